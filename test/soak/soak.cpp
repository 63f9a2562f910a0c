// anydoor-soak: many connections under steady load for a bounded time,
// with connections closed and reopened while it runs. Checks that nothing
// is lost or duplicated, that no RNR happens, and that the process's memory
// and descriptors stay flat once warmed up.
//
//   anydoor-soak [--connections N] [--inflight K] [--seconds S] [--warmup S]
//                [--churn-ms M] [--rss-slack PCT] [--provider tcp|verbs|auto]
//
// Both ends run in this process, on one io_context: a server fabric that
// accepts, and a client fabric whose N connection slots each keep K
// operations in flight: eager messages, rendezvous messages, puts, gets and
// fetch_adds on the server's memory. Every M ms one slot closes its
// connection gracefully (after its operations drain) and opens a new one.
// At each close the server checks the slot's accounts (and answers before
// the client closes): messages arrived in
// order, each exactly once and intact; the last put of every put lane is in
// its area; the counter equals the successful fetch_adds.
// Output: a progress line per second, then `soak: key=value ...` (keys:
// connections inflight seconds ops messages rendezvous puts gets atomics
// reopened errors lost duplicated corrupt rnr rss_start_kib rss_end_kib
// rss_max_kib fd_start fd_end fd_min fd_max left_open verdict). Exit 0 when
// verdict=pass: nothing lost, duplicated or corrupt, no error, no RNR NAK,
// RSS after the warm-up within --rss-slack percent of its first sample, the
// descriptor count within 4, no connection left open at the end, at least
// one reopening per 10 s (unless --churn-ms 0), and every slot drained
// within 60 s of the end (else the stuck slots are named).
#include "../support/args.hpp"
#include "../support/process.hpp"
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
#include <fstream>
#include <memory>
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
using anydoor::test::open_fds;
using anydoor::test::rss_kib;

namespace {

struct options {
  std::uint32_t connections = 256;
  std::uint32_t inflight = 64;
  std::uint32_t seconds = 60;
  std::uint32_t warmup = 15;
  std::uint32_t churn_ms = 250;
  std::uint32_t rss_slack = 10;  // percent
  std::string provider = "tcp";
};

constexpr const char* kUsage =
    "anydoor-soak [--connections N] [--inflight K] [--seconds S] [--warmup S] [--churn-ms M] "
    "[--rss-slack PCT] [--provider tcp|verbs|auto]";

options parse(int argc, char** argv) {
  options o;
  auto fail = [&](const std::string& why) {
    std::fprintf(stderr, "anydoor-soak: %s\nusage: %s\n", why.c_str(), kUsage);
    std::exit(2);
  };
  auto number = [&](const char* s, unsigned long lo, unsigned long hi) {
    const auto v = anydoor::test::parse_number(s, lo, hi);
    if (!v) fail(anydoor::test::number_range_error(s, lo, hi));
    return *v;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) fail("missing value after " + a);
      return argv[++i];
    };
    if (a == "--connections") o.connections = number(next(), 1, 2000);
    else if (a == "--inflight") o.inflight = number(next(), 8, 1024);
    else if (a == "--seconds") o.seconds = number(next(), 1, 86400);
    else if (a == "--warmup") o.warmup = number(next(), 0, 86400);
    else if (a == "--churn-ms") o.churn_ms = number(next(), 0, 3600000);
    else if (a == "--rss-slack") o.rss_slack = number(next(), 0, 1000);
    else if (a == "--provider") o.provider = next();
    else if (a == "--help" || a == "-h") {
      std::printf("usage: %s\n", kUsage);
      std::exit(0);
    } else {
      fail("unknown option " + a);
    }
  }
  if (o.warmup >= o.seconds) fail("--warmup must be shorter than --seconds");
  return o;
}

// Operation lanes of a connection cycle through these kinds.
enum class kind : std::uint8_t { eager, rendezvous, put, get, add };
constexpr kind kCycle[8] = {kind::eager, kind::eager, kind::put, kind::eager,
                            kind::rendezvous, kind::get, kind::eager, kind::add};
constexpr std::size_t kEager = 1024, kRendezvous = 16 * 1024, kChunk = 4096;
constexpr std::uint32_t kEagerLimit = 4096;

// The server's memory for one slot: put areas (one per put lane), the get
// source, the fetch_add counter.
struct slot_layout {
  std::size_t put_lanes;
  std::size_t bytes() const { return (put_lanes + 1) * kChunk + 8; }
  std::size_t put_at(std::size_t lane) const { return lane * kChunk; }
  std::size_t get_at() const { return put_lanes * kChunk; }
  std::size_t counter_at() const { return (put_lanes + 1) * kChunk; }
};

// Content of message `seq` (or put `seq`): every 8th byte position carries
// a word derived from seq and the offset, so reordering, duplication and
// stale bytes all show.
void fill(std::byte* p, std::size_t n, std::uint64_t seq) {
  for (std::size_t off = 0; off + 8 <= n; off += 8) {
    const std::uint64_t w = seq * 0x9e3779b97f4a7c15ull ^ off;
    std::memcpy(p + off, &w, 8);
  }
}
bool matches(const std::byte* p, std::size_t n, std::uint64_t seq) {
  for (std::size_t off = 0; off + 8 <= n; off += 8) {
    std::uint64_t w = 0;
    std::memcpy(&w, p + off, 8);
    if (w != (seq * 0x9e3779b97f4a7c15ull ^ off)) return false;
  }
  return true;
}

// What the client reports when it closes a slot's connection.
struct bye {
  std::uint64_t magic = 0xb7eb7eb7eull;
  std::uint64_t slot = 0;
  std::uint64_t messages = 0;      // sent successfully
  std::uint64_t atomics = 0;       // fetch_adds that succeeded
  std::array<std::uint64_t, 64> last_put{};  // per put lane: seq + 1 of its last put (0: none)
};

struct totals {
  std::uint64_t ops = 0, messages = 0, rendezvous = 0, puts = 0, gets = 0, atomics = 0;
  std::uint64_t reopened = 0, errors = 0, lost = 0, duplicated = 0, corrupt = 0;
  void error(const std::string& what) {
    if (errors++ < 10) std::fprintf(stderr, "soak: error: %s\n", what.c_str());
  }
};

struct soak {
  options opt;
  asio::io_context io;
  std::unique_ptr<ad::fabric> server, client;
  std::optional<ad::acceptor> acc;
  std::vector<std::byte> server_mem;
  std::optional<ad::memory_region> server_mr;
  slot_layout layout{};
  totals t;
  bool running = true;
  std::string address;

  struct slot {
    std::uint32_t index = 0;
    bool stop = false;
    bool active = false;       // its connection coroutine runs
    std::vector<std::byte> mem;  // per lane: the rendezvous source, the get destination
    std::optional<ad::memory_region> mr;
  };
  std::vector<slot> slots;
  ad::transport::device_counters client_rnr0, server_rnr0;  // at the start: verbs counts since the driver loaded
  bool hung = false;

  explicit soak(const options& o) : opt(o) {
    ad::fabric_options fo;
    fo.device.provider = o.provider;
    fo.max_connections = o.connections + 16;
    fo.connection.eager_limit = kEagerLimit;
    fo.connection.credits = static_cast<std::uint16_t>(std::max<std::uint32_t>(64, o.inflight));
    fo.connection.send_queue = std::max<std::uint32_t>(128, 2 * o.inflight);
    fo.pool_max_bytes = std::size_t{1} << 30;
    server = std::make_unique<ad::fabric>(io, fo);
    client = std::make_unique<ad::fabric>(io, fo);
    layout.put_lanes = 0;
    for (std::uint32_t k = 0; k < o.inflight; ++k) layout.put_lanes += kCycle[k % 8] == kind::put ? 1u : 0u;
    layout.put_lanes = std::min<std::size_t>(layout.put_lanes, 64);
    server_mem.assign(layout.bytes() * o.connections, std::byte{0});
    server_mr.emplace(server->register_memory(server_mem, ad::access::local_write | ad::access::remote_write |
                                                              ad::access::remote_read | ad::access::remote_atomic));
    for (std::uint32_t s = 0; s < o.connections; ++s) fill(&server_mem[s * layout.bytes() + layout.get_at()], kChunk, s);
    client_rnr0 = client->device().counters();
    server_rnr0 = server->device().counters();
    acc.emplace(server->listen("127.0.0.1", 0));
    address = "127.0.0.1:" + std::to_string(acc->port());
    slots.resize(o.connections);
    for (std::uint32_t s = 0; s < o.connections; ++s) {
      slots[s].index = s;
      slots[s].mem.assign(std::size_t{o.inflight} * kRendezvous, std::byte{0});
      slots[s].mr.emplace(client->register_memory(slots[s].mem, ad::access::local_write));
    }
  }

  // ------------------------------------------------------------ server side
  awaitable<void> accept_loop() {
    while (running) {
      auto [ec, c] = co_await acc->async_accept(asio::as_tuple(use_awaitable));
      if (ec) {
        if (running) t.error("accept: " + ec.message());
        co_return;
      }
      asio::co_spawn(io, serve(std::move(c)), asio::detached);
    }
  }

  awaitable<void> serve(ad::connection c) {
    // hello: the slot index
    auto [e1, hello] = co_await c.async_receive(asio::as_tuple(use_awaitable));
    std::uint64_t s = 0;
    if (e1 || hello.size() != 8) {
      t.error("server: no hello: " + e1.message());
      co_return;
    }
    std::memcpy(&s, hello.data(), 8);
    if (s >= opt.connections) {
      t.error("server: bad slot");
      co_return;
    }
    std::byte* base = &server_mem[s * layout.bytes()];
    std::memset(base, 0, layout.get_at());           // put areas
    std::memset(base + layout.counter_at(), 0, 8);   // counter
    const auto region = server_mr->remote().at(s * layout.bytes(), layout.bytes()).pack();
    auto [e2, n2] = co_await c.async_send(asio::buffer(region), asio::as_tuple(use_awaitable));
    if (e2) {
      t.error("server: sending the region: " + e2.message());
      co_return;
    }
    std::uint64_t next = 0;
    bool said_bye = false;
    for (;;) {
      auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
      if (ec == ad::errc::connection_closed) break;
      if (ec) {
        t.error("server: receive: " + ec.message());
        co_return;
      }
      if (m.size() == sizeof(bye)) {
        bye b;
        std::memcpy(&b, m.data(), sizeof b);
        if (b.magic == bye{}.magic) {
          said_bye = true;
          if (b.messages > next) t.lost += b.messages - next;
          if (b.messages < next) t.duplicated += next - b.messages;
          std::uint64_t counter = 0;
          std::memcpy(&counter, base + layout.counter_at(), 8);
          if (counter != b.atomics) t.error("slot " + std::to_string(s) + ": counter " + std::to_string(counter) +
                                            ", fetch_adds " + std::to_string(b.atomics));
          for (std::size_t lane = 0; lane < layout.put_lanes; ++lane) {
            const std::byte* area = base + layout.put_at(lane);
            const bool ok = b.last_put[lane] == 0
                                ? std::all_of(area, area + kChunk, [](std::byte x) { return x == std::byte{0}; })
                                : matches(area, kChunk, b.last_put[lane] - 1);
            if (!ok) {
              ++t.corrupt;
              t.error("slot " + std::to_string(s) + ": put lane " + std::to_string(lane) + " holds other bytes");
            }
          }
          // Checked: the client may close (and the slot's next connection
          // may reset the area).
          auto [ea, na] = co_await c.async_send(asio::buffer(&b.magic, 8), asio::as_tuple(use_awaitable));
          if (ea) t.error("server: answering the accounts: " + ea.message());
          continue;
        }
      }
      std::uint64_t seq = ~std::uint64_t{0};
      if (m.size() >= 8) std::memcpy(&seq, m.data(), 8);
      if (seq != next) {
        if (seq < next) ++t.duplicated;
        else t.lost += seq - next;
        t.error("slot " + std::to_string(s) + ": message " + std::to_string(seq) + ", expected " + std::to_string(next));
      } else if ((m.size() != kEager && m.size() != kRendezvous) || !matches(m.data() + 8, m.size() - 8, seq)) {
        ++t.corrupt;
      }
      next = seq + 1;
    }
    if (!said_bye) t.error("slot " + std::to_string(s) + ": closed without its accounts");
    auto [e3] = co_await c.async_close(asio::as_tuple(use_awaitable));
    if (e3 && e3 != ad::errc::connection_closed) t.error("server: close: " + e3.message());
  }

  // ------------------------------------------------------------ client side
  struct conn_state {
    ad::connection conn;
    ad::remote_region region;
    std::uint64_t next_seq = 0;
    std::uint64_t messages = 0, atomics = 0;
    std::array<std::uint64_t, 64> last_put{};
    std::uint32_t lanes_running = 0;
  };

  awaitable<void> lane(slot& sl, conn_state& cs, std::uint32_t k) {
    const kind what = kCycle[k % 8];
    std::byte* mine = &sl.mem[std::size_t{k} * kRendezvous];
    std::size_t put_lane = 0;
    for (std::uint32_t j = 0; j < k; ++j) put_lane += kCycle[j % 8] == kind::put ? 1u : 0u;
    std::array<std::byte, kEager> eager{};
    std::uint64_t put_seq = 0;
    while (!sl.stop && running) {
      switch (what) {
        case kind::eager:
        case kind::rendezvous: {
          const std::uint64_t seq = cs.next_seq++;
          std::byte* p = what == kind::eager ? eager.data() : mine;
          const std::size_t n = what == kind::eager ? kEager : kRendezvous;
          std::memcpy(p, &seq, 8);
          fill(p + 8, n - 8, seq);
          auto [ec, sent] = co_await cs.conn.async_send(asio::buffer(p, n), asio::as_tuple(use_awaitable));
          if (ec) {
            t.error("send: " + ec.message());
            sl.stop = true;
            break;
          }
          ++cs.messages;
          ++(what == kind::eager ? t.messages : t.rendezvous);
          break;
        }
        case kind::put: {
          if (put_lane >= 64) co_return;
          const std::uint64_t seq = (std::uint64_t{sl.index} << 40) | put_seq++;
          fill(mine, kChunk, seq);
          auto [ec, n] = co_await cs.conn.async_put(sl.mr->at(std::size_t{k} * kRendezvous, kChunk),
                                                    cs.region.at(layout.put_at(put_lane), kChunk),
                                                    asio::as_tuple(use_awaitable));
          if (ec) {
            t.error("put: " + ec.message());
            sl.stop = true;
            break;
          }
          cs.last_put[put_lane] = seq + 1;
          ++t.puts;
          break;
        }
        case kind::get: {
          std::memset(mine, 0, kChunk);
          auto [ec, n] = co_await cs.conn.async_get(sl.mr->at(std::size_t{k} * kRendezvous, kChunk),
                                                    cs.region.at(layout.get_at(), kChunk),
                                                    asio::as_tuple(use_awaitable));
          if (ec) {
            t.error("get: " + ec.message());
            sl.stop = true;
            break;
          }
          if (!matches(mine, kChunk, sl.index)) ++t.corrupt;
          ++t.gets;
          break;
        }
        case kind::add: {
          auto [ec, before] = co_await cs.conn.async_fetch_add(cs.region.at(layout.counter_at(), 8), 1,
                                                               asio::as_tuple(use_awaitable));
          if (ec) {
            t.error("fetch_add: " + ec.message());
            sl.stop = true;
            break;
          }
          ++cs.atomics;
          ++t.atomics;
          break;
        }
      }
      ++t.ops;
    }
  }

  // A slot counts as active from here until its connection has closed, so
  // the churn never runs two connections of one slot at once.
  void start_slot(slot& sl) {
    sl.active = true;
    sl.stop = false;
    asio::co_spawn(io, run_slot(sl), asio::detached);
  }

  awaitable<void> run_slot(slot& sl) {
    conn_state cs;
    auto [e1, c] = co_await client->async_connect(address, asio::as_tuple(use_awaitable));
    if (e1) {
      t.error("connect: " + e1.message());
      sl.active = false;
      co_return;
    }
    cs.conn = std::move(c);
    const std::uint64_t index = sl.index;
    auto [e2, n2] = co_await cs.conn.async_send(asio::buffer(&index, 8), asio::as_tuple(use_awaitable));
    auto [e3, m] = co_await cs.conn.async_receive(asio::as_tuple(use_awaitable));
    if (e2 || e3 || ad::remote_region::unpack(m.bytes(), cs.region)) {
      t.error("slot setup failed");
      sl.active = false;
      co_return;
    }
    m = {};
    cs.lanes_running = opt.inflight;
    for (std::uint32_t k = 0; k < opt.inflight; ++k) {
      asio::co_spawn(io, lane(sl, cs, k), [this, &cs](std::exception_ptr e) {
        if (e) t.error("an operation lane ended with an exception");
        --cs.lanes_running;
      });
    }
    while (cs.lanes_running > 0) co_await sleep_for(ms(5));
    bye b;
    b.slot = sl.index;
    b.messages = cs.messages;
    b.atomics = cs.atomics;
    b.last_put = cs.last_put;
    auto [e4, n4] = co_await cs.conn.async_send(asio::buffer(&b, sizeof b), asio::as_tuple(use_awaitable));
    if (e4) t.error("bye: " + e4.message());
    auto [e6, checked] = co_await cs.conn.async_receive(asio::as_tuple(use_awaitable));
    if (e6 || checked.size() != 8) t.error("the server did not answer the accounts: " + e6.message());
    checked = {};
    auto [e5] = co_await cs.conn.async_close(asio::as_tuple(use_awaitable));
    if (e5) t.error("close: " + e5.message());
    sl.active = false;
  }

  awaitable<void> churn() {
    if (opt.churn_ms == 0) co_return;
    std::uint32_t next = 0;
    while (running) {
      co_await sleep_for(ms(opt.churn_ms));
      if (!running) break;
      slot& sl = slots[next++ % opt.connections];
      sl.stop = true;
      while (sl.active) co_await sleep_for(ms(2));
      if (!running) break;
      ++t.reopened;
      start_slot(sl);
    }
  }

  struct sample {
    double at;
    std::size_t rss, fds;
  };
  std::vector<sample> samples;

  awaitable<void> monitor() {
    const auto t0 = clock_type::now();
    std::uint64_t last_ops = 0;
    for (std::uint32_t sec = 1; sec <= opt.seconds; ++sec) {
      co_await asio::steady_timer(io, t0 + std::chrono::seconds(sec)).async_wait(use_awaitable);
      const std::size_t rss = rss_kib(), fds = open_fds();
      samples.push_back({static_cast<double>(sec), rss, fds});
      std::printf("soak: t=%us ops/s=%llu rss_kib=%zu fds=%zu reopened=%llu errors=%llu%s\n", sec,
                  static_cast<unsigned long long>(t.ops - last_ops), rss, fds,
                  static_cast<unsigned long long>(t.reopened), static_cast<unsigned long long>(t.errors),
                  sec <= opt.warmup ? " (warm-up)" : "");
      std::fflush(stdout);
      last_ops = t.ops;
    }
    running = false;
    for (auto& s : slots) s.stop = true;
    const auto drain_deadline = clock_type::now() + std::chrono::seconds(60);
    for (bool busy = true; busy;) {
      busy = false;
      for (auto& s : slots) busy |= s.active;
      if (!busy) break;
      if (clock_type::now() > drain_deadline) {
        std::string stuck;
        for (auto& s : slots) {
          if (s.active) stuck += " " + std::to_string(s.index);
        }
        std::printf("soak: slots still draining 60 s after the end:%s\n", stuck.c_str());
        hung = true;
        io.stop();
        co_return;
      }
      co_await sleep_for(ms(10));
    }
    acc->close();
  }

  int run() {
    asio::co_spawn(io, accept_loop(), asio::detached);
    for (auto& s : slots) start_slot(s);
    asio::co_spawn(io, churn(), asio::detached);
    asio::co_spawn(io, monitor(), asio::detached);
    io.run();
    return report();
  }

  int report() {
    std::size_t rss_start = 0, rss_end = 0, rss_max = 0, fd_start = 0, fd_end = 0, fd_min = ~std::size_t{0}, fd_max = 0;
    for (const sample& s : samples) {
      if (s.at <= opt.warmup) continue;
      if (rss_start == 0) {
        rss_start = s.rss;
        fd_start = s.fds;
      }
      rss_end = s.rss;
      fd_end = s.fds;
      rss_max = std::max(rss_max, s.rss);
      fd_min = std::min(fd_min, s.fds);
      fd_max = std::max(fd_max, s.fds);
    }
    // RNR NAKs during the run (counters since the start; verbs reads the
    // NIC's, which both fabrics share: counted twice, still 0 when none).
    const auto cc = client->device().counters();
    const auto sc = server->device().counters();
    const bool rnr_known = cc.rnr_naks_sent && cc.rnr_naks_received && sc.rnr_naks_sent && sc.rnr_naks_received;
    auto delta = [](const std::optional<std::uint64_t>& now, const std::optional<std::uint64_t>& then) {
      return now.value_or(0) - then.value_or(0);
    };
    const std::uint64_t rnr = delta(cc.rnr_naks_sent, client_rnr0.rnr_naks_sent) +
                              delta(cc.rnr_naks_received, client_rnr0.rnr_naks_received) +
                              delta(sc.rnr_naks_sent, server_rnr0.rnr_naks_sent) +
                              delta(sc.rnr_naks_received, server_rnr0.rnr_naks_received);
    if (!rnr_known) std::printf("soak: the device keeps no RNR counters: rnr is not checked\n");
    // Every connection closed at the end: a connection object that leaked
    // (or never finished closing) is still counted by its fabric.
    const std::uint64_t left_open = client->stats().connections + server->stats().connections;
    // Reopening must really have happened (at least one per 10 s).
    const std::uint64_t want_reopened = opt.churn_ms == 0 || opt.churn_ms > 10'000 ? 0 : std::max<std::uint64_t>(1, opt.seconds / 10);
    const bool churned = t.reopened >= want_reopened;
    const bool rss_flat = rss_max * 100 <= rss_start * (100 + opt.rss_slack);
    // One connection at a time is being replaced: two sockets may be
    // missing or extra at a sample.
    const bool fd_flat = fd_max - fd_min <= 4;
    const bool pass = !hung && t.errors == 0 && t.lost == 0 && t.duplicated == 0 && t.corrupt == 0 && rnr == 0 &&
                      rss_flat && fd_flat && t.ops > 0 && left_open == 0 && churned;
    std::printf(
        "soak: connections=%u inflight=%u seconds=%u ops=%llu messages=%llu rendezvous=%llu puts=%llu gets=%llu "
        "atomics=%llu reopened=%llu errors=%llu lost=%llu duplicated=%llu corrupt=%llu rnr=%llu rss_start_kib=%zu "
        "rss_end_kib=%zu rss_max_kib=%zu fd_start=%zu fd_end=%zu fd_min=%zu fd_max=%zu left_open=%llu verdict=%s\n",
        opt.connections, opt.inflight, opt.seconds, static_cast<unsigned long long>(t.ops),
        static_cast<unsigned long long>(t.messages), static_cast<unsigned long long>(t.rendezvous),
        static_cast<unsigned long long>(t.puts), static_cast<unsigned long long>(t.gets),
        static_cast<unsigned long long>(t.atomics), static_cast<unsigned long long>(t.reopened),
        static_cast<unsigned long long>(t.errors), static_cast<unsigned long long>(t.lost),
        static_cast<unsigned long long>(t.duplicated), static_cast<unsigned long long>(t.corrupt),
        static_cast<unsigned long long>(rnr), rss_start, rss_end, rss_max, fd_start, fd_end, fd_min, fd_max,
        static_cast<unsigned long long>(left_open), pass ? "pass" : "fail");
    if (left_open != 0) std::printf("soak: %llu connections still open after every slot closed\n",
                                    static_cast<unsigned long long>(left_open));
    if (!churned) std::printf("soak: only %llu connections reopened\n", static_cast<unsigned long long>(t.reopened));
    std::fflush(stdout);
    if (hung) std::_Exit(1);  // coroutines still hold the connections: no orderly teardown
    if (!rss_flat) std::printf("soak: RSS grew more than %u%% after warm-up\n", opt.rss_slack);
    if (!fd_flat) std::printf("soak: the descriptor count moved by more than 4 after warm-up\n");
    return pass ? 0 : 1;
  }
};

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    soak s(o);
    return s.run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "anydoor-soak: %s\n", e.what());
    return 1;
  }
}
