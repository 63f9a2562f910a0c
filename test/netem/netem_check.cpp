// anydoor-netem-check: the runtime's operations over an impaired link
// (scripts/rxe-vm/run-netem runs it in two QEMU guests joined by a link
// that tc netem makes lossy, slow, duplicating or reordering).
//
//   anydoor-netem-check --server --listen HOST:PORT
//   anydoor-netem-check --connect HOST:PORT --label NAME [--ops N] [--window W]
//                       [--expect ok|fail] [--after-connect CMD] [--deadline S] [--keepalive MS]
//                       [--max-error-ms MS] [--quit]
//
// The server accepts connections until one sends "quit". For each it
// registers 1 MiB (its upper half a known pattern), sends the descriptor,
// and checks every message: sequence number in order, each exactly once,
// checksum of the payload; on "end" it answers with what it counted.
// The client keeps W operations in flight out of N (eager and rendezvous
// messages, puts, gets, fetch_adds), then reads back what the puts and
// fetch_adds left and asks for the server's count. --expect ok: every
// operation succeeds and every check holds. --expect fail: CMD (run after
// connecting, e.g. a 100 % loss rule) breaks the link, and every operation
// must end with an error within --max-error-ms (else --deadline): no hang.
// (An eager message completes once posted, so it may succeed even then.)
// --keepalive sets connection_options::keepalive (ms, default 10000). Prints
// `netem: label=... key=value ...` and exits 0 when the expectation holds,
// 1 when not, 2 on a bad command line.
#include "../support/args.hpp"
#include "../support/sleep.hpp"

#include <anydoor/anydoor.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace asio = boost::asio;
namespace ad = anydoor;
using asio::awaitable;
using asio::use_awaitable;
using ms = std::chrono::milliseconds;
using anydoor::test::sleep_for;
using clock_type = std::chrono::steady_clock;

namespace {

constexpr std::size_t kRegion = std::size_t{1} << 20;
constexpr std::size_t kHalf = kRegion / 2;
constexpr std::size_t kCounterAt = kHalf - 8;           // fetch_add's word (end of the put half)
constexpr std::size_t kChunk = 4096, kPutSlots = 64;    // puts: slot i at i * kChunk
// (kRendezvous above connection_options::eager_split_limit, 64 KiB: never split.)
constexpr std::size_t kEager = 1024, kRendezvous = 96 * 1024;
constexpr std::uint64_t kEnd = 0xe7de7de7de7de7dull, kQuit = 0x9a179a179a179a1ull;

struct options {
  bool server = false;
  std::string address;
  std::string label = "run";
  std::uint32_t ops = 600;
  std::uint32_t window = 16;
  bool expect_fail = false;
  std::string after_connect;
  std::uint32_t deadline_s = 60;
  std::uint32_t keepalive_ms = 10000;  // connection_options::keepalive
  std::uint32_t max_error_ms = 0;      // --expect fail: every operation ended by then (0: by the deadline)
  bool quit = false;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "anydoor-netem-check: %s\nusage: anydoor-netem-check --server --listen HOST:PORT\n"
               "       anydoor-netem-check --connect HOST:PORT --label NAME [--ops N] [--window W] "
               "[--expect ok|fail] [--after-connect CMD] [--deadline S] [--keepalive MS] [--max-error-ms MS] "
               "[--quit]\n",
               why.c_str());
  std::exit(2);
}

options parse(int argc, char** argv) {
  options o;
  auto number = [](const char* s, unsigned long lo, unsigned long hi) {
    const auto v = anydoor::test::parse_number(s, lo, hi);
    if (!v) usage(anydoor::test::number_range_error(s, lo, hi));
    return *v;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) usage("missing value after " + a);
      return argv[++i];
    };
    if (a == "--server") o.server = true;
    else if (a == "--listen" || a == "--connect") o.address = next();
    else if (a == "--label") o.label = next();
    else if (a == "--ops") o.ops = number(next(), 5, 10'000'000);
    else if (a == "--window") o.window = number(next(), 1, 1024);
    else if (a == "--expect") {
      const std::string e = next();
      if (e != "ok" && e != "fail") usage("--expect takes ok or fail");
      o.expect_fail = e == "fail";
    } else if (a == "--after-connect") o.after_connect = next();
    else if (a == "--deadline") o.deadline_s = number(next(), 1, 3600);
    else if (a == "--keepalive") o.keepalive_ms = number(next(), 0, 3'600'000);
    else if (a == "--max-error-ms") o.max_error_ms = number(next(), 1, 3'600'000);
    else if (a == "--quit") o.quit = true;
    else usage("unknown option " + a);
  }
  if (o.address.empty()) usage(o.server ? "--server needs --listen HOST:PORT" : "give --server or --connect HOST:PORT");
  return o;
}

std::uint64_t fnv1a(const std::byte* p, std::size_t n) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ std::to_integer<std::uint64_t>(p[i])) * 0x100000001b3ull;
  return h;
}

void fill(std::byte* p, std::size_t n, std::uint64_t seed) {
  std::uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (std::size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = static_cast<std::byte>(x);
  }
}

// A message: seq (8) | checksum of the rest (8) | payload.
std::vector<std::byte> make_message(std::uint64_t seq, std::size_t n) {
  std::vector<std::byte> m(n);
  fill(m.data() + 16, n - 16, seq);
  const std::uint64_t sum = fnv1a(m.data() + 16, n - 16);
  std::memcpy(m.data(), &seq, 8);
  std::memcpy(m.data() + 8, &sum, 8);
  return m;
}

std::pair<std::string, std::string> split(const std::string& address) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos) usage("expected HOST:PORT: " + address);
  return {address.substr(0, colon), address.substr(colon + 1)};
}

// ------------------------------------------------------------------ server

struct counts {
  std::uint64_t received = 0, out_of_order = 0, bad_checksum = 0;
};

awaitable<void> serve(ad::fabric& fab, ad::connection c, bool& quit) {
  std::vector<std::byte> mem(kRegion);
  fill(mem.data() + kHalf, kHalf, 0x5eed);
  ad::memory_region mr = fab.register_memory(mem, ad::access::local_write | ad::access::remote_write |
                                                      ad::access::remote_read | ad::access::remote_atomic);
  const auto packed = mr.remote().pack();
  auto [e0, n0] = co_await c.async_send(asio::buffer(packed), asio::as_tuple(use_awaitable));
  if (e0) co_return;
  counts k;
  for (;;) {
    auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
    if (ec) {
      std::printf("netem-server: connection ended: %s (%llu messages in order)\n", ec.message().c_str(),
                  static_cast<unsigned long long>(k.received));
      co_return;
    }
    std::uint64_t seq = 0;
    if (m.size() >= 8) std::memcpy(&seq, m.data(), 8);
    if (m.size() == 8 && seq == kQuit) {
      quit = true;
      co_return;
    }
    if (m.size() == 8 && seq == kEnd) {
      co_await c.async_send(asio::buffer(&k, sizeof k), asio::as_tuple(use_awaitable));
      continue;
    }
    if (m.size() < 16 || seq != k.received) {
      ++k.out_of_order;
      k.received = seq + 1;
      continue;
    }
    std::uint64_t sum = 0;
    std::memcpy(&sum, m.data() + 8, 8);
    if (sum != fnv1a(m.data() + 16, m.size() - 16)) ++k.bad_checksum;
    ++k.received;
  }
}

int run_server(const options& o) {
  asio::io_context io;
  ad::fabric fab(io);
  const auto [host, port] = split(o.address);
  ad::acceptor acc = fab.listen(host, static_cast<std::uint16_t>(std::stoul(port)));
  std::printf("netem-server: listening on %s:%u (%s)\n", host.c_str(), acc.port(), std::string(fab.provider()).c_str());
  std::fflush(stdout);
  bool quit = false;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    while (!quit) {
      auto [ec, c] = co_await acc.async_accept(asio::as_tuple(use_awaitable));
      if (ec) break;
      asio::co_spawn(io, serve(fab, std::move(c), quit), asio::detached);
    }
  }, asio::detached);
  asio::co_spawn(io, [&]() -> awaitable<void> {
    while (!quit) co_await sleep_for(ms(50));
    acc.close();
  }, asio::detached);
  io.run();
  std::printf("netem-server: quit\n");
  return 0;
}

// ------------------------------------------------------------------ client

struct client_run {
  client_run(const options& opts, ad::fabric& f) : o(opts), fab(f) {}
  const options& o;
  ad::fabric& fab;
  ad::connection c;
  ad::remote_region region;
  std::uint32_t issued = 0, done = 0, ok = 0, failed = 0, in_flight = 0, eager_ok = 0;
  std::uint64_t next_seq = 0, adds_ok = 0, adds = 0, bad_get = 0;
  std::array<std::uint64_t, kPutSlots> last_put{};  // seq + 1 of the last put issued to each slot
  std::vector<double> latency_us;
  clock_type::time_point t0{}, first_error{}, last_error{};
  std::string first_error_text;
  std::vector<std::byte> get_source = std::vector<std::byte>(kHalf);

  awaitable<void> one(std::uint32_t i) {
    const auto start = clock_type::now();
    ad::error_code ec;
    switch (i % 5) {
      case 0:
      case 1: {  // eager, rendezvous
        const auto m = make_message(next_seq++, i % 5 == 0 ? kEager : kRendezvous);
        auto [e, n] = co_await c.async_send(asio::buffer(m), asio::as_tuple(use_awaitable));
        ec = e;
        break;
      }
      case 2: {
        const std::size_t slot = i % kPutSlots;
        std::vector<std::byte> data(kChunk);
        fill(data.data(), kChunk, i);
        last_put[slot] = i + 1u;
        auto [e, n] = co_await c.async_put(asio::buffer(data), region.at(slot * kChunk, kChunk),
                                           asio::as_tuple(use_awaitable));
        ec = e;
        break;
      }
      case 3: {
        const std::size_t off = (i * 4099u) % (kHalf - kChunk);
        std::vector<std::byte> data(kChunk);
        auto [e, n] = co_await c.async_get(asio::buffer(data), region.at(kHalf + off, kChunk),
                                           asio::as_tuple(use_awaitable));
        ec = e;
        if (!e && std::memcmp(data.data(), get_source.data() + off, kChunk) != 0) ++bad_get;
        break;
      }
      case 4: {
        ++adds;
        auto [e, before] = co_await c.async_fetch_add(region.at(kCounterAt, 8), 1, asio::as_tuple(use_awaitable));
        ec = e;
        if (!e) ++adds_ok;
        break;
      }
    }
    const auto end = clock_type::now();
    ++done;
    --in_flight;
    if (ec) {
      if (failed++ == 0) {
        first_error = end;
        first_error_text = ec.message();
      }
      last_error = end;
    } else {
      ++ok;
      if (i % 5 == 0) ++eager_ok;
      latency_us.push_back(std::chrono::duration<double, std::micro>(end - start).count());
    }
  }

  awaitable<void> drive() {
    fill(get_source.data(), kHalf, 0x5eed);
    t0 = clock_type::now();
    const auto deadline = t0 + std::chrono::seconds(o.deadline_s);
    while (done < o.ops && clock_type::now() < deadline) {
      while (issued < o.ops && in_flight < o.window) {
        ++in_flight;
        asio::co_spawn(co_await asio::this_coro::executor, one(issued++), asio::detached);
      }
      co_await sleep_for(ms(1));
    }
  }
};

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(p * static_cast<double>(v.size() - 1))];
}

ad::fabric_options fabric_options_for(const options& o) {
  ad::fabric_options fo;
  fo.connection.keepalive = std::chrono::milliseconds(o.keepalive_ms);
  return fo;
}

int run_client(const options& o) {
  asio::io_context io;
  ad::fabric fab(io, fabric_options_for(o));
  client_run r{o, fab};
  int rc = 1;
  std::string verdict_detail;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    // The server's guest may still be booting: try for up to 120 s.
    for (int attempt = 0;; ++attempt) {
      auto [ec, c] = co_await fab.async_connect(o.address, asio::as_tuple(use_awaitable));
      if (!ec) {
        r.c = std::move(c);
        break;
      }
      if (attempt >= 240) {
        verdict_detail = "connect: " + ec.message();
        co_return;
      }
      co_await sleep_for(ms(500));
    }
    if (o.quit) {
      const std::uint64_t q = kQuit;
      co_await r.c.async_send(asio::buffer(&q, 8), asio::as_tuple(use_awaitable));
      co_await sleep_for(ms(200));
      rc = 0;
      co_return;
    }
    auto [e1, m] = co_await r.c.async_receive(asio::as_tuple(use_awaitable));
    if (e1 || ad::remote_region::unpack(m.bytes(), r.region)) {
      verdict_detail = "no region from the server";
      co_return;
    }
    m = {};
    if (!o.after_connect.empty()) {
      const int s = std::system(o.after_connect.c_str());
      std::printf("netem: ran '%s': %d\n", o.after_connect.c_str(), s);
    }
    co_await r.drive();
    if (r.done < o.ops) {  // past the deadline: abort, so that everything pending ends now
      std::printf("netem: label=%s: %u of %u operations still pending after %u s: aborting the connection\n",
                  o.label.c_str(), o.ops - r.done, o.ops, o.deadline_s);
      r.c = {};
      while (r.in_flight > 0) co_await sleep_for(ms(10));
    }
    const double elapsed = std::chrono::duration<double>(clock_type::now() - r.t0).count();
    if (o.expect_fail) {
      const double first = r.failed ? std::chrono::duration<double, std::milli>(r.first_error - r.t0).count() : -1.0;
      const double last = r.failed ? std::chrono::duration<double, std::milli>(r.last_error - r.t0).count() : -1.0;
      const bool all_failed = r.done == o.ops && r.ok == r.eager_ok &&
                              (o.max_error_ms == 0 || last <= static_cast<double>(o.max_error_ms));
      std::printf("netem: label=%s expect=fail ops=%u failed=%u ok=%u eager_posted=%u first_error_ms=%.0f "
                  "last_error_ms=%.0f keepalive_ms=%u error=\"%s\" verdict=%s\n",
                  o.label.c_str(), o.ops, r.failed, r.ok, r.eager_ok, first, last, o.keepalive_ms,
                  r.first_error_text.c_str(), all_failed ? "pass" : "fail");
      rc = all_failed ? 0 : 1;
      co_return;
    }
    // Read back what the puts and the fetch_adds left, then the server's count.
    std::uint64_t bad_put = 0, counter = 0;
    std::vector<std::byte> back(kChunk);
    bool readback = r.failed == 0 && r.done == o.ops;
    for (std::size_t slot = 0; readback && slot < kPutSlots; ++slot) {
      if (r.last_put[slot] == 0) continue;
      auto [e, n] = co_await r.c.async_get(asio::buffer(back), r.region.at(slot * kChunk, kChunk),
                                           asio::as_tuple(use_awaitable));
      std::vector<std::byte> want(kChunk);
      fill(want.data(), kChunk, r.last_put[slot] - 1);
      if (e || back != want) ++bad_put;
    }
    if (readback) {
      auto [e, n] = co_await r.c.async_get(asio::buffer(&counter, 8), r.region.at(kCounterAt, 8),
                                           asio::as_tuple(use_awaitable));
      if (e) readback = false;
    }
    counts k{};
    if (readback) {
      const std::uint64_t end = kEnd;
      auto [e2, n2] = co_await r.c.async_send(asio::buffer(&end, 8), asio::as_tuple(use_awaitable));
      auto [e3, reply] = co_await r.c.async_receive(asio::as_tuple(use_awaitable));
      if (e2 || e3 || reply.size() != sizeof k) readback = false;
      else std::memcpy(&k, reply.data(), sizeof k);
    }
    const bool pass = readback && r.done == o.ops && r.failed == 0 && r.bad_get == 0 && bad_put == 0 &&
                      counter == r.adds_ok && r.adds_ok == r.adds && k.received == r.next_seq &&
                      k.out_of_order == 0 && k.bad_checksum == 0;
    std::printf("netem: label=%s expect=ok ops=%u ok=%u failed=%u elapsed_s=%.2f ops_per_s=%.0f p50_us=%.0f "
                "p99_us=%.0f messages_sent=%llu messages_received=%llu out_of_order=%llu bad_checksum=%llu "
                "bad_get=%llu bad_put=%llu counter=%llu fetch_adds=%llu first_error=\"%s\" verdict=%s\n",
                o.label.c_str(), o.ops, r.ok, r.failed, elapsed, elapsed > 0 ? r.done / elapsed : 0.0,
                percentile(r.latency_us, 0.5), percentile(r.latency_us, 0.99),
                static_cast<unsigned long long>(r.next_seq), static_cast<unsigned long long>(k.received),
                static_cast<unsigned long long>(k.out_of_order), static_cast<unsigned long long>(k.bad_checksum),
                static_cast<unsigned long long>(r.bad_get), static_cast<unsigned long long>(bad_put),
                static_cast<unsigned long long>(counter), static_cast<unsigned long long>(r.adds_ok),
                r.first_error_text.c_str(), pass ? "pass" : "fail");
    rc = pass ? 0 : 1;
  }, [&](std::exception_ptr e) {
    if (e) verdict_detail = "exception";
  });
  io.run();
  if (!verdict_detail.empty()) std::printf("netem: label=%s verdict=fail (%s)\n", o.label.c_str(), verdict_detail.c_str());
  std::fflush(stdout);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    return o.server ? run_server(o) : run_client(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "anydoor-netem-check: %s\n", e.what());
    return 1;
  }
}
