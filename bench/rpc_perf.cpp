// anydoor-rpc-perf: RPC round trips and call rate over one connection, for
// side-by-side comparison with the connection's own echo
// (anydoor-runtime-perf) and gRPC (bench/compare-rpc.sh).
//
//   anydoor-rpc-perf --server [--port P] [options]   (prints "anydoor-rpc-perf: listening on 0.0.0.0:PORT")
//   anydoor-rpc-perf --connect HOST [--port P] [options]
// options:
//   --test lat|rate
//     lat:  one call in flight: co_await client.async_call(echo, SIZE bytes)
//           (the server's handler copies the request into its reply)
//     rate: --window calls in flight (default 32): each completion starts
//           the next call
//   -s SIZE     request and reply payload in bytes (default 64)
//   -n ITERS    calls (default 20000 for lat, 200000 for rate)
//   --window W  rate: calls in flight (1..4096)
//   --provider auto|tcp|verbs  (default auto)
//   --handler sync|coro  the server's echo handler: returns its status
//               (default), or is a coroutine (asio::awaitable) that does
//               not suspend
// Poll mode from ANYDOOR_POLL. The server serves one connection and exits
// when it closes. Prints one line:
//   RESULT test=lat size=64 iters=.. median_us=.. p99_us=.. mean_us=.. (the round trip)
//   RESULT test=rate size=64 iters=.. window=32 Mcalls=.. (10^6 calls per second)
#include <anydoor/anydoor.hpp>
#include <anydoor/rpc.hpp>

#include "cli.hpp"
#include "common/session.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <chrono>
#include <functional>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace asio = boost::asio;
namespace ad = anydoor;
namespace rpc = anydoor::rpc;
using asio::awaitable;
using asio::use_awaitable;
using clk = std::chrono::steady_clock;

namespace {

constexpr std::uint64_t kEcho = rpc::method_id("bench.echo");

constexpr const char* kUsage =
    "anydoor-rpc-perf (--server | --connect HOST) [--port P] [--test lat|rate]\n"
    "                        [-s SIZE] [-n ITERS] [--window W] [--provider auto|tcp|verbs] [--handler sync|coro]";

// Takes --handler out of argv (the shared parser does not know it): true for coro.
bool take_handler(int& argc, char** argv) {
  bool coro = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--handler") != 0) continue;
    const char* v = i + 1 < argc ? argv[i + 1] : "";
    if (std::strcmp(v, "coro") == 0) {
      coro = true;
    } else if (std::strcmp(v, "sync") != 0) {
      std::fprintf(stderr, "%s: --handler must be sync or coro: '%s'\nusage: %s\n", argv[0], v, kUsage);
      std::exit(2);
    }
    for (int j = i; j + 2 <= argc; ++j) argv[j] = argv[j + 2];
    argc -= 2;
    --i;
  }
  return coro;
}

ad::bench::cli_options parse(int argc, char** argv) {
  auto o = ad::bench::parse_cli(argc, argv, kUsage,
                                {.port = 7480, .test = "lat", .window = 0}, {"lat", "rate"});
  if (o.size == 0) o.size = 64;
  if (o.window == 0) o.window = 32;
  if (o.iters == 0) o.iters = o.test == "rate" ? 200000 : 20000;
  if (o.window > 4096) {
    std::fprintf(stderr, "anydoor-rpc-perf: --window must be in 1..4096\n");
    std::exit(2);
  }
  return o;
}

awaitable<void> serve(ad::fabric& fab, rpc::server& srv, const ad::bench::cli_options& o, bool coro) {
  ad::acceptor acc = fab.listen("0.0.0.0", o.port);
  std::printf("anydoor-rpc-perf: listening on 0.0.0.0:%u\n", static_cast<unsigned>(acc.port()));  // (--port 0: the one picked)
  std::fflush(stdout);
  ad::connection c = co_await acc.async_accept(use_awaitable);
  acc.close();
  if (coro) {
    srv.add(kEcho, [](rpc::server_call& call) -> awaitable<rpc::status> {
      call.reply(call.request());
      co_return rpc::status();
    });
  } else {
    srv.add(kEcho, [](rpc::server_call& call) -> rpc::status {
      call.reply(call.request());
      return {};
    });
  }
  co_await srv.async_serve(std::move(c), asio::as_tuple(use_awaitable));
}

awaitable<void> run_client(ad::fabric& fab, const ad::bench::cli_options& o) {
  rpc::client cli(co_await fab.async_connect(o.host + ":" + std::to_string(o.port), use_awaitable));
  std::vector<std::byte> req(o.size, std::byte{0x5a});
  const std::uint32_t warm = std::min<std::uint32_t>(2000, o.iters);
  if (o.test == "lat") {
    std::vector<double> ns;
    ns.reserve(o.iters);
    auto t0 = clk::now();
    for (std::uint32_t i = 0; i < warm + o.iters; ++i) {
      rpc::reply r = co_await cli.async_call(kEcho, asio::buffer(req), use_awaitable);
      const auto t1 = clk::now();
      if (r.size() != o.size) throw std::runtime_error("a reply of the wrong size");
      if (i >= warm) ns.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count());
      t0 = t1;
    }
    const auto s = ad::examples::summarize(std::move(ns));
    std::printf("RESULT test=lat size=%u iters=%u median_us=%.3f p99_us=%.3f mean_us=%.3f\n", o.size, o.iters,
                s.median / 1000, s.p99 / 1000, s.mean / 1000);
  } else {
    std::uint32_t started = 0, done = 0, errors = 0, target = warm;
    std::function<void()> start_one = [&] {
      ++started;
      cli.async_call(kEcho, asio::buffer(req), [&](ad::error_code ec, rpc::reply r) {
        if (ec || r.size() != o.size) ++errors;
        ++done;
        if (started < target) start_one();
      });
    };
    auto ex = co_await asio::this_coro::executor;
    auto run = [&](std::uint32_t count) -> awaitable<void> {
      target = started + count;
      const std::uint32_t goal = done + count;
      for (std::uint32_t i = 0; i < o.window && started < target; ++i) start_one();
      while (done != goal) co_await asio::post(ex, use_awaitable);
    };
    co_await run(warm);
    const auto t0 = clk::now();
    co_await run(o.iters);
    const double secs = std::chrono::duration<double>(clk::now() - t0).count();
    if (errors != 0) throw std::runtime_error(std::to_string(errors) + " calls failed");
    std::printf("RESULT test=rate size=%u iters=%u window=%u Mcalls=%.3f\n", o.size, o.iters, o.window,
                o.iters / secs / 1e6);
  }
  co_await cli.connection().async_close(asio::as_tuple(use_awaitable));
}

}  // namespace

int main(int argc, char** argv) {
  const bool coro = take_handler(argc, argv);
  const auto o = parse(argc, argv);
  try {
    asio::io_context io{1};  // hint 1: one thread runs it (Asio queues what that thread posts without a lock)
    ad::fabric_options fo;
    fo.device.provider = o.provider;
    fo.max_connections = 4;
    ad::fabric fab(io, fo);
    rpc::server srv;
    std::exception_ptr failure;
    auto done = [&](std::exception_ptr e) {
      if (e) failure = e;
    };
    if (o.server) {
      asio::co_spawn(io, serve(fab, srv, o, coro), done);
    } else {
      asio::co_spawn(io, run_client(fab, o), done);
    }
    io.run();
    if (failure) std::rethrow_exception(failure);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "anydoor-rpc-perf: %s\n", e.what());
    return 1;
  }
}
