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
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
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
  load(asio::io_context& io, fabric& fab, const client_options& o) : io_(io), fab_(fab), o_(o), tick_(io) {}

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
      conns_[i].cli = rpc::client(std::move(c), {.timeout = std::chrono::milliseconds(
                                                     static_cast<std::int64_t>(o_.timeout * 1000))});
      if (++connected_ == o_.connections) return run();
      if (o_.connections > 1 && !o_.json && connected_ % 500 == 0) {
        std::fprintf(stderr, "anydoor-echo: %u of %u connections open\n", connected_, o_.connections);
      }
      connect_next();
    });
  }

  bool failed() const { return failed_; }
  const std::string& reason() const { return reason_; }

  void report() const {
    const double secs = std::chrono::duration<double>(end_ - begin_).count();
    const double rate = secs > 0 ? static_cast<double>(done_) / secs : 0;
    const double mbps = rate * static_cast<double>(o_.size) / 1e6;
    auto us = [&](double q) { return static_cast<double>(hist_.quantile(q)) / 1000.0; };
    const double max_us = static_cast<double>(hist_.max()) / 1000.0;
    if (o_.json) {
      std::printf(
          "{\"provider\":\"%.*s\",\"size\":%llu,\"connections\":%u,\"in_flight\":%u,\"messages\":%llu,"
          "\"seconds\":%.6f,\"msgs_per_s\":%.1f,\"mb_per_s\":%.3f,\"p50_us\":%.3f,\"p99_us\":%.3f,"
          "\"p999_us\":%.3f,\"max_us\":%.3f,\"verified\":%s}\n",
          static_cast<int>(fab_.provider().size()), fab_.provider().data(),
          static_cast<unsigned long long>(o_.size), o_.connections, o_.in_flight,
          static_cast<unsigned long long>(done_), secs, rate, mbps, us(0.5), us(0.99), us(0.999), max_us,
          o_.verify ? "true" : "false");
      return;
    }
    std::printf("anydoor-echo: %llu messages of %llu B in %.2f s over %u connection(s), %u in flight each "
                "(provider %.*s%s)\n",
                static_cast<unsigned long long>(done_), static_cast<unsigned long long>(o_.size), secs,
                o_.connections, o_.in_flight, static_cast<int>(fab_.provider().size()), fab_.provider().data(),
                o_.verify ? ", every byte verified" : "");
    std::printf("  messages/s %.1f  MB/s %.2f\n", rate, mbps);
    std::printf("  latency us  p50 %.2f  p99 %.2f  p99.9 %.2f  max %.2f\n", us(0.5), us(0.99), us(0.999), max_us);
  }

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
    if (failed_) return true;
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
    ++done_;
    issue(c, s);
    maybe_finish();
  }

  void fail(std::string why) {
    if (failed_) return;
    failed_ = true;
    reason_ = std::move(why);
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
      if (!o_.json && (o_.duration > 2 || elapsed > 2.0)) {
        const double dt = std::chrono::duration<double>(now - last_tick_).count();
        const double rate = static_cast<double>(done_ - last_done_) / dt;
        std::fprintf(stderr, "anydoor-echo: %.0f s: %llu messages, %.0f msg/s, %.2f MB/s, p99 %.1f us so far\n",
                     elapsed, static_cast<unsigned long long>(done_), rate,
                     rate * static_cast<double>(o_.size) / 1e6, static_cast<double>(hist_.quantile(0.99)) / 1000.0);
      }
      last_tick_ = now;
      last_done_ = done_;
      arm_tick();
    });
  }

  asio::io_context& io_;
  fabric& fab_;
  const client_options& o_;
  std::vector<conn> conns_;
  std::uint32_t connected_ = 0;
  std::uint32_t next_connect_ = 0;
  std::uint64_t issued_ = 0;
  std::uint64_t done_ = 0;
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

int run_client(const client_options& o) {
  asio::io_context io;
  fabric_options fo;
  fo.device.provider = o.provider;
  fo.max_connections = std::max<std::uint32_t>(64, o.connections);
  fo.connection.credits = o.credits;
  // Receive buffers for every connection's credits, with room to spare.
  fo.pool_max_bytes = std::max<std::size_t>(fo.pool_max_bytes, std::size_t{o.connections} * o.credits * 9 * 1024 * 5 / 4);
  ensure_fd_limit(std::uint64_t{o.connections} + 64, "anydoor-echo");
  // Replies above the eager limit are read into runtime memory: room for
  // every call in flight on a connection.
  fo.connection.rendezvous_memory =
      std::max<std::uint64_t>(std::uint64_t{16} << 20, o.size * std::min<std::uint64_t>(o.in_flight, 64));
  fabric fab(io, fo);
  auto l = std::make_unique<load>(io, fab, o);
  l->start();
  io.run();
  if (l->failed()) {
    std::fprintf(stderr, "anydoor-echo: %s\n", l->reason().c_str());
    return 1;
  }
  l->report();
  return 0;
}

}  // namespace anydoor::apps::echo
