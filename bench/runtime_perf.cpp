// anydoor-runtime-perf: the runtime (fabric + connection + coroutines) under
// load, for side-by-side comparison with the raw provider (anydoor-perf) and
// peers (bench/compare-runtime.sh).
//
//   anydoor-runtime-perf --server [--port P] [options]
//   anydoor-runtime-perf --connect HOST [--port P] [options]
// options (the server must be given the same --test):
//   --test echo|msg_rate   echo: co_await send + co_await receive round trips
//                          (one-way latency = half the round trip);
//                          msg_rate: the client streams messages (at most
//                          --window in flight: the connection's credits), the
//                          server receives them all and answers once
//   -s SIZE     message size in bytes (default 64)
//   -n ITERS    round trips or messages (default 10000 / 1000000)
//   --window W  msg_rate: credits per connection (default 64)
//   --provider auto|tcp|verbs  (default auto)
// Poll mode from ANYDOOR_POLL (compare-runtime.sh uses busy, as the raw
// ping-pong does). Prints one line:
//   RESULT test=echo size=64 iters=.. median_us=.. p99_us=.. mean_us=.. (one-way)
//   RESULT test=msg_rate size=64 iters=.. window=64 Mmsgs=.. MBps=..
#include <anydoor/anydoor.hpp>

#include "cli.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
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
      "anydoor-runtime-perf (--server | --connect HOST) [--port P] [--test echo|msg_rate]\n"
      "                            [-s SIZE] [-n ITERS] [--window W] [--provider auto|tcp|verbs]",
      {.port = 7473, .test = "echo", .window = 64}, {"echo", "msg_rate"});
  if (o.size == 0) o.size = 64;
  if (o.iters == 0) o.iters = o.test == "echo" ? 10000 : 1000000;
  if (o.window < 4 || o.window > 4096) {
    std::fprintf(stderr, "anydoor-runtime-perf: --window must be in 4..4096\n");
    std::exit(2);
  }
  return o;
}

awaitable<void> serve(ad::fabric& fab, const options& o) {
  ad::acceptor acc = fab.listen("0.0.0.0", o.port);
  ad::connection c = co_await acc.async_accept(use_awaitable);
  if (o.test == "echo") {
    for (;;) {
      auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
      if (ec) co_return;
      co_await c.async_send(m.buffer(), use_awaitable);
    }
  }
  for (std::uint64_t i = 0; i < o.iters; ++i) co_await c.async_receive(use_awaitable);
  co_await c.async_send(asio::buffer("done", 4), use_awaitable);
  auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));  // the client's close
}

awaitable<void> run_client(ad::fabric& fab, const options& o) {
  ad::connection c = co_await fab.async_connect(o.host + ":" + std::to_string(o.port), use_awaitable);
  std::vector<std::byte> out(o.size, std::byte{0x5a});
  if (o.test == "echo") {
    const std::uint32_t warm = std::min<std::uint32_t>(1000, o.iters);
    std::vector<double> ns;
    ns.reserve(o.iters);
    for (std::uint32_t i = 0; i < warm + o.iters; ++i) {
      const auto t0 = clk::now();
      co_await c.async_send(asio::buffer(out), use_awaitable);
      ad::message m = co_await c.async_receive(use_awaitable);
      const auto t1 = clk::now();
      if (m.size() != o.size) throw std::runtime_error("echo of the wrong size");
      if (i >= warm) ns.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count());
    }
    std::sort(ns.begin(), ns.end());
    double sum = 0;
    for (double v : ns) sum += v;
    std::printf("RESULT test=echo size=%u iters=%u median_us=%.3f p99_us=%.3f mean_us=%.3f\n", o.size, o.iters,
                ns[ns.size() / 2] / 2000, ns[ns.size() * 99 / 100] / 2000, sum / static_cast<double>(ns.size()) / 2000);
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
    asio::io_context io;
    ad::fabric_options fo;
    fo.device.provider = o.provider;
    fo.connection.credits = static_cast<std::uint16_t>(o.window);
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
