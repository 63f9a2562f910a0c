// What anydoor-doctor reads off the host besides rdma-core: kernel modules,
// limits, hugepages, GPUs (through the CUDA driver, loaded at run time if
// present), the PCIe tree between GPUs and NICs, IOMMU and ACS. Every
// reader takes the root of /sys and /proc, so the tests can point it at a
// made-up tree.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace anydoor::apps::doctor {

struct roots {
  std::string sys = "/sys";
  std::string proc = "/proc";
};

// The first line of a file, trimmed; nullopt when it cannot be read.
std::optional<std::string> read_first_line(const std::string& path);

bool module_loaded(const roots& r, const std::string& name);
// The RDMA kernel parts, loaded as modules or built in: ib_core (the
// infiniband class), ib_uverbs (infiniband_verbs), rdma_ucm (misc/rdma_cm).
bool rdma_part_present(const roots& r, const std::string& module);

struct memlock_limit {
  bool unlimited = false;
  std::uint64_t bytes = 0;      // the soft limit
  bool cap_ipc_lock = false;    // the process may lock memory beyond it
};
memlock_limit read_memlock(const roots& r);

struct hugepage_info {
  std::uint64_t total = 0, free = 0, size_kib = 0;
  std::string thp;  // transparent hugepages: "always", "madvise", "never" or empty
};
hugepage_info read_hugepages(const roots& r);

// NVIDIA GPUs on the PCI bus (vendor 0x10de, display class), found without
// a driver: their PCI addresses.
std::vector<std::string> nvidia_pci_devices(const roots& r);

struct gpu_entry {
  std::string name;
  std::string pci_address;  // "0000:3b:00.0"
  bool dma_buf = false;     // CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
};
struct cuda_info {
  bool driver_loaded = false;   // libcuda.so.1 opened and cuInit succeeded
  std::string error;            // why not
  int driver_version = 0;       // 13000 = 13.0
  std::vector<gpu_entry> gpus;
};
cuda_info probe_cuda();
// The toolkit's version from CUDA_HOME (or /usr/local/cuda)/version.json;
// empty when there is none.
std::string cuda_toolkit_version(std::string* where);

// How two PCI devices are connected.
enum class pcie_relation {
  same_switch,      // a PCIe bridge below the root port joins them
  root_complex,     // they meet only at the host bridge (same socket)
  across_sockets,   // different host bridges and different NUMA nodes
  unknown,          // a device is not in the tree
};
const char* to_string(pcie_relation r);
pcie_relation relate_pci(const roots& r, const std::string& a, const std::string& b);

// The PCI bridges between a device and its host bridge (nearest first).
std::vector<std::string> upstream_bridges(const roots& r, const std::string& bdf);
// The bridges peer-to-peer traffic between a and b passes through below
// the one where their paths meet (the switch's downstream ports on each
// side): where ACS redirect would send it up to the root complex.
std::vector<std::string> bridges_between(const roots& r, const std::string& a, const std::string& b);

// ACS control of a PCI function, from its config space (root may read the
// extended space). nullopt: no ACS capability, or the space is not readable.
struct acs_control {
  bool request_redirect = false;     // P2P Request Redirect
  bool completion_redirect = false;  // P2P Completion Redirect
  bool upstream_forwarding = false;
};
std::optional<acs_control> read_acs(const roots& r, const std::string& bdf);

// IOMMU groups exist (the IOMMU translates DMA), and whether DMA passes
// through untranslated: every group's type "identity", or iommu=pt /
// iommu.passthrough=1 on the kernel command line.
struct iommu_info {
  bool enabled = false;
  bool passthrough = false;
};
iommu_info read_iommu(const roots& r);

}  // namespace anydoor::apps::doctor
