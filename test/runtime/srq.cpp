// The runtime on a shared receive queue (fabric_options::srq_buffers): many
// connections share one queue's buffers, credits still keep every sender
// from meeting RNR, windows grow while the queue has spare receives, a
// connection the queue cannot cover is refused, and a queue pair that fails
// without a completion (nothing of its own to flush) fails its connection.
#include "../support/runtime.hpp"

#include <anydoor/anydoor.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

using namespace anydoor::test;
namespace asio = boost::asio;
namespace ad = anydoor;
using asio::awaitable;
using asio::use_awaitable;

namespace {

ad::fabric_options srq_options(std::uint32_t buffers, std::uint16_t window, std::uint32_t max_connections = 16) {
  ad::fabric_options o = test_options({.credits = window, .keepalive = std::chrono::milliseconds(0)});
  o.srq_buffers = buffers;
  o.max_connections = max_connections;
  return o;
}

}  // namespace

TEST_CASE("shared receive queue: 8 connections share 32 receive buffers and no sender meets RNR", "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, srq_options(32, 16));
  ad::fabric client(io, test_options());
  CHECK(server.stats().srq_posted == 32);
  CHECK(server.stats().srq_spare == 32);
  // The device's own count (on verbs the port's, since it came up: what
  // this test adds is what counts).
  const auto rnr_before = server.device().counters().rnr_naks_sent;
  REQUIRE(rnr_before.has_value());
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  constexpr int kConns = 8, kMessages = 300;
  std::vector<int> got(kConns, 0);
  asio::co_spawn(io, [&]() -> awaitable<void> {
    for (int i = 0; i < kConns; ++i) {
      ad::connection c = co_await acc.async_accept(use_awaitable);
      CHECK(c.peer().credits == 64);  // the client has its own receives
      asio::co_spawn(io, [](ad::connection conn, int* g) -> awaitable<void> {
        for (int k = 0; k < kMessages; ++k) {
          ad::message m = co_await conn.async_receive(use_awaitable);
          const auto want = pattern(100 + static_cast<std::size_t>(k % 50), static_cast<std::uint32_t>(k));
          REQUIRE(m.size() == want.size());
          CHECK(std::memcmp(m.data(), want.data(), want.size()) == 0);
          ++*g;
        }
        const char done = 'd';
        co_await conn.async_send(asio::buffer(&done, 1), use_awaitable);
        auto [ec, m] = co_await conn.async_receive(asio::as_tuple(use_awaitable));  // the client's close
        CHECK(ec == ad::errc::connection_closed);
      }(std::move(c), &got[static_cast<std::size_t>(i)]), f.handler());
    }
  }, f.handler());
  for (int i = 0; i < kConns; ++i) {
    asio::co_spawn(io, [&]() -> awaitable<void> {
      ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
      // The server grants 4 at the start, out of a window of 16.
      CHECK(c.peer().credits == 4);
      CHECK(c.peer().max_credits == 16);
      // Eager sends complete once posted: they run ahead as far as the
      // credits let them, never into a missing receive.
      for (int k = 0; k < kMessages; ++k) {
        const auto out = pattern(100 + static_cast<std::size_t>(k % 50), static_cast<std::uint32_t>(k));
        co_await c.async_send(asio::buffer(out), use_awaitable);
      }
      ad::message done = co_await c.async_receive(use_awaitable);
      CHECK(done.size() == 1);
      CHECK(c.stats().rnr_naks == 0);
      co_await c.async_close(use_awaitable);
    }, f.handler());
  }
  run_to_completion(io);
  f.check();
  for (int g : got) CHECK(g == kMessages);
  const auto counters = server.device().counters();
  REQUIRE(counters.rnr_naks_sent.has_value());
  CHECK(*counters.rnr_naks_sent == *rnr_before);
  // Everything back in the queue, nothing promised: receive memory was the
  // 32 buffers throughout.
  CHECK(server.stats().srq_posted == 32);
  CHECK(server.stats().srq_spare == 32);
}

TEST_CASE("shared receive queue: a busy connection's window grows while the queue has spare receives", "[runtime]") {
  asio::io_context io;
  // Room for one more connection's floor beyond this one: the rest may
  // feed windows.
  ad::fabric server(io, srq_options(64, 32, 2));
  ad::fabric client(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  constexpr int kMessages = 200;
  std::uint64_t spare_while_open = 0;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    // The new connection's floor. The client's sends stay held in its inbox
    // until taken below (no credit comes back for them), but on a device
    // where the connecting side speaks first (verbs) its greeting, a control
    // message released at once, may have been taken already: its buffer
    // brought its credit back and one more. Exactly that, nothing else.
    const std::uint64_t spare = server.stats().srq_spare;
    if (server.device().caps().established_by_message) {
      CHECK((spare == 64 - 4 || spare == 64 - 4 - 1));
    } else {
      CHECK(spare == 64 - 4);
    }
    for (int k = 0; k < kMessages; ++k) (void)co_await c.async_receive(use_awaitable);  // released at once
    spare_while_open = server.stats().srq_spare;
    const char done = 'd';
    co_await c.async_send(asio::buffer(&done, 1), use_awaitable);
    auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
    CHECK(ec == ad::errc::connection_closed);
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    const std::vector<std::byte> out(64, std::byte{7});
    for (int k = 0; k < kMessages; ++k) co_await c.async_send(asio::buffer(out), use_awaitable);
    (void)co_await c.async_receive(use_awaitable);
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  // Each re-posted buffer brought the credit back and one more until the
  // window (32) was reached: the connection held 32 of the 64, not 4.
  CHECK(spare_while_open == 64 - 32);
  CHECK(server.stats().srq_spare == 64);  // returned when its queue pair went
}

TEST_CASE("shared receive queue: a connection the queue cannot cover is refused until another ends", "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, srq_options(8, 16));  // two connections' floors
  ad::fabric client(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  std::vector<ad::connection> held;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    for (int i = 0; i < 3; ++i) held.push_back(co_await acc.async_accept(use_awaitable));
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection a = co_await client.async_connect(addr(acc), use_awaitable);
    ad::connection b = co_await client.async_connect(addr(acc), use_awaitable);
    CHECK(server.stats().srq_spare == 0);
    auto [ec, c] = co_await client.async_connect(addr(acc), asio::as_tuple(use_awaitable));
    CHECK(ec == ad::errc::too_many_connections);
    CHECK(server.stats().refused == 1);
    // One ends: once its queue pair is gone its 4 receives are free again.
    co_await a.async_close(use_awaitable);
    a = ad::connection();
    co_await until([&] {
      // (the server's side of `a` goes when its owner drops it)
      if (!held.empty() && !held.front().is_open()) held.erase(held.begin());
      return server.stats().srq_spare >= 4;
    }, std::chrono::seconds(2));
    CHECK(server.stats().srq_spare == 4);
    ad::connection d = co_await client.async_connect(addr(acc), use_awaitable);
    CHECK(d.is_open());
    co_await b.async_close(use_awaitable);
    co_await d.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
}

TEST_CASE("shared receive queue: a peer that vanishes fails its connection though nothing completes", "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, srq_options(16, 8));  // keepalive off: no silence detection
  ad::fabric client(io, test_options({.keepalive = std::chrono::milliseconds(0)}));
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  std::error_code ended;
  std::chrono::steady_clock::duration took{};
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    // A receive waits: no work request of this connection is outstanding
    // (its receives are the shared queue's), so the queue pair's failure
    // produces no completion.
    const auto start = std::chrono::steady_clock::now();
    auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
    took = std::chrono::steady_clock::now() - start;
    ended = ec;
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    asio::steady_timer t(io);
    t.expires_after(std::chrono::milliseconds(200));
    co_await t.async_wait(use_awaitable);
    c.abort();  // no close message: the queue pair just goes
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(ended);
  CHECK(ended != ad::errc::connection_closed);
  // Noticed by the fabric's liveness tick (once a second when idle).
  CHECK(took < std::chrono::seconds(5));
}

TEST_CASE("shared receive queue: a slow reader's window never outgrows its inbox", "[runtime]") {
  // Window 4: the reader takes nothing for a while, then one message at a
  // time. Each buffer it gives back may bring credits, but never more than
  // the window minus what it still holds: the peer's messages always fit.
  asio::io_context io;
  ad::fabric server(io, srq_options(64, 4, 2));
  ad::fabric client(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  constexpr int kMessages = 60;
  int got = 0;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    asio::steady_timer t(io);
    t.expires_after(std::chrono::milliseconds(300));  // the sender fills the window meanwhile
    co_await t.async_wait(use_awaitable);
    for (int k = 0; k < kMessages; ++k) {
      {
        ad::message m = co_await c.async_receive(use_awaitable);
        REQUIRE(m.size() == 32);
        CHECK(std::to_integer<int>(m.data()[0]) == k % 251);
        ++got;
      }  // given back: credits go out while the inbox still holds the rest
      t.expires_after(std::chrono::milliseconds(10));
      co_await t.async_wait(use_awaitable);
    }
    const char done = 'd';
    co_await c.async_send(asio::buffer(&done, 1), use_awaitable);
    auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
    CHECK(ec == ad::errc::connection_closed);
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    for (int k = 0; k < kMessages; ++k) {
      std::vector<std::byte> out(32, static_cast<std::byte>(k % 251));
      co_await c.async_send(asio::buffer(out), use_awaitable);
    }
    (void)co_await c.async_receive(use_awaitable);
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(got == kMessages);
  CHECK(server.stats().srq_spare == 64);
}

TEST_CASE("shared receive queue: with authentication the withheld credits come from the queue too", "[runtime]") {
  asio::io_context io;
  ad::fabric_options so = srq_options(16, 8);
  so.connection.auth_token = "a shared receive queue token";
  ad::fabric server(io, so);
  ad::fabric client(io, test_options({.auth_token = "a shared receive queue token"}));
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  int echoed = 0;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    for (;;) {
      auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
      if (ec) break;
      co_await c.async_send(asio::buffer(m.data(), m.size()), use_awaitable);
    }
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    CHECK(c.peer().credits == 4);
    for (int k = 0; k < 100; ++k) {
      const auto out = pattern(10 + static_cast<std::size_t>(k), static_cast<std::uint32_t>(k));
      co_await c.async_send(asio::buffer(out), use_awaitable);
      ad::message m = co_await c.async_receive(use_awaitable);
      REQUIRE(m.size() == out.size());
      CHECK(std::memcmp(m.data(), out.data(), out.size()) == 0);
      ++echoed;
    }
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(echoed == 100);
  CHECK(server.stats().srq_spare == 16);
}

TEST_CASE("shared receive queue: buffers a connection holds count toward its floor, so the floors of "
          "max_connections connections always fit",
          "[runtime]") {
  // 8 buffers, at most 2 connections: both floors (4 each) must fit even
  // while the first holds messages it has not taken yet.
  asio::io_context io;
  ad::fabric server(io, srq_options(8, 16, 2));
  ad::fabric client(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  bool second = false;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection a = co_await acc.async_accept(use_awaitable);
    // The peer's three messages (its window of 4 less the control credit) arrive.
    co_await until([&] { return server.stats().srq_posted <= 5; });
    CHECK(server.stats().srq_posted == 5);
    { ad::message m = co_await a.async_receive(use_awaitable); }  // one given back, two still held
    ad::connection b = co_await acc.async_accept(use_awaitable);
    second = b.is_open();
    for (int k = 0; k < 2; ++k) (void)co_await a.async_receive(use_awaitable);
    auto [ec1, m1] = co_await a.async_receive(asio::as_tuple(use_awaitable));
    auto [ec2, m2] = co_await b.async_receive(asio::as_tuple(use_awaitable));
    CHECK(ec1 == ad::errc::connection_closed);
    CHECK(ec2 == ad::errc::connection_closed);
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection a = co_await client.async_connect(addr(acc), use_awaitable);
    const std::vector<std::byte> out(16, std::byte{1});
    for (int k = 0; k < 3; ++k) co_await a.async_send(asio::buffer(out), use_awaitable);
    co_await until([&] { return server.stats().srq_posted == 6; });
    ad::connection b = co_await client.async_connect(addr(acc), use_awaitable);
    co_await b.async_close(use_awaitable);
    co_await a.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(second);
}

TEST_CASE("shared receive queue: a reader holding messages still gets the next one when the queue is tight",
          "[runtime]") {
  // 8 buffers for at most 2 connections (no growth: the spare is the
  // second connection's floor), window 8, no keepalive (no heartbeat to
  // carry a credit). The reader frees the first message and keeps the
  // next two: the one credit it owes must reach the peer, which is down to
  // its control credit, or the fourth message never comes.
  asio::io_context io;
  ad::fabric server(io, srq_options(8, 8, 2));
  ad::fabric client(io, test_options({.keepalive = std::chrono::milliseconds(0)}));
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  bool fourth = false;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    { ad::message m1 = co_await c.async_receive(use_awaitable); }
    ad::message m2 = co_await c.async_receive(use_awaitable);
    ad::message m3 = co_await c.async_receive(use_awaitable);
    asio::steady_timer limit(io);
    limit.expires_after(std::chrono::seconds(5));
    limit.async_wait([&](const boost::system::error_code& ec) {
      if (!ec) c.abort();  // a stall: end it so that the test fails instead of hanging
    });
    auto [ec, m4] = co_await c.async_receive(asio::as_tuple(use_awaitable));
    limit.cancel();
    fourth = !ec && m4.size() == 16;
    m2 = ad::message();
    m3 = ad::message();
    if (!ec) {
      auto [e, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
      CHECK(e == ad::errc::connection_closed);
    }
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    const std::vector<std::byte> out(16, std::byte{4});
    // The first alone: the reader frees it (and owes one credit) before
    // the next two arrive.
    co_await c.async_send(asio::buffer(out), use_awaitable);
    asio::steady_timer t(io);
    t.expires_after(std::chrono::milliseconds(200));
    co_await t.async_wait(use_awaitable);
    for (int k = 1; k < 4; ++k) co_await c.async_send(asio::buffer(out), use_awaitable);
    co_await c.async_close(asio::as_tuple(use_awaitable));
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(fourth);
}

TEST_CASE("shared receive queue: a peer sending far beyond its credits is failed, its stolen receives come back, "
          "and another connection loses nothing",
          "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, srq_options(32, 8, 4));
  ad::fabric client(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  constexpr int kBurst = 64;  // 4 credits granted and none returned: 60 beyond them
  constexpr int kMessages = 200;
  failure f;
  std::atomic<bool> burst_done{false}, release{false};
  std::atomic<int> raw_failures{0};
  int hostile_messages = 0;
  ad::error_code hostile_end;
  // A raw provider-level peer: a valid hello, then one doorbell of 64 eager
  // messages, each 8-byte header with no credits to spend.
  std::thread raw([&] {
    auto dev = open_test_device();
    auto pd = dev->alloc_pd();
    auto cq = dev->create_cq(512);
    auto qp = pd->create_qp({.send_cq = cq.get(), .recv_cq = cq.get(), .max_send_wr = 128});
    auto res = dev->connect(*qp, test_host(), acc.port(), raw_hello(kWireVersion), std::chrono::seconds(10));
    std::vector<std::byte> out(kBurst * 16, std::byte{0});
    for (int i = 0; i < kBurst; ++i) out[static_cast<std::size_t>(i) * 16] = std::byte{1};  // eager
    auto mr = pd->register_memory(out.data(), out.size(), tp::access::local_write);
    std::vector<tp::sge> sg;
    std::vector<tp::work_request> wrs;
    for (int i = 0; i < kBurst; ++i) sg.push_back(mr->slice(static_cast<std::uint32_t>(i) * 16, 16));
    for (int i = 0; i < kBurst; ++i) wrs.push_back(send_wr(static_cast<std::uint64_t>(i), {&sg[static_cast<std::size_t>(i)], 1}));
    if (res.ec || qp->post_send(wrs)) {
      ++raw_failures;
      burst_done = true;
      return;
    }
    burst_done = true;
    std::array<tp::completion, 64> wc;
    std::error_code ec;
    for (auto t0 = std::chrono::steady_clock::now();
         !release && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30);) {
      cq->poll(wc, ec);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  // (A failed REQUIRE below must not leave the thread joinable.)
  struct joiner {
    std::thread& t;
    std::atomic<bool>& stop;
    ~joiner() {
      stop = true;
      if (t.joinable()) t.join();
    }
  } join_raw{raw, release};
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection h = co_await acc.async_accept(use_awaitable);
    // Nothing is taken from it: its 4 credits are never returned, so the
    // fifth message of the burst is one it had no credit for.
    const bool closed = co_await until([&] { return !h.is_open(); }, std::chrono::seconds(10));
    CHECK(closed);
    for (;;) {
      auto [ec, m] = co_await h.async_receive(asio::as_tuple(use_awaitable));
      if (ec) {
        hostile_end = ec;
        break;
      }
      ++hostile_messages;
    }
    ad::connection g = co_await acc.async_accept(use_awaitable);  // the good peer: an echo
    for (;;) {
      auto [ec, m] = co_await g.async_receive(asio::as_tuple(use_awaitable));
      if (ec) break;
      co_await g.async_send(asio::buffer(m.data(), m.size()), use_awaitable);
    }
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    const bool burst_over = co_await until([&] { return burst_done.load(); }, std::chrono::seconds(30),
                                           std::chrono::milliseconds(2));
    REQUIRE(burst_over);
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    for (int k = 0; k < kMessages; ++k) {
      const std::vector<std::byte> out = pattern(100 + static_cast<std::size_t>(k), static_cast<std::uint32_t>(k));
      co_await c.async_send(asio::buffer(out), use_awaitable);
      ad::message m = co_await c.async_receive(use_awaitable);
      CHECK(std::vector<std::byte>(m.data(), m.data() + m.size()) == out);
    }
    co_await c.async_close(use_awaitable);
    release = true;
    // Every receive the burst took is back once its queue pair is gone.
    co_await until([&] { return server.stats().srq_posted == 32; }, std::chrono::seconds(10));
  }, f.handler());
  run_to_completion(io);
  release = true;
  raw.join();
  f.check();
  CHECK(raw_failures == 0);
  CHECK(hostile_end == ad::errc::protocol_error);
  CHECK(hostile_messages <= 4);  // at most what its credits allowed
  CHECK(server.stats().srq_posted == 32);
  CHECK(server.stats().srq_spare == 32);
}
