// anydoor-doctor's host readers against made-up /sys and /proc trees: the
// PCIe relation of a GPU and a NIC (one switch, the root complex, two
// sockets), ACS in a bridge's extended config space, memlock, hugepages,
// GPUs on the bus without a driver, the IOMMU, kernel modules.
#include "doctor/host.hpp"

#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
namespace doc = anydoor::apps::doctor;

namespace {

struct fake_host {
  fs::path root;
  doc::roots r;
  fake_host() {
    char tmpl[] = "/tmp/anydoor-doctor-XXXXXX";
    root = ::mkdtemp(tmpl);
    r.sys = (root / "sys").string();
    r.proc = (root / "proc").string();
    fs::create_directories(root / "sys/bus/pci/devices");
    fs::create_directories(root / "proc/self");
  }
  ~fake_host() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
  void write(const std::string& rel, const std::string& text) {
    const fs::path p = root / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  // A PCI function at sys/devices/<chain...>, linked from sys/bus/pci/devices.
  void pci(const std::vector<std::string>& chain, const std::string& numa = "0") {
    fs::path dir = root / "sys/devices";
    for (const auto& c : chain) dir /= c;
    fs::create_directories(dir);
    std::ofstream(dir / "numa_node") << numa << "\n";
    fs::create_symlink(fs::relative(dir, root / "sys/bus/pci/devices"), root / "sys/bus/pci/devices" / chain.back());
  }
};

void put_u32(std::string& cfg, std::size_t at, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) cfg[at + static_cast<std::size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
}

}  // namespace

TEST_CASE("doctor: the PCIe relation of two devices from the sysfs tree", "[apps]") {
  fake_host h;
  // socket 0: root port 00:01.0 -> switch 01:00.0 -> ports 02:08.0, 02:10.0
  h.pci({"pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:08.0", "0000:03:00.0"});  // GPU
  h.pci({"pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:10.0", "0000:04:00.0"});  // NIC, same switch
  h.pci({"pci0000:00", "0000:00:02.0", "0000:05:00.0"});                                  // NIC on another root port
  h.pci({"pci0000:40", "0000:40:01.0", "0000:41:00.0"});                                  // another host bridge, node 0
  h.pci({"pci0000:80", "0000:80:01.0", "0000:81:00.0"}, "1");                             // socket 1
  CHECK(doc::relate_pci(h.r, "0000:03:00.0", "0000:04:00.0") == doc::pcie_relation::same_switch);
  CHECK(doc::relate_pci(h.r, "0000:03:00.0", "0000:05:00.0") == doc::pcie_relation::root_complex);
  CHECK(doc::relate_pci(h.r, "0000:03:00.0", "0000:41:00.0") == doc::pcie_relation::root_complex);
  CHECK(doc::relate_pci(h.r, "0000:03:00.0", "0000:81:00.0") == doc::pcie_relation::across_sockets);
  CHECK(doc::relate_pci(h.r, "0000:03:00.0", "0000:99:00.0") == doc::pcie_relation::unknown);
  const std::vector<std::string> up = doc::upstream_bridges(h.r, "0000:03:00.0");
  CHECK(up == std::vector<std::string>{"0000:02:08.0", "0000:01:00.0", "0000:00:01.0"});
  // Peer-to-peer between the GPU and the NIC on the same switch passes only
  // the switch's two downstream ports; across the root complex, every bridge.
  CHECK(doc::bridges_between(h.r, "0000:03:00.0", "0000:04:00.0") ==
        std::vector<std::string>{"0000:02:08.0", "0000:02:10.0"});
  CHECK(doc::bridges_between(h.r, "0000:03:00.0", "0000:05:00.0") ==
        std::vector<std::string>{"0000:00:01.0", "0000:01:00.0", "0000:02:08.0", "0000:00:02.0"});
  CHECK(doc::bridges_between(h.r, "0000:03:00.0", "0000:81:00.0").empty());  // another host bridge
}

TEST_CASE("doctor: ACS control from a bridge's extended config space", "[apps]") {
  fake_host h;
  h.pci({"pci0000:00", "0000:00:01.0", "0000:01:00.0"});
  h.pci({"pci0000:00", "0000:00:02.0", "0000:02:00.0"});
  h.pci({"pci0000:00", "0000:00:03.0", "0000:03:00.0"});
  std::string cfg(4096, '\0');
  put_u32(cfg, 0x100, 0x0001u | (1u << 16) | (0x140u << 20));  // AER, next 0x140
  put_u32(cfg, 0x140, 0x000du | (1u << 16) | (0u << 20));      // ACS, last
  put_u32(cfg, 0x144, 0x005fu | (0x0015u << 16));              // capability; control: SV, RR, UF
  std::ofstream(h.root / "sys/bus/pci/devices/0000:01:00.0/config", std::ios::binary) << cfg;
  const auto acs = doc::read_acs(h.r, "0000:01:00.0");
  REQUIRE(acs);
  CHECK(acs->request_redirect);
  CHECK_FALSE(acs->completion_redirect);
  CHECK(acs->upstream_forwarding);
  // Only the first 256 bytes (not root): unknown, not "no ACS".
  std::ofstream(h.root / "sys/bus/pci/devices/0000:02:00.0/config", std::ios::binary) << cfg.substr(0, 256);
  CHECK_FALSE(doc::read_acs(h.r, "0000:02:00.0"));
  // A capability list that loops ends (bounded walk).
  std::string loop(4096, '\0');
  put_u32(loop, 0x100, 0x0001u | (0x100u << 20));
  std::ofstream(h.root / "sys/bus/pci/devices/0000:03:00.0/config", std::ios::binary) << loop;
  CHECK_FALSE(doc::read_acs(h.r, "0000:03:00.0"));
}

TEST_CASE("doctor: memlock, hugepages, GPUs on the bus, IOMMU and modules from /proc and /sys", "[apps]") {
  fake_host h;
  h.write("proc/self/limits",
          "Limit                     Soft Limit           Hard Limit           Units\n"
          "Max locked memory         65536                65536                bytes\n");
  h.write("proc/self/status", "Name:\tx\nCapEff:\t0000000000000000\n");
  doc::memlock_limit m = doc::read_memlock(h.r);
  CHECK_FALSE(m.unlimited);
  CHECK(m.bytes == 65536);
  CHECK_FALSE(m.cap_ipc_lock);
  h.write("proc/self/limits", "Max locked memory         unlimited            unlimited            bytes\n");
  h.write("proc/self/status", "CapEff:\t000001ffffffffff\n");
  m = doc::read_memlock(h.r);
  CHECK(m.unlimited);
  CHECK(m.cap_ipc_lock);

  h.write("proc/meminfo", "MemTotal: 1 kB\nHugePages_Total:      16\nHugePages_Free:        8\nHugepagesize:       2048 kB\n");
  h.write("sys/kernel/mm/transparent_hugepage/enabled", "always [madvise] never\n");
  const doc::hugepage_info hp = doc::read_hugepages(h.r);
  CHECK(hp.total == 16);
  CHECK(hp.free == 8);
  CHECK(hp.size_kib == 2048);
  CHECK(hp.thp == "madvise");

  h.pci({"pci0000:00", "0000:00:01.0", "0000:3b:00.0"});
  h.write("sys/devices/pci0000:00/0000:00:01.0/0000:3b:00.0/vendor", "0x10de\n");
  h.write("sys/devices/pci0000:00/0000:00:01.0/0000:3b:00.0/class", "0x030200\n");
  h.pci({"pci0000:00", "0000:00:02.0", "0000:5e:00.0"});
  h.write("sys/devices/pci0000:00/0000:00:02.0/0000:5e:00.0/vendor", "0x15b3\n");  // a ConnectX
  h.write("sys/devices/pci0000:00/0000:00:02.0/0000:5e:00.0/class", "0x020000\n");
  CHECK(doc::nvidia_pci_devices(h.r) == std::vector<std::string>{"0000:3b:00.0"});

  CHECK_FALSE(doc::read_iommu(h.r).enabled);
  h.write("sys/kernel/iommu_groups/0/type", "identity\n");
  h.write("sys/kernel/iommu_groups/1/type", "identity\n");
  CHECK(doc::read_iommu(h.r).enabled);
  CHECK(doc::read_iommu(h.r).passthrough);  // every group identity
  h.write("sys/kernel/iommu_groups/1/type", "DMA-FQ\n");
  CHECK_FALSE(doc::read_iommu(h.r).passthrough);
  fs::create_directories(h.root / "sys/class/iommu/dmar0");
  h.write("proc/cmdline", "BOOT_IMAGE=/vmlinuz root=/dev/sda1 intel_iommu=on iommu=pt quiet\n");
  const doc::iommu_info io = doc::read_iommu(h.r);
  CHECK(io.enabled);
  CHECK(io.passthrough);

  CHECK_FALSE(doc::module_loaded(h.r, "ib_uverbs"));
  CHECK_FALSE(doc::rdma_part_present(h.r, "ib_uverbs"));
  fs::create_directories(h.root / "sys/module/ib_uverbs");
  CHECK(doc::module_loaded(h.r, "ib_uverbs"));
  // Built into the kernel: no module directory, but its class is there.
  CHECK_FALSE(doc::rdma_part_present(h.r, "rdma_ucm"));
  fs::create_directories(h.root / "sys/class/misc/rdma_cm");
  CHECK(doc::rdma_part_present(h.r, "rdma_ucm"));
}
