// Helpers shared by the demo and the benchmarks: one connected queue pair
// with a registered buffer, busy-polling loops, and statistics.
#pragma once

#include <anydoor/memory.hpp>
#include <anydoor/transport/provider.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace anydoor::examples {

namespace tp = anydoor::transport;

struct session {
  std::unique_ptr<tp::device> dev;
  std::unique_ptr<tp::protection_domain> pd;
  std::unique_ptr<tp::completion_queue> cq;
  std::unique_ptr<tp::queue_pair> qp;
  std::vector<std::byte> buf;  // registered, page-aligned use is not required by the tcp provider
  std::unique_ptr<tp::memory_region> mr;
  // The other side's buffer, for one-sided operations: each side sends its
  // own, packed, in its connect or accept private data.
  remote_region peer;

  // Busy-polls until one completion arrives; throws on a failed completion
  // or when nothing completes within the timeout.
  tp::completion wait(std::chrono::milliseconds timeout = std::chrono::seconds(30));
  void post_recv(std::uint64_t wr_id, std::uint32_t length);
  void post(const tp::work_request& wr);
};

struct session_options {
  std::string provider = "auto";
  std::size_t buffer_size = 1 << 20;
  std::uint32_t queue_depth = 128;
};

// Passive side: listens on host:port, accepts one connection. `on_listen`
// is told the bound port (port 0 picks one).
session accept_one(const std::string& host, std::uint16_t port, const session_options& opt,
                   void (*on_listen)(std::uint16_t port, void* ctx) = nullptr, void* ctx = nullptr);
// Active side.
session connect_to(const std::string& host, std::uint16_t port, const session_options& opt);

// Send/recv ping-pong of `size` bytes, `iters` round trips (plus warm-up).
// The initiator returns one round-trip time per iteration (ns).
std::vector<double> pingpong(session& s, std::uint32_t size, std::uint32_t iters, bool initiator);

// Streams `count` one-sided operations (write or read) of `size` bytes with
// `window` in flight between the two buffers; returns the elapsed seconds.
double stream(session& s, tp::opcode op, std::uint32_t size, std::uint64_t count, std::uint32_t window);

// Drives the passive side (the tcp provider executes one-sided operations in
// poll) until the peer disconnects.
void serve_until_disconnect(session& s);

struct summary {
  double median = 0, p99 = 0, min = 0, mean = 0;
};
summary summarize(std::vector<double> v);

}  // namespace anydoor::examples
