// reactor_group: N reactors behind one listening socket. Assertions run on
// the test's thread only; the reactors' coroutines record what they saw.
#include "../support/runtime.hpp"

#include <anydoor/metrics.hpp>
#include <anydoor/reactor_group.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <sched.h>

#include <atomic>
#include <future>
#include <map>
#include <mutex>

using namespace anydoor::test;
using asio::awaitable;
using asio::use_awaitable;

namespace {

// What the reactors of a group did, filled on their threads.
struct served {
  std::mutex m;
  std::vector<std::size_t> accepted_on;               // reactor index per accepted connection, in order
  std::map<std::size_t, std::thread::id> accept_thread;  // reactor -> the thread its accepts completed on
  std::vector<std::pair<std::size_t, std::thread::id>> echo_threads;  // reactor, thread of each echo
  std::vector<int> echo_cpus;
  std::atomic<int> loops_running{0};
  std::atomic<int> echoes_running{0};
};

awaitable<void> echo(ad::connection c, std::size_t reactor, served& s) {
  for (;;) {
    auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
    if (ec) break;
    {
      std::lock_guard lock(s.m);
      s.echo_threads.emplace_back(reactor, std::this_thread::get_id());
      s.echo_cpus.push_back(::sched_getcpu());
    }
    auto [sec, n] = co_await c.async_send(asio::buffer(m.data(), m.size()), asio::as_tuple(use_awaitable));
    if (sec) break;
  }
  --s.echoes_running;
}

awaitable<void> accept_loop(ad::acceptor& acc, std::size_t reactor, served& s) {
  for (;;) {
    auto [ec, c] = co_await acc.async_accept(asio::as_tuple(use_awaitable));
    if (ec) break;
    {
      std::lock_guard lock(s.m);
      s.accepted_on.push_back(reactor);
      s.accept_thread.emplace(reactor, std::this_thread::get_id());
    }
    ++s.echoes_running;
    asio::co_spawn(acc.get_executor(), echo(std::move(c), reactor, s), asio::detached);
  }
  --s.loops_running;
}

// Starts an accept loop on every reactor.
void serve(ad::reactor_group& g, std::vector<ad::acceptor>& accs, served& s) {
  for (std::size_t i = 0; i < g.size(); ++i) {
    ++s.loops_running;
    asio::co_spawn(g.context(i), accept_loop(accs[i], i, s), asio::detached);
  }
}

// Closes every acceptor on its reactor and waits until the loops and the
// echoes have ended (the connections are closed by then).
bool wind_down(ad::reactor_group& g, std::vector<ad::acceptor>& accs, served& s) {
  for (std::size_t i = 0; i < g.size(); ++i) asio::post(g.get_executor(i), [&accs, i] { accs[i].close(); });
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while ((s.loops_running > 0 || s.echoes_running > 0) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(5ms);
  }
  return s.loops_running == 0 && s.echoes_running == 0;
}

// The thread each reactor runs on.
std::vector<std::thread::id> reactor_threads(ad::reactor_group& g) {
  std::vector<std::thread::id> ids;
  for (std::size_t i = 0; i < g.size(); ++i) {
    std::promise<std::thread::id> p;
    auto f = p.get_future();
    asio::post(g.get_executor(i), [&p] { p.set_value(std::this_thread::get_id()); });
    REQUIRE(f.wait_for(5s) == std::future_status::ready);
    ids.push_back(f.get());
  }
  return ids;
}

// Connects `n` clients one after another from the test's thread, each
// exchanging one message, then closes them all.
std::size_t connect_and_echo(const std::string& address, std::size_t n) {
  asio::io_context io;
  ad::fabric client(io, test_options());
  std::size_t echoed = 0;
  failure f;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    std::vector<ad::connection> conns;
    for (std::size_t i = 0; i < n; ++i) {
      ad::connection c = co_await client.async_connect(address, use_awaitable);
      const auto out = pattern(100 + i, static_cast<std::uint32_t>(i));
      co_await c.async_send(asio::buffer(out), use_awaitable);
      ad::message m = co_await c.async_receive(use_awaitable);
      if (m.size() == out.size() && std::memcmp(m.data(), out.data(), out.size()) == 0) ++echoed;
      conns.push_back(std::move(c));
    }
    for (auto& c : conns) co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  return echoed;
}

}  // namespace

TEST_CASE("reactor_group: connections are placed round robin and served on their reactor's thread", "[runtime]") {
  ad::reactor_group g({.threads = 3, .fabric = test_options()});
  REQUIRE(g.size() == 3);
  const auto threads = reactor_threads(g);
  CHECK(threads[0] != threads[1]);
  CHECK(threads[1] != threads[2]);
  CHECK(threads[0] != std::this_thread::get_id());
  std::vector<ad::acceptor> accs = g.listen(test_host(), 0);
  REQUIRE(accs.size() == 3);
  CHECK(accs[0].port() == accs[2].port());
  served s;
  serve(g, accs, s);
  CHECK(connect_and_echo(test_host() + ":" + std::to_string(accs[0].port()), 6) == 6);
  REQUIRE(wind_down(g, accs, s));
  g.stop();
  CHECK(s.accepted_on == std::vector<std::size_t>{0, 1, 2, 0, 1, 2});
  for (const auto& [reactor, id] : s.accept_thread) CHECK(id == threads[reactor]);
  REQUIRE(s.echo_threads.size() == 6);
  for (const auto& [reactor, id] : s.echo_threads) CHECK(id == threads[reactor]);
  std::uint64_t accepted = 0;
  for (std::size_t i = 0; i < g.size(); ++i) accepted += g.at(i).stats().accepted;
  CHECK(accepted == 6);
  CHECK(g.at(1).stats().accepted == 2);
}

TEST_CASE("reactor_group: a placement hook chooses the reactor, and one out of range falls back to round robin",
          "[runtime]") {
  ad::reactor_group g({.threads = 2, .fabric = test_options()});
  std::atomic<std::uint64_t> asked{0};
  std::vector<std::uint64_t> sequences;
  std::vector<std::size_t> counts;
  std::mutex m;
  std::vector<ad::acceptor> accs = g.listen(test_host(), 0, [&](const ad::placement_request& r) -> std::size_t {
    ++asked;
    std::lock_guard lock(m);
    sequences.push_back(r.sequence);
    counts.push_back(r.reactors);
    return r.sequence < 3 ? 1 : 7;  // 7: out of range
  });
  served s;
  serve(g, accs, s);
  CHECK(connect_and_echo(test_host() + ":" + std::to_string(accs[0].port()), 5) == 5);
  REQUIRE(wind_down(g, accs, s));
  g.stop();
  CHECK(asked == 5);
  CHECK(sequences == std::vector<std::uint64_t>{0, 1, 2, 3, 4});
  CHECK(counts == std::vector<std::size_t>(5, 2));
  REQUIRE(s.accepted_on.size() == 5);
  CHECK(s.accepted_on[0] == 1);
  CHECK(s.accepted_on[1] == 1);
  CHECK(s.accepted_on[2] == 1);
  // round robin from then on (the counter counts every attempt: 3, 4)
  CHECK(s.accepted_on[3] == 1);
  CHECK(s.accepted_on[4] == 0);
}

TEST_CASE("reactor_group: a reactor whose acceptor is closed is skipped, and with none open attempts are refused",
          "[runtime]") {
  ad::reactor_group g({.threads = 2, .fabric = test_options()});
  std::vector<ad::acceptor> accs = g.listen(test_host(), 0);
  const std::string address = test_host() + ":" + std::to_string(accs[0].port());
  served s;
  // only reactor 1 accepts; reactor 0's acceptor is closed
  ++s.loops_running;
  asio::co_spawn(g.context(1), accept_loop(accs[1], 1, s), asio::detached);
  asio::post(g.get_executor(0), [&] { accs[0].close(); });
  std::this_thread::sleep_for(300ms);  // the acceptor's listener thread ends within 100 ms
  CHECK(connect_and_echo(address, 3) == 3);
  {
    std::lock_guard lock(s.m);  // reactor 1 still runs
    CHECK(s.accepted_on == std::vector<std::size_t>{1, 1, 1});
  }
  // reactor 1 closes too: the listening socket closes once every acceptor
  // has (its listener thread ends within 100 ms): refused by the system.
  REQUIRE(wind_down(g, accs, s));
  asio::io_context io;
  ad::fabric client(io, test_options());
  std::error_code got;
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  do {
    std::this_thread::sleep_for(50ms);
    client.async_connect(address, [&](std::error_code ec, ad::connection) { got = ec; });
    run_to_completion(io);
  } while (got != ad::errc::connection_refused && std::chrono::steady_clock::now() < deadline);
  CHECK(got == ad::errc::connection_refused);
  g.stop();
}

TEST_CASE("reactor_group: attempts placed on a reactor that does not accept are refused within the handshake timeout",
          "[runtime]") {
  // Reactor 0 never calls async_accept. The attempts placed there must not
  // wait one handshake timeout each, in turn (the last of 6 would wait 12
  // s, past its client's 10 s connect timeout): those that waited over twice
  // the handshake timeout are refused. (Timeouts generous enough for
  // sanitizer builds on 2 cores and for the rxe VM's emulated CPU, where
  // reactor 1 took over 1 s to accept its 6 in turn and, with a 1 s
  // handshake timeout, refused its last.)
  ad::connection_options co;
  co.handshake_timeout = 2000ms;
  ad::fabric_options so = test_options(co);
  so.max_connections = 64;
  ad::reactor_group g({.threads = 2, .fabric = so});
  std::vector<ad::acceptor> accs = g.listen(test_host(), 0);
  served s;
  ++s.loops_running;
  asio::co_spawn(g.context(1), accept_loop(accs[1], 1, s), asio::detached);
  asio::io_context io;
  ad::fabric_options copts = test_options();
  copts.max_connections = 64;
  copts.connection.connect_timeout = 10s;
  ad::fabric client(io, copts);
  std::vector<ad::connection> kept;
  std::size_t ok = 0, refused = 0, other = 0;
  std::string others;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 12; ++i) {
    client.async_connect(test_host() + ":" + std::to_string(accs[0].port()), [&](std::error_code ec, ad::connection c) {
      if (!ec) {
        ++ok;
        kept.push_back(std::move(c));
      } else if (ec == ad::errc::too_many_connections) {
        ++refused;
      } else {
        ++other;
        others += ec.message() + "; ";
      }
    });
  }
  run_to_completion(io);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(others << " in " << secs << " s");
  CHECK(ok == 6);
  CHECK(refused == 6);
  CHECK(other == 0);
  CHECK(secs < 9);  // (refused at 2, 4 and about 6 s)
  for (auto& c : kept) {
    c.async_close([](std::error_code) {});
  }
  run_to_completion(io);
  kept.clear();
  REQUIRE(wind_down(g, accs, s));
  g.stop();
}

TEST_CASE("reactor_group: threads are pinned where asked", "[runtime]") {
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(::sched_getaffinity(0, sizeof set, &set) == 0);
  int cpu = -1;
  for (int c = CPU_SETSIZE - 1; c >= 0; --c) {
    if (CPU_ISSET(static_cast<std::size_t>(c), &set)) cpu = c;  // the first allowed
  }
  REQUIRE(cpu >= 0);
  ad::reactor_group g({.threads = 2, .fabric = test_options(), .cpus = {cpu}});
  CHECK(g.placement(0).cpu == cpu);
  CHECK(g.placement(1).cpu == cpu);
  for (std::size_t i = 0; i < g.size(); ++i) {
    std::promise<int> p;
    auto f = p.get_future();
    asio::post(g.get_executor(i), [&p] { p.set_value(::sched_getcpu()); });
    REQUIRE(f.wait_for(5s) == std::future_status::ready);
    CHECK(f.get() == cpu);
  }
  // automatic: the tcp provider has no device node, so all allowed cores,
  // round robin, and each thread really runs on its core
  ad::reactor_group a({.threads = 2, .fabric = test_options()});
  for (std::size_t i = 0; i < a.size(); ++i) {
    const int want = a.placement(i).cpu;
    REQUIRE(want >= 0);
    CHECK(CPU_ISSET(static_cast<std::size_t>(want), &set));
    std::promise<int> p;
    auto f = p.get_future();
    asio::post(a.get_executor(i), [&p] { p.set_value(::sched_getcpu()); });
    REQUIRE(f.wait_for(5s) == std::future_status::ready);
    CHECK(f.get() == want);
  }
  if (CPU_COUNT(&set) > 1) CHECK(a.placement(0).cpu != a.placement(1).cpu);
  ad::reactor_group u({.threads = 1, .fabric = test_options(), .pin = false});
  CHECK(u.placement(0).cpu == -1);
}

TEST_CASE("reactor_group: bad options are refused with a reason", "[runtime]") {
  auto code_of = [](ad::reactor_group_options o) {
    try {
      ad::reactor_group g(std::move(o));
    } catch (const std::system_error& e) {
      return e.code();
    }
    return std::error_code{};
  };
  CHECK(code_of({.threads = 0, .fabric = test_options()}) == ad::errc::invalid_argument);
  CHECK(code_of({.threads = 257, .fabric = test_options()}) == ad::errc::invalid_argument);
  CHECK(code_of({.threads = 1, .fabric = test_options(), .cpus = {CPU_SETSIZE + 5}}) == ad::errc::invalid_argument);
  CHECK(code_of({.threads = 1, .fabric = test_options(), .cpus = {0}, .pin = false}) == ad::errc::invalid_argument);
  ad::fabric_options bad = test_options();
  bad.max_connections = 0;  // the fabric's own check, from the reactor's thread
  CHECK(code_of({.threads = 2, .fabric = bad}) == ad::errc::invalid_argument);
  ad::reactor_group g({.threads = 1, .fabric = test_options()});
  CHECK_THROWS_AS(g.at(1), std::system_error);
  CHECK_THROWS_AS(g.context(5), std::system_error);
  // stop() from a reactor's own thread is refused
  std::promise<std::error_code> p;
  auto f = p.get_future();
  asio::post(g.get_executor(0), [&] {
    try {
      g.stop();
      p.set_value({});
    } catch (const std::system_error& e) {
      p.set_value(e.code());
    }
  });
  REQUIRE(f.wait_for(5s) == std::future_status::ready);
  CHECK(f.get() == ad::errc::invalid_state);
}

TEST_CASE("reactor_group: the metrics page has every reactor's connections, each read on its own thread",
          "[runtime]") {
  ad::reactor_group g({.threads = 2, .fabric = test_options()});
  std::vector<ad::acceptor> accs = g.listen(test_host(), 0);
  served s;
  serve(g, accs, s);
  asio::io_context io;  // the endpoint and the clients: the test's thread
  ad::metrics_endpoint ep(io, "127.0.0.1", 0, ad::collect(g));
  ad::fabric client(io, test_options());
  std::string page;
  failure f;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    std::vector<ad::connection> conns;
    for (std::size_t i = 0; i < 4; ++i) {  // two on each reactor (round robin)
      ad::connection c = co_await client.async_connect(test_host() + ":" + std::to_string(accs[0].port()), use_awaitable);
      const auto out = pattern(64, static_cast<std::uint32_t>(i));
      for (std::size_t k = 0; k <= i; ++k) {  // i + 1 messages on connection i
        co_await c.async_send(asio::buffer(out), use_awaitable);
        (void)co_await c.async_receive(use_awaitable);
      }
      conns.push_back(std::move(c));
    }
    page = co_await http_get_metrics(ep.port());
    for (auto& c : conns) co_await c.async_close(use_awaitable);
    ep.stop();
  }, f.handler());
  run_to_completion(io);
  f.check();
  REQUIRE(wind_down(g, accs, s));
  g.stop();
  INFO(page);
  CHECK(metric_sum(page, "anydoor_connections_open", "reactor=\"0\"") == 2);
  CHECK(metric_sum(page, "anydoor_connections_open", "reactor=\"1\"") == 2);
  // connections 0 and 2 on reactor 0 (1 + 3 messages), 1 and 3 on reactor 1 (2 + 4)
  CHECK(metric_sum(page, "anydoor_connection_messages_received_total", "reactor=\"0\"") == 4);
  CHECK(metric_sum(page, "anydoor_connection_messages_received_total", "reactor=\"1\"") == 6);
  CHECK(ep.scrapes() == 1);
}
