// anydoor-perf: provider-level benchmarks between two processes (no
// runtime: one queue pair, busy-polling, as perftest and ucx_perftest do).
//
//   anydoor-perf --server [--port P] [--provider P]     (P 0: any free port; it prints
//                                                        "anydoor-perf: listening on 0.0.0.0:PORT")
// --port defaults to 18515. The server serves one client and exits: it
// takes --test, -s, -n, --window and --slots but follows the client's plan (so a
// script may give both sides the same arguments); --json and --all-sizes
// are the client's only (exit 2 on the server).
//   anydoor-perf --connect HOST [--port P] [--test T] [-s SIZE | --all-sizes] [-n ITERS]
//                [--window W] [--slots N] [--provider P] [--json]
//
//   --test T       lat         send/recv ping-pong; one-way latency (half the round trip)
//                  send_bw     streamed sends (the server receives): bandwidth
//                  msg_rate    streamed small sends, inline where they fit: messages per second
//                  write_bw    streamed RDMA WRITEs: bandwidth
//                  read_bw     streamed RDMA READs: bandwidth
//                  atomic_lat  one 8-byte fetch_add at a time: its full round trip
//                  write_lat   RDMA WRITE ping-pong on memory, as ib_write_lat (each
//                              side waits for the peer's write to land, then writes
//                              back; inline where it fits): one-way latency
//   -s SIZE        bytes per message or operation, 1..64 MiB (lat and write_lat 64, msg_rate 8,
//                  atomic_lat 8 and nothing else, the rest 65536)
//   --all-sizes    every power of two from 2 B to 8 MiB instead of -s, one result
//                  each (atomic_lat: 8 B only); sizes above 8 KiB run fewer
//                  iterations (ITERS * 8 KiB / SIZE, at least 100, at most
//                  ITERS). Registers 64 MiB on each side: mind ulimit -l on verbs
//   -n ITERS       timed iterations per size (default 10000; msg_rate 200000),
//                  after a warm-up of ITERS/10 (10..1000)
//   --window W     operations in flight for the streamed tests, 1..4096
//                  (default 32; msg_rate 128)
//   --slots N      write_bw and read_bw: cycle through N places of SIZE bytes
//                  in each side's buffer (default: all that half of it holds;
//                  the buffer is 4 x SIZE x W bytes within 1 MiB..64 MiB, and
//                  at least 4 x SIZE). N = 1 reuses one place, as perftest and
//                  ucx_perftest do; more than fit is a usage error (exit 2)
//   --provider P   auto | tcp | verbs (default auto; both sides must agree)
//   --json         one JSON object per line and size instead of RESULT lines
//
// The client sends its plan (test, sizes, iterations, window) to the server
// with its connection request: the server needs no --test (one given is
// ignored) and serves exactly one client.
//
// Output, one line per size:
//   RESULT test=lat size=64 iters=10000 median_us=.. p99_us=.. mean_us=.. min_us=.. p999_us=.. MBps=.. Mpps=..
//   RESULT test=write_bw size=65536 iters=10000 MBps=.. Mpps=.. avg_us=..
//   {"tool":"anydoor","provider":"tcp","test":"lat","size":64,"iters":10000,"t_min_us":..,
//    "t_typical_us":..,"t_avg_us":..,"p99_us":..,"p999_us":..,"bw_avg_MBps":..,"msg_rate_Mpps":..}
// t_typical_us is the median. The streamed tests measure no single
// operation: their t_min_us, t_typical_us, p99_us and p999_us are null and
// t_avg_us is the elapsed time over the operations. MB is 10^6 bytes.
// Exit: 0, 1 on a failure (printed), 2 on a bad command line.
#include "cli.hpp"
#include "common/session.hpp"
#include "perf_plan.hpp"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

using namespace anydoor::examples;
using namespace anydoor::bench;

namespace {

static_assert(kPlanSize <= kMaxExtra);

// Both sides size their queue pair and buffer from the plan alone.
session_options options_for(const plan& p, const std::string& provider) {
  const auto sizes = sizes_of(p);
  const std::size_t largest = *std::max_element(sizes.begin(), sizes.end());
  // Two halves (sends from the first, receives into the second), each with
  // room for a few operations of the largest size; streamed operations wrap
  // around in it.
  const std::size_t buffer = std::max<std::size_t>(
      {std::size_t{1} << 20, 4 * largest, std::min<std::size_t>(largest * p.window * 4, std::size_t{64} << 20)});
  return {.provider = provider, .buffer_size = buffer, .queue_depth = std::max<std::uint32_t>(p.window * 2, 64),
          .max_inline = 64};
}

struct options {
  anydoor::bench::cli_options cli;
  bool json = false;
  bool all_sizes = false;
};

options parse(int argc, char** argv) {
  static const char* usage =
      "anydoor-perf --server [--port P] [--provider auto|tcp|verbs]\n"
      "       anydoor-perf --connect HOST [--port P]\n"
      "                    [--test lat|send_bw|msg_rate|write_bw|read_bw|atomic_lat|write_lat]\n"
      "                    [-s SIZE | --all-sizes] [-n ITERS] [--window W] [--slots N] [--provider auto|tcp|verbs]\n"
      "                    [--json]";
  options o;
  std::vector<char*> rest{argv[0]};
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--json") o.json = true;
    else if (a == "--all-sizes") o.all_sizes = true;
    else rest.push_back(argv[i]);
  }
  auto fail = [&](const std::string& why) {
    std::fprintf(stderr, "%s: %s\nusage: %s\n", argv[0], why.c_str(), usage);
    std::exit(2);
  };
  o.cli = anydoor::bench::parse_cli(static_cast<int>(rest.size()), rest.data(), usage,
                                    {.port = 18515, .test = "lat", .window = 0},
                                    {"lat", "send_bw", "msg_rate", "write_bw", "read_bw", "atomic_lat", "write_lat"});
  auto& c = o.cli;
  if (c.server && (o.json || o.all_sizes)) fail("--json and --all-sizes are the client's (the server follows its plan)");
  if (o.all_sizes && c.size != 0) fail("give -s or --all-sizes, not both");
  if (c.test == "atomic_lat" && c.size != 0 && c.size != 8) fail("atomic_lat operates on 8 bytes: -s 8 or none");
  if (c.size > kMaxSize) fail("-s must be at most " + std::to_string(kMaxSize));
  if (c.window > kMaxWindow) fail("--window must be at most " + std::to_string(kMaxWindow));
  if (c.slots != 0 && !c.server && c.test != "write_bw" && c.test != "read_bw") {
    fail("--slots applies to write_bw and read_bw");
  }
  if (c.iters > kMaxIters) fail("-n must be at most " + std::to_string(kMaxIters));
  if (c.size == 0) c.size = c.test == "lat" || c.test == "write_lat" ? 64 : c.test == "msg_rate" || c.test == "atomic_lat" ? 8 : 65536;
  if (c.iters == 0) c.iters = c.test == "msg_rate" ? 200000 : 10000;
  if (c.window == 0) c.window = c.test == "msg_rate" ? 128 : 32;
  return o;
}

plan plan_of(const options& o) {
  plan p;
  for (std::size_t i = 1; i < kNames.size(); ++i) {
    if (kNames[i] == o.cli.test) p.test = static_cast<test_kind>(i);
  }
  p.all_sizes = o.all_sizes;
  p.size = o.cli.size;
  p.iters = o.cli.iters;
  p.window = o.cli.window;
  return p;
}

// One result: latency samples (ns per operation) or, for the streamed
// tests, the elapsed seconds.
struct result {
  std::uint32_t size = 0, iters = 0;
  summary lat;  // microseconds
  double avg_us = 0;
  double mbps = 0, mpps = 0;
};

result from_samples(std::vector<double> ns, std::uint32_t size, double scale) {
  for (double& v : ns) v *= scale / 1000.0;  // to microseconds
  result r;
  r.size = size;
  r.iters = static_cast<std::uint32_t>(ns.size());
  r.lat = summarize(std::move(ns));
  r.avg_us = r.lat.mean;
  r.mbps = r.avg_us > 0 ? size / r.avg_us : 0;  // bytes per microsecond = MB/s
  r.mpps = r.avg_us > 0 ? 1.0 / r.avg_us : 0;
  return r;
}

result from_elapsed(double secs, std::uint32_t size, std::uint32_t iters) {
  result r;
  r.size = size;
  r.iters = iters;
  r.avg_us = secs * 1e6 / iters;
  r.mbps = static_cast<double>(size) * iters / secs / 1e6;
  r.mpps = iters / secs / 1e6;
  return r;
}

void print(const options& o, const plan& p, const result& r, std::string_view provider) {
  const std::string_view name = kNames[static_cast<std::size_t>(p.test)];
  if (o.json) {
    std::printf("{\"tool\":\"anydoor\",\"provider\":\"%.*s\",\"test\":\"%.*s\",\"size\":%u,\"iters\":%u,",
                static_cast<int>(provider.size()), provider.data(), static_cast<int>(name.size()), name.data(), r.size,
                r.iters);
    if (streamed(p.test)) {
      std::printf("\"t_min_us\":null,\"t_typical_us\":null,\"t_avg_us\":%.4f,\"p99_us\":null,\"p999_us\":null,", r.avg_us);
    } else {
      std::printf("\"t_min_us\":%.4f,\"t_typical_us\":%.4f,\"t_avg_us\":%.4f,\"p99_us\":%.4f,\"p999_us\":%.4f,",
                  r.lat.min, r.lat.median, r.avg_us, r.lat.p99, r.lat.p999);
    }
    // (%g: six significant digits, so that a slow tiny-size run never prints a rate of 0)
    std::printf("\"bw_avg_MBps\":%.6g,\"msg_rate_Mpps\":%.6g}\n", r.mbps, r.mpps);
  } else if (streamed(p.test)) {
    std::printf("RESULT test=%.*s size=%u iters=%u MBps=%.1f Mpps=%.4f avg_us=%.4f\n", static_cast<int>(name.size()),
                name.data(), r.size, r.iters, r.mbps, r.mpps, r.avg_us);
  } else {
    std::printf("RESULT test=%.*s size=%u iters=%u median_us=%.3f p99_us=%.3f mean_us=%.3f min_us=%.3f p999_us=%.3f "
                "MBps=%.1f Mpps=%.4f\n",
                static_cast<int>(name.size()), name.data(), r.size, r.iters, r.lat.median, r.lat.p99, r.lat.mean,
                r.lat.min, r.lat.p999, r.mbps, r.mpps);
  }
  std::fflush(stdout);
}

// --slots beyond what half the buffer holds at the largest size: why.
std::string slots_problem(const options& o, const plan& p) {
  if (o.cli.slots == 0) return {};
  const auto sizes = sizes_of(p);
  const std::size_t largest = *std::max_element(sizes.begin(), sizes.end());
  const std::size_t fit = options_for(p, o.cli.provider).buffer_size / 2 / largest;
  if (o.cli.slots <= fit) return {};
  return "--slots " + std::to_string(o.cli.slots) + ": " + std::to_string(fit) + " places of " +
         std::to_string(largest) + " bytes fit half the buffer";
}

result run_client_size(session& s, const plan& p, std::uint32_t size, std::uint32_t slots) {
  const std::uint32_t iters = iters_at(p, size);
  const std::uint32_t warm = warmup_for(iters);
  switch (p.test) {
    case test_kind::lat: return from_samples(pingpong(s, size, iters, true, warm), size, 0.5);  // one way
    case test_kind::atomic_lat: return from_samples(atomic_roundtrips(s, iters, warm), size, 1.0);
    case test_kind::write_lat: return from_samples(write_pingpong(s, size, iters, true, warm), size, 0.5);  // one way
    case test_kind::send_bw:
    case test_kind::msg_rate:
      send_stream(s, size, warm, p.window);
      return from_elapsed(send_stream(s, size, iters, p.window), size, iters);
    case test_kind::write_bw:
    case test_kind::read_bw: {
      const auto op = p.test == test_kind::write_bw ? anydoor::transport::opcode::write : anydoor::transport::opcode::read;
      stream(s, op, size, warm, p.window, slots);
      return from_elapsed(stream(s, op, size, iters, p.window, slots), size, iters);
    }
  }
  throw std::logic_error("unknown test");
}

// The client's last word: its ACKs for our last messages went out before
// it on the same connection, so once it is here nothing of ours is left
// unacknowledged when the client goes away. (Leaving right after its last
// receive, the client could close before our last send's ACK reached us.)
constexpr std::uint64_t kByeId = 0xb7e;

void run_server_plan(session& s, const plan& p) {
  const auto sizes = sizes_of(p);
  if (!(p.test == test_kind::lat || p.test == test_kind::send_bw || p.test == test_kind::msg_rate)) {
    s.post_recv(kByeId, 1);  // the one-sided tests take no receive before it
  }
  if (p.test == test_kind::lat) {
    for (const std::uint32_t size : sizes) {
      const std::uint32_t iters = iters_at(p, size);
      pingpong(s, size, iters, false, warmup_for(iters));
    }
  } else if (p.test == test_kind::write_lat) {
    for (const std::uint32_t size : sizes) {
      const std::uint32_t iters = iters_at(p, size);
      write_pingpong(s, size, iters, false, warmup_for(iters));
    }
  } else if (p.test == test_kind::send_bw || p.test == test_kind::msg_rate) {
    std::uint64_t total = 0;
    for (const std::uint32_t size : sizes) total += iters_at(p, size) + std::uint64_t{warmup_for(iters_at(p, size))};
    receive_count(s, total, *std::max_element(sizes.begin(), sizes.end()), s.qp->attributes().max_recv_wr);
  }
  if (p.test == test_kind::lat || p.test == test_kind::send_bw || p.test == test_kind::msg_rate) {
    s.post_recv(kByeId, 1);
  }
  if (!serve_until_message(s, kByeId)) throw std::runtime_error("the client left before its run was over");
  serve_until_disconnect(s);  // (the client waits for the ACK of its last word: leaving now could cut it off)
}

void say_bye(session& s) {
  const tp::sge sg = s.mr->slice(0, 1);
  s.post({.wr_id = kByeId, .op = tp::opcode::send, .sg_list = {&sg, 1}, .inline_data = true});
  while (s.wait().wr_id != kByeId) {
  }
}

void tell_port(std::uint16_t port, void*) {
  std::printf("anydoor-perf: listening on 0.0.0.0:%u\n", port);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    if (o.cli.server) {
      plan got;
      session s = accept_one("0.0.0.0", o.cli.port, {.provider = o.cli.provider}, tell_port, nullptr,
                             [&](std::span<const std::byte> extra) {
                               got = decode(extra);
                               return options_for(got, o.cli.provider);
                             });
      run_server_plan(s, got);
      return 0;
    }
    const plan p = plan_of(o);
    if (const std::string why = slots_problem(o, p); !why.empty()) {
      std::fprintf(stderr, "anydoor-perf: %s\n", why.c_str());
      return 2;
    }
    const auto wire = encode(p);
    session s = connect_to(o.cli.host, o.cli.port, options_for(p, o.cli.provider), wire);
    const std::string provider(s.dev->provider());
    const auto sizes = sizes_of(p);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const result r = run_client_size(s, p, sizes[i], o.cli.slots);
      print(o, p, r, provider);
      if (i + 1 == sizes.size()) say_bye(s);
      if (sizes.size() > 1) {
        std::fprintf(stderr, "anydoor-perf: %s %u B done (%zu of %zu)\n", std::string(kNames[static_cast<std::size_t>(p.test)]).c_str(),
                     sizes[i], i + 1, sizes.size());
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "anydoor-perf: %s\n", e.what());
    return 1;
  }
}
