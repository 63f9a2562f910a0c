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
#include "common/session.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

using namespace anydoor::examples;

namespace {

struct options {
  bool server = false;
  std::string host;
  std::uint16_t port = 18515;
  std::string test = "lat";
  std::uint32_t size = 0;
  std::uint32_t iters = 10000;
  std::uint32_t window = 32;
  std::string provider = "auto";
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "anydoor-perf: %s\n"
               "usage: anydoor-perf (--server | --connect HOST) [--port P] [--test lat|write_bw|read_bw]\n"
               "                    [-s SIZE] [-n ITERS] [--window W] [--provider auto|tcp|verbs]\n",
               why);
  std::exit(2);
}

std::uint32_t number(const char* s) {
  char* end = nullptr;
  const unsigned long v = std::strtoul(s, &end, 10);
  if (end == s || *end != '\0' || v == 0 || v > 0xffffffffUL) usage("expected a positive number");
  return static_cast<std::uint32_t>(v);
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) usage(("missing value after " + a).c_str());
      return argv[++i];
    };
    if (a == "--server") o.server = true;
    else if (a == "--connect") o.host = next();
    else if (a == "--port") o.port = static_cast<std::uint16_t>(number(next()));
    else if (a == "--test") o.test = next();
    else if (a == "-s") o.size = number(next());
    else if (a == "-n") o.iters = number(next());
    else if (a == "--window") o.window = number(next());
    else if (a == "--provider") o.provider = next();
    else usage(("unknown option " + a).c_str());
  }
  if (o.server == !o.host.empty()) usage("give exactly one of --server and --connect");
  if (o.test != "lat" && o.test != "write_bw" && o.test != "read_bw") usage("unknown --test");
  if (o.size == 0) o.size = o.test == "lat" ? 64 : 65536;
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
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
