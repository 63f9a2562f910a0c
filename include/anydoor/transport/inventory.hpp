// What the host's RDMA devices are and what state they are in, for tools
// that check a host (anydoor-doctor): devices, ports, GIDs and limits as
// rdma-core reports them, and whether rdma_cm can route to a peer. Not on
// any data path; nothing here opens a queue pair.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace anydoor::transport {

struct gid_entry {
  std::uint32_t index = 0;
  std::string gid;     // "fe80::...", or "::ffff:10.0.2.15" for an IPv4-mapped one
  std::string type;    // "IB", "RoCE v1" or "RoCE v2"
  std::string ipv4;    // the IPv4 address of an IPv4-mapped GID, else empty
  std::string netdev;  // the network device the GID belongs to (RoCE), else empty
};

struct port_entry {
  std::uint8_t number = 0;
  std::string state;       // "active", "down", "init", "armed", ... (ibv_port_state_str, lower case)
  std::string link_layer;  // "InfiniBand" or "Ethernet"
  std::uint32_t active_mtu = 0;  // bytes (256..4096)
  std::uint32_t max_mtu = 0;
  std::string netdev;      // RoCE: the port's network device, when known
  std::vector<gid_entry> gids;
  // The GID the verbs provider expects rdma_cm to use: the first RoCE v2
  // GID with an IPv4 address (ANYDOOR_GID_INDEX overrides it); -1: none.
  int preferred_gid = -1;
};

struct device_entry {
  std::string name;            // "mlx5_0", "rxe0", "siw0"
  std::string transport;       // "InfiniBand" (IB and RoCE) or "iWARP"
  std::string pci_address;     // "0000:3b:00.0"; empty for software devices
  int numa_node = -1;          // from sysfs; -1: unknown or none
  std::uint64_t max_mr_size = 0;
  std::uint32_t max_qp = 0, max_qp_wr = 0, max_cqe = 0, max_sge = 0, max_mr = 0;
  std::uint32_t max_srq = 0, max_mw = 0;
  bool atomics = false;
  std::vector<port_entry> ports;
  std::string error;  // set when the device could not be opened or queried
};

struct device_inventory {
  bool verbs_built = false;   // the library was built with ANYDOOR_WITH_VERBS
  std::string error;          // why the list could not be had (rdma-core's words)
  std::vector<device_entry> devices;
};

// Every verbs device and port. Never throws for a missing device: an empty
// list (with `error` saying why when rdma-core gave a reason).
device_inventory inspect_devices();

struct route_result {
  bool ok = false;
  std::string device;   // the device rdma_cm resolved the peer to
  std::uint8_t port = 0;
  std::string source;   // the local address it would leave from
  std::string error;    // why not, in rdma_cm's and the resolver's words
};

// Whether rdma_cm can resolve an address and a route to host:port (no
// connection is made; the peer need not listen). Waits at most `timeout`.
route_result resolve_route(const std::string& host, std::uint16_t port,
                           std::chrono::milliseconds timeout = std::chrono::seconds(2));

}  // namespace anydoor::transport
