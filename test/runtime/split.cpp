// Split messages (connection_options::eager_split_limit): a message above
// the eager limit sent as consecutive eager pieces, when the credits, send
// queue slots and pool buffers for all of them are there at once; else by
// rendezvous. The receiver assembles the pieces, and refuses pieces that do
// not make one message.
#include "../support/runtime.hpp"

#include <anydoor/anydoor.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <thread>

using namespace anydoor::test;
namespace asio = boost::asio;
namespace ad = anydoor;
using asio::awaitable;
using asio::use_awaitable;

namespace {

std::uint64_t pieces_of(std::size_t n, std::size_t piece) { return (n + piece - 1) / piece; }

// Echoes every message of one connection until the peer closes.
awaitable<void> echo_one(ad::acceptor& acc) {
  ad::connection c = co_await acc.async_accept(use_awaitable);
  for (;;) {
    auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
    if (ec) co_return;
    auto [sec, n] = co_await c.async_send(m.buffer(), asio::as_tuple(use_awaitable));
    if (sec) co_return;
  }
}

// As echo_one, but each message is released before its echo goes out, so
// that the echo returns its receive buffer's credit.
awaitable<void> echo_released(ad::acceptor& acc) {
  ad::connection c = co_await acc.async_accept(use_awaitable);
  for (;;) {
    auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
    if (ec) co_return;
    const std::vector<std::byte> copy(m.bytes().begin(), m.bytes().end());
    m = ad::message();
    auto [sec, n] = co_await c.async_send(asio::buffer(copy), asio::as_tuple(use_awaitable));
    if (sec) co_return;
  }
}

bool same(const ad::message& m, const std::vector<std::byte>& v) {
  return m.size() == v.size() && std::memcmp(m.data(), v.data(), v.size()) == 0;
}

}  // namespace

TEST_CASE_METHOD(fabric_pair,
                 "split messages: above the eager limit and up to eager_split_limit they go as eager pieces - whole and in "
                 "order",
                 "[runtime]") {
  asio::co_spawn(io, echo_one(acc), f.handler());
  // 8192: eager; 65536: the default split limit; 65537: rendezvous.
  const std::vector<std::size_t> sizes = {8193, 12000, 16384, 40000, 65535, 65536, 65537, 100, 20000, 8192};
  int echoed = 0;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    REQUIRE(c.eager_limit() == 8192);
    std::uint64_t pieces = 0, splits = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      INFO(sizes[i]);
      const auto out = pattern(sizes[i], static_cast<std::uint32_t>(i));
      const std::size_t sent = co_await c.async_send(asio::buffer(out), use_awaitable);
      CHECK(sent == sizes[i]);
      ad::message m = co_await c.async_receive(use_awaitable);
      CHECK(same(m, out));
      echoed += same(m, out) ? 1 : 0;
      if (sizes[i] > 8192 && sizes[i] <= 65536) {
        ++splits;
        pieces += pieces_of(sizes[i], 8192);
      }
    }
    const ad::connection_stats s = c.stats();
    CHECK(s.split_sends == splits);
    CHECK(s.split_pieces == pieces);
    CHECK(s.rendezvous_sends == 1);
    CHECK(s.eager_sends == 2);
    CHECK(s.messages_sent == sizes.size());
    CHECK(s.messages_received == sizes.size());
    CHECK(s.rnr_naks == 0);
    // The received split messages' blocks are kept for the next ones.
    CHECK(client.stats().kept_blocks >= 1);
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(echoed == static_cast<int>(sizes.size()));
}

TEST_CASE_METHOD(fabric_pair,
                 "split messages: into a caller's buffer - a larger one is message_size, never truncated, and the next "
                 "arrives",
                 "[runtime]") {
  const auto a = pattern(20000, 1), b = pattern(20000, 2), c3 = pattern(12000, 3);
  int steps = 0;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection s = co_await acc.async_accept(use_awaitable);
    std::vector<std::byte> big(70000), small(10000);
    const std::size_t n1 = co_await s.async_receive(asio::buffer(big), use_awaitable);
    CHECK(n1 == a.size());
    CHECK(std::memcmp(big.data(), a.data(), a.size()) == 0);
    auto [ec, n2] = co_await s.async_receive(asio::buffer(small), asio::as_tuple(use_awaitable));
    CHECK(ec == ad::errc::message_size);
    CHECK(n2 == 0);
    const std::size_t n3 = co_await s.async_receive(asio::buffer(big), use_awaitable);
    CHECK(n3 == c3.size());
    CHECK(std::memcmp(big.data(), c3.data(), c3.size()) == 0);
    steps = 3;
    co_await s.async_send(asio::buffer(small.data(), 1), use_awaitable);
    auto [ec4, m] = co_await s.async_receive(asio::as_tuple(use_awaitable));
    CHECK(ec4 == ad::errc::connection_closed);
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    // All three in flight at once.
    int sent = 0;
    for (const auto* v : {&a, &b, &c3}) {
      c.async_send(asio::buffer(*v), [&](ad::error_code ec, std::size_t) { sent += ec ? 0 : 1; });
    }
    ad::message ack = co_await c.async_receive(use_awaitable);
    CHECK(sent == 3);
    CHECK(c.stats().split_sends == 3);
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(steps == 3);
}

TEST_CASE_METHOD(fabric_pair,
                 "split messages: many in flight, between eager and rendezvous ones, keep their order", "[runtime]") {
  const std::vector<std::size_t> cycle = {100, 9000, 70000, 30000, 8192, 65536, 16385};
  constexpr int kCount = 280;
  int good = 0;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection s = co_await acc.async_accept(use_awaitable);
    for (int i = 0; i < kCount; ++i) {
      ad::message m = co_await s.async_receive(use_awaitable);
      const std::size_t n = cycle[static_cast<std::size_t>(i) % cycle.size()];
      good += same(m, pattern(n, static_cast<std::uint32_t>(i))) ? 1 : 0;
    }
    auto [ec, m] = co_await s.async_receive(asio::as_tuple(use_awaitable));
    CHECK(ec == ad::errc::connection_closed);
  }, f.handler());
  ad::connection_stats st;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    std::vector<std::vector<std::byte>> out;
    for (int i = 0; i < kCount; ++i) {
      out.push_back(pattern(cycle[static_cast<std::size_t>(i) % cycle.size()], static_cast<std::uint32_t>(i)));
    }
    int done = 0, failed = 0;
    for (int i = 0; i < kCount; ++i) {
      c.async_send(asio::buffer(out[static_cast<std::size_t>(i)]), [&](ad::error_code ec, std::size_t) {
        ++done;
        failed += ec ? 1 : 0;
      });
    }
    while (done < kCount) co_await asio::post(co_await asio::this_coro::executor, use_awaitable);
    CHECK(failed == 0);
    st = c.stats();
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io, std::chrono::seconds(60));
  f.check();
  CHECK(good == kCount);
  // Each 70000 by rendezvous; the others of their sizes split when the
  // credits allowed, else by rendezvous too.
  CHECK(st.eager_sends == 80);
  CHECK(st.split_sends + st.rendezvous_sends == 200);
  CHECK(st.rendezvous_sends >= 40);
  CHECK(st.split_sends > 0);
  CHECK(st.rnr_naks == 0);
}

TEST_CASE("split messages: sent by rendezvous when the credits cannot cover every piece, above the option, or beyond "
          "64 pieces",
          "[runtime]") {
  struct run_case {
    const char* what;
    ad::connection_options server;
    ad::connection_options client;
    std::size_t size;
    bool split;
  };
  const std::vector<run_case> cases = {
      {"2 pieces and a credit kept back: 3 of 4 credits", {.credits = 4}, {}, 16384, true},
      {"3 pieces and a credit kept back: 4 of 4 credits", {.credits = 4}, {}, 24576, true},
      {"4 pieces need 5 credits of 4", {.credits = 4}, {}, 24577, false},
      {"5 pieces need 6 credits of 4", {.credits = 4}, {}, 40000, false},
      {"eager_split_limit 0: never", {}, {.eager_split_limit = 0}, 16384, false},
      {"above eager_split_limit", {}, {.eager_split_limit = 20000}, 20001, false},
      {"at eager_split_limit", {}, {.eager_split_limit = 20000}, 20000, true},
      {"64 pieces of 100 bytes", {.credits = 128}, {.eager_limit = 100}, 6400, true},
      {"65 pieces", {.credits = 128}, {.eager_limit = 100}, 6401, false},
      {"the peer's smaller receive buffers make the pieces: 8 KiB pieces, 65 of them", {.credits = 128},
       {.eager_limit = 65536, .eager_split_limit = 16 << 20}, 65 * 8192, false},
      {"16 MiB limit, 64 pieces of 64 KiB", {.credits = 128, .eager_limit = 65536},
       {.eager_limit = 65536, .eager_split_limit = 16 << 20}, 64 << 16, true},
  };
  for (const run_case& rc : cases) {
    INFO(rc.what);
    asio::io_context io;
    ad::fabric server(io, test_options(rc.server));
    ad::fabric client(io, test_options(rc.client));
    ad::acceptor acc = server.listen(test_host(), 0);
    failure f;
    asio::co_spawn(io, echo_released(acc), f.handler());
    ad::connection_stats st;
    bool whole = false;
    asio::co_spawn(io, [&]() -> awaitable<void> {
      ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
      // One round trip first: its reply returns every credit the peer owes
      // (on verbs the connecting side's first message spent one).
      co_await c.async_send(asio::buffer("hi", 2), use_awaitable);
      (void)co_await c.async_receive(use_awaitable);
      const auto out = pattern(rc.size, 7);
      co_await c.async_send(asio::buffer(out), use_awaitable);
      st = c.stats();
      ad::message m = co_await c.async_receive(use_awaitable);
      whole = same(m, out);
      co_await c.async_close(use_awaitable);
    }, f.handler());
    run_to_completion(io);
    f.check();
    CHECK(whole);
    CHECK(st.split_sends == (rc.split ? 1u : 0u));
    CHECK(st.rendezvous_sends == (rc.split ? 0u : 1u));
  }
}

TEST_CASE("split messages: eager_split_limit above 16 MiB is refused", "[runtime]") {
  asio::io_context io;
  CHECK_THROWS_WITH(ad::fabric(io, test_options({.eager_split_limit = (16u << 20) + 1})),
                    Catch::Contains("connection.eager_split_limit must be in 0..16 MiB"));
  CHECK_NOTHROW(ad::fabric(io, test_options({.eager_split_limit = 16u << 20})));
}

namespace {

std::vector<std::byte> raw_message(std::uint8_t type, std::uint32_t aux, std::size_t payload) {
  std::vector<std::byte> m(8 + payload, std::byte{0x5a});
  m[0] = std::byte{type};
  m[1] = std::byte{0};
  m[2] = m[3] = std::byte{0};
  std::memcpy(m.data() + 4, &aux, 4);
  return m;
}

}  // namespace

TEST_CASE("split messages: pieces that do not make one message fail the connection with protocol_error", "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  constexpr std::uint8_t kEager = 1, kRts = 2, kClose = 5, kNotify = 6, kSplit = 8;
  // The server's receive buffers hold 8248 bytes of payload: 64 of them.
  constexpr std::uint32_t kMost = 64 * 8248;
  struct bad {
    const char* what;
    std::vector<std::vector<std::byte>> messages;
  };
  const std::vector<bad> cases = {
      {"a piece of a message of 0 bytes", {raw_message(kSplit, 0, 1)}},
      {"a piece with no payload", {raw_message(kSplit, 100, 0)}},
      {"a message above max_message", {raw_message(kSplit, (1u << 30) + 1, 16)}},
      {"a message above 64 receive buffers", {raw_message(kSplit, kMost + 1, 16)}},
      {"a piece longer than its message", {raw_message(kSplit, 4, 8)}},
      {"a later piece beyond the message", {raw_message(kSplit, 100, 60), raw_message(kSplit, 100, 41)}},
      {"a later piece of another length", {raw_message(kSplit, 100, 50), raw_message(kSplit, 101, 50)}},
      {"an eager message inside a split one", {raw_message(kSplit, 100, 50), raw_message(kEager, 0, 10)}},
      {"a rendezvous request inside a split one", {raw_message(kSplit, 100, 50), raw_message(kRts, 0, 24)}},
      {"a notification inside a split one", {raw_message(kSplit, 100, 50), raw_message(kNotify, 1, 24)}},
      {"a close inside a split one", {raw_message(kSplit, 100, 50), raw_message(kClose, 0, 0)}},
  };
  std::vector<std::vector<std::vector<std::byte>>> sequences;
  for (const bad& b : cases) sequences.push_back(b.messages);
  const raw_judgement r = judge_raw_sequences(io, acc, sequences);
  CHECK(r.raw_ok);
  CHECK(r.left_open == 0);
  REQUIRE(r.ends.size() == cases.size());
  for (std::size_t i = 0; i < cases.size(); ++i) {
    INFO(cases[i].what);
    CHECK(r.ends[i] == ad::errc::protocol_error);
    CHECK(r.messages[i].empty());
  }
}

TEST_CASE("split messages: a peer gone in the middle of one - the receive fails, nothing is delivered", "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options({.keepalive = std::chrono::milliseconds(0)}));
  ad::acceptor acc = server.listen(test_host(), 0);
  ad::error_code got;
  std::size_t size = 99;
  std::atomic<bool> judged{false};
  failure f;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
    got = ec;
    size = m.size();
    judged = true;
  }, f.handler());
  std::atomic<int> raw_failures{0};
  std::thread raw([&] {
    auto dev = open_test_device();
    auto pd = dev->alloc_pd();
    auto cq = dev->create_cq(16);
    auto qp = pd->create_qp({.send_cq = cq.get(), .recv_cq = cq.get()});
    auto res = dev->connect(*qp, test_host(), acc.port(), raw_hello(kWireVersion), std::chrono::seconds(10));
    // Two pieces of a 30000-byte message, then the queue pair is gone.
    std::vector<std::byte> all = raw_message(8, 30000, 8000);
    const auto second = raw_message(8, 30000, 8000);
    all.insert(all.end(), second.begin(), second.end());
    auto mr = pd->register_memory(all.data(), all.size(), tp::access::local_write);
    const std::array<tp::sge, 2> sg = {mr->slice(0, 8008), mr->slice(8008, 8008)};
    const std::array<tp::work_request, 2> wrs = {send_wr(1, {&sg[0], 1}), send_wr(2, {&sg[1], 1})};
    if (res.ec || qp->post_send(wrs)) {
      ++raw_failures;
      return;
    }
    std::array<tp::completion, 8> wc;
    std::error_code ec;
    int completed = 0;
    for (auto t0 = std::chrono::steady_clock::now();
         completed < 2 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10);) {
      completed += static_cast<int>(cq->poll(wc, ec));
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (completed < 2) ++raw_failures;
    qp.reset();  // (gone: the server sees its peer's queue pair end)
  });
  run_to_completion(io, std::chrono::seconds(30));
  raw.join();
  f.check();
  CHECK(raw_failures == 0);
  CHECK(judged);
  CHECK(got);
  CHECK(got != ad::errc::protocol_error);
  CHECK(size == 0);
}

TEST_CASE("split messages: pieces with credits between them, and 64 whole receive buffers' worth, arrive as one message",
          "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  constexpr std::uint8_t kCredit = 4, kSplit = 8;
  constexpr std::uint32_t kPiece = 8248;  // the server's receive buffer's payload
  // [0]: 100 bytes in two pieces with a credit message between them;
  // [1]: 64 full pieces, the most a split message may be.
  std::vector<std::vector<std::byte>> seq0 = {raw_message(kSplit, 100, 60), raw_message(kCredit, 0, 0),
                                              raw_message(kSplit, 100, 40)};
  std::vector<std::vector<std::byte>> seq1;
  for (int i = 0; i < 64; ++i) seq1.push_back(raw_message(kSplit, 64 * kPiece, kPiece));
  for (auto* seq : {&seq0, &seq1}) {
    std::uint32_t k = 0;
    for (auto& m : *seq) {
      if (m[0] != std::byte{kSplit}) continue;
      for (std::size_t i = 8; i < m.size(); ++i) m[i] = static_cast<std::byte>((k++ * 7 + 3) & 0xff);
    }
  }
  const raw_judgement r = judge_raw_sequences(io, acc, {seq0, seq1});
  CHECK(r.raw_ok);
  REQUIRE(r.ends.size() == 2);
  CHECK_FALSE(r.ends[0]);
  CHECK_FALSE(r.ends[1]);
  CHECK(r.messages[0].size() == 100);
  CHECK(r.messages[1].size() == 64 * kPiece);
  for (const auto& m : r.messages) {
    bool right = true;
    for (std::size_t j = 0; j < m.size(); ++j) right = right && m[j] == static_cast<std::byte>((j * 7 + 3) & 0xff);
    CHECK(right);
  }
}

TEST_CASE("split messages: async_receive() refuses one above rendezvous_memory with message_size - a caller's buffer "
          "takes it",
          "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options({.rendezvous_memory = 16384}));
  ad::fabric client(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  const auto big = pattern(20000, 1), fits = pattern(12000, 2), again = pattern(20000, 3);
  int steps = 0;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection s = co_await acc.async_accept(use_awaitable);
    auto [ec, m] = co_await s.async_receive(asio::as_tuple(use_awaitable));
    CHECK(ec == ad::errc::message_size);
    CHECK(m.size() == 0);
    ad::message m2 = co_await s.async_receive(use_awaitable);
    CHECK(same(m2, fits));
    std::vector<std::byte> buf(20000);
    const std::size_t n = co_await s.async_receive(asio::buffer(buf), use_awaitable);
    CHECK(n == again.size());
    CHECK(buf == again);
    steps = 3;
    co_await s.async_send(asio::buffer("k", 1), use_awaitable);
    auto [ec4, m4] = co_await s.async_receive(asio::as_tuple(use_awaitable));
    CHECK(ec4 == ad::errc::connection_closed);
  }, f.handler());
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    for (const auto* v : {&big, &fits, &again}) {
      auto [ec, n] = co_await c.async_send(asio::buffer(*v), asio::as_tuple(use_awaitable));
      CHECK_FALSE(ec);  // (split: the receiver's refusal is its own)
    }
    (void)co_await c.async_receive(use_awaitable);
    CHECK(c.stats().split_sends == 3);
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(steps == 3);
}

TEST_CASE("split messages: with shared receive queues on both sides", "[runtime]") {
  asio::io_context io;
  ad::fabric_options o = test_options();
  o.srq_buffers = 512;
  ad::fabric server(io, o);
  ad::fabric client(io, o);
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  asio::co_spawn(io, echo_one(acc), f.handler());
  const std::vector<std::size_t> cycle = {12000, 30000, 65536, 100, 16384};
  int good = 0;
  ad::connection_stats st;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    for (std::uint32_t i = 0; i < 100; ++i) {
      const auto out = pattern(cycle[i % cycle.size()], i);
      co_await c.async_send(asio::buffer(out), use_awaitable);
      ad::message m = co_await c.async_receive(use_awaitable);
      good += same(m, out) ? 1 : 0;
    }
    st = c.stats();
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io, std::chrono::seconds(60));
  f.check();
  CHECK(good == 100);
  CHECK(st.split_sends > 0);
  CHECK(st.split_sends + st.rendezvous_sends == 80);
  CHECK(st.rnr_naks == 0);
}
