// Faults injected into the tcp provider (ANYDOOR_TCP_FAULTS, see
// transport/tcp/faults.hpp) under the runtime: a connection cut after N
// frames, a corrupt frame, delayed frames, and a peer that stops reading.
// For each: every operation completes exactly once; what succeeded arrived
// (in order, intact); other connections carry on; a new connection to the
// same peer works. The sanitizer build adds LeakSanitizer's verdict.
#include "../support/process.hpp"
#include "../support/runtime.hpp"
#include "../support/sleep.hpp"

#include <anydoor/anydoor.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>


#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using namespace anydoor::test;
namespace asio = boost::asio;
namespace ad = anydoor;
using asio::awaitable;
using asio::use_awaitable;
using ms = std::chrono::milliseconds;
using clock_point = std::chrono::steady_clock::time_point;

namespace {

constexpr const char* kVariable = "ANYDOOR_TCP_FAULTS";
constexpr std::size_t kTargetSize = std::size_t{1} << 20;
constexpr std::size_t kPutArea = kTargetSize / 2;           // puts land in [0, kPutArea)
constexpr std::size_t kCounterAt = kTargetSize - 8;         // fetch_add's word
constexpr std::size_t kSmall = 200, kLarge = 300 * 1024, kChunk = 4096;
constexpr std::uint32_t kDone = 0xffffffffu;                // the sender's last message
constexpr std::uint32_t kFlood = 0xfffffffeu;               // a flood message (counted apart)
constexpr std::size_t kFloodSize = 8000;                    // eager (below the 8192-byte limit)

// A fabric whose device reads `spec` from the environment when it opens.
std::unique_ptr<ad::fabric> faulty_fabric(asio::io_context& io, const char* spec,
                                          const ad::fabric_options& o = test_options()) {
  REQUIRE(::setenv(kVariable, spec, 1) == 0);
  std::unique_ptr<ad::fabric> f;
  try {
    f = std::make_unique<ad::fabric>(io, o);
  } catch (...) {
    ::unsetenv(kVariable);
    throw;
  }
  ::unsetenv(kVariable);
  return f;
}

std::vector<std::byte> message_bytes(std::uint32_t seq, std::size_t n) {
  std::vector<std::byte> m = pattern(n, seq);
  std::memcpy(m.data(), &seq, 4);
  return m;
}

// The accepting side of one connection: sends its region, then checks
// every message (sequence and content) until the connection ends or the
// sender says it is done.
struct target {
  std::vector<std::byte> mem = std::vector<std::byte>(kTargetSize);
  std::optional<ad::memory_region> mr;
  std::uint32_t next_seq = 0;  // messages received in order so far
  std::size_t flood = 0;       // flood messages received
  bool bad_message = false;
  bool done = false;
  ad::error_code ended;
  ad::connection conn;

  awaitable<void> serve() {
    const auto packed = mr->remote().pack();
    auto [ec0, n0] = co_await conn.async_send(asio::buffer(packed), asio::as_tuple(use_awaitable));
    if (ec0) {
      ended = ec0;
      co_return;
    }
    for (;;) {
      auto [ec, m] = co_await conn.async_receive(asio::as_tuple(use_awaitable));
      if (ec) {
        ended = ec;
        co_return;
      }
      std::uint32_t seq = 0;
      if (m.size() >= 4) std::memcpy(&seq, m.data(), 4);
      if (m.size() == 4 && seq == kDone) {
        done = true;
        co_return;
      }
      if (m.size() == kFloodSize && seq == kFlood) {
        ++flood;
        continue;
      }
      const std::size_t expect = next_seq % 3 == 2 ? kLarge : kSmall;
      if (seq != next_seq || m.size() != expect || message_bytes(seq, m.size()) != std::vector<std::byte>(m.bytes().begin(), m.bytes().end())) {
        bad_message = true;
        co_return;
      }
      ++next_seq;
    }
  }
};

// The connecting side: a mix of operations all in flight at once, each
// recorded as it completes.
struct traffic {
  static constexpr std::size_t kOps = 150;
  enum kind { send, put, get, add };
  struct op {
    kind k{};
    std::uint32_t seq = 0;          // send: its sequence number
    std::size_t offset = 0;         // put, get: where in the target
    std::vector<std::byte> data;    // send, put: what goes; get: where it lands
    int completions = 0;
    ad::error_code ec;
  };
  std::vector<op> ops = std::vector<op>(kOps);
  std::size_t finished = 0;
  ad::connection conn;
  ad::remote_region region;
  const std::vector<std::byte> get_source = pattern(kPutArea - 8, 777);  // the target's upper half

  static kind kind_of(std::size_t i) {
    static constexpr kind cycle[] = {send, put, send, get, send, add};
    return cycle[i % 6];
  }

  auto recorder(std::size_t i) {
    return [this, i](ad::error_code ec, auto&&...) {
      ++ops[i].completions;
      ops[i].ec = ec;
      ++finished;
    };
  }

  awaitable<void> run(ms settle = ms(200)) {
    auto [ec, m] = co_await conn.async_receive(asio::as_tuple(use_awaitable));
    REQUIRE_FALSE(ec);
    REQUIRE_FALSE(ad::remote_region::unpack(m.bytes(), region));
    std::uint32_t seq = 0;
    for (std::size_t i = 0; i < kOps; ++i) {
      op& o = ops[i];
      o.k = kind_of(i);
      switch (o.k) {
        case send:
          o.seq = seq++;
          o.data = message_bytes(o.seq, o.seq % 3 == 2 ? kLarge : kSmall);
          conn.async_send(asio::buffer(o.data), recorder(i));
          break;
        case put:
          o.offset = (i * kChunk) % kPutArea;
          o.data = pattern(kChunk, static_cast<std::uint32_t>(1000 + i));
          conn.async_put(asio::buffer(o.data), region.at(o.offset, kChunk), recorder(i));
          break;
        case get:
          o.offset = kPutArea + (i * 97) % (kPutArea - 8 - kChunk);
          o.data.assign(kChunk, std::byte{0});
          conn.async_get(asio::buffer(o.data), region.at(o.offset, kChunk), recorder(i));
          break;
        case add:
          conn.async_fetch_add(region.at(kCounterAt, 8), 1, recorder(i));
          break;
      }
    }
    for (int waited = 0; finished < kOps && waited < 3000; ++waited) co_await sleep_for(ms(10));
    co_await sleep_for(settle);  // nothing completes twice
    if (conn.is_open()) {
      const std::uint32_t done = kDone;
      co_await conn.async_send(asio::buffer(&done, 4), asio::as_tuple(use_awaitable));
    }
  }

  std::size_t failed() const {
    std::size_t n = 0;
    for (const op& o : ops) n += o.ec ? 1u : 0u;
    return n;
  }
};

// Checks one connection's outcome: every operation completed exactly once;
// the target took a prefix of the messages, in order and intact; each
// rendezvous send that succeeded arrived (an eager send completes once
// posted: success says nothing about delivery), each successful put is in
// the target, each successful get read the target's bytes; the counter
// counts at least the successful adds and at most all of them.
void check(const traffic& t, const target& g, bool expect_all_ok) {
  REQUIRE(t.finished == traffic::kOps);
  std::size_t adds_ok = 0, adds = 0;
  std::uint32_t sends = 0;
  for (const auto& o : t.ops) {
    REQUIRE(o.completions == 1);
    if (expect_all_ok) CHECK_FALSE(o.ec);
    switch (o.k) {
      case traffic::send:
        ++sends;
        if (!o.ec && o.data.size() == kLarge) CHECK(g.next_seq > o.seq);
        break;
      case traffic::put:
        if (!o.ec) CHECK(std::memcmp(g.mem.data() + o.offset, o.data.data(), kChunk) == 0);
        break;
      case traffic::get:
        if (!o.ec) CHECK(std::memcmp(o.data.data(), t.get_source.data() + (o.offset - kPutArea), kChunk) == 0);
        break;
      case traffic::add:
        ++adds;
        adds_ok += o.ec ? 0u : 1u;
        break;
    }
  }
  CHECK_FALSE(g.bad_message);  // what arrived is in order and intact
  // Every completion named a work request counted as posted.
  CHECK(t.conn.stats().stray_completions == 0);
  CHECK(g.conn.stats().stray_completions == 0);
  std::uint64_t counter = 0;
  std::memcpy(&counter, g.mem.data() + kCounterAt, 8);
  CHECK(counter >= adds_ok);
  CHECK(counter <= adds);
  if (expect_all_ok) {
    CHECK(g.done);
    CHECK(g.next_seq == sends);
  }
}

// A server fabric and a client fabric on one io_context; connections made
// one at a time, so the client device numbers them 1, 2, 3 (fault_plan::qp).
struct setup {
  asio::io_context io;
  std::unique_ptr<ad::fabric> server, client;
  std::optional<ad::acceptor> acc;
  std::vector<std::unique_ptr<target>> targets;
  std::vector<std::unique_ptr<traffic>> clients;

  setup(const char* server_faults, const char* client_faults, const ad::fabric_options& server_options = test_options()) {
    server = faulty_fabric(io, server_faults, server_options);
    client = faulty_fabric(io, client_faults);
    acc.emplace(server->listen(test_host(), 0));
  }
  ~setup() {
    for (auto& t : targets) t->conn = {};
    for (auto& c : clients) c->conn = {};
    io.restart();
    io.run_for(std::chrono::seconds(10));
  }
  setup(const setup&) = delete;
  setup& operator=(const setup&) = delete;

  // Connects one more pair; returns its index.
  std::size_t connect() {
    auto g = std::make_unique<target>();
    g->mr.emplace(server->register_memory(
        g->mem, ad::access::local_write | ad::access::remote_write | ad::access::remote_read | ad::access::remote_atomic));
    const auto upper = pattern(kPutArea - 8, 777);
    std::memcpy(g->mem.data() + kPutArea, upper.data(), upper.size());
    auto t = std::make_unique<traffic>();
    failure f;
    asio::co_spawn(io, [&]() -> awaitable<void> { g->conn = co_await acc->async_accept(use_awaitable); }, f.handler());
    asio::co_spawn(io, [&]() -> awaitable<void> {
      t->conn = co_await client->async_connect(addr(*acc), use_awaitable);
    }, f.handler());
    run_to_completion(io, std::chrono::seconds(20));
    f.check();
    targets.push_back(std::move(g));
    clients.push_back(std::move(t));
    return targets.size() - 1;
  }

  // Runs the traffic of the given pairs together.
  void run(std::initializer_list<std::size_t> which, ms settle = ms(200)) {
    failure f;
    for (std::size_t i : which) {
      asio::co_spawn(io, targets[i]->serve(), f.handler());
      asio::co_spawn(io, clients[i]->run(settle), f.handler());
    }
    run_to_completion(io, std::chrono::seconds(60));
    f.check();
  }
};

// The common shape: connection 1 has the fault, connection 2 runs beside
// it untouched, connection 3 (opened afterwards, same peer) works.
void faulty_first_then_fresh(const char* server_faults, const char* client_faults, bool first_fails) {
  setup s(server_faults, client_faults);
  const std::size_t a = s.connect(), b = s.connect();
  s.run({a, b});
  const std::size_t failed = s.clients[a]->failed();
  INFO("faulty connection: " << failed << " of " << traffic::kOps << " operations failed");
  if (first_fails) {
    CHECK(failed > 0);
    CHECK_FALSE(s.clients[a]->conn.is_open());
  }
  check(*s.clients[a], *s.targets[a], !first_fails);
  check(*s.clients[b], *s.targets[b], true);
  const std::size_t c = s.connect();
  s.run({c});
  check(*s.clients[c], *s.targets[c], true);
}

}  // namespace

TEST_CASE("faults: a connection cut after N frames fails every pending operation once, the others carry on",
          "[runtime][faults]") {
  // The client's 30th frame is its last: the cut lands mid-traffic.
  faulty_first_then_fresh("", "cut=30,qp=1", true);
}

TEST_CASE("faults: a corrupt frame fails its connection (the peer refuses it), the others carry on",
          "[runtime][faults]") {
  faulty_first_then_fresh("", "corrupt=25,qp=1", true);
}

TEST_CASE("faults: a corrupt response frame from the target fails the initiator's connection",
          "[runtime][faults]") {
  // The server's 20th frame: an ACK, a read response or an atomic response.
  faulty_first_then_fresh("corrupt=20,qp=1", "", true);
}

TEST_CASE("faults: a post that fails part way inside the initiating call ends its operation later - never in the call",
          "[runtime][faults]") {
  // A connection whose operations come one per turn rings the doorbell
  // inside the initiating call. A put in four fragments, posted there,
  // fails part way: the queue pair goes in the call, but the put's handler
  // runs afterwards, never inside async_put.
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::connection_options small_pieces;
  small_pieces.fragment_size = 4096;
  std::unique_ptr<ad::fabric> client = faulty_fabric(io, "post_fail=1,qp=1", test_options(small_pieces));
  std::vector<std::byte> target(16384), src(16384, std::byte{9});
  ad::memory_region dst = server.register_memory(target, ad::access::local_write | ad::access::remote_write);
  ad::acceptor acc = server.listen(test_host(), 0);
  auto [a, c] = connect_through(io, *client, acc, addr(acc));
  // Lone operations, one per turn (single requests: the fault counts none).
  for (int i = 0; i < 4; ++i) {
    std::optional<ad::error_code> done;
    c.async_put(asio::buffer(src.data(), 64), dst.remote().at(0, 64),
                [&](ad::error_code ec, std::size_t) { done = ec; });
    run_until(io, [&] { return done.has_value(); });
    REQUIRE(done.has_value());
    REQUIRE_FALSE(*done);
  }
  const ad::connection_stats before = c.stats();
  std::vector<ad::error_code> ended;
  // Issued by a handler the io_context runs (where a handler could run
  // inline, as dispatch would run it).
  ad::connection_stats after_call;
  bool held_after_call = true, ended_in_call = true, issued = false;
  asio::post(io, [&] {
    c.async_put(asio::buffer(src), dst.remote().at(0, 16384),
                [&](ad::error_code ec, std::size_t) { ended.push_back(ec); });
    after_call = c.stats();
    const auto r = client->connection_reports();
    held_after_call = r.empty() || r[0].holds_queue_pair;
    ended_in_call = !ended.empty();
    issued = true;
  });
  run_until(io, [&] { return issued; });
  REQUIRE(issued);
  // Rung in the call: four requests, three taken, and the queue pair gone.
  CHECK(after_call.doorbells == before.doorbells + 1);
  CHECK(after_call.posts == before.posts + 3);
  CHECK_FALSE(held_after_call);
  CHECK_FALSE(ended_in_call);  // not inside async_put
  run_until(io, [&] { return !ended.empty(); });
  std::this_thread::sleep_for(ms(20));
  io.restart();
  io.poll();  // (nothing ends twice)
  REQUIRE(ended.size() == 1);
  CHECK(ended[0]);
  CHECK(c.stats().stray_completions == 0);
}

TEST_CASE("faults: a post that fails part way mid-traffic fails its connection, the others carry on",
          "[runtime][faults]") {
  // The client's 2nd doorbell of several requests takes all but the last,
  // then fails (a device's error past the checks): no completion of what
  // it took is stray (check()).
  faulty_first_then_fresh("", "post_fail=2,qp=1", true);
}

TEST_CASE("faults: delayed frames arrive late, intact and in order, on that connection only", "[runtime][faults]") {
  setup s("", "delay=60,qp=1");
  const std::size_t a = s.connect(), b = s.connect();
  // One round trip on each: the delayed one takes at least the delay.
  ms rtt[2]{};
  failure f;
  for (std::size_t i : {a, b}) {
    asio::co_spawn(s.io, [&, i]() -> awaitable<void> {
      std::array<std::byte, 8> ping{};
      const auto t0 = std::chrono::steady_clock::now();
      co_await s.clients[i]->conn.async_send(asio::buffer(ping), use_awaitable);
      ad::message m = co_await s.targets[i]->conn.async_receive(use_awaitable);
      co_await s.targets[i]->conn.async_send(m.buffer(), use_awaitable);
      ad::message back = co_await s.clients[i]->conn.async_receive(use_awaitable);
      rtt[i] = std::chrono::duration_cast<ms>(std::chrono::steady_clock::now() - t0);
      CHECK(back.size() == 8);
    }, f.handler());
  }
  run_to_completion(s.io, std::chrono::seconds(20));
  f.check();
  INFO("round trip: delayed " << rtt[a].count() << " ms, other " << rtt[b].count() << " ms");
  CHECK(rtt[a] >= ms(60));
  CHECK(rtt[b] < ms(60));
  s.run({a, b});
  check(*s.clients[a], *s.targets[a], true);
  check(*s.clients[b], *s.targets[b], true);
}

TEST_CASE("faults: a peer that stops reading for a while backs its sender up by flow control, without memory "
          "growth, and everything arrives once it reads again",
          "[runtime][faults]") {
  // The server's first connection reads 10 frames, then nothing for 3 s.
  setup s("stop_reading=10,stall=3000,qp=1", "");
  const std::size_t a = s.connect(), b = s.connect();
  // While the stalled connection's sender is backed up, 3000 more messages
  // of 8000 bytes (24 MB) are sent on it from one buffer: they must wait
  // for credits (holding the caller's buffer), not be copied somewhere.
  constexpr std::size_t kFloodCount = 3000;
  std::vector<std::byte> flood(kFloodSize, std::byte{0x5a});
  std::memcpy(flood.data(), &kFlood, 4);
  std::size_t flood_done = 0, flood_failed = 0;
  std::size_t rss_early = 0, rss_late = 0, done_early = 0, done_late = 0;
  failure f;
  asio::co_spawn(s.io, [&]() -> awaitable<void> {
    // What can still complete (eager sends complete once posted) does so
    // first: wait until the count holds still (slow under sanitizers).
    co_await sleep_for(ms(300));
    for (std::size_t last = ~std::size_t{0}, i = 0; i < 15 && s.clients[a]->finished != last; ++i) {
      last = s.clients[a]->finished;
      co_await sleep_for(ms(100));
    }
    rss_early = rss_kib();
    done_early = s.clients[a]->finished;
    for (std::size_t i = 0; i < kFloodCount; ++i) {
      s.clients[a]->conn.async_send(asio::buffer(flood), [&](ad::error_code ec, std::size_t) {
        ++flood_done;
        flood_failed += ec ? 1u : 0u;
      });
    }
    co_await sleep_for(ms(600));
    rss_late = rss_kib();
    done_late = s.clients[a]->finished;
  }, f.handler());
  s.run({a, b});
  f.check();
  INFO("stalled sender: " << done_early << " then " << done_late << " of " << traffic::kOps
                          << " done; RSS " << rss_early << " KiB, then " << rss_late << " KiB with "
                          << kFloodCount << " more messages waiting");
  CHECK(done_early == done_late);        // nothing moved during the stall
  CHECK(done_early < traffic::kOps);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // Sanitizer allocators (redzones, quarantine, shadow memory) make RSS
  // say nothing about copies; the plain build checks it.
  WARN("skipped under a sanitizer: the RSS check (" << rss_early << " KiB, then " << rss_late << " KiB)");
#else
  CHECK(rss_late <= rss_early + 8192);   // 24 MB posted: not copied, waiting for credits
#endif
  CHECK(flood_done == kFloodCount);      // and all of it went once the peer read again
  CHECK(flood_failed == 0);
  CHECK(s.targets[a]->flood == kFloodCount);
  check(*s.clients[a], *s.targets[a], true);
  check(*s.clients[b], *s.targets[b], true);
}

TEST_CASE("faults: a peer that never reads again leaves its sender's operations pending until the sender aborts, "
          "then each ends once",
          "[runtime][faults]") {
  // A 1 s keepalive: the server's end of the aborted connection, which
  // reads nothing, learns of the abort when its heartbeat finds the socket
  // closed, instead of after the default 10 s.
  ad::connection_options co;
  co.keepalive = ms(1000);
  setup s("stop_reading=10,qp=1", "", test_options(co));
  const std::size_t a = s.connect(), b = s.connect();
  failure f;
  std::size_t pending_before_close = 0;
  asio::co_spawn(s.io, [&]() -> awaitable<void> {
    co_await sleep_for(ms(500));
    pending_before_close = traffic::kOps - s.clients[a]->finished;
    s.clients[a]->conn = {};  // aborts: a graceful close would wait for the peer
  }, f.handler());
  s.run({a, b});
  f.check();
  INFO(pending_before_close << " operations pending when the sender aborted");
  CHECK(pending_before_close > 0);
  CHECK(s.clients[a]->failed() >= pending_before_close);
  check(*s.clients[a], *s.targets[a], false);
  check(*s.clients[b], *s.targets[b], true);
  const std::size_t c = s.connect();
  s.run({c});
  check(*s.clients[c], *s.targets[c], true);
}

TEST_CASE("faults: a reader stopped for good still learns that its peer left, and does not spin meanwhile",
          "[runtime][faults]") {
  ad::connection_options co;
  co.keepalive = ms(0);  // only the socket can tell
  setup s("stop_reading=3,qp=1", "", test_options(co));
  const std::size_t a = s.connect();
  ad::error_code target_ended;
  clock_point aborted{}, ended{};
  double cpu_s = -1;
  failure f;
  asio::co_spawn(s.io, [&]() -> awaitable<void> {
    for (;;) {
      auto [ec, m] = co_await s.targets[a]->conn.async_receive(asio::as_tuple(use_awaitable));
      if (ec) {
        target_ended = ec;
        ended = std::chrono::steady_clock::now();
        co_return;
      }
    }
  }, f.handler());
  asio::co_spawn(s.io, [&]() -> awaitable<void> {
    std::array<std::byte, 8> x{};
    for (int k = 0; k < 6; ++k) co_await s.clients[a]->conn.async_send(asio::buffer(x), use_awaitable);
    co_await sleep_for(ms(100));
    aborted = std::chrono::steady_clock::now();
    s.clients[a]->conn = {};  // the client's socket closes (a FIN)
    co_await sleep_for(ms(100));
    // Our send now meets a closed socket: the peer resets the connection.
    s.targets[a]->conn.async_send(asio::buffer(x), [](ad::error_code, std::size_t) {});
    const double cpu0 = process_cpu_seconds();
    co_await sleep_for(ms(1000));
    cpu_s = process_cpu_seconds() - cpu0;
    s.targets[a]->conn = {};
  }, f.handler());
  run_to_completion(s.io, std::chrono::seconds(20));
  f.check();
  INFO("CPU over 1 s: " << cpu_s << " s; the stalled side ended " << (ended - aborted) / ms(1) << " ms after the abort");
  CHECK(cpu_s >= 0);
  CHECK(cpu_s < 0.5);
  CHECK(target_ended);
  CHECK(ended - aborted < ms(1000));
}

TEST_CASE("faults: a put the peer never answers ends about a second after the peer's close - not never",
          "[runtime][faults]") {
  // The server's device reads nothing after the handshake, so nothing the
  // client posts is answered (a receive waits there, so that its reactor
  // watches: README, "Progress with the tcp provider"); then the server
  // closes. A peer that closed
  // puts its queue pair in error once its close is acknowledged and
  // answers nothing more (on a NIC, on rxe), so the client's put, and a
  // flush behind it, must end once connection_impl::kPeerCloseGrace (1 s)
  // has passed with them unanswered: flushed, as the connection closes. No
  // keepalive: nothing else would end them.
  ad::connection_options co;
  co.keepalive = ms(0);
  asio::io_context io;
  std::optional<ad::error_code> put, flushed, closed;
  std::vector<std::byte> mem(4096), src(4096, std::byte{1});
  auto server = faulty_fabric(io, "stop_reading=0,qp=1", test_options(co));
  ad::fabric client(io, test_options(co));
  ad::memory_region dst = server->register_memory(mem, ad::access::local_write | ad::access::remote_write);
  ad::memory_region from = client.register_memory(src, ad::access::local_write);
  ad::acceptor acc = server->listen(test_host(), 0);
  auto [a, c] = connect_through(io, client, acc, addr(acc));
  a.async_receive([](ad::error_code, ad::message) {});
  c.async_put(from, dst.remote(), [&](ad::error_code ec, std::size_t) { put = ec; });
  c.async_flush([&](ad::error_code ec) { flushed = ec; });
  const auto quiet = std::chrono::steady_clock::now() + ms(300);
  run_until(io, [&] { return put.has_value() || std::chrono::steady_clock::now() >= quiet; });
  REQUIRE_FALSE(put.has_value());  // the premise: unanswered
  REQUIRE_FALSE(flushed.has_value());
  const auto closing = std::chrono::steady_clock::now();
  a.async_close([&](ad::error_code ec) { closed = ec; });
  clock_point put_ended{};
  run_until(io, [&] {
    if (put && put_ended == clock_point{}) put_ended = std::chrono::steady_clock::now();
    return put && flushed;
  });
  const auto after = (put_ended - closing) / ms(1);
  INFO("the put ended " << after << " ms after the peer's close, with: " << put->message());
  CHECK(*put == ad::errc::connection_closed);
  CHECK(*flushed == ad::errc::connection_closed);
  CHECK(after >= 900);   // not before the grace
  CHECK(after < 5000);   // the grace, a tick, and a loaded machine (about 1,000 ms seen)
  CHECK_FALSE(c.is_open());
  CHECK(client.failure_counts().empty());  // the peer closed: the client's side did not fail
  CHECK_FALSE(closed.has_value());  // (the server's close is never acknowledged: it reads nothing)
}

TEST_CASE("faults: an idle target whose socket is not read does not spin its fabric's watch of the queue",
          "[runtime][faults]") {
  // The server has nothing pending (its reactor is stopped), so its
  // fabric's liveness thread watches the completion queue's notify fd for
  // the peers' one-sided requests. Its device reads nothing: the client's
  // put waits in the socket, unread for good. The watch must not wake over
  // and over for input the queue will not take.
  asio::io_context io;
  std::optional<ad::error_code> put;
  std::vector<std::byte> mem(4096), src(4096, std::byte{1});
  auto server = faulty_fabric(io, "stop_reading=0,qp=1");
  ad::fabric client(io, test_options());
  ad::memory_region dst = server->register_memory(mem, ad::access::local_write | ad::access::remote_write);
  ad::memory_region from = client.register_memory(src, ad::access::local_write);
  ad::acceptor acc = server->listen(test_host(), 0);
  auto [a, c] = connect_through(io, client, acc, addr(acc));
  c.async_put(from, dst.remote(), [&](ad::error_code ec, std::size_t) { put = ec; });
  // The client's reactor spins a while after the put (adaptive), then sleeps.
  asio::steady_timer settle(io, ms(200)), quiet(io, ms(1200));
  bool settled = false, fired = false;
  settle.async_wait([&](const boost::system::error_code&) { settled = true; });
  quiet.async_wait([&](const boost::system::error_code&) { fired = true; });
  run_until(io, [&] { return settled; });
  const double cpu0 = process_cpu_seconds();
  run_until(io, [&] { return fired; });
  const double used = process_cpu_seconds() - cpu0;
  INFO("CPU over 1 s with the put unread: " << used << " s");
  CHECK_FALSE(put.has_value());  // the premise: unread, unanswered
  CHECK(used < 0.3);
}

TEST_CASE("faults: a malformed ANYDOOR_TCP_FAULTS stops the device from opening, naming the item",
          "[runtime][faults]") {
  asio::io_context io;
  try {
    faulty_fabric(io, "cut=ten");
    FAIL("a fabric opened with a malformed ANYDOOR_TCP_FAULTS");
  } catch (const std::system_error& e) {
    CHECK(e.code() == ad::errc::invalid_argument);
    CHECK(std::string(e.what()).find("cut=ten") != std::string::npos);
  }
}

TEST_CASE("faults: a post that fails part way counts what the device took - their operations end with its flushes",
          "[runtime][faults]") {
  // The client's first post_send takes all its requests but the last, then
  // fails with a device error (as ibv_post_send can). The requests it took
  // count as posted, and are the device's until it lets go: what it took
  // may never all come back (one that succeeded unsignaled leaves no
  // completion), so the queue pair goes before any operation ends; none of
  // its completions is taken for a stray one, and every operation ends
  // once, with an error.
  asio::io_context io;
  ad::fabric server(io, test_options());
  std::unique_ptr<ad::fabric> client = faulty_fabric(io, "post_fail=1,qp=1");
  std::vector<std::byte> target(4096), src(4096, std::byte{5}), got(4096);
  ad::memory_region dst = server.register_memory(target, ad::access::local_write | ad::access::remote_write |
                                                             ad::access::remote_read);
  ad::memory_region into = client->register_memory(got, ad::access::local_write);
  ad::acceptor acc = server.listen(test_host(), 0);
  auto [a, c] = connect_through(io, *client, acc, addr(acc));
  REQUIRE(c.stats().doorbells == 0);  // (the failing post is the batch below)
  REQUIRE(client->connection_reports().size() == 1);
  CHECK(client->connection_reports()[0].holds_queue_pair);
  constexpr std::size_t kOps = 4;
  std::vector<std::vector<ad::error_code>> ended(kOps);
  // Whether the queue pair was still allocated when each operation ended
  // (its memory the caller's again: the device must have let go of it).
  std::vector<bool> qp_held_at_end(kOps, true);
  auto record = [&](std::size_t i, ad::error_code ec) {
    ended[i].push_back(ec);
    const auto r = client->connection_reports();
    qp_held_at_end[i] = r.empty() || r[0].holds_queue_pair;
  };
  for (std::size_t i = 0; i + 1 < kOps; ++i) {
    c.async_put(asio::buffer(src.data() + i * 64, 64), dst.remote().at(i * 64, 64),
                [&record, i](ad::error_code ec, std::size_t) { record(i, ec); });
  }
  c.async_get(into.at(0, 64), dst.remote().at(1024, 64),
              [&record](ad::error_code ec, std::size_t) { record(kOps - 1, ec); });
  auto all_ended = [&] {
    for (const auto& e : ended) {
      if (e.empty()) return false;
    }
    return true;
  };
  run_until(io, all_ended);
  std::this_thread::sleep_for(ms(20));
  io.restart();
  io.poll();  // (nothing ends twice)
  REQUIRE(all_ended());
  for (std::size_t i = 0; i < kOps; ++i) {
    INFO("operation " << i);
    REQUIRE(ended[i].size() == 1);
    CHECK(ended[i][0]);
    CHECK_FALSE(qp_held_at_end[i]);
  }
  const ad::connection_stats st = c.stats();
  CHECK(st.doorbells == 1);
  CHECK(st.posts == kOps - 1);           // what the device took
  CHECK(st.stray_completions == 0);      // each flush named a work request counted as posted
  CHECK(st.puts == 0);
  CHECK(st.gets == 0);
  CHECK_FALSE(c.is_open());
}

TEST_CASE("faults: a connection that ends behind an unsignaled tail on a device that loses requests posted in "
          "error is released after a second - not never",
          "[runtime][faults]") {
  // A ping-pong leaves the client's last messages unsignaled (flush_now).
  // The abort moves the queue pair to error and posts a signaled marker
  // behind them (cover_tail), which this device never completes, as siw's
  // user-space queue pairs do: the connection lets the tail go after
  // kPeerCloseGrace, since none of it holds memory.
  asio::io_context io;
  ad::fabric server(io, test_options({.signal_interval = 8}));
  std::unique_ptr<ad::fabric> client = faulty_fabric(io, "lose_late=1", test_options({.signal_interval = 8}));
  ad::acceptor acc = server.listen(test_host(), 0);
  auto [a, c] = connect_through(io, *client, acc, addr(acc));
  failure f;
  asio::co_spawn(io, [&a = a]() -> awaitable<void> {
    for (;;) {
      auto [ec, m] = co_await a.async_receive(asio::as_tuple(use_awaitable));
      if (ec) co_return;
      co_await a.async_send(m.buffer(), asio::as_tuple(use_awaitable));
    }
  }, f.handler());
  bool ended = false;
  asio::co_spawn(io, [&c = c, &ended]() -> awaitable<void> {
    std::array<std::byte, 16> out{};
    for (int i = 0; i < 5; ++i) {
      co_await c.async_send(asio::buffer(out), use_awaitable);
      co_await c.async_receive(use_awaitable);
    }
    CHECK(c.stats().posts - c.stats().signaled >= 4);  // the tail
    c.abort();
    ended = true;
  }, f.handler());
  run_until(io, [&] { return ended; });
  const auto t0 = std::chrono::steady_clock::now();
  c = ad::connection{};
  run_until(io, [&] { return client->stats().connections == 0; }, std::chrono::seconds(10));
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took >= ms(900));  // the grace (a marker that came back would end it at once)
  CHECK(took < std::chrono::seconds(5));
  a = ad::connection{};
  run_to_completion(io, std::chrono::seconds(20));
  f.check();
  CHECK(server.stats().connections == 0);
}

TEST_CASE("faults: a completion queue that overflows ends every operation on it once, none reported done",
          "[runtime][faults]") {
  // The client's completion queue holds 8 completions (cq_depth=8). While
  // the client does not poll, the server executes its puts and an atomic
  // and sends it more messages than that: the queue overflows and the
  // client's reactor gives up on it. Nothing came back, so nothing may be
  // reported done: a put that landed but whose completion was lost ends
  // with an error, as do the atomic (its old value never came back), the
  // flush behind them and the receive.
  // (Also with a shared receive queue: the connection's receives are the
  // fabric's then.)
  const bool srq = GENERATE(false, true);
  INFO((srq ? "with" : "without") << " a shared receive queue");
  asio::io_context io_s, io_c;
  ad::fabric server(io_s, test_options());
  ad::fabric_options client_options = test_options();
  client_options.connection.connect_timeout = std::chrono::seconds(30);
  if (srq) client_options.srq_buffers = 64;
  std::unique_ptr<ad::fabric> client = faulty_fabric(io_c, "cq_depth=8", client_options);
  std::vector<std::byte> target(4096), src(4096, std::byte{3});
  ad::memory_region dst =
      server.register_memory(target, ad::access::local_write | ad::access::remote_write | ad::access::remote_atomic);
  ad::acceptor acc = server.listen(test_host(), 0);
  auto [a, c] = connect_across(io_s, io_c, *client, acc);
  REQUIRE(client->connection_reports().size() == 1);
  const std::uint32_t qpn = client->connection_reports()[0].qp_num;
  CHECK(qpn != 0);
  // An accept on the client's fabric waits through the overflow.
  ad::acceptor back = client->listen(test_host(), 0);
  std::optional<ad::error_code> accept_waiting;
  back.async_accept([&](ad::error_code ec, ad::connection) { accept_waiting = ec; });
  ad::acceptor idle_acceptor = client->listen(test_host(), 0);  // (no accept waiting)
  // A connect of the client's is in its handshake through the overflow (its
  // thread holds the queue pair): a third fabric, not run until then,
  // leaves the welcome unsent.
  // (Generous handshake timeouts: the welcome waits through the overflow.)
  asio::io_context io_late;
  ad::connection_options patient;
  patient.handshake_timeout = std::chrono::seconds(30);
  ad::fabric late(io_late, test_options(patient));
  ad::acceptor late_acc = late.listen(test_host(), 0);
  late_acc.async_accept([](ad::error_code, ad::connection) {});
  std::optional<ad::error_code> in_handshake;
  client->async_connect(addr(late_acc), [&](ad::error_code ec, ad::connection) { in_handshake = ec; });
  constexpr std::size_t kPuts = 16, kMessages = 16;
  std::vector<std::vector<ad::error_code>> puts(kPuts);
  std::vector<ad::error_code> atomic, flushed, received;
  const std::uint64_t posts_before = c.stats().posts, server_posts_before = a.stats().posts;
  // Whether the queue pair was gone when each put ended (its memory the
  // caller's again: the device must have let go of it).
  auto report_of_c = [&]() -> std::optional<ad::connection_report> {
    for (const ad::connection_report& r : client->connection_reports()) {
      if (r.qp_num == qpn) return r;
    }
    return std::nullopt;
  };
  std::vector<bool> qp_held_at_end(kPuts, true);
  for (std::size_t i = 0; i < kPuts; ++i) {
    c.async_put(asio::buffer(src.data() + i * 64, 64), dst.remote().at(i * 64, 64),
                [&puts, &qp_held_at_end, &report_of_c, i](ad::error_code ec, std::size_t) {
                  puts[i].push_back(ec);
                  const auto r = report_of_c();
                  qp_held_at_end[i] = !r || r->holds_queue_pair;
                });
  }
  c.async_fetch_add(dst.remote().at(4088, 8), 1, [&](ad::error_code ec, std::uint64_t) { atomic.push_back(ec); });
  c.async_flush([&](ad::error_code ec) { flushed.push_back(ec); });
  c.async_receive([&](ad::error_code ec, ad::message) { received.push_back(ec); });
  io_c.restart();
  io_c.poll();  // the doorbell: all of them go out
  REQUIRE(c.stats().posts - posts_before >= kPuts + 1);  // (the puts' and the atomic's)
  const std::uint32_t word = 7;
  for (std::size_t i = 0; i < kMessages; ++i) a.async_send(asio::buffer(&word, 4), [](ad::error_code, std::size_t) {});
  // The server executes the puts and the atomic and posts its messages;
  // the client's socket holds their answers (a while more: acknowledgements
  // the server holds back go when it next waits).
  auto executed = [&] {
    for (std::size_t i = 0; i < kPuts * 64; ++i) {
      if (target[i] != src[i]) return false;
    }
    std::uint64_t counter = 0;
    std::memcpy(&counter, target.data() + 4088, 8);
    // (With a shared receive queue the client grants a few credits at first:
    // the server sends what they allow.)
    return counter == 1 && a.stats().posts - server_posts_before >= (srq ? 3 : kMessages);
  };
  const auto answer_by = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!executed() && std::chrono::steady_clock::now() < answer_by) {
    io_s.restart();
    io_s.poll();
  }
  REQUIRE(executed());  // (the puts landed: their completions are what the client loses)
  const auto settle = std::chrono::steady_clock::now() + ms(100);
  while (std::chrono::steady_clock::now() < settle) {
    io_s.restart();
    io_s.poll();
  }
  auto all_ended = [&] {
    for (const auto& p : puts) {
      if (p.empty()) return false;
    }
    return !atomic.empty() && !flushed.empty() && !received.empty();
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!all_ended() && std::chrono::steady_clock::now() < deadline) {
    io_c.restart();
    io_c.poll();
    io_s.restart();
    io_s.poll();
  }
  std::this_thread::sleep_for(ms(50));
  io_c.restart();
  io_c.poll();  // (nothing ends twice)
  REQUIRE(all_ended());
  for (std::size_t i = 0; i < kPuts; ++i) {
    INFO("put " << i);
    REQUIRE(puts[i].size() == 1);
    CHECK(puts[i][0]);  // not done: its completion was lost
    CHECK_FALSE(qp_held_at_end[i]);
  }
  REQUIRE(atomic.size() == 1);
  CHECK(atomic[0]);
  REQUIRE(flushed.size() == 1);
  CHECK(flushed[0]);
  REQUIRE(received.size() == 1);
  CHECK(received[0]);
  CHECK_FALSE(c.is_open());
  CHECK(c.stats().puts == 0);  // (none counted as done either)
  CHECK(c.stats().atomics == 0);
  // The reactor gave up; its queue stays signalled (the overflow's
  // eventfd) and nothing polls it: the fabric's idle watch of the queue
  // must not wake for it over and over while the io_context runs.
  asio::steady_timer quiet(io_c, ms(1000));
  bool fired = false;
  quiet.async_wait([&](const boost::system::error_code&) { fired = true; });
  const double cpu0 = process_cpu_seconds();
  run_until(io_c, [&] { return fired; });
  const double used = process_cpu_seconds() - cpu0;
  INFO("CPU over 1 s after the overflow: " << used << " s");
  CHECK(used < 0.3);
  // The fabric's listing still names the connection, its queue pair gone.
  const auto report = report_of_c();
  REQUIRE(report.has_value());
  CHECK_FALSE(report->holds_queue_pair);
  // The connect in its handshake ends with the error once its thread lets
  // go of the queue pair (not a connection that would serve nothing).
  const auto handshake_by = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!in_handshake.has_value() && std::chrono::steady_clock::now() < handshake_by) {
    io_late.restart();
    io_late.poll();
    io_c.restart();
    io_c.poll();
  }
  REQUIRE(in_handshake.has_value());
  CHECK(*in_handshake == ad::errc::invalid_state);
  CHECK(client->connection_reports().size() == 1);  // (it let itself go)
  if (srq) {
    // Both grants are back: the shared queue's receives are all spare again.
    const ad::fabric_stats fs = client->stats();
    CHECK(fs.srq_posted == 64);
    CHECK(fs.srq_spare == fs.srq_posted);
  }
  // A new connection on this fabric would never see an operation end:
  // refused at once, saying why.
  std::optional<ad::error_code> refused;
  client->async_connect(addr(acc), [&](ad::error_code ec, ad::connection) { refused = ec; });
  run_until(io_c, [&] { return refused.has_value(); });
  REQUIRE(refused.has_value());
  CHECK(*refused == ad::errc::invalid_state);
  CHECK(client->connection_reports().size() == 1);
  // The accept that waited ends with that error, with no peer coming, and
  // a later one at once: not an accept loop waiting for ever on a fabric
  // that can serve nobody. The listener closes: a peer finds nobody there.
  run_until(io_c, [&] { return accept_waiting.has_value(); });
  REQUIRE(accept_waiting.has_value());
  CHECK(*accept_waiting == ad::errc::invalid_state);
  std::optional<ad::error_code> peer;
  server.async_connect(addr(back), [&](ad::error_code ec, ad::connection) { peer = ec; });
  run_until(io_s, [&] { return peer.has_value(); });
  REQUIRE(peer.has_value());
  CHECK(*peer == ad::errc::connection_refused);
  for (ad::acceptor* l : {&back, &idle_acceptor}) {
    std::optional<ad::error_code> later;
    l->async_accept([&](ad::error_code ec, ad::connection) { later = ec; });
    run_until(io_c, [&] { return later.has_value(); });
    REQUIRE(later.has_value());
    CHECK(*later == ad::errc::invalid_state);
  }
  CHECK(client->connection_reports().size() == 1);
  try {
    client->listen(test_host(), 0);
    FAIL("listening on a fabric whose completion queue was lost");
  } catch (const std::system_error& e) {
    CHECK(e.code() == ad::errc::invalid_state);
    CHECK(std::string(e.what()).find("completion queue was lost") != std::string::npos);
  }
}

// What the runtime holds for late duplicate READs (fabric_options::
// late_read_grace), on a device that says they can come
// (late_duplicates=1: the tcp device then claims capabilities::
// late_duplicates; these buffers outlive every grace).
TEST_CASE("faults: late_duplicates=1 - rendezvous sources are held late_read_grace after their sends, at most 256 "
          "and 64 MiB, none with 0 or once the connection failed",
          "[faults]") {
  asio::io_context io;
  ad::fabric_options so = test_options();
  so.connection.rendezvous_memory = std::uint64_t{256} << 20;  // (the 65 MiB message)
  ad::fabric server(io, so);
  ad::acceptor acc = server.listen(test_host(), 0);
  // Receives every message of each connection until it ends, except on
  // the connection that receives nothing at all (its RTS waits unread).
  bool hold_next = false;
  ad::connection held;  // (posts no receive)
  asio::co_spawn(io, [&]() -> awaitable<void> {
    for (;;) {
      auto [ec, c] = co_await acc.async_accept(asio::as_tuple(use_awaitable));
      if (ec) co_return;
      if (std::exchange(hold_next, false)) {
        held = std::move(c);
        continue;
      }
      asio::co_spawn(co_await asio::this_coro::executor, [](ad::connection conn) -> awaitable<void> {
        for (;;) {
          auto [e, m] = co_await conn.async_receive(asio::as_tuple(use_awaitable));
          if (e) co_return;
        }
      }(std::move(c)), asio::detached);
    }
  }, asio::detached);
  auto client_with = [&](std::chrono::milliseconds grace) {
    ad::fabric_options o = test_options();
    o.late_read_grace = grace;
    return faulty_fabric(io, "late_duplicates=1", o);
  };
  bool done = false;
  failure f;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    auto ex = co_await asio::this_coro::executor;
    {  // The default, 100 ms: held that long, then deregistered by a tick.
      auto client = client_with(std::chrono::milliseconds(100));
      CHECK(client->device().caps().late_duplicates);
      ad::connection c = co_await client->async_connect(addr(acc), use_awaitable);
      const auto out = pattern(100000, 1);
      co_await c.async_send(asio::buffer(out), use_awaitable);
      const auto ended = std::chrono::steady_clock::now();
      co_await sleep_for(ms(50));
      ad::fabric_stats s = client->stats();
      if (std::chrono::steady_clock::now() - ended < ms(90)) {  // (in time: a sanitizer's build may be slower)
        CHECK(s.retired_sources == 1);
        CHECK(s.retired_bytes == 100000);
      }
      const bool gone = co_await until([&] { return client->stats().retired_sources == 0; }, std::chrono::seconds(3),
                                       ms(1));
      CHECK(gone);
      CHECK(std::chrono::steady_clock::now() - ended >= ms(90));
      s = client->stats();
      CHECK(s.retired_bytes == 0);
      CHECK(s.retired_early == 0);
      co_await c.async_close(use_awaitable);
    }
    {  // 10 s: the limits make the oldest go early.
      auto client = client_with(std::chrono::seconds(10));
      ad::connection c = co_await client->async_connect(addr(acc), use_awaitable);
      const auto start = std::chrono::steady_clock::now();
      // (Counts exact while no source has been held its 10 s.)
      const auto in_time = [&] { return std::chrono::steady_clock::now() - start < std::chrono::seconds(9); };
      const auto small = pattern(70000, 2);  // above eager_split_limit (64 KiB): by rendezvous
      for (int i = 0; i < 300; ++i) co_await c.async_send(asio::buffer(small), use_awaitable);
      co_await asio::post(ex, use_awaitable);
      ad::fabric_stats s = client->stats();
      CHECK(c.stats().rendezvous_sends == 300);
      REQUIRE(in_time());
      CHECK(s.retired_sources == 256);
      CHECK(s.retired_bytes == 256u * 70000u);
      CHECK(s.retired_early == 44);
      const auto big = pattern(std::size_t{1} << 20, 3);
      for (int i = 0; i < 70; ++i) co_await c.async_send(asio::buffer(big), use_awaitable);
      co_await asio::post(ex, use_awaitable);
      s = client->stats();
      REQUIRE(in_time());
      CHECK(s.retired_sources == 64);  // 64 MiB exactly
      CHECK(s.retired_bytes == std::uint64_t{64} << 20);
      CHECK(s.retired_early == 44 + 256 + 6);
      // One larger than the whole limit is not held (nor does it push the others out).
      const std::vector<std::byte> huge(std::size_t{65} << 20, std::byte{7});
      co_await c.async_send(asio::buffer(huge), use_awaitable);
      co_await asio::post(ex, use_awaitable);
      s = client->stats();
      REQUIRE(in_time());
      CHECK(s.retired_sources == 64);
      CHECK(s.retired_early == 44 + 256 + 6 + 1);
      co_await c.async_close(use_awaitable);
    }  // (the fabric goes with 64 held: deregistered before its protection domain)
    {  // 0: nothing held.
      auto client = client_with(ms(0));
      ad::connection c = co_await client->async_connect(addr(acc), use_awaitable);
      const auto out = pattern(100000, 4);
      co_await c.async_send(asio::buffer(out), use_awaitable);
      co_await asio::post(ex, use_awaitable);
      const ad::fabric_stats s = client->stats();
      CHECK(s.retired_sources == 0);
      CHECK(s.retired_early == 0);
      co_await c.async_close(use_awaitable);
    }
    {  // A connection that failed: its queue pair executes nothing more, so nothing is held.
      auto client = client_with(std::chrono::seconds(10));
      hold_next = true;
      ad::connection c = co_await client->async_connect(addr(acc), use_awaitable);
      const auto out = pattern(100000, 5);
      std::optional<ad::error_code> sent;
      c.async_send(asio::buffer(out), [&](ad::error_code ec, std::size_t) { sent = ec; });
      const bool out_there = co_await until([&] { return c.stats().rendezvous_sends == 1; });
      CHECK(out_there);
      c.abort();
      const bool ended = co_await until([&] { return sent.has_value(); });
      REQUIRE(ended);
      CHECK(*sent);
      co_await asio::post(ex, use_awaitable);
      const ad::fabric_stats s = client->stats();
      CHECK(s.retired_sources == 0);
      CHECK(s.retired_early == 0);
    }
    held = {};
    acc.close();
    done = true;
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(done);
}
