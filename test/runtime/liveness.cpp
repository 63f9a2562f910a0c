// Liveness (connection_options::keepalive): a peer that stops answering
// without closing is detected, and idle connections stay up on heartbeats.
#include "../support/runtime.hpp"
#include "../support/sleep.hpp"

#include <anydoor/anydoor.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <thread>

using namespace anydoor::test;
namespace asio = boost::asio;
namespace ad = anydoor;
using asio::awaitable;
using asio::use_awaitable;
using ms = std::chrono::milliseconds;

namespace {

// Waits up to `limit` for the child to exit; its wait status, or -1.
int wait_exit(pid_t pid, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (::waitpid(pid, &status, WNOHANG) == pid) return status;
    std::this_thread::sleep_for(ms(10));
  }
  return -1;
}

// Starts anydoor-test-peer against `where` (with `mode`, if any).
pid_t start_peer(const std::string& where, const char* mode = nullptr) {
  const std::string peer = sibling("anydoor-test-peer");
  const pid_t child = ::fork();
  if (child == 0) {
    ::execl(peer.c_str(), peer.c_str(), where.c_str(), mode, static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return child;
}

// Resumes a stopped child and waits for it to exit; its wait status, or -1
// (then it was killed).
int resume_and_reap(pid_t child, bool stopped) {
  if (stopped) ::kill(child, SIGCONT);
  const int status = wait_exit(child, std::chrono::seconds(15));
  if (status == -1) {
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
  }
  return status;
}

}  // namespace

TEST_CASE("liveness: a frozen peer (SIGSTOP) is detected within keepalive and every pending operation ends once "
          "with timed_out and after SIGCONT the peer finds its connection failed",
          "[runtime]") {
  asio::io_context io;
  ad::connection_options co;
  co.keepalive = ms(1000);
  ad::fabric server(io, test_options(co));
  ad::acceptor acc = server.listen(test_host(), 0);
  const pid_t child = start_peer(addr(acc));
  REQUIRE(child >= 0);
  std::vector<ad::error_code> ends;
  std::chrono::steady_clock::duration first{}, last{};
  bool stopped = false;
  failure f;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    ad::message ready = co_await c.async_receive(use_awaitable);
    CHECK(ready.size() == 5);
    co_await sleep_for(ms(300));  // a few heartbeats both ways first
    REQUIRE(::kill(child, SIGSTOP) == 0);
    stopped = true;
    const auto t0 = std::chrono::steady_clock::now();
    auto ended = [&](ad::error_code ec) {
      const auto t = std::chrono::steady_clock::now() - t0;
      if (ends.empty()) first = t;
      last = t;
      ends.push_back(ec);
    };
    // Two operations pending on the frozen peer: a receive, and a
    // rendezvous send whose fin will never come.
    c.async_receive([&](ad::error_code ec, ad::message) { ended(ec); });
    static std::vector<std::byte> big(std::size_t{1} << 20, std::byte{7});
    c.async_send(asio::buffer(big), [&](ad::error_code ec, std::size_t) { ended(ec); });
    for (int i = 0; i < 500 && ends.size() < 2; ++i) co_await sleep_for(ms(10));
    co_await sleep_for(ms(200));  // nothing completes twice
  }, f.handler());
  run_to_completion(io, std::chrono::seconds(30));
  const int status = resume_and_reap(child, stopped);
  f.check();
  REQUIRE(ends.size() == 2);
  CHECK(ends[0] == ad::errc::timed_out);
  CHECK(ends[1] == ad::errc::timed_out);
  std::printf("liveness: SIGSTOP to first error %lld ms, to the last %lld ms (keepalive 1000 ms)\n",
              static_cast<long long>(std::chrono::duration_cast<ms>(first).count()),
              static_cast<long long>(std::chrono::duration_cast<ms>(last).count()));
  INFO("detected after " << std::chrono::duration_cast<ms>(first).count() << " ms");
  // Silence counts from the peer's last heartbeat, up to 250 ms before the stop.
  CHECK(first >= ms(500));
  CHECK(first <= ms(2000));   // within keepalive (plus scheduling, generous for sanitizer builds)
  CHECK(last - first < ms(500));  // together
  // Resumed, the peer finds its connection gone and ends normally.
  REQUIRE(status != -1);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("liveness: a frozen peer that holds our credits is detected within keepalive by probes its device "
          "no longer answers",
          "[runtime]") {
  // The peer fills our receives and our application takes nothing: the
  // peer has no credit to speak with, so its silence is no sign. Its
  // application takes none of our messages either, and we fill its 4
  // receives but the one kept for control messages: we send no heartbeat
  // (nothing to return, no credit to spare). Only probes (a zero-length
  // RDMA WRITE, answered by the peer's device, here its tcp provider) keep
  // the connection up while it runs, and they stop coming back once it is
  // frozen.
  asio::io_context io;
  ad::connection_options co;
  co.keepalive = ms(1000);
  co.credits = 8;
  ad::fabric server(io, test_options(co));
  ad::acceptor acc = server.listen(test_host(), 0);
  const pid_t child = start_peer(addr(acc), "flood");
  REQUIRE(child >= 0);
  bool stopped = false;
  bool open_before = false;
  ms detected{-1};
  ad::error_code after;
  std::uint64_t probes = 0;
  failure f;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    ad::message ready = co_await c.async_receive(use_awaitable);
    CHECK(ready.size() == 5);
    for (int i = 0; i < 3; ++i) co_await c.async_send(asio::buffer("held", 4), use_awaitable);
    // Two keepalives with neither side able to speak: it stays up.
    const std::uint64_t before = c.stats().heartbeats;
    co_await sleep_for(ms(2000));
    open_before = c.is_open();
    probes = c.stats().heartbeats - before;
    if (provider_under_test() != "tcp") co_return;  // (see below)
    REQUIRE(::kill(child, SIGSTOP) == 0);
    stopped = true;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 500 && c.is_open(); ++i) co_await sleep_for(ms(10));
    if (!c.is_open()) detected = std::chrono::duration_cast<ms>(std::chrono::steady_clock::now() - t0);
    auto [ec, n] = co_await c.async_send(asio::buffer("x", 1), asio::as_tuple(use_awaitable));
    after = ec;
  }, f.handler());
  run_to_completion(io, std::chrono::seconds(30));
  f.check();
  CHECK(open_before);
  INFO("heartbeats and probes in 2 s: " << probes);
  CHECK(probes >= 2);  // (probes: no heartbeat can go; one per 375-500 ms)
  if (provider_under_test() != "tcp") {
    // A NIC answers for a frozen process (its queue pair lives in the
    // kernel and the device): only the first half holds there.
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
    WARN("the frozen-peer half runs on the tcp provider only: a NIC answers probes for a frozen process");
    return;
  }
  const int status = resume_and_reap(child, stopped);
  INFO("detected after " << detected.count() << " ms");
  CHECK(detected >= ms(0));
  CHECK(detected <= ms(2000));  // within keepalive (plus scheduling, generous for sanitizer builds)
  CHECK(after == ad::errc::timed_out);
  std::printf("liveness: a frozen peer holding our credits detected %lld ms after SIGSTOP (keepalive 1000 ms)\n",
              static_cast<long long>(detected.count()));
  REQUIRE(status != -1);
  CHECK(WIFEXITED(status));
}

TEST_CASE("liveness: idle connections stay up on heartbeats at the stricter side's rate", "[runtime]") {
  // The server detects nothing (keepalive 0) but sends the heartbeats its
  // client's 400 ms keepalive asks for. The client has nothing pending for
  // 1.6 s: its fabric's reactor sleeps and its liveness tick takes the
  // heartbeats from the completion queue.
  asio::io_context io;
  ad::connection_options server_co;
  server_co.keepalive = ms(0);
  ad::connection_options client_co;
  client_co.keepalive = ms(400);
  ad::fabric server(io, test_options(server_co));
  ad::fabric client(io, test_options(client_co));
  ad::acceptor acc = server.listen(test_host(), 0);
  ad::connection_stats server_stats, client_stats;
  std::string got;
  failure f;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    ad::message m = co_await c.async_receive(use_awaitable);
    got.assign(reinterpret_cast<const char*>(m.data()), m.size());
    server_stats = c.stats();
    auto [ec, m2] = co_await c.async_receive(asio::as_tuple(use_awaitable));  // the client's close
    CHECK(ec == ad::errc::connection_closed);
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    co_await sleep_for(ms(1600));  // four keepalives of silence from the application
    CHECK(c.is_open());
    co_await c.async_send(asio::buffer("late", 4), use_awaitable);
    client_stats = c.stats();
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(got == "late");
  INFO("server heartbeats " << server_stats.heartbeats << ", client heartbeats " << client_stats.heartbeats);
  CHECK(server_stats.heartbeats >= 8);   // every 100 ms (a quarter of 400 ms) for 1.6 s
  CHECK(client_stats.heartbeats >= 8);
}

TEST_CASE("liveness: a receiver that stops taking messages longer than keepalive does not fail its live peer",
          "[runtime]") {
  // The client fills the server's 4 receives (all but the one kept for
  // control messages) and waits for credits; the server's application
  // takes nothing for three keepalives. Heartbeats still flow both ways on
  // the reserved credit (a control message's receive is re-posted at once),
  // so neither side mistakes the other for dead; then everything arrives.
  asio::io_context io;
  ad::connection_options co;
  co.keepalive = ms(400);
  co.credits = 4;
  ad::fabric server(io, test_options(co));
  ad::fabric client(io, test_options(co));
  ad::acceptor acc = server.listen(test_host(), 0);
  int received = 0;
  int sent = 0;
  failure f;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    co_await sleep_for(ms(1200));
    for (int i = 0; i < 20; ++i) {
      ad::message m = co_await c.async_receive(use_awaitable);
      if (m.size() == 100) ++received;
    }
    auto [ec, m2] = co_await c.async_receive(asio::as_tuple(use_awaitable));  // the client's close
    CHECK(ec == ad::errc::connection_closed);
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    const std::vector<std::byte> payload(100, std::byte{1});
    for (int i = 0; i < 20; ++i) {
      co_await c.async_send(asio::buffer(payload), use_awaitable);
      ++sent;
    }
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(sent == 20);
  CHECK(received == 20);
}

TEST_CASE("liveness: both sides that stop taking messages longer than keepalive still recover", "[runtime]") {
  // Each side fills the other's receives and then takes nothing for three
  // keepalives: both are down to the credit kept for control messages.
  // Heartbeats must not spend it (both at once would leave neither able to
  // return credits), and a peer without credits is not silent.
  asio::io_context io;
  ad::connection_options co;
  co.keepalive = ms(400);
  co.credits = 4;
  ad::fabric server(io, test_options(co));
  ad::fabric client(io, test_options(co));
  ad::acceptor acc = server.listen(test_host(), 0);
  std::array<int, 2> received{};
  failure f;
  auto side = [&](ad::connection c, int who) -> awaitable<void> {
    const std::vector<std::byte> payload(100, std::byte{1});
    int sent = 0;
    asio::co_spawn(co_await asio::this_coro::executor, [&c, &sent, &payload]() -> awaitable<void> {
      for (int i = 0; i < 20; ++i) {
        co_await c.async_send(asio::buffer(payload), use_awaitable);
        ++sent;
      }
    }, f.handler());
    co_await sleep_for(ms(1200));
    for (int i = 0; i < 20; ++i) {
      ad::message m = co_await c.async_receive(use_awaitable);
      if (m.size() == 100) ++received[static_cast<std::size_t>(who)];
    }
    while (sent < 20) co_await sleep_for(ms(5));
    co_await sleep_for(ms(100));
  };
  asio::co_spawn(io, [&]() -> awaitable<void> {
    co_await side(co_await acc.async_accept(use_awaitable), 0);
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    co_await side(co_await client.async_connect(addr(acc), use_awaitable), 1);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(received[0] == 20);
  CHECK(received[1] == 20);
}

TEST_CASE("liveness: keepalive is 0 or 200 ms to 1 h", "[runtime]") {
  asio::io_context io;
  for (const ms bad : {ms(1), ms(199), ms(3600001)}) {
    INFO(bad.count() << " ms");
    ad::connection_options co;
    co.keepalive = bad;
    CHECK_THROWS_AS(ad::fabric(io, test_options(co)), std::system_error);
  }
  for (const ms good : {ms(0), ms(200), ms(3600000)}) {
    ad::connection_options co;
    co.keepalive = good;
    CHECK_NOTHROW(ad::fabric(io, test_options(co)));
  }
}
