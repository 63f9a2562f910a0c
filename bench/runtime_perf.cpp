// anydoor-runtime-perf: the runtime (fabric + connection + coroutines) under
// load, for side-by-side comparison with the raw provider (anydoor-perf) and
// peers (bench/compare-runtime.sh).
//
//   anydoor-runtime-perf --server [--port P] [options]   (prints "anydoor-runtime-perf: listening on 0.0.0.0:PORT")
//   anydoor-runtime-perf --connect HOST [--port P] [options]
// options (the server must be given the same --test and -s):
//   --test echo|echo_rate|msg_rate|put_lat|get_lat|put_bw
//     echo:     co_await send + co_await receive round trips (one-way
//               latency = half the round trip), through asio::use_awaitable
//     echo_deferred: the same through asio::deferred (co_await op(deferred):
//               no coroutine frame per operation, Asio 1.81's lighter path)
//     echo_rate: echo round trips with --window in flight (default 32):
//               each echo that comes back sends the next message (the
//               baseline of anydoor-rpc-perf's rate test)
//     msg_rate: the client streams messages (at most --window in flight: the
//               connection's credits), the server receives them all and
//               answers once
//     put_lat:  put ping-pong, as ucp_put_lat and ib_write_lat: each side
//               puts SIZE bytes into the other's region and spins on its own
//               memory until the peer's put has landed (one-way = half the
//               round trip); the reactor polls once per io_context round
//               (spin_polls 1) so that the spinning coroutine runs often
//     get_lat:  the client gets SIZE bytes from the server's region, one at
//               a time (latency = the whole get, as ib_read_lat)
//     put_bw:   the client streams puts of SIZE bytes, --window in flight
//               (default 16), as ucp_put_bw and ib_write_bw
//   The one-sided tests exchange memory regions as messages first (packed
//   remote_region); the server then waits for the client's "done".
//   -s SIZE     message size in bytes (default 64)
//   -n ITERS    round trips or messages (default 10000 / 1000000)
//   --window W  msg_rate: credits per connection (default 64)
//   --provider auto|tcp|verbs  (default auto)
// Poll mode from ANYDOOR_POLL (compare-runtime.sh uses busy, as the raw
// ping-pong does). Prints one line:
//   RESULT test=echo|echo_deferred size=64 iters=.. median_us=.. p99_us=.. mean_us=.. p999_us=.. (one-way)
//   RESULT test=msg_rate size=64 iters=.. window=64 Mmsgs=.. MBps=..
//   RESULT test=echo_rate size=64 iters=.. window=32 Mmsgs=.. (round trips per second)
//   RESULT test=put_lat|get_lat size=.. iters=.. median_us=.. p99_us=.. mean_us=.. p999_us=..
//   RESULT test=put_bw size=.. iters=.. window=.. MBps=.. (10^6 bytes per second) doorbells=.. posts=..
#include <anydoor/anydoor.hpp>

#include "cli.hpp"
#include "common/session.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/deferred.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace asio = boost::asio;
namespace ad = anydoor;
using asio::awaitable;
using asio::use_awaitable;
using clk = std::chrono::steady_clock;

namespace {

using options = anydoor::bench::cli_options;

options parse(int argc, char** argv) {
  options o = anydoor::bench::parse_cli(
      argc, argv,
      "anydoor-runtime-perf (--server | --connect HOST) [--port P]\n"
      "                            [--test echo|echo_deferred|echo_rate|msg_rate|put_lat|get_lat|put_bw]\n"
      "                            [-s SIZE] [-n ITERS] [--window W] [--provider auto|tcp|verbs]",
      {.port = 7473, .test = "echo", .window = 0}, {"echo", "echo_deferred", "echo_rate", "msg_rate", "put_lat", "get_lat", "put_bw"});
  if (o.size == 0) o.size = 64;
  if (o.window == 0) o.window = o.test == "put_bw" ? 16 : o.test == "echo_rate" ? 32 : 64;
  if (o.iters == 0) o.iters = o.test == "msg_rate" ? 1000000 : o.test == "put_bw" ? 20000 : o.test == "echo_rate" ? 200000 : 10000;
  if (o.window < 4 || o.window > 4096) {
    std::fprintf(stderr, "anydoor-runtime-perf: --window must be in 4..4096\n");
    std::exit(2);
  }
  return o;
}

bool onesided(const options& o) { return o.test == "put_lat" || o.test == "get_lat" || o.test == "put_bw"; }

using anydoor::examples::summarize;
using anydoor::examples::summary;

// Sends our region, receives the peer's (the server sends first).
awaitable<ad::remote_region> swap_regions(ad::connection& c, const ad::memory_region& mine, bool first) {
  const auto packed = mine.remote().pack();
  if (first) co_await c.async_send(asio::buffer(packed), use_awaitable);
  ad::message m = co_await c.async_receive(use_awaitable);
  if (!first) co_await c.async_send(asio::buffer(packed), use_awaitable);
  ad::remote_region peer;
  if (auto ec = ad::remote_region::unpack(m.bytes(), peer)) throw std::system_error(ec, "the peer's region");
  co_return peer;
}

// Waits (yielding to the io_context) until the last byte of `buf` is `tag`.
awaitable<void> wait_for(const volatile std::byte* last, std::byte tag) {
  auto ex = co_await asio::this_coro::executor;
  while (*last != tag) co_await asio::post(ex, use_awaitable);
}

awaitable<void> onesided_side(ad::fabric& fab, ad::connection& c, const options& o, bool server) {
  const std::size_t size = o.size;
  std::vector<std::byte> recv_mem(size), send_mem(size, std::byte{0x5a});
  ad::memory_region recv_mr = fab.register_memory(
      recv_mem, ad::access::local_write | ad::access::remote_write | ad::access::remote_read);
  ad::memory_region send_mr = fab.register_memory(send_mem, ad::access::local_write);
  const ad::remote_region peer = co_await swap_regions(c, recv_mr, server);
  const ad::remote_region dst = peer.at(0, size);
  // Each side's receive of the other's "done" stays pending throughout: with
  // the tcp provider the peer's puts land only while this side progresses.
  bool peer_done = false;
  c.async_receive([&peer_done](ad::error_code, ad::message) { peer_done = true; });
  const std::uint32_t warm = std::min<std::uint32_t>(1000, o.iters);
  if (o.test == "put_lat") {
    std::vector<double> ns;
    ns.reserve(o.iters);
    bool failed = false;
    auto done = [&failed](ad::error_code ec, std::size_t) { failed |= static_cast<bool>(ec); };
    for (std::uint32_t i = 0; i < warm + o.iters; ++i) {
      const auto tag = static_cast<std::byte>(i % 255 + 1);
      if (server) {
        co_await wait_for(&recv_mem[size - 1], tag);
        send_mem[size - 1] = tag;
        c.async_put(send_mr, dst, done);
      } else {
        const auto t0 = clk::now();
        send_mem[size - 1] = tag;
        c.async_put(send_mr, dst, done);
        co_await wait_for(&recv_mem[size - 1], tag);
        if (i >= warm) ns.push_back(std::chrono::duration<double, std::nano>(clk::now() - t0).count());
      }
      if (failed) throw std::runtime_error("a put failed");
    }
    co_await c.async_flush(use_awaitable);
    if (!server) {
      const summary r = summarize(ns);
      std::printf("RESULT test=put_lat size=%u iters=%u median_us=%.3f p99_us=%.3f mean_us=%.3f p999_us=%.3f\n", o.size,
                  o.iters, r.median / 2000, r.p99 / 2000, r.mean / 2000, r.p999 / 2000);
    }
  } else if (!server && o.test == "get_lat") {
    std::vector<double> ns;
    ns.reserve(o.iters);
    for (std::uint32_t i = 0; i < warm + o.iters; ++i) {
      const auto t0 = clk::now();
      co_await c.async_get(recv_mr, dst, use_awaitable);
      if (i >= warm) ns.push_back(std::chrono::duration<double, std::nano>(clk::now() - t0).count());
    }
    const summary r = summarize(ns);
    std::printf("RESULT test=get_lat size=%u iters=%u median_us=%.3f p99_us=%.3f mean_us=%.3f p999_us=%.3f\n", o.size,
                o.iters, r.median / 1000, r.p99 / 1000, r.mean / 1000, r.p999 / 1000);
  } else if (!server && o.test == "put_bw") {
    std::uint32_t in_flight = 0, completed = 0;
    bool failed = false;
    auto bw_ex = co_await asio::this_coro::executor;
    auto stream = [&](std::uint32_t count) -> awaitable<void> {
      completed = 0;
      for (std::uint32_t posted = 0; posted < count;) {
        while (in_flight < o.window && posted < count) {
          ++in_flight;
          ++posted;
          c.async_put(send_mr, dst, [&](ad::error_code ec, std::size_t) {
            failed |= static_cast<bool>(ec);
            --in_flight;
            ++completed;
          });
        }
        co_await asio::post(bw_ex, use_awaitable);
        if (failed) throw std::runtime_error("a put failed");
      }
      co_await c.async_flush(use_awaitable);
    };
    co_await stream(std::min<std::uint32_t>(1000, o.iters));  // warm-up
    const ad::connection_stats s0 = c.stats();
    const auto t0 = clk::now();
    co_await stream(o.iters);
    const double secs = std::chrono::duration<double>(clk::now() - t0).count();
    ad::connection_stats s = c.stats();
    s.doorbells -= s0.doorbells;  // the measured stream's
    s.posts -= s0.posts;
    std::printf("RESULT test=put_bw size=%u iters=%u window=%u MBps=%.1f doorbells=%llu posts=%llu\n", o.size, o.iters,
                o.window, static_cast<double>(o.size) * o.iters / secs / 1e6,
                static_cast<unsigned long long>(s.doorbells), static_cast<unsigned long long>(s.posts));
  }
  co_await c.async_send(asio::buffer("done", 4), use_awaitable);
  auto ex = co_await asio::this_coro::executor;
  while (!peer_done) co_await asio::post(ex, use_awaitable);
  // The client closes; the server waits for that (as in the echo test).
  if (server) {
    auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
  } else {
    co_await c.async_close(use_awaitable);
  }
}

// The echo test's two loops, through either completion token.
template <class Token>
awaitable<void> echo_back(ad::connection& c, Token token) {
  for (;;) {
    auto [ec, m] = co_await c.async_receive(asio::as_tuple(token));
    if (ec) co_return;
    co_await c.async_send(m.buffer(), token);
  }
}

template <class Token>
awaitable<void> echo_client(ad::connection& c, const options& o, const std::vector<std::byte>& out, Token token) {
  const std::uint32_t warm = std::min<std::uint32_t>(1000, o.iters);
  std::vector<double> ns;
  ns.reserve(o.iters);
  // One clock read per round trip, as in anydoor-perf's ping-pong.
  auto t0 = clk::now();
  for (std::uint32_t i = 0; i < warm + o.iters; ++i) {
    co_await c.async_send(asio::buffer(out), token);
    ad::message m = co_await c.async_receive(token);
    const auto t1 = clk::now();
    if (m.size() != o.size) throw std::runtime_error("echo of the wrong size");
    if (i >= warm) ns.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count());
    t0 = t1;
  }
  const summary r = summarize(std::move(ns));
  std::printf("RESULT test=%s size=%u iters=%u median_us=%.3f p99_us=%.3f mean_us=%.3f p999_us=%.3f\n", o.test.c_str(),
              o.size, o.iters, r.median / 2000, r.p99 / 2000, r.mean / 2000, r.p999 / 2000);
}

awaitable<void> serve(ad::fabric& fab, const options& o) {
  ad::acceptor acc = fab.listen("0.0.0.0", o.port);
  std::printf("anydoor-runtime-perf: listening on 0.0.0.0:%u\n", static_cast<unsigned>(acc.port()));  // (--port 0: the one picked)
  std::fflush(stdout);
  ad::connection c = co_await acc.async_accept(use_awaitable);
  if (onesided(o)) {
    co_await onesided_side(fab, c, o, true);
    co_return;
  }
  if (o.test == "echo") co_return co_await echo_back(c, use_awaitable);
  if (o.test == "echo_deferred") co_return co_await echo_back(c, asio::deferred);
  if (o.test == "echo_rate") {
    // The eager echo is copied when posted: the message can go at once.
    for (;;) {
      auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
      if (ec) co_return;
      c.async_send(m.buffer(), [](ad::error_code, std::size_t) {});
    }
  }
  for (std::uint64_t i = 0; i < o.iters; ++i) co_await c.async_receive(use_awaitable);
  co_await c.async_send(asio::buffer("done", 4), use_awaitable);
  auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));  // the client's close
}

awaitable<void> run_client(ad::fabric& fab, const options& o) {
  ad::connection c = co_await fab.async_connect(o.host + ":" + std::to_string(o.port), use_awaitable);
  if (onesided(o)) {
    co_await onesided_side(fab, c, o, false);
    co_return;
  }
  std::vector<std::byte> out(o.size, std::byte{0x5a});
  if (o.test == "echo") {
    co_await echo_client(c, o, out, use_awaitable);
  } else if (o.test == "echo_deferred") {
    co_await echo_client(c, o, out, asio::deferred);
  } else if (o.test == "echo_rate") {
    // --window echoes in flight: each one back sends the next.
    const std::uint32_t warm = std::min<std::uint32_t>(2000, o.iters);
    bool failed = false;
    auto rounds = [&](std::uint32_t count) -> awaitable<void> {
      const std::uint32_t w = std::min(o.window, count);
      for (std::uint32_t i = 0; i < w; ++i) {
        c.async_send(asio::buffer(out), [&](ad::error_code ec, std::size_t) { failed |= static_cast<bool>(ec); });
      }
      for (std::uint32_t got = 0; got < count; ++got) {
        ad::message m = co_await c.async_receive(use_awaitable);
        if (m.size() != o.size || failed) throw std::runtime_error("echo_rate: a bad echo or a failed send");
        if (got + w < count) {
          c.async_send(asio::buffer(out), [&](ad::error_code ec, std::size_t) { failed |= static_cast<bool>(ec); });
        }
      }
    };
    co_await rounds(warm);
    const auto t0 = clk::now();
    co_await rounds(o.iters);
    const double secs = std::chrono::duration<double>(clk::now() - t0).count();
    std::printf("RESULT test=echo_rate size=%u iters=%u window=%u Mmsgs=%.3f\n", o.size, o.iters, o.window,
                o.iters / secs / 1e6);
  } else {
    const auto t0 = clk::now();
    for (std::uint64_t i = 0; i < o.iters; ++i) co_await c.async_send(asio::buffer(out), use_awaitable);
    ad::message done = co_await c.async_receive(use_awaitable);
    const double secs = std::chrono::duration<double>(clk::now() - t0).count();
    const ad::connection_stats s = c.stats();
    std::printf("RESULT test=msg_rate size=%u iters=%u window=%u Mmsgs=%.3f MBps=%.1f doorbells=%llu posts=%llu "
                "signaled=%llu credit_stalls=%llu\n",
                o.size, o.iters, o.window, o.iters / secs / 1e6, static_cast<double>(o.size) * o.iters / secs / 1e6,
                static_cast<unsigned long long>(s.doorbells), static_cast<unsigned long long>(s.posts),
                static_cast<unsigned long long>(s.signaled), static_cast<unsigned long long>(s.credit_stalls));
  }
  co_await c.async_close(use_awaitable);
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    asio::io_context io{1};  // hint 1: one thread runs it (Asio queues what that thread posts without a lock)
    ad::fabric_options fo;
    fo.device.provider = o.provider;
    fo.connection.credits = static_cast<std::uint16_t>(o.test == "msg_rate" ? o.window : 64);
    if (o.test == "put_lat") fo.reactor.spin_polls = 1;  // the spinning coroutine checks memory every round
    fo.max_connections = 4;
    ad::fabric fab(io, fo);
    std::exception_ptr failure;
    auto done = [&](std::exception_ptr e) {
      if (e) failure = e;
    };
    if (o.server) {
      asio::co_spawn(io, serve(fab, o), done);
    } else {
      asio::co_spawn(io, run_client(fab, o), done);
    }
    io.run();
    if (failure) std::rethrow_exception(failure);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "anydoor-runtime-perf: %s\n", e.what());
    return 1;
  }
}
