// Test support for the runtime (fabric, connection): run io to its natural
// end under a watchdog, fabric options sized for tests, data patterns, and
// coroutine failures rethrown in the test.
#pragma once

#include "harness.hpp"

#include <anydoor/anydoor.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <unistd.h>

#include <array>
#include <chrono>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace anydoor::test {

namespace asio = boost::asio;
namespace ad = anydoor;

// The runtime's wire version (runtime/protocol.hpp's kVersion), for tests
// that speak the protocol themselves: a change there must be made here too.
inline constexpr std::uint16_t kWireVersion = 8;

// A runtime hello as a raw provider-level client would send it (see
// runtime/protocol.hpp): magic, version, kind hello, credits, flags (none:
// no authentication), receive buffer, eager limit, max message, no nonce.
inline std::array<std::byte, 50> raw_hello(std::uint16_t version, std::uint32_t magic = 0x31524441,
                                    std::uint16_t max_credits = 8) {
  std::array<std::byte, 50> h{};
  const std::uint16_t credits = 8;
  const std::uint32_t recv_buffer = 8256, eager = 8192;
  const std::uint64_t max_message = 1 << 20;
  std::memcpy(h.data(), &magic, 4);
  std::memcpy(h.data() + 4, &version, 2);
  h[6] = std::byte{1};  // kind hello
  std::memcpy(h.data() + 8, &credits, 2);
  std::memcpy(h.data() + 12, &recv_buffer, 4);
  std::memcpy(h.data() + 16, &eager, 4);
  std::memcpy(h.data() + 20, &max_message, 8);
  std::memcpy(h.data() + 48, &max_credits, 2);
  return h;
}

// A raw provider-level peer, run on a thread of its own: for each sequence
// of `sequences`, connects to `port` with raw_hello(), posts the sequence's
// messages (bytes as on the wire: runtime header and body) in one
// post_send, and keeps the queue pair until `judged` is past the
// sequence's index (at most 10 s). False when a connect or post failed.
inline bool raw_peer_sends(std::uint16_t port, const std::vector<std::vector<std::vector<std::byte>>>& sequences,
                           const std::atomic<std::size_t>& judged) {
  auto dev = open_test_device();
  auto pd = dev->alloc_pd();
  auto cq = dev->create_cq(256);
  for (std::size_t ci = 0; ci < sequences.size(); ++ci) {
    auto qp = pd->create_qp({.send_cq = cq.get(), .recv_cq = cq.get()});
    auto res = dev->connect(*qp, test_host(), port, raw_hello(kWireVersion), std::chrono::seconds(10));
    std::vector<std::byte> all;
    for (const auto& m : sequences[ci]) all.insert(all.end(), m.begin(), m.end());
    auto mr = pd->register_memory(all.data(), all.size(), tp::access::local_write);
    std::vector<tp::sge> sg;
    std::vector<tp::work_request> wrs;
    std::size_t off = 0;
    for (const auto& m : sequences[ci]) {
      sg.push_back(mr->slice(off, static_cast<std::uint32_t>(m.size())));
      off += m.size();
    }
    for (std::size_t i = 0; i < sg.size(); ++i) wrs.push_back(send_wr(i + 1, {&sg[i], 1}));
    if (res.ec || qp->post_send(wrs)) return false;
    std::array<tp::completion, 8> wc;
    std::error_code ec;
    for (auto t0 = std::chrono::steady_clock::now(); std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10);) {
      cq->poll(wc, ec);
      if (judged > ci) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  return true;
}

// In a coroutine: waits in steps of `step` until pred() holds or `limit`
// has passed; returns pred()'s last answer (CHECK it after the co_await:
// a co_await inside a CHECK is not allowed).
template <class Pred>
asio::awaitable<bool> until(Pred pred, std::chrono::milliseconds limit = std::chrono::seconds(5),
                            std::chrono::milliseconds step = std::chrono::milliseconds(10)) {
  asio::steady_timer t(co_await asio::this_coro::executor);
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!pred() && std::chrono::steady_clock::now() < end) {
    t.expires_after(step);
    co_await t.async_wait(asio::use_awaitable);
  }
  co_return pred();
}

// In a coroutine: GET /metrics from 127.0.0.1:port (a metrics_endpoint);
// the body, or "" when the answer is not 200.
inline asio::awaitable<std::string> http_get_metrics(std::uint16_t port) {
  using tcp = asio::ip::tcp;
  tcp::socket s(co_await asio::this_coro::executor);
  co_await s.async_connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port), asio::use_awaitable);
  co_await asio::async_write(s, asio::buffer(std::string_view("GET /metrics HTTP/1.1\r\n\r\n")), asio::use_awaitable);
  std::string resp;
  (void)co_await asio::async_read(s, asio::dynamic_buffer(resp), asio::as_tuple(asio::use_awaitable));
  const auto head = resp.find("\r\n\r\n");
  if (resp.rfind("HTTP/1.1 200 ", 0) != 0 || head == std::string::npos) co_return std::string();
  co_return resp.substr(head + 4);
}

// The sum of a metric's samples whose labels contain `labels` (a
// substring such as reactor="1"), in a Prometheus text page.
inline std::uint64_t metric_sum(const std::string& page, const std::string& name, const std::string& labels = "") {
  std::uint64_t sum = 0;
  std::size_t at = 0;
  while (at < page.size()) {
    const auto nl = page.find('\n', at);
    const std::string line = page.substr(at, nl == std::string::npos ? std::string::npos : nl - at);
    at = nl == std::string::npos ? page.size() : nl + 1;
    if (line.rfind(name + "{", 0) != 0) continue;
    const auto close = line.rfind("} ");
    if (close == std::string::npos || line.substr(0, close).find(labels) == std::string::npos) continue;
    sum += std::stoull(line.substr(close + 2));
  }
  return sum;
}

// Runs io until it runs out of work; fails if that takes longer than limit.
inline void run_to_completion(asio::io_context& io, std::chrono::seconds limit = std::chrono::seconds(60)) {
  std::mutex m;
  std::condition_variable cv;
  bool finished = false;
  bool fired = false;
  std::thread watchdog([&] {
    std::unique_lock lock(m);
    if (!cv.wait_for(lock, limit, [&] { return finished; })) {
      fired = true;
      io.stop();
    }
  });
  io.run();
  {
    std::lock_guard lock(m);
    finished = true;
  }
  cv.notify_one();
  watchdog.join();
  REQUIRE_FALSE(fired);  // run() did not return by itself: something hung or leaked work
  io.restart();
}

// Runs io one handler at a time until done() holds (restarting it should
// it run out of work first); fails once `limit` has passed without it
// (handlers that keep running, timers and liveness ticks, do not hold it off).
template <class Done>
void run_until(asio::io_context& io, Done done, std::chrono::seconds limit = std::chrono::seconds(10)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    const auto now = std::chrono::steady_clock::now();
    REQUIRE(now < end);
    if (io.stopped()) io.restart();
    io.run_one_for(end - now);
  }
}

// One connection through `acc` from `client` to `where`, both ends
// completing on this thread: the accepted end, then the connecting end
// (either failing is a failed check).
inline std::pair<ad::connection, ad::connection> connect_through(asio::io_context& io, ad::fabric& client,
                                                                 ad::acceptor& acc, const std::string& where) {
  std::optional<ad::error_code> accepted, connected;
  ad::connection a, c;
  acc.async_accept([&](ad::error_code ec, ad::connection conn) {
    accepted = ec;
    a = std::move(conn);
  });
  client.async_connect(where, [&](ad::error_code ec, ad::connection conn) {
    connected = ec;
    c = std::move(conn);
  });
  run_until(io, [&] { return accepted && connected; });
  CHECK_FALSE(*accepted);
  CHECK_FALSE(*connected);
  return {std::move(a), std::move(c)};
}

// The same with the server's fabric on io_context `sio` and the client's
// on `cio`, both polled here in turn until both ends completed (at most 10
// s). (poll() stops an io_context that runs out of work: restart() it
// before running it again, or keep a work guard.)
inline std::pair<ad::connection, ad::connection> connect_across(asio::io_context& sio, asio::io_context& cio,
                                                                ad::fabric& client, ad::acceptor& acc) {
  ad::connection a, c;
  bool failed = false;
  acc.async_accept([&](ad::error_code ec, ad::connection conn) {
    CHECK_FALSE(ec);
    failed |= static_cast<bool>(ec);
    a = std::move(conn);
  });
  client.async_connect(test_host() + ":" + std::to_string(acc.port()), [&](ad::error_code ec, ad::connection conn) {
    CHECK_FALSE(ec);
    failed |= static_cast<bool>(ec);
    c = std::move(conn);
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((!a || !c) && !failed && std::chrono::steady_clock::now() < deadline) {
    sio.poll();
    cio.poll();
  }
  REQUIRE(a);
  REQUIRE(c);
  return {std::move(a), std::move(c)};
}

inline ad::fabric_options test_options(ad::connection_options c = {}) {
  ad::fabric_options o;
  o.device.provider = provider_under_test();
  o.connection = std::move(c);
  o.max_connections = 8;
  o.buffers_per_slab = 64;
  o.pool_max_bytes = std::size_t{64} << 20;
  return o;
}

inline std::vector<std::byte> pattern(std::size_t n, std::uint32_t seed) {
  std::vector<std::byte> v(n);
  std::uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x = x * 1103515245u + 12345u;
    b = static_cast<std::byte>(x >> 24);
  }
  return v;
}

inline std::string addr(const ad::acceptor& a) { return test_host() + ":" + std::to_string(a.port()); }

// The helper program next to this test binary (built with the tests).
inline std::string sibling(const char* name) {
  std::array<char, 4096> self{};
  const ssize_t n = ::readlink("/proc/self/exe", self.data(), self.size() - 1);
  REQUIRE(n > 0);
  std::string dir(self.data(), static_cast<std::size_t>(n));
  return dir.substr(0, dir.rfind('/') + 1) + name;
}

// Rethrows a coroutine's exception in the test.
struct failure {
  std::exception_ptr e;
  auto handler() {
    return [this](std::exception_ptr p) {
      if (p && !e) e = p;
    };
  }
  void check() const {
    if (e) std::rethrow_exception(e);
  }
};

// Two fabrics on one io_context, the server listening on an ephemeral
// port, and a failure for the coroutines a test spawns: the common start
// of a runtime test (TEST_CASE_METHOD(fabric_pair, ...)). Members go in
// the reverse order, as a test's own locals would.
struct fabric_pair {
  asio::io_context io;
  ad::fabric server{io, test_options()};
  ad::fabric client{io, test_options()};
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
};

// What the runtime made of a raw peer's sequences of messages
// (raw_peer_sends), each on a connection of its own to `acc`, taken by one
// async_receive() per connection: runs `io` to completion.
struct raw_judgement {
  std::vector<ad::error_code> ends;              // each receive's error
  std::vector<std::vector<std::byte>> messages;  // what each delivered (empty: nothing)
  std::size_t left_open = 0;                     // connections open after their receive
  bool raw_ok = false;                           // every connect and post of the peer succeeded
};
inline raw_judgement judge_raw_sequences(asio::io_context& io, ad::acceptor& acc,
                                         const std::vector<std::vector<std::vector<std::byte>>>& sequences) {
  raw_judgement r;
  failure f;
  std::atomic<std::size_t> judged{0};
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    for (std::size_t i = 0; i < sequences.size(); ++i) {
      ad::connection c = co_await acc.async_accept(asio::use_awaitable);
      auto [ec, m] = co_await c.async_receive(asio::as_tuple(asio::use_awaitable));
      r.ends.push_back(ec);
      r.messages.emplace_back(m.bytes().begin(), m.bytes().end());
      if (c.is_open()) ++r.left_open;
      judged = r.ends.size();
    }
  }, f.handler());
  std::atomic<bool> ok{false};
  std::thread raw([&] { ok = raw_peer_sends(acc.port(), sequences, judged); });
  struct joiner {  // (a failed run_to_completion throws: the thread is joined, not left to terminate)
    std::thread& t;
    ~joiner() {
      if (t.joinable()) t.join();
    }
  } join_raw{raw};
  run_to_completion(io);
  raw.join();
  f.check();
  r.raw_ok = ok;
  return r;
}


}  // namespace anydoor::test
