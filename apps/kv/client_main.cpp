// anydoor-kv: the key-value store's command-line client and benchmark.
//   anydoor-kv --connect HOST:PORT put KEY VALUE | get KEY | del KEY
//   anydoor-kv --connect HOST:PORT bench [--workload a|b|c] [--keys N] [--value-size B]
//                                  [--duration S] [--in-flight N] [--get rpc|read] [--location-cache N]
//                                  [--json]
// Exit codes: 0 done (get: found), 1 not found, 2 an error (with the reason).
#include "client.hpp"
#include "common/args.hpp"
#include "common/histogram.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

namespace {

namespace kv = anydoor::apps::kv;
namespace asio = boost::asio;
namespace rpc = anydoor::rpc;
using anydoor::apps::arg_scanner;
using anydoor::apps::histogram;
using clock_type = std::chrono::steady_clock;

constexpr const char* kUsage =
    "anydoor-kv --connect HOST:PORT [--provider auto|tcp|verbs] [--timeout SECONDS] COMMAND\n"
    "  put KEY VALUE | get KEY [--get rpc|read] | del KEY\n"
    "  bench [--workload a|b|c] [--keys N] [--value-size BYTES] [--duration SECONDS] [--in-flight N]\n"
    "        [--get rpc|read] [--location-cache N] [--json]";

struct options {
  anydoor::apps::endpoint connect;
  std::string provider = "auto";
  double timeout = 10;
  std::string command;
  std::vector<std::string> words;
  char workload = 'a';
  std::uint64_t keys = 10000;
  std::uint64_t value_size = 100;
  double duration = 10;
  std::uint32_t in_flight = 16;
  bool read = false;  // --get read
  std::size_t location_cache = anydoor::apps::kv::kLocationCache;  // entries; 0: off
  bool json = false;
};

options parse(int argc, char** argv) {
  options o;
  arg_scanner a(argc, argv, 1, kUsage);
  bool connect = false;
  std::size_t want = 0;  // positional words the command takes
  while (a.next()) {
    const std::string_view s = a.arg();
    if (!o.command.empty() && o.words.size() < want) {
      o.words.emplace_back(s);  // verbatim (a value may start with --)
      continue;
    }
    if (s == "--help" || s == "-h") {
      std::printf("usage: %s\n", kUsage);
      std::exit(0);
    } else if (s == "--connect") {
      const std::string_view v = a.value();
      if (!anydoor::apps::parse_endpoint(v, o.connect)) a.fail("--connect takes HOST:PORT, not '" + std::string(v) + "'");
      connect = true;
    } else if (s == "--provider") {
      o.provider = std::string(a.value());
      if (o.provider != "auto" && o.provider != "tcp" && o.provider != "verbs") a.fail("--provider takes auto, tcp or verbs");
    } else if (s == "--timeout") {
      if (!anydoor::apps::parse_seconds(a.value(), o.timeout)) a.fail("--timeout takes a positive number of seconds");
    } else if (s == "--workload") {
      const std::string_view v = a.value();
      if (v != "a" && v != "b" && v != "c") a.fail("--workload takes a, b or c, not '" + std::string(v) + "'");
      o.workload = v[0];
    } else if (s == "--keys") {
      o.keys = a.size_value(1, std::uint64_t{1} << 32);
    } else if (s == "--value-size") {
      o.value_size = a.size_value(0, std::uint64_t{1} << 30);
    } else if (s == "--duration") {
      if (!anydoor::apps::parse_seconds(a.value(), o.duration)) a.fail("--duration takes a positive number of seconds");
    } else if (s == "--in-flight") {
      o.in_flight = static_cast<std::uint32_t>(a.size_value(1, 4096));
    } else if (s == "--get") {
      const std::string_view v = a.value();
      if (v != "rpc" && v != "read") a.fail("--get takes rpc or read, not '" + std::string(v) + "'");
      o.read = v == "read";
    } else if (s == "--location-cache") {
      o.location_cache = static_cast<std::size_t>(a.size_value(0, std::uint64_t{1} << 24));
    } else if (s == "--json") {
      o.json = true;
    } else if (s.starts_with("--")) {
      a.fail("unknown option " + std::string(s));
    } else if (o.command.empty()) {
      o.command = std::string(s);
      if (o.command == "put") want = 2;
      else if (o.command == "get" || o.command == "del") want = 1;
      else if (o.command == "bench") want = 0;
      else a.fail("unknown command '" + o.command + "' (put, get, del, bench)");
    } else {
      a.fail("unexpected argument '" + std::string(s) + "'");
    }
  }
  if (!connect) a.fail("needs --connect HOST:PORT");
  if (o.command.empty()) a.fail("needs a command: put, get, del or bench");
  if (o.words.size() != want) a.fail(o.command + " takes " + std::to_string(want) + " argument(s)");
  return o;
}

// YCSB's scrambled zipfian (theta 0.99) over n items.
class zipfian {
 public:
  explicit zipfian(std::uint64_t n) : n_(n) {
    if (n_ < 2) return;
    double z = 0;
    for (std::uint64_t i = 1; i <= n_; ++i) z += 1.0 / std::pow(static_cast<double>(i), kTheta);
    zetan_ = z;
    const double zeta2 = 1.0 + 1.0 / std::pow(2.0, kTheta);
    alpha_ = 1.0 / (1.0 - kTheta);
    eta_ = (1.0 - std::pow(2.0 / static_cast<double>(n_), 1.0 - kTheta)) / (1.0 - zeta2 / zetan_);
    half_pow_ = 1.0 + std::pow(0.5, kTheta);
  }
  std::uint64_t next(std::mt19937_64& rng) const {
    if (n_ < 2) return 0;
    const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
    const double uz = u * zetan_;
    std::uint64_t rank;
    if (uz < 1.0) rank = 0;
    else if (uz < half_pow_) rank = 1;
    else rank = static_cast<std::uint64_t>(static_cast<double>(n_) * std::pow(eta_ * u - eta_ + 1.0, alpha_));
    rank = std::min(rank, n_ - 1);
    // Scramble, so the hot keys are spread over the key space.
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < 8; ++i) h = (h ^ ((rank >> (8 * i)) & 0xff)) * 0x100000001b3ull;
    return h % n_;
  }

 private:
  static constexpr double kTheta = 0.99;
  std::uint64_t n_;
  double zetan_ = 1, alpha_ = 1, eta_ = 1, half_pow_ = 1;
};

std::string key_name(std::uint64_t i) {
  char b[32];
  std::snprintf(b, sizeof b, "key:%010llu", static_cast<unsigned long long>(i));
  return b;
}

// A value names its key and version in its first 8 bytes and fills the
// rest from both: any value read back can be checked for being one that
// was written for that key (never a torn mix).
void make_value(std::vector<std::byte>& v, std::size_t size, std::uint32_t key, std::uint32_t ver) {
  v.resize(size);
  for (std::size_t i = 0; i < size; ++i) v[i] = static_cast<std::byte>((key * 131u + ver * 29u + i * 7u) & 0xff);
  if (size >= 8) {
    std::memcpy(v.data(), &key, 4);
    std::memcpy(v.data() + 4, &ver, 4);
  }
}
bool value_ok(const std::string& got, std::size_t size, std::uint32_t key, std::vector<std::byte>& scratch) {
  if (got.size() != size) return false;
  if (size < 8) return true;
  std::uint32_t k, ver;
  std::memcpy(&k, got.data(), 4);
  std::memcpy(&ver, got.data() + 4, 4);
  if (k != key) return false;
  make_value(scratch, size, key, ver);
  return std::memcmp(scratch.data(), got.data(), size) == 0;
}

std::string describe(const rpc::status& st) { return st.message().empty() ? "error" : st.message(); }

struct bench_state {
  const options& o;
  kv::client& cli;
  zipfian zipf;
  clock_type::time_point stop_at;
  histogram get_lat, put_lat;
  std::uint64_t gets = 0, puts = 0;
  std::string error;
  bool done = false;
};

asio::awaitable<void> load_worker(bench_state& b, std::uint64_t& next, std::uint64_t& loaded) {
  std::vector<std::byte> v;
  while (next < b.o.keys && b.error.empty()) {
    const std::uint64_t i = next++;
    make_value(v, b.o.value_size, static_cast<std::uint32_t>(i), 0);
    const rpc::status st = co_await b.cli.put(key_name(i), v);
    if (!st.is_ok()) {
      b.error = "loading " + key_name(i) + ": " + describe(st);
      co_return;
    }
    ++loaded;
  }
}

asio::awaitable<void> run_worker(bench_state& b, std::uint32_t id) {
  std::mt19937_64 rng(0x5eed0000u + id);
  const double read_share = b.o.workload == 'a' ? 0.5 : b.o.workload == 'b' ? 0.95 : 1.0;
  kv::client::reader reader;
  if (b.o.read) reader = b.cli.make_reader();
  std::vector<std::byte> v, scratch;
  std::string got;
  std::uint32_t ver = id;
  while (b.error.empty() && clock_type::now() < b.stop_at) {
    const std::uint64_t i = b.zipf.next(rng);
    const std::string key = key_name(i);
    const bool get = std::uniform_real_distribution<double>(0.0, 1.0)(rng) < read_share;
    const auto t0 = clock_type::now();
    if (get) {
      // (No co_await inside ?: : GCC 12 miscompiles it.)
      rpc::status st;
      if (b.o.read) {
        st = co_await b.cli.read_get(reader, key, got);
      } else {
        st = co_await b.cli.get(key, got);
      }
      if (!st.is_ok()) {
        b.error = "get " + key + ": " + describe(st);
        break;
      }
      if (!value_ok(got, b.o.value_size, static_cast<std::uint32_t>(i), scratch)) {
        b.error = "get " + key + " returned a value that was never written for it";
        break;
      }
      b.get_lat.record(static_cast<std::uint64_t>((clock_type::now() - t0).count()));
      ++b.gets;
    } else {
      ver += 4096;
      make_value(v, b.o.value_size, static_cast<std::uint32_t>(i), ver);
      const rpc::status st = co_await b.cli.put(key, v);
      if (!st.is_ok()) {
        b.error = "put " + key + ": " + describe(st);
        break;
      }
      b.put_lat.record(static_cast<std::uint64_t>((clock_type::now() - t0).count()));
      ++b.puts;
    }
  }
}

asio::awaitable<int> bench(const options& o, kv::client& cli) {
  auto ex = co_await asio::this_coro::executor;
  if (o.read) {
    const rpc::status st = co_await cli.fetch_layout();
    if (!st.is_ok()) {
      std::fprintf(stderr, "anydoor-kv: cannot read the table one-sided: %s\n", describe(st).c_str());
      co_return 2;
    }
  }
  bench_state b{o, cli, zipfian(o.keys), {}, {}, {}, 0, 0, {}, false};
  // Load.
  const auto l0 = clock_type::now();
  std::uint64_t next = 0, loaded = 0;
  std::uint32_t running = 0;
  for (std::uint32_t w = 0; w < o.in_flight; ++w) {
    ++running;
    asio::co_spawn(ex, load_worker(b, next, loaded), [&](std::exception_ptr e) {
      --running;
      if (e && b.error.empty()) b.error = "a load worker failed";
    });
  }
  asio::steady_timer t(ex);
  auto last_print = clock_type::now();
  while (running != 0) {
    t.expires_after(std::chrono::milliseconds(5));
    co_await t.async_wait(asio::use_awaitable);
    if (!o.json && clock_type::now() - last_print >= std::chrono::seconds(1) && clock_type::now() - l0 > std::chrono::seconds(2)) {
      last_print = clock_type::now();
      std::fprintf(stderr, "anydoor-kv: loading: %llu of %llu keys\n", static_cast<unsigned long long>(loaded),
                   static_cast<unsigned long long>(o.keys));
    }
  }
  if (!b.error.empty()) {
    std::fprintf(stderr, "anydoor-kv: %s\n", b.error.c_str());
    co_return 2;
  }
  const double load_s = std::chrono::duration<double>(clock_type::now() - l0).count();
  // Run.
  const auto r0 = clock_type::now();
  b.stop_at = r0 + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(o.duration));
  for (std::uint32_t w = 0; w < o.in_flight; ++w) {
    ++running;
    asio::co_spawn(ex, run_worker(b, w), [&](std::exception_ptr e) {
      --running;
      if (e && b.error.empty()) {
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& x) {
          b.error = std::string("a worker failed: ") + x.what();
        }
      }
    });
  }
  last_print = r0;
  std::uint64_t last_ops = 0;
  while (running != 0) {
    t.expires_after(std::chrono::milliseconds(5));
    co_await t.async_wait(asio::use_awaitable);
    const auto now = clock_type::now();
    if (!o.json && o.duration > 2 && now - last_print >= std::chrono::seconds(1)) {
      const double dt = std::chrono::duration<double>(now - last_print).count();
      const std::uint64_t ops = b.gets + b.puts;
      std::fprintf(stderr, "anydoor-kv: %.0f s: %.0f ops/s, get p99 %.1f us\n",
                   std::chrono::duration<double>(now - r0).count(), static_cast<double>(ops - last_ops) / dt,
                   static_cast<double>(b.get_lat.quantile(0.99)) / 1000.0);
      last_print = now;
      last_ops = ops;
    }
  }
  const double secs = std::chrono::duration<double>(clock_type::now() - r0).count();
  if (!b.error.empty()) {
    std::fprintf(stderr, "anydoor-kv: %s\n", b.error.c_str());
    co_return 2;
  }
  const std::uint64_t ops = b.gets + b.puts;
  auto us = [](const histogram& h, double q) { return static_cast<double>(h.quantile(q)) / 1000.0; };
  const auto& rs = cli.reads();
  if (o.json) {
    std::printf("{\"workload\":\"%c\",\"keys\":%llu,\"value_size\":%llu,\"in_flight\":%u,\"get\":\"%s\","
                "\"load_seconds\":%.3f,\"seconds\":%.3f,\"ops\":%llu,\"ops_per_s\":%.1f,\"get_ops\":%llu,"
                "\"put_ops\":%llu,\"get_p50_us\":%.3f,\"get_p99_us\":%.3f,\"get_p999_us\":%.3f,\"get_max_us\":%.3f,"
                "\"put_p50_us\":%.3f,\"put_p99_us\":%.3f,\"put_p999_us\":%.3f,\"put_max_us\":%.3f,"
                "\"reads\":%llu,\"read_hits\":%llu,\"read_retries\":%llu,\"read_fallbacks\":%llu,"
                "\"read_ahead\":%llu,\"read_ahead_hits\":%llu}\n",
                o.workload, static_cast<unsigned long long>(o.keys), static_cast<unsigned long long>(o.value_size),
                o.in_flight, o.read ? "read" : "rpc", load_s, secs, static_cast<unsigned long long>(ops),
                static_cast<double>(ops) / secs, static_cast<unsigned long long>(b.gets),
                static_cast<unsigned long long>(b.puts), us(b.get_lat, 0.5), us(b.get_lat, 0.99),
                us(b.get_lat, 0.999), static_cast<double>(b.get_lat.max()) / 1000.0, us(b.put_lat, 0.5),
                us(b.put_lat, 0.99), us(b.put_lat, 0.999), static_cast<double>(b.put_lat.max()) / 1000.0,
                static_cast<unsigned long long>(rs.reads), static_cast<unsigned long long>(rs.hits),
                static_cast<unsigned long long>(rs.retries), static_cast<unsigned long long>(rs.fallbacks),
                static_cast<unsigned long long>(rs.ahead), static_cast<unsigned long long>(rs.ahead_hits));
    co_return 0;
  }
  const int get_pct = o.workload == 'a' ? 50 : o.workload == 'b' ? 95 : 100;
  std::printf("anydoor-kv bench: workload %c (%d%% get, %d%% put), %llu zipfian keys of %llu B, %u in flight, "
              "get by %s; loaded in %.2f s, ran %.2f s\n",
              o.workload, get_pct, 100 - get_pct, static_cast<unsigned long long>(o.keys),
              static_cast<unsigned long long>(o.value_size), o.in_flight, o.read ? "one-sided read" : "rpc", load_s,
              secs);
  std::printf("  ops/s %.1f (get %llu, put %llu)\n", static_cast<double>(ops) / secs,
              static_cast<unsigned long long>(b.gets), static_cast<unsigned long long>(b.puts));
  std::printf("  get latency us  p50 %.2f  p99 %.2f  p99.9 %.2f  max %.2f\n", us(b.get_lat, 0.5), us(b.get_lat, 0.99),
              us(b.get_lat, 0.999), static_cast<double>(b.get_lat.max()) / 1000.0);
  if (b.puts != 0) {
    std::printf("  put latency us  p50 %.2f  p99 %.2f  p99.9 %.2f  max %.2f\n", us(b.put_lat, 0.5),
                us(b.put_lat, 0.99), us(b.put_lat, 0.999), static_cast<double>(b.put_lat.max()) / 1000.0);
  }
  if (o.read) {
    std::printf("  one-sided: %llu READs for %llu gets, %llu hits, %llu retries, %llu by rpc; "
                "%llu items READ ahead from the location cache, %llu taken\n",
                static_cast<unsigned long long>(rs.reads), static_cast<unsigned long long>(rs.gets),
                static_cast<unsigned long long>(rs.hits), static_cast<unsigned long long>(rs.retries),
                static_cast<unsigned long long>(rs.fallbacks), static_cast<unsigned long long>(rs.ahead),
                static_cast<unsigned long long>(rs.ahead_hits));
  }
  co_return 0;
}

asio::awaitable<int> run(const options& o, anydoor::fabric& fab) {
  auto [ec, conn] = co_await fab.async_connect(o.connect.str(), asio::as_tuple(asio::use_awaitable));
  if (ec) {
    std::fprintf(stderr, "anydoor-kv: cannot connect to %s: %s\n", o.connect.str().c_str(), ec.message().c_str());
    co_return 2;
  }
  kv::client cli(fab, std::move(conn), anydoor::apps::timeout_ms(o.timeout),
                 o.location_cache);
  if (o.command == "bench") co_return co_await bench(o, cli);
  const std::string& key = o.words[0];
  if (o.command == "put") {
    const std::string& value = o.words[1];
    const rpc::status st = co_await cli.put(key, std::span<const std::byte>(
                                                     reinterpret_cast<const std::byte*>(value.data()), value.size()));
    if (!st.is_ok()) {
      std::fprintf(stderr, "anydoor-kv: put failed: %s\n", describe(st).c_str());
      co_return 2;
    }
    std::printf("OK\n");
    co_return 0;
  }
  if (o.command == "del") {
    bool existed = false;
    const rpc::status st = co_await cli.del(key, existed);
    if (!st.is_ok()) {
      std::fprintf(stderr, "anydoor-kv: del failed: %s\n", describe(st).c_str());
      co_return 2;
    }
    std::printf(existed ? "deleted\n" : "not found\n");
    co_return existed ? 0 : 1;
  }
  std::string value;
  rpc::status st;
  if (o.read) {
    st = co_await cli.fetch_layout();
    if (st.is_ok()) {
      kv::client::reader r = cli.make_reader();
      st = co_await cli.read_get(r, key, value);
    }
  } else {
    st = co_await cli.get(key, value);
  }
  if (st.code() == rpc::errc::not_found) {
    std::printf("not found\n");
    co_return 1;
  }
  if (!st.is_ok()) {
    std::fprintf(stderr, "anydoor-kv: get failed: %s\n", describe(st).c_str());
    co_return 2;
  }
  std::fwrite(value.data(), 1, value.size(), stdout);
  std::printf("\n");
  co_return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    asio::io_context io{1};  // hint 1: one thread runs it (Asio queues what that thread posts without a lock)
    anydoor::fabric_options fo;
    fo.device.provider = o.provider;
    // --timeout bounds the connection's set-up as it bounds each call (a
    // server that accepts at the socket and never answers: SIGSTOPped).
    fo.connection.connect_timeout = anydoor::apps::timeout_ms(o.timeout);
    fo.connection.max_message = std::uint64_t{1} << 30;
    fo.connection.rendezvous_memory = std::max<std::uint64_t>(std::uint64_t{64} << 20, o.value_size * 4);
    anydoor::fabric fab(io, fo);
    int rc = 2;
    asio::co_spawn(io, run(o, fab), [&](std::exception_ptr e, int r) {
      if (e) {
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& x) {
          std::fprintf(stderr, "anydoor-kv: %s\n", x.what());
        }
        rc = 2;
      } else {
        rc = r;
      }
    });
    io.run();
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "anydoor-kv: %s\n", e.what());
    return 2;
  }
}
