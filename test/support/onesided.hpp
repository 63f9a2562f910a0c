// Test support for one-sided operations: two fabrics on one io_context with
// a connection between them (shared by the one-sided and the registration
// cache tests).
#pragma once

#include "runtime.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <system_error>

namespace anydoor::test {

// (thrown() is in harness.hpp.)

// Re-seals a packed remote_region (its last 4 bytes: FNV-1a of the bytes
// before them) after a test changed its bytes.
inline void reseal(std::vector<std::byte>& p) {
  const std::size_t n = p.size() - 4;
  std::uint32_t h = 2166136261u;
  for (std::size_t i = 0; i < n; ++i) {
    h ^= std::to_integer<std::uint32_t>(p[i]);
    h *= 16777619u;
  }
  for (std::size_t i = 0; i < 4; ++i) p[n + i] = static_cast<std::byte>((h >> (8 * i)) & 0xff);
}

// Two fabrics on one io_context, connected: `a` initiates, `b` is the target.
struct onesided_pair {
  asio::io_context io;
  ad::fabric fa;
  ad::fabric fb;
  ad::acceptor acc;
  ad::connection a, b;

  explicit onesided_pair(const ad::fabric_options& o = test_options())
      : fa(io, o), fb(io, o), acc(fb.listen(test_host(), 0)) {
    connect();
  }
  // Open connections are aborted; their teardown finishes in io.run().
  ~onesided_pair() {
    a = {};
    b = {};
    io.restart();
    io.run_for(std::chrono::seconds(10));
  }
  onesided_pair(const onesided_pair&) = delete;
  onesided_pair& operator=(const onesided_pair&) = delete;
  // A fresh connection pair on the same fabrics.
  void connect() {
    failure f;
    asio::co_spawn(
        io, [this]() -> asio::awaitable<void> { b = co_await acc.async_accept(asio::use_awaitable); }, f.handler());
    asio::co_spawn(
        io, [this]() -> asio::awaitable<void> { a = co_await fa.async_connect(addr(acc), asio::use_awaitable); },
        f.handler());
    run_to_completion(io);
    f.check();
    REQUIRE(a.is_open());
    REQUIRE(b.is_open());
  }
  // Runs `initiator` on a while b waits for its "done" message (sent after
  // it), then returns; `target_ended` gets how b's wait ended.
  template <class Initiator>
  void run(Initiator initiator, ad::error_code* target_ended = nullptr) {
    failure f;
    asio::co_spawn(io, [this, target_ended]() -> asio::awaitable<void> {
      auto [ec, m] = co_await b.async_receive(asio::as_tuple(asio::use_awaitable));
      if (target_ended != nullptr) *target_ended = ec;
    }, f.handler());
    asio::co_spawn(io, [this, initiator]() -> asio::awaitable<void> {
      co_await initiator(a);
      if (a.is_open()) co_await a.async_send(asio::buffer("done", 4), asio::use_awaitable);
    }, f.handler());
    run_to_completion(io);
    f.check();
  }
};

}  // namespace anydoor::test
