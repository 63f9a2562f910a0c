// anydoor-echo: an RPC echo service and a load generator for it.
#pragma once

#include "common/args.hpp"

#include <anydoor/rpc.hpp>

#include <cstdint>
#include <optional>
#include <string>

namespace anydoor::apps::echo {

// The one method: the reply is the request's bytes.
inline constexpr rpc::method<std::string, std::string> method{"anydoor.echo"};

struct server_options {
  endpoint listen;
  std::string provider = "auto";
  std::uint64_t max_message = std::uint64_t{64} << 20;
  std::uint32_t max_connections = 128;  // per reactor; x (send queue + credits) must fit the device's CQ (rxe: 32767)
  std::size_t threads = 1;              // reactor threads (reactor_group when > 1)
  std::uint16_t credits = 64;           // receive buffers posted per connection (with srq: the window)
  std::uint32_t srq = 0;                // shared receive queue buffers per reactor; 0: none
  std::optional<endpoint> metrics;      // --metrics-listen: live counters (GET /metrics)
};
int run_server(const server_options& o);

struct client_options {
  endpoint connect;
  std::string provider = "auto";
  std::uint64_t size = 64;
  std::uint64_t count = 0;     // 0: --duration decides
  double duration = 0;         // seconds; 0: --count decides (default 10000 messages)
  std::uint32_t in_flight = 1;
  std::uint32_t connections = 1;
  std::uint16_t credits = 64;  // receive buffers posted per connection
  double timeout = 10;         // seconds a reply may take before the server counts as gone
  bool verify = false;
  bool json = false;
  std::uint32_t threads = 1;   // client reactors (each its own thread, fabric and share of the connections)
};
int run_client(const client_options& o);

}  // namespace anydoor::apps::echo
