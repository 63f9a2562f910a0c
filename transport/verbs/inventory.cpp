// transport::inspect_devices and transport::resolve_route (inventory.hpp):
// rdma-core's view of the host, for anydoor-doctor. Without
// ANYDOOR_WITH_VERBS both say the library was built without verbs.
#include <anydoor/transport/inventory.hpp>

#ifdef ANYDOOR_HAVE_VERBS
#include "verbs/verbs_util.hpp"

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <arpa/inet.h>
#include <net/if.h>
#include <netdb.h>
#include <poll.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#endif

namespace anydoor::transport {

#ifdef ANYDOOR_HAVE_VERBS
namespace {

std::string read_line(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

// "0000:3b:00.0": a PCI address.
bool looks_like_pci(const std::string& s) {
  return s.size() == 12 && s[4] == ':' && s[7] == ':' && s[10] == '.';
}

std::uint32_t mtu_bytes(ibv_mtu m) {
  return m >= IBV_MTU_256 && m <= IBV_MTU_4096 ? 128u << static_cast<int>(m) : 0;
}

std::string ipv4_of(const ibv_gid& g) {
  const bool mapped = std::all_of(g.raw, g.raw + 10, [](std::uint8_t b) { return b == 0; }) && g.raw[10] == 0xff &&
                      g.raw[11] == 0xff;
  if (!mapped) return {};
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, g.raw + 12, buf, sizeof buf);
  return buf;
}

std::string gid_type_name(std::uint32_t t) {
  switch (t) {
    case IBV_GID_TYPE_IB: return "IB";
    case IBV_GID_TYPE_ROCE_V1: return "RoCE v1";
    case IBV_GID_TYPE_ROCE_V2: return "RoCE v2";
    default: return "type " + std::to_string(t);
  }
}

void inspect_port(ibv_context* ctx, std::uint8_t number, port_entry& p) {
  ibv_port_attr a{};
  if (ibv_query_port(ctx, number, &a) != 0) {
    p.state = std::string("unknown (ibv_query_port: ") + std::strerror(errno) + ")";
    return;
  }
  // "PORT_ACTIVE" -> "active"
  std::string st = ibv_port_state_str(a.state);
  if (st.rfind("PORT_", 0) == 0) st.erase(0, 5);
  for (char& ch : st) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  p.state = st;
  p.link_layer = a.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand";
  p.active_mtu = mtu_bytes(a.active_mtu);
  p.max_mtu = mtu_bytes(a.max_mtu);
  for (int i = 0; i < a.gid_tbl_len; ++i) {
    ibv_gid_entry e{};
    if (ibv_query_gid_ex(ctx, number, static_cast<std::uint32_t>(i), &e, 0) != 0) continue;  // an empty slot
    if (std::all_of(e.gid.raw, e.gid.raw + 16, [](std::uint8_t b) { return b == 0; })) continue;
    gid_entry g;
    g.index = static_cast<std::uint32_t>(i);
    char buf[INET6_ADDRSTRLEN] = {};
    inet_ntop(AF_INET6, e.gid.raw, buf, sizeof buf);
    g.gid = buf;
    g.type = gid_type_name(e.gid_type);
    g.ipv4 = ipv4_of(e.gid);
    char name[IF_NAMESIZE] = {};
    if (e.ndev_ifindex != 0 && if_indextoname(e.ndev_ifindex, name) != nullptr) g.netdev = name;
    if (p.netdev.empty()) p.netdev = g.netdev;
    // The verbs provider's choice (verbs_device.cpp): the first RoCE v2
    // GID with an IPv4 address.
    if (p.preferred_gid < 0 && e.gid_type == IBV_GID_TYPE_ROCE_V2 && !g.ipv4.empty()) p.preferred_gid = i;
    p.gids.push_back(std::move(g));
  }
  if (p.link_layer == "InfiniBand" && !p.gids.empty() && p.preferred_gid < 0) {
    p.preferred_gid = static_cast<int>(p.gids.front().index);  // IB: the port GID
  }
}

}  // namespace

device_inventory inspect_devices() {
  device_inventory inv;
  inv.verbs_built = true;
  int count = 0;
  errno = 0;
  ibv_device** list = ibv_get_device_list(&count);
  if (list == nullptr) {
    inv.error = std::string("ibv_get_device_list: ") + std::strerror(errno != 0 ? errno : ENODEV);
    return inv;
  }
  for (int i = 0; i < count; ++i) {
    device_entry d;
    d.name = ibv_get_device_name(list[i]);
    d.transport = list[i]->transport_type == IBV_TRANSPORT_IWARP ? "iWARP" : "InfiniBand";
    const std::string sys = std::string("/sys/class/infiniband/") + d.name + "/device";
    std::error_code ec;
    const auto real = std::filesystem::canonical(sys, ec);
    if (!ec && looks_like_pci(real.filename().string())) d.pci_address = real.filename().string();
    const std::string numa = read_line(sys + "/numa_node");
    if (!numa.empty()) d.numa_node = std::atoi(numa.c_str());
    ibv_context* ctx = ibv_open_device(list[i]);
    if (ctx == nullptr) {
      d.error = std::string("ibv_open_device: ") + std::strerror(errno);
      inv.devices.push_back(std::move(d));
      continue;
    }
    ibv_device_attr a{};
    if (ibv_query_device(ctx, &a) != 0) {
      d.error = std::string("ibv_query_device: ") + std::strerror(errno);
    } else {
      d.max_mr_size = a.max_mr_size;
      d.max_qp = static_cast<std::uint32_t>(a.max_qp);
      d.max_qp_wr = static_cast<std::uint32_t>(a.max_qp_wr);
      d.max_cqe = static_cast<std::uint32_t>(a.max_cqe);
      d.max_sge = static_cast<std::uint32_t>(a.max_sge);
      d.max_mr = static_cast<std::uint32_t>(a.max_mr);
      d.max_srq = static_cast<std::uint32_t>(a.max_srq);
      d.max_mw = static_cast<std::uint32_t>(a.max_mw);
      d.atomics = a.atomic_cap != IBV_ATOMIC_NONE;
      for (int port = 1; port <= a.phys_port_cnt; ++port) {
        port_entry p;
        p.number = static_cast<std::uint8_t>(port);
        inspect_port(ctx, p.number, p);
        d.ports.push_back(std::move(p));
      }
    }
    ibv_close_device(ctx);
    inv.devices.push_back(std::move(d));
  }
  ibv_free_device_list(list);
  return inv;
}

route_result resolve_route(const std::string& host, std::uint16_t port, std::chrono::milliseconds timeout) {
  route_result r;
  rdma_addrinfo hints{};
  hints.ai_port_space = RDMA_PS_TCP;
  rdma_addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  errno = 0;
  if (const int rc = rdma_getaddrinfo(host.c_str(), service.c_str(), &hints, &res); rc != 0 || res == nullptr) {
    // (EAI codes, or -1 with errno)
    r.error = "cannot resolve '" + host + "' (rdma_getaddrinfo: " +
              (rc == -1 || errno != 0 ? std::string(std::strerror(errno != 0 ? errno : ENODEV)) : gai_strerror(rc)) +
              ")";
    return r;
  }
  rdma_event_channel* ch = rdma_create_event_channel();
  rdma_cm_id* id = nullptr;
  if (ch == nullptr || rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP) != 0) {
    r.error = std::string(ch == nullptr ? "rdma_create_event_channel: " : "rdma_create_id: ") + std::strerror(errno) +
              " (is rdma_ucm loaded and /dev/infiniband/rdma_cm there?)";
    rdma_freeaddrinfo(res);
    if (ch != nullptr) rdma_destroy_event_channel(ch);
    return r;
  }
  verbs::detail::set_nonblocking(ch->fd);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const int ms = static_cast<int>(std::max<long long>(timeout.count(), 1));
  // Waits for one event; returns its type (or -1 with r.error set).
  auto wait_event = [&](const char* step) -> int {
    for (;;) {
      rdma_cm_event* ev = nullptr;
      if (rdma_get_cm_event(ch, &ev) == 0) {
        const int type = ev->event;
        const int status = ev->status;
        rdma_ack_cm_event(ev);
        if (type == RDMA_CM_EVENT_ADDR_ERROR || type == RDMA_CM_EVENT_ROUTE_ERROR) {
          r.error = std::string(step) + ": " + rdma_event_str(static_cast<rdma_cm_event_type>(type)) + " (" +
                    std::strerror(status < 0 ? -status : status) + ")";
          return -1;
        }
        return type;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        r.error = std::string(step) + ": rdma_get_cm_event: " + std::strerror(errno);
        return -1;
      }
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
      if (left <= 0) {
        r.error = std::string(step) + ": no answer within " + std::to_string(timeout.count()) + " ms";
        return -1;
      }
      pollfd p{ch->fd, POLLIN, 0};
      ::poll(&p, 1, static_cast<int>(left));
    }
  };
  if (rdma_resolve_addr(id, res->ai_src_addr, res->ai_dst_addr, ms) != 0) {
    r.error = std::string("rdma_resolve_addr: ") + std::strerror(errno) + " (no RDMA device routes to " + host + ")";
  } else if (const int t = wait_event("address resolution"); t == RDMA_CM_EVENT_ADDR_RESOLVED) {
    if (rdma_resolve_route(id, ms) != 0) {
      r.error = std::string("rdma_resolve_route: ") + std::strerror(errno);
    } else if (const int u = wait_event("route resolution"); u == RDMA_CM_EVENT_ROUTE_RESOLVED) {
      r.ok = true;
      if (id->verbs != nullptr) r.device = ibv_get_device_name(id->verbs->device);
      r.port = id->port_num;
      char buf[INET6_ADDRSTRLEN] = {};
      const sockaddr* src = rdma_get_local_addr(id);
      if (src->sa_family == AF_INET) {
        inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(src)->sin_addr, buf, sizeof buf);
      } else if (src->sa_family == AF_INET6) {
        inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(src)->sin6_addr, buf, sizeof buf);
      }
      r.source = buf;
    } else if (u >= 0) {
      r.error = std::string("route resolution: ") + rdma_event_str(static_cast<rdma_cm_event_type>(u));
    }
  } else if (t >= 0) {
    r.error = std::string("address resolution: ") + rdma_event_str(static_cast<rdma_cm_event_type>(t));
  }
  rdma_freeaddrinfo(res);
  rdma_destroy_id(id);
  rdma_destroy_event_channel(ch);
  return r;
}

#else

device_inventory inspect_devices() {
  device_inventory inv;
  inv.error = "built without ANYDOOR_WITH_VERBS";
  return inv;
}

route_result resolve_route(const std::string&, std::uint16_t, std::chrono::milliseconds) {
  route_result r;
  r.error = "built without ANYDOOR_WITH_VERBS";
  return r;
}

#endif

}  // namespace anydoor::transport
