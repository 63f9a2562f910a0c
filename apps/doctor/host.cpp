#include "host.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

namespace anydoor::apps::doctor {

namespace fs = std::filesystem;

std::optional<std::string> read_first_line(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::string s;
  std::getline(in, s);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  return s;
}

bool module_loaded(const roots& r, const std::string& name) {
  std::error_code ec;
  return fs::is_directory(r.sys + "/module/" + name, ec);
}

bool rdma_part_present(const roots& r, const std::string& module) {
  if (module_loaded(r, module)) return true;
  std::error_code ec;
  if (module == "ib_core") return fs::is_directory(r.sys + "/class/infiniband", ec);
  if (module == "ib_uverbs") return fs::is_directory(r.sys + "/class/infiniband_verbs", ec);
  if (module == "rdma_ucm") return fs::exists(r.sys + "/class/misc/rdma_cm", ec);
  return false;
}

memlock_limit read_memlock(const roots& r) {
  memlock_limit m;
  std::ifstream limits(r.proc + "/self/limits");
  for (std::string line; std::getline(limits, line);) {
    if (line.rfind("Max locked memory", 0) != 0) continue;
    std::istringstream in(line.substr(std::strlen("Max locked memory")));
    std::string soft;
    in >> soft;
    if (soft == "unlimited") {
      m.unlimited = true;
    } else {
      m.bytes = std::strtoull(soft.c_str(), nullptr, 10);
    }
  }
  std::ifstream status(r.proc + "/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("CapEff:", 0) != 0) continue;
    const std::uint64_t caps = std::strtoull(line.c_str() + 7, nullptr, 16);
    m.cap_ipc_lock = (caps >> 14) & 1;  // CAP_IPC_LOCK
  }
  return m;
}

hugepage_info read_hugepages(const roots& r) {
  hugepage_info h;
  std::ifstream meminfo(r.proc + "/meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    auto value = [&](const char* key) -> std::optional<std::uint64_t> {
      if (line.rfind(key, 0) != 0) return std::nullopt;
      return std::strtoull(line.c_str() + std::strlen(key), nullptr, 10);
    };
    if (auto v = value("HugePages_Total:")) h.total = *v;
    if (auto v = value("HugePages_Free:")) h.free = *v;
    if (auto v = value("Hugepagesize:")) h.size_kib = *v;
  }
  // "always [madvise] never": the bracketed one is in effect.
  if (auto thp = read_first_line(r.sys + "/kernel/mm/transparent_hugepage/enabled")) {
    const auto open = thp->find('['), close = thp->find(']');
    if (open != std::string::npos && close != std::string::npos && close > open) {
      h.thp = thp->substr(open + 1, close - open - 1);
    }
  }
  return h;
}

std::vector<std::string> nvidia_pci_devices(const roots& r) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(r.sys + "/bus/pci/devices", ec)) {
    const std::string dir = e.path().string();
    const auto vendor = read_first_line(dir + "/vendor");
    const auto cls = read_first_line(dir + "/class");
    // 0x0300xx: VGA controller; 0x0302xx: 3D controller (compute GPUs)
    if (vendor && *vendor == "0x10de" && cls && (cls->rfind("0x0300", 0) == 0 || cls->rfind("0x0302", 0) == 0)) {
      out.push_back(e.path().filename().string());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

cuda_info probe_cuda() {
  cuda_info c;
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    c.error = "libcuda.so.1 not found (no NVIDIA driver)";
    return c;
  }
  using init_fn = int (*)(unsigned);
  using int_fn = int (*)(int*);
  using get_fn = int (*)(int*, int);
  using str_fn = int (*)(char*, int, int);
  using attr_fn = int (*)(int*, int, int);
  auto sym = [&](const char* name) { return ::dlsym(lib, name); };
  auto cu_init = reinterpret_cast<init_fn>(sym("cuInit"));
  auto cu_version = reinterpret_cast<int_fn>(sym("cuDriverGetVersion"));
  auto cu_count = reinterpret_cast<int_fn>(sym("cuDeviceGetCount"));
  auto cu_get = reinterpret_cast<get_fn>(sym("cuDeviceGet"));
  auto cu_name = reinterpret_cast<str_fn>(sym("cuDeviceGetName"));
  auto cu_bus = reinterpret_cast<str_fn>(sym("cuDeviceGetPCIBusId"));
  auto cu_attr = reinterpret_cast<attr_fn>(sym("cuDeviceGetAttribute"));
  if (!cu_init || !cu_version || !cu_count || !cu_get || !cu_name || !cu_bus || !cu_attr) {
    c.error = "libcuda.so.1 lacks the driver API's entry points";
    ::dlclose(lib);
    return c;
  }
  if (int rc = cu_init(0); rc != 0) {
    c.error = "cuInit failed with CUresult " + std::to_string(rc) + " (is the kernel module loaded? nvidia-smi)";
    ::dlclose(lib);
    return c;
  }
  c.driver_loaded = true;
  cu_version(&c.driver_version);
  int n = 0;
  cu_count(&n);
  for (int i = 0; i < n; ++i) {
    int dev = 0;
    if (cu_get(&dev, i) != 0) continue;
    gpu_entry g;
    char buf[256] = {};
    if (cu_name(buf, sizeof buf, dev) == 0) g.name = buf;
    char bus[64] = {};
    if (cu_bus(bus, sizeof bus, dev) == 0) {
      g.pci_address = bus;
      std::transform(g.pci_address.begin(), g.pci_address.end(), g.pci_address.begin(),
                     [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
    }
    int dma_buf = 0;
    constexpr int kDmaBufSupported = 124;  // CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
    if (cu_attr(&dma_buf, kDmaBufSupported, dev) == 0) g.dma_buf = dma_buf != 0;
    c.gpus.push_back(std::move(g));
  }
  // (libcuda stays loaded: unloading a driver library at exit buys nothing)
  return c;
}

std::string cuda_toolkit_version(std::string* where) {
  const char* home = std::getenv("CUDA_HOME");
  const std::string dir = home != nullptr && *home != '\0' ? home : "/usr/local/cuda";
  if (where != nullptr) *where = dir;
  std::ifstream in(dir + "/version.json");
  if (!in) {
    // Toolkits without version.json (pip wheels, some distributions): the
    // runtime header's CUDART_VERSION, 13000 = 13.0.
    std::ifstream h(dir + "/include/cuda_runtime_api.h");
    for (std::string line; std::getline(h, line);) {
      std::istringstream words(line);
      std::string define, name;
      long v = 0;
      if (words >> define >> name >> v && define == "#define" && name == "CUDART_VERSION" && v > 0) {
        return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
      }
    }
    return {};
  }
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // {"cuda" : {"name" : "CUDA SDK", "version" : "13.0.48"}, ...}
  auto at = text.find("\"cuda\"");
  if (at == std::string::npos) return {};
  at = text.find("\"version\"", at);
  if (at == std::string::npos) return {};
  const auto colon = text.find(':', at);
  if (colon == std::string::npos) return {};
  const auto open = text.find('"', colon + 1);
  const auto close = open == std::string::npos ? open : text.find('"', open + 1);
  if (close == std::string::npos) return {};
  return text.substr(open + 1, close - open - 1);
}

const char* to_string(pcie_relation r) {
  switch (r) {
    case pcie_relation::same_switch: return "under one PCIe switch";
    case pcie_relation::root_complex: return "across the root complex";
    case pcie_relation::across_sockets: return "across CPU sockets";
    case pcie_relation::unknown: return "unknown";
  }
  return "unknown";
}

namespace {

// The device's path below /sys/devices: host bridge first ("pci0000:00"),
// then each bridge, then the device. Empty when it is not there.
std::vector<std::string> pci_chain(const roots& r, const std::string& bdf) {
  std::error_code ec;
  const fs::path real = fs::canonical(r.sys + "/bus/pci/devices/" + bdf, ec);
  if (ec) return {};
  std::vector<std::string> parts;
  bool in = false;
  for (const auto& part : real) {
    const std::string s = part.string();
    if (!in && s.rfind("pci", 0) == 0 && s.size() > 3 && s.find(':') != std::string::npos) in = true;
    if (in) parts.push_back(s);
  }
  return parts;
}

std::optional<int> numa_of(const roots& r, const std::string& bdf) {
  const auto s = read_first_line(r.sys + "/bus/pci/devices/" + bdf + "/numa_node");
  if (!s || s->empty()) return std::nullopt;
  return std::atoi(s->c_str());
}

}  // namespace

pcie_relation relate_pci(const roots& r, const std::string& a, const std::string& b) {
  const auto ca = pci_chain(r, a), cb = pci_chain(r, b);
  if (ca.size() < 2 || cb.size() < 2) return pcie_relation::unknown;
  if (ca.front() != cb.front()) {
    const auto na = numa_of(r, a), nb = numa_of(r, b);
    return na && nb && *na >= 0 && *nb >= 0 && *na != *nb ? pcie_relation::across_sockets
                                                           : pcie_relation::root_complex;
  }
  // Each chain: host bridge, bridges (a root port first), the device. The
  // bridges both lie below: one or more, and traffic between them turns
  // around below the root complex.
  const std::size_t bridges_a = ca.size() - 2, bridges_b = cb.size() - 2;
  std::size_t common = 0;
  while (common < bridges_a && common < bridges_b && ca[common + 1] == cb[common + 1]) ++common;
  return common >= 1 ? pcie_relation::same_switch : pcie_relation::root_complex;
}

std::vector<std::string> upstream_bridges(const roots& r, const std::string& bdf) {
  auto chain = pci_chain(r, bdf);
  if (chain.size() < 2) return {};
  std::vector<std::string> out(chain.begin() + 1, chain.end() - 1);
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string> bridges_between(const roots& r, const std::string& a, const std::string& b) {
  const auto ca = pci_chain(r, a), cb = pci_chain(r, b);
  if (ca.size() < 2 || cb.size() < 2 || ca.front() != cb.front()) return {};
  std::size_t common = 0;  // bridges shared (after the host bridge)
  while (common + 2 < ca.size() && common + 2 < cb.size() && ca[common + 1] == cb[common + 1]) ++common;
  std::vector<std::string> out;
  for (std::size_t i = common + 1; i + 1 < ca.size(); ++i) out.push_back(ca[i]);
  for (std::size_t i = common + 1; i + 1 < cb.size(); ++i) out.push_back(cb[i]);
  return out;
}

std::optional<acs_control> read_acs(const roots& r, const std::string& bdf) {
  std::ifstream in(r.sys + "/bus/pci/devices/" + bdf + "/config", std::ios::binary);
  if (!in) return std::nullopt;
  const std::string cfg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (cfg.size() <= 0x100) return std::nullopt;  // only root reads the extended space
  auto u32 = [&](std::size_t at) {
    std::uint32_t v = 0;
    for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(cfg[at + static_cast<std::size_t>(i)]);
    return v;
  };
  std::size_t at = 0x100;
  for (int hops = 0; hops < 64 && at >= 0x100 && at + 8 <= cfg.size(); ++hops) {
    const std::uint32_t h = u32(at);
    if (h == 0 || h == 0xffffffffu) break;
    if ((h & 0xffff) == 0x000d) {  // Access Control Services
      const std::uint32_t ctrl = u32(at + 4) >> 16;
      return acs_control{(ctrl & 0x4) != 0, (ctrl & 0x8) != 0, (ctrl & 0x10) != 0};
    }
    at = (h >> 20) & 0xffc;
  }
  return std::nullopt;
}

iommu_info read_iommu(const roots& r) {
  iommu_info i;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(r.sys + "/class/iommu", ec)) {
    (void)e;
    i.enabled = true;
    break;
  }
  if (!i.enabled) {
    for (const auto& e : fs::directory_iterator(r.sys + "/kernel/iommu_groups", ec)) {
      (void)e;
      i.enabled = true;
      break;
    }
  }
  if (auto cmd = read_first_line(r.proc + "/cmdline")) {
    std::istringstream words(*cmd);
    for (std::string w; words >> w;) {
      if (w == "iommu=pt" || w == "iommu.passthrough=1") i.passthrough = true;
    }
  }
  // The default domain type each group got (identity: passthrough).
  bool any = false, all_identity = true;
  for (const auto& e : fs::directory_iterator(r.sys + "/kernel/iommu_groups", ec)) {
    if (auto t = read_first_line(e.path().string() + "/type")) {
      any = true;
      all_identity = all_identity && *t == "identity";
    }
  }
  if (any && all_identity) i.passthrough = true;
  return i;
}

}  // namespace anydoor::apps::doctor
