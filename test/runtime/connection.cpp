// The runtime's connection on a real provider (ANYDOOR_TEST_PROVIDER): the
// handshake, eager and rendezvous messages, credits, batching, completion
// tokens, cancellation, close and peer death. Every test drives io.run()
// to its natural end under a watchdog: run() must return once the work is
// done, so a hang (or work left behind) fails the test.
#include "../support/process.hpp"
#include "../support/runtime.hpp"
#include "../support/sleep.hpp"

#include <anydoor/anydoor.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/deferred.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/use_future.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>

using namespace anydoor::test;
namespace asio = boost::asio;
namespace ad = anydoor;
using asio::awaitable;
using asio::use_awaitable;

namespace {


// Echoes every message of `conns` connections until each peer closes.
awaitable<void> echo_server(ad::acceptor& acc, int conns, std::vector<ad::error_code>* endings = nullptr) {
  for (int i = 0; i < conns; ++i) {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    asio::co_spawn(
        co_await asio::this_coro::executor,
        [](ad::connection conn, std::vector<ad::error_code>* ends) -> awaitable<void> {
          for (;;) {
            auto [ec, m] = co_await conn.async_receive(asio::as_tuple(use_awaitable));
            if (ec) {
              if (ends != nullptr) ends->push_back(ec);
              co_return;
            }
            auto [sec, n] = co_await conn.async_send(m.buffer(), asio::as_tuple(use_awaitable));
            if (sec) {
              if (ends != nullptr) ends->push_back(sec);
              co_return;
            }
          }
        }(std::move(c), endings),
        asio::detached);
  }
}

}  // namespace

TEST_CASE("echo: eager, inline, split and rendezvous messages arrive whole and in order", "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::fabric client(io, test_options());
  CHECK(server.provider() == provider_under_test());
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  asio::co_spawn(io, echo_server(acc, 1), f.handler());
  const std::size_t eager = 8192;
  const std::vector<std::size_t> sizes = {1, 8, 64, 200, 1000, eager - 1, eager, eager + 1, 100000, 1u << 20, 3};
  std::size_t echoed = 0;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    CHECK(c.is_open());
    CHECK(c.peer().credits == 64);
    CHECK(c.eager_limit() == eager);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const auto out = pattern(sizes[i], static_cast<std::uint32_t>(i));
      const std::size_t sent = co_await c.async_send(asio::buffer(out), use_awaitable);
      CHECK(sent == sizes[i]);
      ad::message m = co_await c.async_receive(use_awaitable);
      REQUIRE(m.size() == sizes[i]);
      CHECK(std::memcmp(m.data(), out.data(), out.size()) == 0);
      ++echoed;
    }
    const ad::connection_stats s = c.stats();
    CHECK(s.messages_sent == sizes.size());
    CHECK(s.messages_received == sizes.size());
    CHECK(s.rendezvous_sends == 2);
    CHECK(s.split_sends == 1);  // eager + 1
    CHECK(s.split_pieces == 2);
    CHECK(s.inline_sends >= 4);
    CHECK(s.bytes_sent == std::accumulate(sizes.begin(), sizes.end(), std::size_t{0}));
    CHECK(s.rnr_naks == 0);
    co_await c.async_close(use_awaitable);
    CHECK_FALSE(c.is_open());
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(echoed == sizes.size());
  const ad::fabric_stats fs = client.stats();
  CHECK(fs.connected == 1);
  CHECK(server.stats().accepted == 1);
  CHECK(fs.reactor.completions > 0);
  CHECK(fs.pool.gets > 0);
}

// A rendezvous source's key must hold a moment after its send where the
// fabric may deliver a stale duplicate of the peer's READ (rxe, RoCE,
// InfiniBand): revoked at once, a late duplicate fails the connection
// (rxe-netem's late-read scenario). On a stream transport (tcp, siw)
// nothing is held: the tcp provider's key would name memory the user may
// free. (The limits, late_read_grace 0 and a failed connection: the
// faults suite, on tcp with late_duplicates=1.)
TEST_CASE("rendezvous: a source's registration outlives its send by late_read_grace where late duplicate READs "
          "can come, never on a stream transport", "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::fabric client(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  asio::co_spawn(io, echo_server(acc, 1), f.handler());
  const bool late = client.device().caps().late_duplicates;
  INFO("late_duplicates: " << late);
  CHECK(late == (client.provider() == "verbs" && client.device().name().find("siw") == std::string_view::npos));
  bool done = false;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    const std::size_t size = 100000;  // above the eager limit and eager_split_limit: by rendezvous
    const auto out = pattern(size, 3);
    const std::size_t sent = co_await c.async_send(asio::buffer(out), use_awaitable);
    const auto ended = std::chrono::steady_clock::now();
    REQUIRE(sent == size);
    CHECK(c.stats().rendezvous_sends == 1);
    // Still held half way through its 100 ms (where the check comes in
    // time: the emulated VM may be slower).
    co_await sleep_for(std::chrono::milliseconds(50));
    const ad::fabric_stats s = client.stats();
    if (std::chrono::steady_clock::now() - ended < std::chrono::milliseconds(90)) {
      CHECK(s.retired_sources == (late ? 1u : 0u));
      CHECK(s.retired_bytes == (late ? size : 0u));
    }
    CHECK(s.retired_early == 0);
    ad::message m = co_await c.async_receive(use_awaitable);
    CHECK(m.size() == size);
    m = {};
    // Deregistered by a tick once its 100 ms are over (within twice that).
    const bool gone = co_await until([&] { return client.stats().retired_sources == 0; }, std::chrono::seconds(3),
                                     std::chrono::milliseconds(1));
    CHECK(gone);
    if (late) CHECK(std::chrono::steady_clock::now() - ended >= std::chrono::milliseconds(90));
    CHECK(client.stats().retired_bytes == 0);
    co_await c.async_close(use_awaitable);
    done = true;
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(done);
}

// The natural way to scope a client: the fabric goes at the end of the
// block, in the coroutine that the close's completion resumed, which runs
// inside the fabric's own reactor (a completion it dispatches). The
// reactor, and the fabric's state, must outlive that handler.
TEST_CASE("a fabric destroyed by a coroutine that its own completions resumed", "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  asio::co_spawn(io, echo_server(acc, 3), f.handler());
  int rounds = 0;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    for (int i = 0; i < 3; ++i) {
      auto client = std::make_unique<ad::fabric>(io, test_options());
      ad::connection c = co_await client->async_connect(addr(acc), use_awaitable);
      const auto out = pattern(i == 1 ? 100000 : 64, static_cast<std::uint32_t>(i));  // (eager, rendezvous)
      co_await c.async_send(asio::buffer(out), use_awaitable);
      ad::message m = co_await c.async_receive(use_awaitable);
      CHECK(m.size() == out.size());
      m = {};
      if (i == 2) {
        c.abort();  // (the last ends without a close)
      } else {
        co_await c.async_close(use_awaitable);
      }
      c = {};
      client.reset();  // here, inside a handler of its own reactor
      ++rounds;
    }
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(rounds == 3);
}

TEST_CASE_METHOD(fabric_pair,
                 "receive into a caller's buffer: a larger message is message_size, never truncated", "[runtime]") {
  int steps = 0;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    std::vector<std::byte> small(100), big(300000);
    for (const std::size_t size : {std::size_t{101}, std::size_t{200000}}) {
      // Too large for `small`: dropped with message_size...
      auto [ec, n] = co_await c.async_receive(asio::buffer(small), asio::as_tuple(use_awaitable));
      CHECK(ec == ad::errc::message_size);
      CHECK(n == 0);
      // ...and the connection carries on with the next one.
      const std::size_t got = co_await c.async_receive(asio::buffer(big), use_awaitable);
      CHECK(got == size);
      CHECK(std::memcmp(big.data(), pattern(size, 7).data(), size) == 0);
      ++steps;
    }
    co_await c.async_send(asio::buffer("done", 4), use_awaitable);
    ad::message m = co_await c.async_receive(use_awaitable);  // waits for the client's close
  }, [&](std::exception_ptr e) {
    // The last receive ends with connection_closed (a system_error from use_awaitable).
    try {
      if (e) std::rethrow_exception(e);
      FAIL("the receive after close succeeded");
    } catch (const boost::system::system_error& se) {
      CHECK(se.code() == ad::errc::connection_closed);
    }
  });
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    for (const std::size_t size : {std::size_t{101}, std::size_t{200000}}) {
      const auto out = pattern(size, 7);
      // The rendezvous send of the too-large message fails too: the peer refused it.
      auto [ec, n] = co_await c.async_send(asio::buffer(out), asio::as_tuple(use_awaitable));
      if (size > c.eager_limit()) {
        CHECK(ec == ad::errc::message_size);
      } else {
        CHECK_FALSE(ec);
      }
      co_await c.async_send(asio::buffer(out), use_awaitable);
    }
    ad::message m = co_await c.async_receive(use_awaitable);
    CHECK(m.size() == 4);
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(steps == 2);
}

// A client connected to an echo server, both on one io_context.
struct echo_pair : fabric_pair {
  ad::connection c;
  const std::string text = "hello";
  echo_pair() {
    asio::co_spawn(io, echo_server(acc, 1), f.handler());
    client.async_connect(addr(acc), [&](ad::error_code ec, ad::connection conn) {
      REQUIRE_FALSE(ec);
      c = std::move(conn);
    });
    while (!c) io.run_one();
  }
  void finish() {
    asio::co_spawn(io, [this]() -> awaitable<void> { co_await c.async_close(use_awaitable); }, f.handler());
    run_to_completion(io);
    f.check();
  }
};

TEST_CASE("completion token: plain callbacks", "[runtime]") {
  echo_pair p;
  int callbacks = 0;
  p.c.async_send(asio::buffer(p.text), [&](ad::error_code ec, std::size_t n) {
    CHECK_FALSE(ec);
    CHECK(n == p.text.size());
    ++callbacks;
  });
  p.c.async_receive([&](ad::error_code ec, ad::message m) {
    CHECK_FALSE(ec);
    CHECK(std::string(reinterpret_cast<const char*>(m.data()), m.size()) == p.text);
    ++callbacks;
  });
  while (callbacks < 2) p.io.run_one();
  p.finish();
}

TEST_CASE("completion token: deferred runs nothing until launched", "[runtime]") {
  echo_pair p;
  auto op = p.c.async_send(asio::buffer(p.text), asio::deferred);
  for (int i = 0; i < 20; ++i) p.io.poll_one();  // (bounded: a busy reactor is always ready)
  CHECK(p.c.stats().messages_sent == 0);
  bool launched = false;
  std::move(op)([&](ad::error_code ec, std::size_t) {
    CHECK_FALSE(ec);
    launched = true;
  });
  while (!launched) p.io.run_one();
  CHECK(p.c.stats().messages_sent == 1);
  std::array<char, 16> in{};
  bool got = false;
  p.c.async_receive(asio::buffer(in), asio::deferred)([&](ad::error_code ec, std::size_t n) {
    CHECK_FALSE(ec);
    CHECK(n == p.text.size());
    got = true;
  });
  while (!got) p.io.run_one();
  p.finish();
}

TEST_CASE("completion token: use_future, and an error becomes the future's exception", "[runtime]") {
  echo_pair p;
  std::future<std::size_t> sent = p.c.async_send(asio::buffer(p.text), asio::use_future);
  std::array<char, 16> in{};
  std::future<std::size_t> got = p.c.async_receive(asio::buffer(in), asio::use_future);
  while (got.wait_for(std::chrono::seconds(0)) != std::future_status::ready) p.io.run_one();
  CHECK(sent.get() == p.text.size());
  CHECK(got.get() == p.text.size());
  // An error is thrown by get(): a message larger than the buffer.
  const std::string big(100, 'x');
  p.c.async_send(asio::buffer(big), asio::use_future);
  std::future<std::size_t> small = p.c.async_receive(asio::buffer(in), asio::use_future);
  while (small.wait_for(std::chrono::seconds(0)) != std::future_status::ready) p.io.run_one();
  try {
    small.get();
    FAIL("no exception");
  } catch (const boost::system::system_error& e) {
    CHECK(e.code() == ad::errc::message_size);
  }
  p.finish();
}

TEST_CASE("completion token: as_tuple returns the error instead of throwing", "[runtime]") {
  echo_pair p;
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    auto [ec, n] = co_await p.c.async_send(asio::buffer(p.text), asio::as_tuple(use_awaitable));
    CHECK_FALSE(ec);
    CHECK(n == p.text.size());
    std::array<char, 2> tiny{};
    auto [rec, rn] = co_await p.c.async_receive(asio::buffer(tiny), asio::as_tuple(use_awaitable));
    CHECK(rec == ad::errc::message_size);
    CHECK(rn == 0);
    co_await p.c.async_close(use_awaitable);
  }, p.f.handler());
  run_to_completion(p.io);  // returns once the echo server has seen the close
  p.f.check();
}

TEST_CASE("completion token: use_awaitable returns values and throws errors", "[runtime]") {
  echo_pair p;
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    const std::size_t n = co_await p.c.async_send(asio::buffer(p.text), use_awaitable);
    CHECK(n == p.text.size());
    ad::message m = co_await p.c.async_receive(use_awaitable);
    CHECK(m.size() == p.text.size());
    co_await p.c.async_send(asio::buffer(p.text), use_awaitable);
    std::array<char, 2> tiny{};
    try {
      co_await p.c.async_receive(asio::buffer(tiny), use_awaitable);
      FAIL("no exception");
    } catch (const boost::system::system_error& e) {
      CHECK(e.code() == ad::errc::message_size);
    }
    co_await p.c.async_close(use_awaitable);
  }, p.f.handler());
  run_to_completion(p.io);  // returns once the echo server has seen the close
  p.f.check();
}

TEST_CASE("completion token: co_await op(deferred) returns values and throws errors - as_tuple(deferred) returns them",
          "[runtime]") {
  // Asio 1.81 co_awaits a deferred operation without a coroutine frame of
  // its own: the lighter path (anydoor-micro's reactor_resume_deferred).
  echo_pair p;
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    const std::size_t n = co_await p.c.async_send(asio::buffer(p.text), asio::deferred);
    CHECK(n == p.text.size());
    ad::message m = co_await p.c.async_receive(asio::deferred);
    CHECK(std::string(reinterpret_cast<const char*>(m.data()), m.size()) == p.text);
    co_await p.c.async_send(asio::buffer(p.text), asio::deferred);
    std::array<char, 2> tiny{};
    try {
      co_await p.c.async_receive(asio::buffer(tiny), asio::deferred);
      FAIL("no exception");
    } catch (const boost::system::system_error& e) {
      CHECK(e.code() == ad::errc::message_size);
    }
    co_await p.c.async_send(asio::buffer(p.text), asio::deferred);
    auto [ec, rn] = co_await p.c.async_receive(asio::buffer(tiny), asio::as_tuple(asio::deferred));
    CHECK(ec == ad::errc::message_size);
    CHECK(rn == 0);
    co_await p.c.async_close(asio::deferred);
  }, p.f.handler());
  run_to_completion(p.io);  // returns once the echo server has seen the close
  p.f.check();
}

TEST_CASE("completion token: a callback passed as an lvalue is copied - the caller's stays whole", "[runtime]") {
  echo_pair p;
  int calls = 0;
  const auto callback = [&calls, kept = std::string(64, 'k')](ad::error_code ec, std::size_t) {
    CHECK_FALSE(ec);
    CHECK(kept == std::string(64, 'k'));
    ++calls;
  };
  p.c.async_send(asio::buffer(p.text), callback);
  auto again = callback;  // not const: a move from it would leave its string empty
  p.c.async_send(asio::buffer(p.text), again);
  std::array<char, 16> in{};
  p.c.async_receive(asio::buffer(in), again);
  p.c.async_receive(asio::buffer(in), callback);
  while (calls < 4) p.io.run_one();
  again(ad::error_code{}, 0);  // still whole (its CHECK above)
  CHECK(calls == 5);
  p.finish();
}

TEST_CASE_METHOD(fabric_pair,
                 "cancellation: a cancelled receive completes with operation_canceled: the connection stays usable",
          "[runtime]") {
  asio::cancellation_signal sig;
  ad::error_code cancelled_ec;
  bool cancelled = false;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    std::array<std::byte, 64> buf{};
    c.async_receive(asio::buffer(buf), asio::bind_cancellation_slot(sig.slot(), [&](ad::error_code ec, std::size_t) {
                      cancelled_ec = ec;
                      cancelled = true;
                    }));
    asio::steady_timer t(io, std::chrono::milliseconds(20));
    co_await t.async_wait(use_awaitable);
    sig.emit(asio::cancellation_type::terminal);
    while (!cancelled) co_await asio::post(io, use_awaitable);
    co_await c.async_send(asio::buffer("go", 2), use_awaitable);  // tell the client to send now
    const std::size_t n = co_await c.async_receive(asio::buffer(buf), use_awaitable);
    CHECK(n == 5);
    co_await c.async_close(use_awaitable);
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    ad::message go = co_await c.async_receive(use_awaitable);
    co_await c.async_send(asio::buffer("after", 5), use_awaitable);
    auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
    CHECK(ec == ad::errc::connection_closed);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(cancelled);
  CHECK(cancelled_ec == std::errc::operation_canceled);
}

TEST_CASE("handshake: a wrong or missing auth token is refused on both sides: the acceptor carries on", "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options({.auth_token = "s3cret"}));
  ad::fabric wrong(io, test_options({.auth_token = "guess"}));
  ad::fabric none(io, test_options());
  ad::fabric right(io, test_options({.auth_token = "s3cret"}));
  ad::acceptor acc = server.listen(test_host(), 0);
  std::vector<ad::error_code> server_side;
  std::vector<ad::error_code> client_side;
  failure f;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    // The refused attempts never reach the accept: it completes with the
    // one good connection.
    auto [ec, c] = co_await acc.async_accept(asio::as_tuple(use_awaitable));
    server_side.push_back(ec);
    if (!ec) {
      ad::message m = co_await c.async_receive(use_awaitable);
      co_await c.async_send(m.buffer(), use_awaitable);
      auto [cec, m2] = co_await c.async_receive(asio::as_tuple(use_awaitable));
      CHECK(cec == ad::errc::connection_closed);
    }
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    for (ad::fabric* fab : {&wrong, &none, &right}) {
      auto [ec, c] = co_await fab->async_connect(addr(acc), asio::as_tuple(use_awaitable));
      client_side.push_back(ec);
      if (!ec) {
        co_await c.async_send(asio::buffer("x", 1), use_awaitable);
        ad::message m = co_await c.async_receive(use_awaitable);
        CHECK(m.size() == 1);
        co_await c.async_close(use_awaitable);
      }
    }
  }, f.handler());
  run_to_completion(io);
  f.check();
  REQUIRE(server_side.size() == 1);
  REQUIRE(client_side.size() == 3);
  CHECK_FALSE(server_side[0]);
  CHECK(client_side[0] == ad::errc::authentication_failed);
  CHECK(client_side[1] == ad::errc::authentication_failed);
  CHECK_FALSE(client_side[2]);
  CHECK(server.stats().refused == 2);
  CHECK(wrong.stats().refused == 1);
}

TEST_CASE("handshake: an unknown protocol version or a malformed hello is refused on both sides", "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  std::vector<ad::error_code> server_side;
  failure f;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    auto [ec, c] = co_await acc.async_accept(asio::as_tuple(use_awaitable));  // ends when closed
    server_side.push_back(ec);
  }, f.handler());
  // A raw provider-level client speaking "version 2", then one sending garbage.
  std::vector<tp::connect_result> results;
  std::thread raw([&] {
    auto dev = open_test_device();
    auto pd = dev->alloc_pd();
    auto cq = dev->create_cq(64);
    for (int i = 0; i < 3; ++i) {
      auto qp = pd->create_qp({.send_cq = cq.get(), .recv_cq = cq.get()});
      // version 9, then a bad magic, then a window (max credits) below the credits granted
      const auto hello = i == 0   ? raw_hello(9)
                         : i == 1 ? raw_hello(kWireVersion, 0x31524400)
                                  : raw_hello(kWireVersion, 0x31524441, 7);
      results.push_back(dev->connect(*qp, test_host(), acc.port(), hello, std::chrono::seconds(10)));
    }
    asio::post(io, [&] { acc.close(); });  // both refused: the accept was still waiting
  });
  run_to_completion(io);
  raw.join();
  f.check();
  REQUIRE(server_side.size() == 1);
  CHECK(server_side[0] == std::errc::operation_canceled);
  CHECK(server.stats().refused == 3);
  REQUIRE(results.size() == 3);
  CHECK(results[0].ec == ad::errc::connection_rejected);
  CHECK(results[0].private_data.size() >= 8);
  CHECK(std::to_integer<int>(results[0].private_data[7]) == 1);  // refuse reason: version
  CHECK(results[1].ec == ad::errc::connection_rejected);
  CHECK(results[2].ec == ad::errc::connection_rejected);
  REQUIRE(results[2].private_data.size() >= 8);
  CHECK(std::to_integer<int>(results[2].private_data[7]) == 3);  // refuse reason: malformed
}

TEST_CASE("connect errors: malformed address, nobody listening, too many connections", "[runtime]") {
  asio::io_context io;
  auto o = test_options();
  o.max_connections = 1;
  ad::fabric server(io, o);
  ad::fabric client(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  std::vector<ad::error_code> got;
  failure f;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    for (const char* bad : {"nohost", "host:0", "host:70000", ":5", "host:12x"}) {
      auto [ec, c] = co_await client.async_connect(bad, asio::as_tuple(use_awaitable));
      CHECK(ec == ad::errc::invalid_argument);
    }
    ad::acceptor closed = client.listen(test_host(), 0);
    const std::string dead = addr(closed);
    closed = ad::acceptor{};
    auto [ec, c] = co_await client.async_connect(dead, asio::as_tuple(use_awaitable));
    CHECK(ec == ad::errc::connection_refused);
    // The server holds one connection; a second is refused for resources.
    ad::connection first = co_await client.async_connect(addr(acc), use_awaitable);
    auto [ec2, c2] = co_await client.async_connect(addr(acc), asio::as_tuple(use_awaitable));
    got.push_back(ec2);
    co_await first.async_close(use_awaitable);
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection one = co_await acc.async_accept(use_awaitable);
    // The second attempt is refused for resources; this accept keeps
    // waiting (it completes when the acceptor closes).
    acc.async_accept([&](ad::error_code ec, ad::connection) { got.push_back(ec); });
    auto [rec, m] = co_await one.async_receive(asio::as_tuple(use_awaitable));
    CHECK(rec == ad::errc::connection_closed);
    acc.close();
  }, f.handler());
  run_to_completion(io);
  f.check();
  REQUIRE(got.size() == 2);
  CHECK(got[0] == ad::errc::too_many_connections);
  CHECK(got[1] == std::errc::operation_canceled);
  CHECK(server.stats().refused == 1);
}

TEST_CASE("credits: a flood against a slow receiver waits for credits, never causes RNR, loses nothing",
          "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options({.credits = 8}));
  ad::fabric client(io, test_options({.credits = 8}));
  ad::acceptor acc = server.listen(test_host(), 0);
  constexpr std::uint32_t kMessages = 3000;
  failure f;
  std::uint32_t received = 0;
  ad::connection_stats server_stats, client_stats;
  // The devices' own counters (verbs: the NIC's, which the connection
  // stats cannot see; they must be readable there, or this check is empty).
  const auto server0 = server.device().counters(), client0 = client.device().counters();
  const bool server_counts = device_keeps(server.device(), server0.rnr_naks_sent, "rnr_naks_sent");
  const bool client_counts = device_keeps(client.device(), client0.rnr_naks_received, "rnr_naks_received");
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    asio::steady_timer t(io, std::chrono::milliseconds(100));  // let the sender run out of credits
    co_await t.async_wait(use_awaitable);
    for (std::uint32_t i = 0; i < kMessages; ++i) {
      ad::message m = co_await c.async_receive(use_awaitable);
      std::uint32_t v = 0;
      REQUIRE(m.size() == 300);
      std::memcpy(&v, m.data(), 4);
      REQUIRE(v == i);
      ++received;
    }
    server_stats = c.stats();
    co_await c.async_send(asio::buffer("ok", 2), use_awaitable);
    auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
    CHECK(ec == ad::errc::connection_closed);
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    std::array<std::byte, 300> out{};
    for (std::uint32_t i = 0; i < kMessages; ++i) {
      std::memcpy(out.data(), &i, 4);
      co_await c.async_send(asio::buffer(out), use_awaitable);
    }
    ad::message m = co_await c.async_receive(use_awaitable);
    client_stats = c.stats();
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(received == kMessages);
  CHECK(client_stats.credit_stalls > 0);
  CHECK(client_stats.rnr_naks == 0);
  CHECK(server_stats.rnr_naks == 0);
  if (server_counts) CHECK(*server.device().counters().rnr_naks_sent == *server0.rnr_naks_sent);
  if (client_counts) CHECK(*client.device().counters().rnr_naks_received == *client0.rnr_naks_received);
  CHECK(server_stats.credit_messages > 0);  // the receiver returned credits while it had nothing to send
}

TEST_CASE("credits: two idle peers that hold what the other sent do not pass a credit to and fro", "[runtime]") {
  // A window of 4; each side sends 2 and its peer's application takes
  // neither: both sides are near their control credit, heartbeats (every
  // 100 ms) cost a receive each. A lone credit goes back for a heartbeat,
  // but none for a lone credit, or the two would trade one at the round
  // trip's rate for as long as they stay idle.
  asio::io_context io;
  const ad::fabric_options o = test_options({.credits = 4, .keepalive = std::chrono::milliseconds(400)});
  ad::fabric server(io, o);
  ad::fabric client(io, o);
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  // (The connections live in their coroutines: a handle dropped after the
  // io_context stopped could not drain, and LeakSanitizer would see it.)
  ad::connection_stats s_idle, c_idle;
  auto side = [&](ad::connection& c, ad::connection_stats& idle) -> awaitable<void> {
    for (int i = 0; i < 2; ++i) co_await c.async_send(asio::buffer("held", 4), use_awaitable);
    const ad::connection_stats before = c.stats();
    asio::steady_timer t(io, std::chrono::milliseconds(1000));
    co_await t.async_wait(use_awaitable);
    idle = c.stats();
    idle.credit_messages -= before.credit_messages;
    idle.heartbeats -= before.heartbeats;
    for (int i = 0; i < 2; ++i) {
      ad::message m = co_await c.async_receive(use_awaitable);
      CHECK(m.size() == 4);
    }
  };
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection sc = co_await acc.async_accept(use_awaitable);
    co_await side(sc, s_idle);
    auto [ec, m] = co_await sc.async_receive(asio::as_tuple(use_awaitable));
    CHECK(ec == ad::errc::connection_closed);
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection cc = co_await client.async_connect(addr(acc), use_awaitable);
    co_await side(cc, c_idle);
    co_await cc.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  INFO("idle second: server " << s_idle.credit_messages << " credit messages, " << s_idle.heartbeats
                              << " heartbeats; client " << c_idle.credit_messages << ", " << c_idle.heartbeats);
  CHECK(s_idle.heartbeats + c_idle.heartbeats > 0);  // the heartbeats ran (the case this is about)
  // Heartbeats every 100 ms and at most one lone credit for each: some 40
  // messages in the second; a credit passed to and fro makes thousands.
  CHECK(s_idle.credit_messages + s_idle.heartbeats + c_idle.credit_messages + c_idle.heartbeats < 80);
}

TEST_CASE("batching: sends issued in one turn share a doorbell: only some are signaled", "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::fabric client(io, test_options({.signal_interval = 8}));
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  asio::co_spawn(io, echo_server(acc, 1), f.handler());
  ad::connection_stats s;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    constexpr int kBurst = 48;
    std::array<std::byte, 32> out{};
    int done = 0;
    for (int i = 0; i < kBurst; ++i) {
      c.async_send(asio::buffer(out), [&](ad::error_code ec, std::size_t) {
        CHECK_FALSE(ec);
        ++done;
      });
    }
    for (int i = 0; i < kBurst; ++i) co_await c.async_receive(use_awaitable);
    CHECK(done == kBurst);
    s = c.stats();
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(s.posts >= 48);
  CHECK(s.doorbells < s.posts / 4);
  CHECK(s.signaled < s.posts / 4);
}

// A ping-pong of small messages: each doorbell holds one inline message
// with no operation, so its tail stays unsignaled (flush_now) and only
// every signal_interval-th message takes a send completion. A flush
// behind such a tail queues a signaled marker (a zero-length RDMA WRITE)
// and completes with it; nothing is left behind when the connection ends.
TEST_CASE("selective signaling: a ping-pong's messages are signaled once per signal_interval - a flush behind them "
          "adds one marker",
          "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options({.signal_interval = 8}));
  ad::fabric client(io, test_options({.signal_interval = 8}));
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  asio::co_spawn(io, echo_server(acc, 1), f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    std::array<std::byte, 32> out{};
    constexpr int kRounds = 61;  // 61 = 7 * 8 + 5: the last 5 are an unsignaled tail
    const ad::connection_stats s0 = c.stats();
    for (int i = 0; i < kRounds; ++i) {
      co_await c.async_send(asio::buffer(out), use_awaitable);
      co_await c.async_receive(use_awaitable);
    }
    const ad::connection_stats s1 = c.stats();
    const std::uint64_t posts = s1.posts - s0.posts, signaled = s1.signaled - s0.signaled;
    CHECK(s1.inline_sends - s0.inline_sends == kRounds);
    CHECK(posts >= kRounds);
    // One per 8 messages (7), and control messages (credits) if any: each
    // doorbell's last was signaled before (61).
    CHECK(signaled <= static_cast<std::uint64_t>(kRounds / 8 + (posts - kRounds)));
    CHECK(signaled >= static_cast<std::uint64_t>(kRounds / 8));
    // The tail's 5 have no completion coming: the flush's marker brings one
    // at once (without it, only the next heartbeat would, seconds later).
    const auto t0 = std::chrono::steady_clock::now();
    co_await c.async_flush(use_awaitable);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1));
    const ad::connection_stats s2 = c.stats();
    CHECK(s2.heartbeats == s1.heartbeats);
    CHECK(s2.posts == s1.posts + 1);
    CHECK(s2.signaled == s1.signaled + 1);
    CHECK(s2.flushes == s1.flushes + 1);
    // Nothing uncovered now: a second flush posts nothing.
    co_await c.async_flush(use_awaitable);
    CHECK(c.stats().posts == s2.posts);
    // A flush behind a send: one signaled request either way (the send, or
    // a marker behind it where the lone send rang its doorbell at once).
    c.async_send(asio::buffer(out), [](ad::error_code ec, std::size_t) { CHECK_FALSE(ec); });
    co_await c.async_flush(use_awaitable);
    const ad::connection_stats s3 = c.stats();
    CHECK(s3.posts - s2.posts >= 1);
    CHECK(s3.posts - s2.posts <= 2);
    CHECK(s3.signaled == s2.signaled + 1);
    co_await c.async_receive(use_awaitable);
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io, std::chrono::seconds(20));
  f.check();
  CHECK(client.stats().connections == 0);
  CHECK(server.stats().connections == 0);
}

// A queue pair in error completes, flushed, what it has not executed; a
// request it executed unsignaled never completes. The connection posts a
// signaled marker behind an unsignaled tail when it ends (cover_tail), or
// it would wait for that tail for ever: never released, its reactor never
// idle.
TEST_CASE("selective signaling: a connection that ends behind an unsignaled tail is released - abort, close, the "
          "peer's close, a dropped handle",
          "[runtime]") {
  const auto how = GENERATE(as<std::string>{}, "abort", "close", "peer close", "drop");
  CAPTURE(how);
  asio::io_context io;
  ad::fabric server(io, test_options({.signal_interval = 8}));
  ad::fabric client(io, test_options({.signal_interval = 8}));
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  std::optional<ad::connection> served;
  std::uint64_t client_tail = 0, server_tail = 0;
  bool client_ended = false;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection s = co_await acc.async_accept(use_awaitable);
    for (int i = 0; i < 5; ++i) {
      ad::message m = co_await s.async_receive(use_awaitable);
      co_await s.async_send(m.buffer(), use_awaitable);
    }
    server_tail = s.stats().posts - s.stats().signaled;
    if (how == "peer close") {
      co_await s.async_close(use_awaitable);
    } else {
      served.emplace(std::move(s));  // its peer ends it
    }
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    std::array<std::byte, 16> out{};
    for (int i = 0; i < 5; ++i) {
      co_await c.async_send(asio::buffer(out), use_awaitable);
      co_await c.async_receive(use_awaitable);
    }
    client_tail = c.stats().posts - c.stats().signaled;
    if (how == "abort") {
      c.abort();
    } else if (how == "close") {
      co_await c.async_close(use_awaitable);
    } else if (how == "peer close") {
      auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
      CHECK(ec == ad::errc::connection_closed);
    }
    client_ended = true;
    // "drop" and "peer close": the handle goes with the coroutine.
  }, f.handler());
  run_until(io, [&] { return client_ended && (served.has_value() || how == "peer close"); });
  // At once: the marker comes back (the fallback would take a second).
  const auto t0 = std::chrono::steady_clock::now();
  run_until(io, [&] { return client.stats().connections == 0; }, std::chrono::seconds(5));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(900));
  // The server's handle ends its side.
  const auto t1 = std::chrono::steady_clock::now();
  served.reset();
  run_until(io, [&] { return server.stats().connections == 0; }, std::chrono::seconds(5));
  CHECK(std::chrono::steady_clock::now() - t1 < std::chrono::milliseconds(900));
  run_to_completion(io, std::chrono::seconds(20));
  f.check();
  CHECK(client.stats().reactor.stray == 0);  // every completion named a request outstanding
  CHECK(server.stats().reactor.stray == 0);
  // Both sides had a tail of unsignaled messages when the connection ended.
  CHECK(client_tail >= 4);
  CHECK(server_tail >= 4);
  CHECK(client.stats().connections == 0);
  CHECK(server.stats().connections == 0);
}

TEST_CASE_METHOD(fabric_pair,
                 "batching: a lone send rings in its call - sends from a pass or from handlers never do nor run inline",
          "[runtime]") {
  asio::co_spawn(io, echo_server(acc, 1), f.handler());
  constexpr std::uint64_t kUnset = 99;
  std::uint64_t lone = kUnset, from_posted_handler = kUnset, in_pass = kUnset, from_flush_handler = kUnset;
  bool ran_in_call = true, flush_handler_ran = false;
  int echoes = 0;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    auto ex = co_await asio::this_coro::executor;
    std::array<std::byte, 32> out{};
    auto noop = [](ad::error_code ec, std::size_t) { CHECK_FALSE(ec); };
    // Two turns of one send each: a ping-pong.
    for (int i = 0; i < 2; ++i) {
      co_await asio::post(ex, use_awaitable);
      co_await c.async_send(asio::buffer(out), use_awaitable);
      co_await c.async_receive(use_awaitable);
      ++echoes;
    }
    co_await asio::post(ex, use_awaitable);  // outside any completion
    std::uint64_t d = c.stats().doorbells;
    c.async_send(asio::buffer(out), [&](ad::error_code ec, std::size_t) {
      CHECK_FALSE(ec);
      // A send's handler, posted: what it issues is batched.
      const std::uint64_t d1 = c.stats().doorbells;
      c.async_send(asio::buffer(out), noop);
      from_posted_handler = c.stats().doorbells - d1;
    });
    lone = c.stats().doorbells - d;  // before any io_context round
    for (int i = 0; i < 2; ++i, ++echoes) co_await c.async_receive(use_awaitable);
    // Resumed inside the reactor's pass by the last echo: a send issued
    // here goes at the pass's end, its handler right after its doorbell.
    d = c.stats().doorbells;
    bool ran = false;
    c.async_send(asio::buffer(out), [&](ad::error_code ec, std::size_t) {
      CHECK_FALSE(ec);
      ran = true;
      flush_handler_ran = true;
      // Run by that flush: what it issues is batched too.
      const std::uint64_t d1 = c.stats().doorbells;
      c.async_send(asio::buffer(out), noop);
      from_flush_handler = c.stats().doorbells - d1;
    });
    ran_in_call = ran;
    in_pass = c.stats().doorbells - d;
    for (int i = 0; i < 2; ++i, ++echoes) co_await c.async_receive(use_awaitable);
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(echoes == 6);
  CHECK(lone == 1);
  CHECK(from_posted_handler == 0);
  CHECK(in_pass == 0);
  CHECK_FALSE(ran_in_call);
  CHECK(flush_handler_ran);
  CHECK(from_flush_handler == 0);
}

TEST_CASE_METHOD(fabric_pair,
                 "batching: a burst beyond the batch's inline staging goes on in pool buffers, whole and in order",
          "[runtime]") {
  // 40 sends of 200 bytes (216 on the wire, inline-sized) in one turn: a
  // batch stages at most 4 KiB of inline bytes, so about 18 go inline and
  // the rest in pool buffers, in the same doorbell when the queue allows.
  asio::co_spawn(io, echo_server(acc, 1), f.handler());
  ad::connection_stats s;
  constexpr int kBurst = 40;
  int done = 0, intact = 0;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    std::vector<std::vector<std::byte>> out;
    for (int i = 0; i < kBurst; ++i) out.push_back(pattern(200, static_cast<std::uint32_t>(i)));
    for (int i = 0; i < kBurst; ++i) {
      c.async_send(asio::buffer(out[static_cast<std::size_t>(i)]), [&](ad::error_code ec, std::size_t n) {
        CHECK_FALSE(ec);
        CHECK(n == 200);
        ++done;
      });
    }
    for (int i = 0; i < kBurst; ++i) {
      ad::message m = co_await c.async_receive(use_awaitable);
      if (m.size() == 200 && std::memcmp(m.data(), out[static_cast<std::size_t>(i)].data(), 200) == 0) ++intact;
    }
    s = c.stats();
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(done == kBurst);
  CHECK(intact == kBurst);
  CHECK(s.eager_sends == kBurst);
  if (client.device().caps().max_inline >= 216) {  // (siw's is 104: none goes inline there)
    CHECK(s.inline_sends > 0);
    CHECK(s.inline_sends < kBurst);  // the staging ran short: the case under test
  }
}

TEST_CASE("a send started by a completion's handler completes once posted, before handlers posted meanwhile",
          "[runtime]") {
  echo_pair p;
  std::vector<std::string> order;
  int echoes = 0;
  p.c.async_send(asio::buffer(p.text), [](ad::error_code ec, std::size_t) { CHECK_FALSE(ec); });
  p.c.async_receive([&](ad::error_code ec, ad::message) {
    CHECK_FALSE(ec);
    ++echoes;
    // Runs inside the reactor's pass: the reply's completion comes right
    // after its doorbell, with no handler of its own on the io_context.
    asio::post(p.io, [&] { order.push_back("posted"); });
    p.c.async_send(asio::buffer(p.text), [&](ad::error_code sec, std::size_t n) {
      CHECK_FALSE(sec);
      CHECK(n == p.text.size());
      order.push_back("sent");
    });
    p.c.async_receive([&](ad::error_code rec, ad::message m) {
      CHECK_FALSE(rec);
      CHECK(m.size() == p.text.size());
      ++echoes;
    });
  });
  while (echoes < 2 || order.size() < 2) REQUIRE(p.io.run_one() == 1);
  CHECK(order == std::vector<std::string>{"sent", "posted"});
  p.finish();
}

TEST_CASE("a send started by a completion's handler fails if its connection fails before the doorbell",
          "[runtime]") {
  echo_pair p;
  ad::error_code send_ec;
  int sends = 0;
  bool received = false;
  p.c.async_send(asio::buffer(p.text), [](ad::error_code ec, std::size_t) { CHECK_FALSE(ec); });
  p.c.async_receive([&](ad::error_code ec, ad::message) {
    CHECK_FALSE(ec);
    received = true;
    p.c.async_send(asio::buffer(p.text), [&](ad::error_code sec, std::size_t) {
      send_ec = sec;
      ++sends;
    });
    p.c.abort();  // the queued send never reaches the wire: it must not report success
  });
  while (!received || sends == 0) REQUIRE(p.io.run_one() == 1);
  CHECK(sends == 1);
  CHECK(send_ec == ad::errc::connection_closed);
  p.c = ad::connection();
  run_to_completion(p.io);
  p.f.check();
}

TEST_CASE("busy polling: a coroutine ping-pong needs about one io_context handler per message and side",
          "[runtime]") {
  // Completions resume the coroutines inside the reactor's pass, their
  // sends complete at the doorbell and what they queue is flushed before the
  // next poll: no handler is posted per message, only the reactor's own
  // next round.
  // ANYDOOR_POLL overrides reactor_options::mode: pin it to busy for this
  // test (a run with ANYDOOR_POLL=event must still check), then restore it.
  struct poll_env {
    std::string saved;
    bool had = false;
    poll_env() {
      if (const char* v = std::getenv("ANYDOOR_POLL")) {
        saved = v;
        had = true;
      }
      ::setenv("ANYDOOR_POLL", "busy", 1);
    }
    ~poll_env() {
      if (had) {
        ::setenv("ANYDOOR_POLL", saved.c_str(), 1);
      } else {
        ::unsetenv("ANYDOOR_POLL");
      }
    }
    poll_env(const poll_env&) = delete;
    poll_env& operator=(const poll_env&) = delete;
  } busy_env;
  asio::io_context io;
  ad::fabric_options o = test_options();
  o.reactor.mode = ad::poll_mode::busy;
  o.reactor.spin_polls = 4;
  ad::fabric server(io, o);
  ad::fabric client(io, o);
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  asio::co_spawn(io, echo_server(acc, 1), f.handler());
  constexpr int kTrips = 500;
  int trips = 0;
  bool closed = false;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    std::array<std::byte, 64> out{};
    for (; trips < kTrips; ++trips) {
      co_await c.async_send(asio::buffer(out), use_awaitable);
      ad::message m = co_await c.async_receive(use_awaitable);
      if (m.size() != out.size()) throw std::runtime_error("echo of the wrong size");
    }
    co_await c.async_close(use_awaitable);
    closed = true;
  }, f.handler());
  while (trips == 0) REQUIRE(io.run_one() == 1);  // connected, first echo back
  std::size_t handlers = 0;
  const int first = trips;
  while (trips < kTrips) handlers += io.run_one();
  const int measured = trips - first;
  INFO(handlers << " handlers for " << measured << " round trips");
  // Two reactors on one thread: each round trip takes at least one round of
  // each; a handler per completion would make it at least four.
  CHECK(handlers <= static_cast<std::size_t>(measured) * 3);
  run_to_completion(io);
  f.check();
  CHECK(closed);
}

TEST_CASE_METHOD(fabric_pair, "close: both sides closing at once both complete, and run() returns", "[runtime]") {
  int closed = 0;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    ad::message m = co_await c.async_receive(use_awaitable);
    co_await c.async_send(m.buffer(), use_awaitable);
    co_await c.async_close(use_awaitable);  // while the client closes too
    ++closed;
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    const std::string text = "bye";
    co_await c.async_send(asio::buffer(text), use_awaitable);
    ad::message m = co_await c.async_receive(use_awaitable);
    co_await c.async_close(use_awaitable);
    ++closed;
  }, f.handler());
  run_to_completion(io, std::chrono::seconds(30));
  f.check();
  CHECK(closed == 2);
}

TEST_CASE_METHOD(fabric_pair,
                 "gather: a buffer sequence is one message: more than 16 buffers is invalid_argument", "[runtime]") {
  asio::co_spawn(io, echo_server(acc, 1), f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    const std::string a = "alpha", b = "-beta-", d(5000, 'g');
    std::array<asio::const_buffer, 3> seq{asio::buffer(a), asio::buffer(b), asio::buffer(d)};
    const std::size_t n = co_await c.async_send(seq, use_awaitable);
    CHECK(n == a.size() + b.size() + d.size());
    ad::message m = co_await c.async_receive(use_awaitable);
    CHECK(std::string(reinterpret_cast<const char*>(m.data()), m.size()) == a + b + d);
    std::vector<asio::const_buffer> many(17, asio::buffer(a));
    auto [ec, n2] = co_await c.async_send(many, asio::as_tuple(use_awaitable));
    CHECK(ec == ad::errc::invalid_argument);
    // A rendezvous message must be one buffer.
    const std::string big(20000, 'r');
    std::array<asio::const_buffer, 2> two{asio::buffer(big), asio::buffer(big)};
    auto [ec3, n3] = co_await c.async_send(two, asio::as_tuple(use_awaitable));
    CHECK(ec3 == ad::errc::invalid_argument);
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
}

TEST_CASE("a message above the peer's maximum fails with message_size at the sender", "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options({.eager_limit = 512, .max_message = 4096}));
  ad::fabric client(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  asio::co_spawn(io, echo_server(acc, 1), f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    CHECK(c.peer().max_message == 4096);
    CHECK(c.eager_limit() <= 576);  // capped by the server's receive buffers
    std::vector<std::byte> out(4097);
    auto [ec, n] = co_await c.async_send(asio::buffer(out), asio::as_tuple(use_awaitable));
    CHECK(ec == ad::errc::message_size);
    co_await c.async_send(asio::buffer(out.data(), 4096), use_awaitable);  // rendezvous at the limit
    ad::message m = co_await c.async_receive(use_awaitable);
    CHECK(m.size() == 4096);
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
}

TEST_CASE_METHOD(fabric_pair,
                 "peer death: pending operations fail exactly once, other connections carry on", "[runtime]") {
  std::vector<ad::error_code> endings;
  asio::co_spawn(io, echo_server(acc, 2, &endings), f.handler());
  int victim_failures = 0;
  ad::error_code victim_ec;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection victim = co_await client.async_connect(addr(acc), use_awaitable);
    ad::connection survivor = co_await client.async_connect(addr(acc), use_awaitable);
    co_await victim.async_send(asio::buffer("v", 1), use_awaitable);
    co_await victim.async_receive(use_awaitable);
    // A receive pending on the victim when it dies (abort: its socket or
    // queue pair is torn down as if the process had died).
    std::array<std::byte, 8> buf{};
    victim.async_receive(asio::buffer(buf), [&](ad::error_code ec, std::size_t) {
      victim_ec = ec;
      ++victim_failures;
    });
    victim.abort();
    CHECK_FALSE(victim.is_open());
    auto [ec, n] = co_await victim.async_send(asio::buffer("x", 1), asio::as_tuple(use_awaitable));
    CHECK(ec == ad::errc::connection_closed);
    for (int i = 0; i < 20; ++i) {
      co_await survivor.async_send(asio::buffer("s", 1), use_awaitable);
      ad::message m = co_await survivor.async_receive(use_awaitable);
      CHECK(m.size() == 1);
    }
    co_await survivor.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(victim_failures == 1);
  CHECK(victim_ec == ad::errc::connection_closed);
  // The server saw one connection die with a transport error and one close.
  REQUIRE(endings.size() == 2);
  int closed = 0, died = 0;
  for (auto ec : endings) {
    if (ec == ad::errc::connection_closed) {
      ++closed;
    } else if (std::error_code(ec).category() == tp::wc_category()) {  // boost wraps the std category
      ++died;
    }
  }
  CHECK(closed == 1);
  CHECK(died == 1);
}


TEST_CASE("peer death: a killed peer process fails the pending receive of a sleeping reactor", "[runtime]") {
  const std::string peer = sibling("anydoor-test-peer");
  REQUIRE(::access(peer.c_str(), X_OK) == 0);
  asio::io_context io;
  auto o = test_options();
  o.reactor.mode = ad::poll_mode::event;  // asleep on the notify fd when the peer dies
  ad::fabric server(io, o);
  ad::acceptor acc = server.listen(test_host(), 0);
  const std::string where = addr(acc);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::execl(peer.c_str(), peer.c_str(), where.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  failure f;
  int completions = 0;
  ad::error_code pending_ec;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    ad::message ready = co_await c.async_receive(use_awaitable);
    CHECK(ready.size() == 5);
    acc.close();
    std::array<std::byte, 16> buf{};
    c.async_receive(asio::buffer(buf), [&](ad::error_code ec, std::size_t) {
      pending_ec = ec;
      ++completions;
    });
    // Let the reactor go to sleep, then kill the peer.
    asio::steady_timer t(io, std::chrono::milliseconds(50));
    co_await t.async_wait(use_awaitable);
    ::kill(pid, SIGKILL);
    while (completions == 0) {
      asio::steady_timer w(io, std::chrono::milliseconds(5));
      co_await w.async_wait(use_awaitable);
    }
  }, f.handler());
  run_to_completion(io, std::chrono::seconds(30));
  int status = 0;
  ::waitpid(pid, &status, 0);
  f.check();
  CHECK(WIFSIGNALED(status));
  CHECK(completions == 1);
  CHECK(pending_ec);
  CHECK(std::error_code(pending_ec).category() == tp::wc_category());
}

TEST_CASE("a peer's malformed messages fail its connection with protocol_error, never a crash", "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  // Raw provider-level clients: a valid hello, then one bad message each.
  struct bad {
    const char* what;
    std::vector<std::byte> bytes;
  };
  auto header = [](std::uint8_t type, std::uint8_t status, std::uint16_t credits, std::uint32_t aux) {
    std::vector<std::byte> h(8);
    h[0] = std::byte{type};
    h[1] = std::byte{status};
    std::memcpy(h.data() + 2, &credits, 2);
    std::memcpy(h.data() + 4, &aux, 4);
    return h;
  };
  std::vector<bad> cases = {
      {"unknown type", header(10, 0, 0, 0)},
      {"withdraw with an unknown status", header(9, 2, 0, 5)},
      {"an answer to a withdrawal never asked", header(9, 1, 0, 5)},
      {"withdraw with a body", [&] {
         auto m = header(9, 0, 0, 5);
         m.resize(12);
         return m;
       }()},
      {"fin with an unknown status", header(3, 5, 0, 77)},
      {"short message", std::vector<std::byte>(3)},
      {"more credits than receives", header(4, 0, 60000, 0)},
      {"fin for an unknown rendezvous", header(3, 0, 0, 77)},
      {"rendezvous request of the wrong size", header(2, 0, 0, 0)},
  };
  std::vector<std::vector<std::vector<std::byte>>> sequences;
  for (const bad& b : cases) sequences.push_back({b.bytes});
  const raw_judgement r = judge_raw_sequences(io, acc, sequences);
  CHECK(r.raw_ok);
  CHECK(r.left_open == 0);
  REQUIRE(r.ends.size() == cases.size());
  for (std::size_t i = 0; i < cases.size(); ++i) {
    INFO(cases[i].what);
    CHECK(r.ends[i] == ad::errc::protocol_error);
  }
}

namespace {
// A buffer pool of 8 buffers in all (8 KiB receive buffers and their
// headers, in whole pages): two connections of 4 credits take every one.
ad::fabric_options eight_buffers(ad::fabric_options o) {
  o.buffers_per_slab = 8;
  o.pool_max_bytes = (8 * (8192 + 64) + 4095) / 4096 * 4096;
  return o;
}
}  // namespace

TEST_CASE("buffer pool: sends wait for a buffer (bounded), then proceed or fail with no_buffer_space", "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options({.credits = 4}));
  auto o = eight_buffers(test_options({.credits = 4, .buffer_wait = std::chrono::milliseconds(200)}));
  ad::fabric client(io, o);
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  asio::co_spawn(io, echo_server(acc, 2), f.handler());
  ad::error_code first, second;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection a = co_await client.async_connect(addr(acc), use_awaitable);
    ad::connection b = co_await client.async_connect(addr(acc), use_awaitable);
    CHECK(client.stats().pool.free == 0);
    const std::vector<std::byte> out(1000);  // above the inline limit: needs a pool buffer
    auto [ec, n] = co_await a.async_send(asio::buffer(out), asio::as_tuple(use_awaitable));
    first = ec;
    CHECK(client.stats().pool.exhausted > 0);
    // Now free b's receive buffers while a's send waits.
    bool done = false;
    a.async_send(asio::buffer(out), [&](ad::error_code e, std::size_t) {
      second = e;
      done = true;
    });
    b.abort();
    while (!done) co_await asio::post(io, use_awaitable);
    ad::message m = co_await a.async_receive(use_awaitable);
    CHECK(m.size() == 1000);
    co_await a.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(first == ad::errc::no_buffer_space);
  CHECK_FALSE(second);
}

TEST_CASE("buffer pool: a connection or a shared receive queue the pool cannot hold fails with no_buffer_space",
          "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options({.credits = 4}));
  auto o = eight_buffers(test_options({.credits = 4}));
  ad::fabric client(io, o);
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  asio::co_spawn(io, echo_server(acc, 2), f.handler());
  ad::error_code third;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection a = co_await client.async_connect(addr(acc), use_awaitable);
    ad::connection b = co_await client.async_connect(addr(acc), use_awaitable);
    CHECK(client.stats().pool.free == 0);
    auto [ec, c] = co_await client.async_connect(addr(acc), asio::as_tuple(use_awaitable));
    third = ec;
    CHECK(client.stats().connections == 2);
    co_await a.async_close(use_awaitable);
    co_await b.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(third == ad::errc::no_buffer_space);
  // A shared receive queue of 16 buffers from a pool of 8.
  auto so = o;
  so.srq_buffers = 16;
  try {
    ad::fabric srq(io, so);
    FAIL("a fabric whose pool cannot hold its shared receive queue was made");
  } catch (const std::system_error& e) {
    CHECK(e.code() == ad::errc::no_buffer_space);
    CHECK(std::string(e.what()).find("srq_buffers 16") != std::string::npos);
  }
}

TEST_CASE("buffer_pool: free list, growth to the watermark, counters, bad options", "[runtime][unit]") {
  auto dev = open_test_device();
  auto pd = dev->alloc_pd();
  ad::buffer_pool pool(*pd, {.buffer_size = 1000, .buffers_per_slab = 4, .initial_slabs = 1, .max_bytes = 3 * 4096});
  CHECK(pool.buffer_size() == 1024);
  CHECK(pool.capacity() == 12);
  CHECK(pool.stats().slabs == 1);
  std::vector<std::uint32_t> got;
  for (int i = 0; i < 12; ++i) {
    const std::uint32_t b = pool.try_get();
    REQUIRE(b != ad::buffer_pool::npos);
    CHECK(reinterpret_cast<std::uintptr_t>(pool.data(b)) % 64 == 0);
    std::memset(pool.data(b), i, pool.buffer_size());  // every buffer is usable memory
    got.push_back(b);
  }
  CHECK(pool.stats().slabs == 3);
  CHECK(pool.try_get() == ad::buffer_pool::npos);
  CHECK(pool.stats().exhausted == 1);
  std::sort(got.begin(), got.end());
  CHECK(std::adjacent_find(got.begin(), got.end()) == got.end());
  pool.put(got[5]);
  CHECK(pool.try_get() == got[5]);
  CHECK(pool.stats().gets == 13);
  CHECK(pool.stats().puts == 1);
  using E = std::system_error;
  CHECK_THROWS_AS(ad::buffer_pool(*pd, {.buffer_size = 0}), E);
  CHECK_THROWS_AS(ad::buffer_pool(*pd, {.buffers_per_slab = 0}), E);
  CHECK_THROWS_AS(ad::buffer_pool(*pd, {.buffer_size = 4096, .buffers_per_slab = 4, .max_bytes = 4096}), E);
  CHECK_THROWS_AS(ad::buffer_pool(*pd, {.buffer_size = 64, .buffers_per_slab = 64, .initial_slabs = 3, .max_bytes = 8192}), E);
}

TEST_CASE("fabric options are checked - each refusal names its option", "[runtime][unit]") {
  asio::io_context io;
  // Refused with invalid_argument, the message naming `option`.
  auto bad = [&](auto mutate, std::string_view option) {
    ad::fabric_options o = test_options();
    mutate(o);
    try {
      ad::fabric fab(io, o);
    } catch (const std::system_error& e) {
      INFO("refused: " << e.what());
      return e.code() == ad::errc::invalid_argument && std::string_view(e.what()).find(option) != std::string_view::npos;
    }
    return false;
  };
  CHECK(bad([](ad::fabric_options& o) { o.max_connections = 0; }, "max_connections"));
  CHECK(bad([](ad::fabric_options& o) { o.max_connections = 5000; }, "max_connections"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.credits = 3; }, "credits"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.credits = 5000; }, "credits"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.eager_limit = 0; }, "eager_limit"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.eager_limit = (1u << 20) + 1; }, "eager_limit"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.max_message = 0; }, "max_message"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.max_message = (std::uint64_t{1} << 40) + 1; }, "max_message"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.send_queue = 7; }, "send_queue"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.send_queue = 4097; }, "send_queue"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.signal_interval = 0; }, "signal_interval"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.signal_interval = 129; }, "signal_interval"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.connect_timeout = std::chrono::milliseconds(0); }, "connect_timeout"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.handshake_timeout = std::chrono::milliseconds(0); },
            "handshake_timeout"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.handshake_timeout = std::chrono::minutes(11); },
            "handshake_timeout"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.buffer_wait = std::chrono::milliseconds(-1); }, "buffer_wait"));
  CHECK(bad([](ad::fabric_options& o) { o.pool_max_bytes = 4096; }, "pool"));
  CHECK(bad([](ad::fabric_options& o) { o.reactor.batch = 8; }, "batch"));
  CHECK(bad([](ad::fabric_options& o) { o.reactor.max_operations = (1u << 24) + 1; }, "max_operations"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.rendezvous_memory = 4095; }, "rendezvous_memory"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.rendezvous_memory = (std::uint64_t{1} << 40) + 1; },
            "rendezvous_memory"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.fragment_size = 4095; }, "fragment_size"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.fragment_size = (1u << 30) + 1; }, "fragment_size"));
  CHECK(bad([](ad::fabric_options& o) { o.late_read_grace = std::chrono::milliseconds(-1); }, "late_read_grace"));
  CHECK(bad([](ad::fabric_options& o) { o.late_read_grace = std::chrono::milliseconds(10001); }, "late_read_grace"));
  for (const auto g : {std::chrono::milliseconds(0), std::chrono::milliseconds(10000)}) {
    ad::fabric_options o = test_options();
    o.late_read_grace = g;
    asio::io_context io2;
    CHECK_NOTHROW(ad::fabric(io2, o));
  }
  CHECK(bad([](ad::fabric_options& o) { o.cache_max_entries = 0; }, "cache_max_entries"));
  CHECK(bad([](ad::fabric_options& o) { o.cache_max_entries = (std::size_t{1} << 20) + 1; }, "cache_max_entries"));
  CHECK(bad([](ad::fabric_options& o) { o.cache_max_bytes = 4095; }, "cache_max_bytes"));
  CHECK(bad([](ad::fabric_options& o) { o.max_piece_bytes = 4095; }, "max_piece_bytes"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.auth_token = std::string(1025, 'x'); }, "auth_token"));
  CHECK(bad([](ad::fabric_options& o) { o.srq_buffers = 4; }, "srq_buffers"));
  CHECK(bad([](ad::fabric_options& o) { o.srq_buffers = (1u << 20) + 1; }, "srq_buffers"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.keepalive = std::chrono::milliseconds(199); }, "keepalive"));
  CHECK(bad([](ad::fabric_options& o) { o.connection.keepalive = std::chrono::hours(2); }, "keepalive"));
  // The edges themselves are taken.
  CHECK_FALSE(bad([](ad::fabric_options& o) { o.connection.fragment_size = 4096; }, ""));
  CHECK_FALSE(bad([](ad::fabric_options& o) { o.connection.auth_token = std::string(1024, 'x'); }, ""));
  CHECK_FALSE(bad([](ad::fabric_options& o) { o.connection.handshake_timeout = std::chrono::minutes(10); }, ""));
  CHECK_FALSE(bad([](ad::fabric_options&) {}, ""));
}

TEST_CASE("a rendezvous message many times the send queue's reach is read in pieces: messages behind it follow",
          "[runtime]") {
  // send_queue 8 and 4 KiB fragments: a READ covers 4 KiB, the queue 32 KiB;
  // a 1 MiB message needs 256 of them and used to never start.
  ad::connection_options co;
  co.send_queue = 8;
  co.signal_interval = 4;
  co.fragment_size = 4096;
  asio::io_context io;
  ad::fabric server(io, test_options(co));
  ad::fabric client(io, test_options(co));
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  const auto big = pattern(std::size_t{1} << 20, 7);
  const auto small = pattern(100, 8);
  bool checked = false;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    ad::message m = co_await c.async_receive(use_awaitable);
    CHECK(std::equal(m.bytes().begin(), m.bytes().end(), big.begin(), big.end()));
    std::vector<std::byte> into(big.size());
    const std::size_t n = co_await c.async_receive(asio::buffer(into), use_awaitable);
    CHECK(n == big.size());
    CHECK(into == big);
    ad::message tail = co_await c.async_receive(use_awaitable);
    CHECK(std::equal(tail.bytes().begin(), tail.bytes().end(), small.begin(), small.end()));
    checked = true;
    co_await c.async_close(use_awaitable);
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    co_await c.async_send(asio::buffer(big), use_awaitable);
    co_await c.async_send(asio::buffer(big), use_awaitable);
    co_await c.async_send(asio::buffer(small), use_awaitable);
    auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));  // the server's close
    CHECK(ec == ad::errc::connection_closed);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(checked);
}

TEST_CASE("rendezvous memory: a message above the receiver's budget is refused on both sides: reads wait for it",
          "[runtime]") {
  // The receiver allocates rendezvous messages for async_receive(): at most
  // rendezvous_memory bytes per connection. Larger messages fail with
  // message_size at both ends (the connection carries on); messages that
  // fit wait for earlier reads to finish.
  ad::connection_options sco;
  sco.rendezvous_memory = 64 * 1024;
  asio::io_context io;
  ad::fabric server(io, test_options(sco));
  ad::fabric client(io, test_options({.eager_split_limit = 0}));  // 48 KiB by rendezvous, not split
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  const auto huge = pattern(128 * 1024, 1);
  std::vector<std::vector<std::byte>> fits;
  for (std::uint32_t i = 0; i < 4; ++i) fits.push_back(pattern(48 * 1024, 10 + i));
  ad::error_code server_ec, client_ec;
  int received = 0;
  std::uint64_t server_waits = 0;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
    server_ec = ec;
    // four receives at once: 4 x 48 KiB do not fit 64 KiB together
    std::vector<ad::message> got(fits.size());
    int pending = static_cast<int>(fits.size());
    for (std::size_t i = 0; i < fits.size(); ++i) {
      c.async_receive([&, i](ad::error_code e, ad::message msg) {
        CHECK_FALSE(e);
        got[i] = std::move(msg);
        --pending;
      });
    }
    asio::steady_timer t(co_await asio::this_coro::executor);
    while (pending > 0) {
      t.expires_after(std::chrono::milliseconds(1));
      co_await t.async_wait(use_awaitable);
    }
    server_waits = c.stats().rendezvous_waits;
    for (const auto& msg : got) {
      const bool match = std::any_of(fits.begin(), fits.end(), [&](const auto& v) {
        return std::equal(msg.bytes().begin(), msg.bytes().end(), v.begin(), v.end());
      });
      CHECK(match);
      received += match ? 1 : 0;
    }
    co_await c.async_close(use_awaitable);
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    auto [ec, n] = co_await c.async_send(asio::buffer(huge), asio::as_tuple(use_awaitable));
    client_ec = ec;
    int sent = 0;
    for (const auto& v : fits) {
      c.async_send(asio::buffer(v), [&](ad::error_code e, std::size_t) {
        CHECK_FALSE(e);
        ++sent;
      });
    }
    auto [cec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));  // the server's close
    CHECK(cec == ad::errc::connection_closed);
    CHECK(sent == 4);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(server_ec == ad::errc::message_size);
  CHECK(client_ec == ad::errc::message_size);
  CHECK(received == 4);
  CHECK(server_waits >= 1);  // 4 x 48 KiB in a 64 KiB budget: later reads waited for earlier ones
}

// A server and a client fabric on io_contexts of their own, which the test
// polls (work guards keep poll_one() from stopping them), connected.
struct split_pair {
  asio::io_context sio, cio;
  ad::fabric server, client;
  ad::acceptor acc;
  asio::executor_work_guard<asio::io_context::executor_type> sguard, cguard;
  ad::connection sc, cc;
  explicit split_pair(const ad::fabric_options& o)
      : server(sio, o), client(cio, o), acc(server.listen(test_host(), 0)), sguard(asio::make_work_guard(sio)),
        cguard(asio::make_work_guard(cio)) {
    std::tie(sc, cc) = connect_across(sio, cio, client, acc);
  }
};

TEST_CASE("a rendezvous send torn down while the peer reads it: its buffer is never read after the send completes",
          "[runtime]") {
  // The sender aborts while the receiver's READ response is still being
  // sent from the sender's buffer; the send completes and its buffer is
  // freed. The provider must not send from it afterwards (ASan watches the
  // sendmsg; a NIC never reads a deregistered region).
  if (!testing_tcp()) {
    // On rxe the receiver's READ of an aborted peer did not complete within
    // 20 s in the VM (to be looked at: issue "Harden the core", note); the
    // memory-safety question is the tcp provider's, whose software NIC runs
    // in this process.
    WARN("not run on " << provider_under_test() << ": checks the tcp provider's handling of deregistered memory");
    return;
  }
  ad::fabric_options o = test_options();
  o.reactor.mode = ad::poll_mode::event;
  o.connection.rendezvous_memory = std::uint64_t{128} << 20;
  split_pair p(o);
  auto& sio = p.sio;
  auto& cio = p.cio;
  auto& sc = p.sc;
  auto& cc = p.cc;
  auto buf = std::make_unique<std::vector<std::byte>>(pattern(std::size_t{64} << 20, 3));
  bool sent = false, received = false;
  ad::error_code send_ec, recv_ec;
  cc.async_send(asio::buffer(*buf), [&](ad::error_code ec, std::size_t) {
    send_ec = ec;
    sent = true;
    buf.reset();  // the caller's buffer is free once the send completed
  });
  sc.async_receive([&](ad::error_code ec, ad::message) {
    recv_ec = ec;
    received = true;
  });
  // The rendezvous request leaves; the server posts its READ; the client's
  // provider gets it and sends what the sockets hold (a few MiB of 64) while
  // the server does not poll.
  for (int i = 0; i < 1000 && cc.stats().rendezvous_sends == 0; ++i) cio.poll_one();
  REQUIRE(cc.stats().rendezvous_sends == 1);
  for (int i = 0; i < 1000 && cc.stats().doorbells == 0; ++i) cio.poll_one();
  REQUIRE(cc.stats().doorbells >= 1);  // the request is on the wire
  for (int i = 0; i < 1000 && sc.stats().posts == 0; ++i) {
    sio.poll_one();
    std::this_thread::sleep_for(1ms);
  }
  REQUIRE(sc.stats().posts >= 1);
  for (int i = 0; i < 50; ++i) {
    cio.poll_one();
    std::this_thread::sleep_for(1ms);
  }
  REQUIRE_FALSE(sent);
  cc.abort();
  // The send completes and its buffer is freed while part of the read
  // response is still in the client's transmit batch (the server does not
  // read yet); what leaves afterwards must not come from that buffer.
  for (int i = 0; i < 1000 && !sent; ++i) cio.poll_one();
  REQUIRE(sent);
  REQUIRE(buf == nullptr);
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while ((!sent || !received) && std::chrono::steady_clock::now() < deadline) {
    sio.poll_one();
    cio.poll_one();
  }
  CHECK(sent);
  CHECK(received);
  CHECK(send_ec);
  CHECK(recv_ec);
  sc = {};
  cc = {};
  p.sguard.reset();
  p.cguard.reset();
  sio.run_for(2s);
  cio.run_for(2s);
}

TEST_CASE("accept: idle and garbage sockets delay a real client by milliseconds and never fail the accept",
          "[runtime]") {
  // An accept loop as README writes it must keep serving: 100 sockets that
  // never speak and 10 that send garbage are refused (counted) without
  // completing async_accept with an error, and a real client that comes
  // after them connects at once.
  if (!testing_tcp()) {
    WARN("not run on " << provider_under_test() << ": raw TCP sockets reach only the tcp provider's listener");
    return;
  }
  asio::io_context io;
  ad::connection_options co;
  co.handshake_timeout = std::chrono::milliseconds(500);
  ad::fabric server(io, test_options(co));
  ad::fabric client(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  std::vector<int> socks;
  const auto raw = [&] {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(acc.port());
    ::inet_pton(AF_INET, test_host().c_str(), &a.sin_addr);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    socks.push_back(fd);
    return fd;
  };
  for (int i = 0; i < 100; ++i) raw();
  for (int i = 0; i < 10; ++i) {
    const std::string junk(64, 'z');
    REQUIRE(::send(raw(), junk.data(), junk.size(), MSG_NOSIGNAL) == 64);
  }
  failure f;
  std::vector<ad::error_code> accepted;
  std::chrono::steady_clock::duration took{};
  asio::co_spawn(io, [&]() -> awaitable<void> {
    for (int i = 0; i < 2; ++i) {
      auto [ec, c] = co_await acc.async_accept(asio::as_tuple(use_awaitable));
      accepted.push_back(ec);
      if (ec) continue;
      co_await c.async_send(asio::buffer("hi", 2), use_awaitable);
      auto [cec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));  // the client's close
      CHECK(cec == ad::errc::connection_closed);
    }
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    asio::steady_timer t(co_await asio::this_coro::executor, std::chrono::milliseconds(100));
    co_await t.async_wait(use_awaitable);  // the junk is in
    for (int i = 0; i < 2; ++i) {
      const auto start = std::chrono::steady_clock::now();
      ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
      took = std::max(took, std::chrono::steady_clock::now() - start);
      ad::message m = co_await c.async_receive(use_awaitable);
      CHECK(m.size() == 2);
      co_await c.async_close(use_awaitable);
    }
  }, f.handler());
  run_to_completion(io, std::chrono::seconds(30));
  f.check();
  REQUIRE(accepted.size() == 2);
  CHECK_FALSE(accepted[0]);
  CHECK_FALSE(accepted[1]);
  INFO("a real client waited " << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms");
  CHECK(took < std::chrono::milliseconds(400));
  CHECK(server.stats().refused >= 10);
  CHECK(server.stats().accepted == 2);
  // The idle sockets are dropped when their handshake timeout passes.
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (server.stats().refused < 110 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
  CHECK(server.stats().refused == 110);
  // Closing the acceptor and the fabric with sockets still connected does not wait for them.
  const int late = raw();
  const auto start = std::chrono::steady_clock::now();
  acc.close();
  acc = ad::acceptor{};
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::milliseconds(500));
  for (int fd : socks) ::close(fd);
  (void)late;
}

TEST_CASE("async_connect and async_accept called from another thread run on the fabric's thread", "[runtime]") {
  // The setup touches the fabric's state (queue pairs, pool, reactor):
  // calls from a thread other than the one running io are posted there,
  // not raced with run() (ThreadSanitizer checks this build).
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::fabric client(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  auto guard = asio::make_work_guard(io);
  std::thread runner([&] { io.run(); });
  auto accepted = acc.async_accept(asio::use_future);
  auto connected = client.async_connect(addr(acc), asio::use_future);
  ad::connection a = accepted.get();
  ad::connection c = connected.get();
  CHECK(a.is_open());
  CHECK(c.is_open());
  asio::post(io, [&] {  // connections belong to io's thread: let them go there
    a = ad::connection{};
    c = ad::connection{};
    guard.reset();
  });
  runner.join();
  io.restart();
  io.run_for(1s);
}

TEST_CASE("a fabric destroyed while a connect waits for its peer ends the attempt at once: operation_canceled",
          "[runtime]") {
  // The peer is a provider listener nobody takes requests from: the
  // client's handshake waits for an answer that never comes (tcp: the hello
  // sits unread; verbs: rdma_cm waits for the connect response).
  asio::io_context io;
  ad::fabric silent(io, test_options());
  auto lis = silent.device().listen(test_host(), 0);
  const std::string where = test_host() + ":" + std::to_string(lis->port());
  {
    ad::connection_options slow;
    slow.connect_timeout = 20s;
    auto client = std::make_unique<ad::fabric>(io, test_options(slow));
    std::optional<ad::error_code> got;
    client->async_connect(where, [&](ad::error_code ec, ad::connection) { got = ec; });
    io.run_for(300ms);  // the helper is inside the provider's connect now
    REQUIRE_FALSE(got.has_value());
    const auto start = std::chrono::steady_clock::now();
    client.reset();
    const auto took = std::chrono::steady_clock::now() - start;
    INFO("destroying the fabric took " << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                                       << " ms");
    CHECK(took < 500ms);  // the helper stopped (within ~50 ms), not after connect_timeout
    io.restart();
    io.run_for(2s);
    REQUIRE(got.has_value());
    CHECK(*got == std::errc::operation_canceled);
  }
  {
    // An io_context destroyed right after its fabric: the helper, stopped
    // and joined by the fabric, posts nothing to it later (ASan checks).
    auto io2 = std::make_unique<asio::io_context>();
    ad::connection_options quick;
    quick.connect_timeout = 300ms;
    auto client = std::make_unique<ad::fabric>(*io2, test_options(quick));
    int calls = 0;
    client->async_connect(where, [&](ad::error_code, ad::connection) { ++calls; });
    io2->run_for(50ms);
    client.reset();
    io2.reset();  // the handler (operation_canceled, posted) is destroyed unrun
    std::this_thread::sleep_for(600ms);  // past connect_timeout: an unstopped helper would post now
    CHECK(calls == 0);
  }
}

TEST_CASE("tcp: one-sided operations towards a target with nothing pending are answered at once - not at its next tick",
          "[runtime]") {
  // With the tcp provider the target's process executes puts and gets (its
  // completion queue's poll). A target with no operation of its own
  // pending has its reactor stopped: the fabric's liveness thread watches
  // the queue's notify fd then and has it polled when a request arrives.
  // Without that watch each operation waited for the target's next tick
  // (up to 1 s). Idle, the watch costs nothing: no spinning.
  if (!testing_tcp()) {
    WARN("not run on " << provider_under_test() << ": a NIC executes one-sided operations without the target");
    return;
  }
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::fabric client(io, test_options());
  std::vector<std::byte> mem(4096), src(4096, std::byte{3}), back(4096);
  ad::memory_region dst = server.register_memory(mem, ad::access::local_write | ad::access::remote_write |
                                                          ad::access::remote_read);
  ad::memory_region from = client.register_memory(src, ad::access::local_write);
  ad::memory_region into = client.register_memory(back, ad::access::local_write);
  ad::acceptor acc = server.listen(test_host(), 0);
  auto [a, c] = connect_through(io, client, acc, addr(acc));
  std::vector<double> ms_taken;
  for (int i = 0; i < 20; ++i) {
    std::optional<ad::error_code> done;
    src[0] = static_cast<std::byte>(i);
    const auto start = std::chrono::steady_clock::now();
    if (i % 2 == 0) {
      c.async_put(from, dst.remote(), [&](ad::error_code ec, std::size_t) { done = ec; });
    } else {
      c.async_get(into, dst.remote(), [&](ad::error_code ec, std::size_t) { done = ec; });
    }
    run_until(io, [&] { return done.has_value(); });
    ms_taken.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    REQUIRE_FALSE(*done);
    if (i % 2 == 0) CHECK(mem[0] == static_cast<std::byte>(i));
    if (i % 2 == 1) CHECK(back[0] == static_cast<std::byte>(i - 1));
  }
  std::vector<double> sorted = ms_taken;
  std::sort(sorted.begin(), sorted.end());
  INFO("median " << sorted[sorted.size() / 2] << " ms, max " << sorted.back() << " ms");
  CHECK(sorted[sorted.size() / 2] < 50);  // (about 0.05 ms seen; 1,000 ms without the watch)
  CHECK(sorted.back() < 500);
  // Idle (the io_context waits for a timer): the watch sleeps.
  const double cpu0 = process_cpu_seconds();
  asio::steady_timer quiet(io, std::chrono::milliseconds(1000));
  bool fired = false;
  quiet.async_wait([&](const boost::system::error_code&) { fired = true; });
  run_until(io, [&] { return fired; });
  const double cpu = process_cpu_seconds() - cpu0;
  INFO("CPU over 1 s idle: " << cpu << " s");
  CHECK(cpu < 0.2);
}

TEST_CASE("a flush behind a put that fails after the peer's close ends with an error - not never", "[runtime]") {
  // The peer closes; before our side sees it, a put to a key the peer
  // never gave out goes, and a flush behind it. The close arrives first,
  // so our side is ending (the failed put does not fail the connection);
  // the flush covers the failed put: it must end, with an error.
  // (On an RDMA NIC the peer's queue pair is in error by then and drops the
  // put unanswered: it ends when the transport retries run out, about half
  // a second. rxe takes the retry count of 7 as "for ever"
  // (transport/verbs/verbs_util.hpp): there the connection's grace after
  // the peer's close, kPeerCloseGrace (1 s), ends it, flushed.)
  asio::io_context io_s, io_c;
  ad::fabric server(io_s, test_options());
  ad::fabric client(io_c, test_options());
  std::vector<std::byte> target(4096), src(4096, std::byte{1});
  ad::memory_region dst = server.register_memory(target, ad::access::local_write | ad::access::remote_write);
  ad::memory_region from = client.register_memory(src, ad::access::local_write);
  ad::acceptor acc = server.listen(test_host(), 0);
  auto [a, c] = connect_across(io_s, io_c, client, acc);
  std::optional<ad::error_code> closed, put, flushed;
  a.async_close([&](ad::error_code ec) { closed = ec; });
  io_s.restart();
  io_s.poll();  // the server's close goes out
  ad::remote_region bad = dst.remote();
  bad.rkey ^= 0x5a5a00u;
  c.async_put(from, bad, [&](ad::error_code ec, std::size_t) { put = ec; });
  c.async_flush([&](ad::error_code ec) { flushed = ec; });
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!(put && flushed) && std::chrono::steady_clock::now() < deadline) {
    io_c.restart();
    io_c.poll();
    io_s.restart();
    io_s.poll();
  }
  INFO("put ended: " << put.has_value() << " flush ended: " << flushed.has_value());
  REQUIRE(put.has_value());
  CHECK(*put);
  REQUIRE(flushed.has_value());
  CHECK(*flushed);
  // The path under test: the client's connection was ending when the put
  // failed, so it did not fail (fail() counts a failure; had the put's
  // error come first, fail() would have ended the flush itself). On tcp the
  // close is read before the server can answer the put.
  CHECK(client.failure_counts().empty());
}

TEST_CASE("a fabric destroyed before its connections' flushes are polled keeps nothing: connections and the fabric go",
          "[runtime]") {
  // A connection whose handle is released moves its queue pair to error
  // and waits for the flushes of what it had posted before it lets itself
  // go. When nothing polls again (io stopped, as a server's shutdown often
  // does) the fabric's destructor must end that wait, or every connection
  // holds the fabric (its device, pool and descriptors) for ever: counted
  // by file descriptors, a kept fabric keeps its device's. Each operation
  // left must end once, posted (run by a poll after the fabrics went). The
  // server has an io_context of its own, not polled while the client's
  // operations go out: with the tcp provider nothing of them is answered
  // (a NIC answers the put and the flush without the server).
  {
    asio::io_context warm;  // (a provider's lazily opened, process-wide descriptors are counted before)
    ad::fabric f(warm, test_options());
  }
  const std::size_t before = open_fds();
  for (const int variant : {0, 1, 2}) {
    const bool in_flight = variant != 0, srq = variant == 2;
    INFO("operations in flight: " << in_flight << ", a shared receive queue: " << srq);
    std::vector<std::byte> big(256 * 1024, std::byte{7}), target(4096), src(4096, std::byte{1});
    // Each operation's ends, by the order below (outlive the fabrics, as a caller's must).
    std::array<std::vector<ad::error_code>, 6> ends;
    auto end = [&ends](std::size_t i) { return [&ends, i](ad::error_code ec, auto&&...) { ends[i].push_back(ec); }; };
    {
      asio::io_context io_s, io_c;
      {
        ad::fabric_options o = test_options();
        if (srq) o.srq_buffers = 64;
        ad::fabric server(io_s, o);
        ad::fabric client(io_c, o);
        ad::memory_region dst = server.register_memory(target, ad::access::local_write | ad::access::remote_write);
        ad::memory_region from = client.register_memory(src, ad::access::local_write);
        {
          ad::acceptor acc = server.listen(test_host(), 0);
          auto [a, c] = connect_across(io_s, io_c, client, acc);
          if (in_flight) {
            // A rendezvous send, an eager one, a put and a flush behind
            // them, and a receive on each end; the client's io runs a while
            // (its doorbells rung), the server's not: nothing is answered.
            c.async_send(asio::buffer(big), end(0));
            c.async_send(asio::buffer(big.data(), 64), end(1));
            c.async_put(from, dst.remote(), end(2));
            c.async_flush(end(3));
            c.async_receive(end(4));
            a.async_receive(end(5));
            io_c.restart();  // (its poll() ran out of work: stopped)
            io_c.run_for(50ms);
            REQUIRE(c.stats().posts >= 3);  // (the rendezvous send's, the eager send's and the put's are out)
            if (testing_tcp()) CHECK(ends[2].empty());  // (posted, unanswered)
          }
          CHECK(open_fds() > before);  // (the count sees a fabric's descriptors)
        }  // the handles go, with no poll after: their flushes stay unpolled
      }
      for (auto* io : {&io_s, &io_c}) {
        io->restart();
        io->poll();  // what the destructors posted
      }
    }
    CHECK(open_fds() == before);
    for (std::size_t i = 0; i < ends.size(); ++i) {
      INFO("operation " << i);
      REQUIRE(ends[i].size() == (in_flight ? 1u : 0u));
      // An eager send is complete once its copy is posted: that one may
      // have succeeded; so may the put and the flush on a NIC.
      const bool may_succeed = i == 1 || (!testing_tcp() && (i == 2 || i == 3));
      if (in_flight && !(may_succeed && !ends[i][0])) CHECK(ends[i][0] == ad::errc::connection_closed);
    }
  }
}

TEST_CASE("accept: an attempt nobody accepts is refused after the handshake timeout, and a closed acceptor refuses",
          "[runtime]") {
  asio::io_context io;
  ad::connection_options quick;
  quick.handshake_timeout = 300ms;
  ad::fabric server(io, test_options(quick));
  ad::fabric client(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  const std::string where = addr(acc);
  // Nobody calls async_accept: the client is refused (too_many_connections)
  // after about the server's handshake timeout, not after its own 10 s.
  std::optional<ad::error_code> first;
  const auto start = std::chrono::steady_clock::now();
  client.async_connect(where, [&](ad::error_code ec, ad::connection) { first = ec; });
  run_to_completion(io, 20s);
  const auto took = std::chrono::steady_clock::now() - start;
  REQUIRE(first.has_value());
  CHECK(*first == ad::errc::too_many_connections);
  INFO("refused after " << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms");
  CHECK(took < 3s);
  CHECK(server.stats().refused == 1);
  // Accepting again: the next attempt gets through.
  auto [a, c] = connect_through(io, client, acc, where);
  // connection::path(): each side's source is the other's destination
  const std::array<std::uint8_t, 16> zero{};
  CHECK(a.path().sgid != zero);
  CHECK(a.path().sgid == c.path().dgid);
  CHECK(a.path().dgid == c.path().sgid);
  a = ad::connection{};
  c = ad::connection{};
  CHECK(a.path().sgid == zero);  // no connection: zeros
  // Closed: the listening socket goes within ~100 ms; a connect is refused
  // at once (connection_refused), not left waiting.
  acc.close();
  std::this_thread::sleep_for(300ms);
  std::optional<ad::error_code> late;
  const auto late_start = std::chrono::steady_clock::now();
  client.async_connect(where, [&](ad::error_code ec, ad::connection) { late = ec; });
  run_to_completion(io, 20s);
  REQUIRE(late.has_value());
  CHECK(*late == ad::errc::connection_refused);
  CHECK(std::chrono::steady_clock::now() - late_start < 2s);
  CHECK(acc.port() != 0);  // still answers, from the value kept at listen
}

TEST_CASE("connection: an event-mode server's reply and the request buffer it drops go out in the reactor's pass - "
          "no posted flush per message",
          "[runtime][connection]") {
  // The echo coroutine's send completes at its doorbell (a reply), which
  // resumes it; it drops the request, whose buffer goes back to the
  // receive queue. That return was flushed by a posted handler: a second
  // io_context round (an epoll_wait) per message for a reactor that sleeps
  // between messages. Counted here: the server's io_context handlers per
  // echo.
  ad::fabric_options o = test_options();
  o.reactor.mode = ad::poll_mode::event;
  split_pair p(o);
  auto& sio = p.sio;
  auto& cio = p.cio;
  auto& sc = p.sc;
  auto& cc = p.cc;
  auto& server = p.server;
  bool server_done = false;
  asio::co_spawn(sio, [&]() -> asio::awaitable<void> {
    for (;;) {
      auto [ec, m] = co_await sc.async_receive(asio::as_tuple(asio::use_awaitable));
      if (ec) break;
      co_await sc.async_send(m.buffer(), asio::use_awaitable);
    }
    server_done = true;
  }, asio::detached);
  for (int i = 0; i < 10; ++i) sio.poll();  // the coroutine waits for its first message
  constexpr int kEchoes = 200;
  const std::array<std::byte, 64> out{};
  int echoed = 0;
  // A ping-pong: each echo back sends the next request (which carries the
  // acknowledgement of the echo: no wake-up of its own for it).
  std::function<void()> next = [&] {
    cc.async_send(asio::buffer(out), [](ad::error_code ec, std::size_t) { CHECK_FALSE(ec); });
    cc.async_receive([&](ad::error_code ec, ad::message m) {
      CHECK_FALSE(ec);
      CHECK(m.size() == out.size());
      if (++echoed < kEchoes) next();
    });
  };
  const std::uint64_t wakeups = server.stats().reactor.wakeups;
  const std::uint64_t polls = server.stats().reactor.polls;
  next();
  std::size_t handlers = 0;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (echoed < kEchoes && std::chrono::steady_clock::now() < deadline) {
    cio.poll();
    handlers += sio.poll();
  }
  // The reactor's wake-ups on the notify fd: one per request (its socket's
  // data). The tcp provider made it two when it signalled its eventfd for
  // the completion the reactor's own poll made and returned, which the
  // fabric's queue asks it not to (cq_options::owner_rearms: the reactor
  // arms again before it sleeps). The handlers besides them are counted
  // next.
  const auto woke = static_cast<std::size_t>(server.stats().reactor.wakeups - wakeups);
  INFO("server wake-ups per echo: " << static_cast<double>(woke) / kEchoes);
  CHECK(woke <= kEchoes + kEchoes / 4);
  // And on tcp one poll per wake-up: the wake-up's drain empties the
  // queue, and the provider's arm reports what came before it
  // (arm_reports_queued): no drain before the arm nor after it (three
  // polls per wake-up, two of them a recv that found nothing). (A NIC's
  // arm does not: verbs polls after arming, as it must.)
  const auto polled = static_cast<std::size_t>(server.stats().reactor.polls - polls);
  INFO("server polls per echo: " << static_cast<double>(polled) / kEchoes);
  if (provider_under_test() == "tcp") CHECK(polled <= woke + kEchoes / 4);
  REQUIRE(handlers >= woke);  // (each wake-up is one of the handlers)
  handlers -= woke;
  CHECK(echoed == kEchoes);
  const double per_echo = static_cast<double>(handlers) / kEchoes;
  INFO("server io_context handlers per echo besides its wake-ups: " << per_echo);
  // None (the coroutine runs inside the wake-up's handler); the posted
  // flush made it one.
  CHECK(per_echo < 0.5);
  cc.async_close([](ad::error_code) {});
  const auto closing = std::chrono::steady_clock::now() + 5s;
  while (!server_done && std::chrono::steady_clock::now() < closing) {
    cio.poll();
    sio.poll();
  }
  CHECK(server_done);
}
