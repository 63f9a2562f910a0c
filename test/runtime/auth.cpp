// Connection authentication (runtime/protocol.hpp): a challenge-response
// with fresh nonces and HMAC-SHA256. The runtime meets raw provider-level
// peers that follow (or break) the protocol; their proofs are computed here
// with OpenSSL from the protocol's description, not with the runtime's code.
#include "../support/runtime.hpp"
#include "../support/sleep.hpp"

#include <anydoor/anydoor.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <optional>
#include <thread>

using namespace anydoor::test;
namespace asio = boost::asio;
namespace ad = anydoor;
using asio::awaitable;
using asio::use_awaitable;

namespace {

constexpr std::size_t kHello = 50;
constexpr std::uint8_t kTypeEager = 1, kTypeAuth = 7;
const std::string kToken = "0123456789abcdef-the-shared-secret";

using bytes = std::vector<std::byte>;

template <class T>
void put(bytes& b, std::size_t at, T v) {
  std::memcpy(b.data() + at, &v, sizeof v);  // little-endian host (x86-64)
}
template <class T>
T get(std::span<const std::byte> b, std::size_t at) {
  T v{};
  std::memcpy(&v, b.data() + at, sizeof v);
  return v;
}

// A hello (kind 1) or welcome (kind 2): magic | version | kind | reason |
// credits | flags | receive buffer | eager limit | max message | nonce |
// keepalive (0: none) | max credits (= credits).
bytes make_hello(std::uint8_t kind, bool auth, std::uint16_t credits = 8) {
  bytes h(kHello);
  put<std::uint32_t>(h, 0, 0x31524441);
  put<std::uint16_t>(h, 4, kWireVersion);
  h[6] = std::byte{kind};
  put<std::uint16_t>(h, 8, credits);
  put<std::uint16_t>(h, 10, auth ? 1 : 0);
  put<std::uint32_t>(h, 12, 256);  // receive buffer
  put<std::uint32_t>(h, 16, 248);  // eager limit
  put<std::uint64_t>(h, 20, 1 << 20);
  put<std::uint16_t>(h, 48, credits);
  if (auth) REQUIRE(RAND_bytes(reinterpret_cast<unsigned char*>(h.data() + 28), 16) == 1);
  return h;
}

// HMAC-SHA256(token, "anydoor-auth-v3 <role>\0" || hello || welcome).
bytes proof(const std::string& token, const char* role, std::span<const std::byte> hello,
            std::span<const std::byte> welcome) {
  std::string input = std::string("anydoor-auth-v3 ") + role;
  input.push_back('\0');
  input.append(reinterpret_cast<const char*>(hello.data()), kHello);
  input.append(reinterpret_cast<const char*>(welcome.data()), kHello);
  bytes out(32);
  unsigned len = 0;
  HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()), reinterpret_cast<const unsigned char*>(input.data()),
       input.size(), reinterpret_cast<unsigned char*>(out.data()), &len);
  return out;
}

// A runtime message: header (type, status, credits, aux) + body.
bytes message(std::uint8_t type, std::uint8_t status, std::uint16_t credits, std::span<const std::byte> body = {}) {
  bytes m(8 + body.size());
  m[0] = std::byte{type};
  m[1] = std::byte{status};
  put<std::uint16_t>(m, 2, credits);
  if (!body.empty()) std::memcpy(m.data() + 8, body.data(), body.size());
  return m;
}

// A provider-level peer: one queue pair with 8 receives of 256 bytes posted.
// Its methods run on the raw thread only; failures are recorded in `notes`.
struct raw_peer {
  std::unique_ptr<tp::device> dev = open_test_device();
  std::unique_ptr<tp::protection_domain> pd = dev->alloc_pd();
  std::unique_ptr<tp::completion_queue> cq = dev->create_cq(64);
  std::unique_ptr<tp::queue_pair> qp;
  std::vector<std::byte> mem = std::vector<std::byte>(16 * 256);
  std::unique_ptr<tp::memory_region> mr = pd->register_memory(mem.data(), mem.size(), tp::access::local_write);
  std::array<tp::sge, 16> sges{};
  std::uint64_t sent = 0;

  // A fresh queue pair in init with its receives posted; false when the
  // provider refused (no Catch2 assertion: it runs on the raw thread).
  bool reset() {
    qp.reset();
    arrived.clear();
    sent = sends_done = 0;
    std::error_code ec;
    std::array<tp::completion, 16> wc;
    while (cq->poll(wc, ec) > 0) {  // what the old queue pair left
    }
    qp = pd->create_qp({.send_cq = cq.get(), .recv_cq = cq.get(), .max_send_wr = 8, .max_recv_wr = 8});
    if (qp->modify(tp::qp_state::init)) return false;
    std::vector<tp::recv_request> rr;
    for (std::uint32_t i = 0; i < 8; ++i) {
      sges[i] = mr->slice(i * 256, 256);
      rr.push_back({.wr_id = 100 + i, .sg_list = {&sges[i], 1}});
    }
    return !qp->post_recv(rr);
  }
  // Posts a message from the next of 8 send slots, once the send queue has
  // room (what completes meanwhile is taken: poll).
  bool send(std::span<const std::byte> m) {
    const auto deadline = std::chrono::steady_clock::now() + 2s;
    while (sent > sends_done && sent - sends_done >= 8) {  // (a test's own polls may take some: then no wait)
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::size_t n = 0;
      if (!poll(n)) return false;
      if (n == 0) std::this_thread::sleep_for(1ms);
    }
    const std::uint32_t slot = 8 + static_cast<std::uint32_t>(sent++ % 8);
    std::memcpy(mem.data() + slot * 256, m.data(), m.size());
    sges[slot] = mr->slice(slot * 256, static_cast<std::uint32_t>(m.size()));
    return !qp->post_send(std::array{send_wr(slot, {&sges[slot], 1})});
  }
  // RDMA-READs `len` bytes at addr/rkey into mem[0, len) and waits up to
  // 2 s for its completion: its status (nullopt: none came). Messages that
  // arrive meanwhile are kept for receive().
  std::optional<tp::wc_status> read(std::uint64_t addr, std::uint32_t rkey, std::uint32_t len) {
    sges[0] = mr->slice(0, len);
    tp::work_request wr = send_wr(kReadId, {&sges[0], 1});
    wr.op = tp::opcode::read;
    wr.remote_addr = addr;
    wr.rkey = rkey;
    read_status.reset();
    if (qp->post_send(std::array{wr})) return std::nullopt;
    ++sent;
    const auto deadline = std::chrono::steady_clock::now() + 2s;
    while (!read_status && std::chrono::steady_clock::now() < deadline) {
      std::size_t n = 0;
      (void)poll(n);  // (the read's own failure is its status)
      if (n == 0) std::this_thread::sleep_for(1ms);
    }
    return read_status;
  }
  // The next received message; nullopt when none came within `limit` or the
  // queue pair failed (then *failed is set).
  std::optional<bytes> receive(std::chrono::milliseconds limit, bool* failed = nullptr) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (;;) {
      if (!arrived.empty()) {
        bytes m = std::move(arrived.front());
        arrived.pop_front();
        return m;
      }
      if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
      std::size_t n = 0;
      if (!poll(n)) {
        if (failed != nullptr) *failed = true;
        return std::nullopt;
      }
      if (n == 0) std::this_thread::sleep_for(1ms);
    }
  }
  // Takes what completed (n: how many): messages into `arrived` (more than
  // one may come in a poll), sends counted, a read's status kept; false
  // when something other than a read failed.
  bool poll(std::size_t& n) {
    std::array<tp::completion, 16> wc;
    std::error_code ec;
    n = cq->poll(wc, ec);
    bool ok = true;
    for (std::size_t i = 0; i < n; ++i) {
      if (wc[i].wr_id < 100) ++sends_done;
      if (wc[i].wr_id == kReadId) {
        read_status = wc[i].status;
      } else if (wc[i].status != tp::wc_status::success) {
        ok = false;
      } else if (wc[i].wr_id >= 100) {
        const std::size_t at = (wc[i].wr_id - 100) * 256;
        arrived.emplace_back(mem.begin() + static_cast<std::ptrdiff_t>(at),
                             mem.begin() + static_cast<std::ptrdiff_t>(at + wc[i].byte_len));
      }
    }
    return ok;
  }
  static constexpr std::uint64_t kReadId = 50;
  std::uint64_t sends_done = 0;  // send completions taken (reads included)
  std::optional<tp::wc_status> read_status;
  std::deque<bytes> arrived;  // received, not returned yet
};

// `rounds` connects of `client` to `port` in turn, each ended at once (a
// raw peer's thread answers them); then the io_context runs out and `raw`
// is joined. Each attempt's error.
std::vector<ad::error_code> connect_rounds(asio::io_context& io, ad::fabric& client, std::uint16_t port,
                                           std::size_t rounds, std::thread& raw) {
  std::vector<ad::error_code> results;
  failure f;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    for (std::size_t r = 0; r < rounds; ++r) {
      auto [ec, c] = co_await client.async_connect(test_host() + ":" + std::to_string(port),
                                                   asio::as_tuple(use_awaitable));
      results.push_back(ec);
      if (!ec) c.abort();
    }
  }, f.handler());
  run_to_completion(io);
  raw.join();
  f.check();
  return results;
}

}  // namespace

TEST_CASE("auth: proofs follow the protocol and a replayed proof or a message before authenticating or a silent peer "
          "is refused while the accept loop carries on",
          "[runtime]") {
  asio::io_context io;
  ad::connection_options co;
  co.auth_token = kToken;
  co.handshake_timeout = std::chrono::milliseconds(500);
  co.credits = 16;
  ad::fabric server(io, test_options(co));
  ad::fabric client(io, test_options({.auth_token = kToken}));
  ad::acceptor acc = server.listen(test_host(), 0);
  auto guard = asio::make_work_guard(io);
  failure f;
  std::vector<ad::error_code> accepted;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    for (int i = 0; i < 2; ++i) {  // the raw client that proves the token, then the runtime client
      auto [ec, c] = co_await acc.async_accept(asio::as_tuple(use_awaitable));
      accepted.push_back(ec);
      if (ec) co_return;
      auto [rec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
      if (rec) continue;
      co_await c.async_send(m.buffer(), use_awaitable);
      co_await c.async_receive(asio::as_tuple(use_awaitable));  // open until the peer leaves: the echo gets out
    }
  }, f.handler());

  // What the raw thread saw (checked on this thread afterwards).
  struct seen_t {
    bool welcome_auth = false, answer_ok = false, echoed = false;
    std::uint16_t answer_credits = 0;
    bool fresh_nonce = false, replay_refused = false;
    bool early_answered = false, silent_answered = false;
    bool early_dropped = false, silent_dropped = false;  // the listener disconnected it
    std::chrono::steady_clock::duration early_took{}, silent_took{};
    std::chrono::steady_clock::duration client_took{};
    bool client_ok = false;
  } seen;
  std::atomic<bool> raw_ok{true};
  std::thread raw([&] {
    raw_peer p;
    if (!p.reset()) return void(raw_ok = false);
    // 1. A peer that follows the protocol.
    const bytes hello = make_hello(1, true);
    auto res = p.dev->connect(*p.qp, test_host(), acc.port(), hello, std::chrono::seconds(10));
    if (res.ec || res.private_data.size() < kHello) return;
    const bytes welcome1(res.private_data.begin(), res.private_data.begin() + kHello);
    seen.welcome_auth = get<std::uint16_t>(welcome1, 10) == 1;
    const bytes auth1 = message(kTypeAuth, 0, 0, proof(kToken, "client", hello, welcome1));
    p.send(auth1);
    if (auto a = p.receive(5s); a && a->size() == 40 && std::to_integer<int>((*a)[0]) == kTypeAuth) {
      seen.answer_credits = get<std::uint16_t>(*a, 2);
      seen.answer_ok = std::to_integer<int>((*a)[1]) == 0 &&
                       bytes(a->begin() + 8, a->end()) == proof(kToken, "server", hello, welcome1);
    }
    // Checked: we confirm (the listener's accept completes only now), and our
    // withheld credits go with that; then a message, which is echoed.
    p.send(message(kTypeAuth, 2, 7));
    const std::array<std::byte, 4> ping{std::byte{'p'}, std::byte{'i'}, std::byte{'n'}, std::byte{'g'}};
    p.send(message(kTypeEager, 0, 0, ping));
    for (int i = 0; i < 4 && !seen.echoed; ++i) {  // (credit messages may come first)
      auto e = p.receive(5s);
      if (!e) break;
      if (e->size() == 12) seen.echoed = std::memcmp(e->data() + 8, "ping", 4) == 0;
    }

    // 2. A sniffer replays the same hello and proof: the listener's nonce differs.
    if (!p.reset()) return void(raw_ok = false);
    res = p.dev->connect(*p.qp, test_host(), acc.port(), hello, std::chrono::seconds(10));
    if (res.ec || res.private_data.size() < kHello) return;
    seen.fresh_nonce = !std::equal(res.private_data.begin() + 28, res.private_data.begin() + 44, welcome1.begin() + 28);
    p.send(auth1);
    if (auto a = p.receive(5s); a && a->size() == 8) {
      seen.replay_refused = std::to_integer<int>((*a)[0]) == kTypeAuth && std::to_integer<int>((*a)[1]) == 1;
    }

    // 3. A peer that sends a message before authenticating gets no answer.
    if (!p.reset()) return void(raw_ok = false);
    res = p.dev->connect(*p.qp, test_host(), acc.port(), make_hello(1, true), std::chrono::seconds(10));
    if (res.ec) return;
    p.send(message(kTypeEager, 0, 0, ping));
    auto t0 = std::chrono::steady_clock::now();
    seen.early_answered = p.receive(2s, &seen.early_dropped).has_value();
    seen.early_took = std::chrono::steady_clock::now() - t0;

    // 4. A peer that never speaks holds nobody up: a runtime client connects
    // meanwhile; the silent one is refused at the handshake timeout.
    if (!p.reset()) return void(raw_ok = false);
    res = p.dev->connect(*p.qp, test_host(), acc.port(), make_hello(1, true), std::chrono::seconds(10));
    if (res.ec) return;
    std::atomic<bool> done{false};
    asio::post(io, [&] {
      asio::co_spawn(io, [&]() -> awaitable<void> {
        const auto start = std::chrono::steady_clock::now();
        ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
        seen.client_took = std::chrono::steady_clock::now() - start;
        co_await c.async_send(asio::buffer("hi", 2), use_awaitable);
        ad::message m = co_await c.async_receive(use_awaitable);
        seen.client_ok = m.size() == 2;
        done = true;
      }, f.handler());
    });
    t0 = std::chrono::steady_clock::now();
    seen.silent_answered = p.receive(3s, &seen.silent_dropped).has_value();
    seen.silent_took = std::chrono::steady_clock::now() - t0;
    while (!done) std::this_thread::sleep_for(1ms);
  });
  asio::co_spawn(io, [&]() -> awaitable<void> {
    // Releases the io once the raw thread is through (it never touches io's objects but by post).
    asio::steady_timer t(io);
    for (;;) {
      t.expires_after(10ms);
      co_await t.async_wait(use_awaitable);
      if (accepted.size() == 2 && seen.client_ok) break;
    }
  }, f.handler());
  std::thread releaser([&] {
    raw.join();
    asio::post(io, [&] { guard.reset(); });
  });
  run_to_completion(io);
  releaser.join();
  f.check();
  CHECK(raw_ok);
  CHECK(seen.welcome_auth);
  CHECK(seen.answer_ok);
  CHECK(seen.answer_credits == 16);  // the 15 withheld plus the re-posted receive of our proof
  CHECK(seen.echoed);
  CHECK(seen.fresh_nonce);
  CHECK(seen.replay_refused);
  CHECK_FALSE(seen.early_answered);
  CHECK_FALSE(seen.silent_answered);
  if (testing_tcp()) {  // (verbs: a queue pair in error tells its peer nothing until it is destroyed)
    using ms = std::chrono::milliseconds;
    INFO("early: dropped after " << std::chrono::duration_cast<ms>(seen.early_took).count() << " ms, silent: after "
                                 << std::chrono::duration_cast<ms>(seen.silent_took).count() << " ms");
    CHECK(seen.early_dropped);
    CHECK(seen.early_took < ms(300));  // at once, not at the 500 ms handshake timeout
    CHECK(seen.silent_dropped);
    CHECK(seen.silent_took > ms(300));  // at the handshake timeout
    CHECK(seen.silent_took < ms(2000));
  }
  CHECK(seen.client_ok);
  INFO("the runtime client waited " << std::chrono::duration_cast<std::chrono::milliseconds>(seen.client_took).count()
                                    << " ms");
  CHECK(seen.client_took < std::chrono::milliseconds(400));
  REQUIRE(accepted.size() == 2);
  CHECK_FALSE(accepted[0]);
  CHECK_FALSE(accepted[1]);
  CHECK(server.stats().accepted == 2);
  CHECK(server.stats().refused == 3);  // the replay, the early message, the silent peer
}

TEST_CASE("auth: the connecting side checks the listener's proof and withholds its credits until then", "[runtime]") {
  asio::io_context io;
  ad::connection_options co;
  co.auth_token = kToken;
  co.handshake_timeout = std::chrono::milliseconds(500);
  ad::fabric client(io, test_options(co));
  raw_peer p;  // verbs accepts only on a queue pair of the listener's device
  auto listener = p.dev->listen(test_host(), 0, {});
  const std::uint16_t port = listener->port();
  enum class answer { right, wrong, none, no_auth_welcome };
  const std::array rounds{answer::right, answer::wrong, answer::none, answer::no_auth_welcome};
  struct round_seen {
    bool hello_auth = false, client_proof_ok = false;
    std::uint16_t proof_credits = 0xffff;
    int next_type = -1;  // what the client sent after our answer
    int next_status = -1;
    std::uint16_t next_credits = 0;
  };
  std::array<round_seen, 4> seen{};
  std::thread raw([&] {
    for (std::size_t r = 0; r < rounds.size(); ++r) {
      std::error_code ec;
      auto req = listener->get_request(std::chrono::seconds(10), ec);
      if (req == nullptr) return;
      const bytes hello(req->private_data().begin(), req->private_data().begin() + kHello);
      seen[r].hello_auth = get<std::uint16_t>(hello, 10) == 1;
      if (!p.reset()) return;
      const bytes welcome = make_hello(2, rounds[r] != answer::no_auth_welcome);
      if (req->accept(*p.qp, welcome)) return;
      if (rounds[r] == answer::no_auth_welcome) continue;
      auto m = p.receive(5s);
      if (!m || m->size() != 40) continue;
      seen[r].proof_credits = get<std::uint16_t>(*m, 2);
      seen[r].client_proof_ok = bytes(m->begin() + 8, m->end()) == proof(kToken, "client", hello, welcome);
      if (rounds[r] == answer::none) {
        (void)p.receive(1s);  // nothing: the client gives up at its handshake timeout
        continue;
      }
      bytes mac = proof(kToken, "server", hello, welcome);
      if (rounds[r] == answer::wrong) mac[5] ^= std::byte{1};
      p.send(message(kTypeAuth, 0, 7, mac));
      if (auto next = p.receive(500ms); next && next->size() >= 8) {  // the client's credits once it checked us
        seen[r].next_type = std::to_integer<int>((*next)[0]);
        seen[r].next_status = std::to_integer<int>((*next)[1]);
        seen[r].next_credits = get<std::uint16_t>(*next, 2);
      }
    }
  });
  const std::vector<ad::error_code> results = connect_rounds(io, client, port, rounds.size(), raw);
  REQUIRE(results.size() == 4);
  CHECK_FALSE(results[0]);
  CHECK(results[1] == ad::errc::authentication_failed);
  CHECK(results[2] == ad::errc::timed_out);
  CHECK(results[3] == ad::errc::authentication_failed);
  for (std::size_t r = 0; r < 3; ++r) {
    INFO("round " << r);
    CHECK(seen[r].hello_auth);
    CHECK(seen[r].client_proof_ok);
    CHECK(seen[r].proof_credits == 0);  // the client grants its receives only to a proven listener
  }
  CHECK(client.stats().connected == 1);
  // Proven: the client confirms (an auth message, status confirmed) and
  // returns its withheld receives with it (64 credits: 63 withheld plus the
  // re-posted receive of our answer).
  CHECK(seen[0].next_type == kTypeAuth);
  CHECK(seen[0].next_status == 2);
  CHECK(seen[0].next_credits == 64);
  CHECK(seen[1].next_type == -1);  // a wrong proof gets nothing
}

TEST_CASE("handshake: a connecting fabric maps a welcome of another version and each refusal reason to its error",
          "[runtime]") {
  asio::io_context io;
  ad::fabric client(io, test_options({}));
  raw_peer p;
  auto listener = p.dev->listen(test_host(), 0, {});
  const std::uint16_t port = listener->port();
  // A welcome of the next wire version, then refusals for each reason:
  // version, authentication, resources, malformed, none.
  constexpr int kWelcomeNext = -1;
  const std::array<int, 6> rounds{kWelcomeNext, 1, 2, 4, 3, 0};
  std::thread raw([&] {
    for (const int r : rounds) {
      std::error_code ec;
      auto req = listener->get_request(std::chrono::seconds(10), ec);
      if (req == nullptr) return;
      if (r == kWelcomeNext) {
        if (!p.reset()) return;
        bytes welcome = make_hello(2, false);
        put<std::uint16_t>(welcome, 4, static_cast<std::uint16_t>(kWireVersion + 1));
        if (req->accept(*p.qp, welcome)) return;
        continue;
      }
      bytes refusal = make_hello(3, false);
      refusal[7] = static_cast<std::byte>(r);
      req->reject(refusal);
    }
  });
  const std::vector<ad::error_code> results = connect_rounds(io, client, port, rounds.size(), raw);
  REQUIRE(results.size() == rounds.size());
  CHECK(results[0] == ad::errc::version_mismatch);  // the client refuses the welcome
  CHECK(results[1] == ad::errc::version_mismatch);
  CHECK(results[2] == ad::errc::authentication_failed);
  CHECK(results[3] == ad::errc::too_many_connections);
  CHECK(results[4] == ad::errc::protocol_error);
  CHECK(results[5] == ad::errc::protocol_error);
  CHECK(client.stats().connected == 0);
}

TEST_CASE("auth: a handshake reflected back to its own fabric is refused", "[runtime]") {
  // The fabric connects out to an attacker, who relays its hello to the
  // fabric's own listener: proving the token to itself must not work.
  asio::io_context io;
  ad::connection_options co;
  co.auth_token = kToken;
  co.handshake_timeout = std::chrono::milliseconds(500);
  co.connect_timeout = std::chrono::milliseconds(3000);
  ad::fabric victim(io, test_options(co));
  ad::acceptor acc = victim.listen(test_host(), 0);
  raw_peer attacker;
  auto listener = attacker.dev->listen(test_host(), 0, {});
  const std::uint16_t port = listener->port();
  tp::connect_result relayed;
  bool got_hello = false;
  std::thread raw([&] {
    std::error_code ec;
    auto req = listener->get_request(std::chrono::seconds(10), ec);
    if (req == nullptr) return;
    got_hello = true;
    const bytes hello(req->private_data().begin(), req->private_data().begin() + kHello);
    if (!attacker.reset()) return;
    relayed = attacker.dev->connect(*attacker.qp, test_host(), acc.port(), hello, std::chrono::seconds(5));
    req->reject({});
  });
  ad::error_code connect_ec;
  failure f;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    auto [ec, c] = co_await victim.async_connect(test_host() + ":" + std::to_string(port),
                                                 asio::as_tuple(use_awaitable));
    connect_ec = ec;
    acc.close();
  }, f.handler());
  run_to_completion(io);
  raw.join();
  f.check();
  REQUIRE(got_hello);
  CHECK(relayed.ec == ad::errc::connection_rejected);
  REQUIRE(relayed.private_data.size() >= 8);
  CHECK(std::to_integer<int>(relayed.private_data[7]) == 2);  // refuse reason: authentication
  CHECK(connect_ec);
  CHECK(victim.stats().refused >= 1);
}

TEST_CASE("auth: until a peer proves the token its queue pair may touch none of the listener's memory, whatever key "
          "it holds",
          "[runtime]") {
  asio::io_context io;
  ad::connection_options co;
  co.auth_token = kToken;
  co.handshake_timeout = std::chrono::milliseconds(2000);
  ad::fabric server(io, test_options(co));
  ad::acceptor acc = server.listen(test_host(), 0);
  // A region that grants everything: only the connection's state may refuse.
  alignas(8) std::array<std::byte, 64> target{};
  ad::memory_region tr = server.register_memory(target, ad::access::local_write | ad::access::remote_write |
                                                            ad::access::remote_read | ad::access::remote_atomic);
  const ad::remote_region where = tr.remote();  // as if leaked, or guessed
  auto guard = asio::make_work_guard(io);
  failure f;
  ad::error_code accepted_ec;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    auto [ec, c] = co_await acc.async_accept(asio::as_tuple(use_awaitable));
    accepted_ec = ec;
    if (ec) co_return;
    auto [rec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));  // held open until the peer goes
  }, f.handler());

  struct seen_t {
    bool connected = false, proven = false;
    tp::wc_status before = tp::wc_status::success;  // a write before proving
    tp::wc_status after = tp::wc_status::general_error;  // the same write after
    bool target_untouched_before = false;
  } seen;
  std::thread raw([&] {
    raw_peer p;
    auto write_once = [&](std::uint8_t value, tp::wc_status& out) {
      std::memset(p.mem.data() + 15 * 256, value, 16);
      tp::sge sg = p.mr->slice(15 * 256, 16);
      const tp::work_request wr{.wr_id = 7, .op = tp::opcode::write, .sg_list = {&sg, 1},
                                .remote_addr = where.addr, .rkey = where.rkey};
      if (p.qp->post_send({&wr, 1})) return;
      std::array<tp::completion, 16> wc;
      std::error_code ec;
      const auto deadline = std::chrono::steady_clock::now() + 5s;
      while (std::chrono::steady_clock::now() < deadline) {
        const std::size_t n = p.cq->poll(wc, ec);
        for (std::size_t i = 0; i < n; ++i) {
          if (wc[i].wr_id == 7) return void(out = wc[i].status);
        }
        if (n == 0) std::this_thread::sleep_for(1ms);
      }
    };
    // 1. Connected, not yet proven: the write is refused by the queue pair.
    if (!p.reset()) return;
    auto res = p.dev->connect(*p.qp, test_host(), acc.port(), make_hello(1, true), std::chrono::seconds(10));
    if (res.ec) return;
    seen.connected = true;
    write_once(0x66, seen.before);
    seen.target_untouched_before =
        std::all_of(target.begin(), target.end(), [](std::byte b) { return b == std::byte{0}; });
    // 2. The same write after proving the token succeeds: the refusal above
    // came from the missing proof, nothing else.
    if (!p.reset()) return;
    const bytes hello = make_hello(1, true);
    res = p.dev->connect(*p.qp, test_host(), acc.port(), hello, std::chrono::seconds(10));
    if (res.ec || res.private_data.size() < kHello) return;
    const bytes welcome(res.private_data.begin(), res.private_data.begin() + kHello);
    p.send(message(kTypeAuth, 0, 0, proof(kToken, "client", hello, welcome)));
    if (auto a = p.receive(5s); a && a->size() == 40 && std::to_integer<int>((*a)[1]) == 0) seen.proven = true;
    p.send(message(kTypeAuth, 2, 0));  // confirmed
    write_once(0x77, seen.after);
  });
  std::thread releaser([&] {
    raw.join();
    asio::post(io, [&] {
      guard.reset();
      acc.close();
    });
  });
  run_to_completion(io);
  releaser.join();
  f.check();
  REQUIRE(seen.connected);
  CHECK(seen.before == tp::wc_status::remote_invalid_request);  // the queue pair admits no write yet
  CHECK(seen.target_untouched_before);
  REQUIRE(seen.proven);
  CHECK(seen.after == tp::wc_status::success);
  CHECK(target[0] == std::byte{0x77});
  CHECK(target[15] == std::byte{0x77});
  CHECK(target[16] == std::byte{0});
}

TEST_CASE("auth: both sides may use one-sided operations on each other's memory as soon as connect and accept "
          "complete",
          "[runtime]") {
  asio::io_context io;
  ad::connection_options co;
  co.auth_token = kToken;
  ad::fabric server(io, test_options(co));
  ad::fabric client(io, test_options(co));
  ad::acceptor acc = server.listen(test_host(), 0);
  alignas(8) std::array<std::byte, 64> at_client{}, at_server{};
  const auto rights = ad::access::local_write | ad::access::remote_write | ad::access::remote_atomic;
  ad::memory_region cr = client.register_memory(at_client, rights);
  ad::memory_region sr = server.register_memory(at_server, rights);
  // The keys travel out of band (as from an earlier connection): each side
  // aims at the other the moment its own side of the setup completes.
  constexpr int kRounds = 10;
  int server_ok = 0, client_ok = 0;
  failure f;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    for (int i = 0; i < kRounds; ++i) {
      ad::connection c = co_await acc.async_accept(use_awaitable);
      const std::array<std::byte, 8> v{std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4},
                                       std::byte{5}, std::byte{6}, std::byte{7}, std::byte(i)};
      auto [e1, n] = co_await c.async_put(asio::buffer(v), cr.remote().at(8, 8), asio::as_tuple(use_awaitable));
      auto [e2, before] = co_await c.async_fetch_add(cr.remote().at(0, 8), 1, asio::as_tuple(use_awaitable));
      if (!e1 && !e2) ++server_ok;
      co_await c.async_send(asio::buffer("done", 4), asio::as_tuple(use_awaitable));
      co_await c.async_receive(asio::as_tuple(use_awaitable));  // until the client goes
    }
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    for (int i = 0; i < kRounds; ++i) {
      ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
      auto [e1, before] = co_await c.async_fetch_add(sr.remote().at(0, 8), 1, asio::as_tuple(use_awaitable));
      if (!e1) ++client_ok;
      co_await c.async_receive(asio::as_tuple(use_awaitable));  // the server's put and add are done
      CHECK(std::to_integer<int>(at_client[15]) == i);
      c.abort();
    }
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(server_ok == kRounds);
  CHECK(client_ok == kRounds);
  std::uint64_t server_adds = 0, client_adds = 0;
  std::memcpy(&server_adds, at_client.data(), 8);
  std::memcpy(&client_adds, at_server.data(), 8);
  CHECK(server_adds == kRounds);
  CHECK(client_adds == kRounds);
}

TEST_CASE("auth: a confirmation out of turn, a message before confirming, or no confirmation drops the peer and "
          "no accept completes",
          "[runtime]") {
  asio::io_context io;
  ad::connection_options co;
  co.auth_token = kToken;
  co.handshake_timeout = std::chrono::milliseconds(500);
  ad::fabric server(io, test_options(co));
  ad::acceptor acc = server.listen(test_host(), 0);
  auto guard = asio::make_work_guard(io);
  int accepted = 0;
  failure f;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    for (;;) {
      auto [ec, c] = co_await acc.async_accept(asio::as_tuple(use_awaitable));
      if (ec) co_return;
      ++accepted;
    }
  }, f.handler());
  enum class step { confirm_first, message_before_confirm, proof_twice, silent_after_answer };
  const std::array steps{step::confirm_first, step::message_before_confirm, step::proof_twice,
                         step::silent_after_answer};
  std::array<bool, 4> dropped{};
  std::array<std::chrono::steady_clock::duration, 4> took{};
  std::thread raw([&] {
    raw_peer p;
    for (std::size_t i = 0; i < steps.size(); ++i) {
      if (!p.reset()) return;
      const bytes hello = make_hello(1, true);
      auto res = p.dev->connect(*p.qp, test_host(), acc.port(), hello, std::chrono::seconds(10));
      if (res.ec || res.private_data.size() < kHello) return;
      const bytes welcome(res.private_data.begin(), res.private_data.begin() + kHello);
      const bytes mine = message(kTypeAuth, 0, 0, proof(kToken, "client", hello, welcome));
      const auto t0 = std::chrono::steady_clock::now();
      if (steps[i] == step::confirm_first) {
        p.send(message(kTypeAuth, 2, 0));
      } else {
        p.send(mine);
        if (!p.receive(5s)) return;  // the answer
        if (steps[i] == step::message_before_confirm) p.send(message(kTypeEager, 0, 7, bytes(4)));
        if (steps[i] == step::proof_twice) p.send(message(kTypeAuth, 0, 7, proof(kToken, "client", hello, welcome)));
      }
      bool failed = false;
      while (!failed && p.receive(3s, &failed)) {
      }
      dropped[i] = failed;
      took[i] = std::chrono::steady_clock::now() - t0;
    }
  });
  std::thread releaser([&] {
    raw.join();
    asio::post(io, [&] {
      guard.reset();
      acc.close();
    });
  });
  run_to_completion(io);
  releaser.join();
  f.check();
  CHECK(accepted == 0);
  CHECK(server.stats().refused >= 4);
  if (testing_tcp()) {  // (verbs: a queue pair in error tells its peer nothing until it is destroyed)
    for (std::size_t i = 0; i < steps.size(); ++i) {
      INFO("step " << i << " ended after " << std::chrono::duration_cast<std::chrono::milliseconds>(took[i]).count()
                   << " ms");
      CHECK(dropped[i]);
      // Out of turn: at once; silent: at the handshake timeout (500 ms).
      CHECK(took[i] < (steps[i] == step::silent_after_answer ? 2500ms : 1000ms));
    }
    CHECK(took[3] >= 400ms);
  }
}

namespace {

// A raw peer (no auth, granting 2 credits) connected to `acc`'s fabric,
// driven by `script` on its own thread, while `server` runs on the
// accepted connection. `server_done` tells the script when it has ended.
struct hostile_run {
  ad::error_code ended;
  std::size_t taken = 0;
  std::chrono::steady_clock::duration took{};  // from the first message to the ending
  bool raw_ok = true;
};
template <class Script, class Server>
hostile_run run_raw(asio::io_context& io, ad::acceptor& acc, Script script, Server server) {
  hostile_run out;
  auto guard = asio::make_work_guard(io);
  failure f;
  std::atomic<bool> server_done{false};
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    co_await server(c, out);
    server_done = true;
  }, f.handler());
  std::thread raw([&] {
    raw_peer p;
    if (!p.reset()) return void(out.raw_ok = false);
    auto res = p.dev->connect(*p.qp, test_host(), acc.port(), make_hello(1, false, 2), std::chrono::seconds(10));
    if (res.ec || res.private_data.size() < kHello) return void(out.raw_ok = false);
    script(p, get<std::uint16_t>(std::span<const std::byte>(res.private_data), 8), server_done);
  });
  std::thread releaser([&] {
    raw.join();
    asio::post(io, [&] { guard.reset(); });
  });
  run_to_completion(io);
  releaser.join();
  f.check();
  return out;
}
// run_raw with a server whose application takes every message until its
// connection ends: the ending's error and the messages taken.
template <class Script>
hostile_run run_hostile(asio::io_context& io, ad::acceptor& acc, Script script) {
  return run_raw(io, acc, script, [](ad::connection& c, hostile_run& out) -> awaitable<void> {
    std::chrono::steady_clock::time_point first{};
    for (;;) {
      auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
      if (ec) {
        out.ended = ec;
        break;
      }
      if (out.taken++ == 0) first = std::chrono::steady_clock::now();
    }
    out.took = std::chrono::steady_clock::now() - first;
  });
}

}  // namespace

TEST_CASE("hostile peer: a withdrawal it never answers fails the connection with timed_out after keepalive, and "
          "the cancelled send with it",
          "[runtime]") {
  // The peer takes our rendezvous request, then the withdraw, answers
  // neither and stays alive (a credit message every 100 ms): the send's
  // memory stays readable by it until the connection goes.
  asio::io_context io;
  ad::connection_options co;
  co.keepalive = std::chrono::milliseconds(1000);  // the withdrawal's grace
  ad::fabric server(io, test_options(co));
  ad::acceptor acc = server.listen(test_host(), 0);
  constexpr std::uint8_t kTypeRts = 2, kTypeCredit = 4, kTypeWithdraw = 9;
  std::atomic<bool> saw_rts{false}, saw_withdraw{false};
  ad::error_code send_ended;
  int send_completions = 0;
  std::chrono::steady_clock::duration took{};
  static const std::vector<std::byte> big = pattern(std::size_t{1} << 20, 3);
  const hostile_run r = run_raw(
      io, acc,
      [&](raw_peer& p, std::uint16_t, std::atomic<bool>& done) {
        const auto deadline = std::chrono::steady_clock::now() + 8s;
        while (!done && std::chrono::steady_clock::now() < deadline) {
          if (auto m = p.receive(100ms); m && !m->empty()) {
            if (static_cast<std::uint8_t>((*m)[0]) == kTypeRts) saw_rts = true;
            if (static_cast<std::uint8_t>((*m)[0]) == kTypeWithdraw) saw_withdraw = true;
          }
          if (!p.send(message(kTypeCredit, 0, 0))) break;
        }
      },
      [&](ad::connection& c, hostile_run&) -> awaitable<void> {
        asio::cancellation_signal cancel;
        c.async_send(asio::buffer(big), asio::bind_cancellation_slot(cancel.slot(), [&](ad::error_code ec, std::size_t) {
                       send_ended = ec;
                       ++send_completions;
                     }));
        co_await sleep_for(200ms);
        CHECK(send_completions == 0);
        const auto t0 = std::chrono::steady_clock::now();
        cancel.emit(asio::cancellation_type::terminal);
        for (int i = 0; i < 400 && send_completions == 0; ++i) co_await sleep_for(10ms);
        took = std::chrono::steady_clock::now() - t0;
        co_await sleep_for(50ms);  // nothing completes twice
        CHECK(!c.is_open());
      });
  CHECK(r.raw_ok);
  CHECK(saw_rts);
  CHECK(saw_withdraw);
  CHECK(send_completions == 1);
  CHECK(send_ended == ad::errc::timed_out);
  INFO("the cancelled send ended " << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                                   << " ms after the cancellation");
  CHECK(took >= 900ms);   // the grace (keepalive), less a tick's rounding
  CHECK(took <= 3000ms);  // generous for sanitizer builds
}

TEST_CASE("hostile peer: a fin that says withdrawn for a send never withdrawn fails the connection with "
          "protocol_error",
          "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  constexpr std::uint8_t kTypeRts = 2, kTypeFin = 3, kFinWithdrawn = 4;
  ad::error_code send_ended;
  static const std::vector<std::byte> big = pattern(std::size_t{1} << 20, 4);
  const hostile_run r = run_raw(
      io, acc,
      [&](raw_peer& p, std::uint16_t, std::atomic<bool>& done) {
        const auto deadline = std::chrono::steady_clock::now() + 5s;
        while (!done && std::chrono::steady_clock::now() < deadline) {
          auto m = p.receive(100ms);
          if (!m || m->size() != 32 || static_cast<std::uint8_t>((*m)[0]) != kTypeRts) continue;
          bytes fin = message(kTypeFin, kFinWithdrawn, 0);
          std::memcpy(fin.data() + 4, m->data() + 28, 4);  // aux = the request's cookie
          if (!p.send(fin)) break;
        }
      },
      [&](ad::connection& c, hostile_run&) -> awaitable<void> {
        auto [ec, n] = co_await c.async_send(asio::buffer(big), asio::as_tuple(use_awaitable));
        send_ended = ec;
      });
  CHECK(r.raw_ok);
  CHECK(send_ended == ad::errc::protocol_error);
}

namespace {
// A rendezvous request as received by a raw peer: where and under which
// key to read it, and its cookie.
struct rts_seen {
  std::uint64_t length = 0, addr = 0;
  std::uint32_t rkey = 0, cookie = 0;
};
std::optional<rts_seen> as_rts(const std::optional<bytes>& m) {
  if (!m || m->size() != 32 || static_cast<std::uint8_t>((*m)[0]) != 2) return std::nullopt;
  const std::span<const std::byte> b(*m);
  return rts_seen{get<std::uint64_t>(b, 8), get<std::uint64_t>(b, 16), get<std::uint32_t>(b, 24),
                  get<std::uint32_t>(b, 28)};
}
bool is_withdraw(const std::optional<bytes>& m) {
  return m && m->size() == 8 && static_cast<std::uint8_t>((*m)[0]) == 9 && (*m)[1] == std::byte{0};
}
// A message with aux = cookie.
bytes with_cookie(std::uint8_t type, std::uint8_t status, std::uint32_t cookie) {
  bytes m = message(type, status, 0);
  put<std::uint32_t>(m, 4, cookie);
  return m;
}
}  // namespace

TEST_CASE("hostile peer: once a withdrawn send has ended its memory is not readable, though it was before",
          "[runtime]") {
  // The peer reads a little of our request (allowed), answers the
  // withdrawal honestly, then tries to read the rest with the same key.
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  static const std::vector<std::byte> big = pattern(std::size_t{1} << 20, 5);
  std::optional<tp::wc_status> before, after;
  bool first_bytes_match = false;
  std::atomic<bool> send_done{false};
  ad::error_code send_ended;
  const hostile_run r = run_raw(
      io, acc,
      [&](raw_peer& p, std::uint16_t, std::atomic<bool>&) {
        std::optional<rts_seen> rts;
        for (int i = 0; i < 50 && !rts; ++i) rts = as_rts(p.receive(100ms));
        if (!rts) return;
        before = p.read(rts->addr, rts->rkey, 64);
        first_bytes_match = std::memcmp(p.mem.data(), big.data(), 64) == 0;
        bool withdrawn = false;
        for (int i = 0; i < 50 && !withdrawn; ++i) withdrawn = is_withdraw(p.receive(100ms));
        if (!withdrawn || !p.send(with_cookie(3, 4, rts->cookie))) return;  // fin, withdrawn
        for (int i = 0; i < 200 && !send_done; ++i) std::this_thread::sleep_for(10ms);
        after = p.read(rts->addr + 4096, rts->rkey, 64);
      },
      [&](ad::connection& c, hostile_run&) -> awaitable<void> {
        asio::cancellation_signal cancel;
        c.async_send(asio::buffer(big), asio::bind_cancellation_slot(cancel.slot(), [&](ad::error_code ec, std::size_t) {
                       send_ended = ec;
                       send_done = true;
                     }));
        co_await sleep_for(300ms);  // the peer's first read
        cancel.emit(asio::cancellation_type::terminal);
        for (int i = 0; i < 300 && !send_done; ++i) co_await sleep_for(10ms);
        co_await sleep_for(300ms);  // the peer's second read
      });
  CHECK(r.raw_ok);
  REQUIRE(before.has_value());
  CHECK(*before == tp::wc_status::success);
  CHECK(first_bytes_match);
  CHECK(send_ended == std::errc::operation_canceled);
  REQUIRE(after.has_value());
  CHECK(*after != tp::wc_status::success);
}

TEST_CASE("hostile peer: a withdrawal answered too late (reading) is not timed: the send ends with the fin, "
          "later than the grace, with success",
          "[runtime]") {
  asio::io_context io;
  ad::connection_options co;
  co.keepalive = std::chrono::milliseconds(1000);  // the withdrawal's grace
  ad::fabric server(io, test_options(co));
  ad::acceptor acc = server.listen(test_host(), 0);
  static const std::vector<std::byte> big = pattern(std::size_t{1} << 20, 6);
  std::atomic<bool> send_done{false};
  ad::error_code send_ended;
  std::chrono::steady_clock::duration took{};
  bool open_after = false;
  const hostile_run r = run_raw(
      io, acc,
      [&](raw_peer& p, std::uint16_t, std::atomic<bool>&) {
        std::optional<rts_seen> rts;
        for (int i = 0; i < 50 && !rts; ++i) rts = as_rts(p.receive(100ms));
        if (!rts) return;
        bool withdrawn = false;
        for (int i = 0; i < 50 && !withdrawn; ++i) withdrawn = is_withdraw(p.receive(100ms));
        if (!withdrawn || !p.send(with_cookie(9, 1, rts->cookie))) return;  // withdraw, too late
        // "Reading" for 1.5 grace periods, alive all along.
        const auto until = std::chrono::steady_clock::now() + 1500ms;
        while (std::chrono::steady_clock::now() < until) {
          (void)p.receive(100ms);  // (takes the send completions too)
          if (!p.send(message(4, 0, 0))) return;
        }
        if (!p.send(with_cookie(3, 0, rts->cookie))) return;  // fin, ok
        for (int i = 0; i < 200 && !send_done; ++i) std::this_thread::sleep_for(10ms);
      },
      [&](ad::connection& c, hostile_run&) -> awaitable<void> {
        asio::cancellation_signal cancel;
        c.async_send(asio::buffer(big), asio::bind_cancellation_slot(cancel.slot(), [&](ad::error_code ec, std::size_t) {
                       send_ended = ec;
                       send_done = true;
                     }));
        co_await sleep_for(100ms);
        const auto t0 = std::chrono::steady_clock::now();
        cancel.emit(asio::cancellation_type::terminal);
        for (int i = 0; i < 400 && !send_done; ++i) co_await sleep_for(10ms);
        took = std::chrono::steady_clock::now() - t0;
        open_after = c.is_open();
      });
  CHECK(r.raw_ok);
  CHECK(send_done);
  CHECK(!send_ended);
  CHECK(took >= 1400ms);
  CHECK(open_after);
}

TEST_CASE("a withdrawal that comes while the receiver reads the message is answered too late, then fin ok, and "
          "the message is delivered",
          "[runtime]") {
  // A raw sender: its rendezvous request, then (before its device has
  // served any of our READs: it polls nothing meanwhile) its withdrawal.
  if (provider_under_test() != "tcp") {
    WARN("runs on the tcp provider only: a NIC serves the READ whether or not the raw sender polls");
    return;
  }
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  constexpr std::uint32_t kCookie = 77;
  static const std::vector<std::byte> source = pattern(64 * 1024, 7);
  std::vector<std::pair<std::uint8_t, std::uint8_t>> answers;  // (type, status) of what came with aux kCookie
  std::vector<std::byte> got;
  const hostile_run r = run_raw(
      io, acc,
      [&](raw_peer& p, std::uint16_t, std::atomic<bool>& done) {
        auto src = p.pd->register_memory(const_cast<std::byte*>(source.data()), source.size(), tp::access::remote_read);
        bytes body(24);
        put<std::uint64_t>(body, 0, source.size());
        put<std::uint64_t>(body, 8, reinterpret_cast<std::uint64_t>(source.data()));
        put<std::uint32_t>(body, 16, src->rkey());
        put<std::uint32_t>(body, 20, kCookie);
        if (!p.send(message(2, 0, 0, body))) return;
        std::this_thread::sleep_for(200ms);  // the receiver's READ is out, unanswered
        if (!p.send(with_cookie(9, 0, kCookie))) return;
        if (!p.send(with_cookie(9, 0, kCookie))) return;  // again: answered once
        const auto deadline = std::chrono::steady_clock::now() + 5s;
        while (!done && std::chrono::steady_clock::now() < deadline) {
          auto m = p.receive(50ms);
          if (m && m->size() == 8 && get<std::uint32_t>(std::span<const std::byte>(*m), 4) == kCookie) {
            answers.emplace_back(static_cast<std::uint8_t>((*m)[0]), static_cast<std::uint8_t>((*m)[1]));
          }
        }
      },
      [&](ad::connection& c, hostile_run&) -> awaitable<void> {
        ad::message m = co_await c.async_receive(use_awaitable);
        got.assign(m.data(), m.data() + m.size());
        co_await sleep_for(300ms);  // the answers reach the raw peer

      });
  CHECK(r.raw_ok);
  CHECK(got == source);
  using answer = std::pair<std::uint8_t, std::uint8_t>;
  for (const answer& a : answers) UNSCOPED_INFO("answer type " << int(a.first) << " status " << int(a.second));
  CHECK(answers == std::vector<answer>{{9, 1}, {3, 0}});  // withdraw: too late (once), then fin: ok
}

TEST_CASE("hostile peer: requests it withdraws hold its credits until the answers go, so it cannot queue answers "
          "without end",
          "[runtime]") {
  // It grants us 2 credits, then sends 20 rendezvous requests, each
  // withdrawn at once, and returns no credit: we can answer 2. Each
  // unanswered withdrawal keeps its request's receive, so the credits that
  // come back are the withdraw messages' and the two answered requests'.
  // (On verbs our side takes the peer's messages only at its next liveness
  // tick, up to a second later, while the application has no operation
  // pending: nothing polls the completion queue before. The tcp provider
  // wakes it at once. Hence the windows of a few seconds.)
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  constexpr std::uint32_t kPairs = 20;
  std::atomic<std::uint32_t> fins{0}, returned{0};
  std::string why = "the raw script ran to its end";  // (written by the raw thread, read after the join)
  std::atomic<bool> raw_finished{false};
  const hostile_run r = run_raw(
      io, acc,
      [&](raw_peer& p, std::uint16_t, std::atomic<bool>& done) {
        const auto take = [&](const std::optional<bytes>& m) {
          if (!m || m->size() < 8) return;
          returned += get<std::uint16_t>(std::span<const std::byte>(*m), 2);
          if (static_cast<std::uint8_t>((*m)[0]) == 3 && (*m)[1] == std::byte{4}) ++fins;
        };
        for (std::uint32_t i = 1; i <= kPairs; ++i) {
          bytes body(24);
          put<std::uint64_t>(body, 0, 100);  // (never read)
          put<std::uint32_t>(body, 20, i);
          if (!p.send(message(2, 0, 0, body)) || !p.send(with_cookie(9, 0, i))) {
            why = "a send of pair " + std::to_string(i) + " failed (" + std::to_string(p.sent) + " posted, " +
                  std::to_string(p.sends_done) + " completed)";
            raw_finished = true;
            return;
          }
          take(p.receive(5ms));  // (takes the send completions too)
        }
        // The two answers our credits allow (and no more: the window ends
        // after a tick's worth of quiet).
        auto until = std::chrono::steady_clock::now() + 300ms;
        while (!done && (std::chrono::steady_clock::now() < until || (fins < 2 && std::chrono::steady_clock::now() < until + 2500ms))) {
          take(p.receive(20ms));
        }
        if (!p.send(message(4, 0, 1))) {  // one credit back: one more answer
          why = "the credit message's send failed";
          raw_finished = true;
          return;
        }
        until = std::chrono::steady_clock::now() + 500ms;
        while (!done && (std::chrono::steady_clock::now() < until || (fins < 3 && std::chrono::steady_clock::now() < until + 2500ms))) {
          take(p.receive(20ms));
        }
        raw_finished = true;
      },
      [&](ad::connection& c, hostile_run&) -> awaitable<void> {
        for (int i = 0; i < 800 && c.is_open() && !raw_finished; ++i) co_await sleep_for(10ms);
      });
  INFO(why);
  CHECK(r.raw_ok);
  CHECK(fins == 3);
  INFO("credits returned: " << returned);
  // The receives of the 20 withdraw messages, of the 2 requests answered
  // before the last answer and of the credit message (41 before: a
  // request's receive went back as soon as it was dropped, and the last
  // answer returned them all).
  CHECK(returned <= kPairs + 3);
  CHECK(returned >= 3);
}

TEST_CASE("hostile peer: messages past the credits it was given fail the connection with protocol_error", "[runtime]") {
  // Its receives are re-posted as the application takes its messages, so
  // the provider lets them in; the credits say no. (Taken, a peer that
  // returns none of ours made fins and credit replies queue without bound.)
  asio::io_context io;
  ad::connection_options co;
  co.credits = 8;
  ad::fabric server(io, test_options(co));
  ad::acceptor acc = server.listen(test_host(), 0);
  constexpr std::size_t kSent = 80;
  const hostile_run r = run_hostile(io, acc, [](raw_peer& p, std::uint16_t granted, std::atomic<bool>& done) {
    (void)granted;
    const std::array<std::byte, 4> ping{std::byte{'p'}, std::byte{'i'}, std::byte{'n'}, std::byte{'g'}};
    bool failed = false;
    for (std::size_t i = 0; i < kSent && !failed && !done; ++i) {
      if (!p.send(message(kTypeEager, 0, 0, ping))) break;  // (credits 0 in every header: none returned)
      (void)p.receive(2ms, &failed);                        // (takes what completed)
    }
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (!done && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  });
  CHECK(r.raw_ok);
  INFO("the application took " << r.taken << " messages");
  CHECK(r.ended == ad::errc::protocol_error);
  CHECK(r.taken < kSent);
  CHECK(r.taken >= 8);  // the grant, at least, was honoured
}
