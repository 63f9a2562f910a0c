// anydoor-perf: provider-level benchmarks between two processes.
//
//   anydoor-perf --server [--port P] [common options]
//   anydoor-perf --connect HOST [--port P] [common options]
// common options (the server must be given the same --test):
//   --test lat|write_bw|read_bw   ping-pong latency (send/recv), or one-sided bandwidth
//   -s SIZE     message size in bytes (lat default 64, bandwidth default 65536)
//   -n ITERS    round trips or operations (default 10000)
//   --window W  operations in flight for bandwidth tests (default 32)
//   --provider P   auto | tcp | verbs (default auto)
// Busy-polls. The client prints one line:
//   RESULT test=lat size=64 iters=10000 median_us=.. p99_us=.. mean_us=.. (one-way)
//   RESULT test=write_bw size=65536 iters=10000 MBps=..
#include "cli.hpp"
#include "common/session.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

using namespace anydoor::examples;

namespace {

anydoor::bench::cli_options parse(int argc, char** argv) {
  anydoor::bench::cli_options o = anydoor::bench::parse_cli(
      argc, argv,
      "anydoor-perf (--server | --connect HOST) [--port P] [--test lat|write_bw|read_bw]\n"
      "                    [-s SIZE] [-n ITERS] [--window W] [--provider auto|tcp|verbs]",
      {.port = 18515, .test = "lat", .window = 32}, {"lat", "write_bw", "read_bw"});
  if (o.size == 0) o.size = o.test == "lat" ? 64 : 65536;
  if (o.iters == 0) o.iters = 10000;
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const anydoor::bench::cli_options o = parse(argc, argv);
  const bool bw = o.test != "lat";
  const session_options so{.provider = o.provider,
                           .buffer_size = std::max<std::size_t>(std::size_t{o.size} * o.window * 4, 1 << 20),
                           .queue_depth = std::max<std::uint32_t>(o.window * 2, 64)};
  try {
    if (o.server) {
      session s = accept_one("0.0.0.0", o.port, so);
      if (!bw) pingpong(s, o.size, o.iters, false);
      serve_until_disconnect(s);
      return 0;
    }
    session s = connect_to(o.host, o.port, so);
    if (!bw) {
      const summary r = summarize(pingpong(s, o.size, o.iters, true));
      std::printf("RESULT test=lat size=%u iters=%u median_us=%.3f p99_us=%.3f mean_us=%.3f\n", o.size, o.iters,
                  r.median / 2000, r.p99 / 2000, r.mean / 2000);
    } else {
      const auto op = o.test == "write_bw" ? anydoor::transport::opcode::write : anydoor::transport::opcode::read;
      stream(s, op, o.size, 1000, o.window);  // warm-up
      const double secs = stream(s, op, o.size, o.iters, o.window);
      std::printf("RESULT test=%s size=%u iters=%u MBps=%.1f\n", o.test.c_str(), o.size, o.iters,
                  static_cast<double>(o.size) * o.iters / secs / 1e6);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "anydoor-perf: %s\n", e.what());
    return 1;
  }
}
