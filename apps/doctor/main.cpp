// anydoor-doctor: is this host ready for anydoor, and what to fix if not.
//
//   anydoor-doctor [--provider auto|tcp|verbs] [--peer HOST:PORT] [--pool-bytes N]
//                  [--register-bytes N] [--json] [--sysfs DIR] [--procfs DIR]
//   anydoor-doctor --attach HOST:PORT [--interval SECONDS] [--count N] [--top N]
//
// One line per check, "[pass]", "[warn]" or "[fail]", the check's name and
// what was found; each warn and fail is followed by "  fix: ..." (--json:
// one object). Exit code 0 when nothing fails, 1 when a check fails, 2 on a
// bad command line.
#include "attach.hpp"
#include "host.hpp"

#include "common/args.hpp"

#include <anydoor/fabric.hpp>
#include <anydoor/transport/inventory.hpp>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace doc = anydoor::apps::doctor;
namespace tp = anydoor::transport;
using anydoor::apps::arg_scanner;
using anydoor::apps::endpoint;

constexpr const char* kUsage =
    "anydoor-doctor [--provider auto|tcp|verbs] [--peer HOST:PORT] [--pool-bytes N] [--register-bytes N] [--json]\n"
    "               [--sysfs DIR] [--procfs DIR]\n"
    "       anydoor-doctor --attach HOST:PORT [--interval SECONDS] [--count N] [--top N]";

struct options {
  std::string provider = "auto";
  std::optional<endpoint> peer;
  std::uint64_t pool_bytes = anydoor::fabric_options{}.pool_max_bytes;
  std::uint64_t register_bytes = std::uint64_t{64} << 20;
  bool json = false;
  doc::roots roots;
  std::optional<endpoint> attach;  // --attach: the live counters instead of the checks
  doc::attach_options watch;
};

options parse(int argc, char** argv) {
  options o;
  arg_scanner a(argc, argv, 1, kUsage);
  while (a.next()) {
    const std::string_view opt = a.arg();
    if (opt == "--provider") {
      o.provider = std::string(a.value());
      if (o.provider != "auto" && o.provider != "tcp" && o.provider != "verbs") {
        a.fail("--provider takes auto, tcp or verbs, not '" + o.provider + "'");
      }
    } else if (opt == "--peer") {
      endpoint e;
      if (!anydoor::apps::parse_endpoint(a.value(), e) || e.port == 0) a.fail("--peer takes HOST:PORT (port 1..65535)");
      o.peer = e;
    } else if (opt == "--pool-bytes") {
      o.pool_bytes = a.size_value(0, std::uint64_t{1} << 50);
    } else if (opt == "--register-bytes") {
      o.register_bytes = a.size_value(0, std::uint64_t{1} << 50);
    } else if (opt == "--json") {
      o.json = true;
    } else if (opt == "--attach") {
      endpoint e;
      if (!anydoor::apps::parse_endpoint(a.value(), e) || e.port == 0) a.fail("--attach takes HOST:PORT (port 1..65535)");
      o.attach = e;
    } else if (opt == "--interval") {
      if (!anydoor::apps::parse_seconds(a.value(), o.watch.interval) || o.watch.interval < 0.1 ||
          o.watch.interval > 3600) {
        a.fail("--interval takes seconds from 0.1 to 3600");
      }
    } else if (opt == "--count") {
      o.watch.count = a.size_value(1, 1000000);
    } else if (opt == "--top") {
      o.watch.top = static_cast<std::size_t>(a.size_value(1, 100000));
    } else if (opt == "--sysfs") {
      o.roots.sys = std::string(a.value());
    } else if (opt == "--procfs") {
      o.roots.proc = std::string(a.value());
    } else if (opt == "-h" || opt == "--help") {
      std::printf("usage: %s\n", kUsage);
      std::exit(0);
    } else {
      a.fail("unknown option " + std::string(opt));
    }
  }
  return o;
}

enum class verdict { pass, warn, fail };
const char* to_string(verdict v) { return v == verdict::pass ? "pass" : v == verdict::warn ? "warn" : "fail"; }

struct check {
  std::string name;
  verdict v = verdict::pass;
  std::string detail;
  std::string fix;
};

std::string bytes_text(std::uint64_t b) {
  char buf[64];
  if (b == ~std::uint64_t{0}) return "no limit";  // rxe reports 2^64 - 1
  if (b >= (std::uint64_t{1} << 40)) {
    std::snprintf(buf, sizeof buf, "%.1f TiB", static_cast<double>(b) / static_cast<double>(std::uint64_t{1} << 40));
  } else if (b >= (std::uint64_t{1} << 30) && b % (std::uint64_t{1} << 30) == 0) {
    std::snprintf(buf, sizeof buf, "%llu GiB", static_cast<unsigned long long>(b >> 30));
  } else if (b >= (std::uint64_t{1} << 20)) {
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / (1 << 20));
  } else if (b >= 1024) {
    std::snprintf(buf, sizeof buf, "%.1f KiB", static_cast<double>(b) / 1024);
  } else {
    std::snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(b));
  }
  return buf;
}

class doctor {
 public:
  explicit doctor(const options& o) : o_(o) {}

  void run() {
    check_modules();
    check_devices();
    check_memlock();
    check_hugepages();
    if (o_.peer) check_peer();
    check_gpus();
  }
  const std::vector<check>& results() const { return checks_; }

 private:
  void add(std::string name, verdict v, std::string detail, std::string fix = {}) {
    checks_.push_back({std::move(name), v, std::move(detail), std::move(fix)});
  }
  // Missing RDMA pieces fail only when verbs is asked for; with auto the
  // runtime falls back to tcp.
  verdict missing() const { return o_.provider == "verbs" ? verdict::fail : verdict::warn; }

  void check_modules() {
    if (o_.provider == "tcp") {
      add("kernel modules", verdict::pass, "provider tcp needs no RDMA module");
      return;
    }
    std::string loaded, absent, absent_words;
    for (const char* m : {"ib_core", "ib_uverbs", "rdma_ucm"}) {
      const bool here = doc::rdma_part_present(o_.roots, m);
      std::string& to = here ? loaded : absent;
      to += to.empty() ? "" : ", ";
      to += m;
      if (!here) absent_words += std::string(absent_words.empty() ? "" : " ") + m;
    }
    std::string soft;
    for (const char* m : {"rdma_rxe", "siw"}) {
      if (!doc::module_loaded(o_.roots, m)) continue;
      soft += soft.empty() ? "" : ", ";
      soft += m;
    }
    std::string detail = absent.empty() ? "loaded: " + loaded : "not loaded: " + absent;
    if (!soft.empty()) detail += "; software RDMA: " + soft;
    if (absent.empty()) {
      add("kernel modules", verdict::pass, detail);
    } else {
      add("kernel modules", missing(), detail,
          "modprobe -a " + absent_words + " (rdma-core's rdma service loads them at boot; a kernel without InfiniBand "
          "support (CONFIG_INFINIBAND) has none: use --provider tcp)");
    }
  }

  void check_devices() {
    if (o_.provider == "tcp") {
      add("rdma devices", verdict::pass, "provider tcp: connections run over TCP sockets, no RDMA device needed");
      return;
    }
    inv_ = tp::inspect_devices();
    if (!inv_.verbs_built) {
      add("rdma devices", missing(), "this build has no verbs provider (ANYDOOR_WITH_VERBS=OFF)",
          "rebuild with -DANYDOOR_WITH_VERBS=ON (needs libibverbs-dev and librdmacm-dev)");
      return;
    }
    if (inv_.devices.empty()) {
      add("rdma devices", missing(),
          std::string("no RDMA device") + (inv_.error.empty() ? "" : " (" + inv_.error + ")") +
              (doc::rdma_part_present(o_.roots, "ib_core") ? "" : ", and the kernel's RDMA core (ib_core) is not loaded") +
              (o_.provider == "auto" ? ": provider auto will use tcp" : ""),
          "install the NIC's driver (mlx5_ib for ConnectX, irdma for Intel E810, ...); for a test without a NIC, "
          "Soft-RoCE: modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <interface>");
      return;
    }
    std::string names;
    for (const auto& d : inv_.devices) {
      names += names.empty() ? "" : ", ";
      names += d.name;
    }
    add("rdma devices", verdict::pass, std::to_string(inv_.devices.size()) + " found: " + names);
    bool any_active = false;
    for (const auto& d : inv_.devices) {
      if (!d.error.empty()) {
        add("device " + d.name, verdict::fail, d.error,
            "check the permissions of /dev/infiniband/uverbs* (udev: group rdma) and that ib_uverbs is loaded");
        continue;
      }
      std::string where = d.pci_address.empty() ? "software device" : "PCI " + d.pci_address;
      if (d.numa_node >= 0) where += ", NUMA node " + std::to_string(d.numa_node);
      add("device " + d.name, verdict::pass,
          d.transport + ", " + where + ", " + std::to_string(d.ports.size()) + " port(s), max_qp " +
              std::to_string(d.max_qp) + ", max_sge " + std::to_string(d.max_sge) + ", atomics " +
              (d.atomics ? "yes" : "no") + ", SRQ " + (d.max_srq > 0 ? "yes" : "no") + ", memory windows " +
              (d.max_mw > 0 ? "yes" : "no"));
      check_max_mr(d);
      for (const auto& p : d.ports) any_active = check_port(d, p) || any_active;
    }
    active_port_ = any_active;
    if (!any_active) {
      add("active port", missing(), "no device has an active port" +
                                        std::string(o_.provider == "auto" ? ": provider auto will use tcp" : ""),
          "bring a port up (see the port lines above)");
    }
  }

  void check_max_mr(const tp::device_entry& d) {
    const std::string name = "max_mr_size " + d.name;
    const std::uint64_t need = o_.register_bytes;
    if (d.max_mr_size >= need) {
      add(name, verdict::pass, bytes_text(d.max_mr_size) + " >= the largest registration asked for (" +
                                   bytes_text(need) + ", --register-bytes)");
    } else {
      add(name, verdict::warn,
          bytes_text(d.max_mr_size) + " < " + bytes_text(need) +
              " (--register-bytes): anydoor registers such memory in pieces (one region to its user), but a "
              "connection-scoped registration or a kv table that large is refused",
          "keep connection-scoped registrations and the kv store's memory within " + bytes_text(d.max_mr_size));
    }
  }

  // true when the port is active
  bool check_port(const tp::device_entry& d, const tp::port_entry& p) {
    const std::string id = d.name + "/" + std::to_string(p.number);
    const bool iwarp = d.transport == "iWARP";
    const bool roce = p.link_layer == "Ethernet" && !iwarp;
    std::string detail = p.state + ", " + (roce ? "Ethernet (RoCE)" : iwarp ? "iWARP" : "InfiniBand");
    if (!p.netdev.empty()) detail += ", netdev " + p.netdev;
    if (p.state != "active") {
      add("port " + id, missing(), detail,
          roce || iwarp
              ? "bring the link up: ip link set " + (p.netdev.empty() ? std::string("<netdev>") : p.netdev) +
                    " up; check the cable and the switch port"
              : "check the cable, and that a subnet manager runs on the fabric (opensm)");
      return false;
    }
    add("port " + id, verdict::pass, detail);
    // MTU: 4096 is what RDMA NICs do best; RoCE's follows the netdev's.
    std::string mtu = "active " + std::to_string(p.active_mtu) + ", max " + std::to_string(p.max_mtu);
    std::optional<std::string> net_mtu;
    if (!p.netdev.empty()) net_mtu = doc::read_first_line(o_.roots.sys + "/class/net/" + p.netdev + "/mtu");
    if (net_mtu) mtu += ", netdev " + *net_mtu;
    if (p.active_mtu >= 4096 || p.active_mtu >= p.max_mtu) {
      add("mtu " + id, verdict::pass, mtu);
    } else {
      add("mtu " + id, verdict::warn, mtu + ": large transfers move in smaller packets",
          roce || iwarp ? "raise the netdev MTU (RoCE 4096 needs about 4200; 9000 with jumbo frames on the switch): "
                          "ip link set " + p.netdev + " mtu 9000"
                        : "set the port MTU in the subnet manager's partition configuration");
    }
    // GID: the one rdma_cm is expected to use (RoCE: a v2 GID with an IPv4
    // address); iWARP addresses by IP alone.
    const char* forced = std::getenv("ANYDOOR_GID_INDEX");
    if (iwarp) {
      add("gid " + id, verdict::pass, "iWARP: rdma_cm connects by IP address (" + std::to_string(p.gids.size()) +
                                          " GIDs, none needed)");
    } else if (forced != nullptr && *forced != '\0') {
      const tp::gid_entry* g = nullptr;
      char* end = nullptr;
      const long want = std::strtol(forced, &end, 10);  // as the verbs provider reads it
      for (const auto& e : p.gids) {
        if (end != forced && *end == '\0' && want >= 0 && static_cast<long>(e.index) == want) g = &e;
      }
      if (g != nullptr && g->type == "RoCE v2" && !g->ipv4.empty()) {
        add("gid " + id, verdict::pass, std::string("index ") + forced + " (RoCE v2, " + g->ipv4 +
                                            ") forced by ANYDOOR_GID_INDEX");
      } else {
        add("gid " + id, verdict::fail,
            std::string("ANYDOOR_GID_INDEX=") + forced + " names " +
                (g == nullptr ? "no GID of this port" : "a GID that is not RoCE v2 with an IPv4 address") +
                ": the verbs provider refuses to open the device",
            "unset ANYDOOR_GID_INDEX, or name a RoCE v2 GID with an IPv4 address (see `rdma link`, "
            "/sys/class/infiniband/" + d.name + "/ports/" + std::to_string(p.number) + "/gid_attrs/types)");
      }
    } else if (p.preferred_gid >= 0) {
      const tp::gid_entry* g = nullptr;
      for (const auto& e : p.gids) {
        if (static_cast<int>(e.index) == p.preferred_gid) g = &e;
      }
      std::string what = "index " + std::to_string(p.preferred_gid);
      if (g != nullptr) what += " (" + g->type + (g->ipv4.empty() ? ", " + g->gid : ", " + g->ipv4) + ")";
      add("gid " + id, verdict::pass, what + " is the one anydoor expects rdma_cm to use (" +
                                          std::to_string(p.gids.size()) + " GIDs; ANYDOOR_GID_INDEX forces one)");
    } else if (roce) {
      bool v1_only = false;
      for (const auto& e : p.gids) v1_only = v1_only || e.type == "RoCE v1";
      add("gid " + id, verdict::fail,
          std::to_string(p.gids.size()) + " GIDs, none RoCE v2 with an IPv4 address" +
              (v1_only ? " (RoCE v1 only)" : ""),
          "give " + (p.netdev.empty() ? std::string("the port's netdev") : p.netdev) +
              " an IPv4 address (ip addr add ADDR/LEN dev " + (p.netdev.empty() ? std::string("<netdev>") : p.netdev) +
              "); rdma_cm finds the GID through it");
    } else {
      add("gid " + id, verdict::fail, "the GID table is empty", "check the port and the subnet manager");
    }
    if (roce && !p.netdev.empty()) check_ecn(id, p.netdev);
    return true;
  }

  void check_ecn(const std::string& id, const std::string& netdev) {
    // mlx5 exposes RoCE congestion control per priority here; PFC needs
    // DCB netlink (dcb pfc show / mlnx_qos), which sysfs does not show.
    const std::string dir = o_.roots.sys + "/class/net/" + netdev + "/ecn/roce_np/enable/";
    std::string on;
    bool readable = false;
    for (int prio = 0; prio < 8; ++prio) {
      if (auto v = doc::read_first_line(dir + std::to_string(prio))) {
        readable = true;
        if (*v == "1") on += (on.empty() ? "" : ",") + std::to_string(prio);
      }
    }
    if (!readable) {
      add("ecn " + id, verdict::pass,
          "not exposed by " + netdev + "'s driver (PFC: check with `dcb pfc show dev " + netdev + "`)");
    } else if (on.empty()) {
      add("ecn " + id, verdict::warn, "RoCE ECN (notification point) is off on every priority",
          "echo 1 > " + dir + "<priority> for the RoCE traffic class, with ECN marking on the switch");
    } else {
      add("ecn " + id, verdict::pass, "RoCE ECN on for priorities " + on);
    }
  }

  void check_memlock() {
    const doc::memlock_limit m = doc::read_memlock(o_.roots);
    const std::uint64_t need = o_.pool_bytes + o_.register_bytes;
    const std::string want = bytes_text(need) + " (--pool-bytes " + bytes_text(o_.pool_bytes) + " + --register-bytes " +
                             bytes_text(o_.register_bytes) + ")";
    if (o_.provider == "tcp") {
      add("memlock", verdict::pass, "provider tcp pins no memory");
    } else if (tcp_in_effect()) {
      add("memlock", verdict::pass, "provider auto will use tcp here, which pins no memory (the limit is " +
                                        (m.unlimited ? std::string("unlimited") : bytes_text(m.bytes)) + ")");
    } else if (m.unlimited) {
      add("memlock", verdict::pass, "unlimited");
    } else if (m.bytes >= need) {
      add("memlock", verdict::pass, bytes_text(m.bytes) + " >= " + want);
    } else if (m.cap_ipc_lock) {
      add("memlock", verdict::pass, bytes_text(m.bytes) + " < " + want + ", but the process has CAP_IPC_LOCK (root)");
    } else {
      add("memlock", verdict::fail, bytes_text(m.bytes) + " < " + want + ": registrations beyond it fail (ENOMEM)",
          "raise it: ulimit -l unlimited; for services LimitMEMLOCK=infinity (systemd) or "
          "'* - memlock unlimited' in /etc/security/limits.conf");
    }
  }

  void check_hugepages() {
    const doc::hugepage_info h = doc::read_hugepages(o_.roots);
    std::string detail = std::to_string(h.total) + " reserved (" + std::to_string(h.free) + " free) of " +
                         std::to_string(h.size_kib) + " KiB; transparent hugepages: " +
                         (h.thp.empty() ? std::string("unknown") : h.thp);
    if (h.thp == "never" && h.total == 0) {
      add("hugepages", verdict::warn, detail + ": large registrations pin 4 KiB pages (more NIC translation entries)",
          "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled, or reserve hugepages (vm.nr_hugepages)");
    } else {
      add("hugepages", verdict::pass, detail);
    }
  }

  void check_peer() {
    const std::string name = "peer " + o_.peer->str();
    if (o_.provider == "tcp") {
      add(name, verdict::pass, "provider tcp: reachability is a TCP connect (not tried here)");
      return;
    }
    const tp::route_result r = tp::resolve_route(o_.peer->host, o_.peer->port);
    if (r.ok) {
      add(name, verdict::pass, "rdma_cm routes it through " + r.device + " port " + std::to_string(r.port) +
                                   (r.source.empty() ? "" : " from " + r.source));
    } else {
      add(name, o_.provider == "auto" && tcp_in_effect() ? verdict::warn : verdict::fail,
          r.error + (o_.provider == "auto" && tcp_in_effect() ? " (provider auto will use tcp here)" : ""),
          "the peer's address must be reachable through an RDMA device's netdev: `ip route get " + o_.peer->host +
              "` should name an interface with a GID (see the gid lines); for IB, IPoIB must be up");
    }
  }

  void check_gpus() {
    const std::vector<std::string> on_bus = doc::nvidia_pci_devices(o_.roots);
    const doc::cuda_info cu = doc::probe_cuda();
    std::string where;
    const std::string toolkit = doc::cuda_toolkit_version(&where);
    const std::string tk = toolkit.empty() ? "no CUDA toolkit at " + where : "CUDA toolkit " + toolkit + " at " + where;
    if (!cu.driver_loaded) {
      // GPU memory is optional (and not in anydoor yet): these checks
      // warn, never fail.
      if (on_bus.empty()) {
        add("gpu", verdict::pass, "no NVIDIA GPU on the PCI bus: GPU memory checks skipped (" + cu.error + "; " + tk + ")");
      } else {
        add("gpu", verdict::warn, std::to_string(on_bus.size()) + " NVIDIA GPU(s) on the PCI bus but " + cu.error,
            "install the NVIDIA driver (nvidia-smi must list the GPUs) to use GPU memory");
      }
      return;
    }
    const int v = cu.driver_version;
    std::string list;
    for (const auto& g : cu.gpus) {
      list += list.empty() ? "" : "; ";
      list += g.name + " at " + g.pci_address;
    }
    add("gpu", cu.gpus.empty() ? verdict::warn : verdict::pass,
        "CUDA driver " + std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10) + ", " + tk + ", " +
            std::to_string(cu.gpus.size()) + " GPU(s)" + (list.empty() ? "" : ": " + list),
        cu.gpus.empty() ? "the driver sees no GPU: check nvidia-smi and dmesg" : "");
    if (cu.gpus.empty()) return;
    // How the NIC reaches GPU memory: dma-buf (kernel >= 5.12, open driver)
    // or the nvidia-peermem module.
    bool all_dma_buf = true;
    for (const auto& g : cu.gpus) all_dma_buf = all_dma_buf && g.dma_buf;
    const bool peermem = doc::module_loaded(o_.roots, "nvidia_peermem");
    if (all_dma_buf || peermem) {
      add("gpudirect", verdict::pass,
          std::string(all_dma_buf ? "dma-buf supported" : "dma-buf not supported by every GPU") +
              (peermem ? "; nvidia_peermem loaded" : ""));
    } else {
      add("gpudirect", verdict::warn,
          "no dma-buf support and nvidia_peermem is not loaded: the NIC cannot reach GPU memory (anydoor stages "
          "GPU transfers through host memory instead)",
          "modprobe nvidia-peermem, or use the open kernel driver on Linux >= 5.12 (dma-buf)");
    }
    const doc::iommu_info io = doc::read_iommu(o_.roots);
    if (io.enabled && !io.passthrough) {
      add("iommu", verdict::warn, "the IOMMU translates DMA: peer-to-peer from the NIC to GPU memory may be slow or blocked",
          "boot with iommu=pt (passthrough), or turn the IOMMU off for the GPUs and NICs");
    } else {
      add("iommu", verdict::pass, io.enabled ? "on, passthrough (iommu=pt)" : "off");
    }
    for (const auto& g : cu.gpus) {
      for (const auto& d : inv_.devices) {
        if (d.pci_address.empty() || g.pci_address.empty()) continue;
        check_path(g, d);
      }
    }
  }

  void check_path(const doc::gpu_entry& g, const tp::device_entry& d) {
    const std::string name = "pcie " + g.pci_address + " <-> " + d.name;
    const doc::pcie_relation rel = doc::relate_pci(o_.roots, g.pci_address, d.pci_address);
    const std::string detail = std::string("GPU and NIC are ") + doc::to_string(rel);
    if (rel == doc::pcie_relation::same_switch) {
      // ACS redirecting peer-to-peer on the switch sends it up to the root
      // complex anyway.
      std::string redirecting;
      for (const auto& b : doc::bridges_between(o_.roots, g.pci_address, d.pci_address)) {
        if (auto acs = doc::read_acs(o_.roots, b); acs && (acs->request_redirect || acs->completion_redirect)) {
          redirecting += (redirecting.empty() ? "" : ", ") + b;
        }
      }
      if (redirecting.empty()) {
        add(name, verdict::pass, detail);
      } else {
        add(name, verdict::warn, detail + ", but ACS redirects peer-to-peer to the root complex on " + redirecting,
            "disable ACS P2P redirect on those bridges (setpci -s BRIDGE ECAP_ACS+6.w=0000) or boot with "
            "pcie_acs_override");
      }
    } else if (rel == doc::pcie_relation::unknown) {
      add(name, verdict::warn, "the PCIe path could not be read from sysfs", "check /sys/bus/pci/devices");
    } else {
      add(name, verdict::warn, detail + ": GPUDirect RDMA bandwidth suffers",
          "put the GPU and the NIC under one PCIe switch, or use the NIC nearest the GPU (nvidia-smi topo -m)");
    }
  }

  // Where the runtime would not use verbs: provider tcp, or auto without
  // an active RDMA port.
  bool tcp_in_effect() const { return o_.provider == "tcp" || (o_.provider == "auto" && !active_port_); }

  const options& o_;
  std::vector<check> checks_;
  tp::device_inventory inv_;
  bool active_port_ = false;
};

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

}  // namespace

int main(int argc, char** argv) {
  options o = parse(argc, argv);
  if (o.attach) {
    o.watch.host = o.attach->host;
    o.watch.port = o.attach->port;
    return doc::attach(o.watch);
  }
  doctor d(o);
  d.run();
  int counts[3] = {0, 0, 0};
  for (const auto& c : d.results()) ++counts[static_cast<int>(c.v)];
  const verdict overall = counts[2] > 0 ? verdict::fail : counts[1] > 0 ? verdict::warn : verdict::pass;
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  if (o.json) {
    std::string out = "{\"host\":" + json_string(host) + ",\"provider\":" + json_string(o.provider) + ",\"checks\":[";
    bool first = true;
    for (const auto& c : d.results()) {
      out += first ? "" : ",";
      first = false;
      out += "{\"check\":" + json_string(c.name) + ",\"verdict\":\"" + to_string(c.v) +
             "\",\"detail\":" + json_string(c.detail) + ",\"fix\":" + json_string(c.fix) + "}";
    }
    out += "],\"pass\":" + std::to_string(counts[0]) + ",\"warn\":" + std::to_string(counts[1]) +
           ",\"fail\":" + std::to_string(counts[2]) + ",\"verdict\":\"" + to_string(overall) + "\"}";
    std::printf("%s\n", out.c_str());
  } else {
    std::printf("anydoor-doctor on %s (provider %s)\n", host, o.provider.c_str());
    for (const auto& c : d.results()) {
      std::printf("[%s] %s: %s\n", to_string(c.v), c.name.c_str(), c.detail.c_str());
      if (c.v != verdict::pass && !c.fix.empty()) std::printf("       fix: %s\n", c.fix.c_str());
    }
    std::printf("%d pass, %d warn, %d fail: %s\n", counts[0], counts[1], counts[2],
                overall == verdict::fail ? "not ready" : overall == verdict::warn ? "ready, with warnings" : "ready");
  }
  return overall == verdict::fail ? 1 : 0;
}
