// The echo load generator: N connections with K calls in flight each, every
// reply checked (size always, every byte with --verify), latency per call
// into a histogram; a progress line per second on long runs; a summary (or
// one JSON object) at the end. Any failure ends the run with a one-line
// reason and exit code 1: the server unreachable, gone (unavailable), or
// silent (no reply within --timeout).
#include "common/histogram.hpp"
#include "echo.hpp"

#include "common/fd_limit.hpp"

#include <anydoor/fabric.hpp>

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace anydoor::apps::echo {

namespace {

using clock = std::chrono::steady_clock;

struct slot {
  std::vector<std::byte> buf;
  clock::time_point start;
  std::uint64_t seq = 0;
};

class load {
 public:
  // progress: this load prints the per-second line (with --threads the
  // main thread prints one for all of them instead).
  // abort_all: set by the first load of a --threads run that fails, so that
  // the others stop issuing calls too (null: a single load).
  load(asio::io_context& io, fabric& fab, const client_options& o, bool progress, std::atomic<bool>* abort_all)
      : io_(io), fab_(fab), o_(o), progress_(progress), abort_all_(abort_all), tick_(io) {}

  // At most kConnectsAtOnce attempts at a time (each is a setup thread; a
  // listener holds a bounded number of handshakes), the next one started
  // as one completes.
  static constexpr std::uint32_t kConnectsAtOnce = 64;
  void start() {
    conns_.resize(o_.connections);
    for (std::uint32_t i = 0; i < std::min(kConnectsAtOnce, o_.connections); ++i) connect_next();
  }
  void connect_next() {
    if (failed_ || next_connect_ == o_.connections) return;
    const std::uint32_t i = next_connect_++;
    fab_.async_connect(o_.connect.str(), [this, i](error_code ec, connection c) {
      if (failed_) return;
      if (ec) return fail("cannot connect to " + o_.connect.str() + ": " + ec.message());
      conns_[i].cli = rpc::client(std::move(c), {.timeout = timeout_ms(o_.timeout)});
      if (++connected_ == o_.connections) return run();
      if (o_.connections > 1 && !o_.json && connected_ % 500 == 0) {
        std::fprintf(stderr, "anydoor-echo: %u of %u connections open\n", connected_, o_.connections);
      }
      connect_next();
    });
  }

  bool failed() const { return failed_; }
  const std::string& reason() const { return reason_; }

  // What the run did (once io.run() has returned).
  std::uint64_t done() const noexcept { return done_.load(std::memory_order_relaxed); }
  clock::time_point began() const noexcept { return begin_; }
  clock::time_point ended() const noexcept { return end_; }
  const histogram& latencies() const noexcept { return hist_; }

 private:
  struct conn {
    rpc::client cli;
    std::vector<slot> slots;
  };

  void run() {
    begin_ = last_tick_ = clock::now();
    if (o_.duration > 0) {
      stop_at_ = begin_ + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(o_.duration));
    }
    arm_tick();
    for (auto& c : conns_) {
      c.slots.resize(o_.in_flight);
      for (std::uint32_t k = 0; k < o_.in_flight; ++k) {
        slot& s = c.slots[k];
        s.buf.resize(o_.size);
        // A pattern that differs per slot and byte; the first 8 bytes
        // carry the message's sequence number.
        for (std::size_t i = 0; i < s.buf.size(); ++i) {
          s.buf[i] = static_cast<std::byte>((i * 131 + k * 7 + 1) & 0xff);
        }
      }
    }
    for (auto& c : conns_) {
      for (auto& s : c.slots) issue(c, s);
    }
    maybe_finish();
  }

  bool stopping() const {
    if (failed_ || (abort_all_ != nullptr && abort_all_->load(std::memory_order_relaxed))) return true;
    if (o_.count != 0) return issued_ >= o_.count;
    return clock::now() >= stop_at_;
  }

  void issue(conn& c, slot& s) {
    if (stopping()) return;
    ++issued_;
    ++in_flight_;
    s.seq = issued_;
    std::memcpy(s.buf.data(), &s.seq, std::min<std::size_t>(sizeof s.seq, s.buf.size()));
    s.start = clock::now();
    c.cli.async_call(method.id, asio::buffer(s.buf), [this, &c, &s](error_code ec, rpc::reply r) {
      --in_flight_;
      on_reply(c, s, ec, r);
    });
  }

  void on_reply(conn& c, slot& s, const error_code& ec, const rpc::reply& r) {
    if (failed_) return maybe_finish();
    if (ec) {
      if (ec == rpc::errc::deadline_exceeded) {
        fail("the server stopped answering: no reply within " + std::to_string(o_.timeout) + " s");
      } else if (ec == rpc::errc::unavailable) {
        fail("lost the connection to the server (it closed or died)");
      } else if (ec == rpc::errc::resource_exhausted && r.status_message().empty()) {
        fail("a call failed: resource exhausted (the message is larger than the server takes)");
      } else {
        std::string why = "a call failed: " + ec.message();
        if (!r.status_message().empty()) why += ": " + std::string(r.status_message());
        fail(why);
      }
      return maybe_finish();
    }
    if (r.size() != s.buf.size()) {
      return fail("message " + std::to_string(s.seq) + ": the echo has " + std::to_string(r.size()) +
                  " bytes, sent " + std::to_string(s.buf.size()));
    }
    if (o_.verify && std::memcmp(r.data(), s.buf.data(), s.buf.size()) != 0) {
      std::size_t at = 0;
      while (r.data()[at] == s.buf[at]) ++at;
      return fail("message " + std::to_string(s.seq) + ": the echo differs at byte " + std::to_string(at));
    }
    hist_.record(static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                clock::now() - s.start).count()));
    done_.store(done_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    issue(c, s);
    maybe_finish();
  }

  void fail(std::string why) {
    if (failed_) return;
    failed_ = true;
    reason_ = std::move(why);
    if (abort_all_ != nullptr) abort_all_->store(true, std::memory_order_relaxed);
    for (auto& c : conns_) {
      if (c.cli.is_open()) c.cli.abort();
    }
    maybe_finish();
  }

  void maybe_finish() {
    if (finished_ || in_flight_ != 0 || connected_ + (failed_ ? o_.connections : 0) < o_.connections) return;
    if (!failed_ && !stopping()) return;
    finished_ = true;
    end_ = clock::now();
    tick_.cancel();
    // Destroying the clients ends their connections (not inside one of
    // their own completions: posted).
    asio::post(io_, [this] { conns_.clear(); });
  }

  void arm_tick() {
    tick_.expires_after(std::chrono::seconds(1));
    tick_.async_wait([this](const error_code& ec) {
      if (ec || finished_) return;
      const auto now = clock::now();
      const double elapsed = std::chrono::duration<double>(now - begin_).count();
      const std::uint64_t done = done_.load(std::memory_order_relaxed);
      if (progress_ && !o_.json && (o_.duration > 2 || elapsed > 2.0)) {
        const double dt = std::chrono::duration<double>(now - last_tick_).count();
        const double rate = static_cast<double>(done - last_done_) / dt;
        std::fprintf(stderr, "anydoor-echo: %.0f s: %llu messages, %.0f msg/s, %.2f MB/s, p99 %.1f us so far\n",
                     elapsed, static_cast<unsigned long long>(done), rate,
                     rate * static_cast<double>(o_.size) / 1e6, static_cast<double>(hist_.quantile(0.99)) / 1000.0);
      }
      last_tick_ = now;
      last_done_ = done;
      arm_tick();
    });
  }

  asio::io_context& io_;
  fabric& fab_;
  const client_options& o_;
  bool progress_;
  std::atomic<bool>* abort_all_;
  std::vector<conn> conns_;
  std::uint32_t connected_ = 0;
  std::uint32_t next_connect_ = 0;
  std::uint64_t issued_ = 0;
  std::atomic<std::uint64_t> done_{0};  // written by this load's thread only; read by --threads' progress line
  std::uint64_t in_flight_ = 0;
  bool failed_ = false;
  bool finished_ = false;
  std::string reason_;
  histogram hist_;
  clock::time_point begin_, end_, stop_at_, last_tick_;
  std::uint64_t last_done_ = 0;
  asio::steady_timer tick_;
};

}  // namespace

namespace {

void print_report(const client_options& o, std::string_view provider, std::uint64_t done, double secs,
                  const histogram& hist) {
  const double rate = secs > 0 ? static_cast<double>(done) / secs : 0;
  const double mbps = rate * static_cast<double>(o.size) / 1e6;
  auto us = [&](double q) { return static_cast<double>(hist.quantile(q)) / 1000.0; };
  const double max_us = static_cast<double>(hist.max()) / 1000.0;
  if (o.json) {
    std::printf(
        "{\"provider\":\"%.*s\",\"size\":%llu,\"connections\":%u,\"in_flight\":%u,\"threads\":%u,"
        "\"messages\":%llu,\"seconds\":%.6f,\"msgs_per_s\":%.1f,\"mb_per_s\":%.3f,\"p50_us\":%.3f,"
        "\"p99_us\":%.3f,\"p999_us\":%.3f,\"max_us\":%.3f,\"verified\":%s}\n",
        static_cast<int>(provider.size()), provider.data(), static_cast<unsigned long long>(o.size), o.connections,
        o.in_flight, o.threads, static_cast<unsigned long long>(done), secs, rate, mbps, us(0.5), us(0.99),
        us(0.999), max_us, o.verify ? "true" : "false");
    return;
  }
  std::string threads;
  if (o.threads > 1) {
    threads = ", ";  // (not ", " + to_string(): GCC 12 at -O3 warns falsely, -Wrestrict)
    threads += std::to_string(o.threads);
    threads += " client threads";
  }
  std::printf("anydoor-echo: %llu messages of %llu B in %.2f s over %u connection(s), %u in flight each "
              "(provider %.*s%s%s)\n",
              static_cast<unsigned long long>(done), static_cast<unsigned long long>(o.size), secs, o.connections,
              o.in_flight, static_cast<int>(provider.size()), provider.data(), threads.c_str(),
              o.verify ? ", every byte verified" : "");
  std::printf("  messages/s %.1f  MB/s %.2f\n", rate, mbps);
  std::printf("  latency us  p50 %.2f  p99 %.2f  p99.9 %.2f  max %.2f\n", us(0.5), us(0.99), us(0.999), max_us);
}

fabric_options client_fabric_options(const client_options& o) {
  fabric_options fo;
  fo.device.provider = o.provider;
  // --timeout bounds each connection's set-up as it bounds each reply.
  fo.connection.connect_timeout = timeout_ms(o.timeout);
  fo.max_connections = std::max<std::uint32_t>(64, o.connections);
  fo.connection.credits = o.credits;
  // Receive buffers for every connection's credits, with room to spare.
  fo.pool_max_bytes = std::max<std::size_t>(fo.pool_max_bytes, std::size_t{o.connections} * o.credits * 9 * 1024 * 5 / 4);
  // Replies above the eager limit are read into runtime memory: room for
  // every call in flight on a connection.
  fo.connection.rendezvous_memory =
      std::max<std::uint64_t>(std::uint64_t{16} << 20, o.size * std::min<std::uint64_t>(o.in_flight, 64));
  return fo;
}

// One client thread: its own io_context, fabric and load (a share of the
// connections and of --count).
struct worker {
  client_options o;
  asio::io_context io{1};  // hint 1: one thread runs it (Asio queues what that thread posts without a lock)
  std::unique_ptr<fabric> fab;
  std::unique_ptr<load> l;
};

}  // namespace

int run_client(const client_options& o) {
  ensure_fd_limit(std::uint64_t{o.connections} + 64, "anydoor-echo");
  const std::uint32_t n = std::max<std::uint32_t>(1, o.threads);
  std::vector<std::unique_ptr<worker>> workers;
  std::atomic<bool> abort_all{false};
  for (std::uint32_t t = 0; t < n; ++t) {
    auto w = std::make_unique<worker>();
    w->o = o;
    w->o.threads = 1;
    w->o.connections = o.connections / n + (t < o.connections % n ? 1 : 0);
    if (o.count != 0) w->o.count = std::max<std::uint64_t>(1, o.count / n + (t < o.count % n ? 1 : 0));
    w->fab = std::make_unique<fabric>(w->io, client_fabric_options(w->o));
    w->l = std::make_unique<load>(w->io, *w->fab, w->o, n == 1, &abort_all);
    workers.push_back(std::move(w));
  }
  if (n == 1) {
    workers[0]->l->start();
    workers[0]->io.run();
  } else {
    std::vector<std::thread> threads;
    for (auto& w : workers) {
      threads.emplace_back([&w = *w] {
        w.l->start();
        w.io.run();
      });
    }
    // One progress line a second for all the threads (each load's own is off).
    std::atomic<bool> all_done{false};
    std::thread progress([&] {
      const auto t0 = clock::now();
      auto last = t0;
      std::uint64_t last_done = 0;
      while (!all_done.load()) {
        for (int i = 0; i < 100 && !all_done.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        if (all_done.load()) break;
        const auto now = clock::now();
        std::uint64_t done = 0;
        for (auto& w : workers) done += w->l->done();
        const double elapsed = std::chrono::duration<double>(now - t0).count();
        const double rate = static_cast<double>(done - last_done) / std::chrono::duration<double>(now - last).count();
        if (!o.json && (o.duration > 2 || elapsed > 2.0)) {
          std::fprintf(stderr, "anydoor-echo: %.0f s: %llu messages, %.0f msg/s, %.2f MB/s (%u client threads)\n",
                       elapsed, static_cast<unsigned long long>(done), rate,
                       rate * static_cast<double>(o.size) / 1e6, n);
        }
        last = now;
        last_done = done;
      }
    });
    for (auto& t : threads) t.join();
    all_done = true;
    progress.join();
  }
  for (auto& w : workers) {
    if (w->l->failed()) {
      std::fprintf(stderr, "anydoor-echo: %s\n", w->l->reason().c_str());
      return 1;
    }
  }
  std::uint64_t done = 0;
  histogram hist;
  auto begin = workers[0]->l->began();
  auto end = workers[0]->l->ended();
  for (auto& w : workers) {
    done += w->l->done();
    hist.merge(w->l->latencies());
    begin = std::min(begin, w->l->began());
    end = std::max(end, w->l->ended());
  }
  print_report(o, workers[0]->fab->provider(), done, std::chrono::duration<double>(end - begin).count(), hist);
  return 0;
}

}  // namespace anydoor::apps::echo
