// Helpers shared by the demo and the benchmarks: one connected queue pair
// with a registered buffer, busy-polling loops, and statistics.
#pragma once

#include <anydoor/memory.hpp>
#include <anydoor/transport/provider.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
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
  // What else the peer put in its private data, after its region.
  std::vector<std::byte> peer_extra;

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
  std::uint32_t max_inline = 64;  // qp_attributes::max_inline_data
};

// Passive side: listens on host:port, accepts one connection. `on_listen`
// is told the bound port (port 0 picks one). `configure`, when given, picks
// the options from the requester's extra private data (the provider is
// opt's); it may throw to refuse the request.
session accept_one(const std::string& host, std::uint16_t port, const session_options& opt,
                   void (*on_listen)(std::uint16_t port, void* ctx) = nullptr, void* ctx = nullptr,
                   const std::function<session_options(std::span<const std::byte> extra)>& configure = {});
// Active side; `extra` follows our region in the private data (at most
// kMaxExtra bytes: the smallest private data a provider carries is 55).
session connect_to(const std::string& host, std::uint16_t port, const session_options& opt,
                   std::span<const std::byte> extra = {});
inline constexpr std::size_t kMaxExtra = 55 - remote_region::packed_size;

// Send/recv ping-pong of `size` bytes, `iters` round trips after `warmup`
// more. The initiator returns one round-trip time per iteration (ns).
std::vector<double> pingpong(session& s, std::uint32_t size, std::uint32_t iters, bool initiator,
                             std::uint32_t warmup = 1000);

// RDMA WRITE ping-pong of `size` bytes, as ib_write_lat: each side writes
// its buffer's first `size` bytes into the second half of the peer's and
// busy-waits on the last byte of its own second half (a tag that changes
// every round), polling its completion queue meanwhile (the tcp provider
// executes the peer's writes in poll). The initiator returns one
// round-trip time per iteration (ns); it returns once its writes are
// acknowledged, the responder right after its last write. Throws on a
// failed completion, a message arriving meanwhile, or a round longer than
// 30 s.
std::vector<double> write_pingpong(session& s, std::uint32_t size, std::uint32_t iters, bool initiator,
                                   std::uint32_t warmup);

// Streams `count` sends of `size` bytes with `window` in flight (batched,
// the last of each batch signaled, inline when it fits); the peer runs
// receive_count. Returns the elapsed seconds.
double send_stream(session& s, std::uint32_t size, std::uint64_t count, std::uint32_t window);
// Keeps `depth` receives of up to `max_size` bytes posted until `count`
// messages have arrived.
void receive_count(session& s, std::uint64_t count, std::uint32_t max_size, std::uint32_t depth);

// One 8-byte fetch_add on the peer's buffer at a time, `iters` of them after
// `warmup` more: the time of each (ns, a full round trip).
std::vector<double> atomic_roundtrips(session& s, std::uint32_t iters, std::uint32_t warmup);

// Streams `count` one-sided operations (write or read) of `size` bytes with
// `window` in flight between the two buffers; returns the elapsed seconds.
// The operations cycle through `slots` consecutive places of `size` bytes
// in each buffer (0: as many as half of the smaller buffer holds); more
// than that throws std::invalid_argument.
double stream(session& s, tp::opcode op, std::uint32_t size, std::uint64_t count, std::uint32_t window,
              std::uint64_t slots = 0);

// Drives the passive side (the tcp provider executes one-sided operations in
// poll) until the peer disconnects.
void serve_until_disconnect(session& s);
// Likewise until a message arrives in the receive the caller posted with
// wr_id: true, or the connection ends (or a receive fails) first: false.
bool serve_until_message(session& s, std::uint64_t wr_id);

struct summary {
  double median = 0, p99 = 0, p999 = 0, min = 0, max = 0, mean = 0;
};
summary summarize(std::vector<double> v);

}  // namespace anydoor::examples
