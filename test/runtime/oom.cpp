// Out of memory on the send path: a connection that cannot get a doorbell
// batch (the staging of its next post) fails with not_enough_memory at
// once, with every operation waiting on it, instead of waiting for good
// (nothing posted would ever bring it back to try again). The fabric
// carries on: a new connection works once memory is back.
//
// operator new is replaced in this binary (support/replaced_new.hpp):
// while `fail_size` is set on this thread, an allocation of exactly that
// many bytes throws std::bad_alloc. The size is that of a batch's work-request array for a
// send queue of an unusual length (kQueue), so nothing else in these tests
// asks for it. (Not under sanitizers: they replace operator new.)
#include "../support/onesided.hpp"
#include "../support/replaced_new.hpp"
#include "../support/runtime.hpp"

#include <anydoor/detail/op_node.hpp>
#include <anydoor/transport/types.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <system_error>
#include <thread>


using namespace anydoor::test;
using boost::asio::awaitable;
using boost::asio::use_awaitable;

namespace {

constexpr std::uint32_t kQueue = 37;  // a send queue no other allocation matches
constexpr std::size_t kBatchSize = kQueue * sizeof(anydoor::transport::work_request);

ad::fabric_options oom_options() {
  ad::connection_options c;
  c.send_queue = kQueue;
  c.signal_interval = 8;
  return test_options(c);
}

// Allocations of a batch's size fail while one lives on this thread.
struct no_batches {
  no_batches() {
    anydoor::test::alloc::fail_size = kBatchSize;
    anydoor::test::alloc::refused = 0;
  }
  ~no_batches() { anydoor::test::alloc::fail_size = 0; }
  no_batches(const no_batches&) = delete;
  no_batches& operator=(const no_batches&) = delete;
};

const std::error_code kNoMemory = std::make_error_code(std::errc::not_enough_memory);

}  // namespace

TEST_CASE("no memory for a doorbell batch: sends fail with not_enough_memory at once and a new connection works",
          "[runtime][oom]") {
  asio::io_context io;
  ad::fabric server(io, test_options());  // (its batches are of another size)
  ad::fabric client(io, oom_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  std::vector<std::size_t> received;  // sizes the server got, in order
  std::error_code first_end, second_end;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    for (std::error_code* end : {&first_end, &second_end}) {
      ad::connection s = co_await acc.async_accept(use_awaitable);
      for (;;) {
        auto [ec, m] = co_await s.async_receive(asio::as_tuple(use_awaitable));
        if (ec) {
          *end = ec;
          break;
        }
        received.push_back(m.size());
      }
    }
  }, f.handler());
  std::error_code e1, e2, e3, after;
  std::uint64_t refused = 0;
  bool open_after = true;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect(addr(acc), use_awaitable);
    const auto small = pattern(64, 1), large = pattern(100000, 2);
    {
      no_batches guard;
      const auto t0 = std::chrono::steady_clock::now();
      // Two sends waiting together (an eager one and a rendezvous one):
      // both end with the error, neither arrives.
      std::size_t done = 0;
      c.async_send(asio::buffer(small), [&](ad::error_code ec, std::size_t) {
        e1 = ec;
        ++done;
      });
      c.async_send(asio::buffer(large), [&](ad::error_code ec, std::size_t) {
        e2 = ec;
        ++done;
      });
      const bool ended = co_await until([&] { return done == 2; }, std::chrono::seconds(5), std::chrono::milliseconds(1));
      CHECK(ended);
      CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1));  // at once, not after a timeout
      refused = anydoor::test::alloc::refused;
    }
    // The connection is failed: a later send gets the same error.
    auto [ec3, n3] = co_await c.async_send(asio::buffer(small), asio::as_tuple(use_awaitable));
    e3 = ec3;
    CHECK(n3 == 0);
    open_after = c.is_open();
    // Memory is back: a new connection on the same fabrics carries data.
    ad::connection c2 = co_await client.async_connect(addr(acc), use_awaitable);
    auto [ec4, n4] = co_await c2.async_send(asio::buffer(small), asio::as_tuple(use_awaitable));
    after = ec4;
    CHECK(n4 == small.size());
    co_await c2.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io, std::chrono::seconds(30));
  f.check();
  CHECK(refused >= 1);  // the batch's allocation was really refused
  CHECK(e1 == kNoMemory);
  CHECK(e2 == kNoMemory);
  CHECK(e3 == kNoMemory);
  CHECK_FALSE(open_after);
  CHECK_FALSE(after);
  // Only the second connection's message arrived; the first connection's
  // end reached the server (no hang there either).
  REQUIRE(received.size() == 1);
  CHECK(received[0] == 64);
  CHECK(first_end);
  CHECK(second_end == ad::errc::connection_closed);
  bool counted = false;
  for (const ad::failure_count& fc : client.failure_counts()) counted |= fc.error == kNoMemory && fc.count == 1;
  CHECK(counted);
}

TEST_CASE("no memory for a doorbell batch: a put fails with not_enough_memory and nothing lands", "[runtime][oom]") {
  onesided_pair p(oom_options());
  std::vector<std::byte> target(4096, std::byte{0});
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write);
  const auto data = pattern(4096, 3);
  std::error_code put_ec, atomic_ec;
  std::uint64_t refused = 0;
  p.run([&](ad::connection& c) -> awaitable<void> {
    no_batches guard;
    auto [ec, n] = co_await c.async_put(asio::buffer(data), tr.remote(), asio::as_tuple(use_awaitable));
    put_ec = ec;
    CHECK(n == 0);
    refused = anydoor::test::alloc::refused;
  });
  CHECK(refused >= 1);
  CHECK(put_ec == kNoMemory);
  CHECK(std::all_of(target.begin(), target.end(), [](std::byte b) { return b == std::byte{0}; }));
}

// The memory of rendezvous messages that async_receive delivers is kept
// when a message is released and taken by the next one it fits (the
// registration with it): a stream of large messages allocates no block
// after the first. Counted by the size of a block (whole pages).
namespace {
constexpr std::size_t block_of(std::size_t n) { return (n + 4095) & ~std::size_t{4095}; }

struct watch {
  explicit watch(std::size_t n) {
    anydoor::test::alloc::watch_size = n;
    anydoor::test::alloc::watched = 0;
  }
  ~watch() { anydoor::test::alloc::watch_size = 0; }
  watch(const watch&) = delete;
  watch& operator=(const watch&) = delete;
  std::uint64_t count() const noexcept { return anydoor::test::alloc::watched; }
};

// A connection from `client` to `acc`: the client's end into c, the
// accepted end returned.
awaitable<ad::connection> connect_pair(ad::fabric& client, ad::acceptor& acc, ad::connection& c) {
  client.async_connect(addr(acc), [&](ad::error_code, ad::connection made) { c = std::move(made); });
  ad::connection s = co_await acc.async_accept(use_awaitable);
  const bool connected = co_await until([&] { return c.is_open(); });
  REQUIRE(connected);
  co_return s;
}

template <class... N>
std::vector<std::size_t> sizes_of(N... n) {
  return {static_cast<std::size_t>(n)...};
}

// Sends `sizes` (in order) on c, then receives them all on s, holding every
// one until the last has come: checks each message's bytes.
awaitable<bool> exchange_held(ad::connection& c, ad::connection& s, std::uint32_t& seed,
                              std::vector<std::size_t> sizes) {
  std::vector<std::vector<std::byte>> sent;
  for (std::size_t n : sizes) sent.push_back(pattern(n, ++seed));
  std::size_t sends_done = 0;
  bool send_failed = false;
  for (const auto& b : sent) {
    c.async_send(asio::buffer(b), [&](ad::error_code ec, std::size_t) {
      send_failed |= static_cast<bool>(ec);
      ++sends_done;
    });
  }
  std::vector<ad::message> held;
  for (const auto& b : sent) {
    auto [ec, m] = co_await s.async_receive(asio::as_tuple(use_awaitable));
    if (ec || m.size() != b.size() || !std::equal(b.begin(), b.end(), m.bytes().begin())) co_return false;
    held.push_back(std::move(m));
  }
  const bool sends_ended = co_await until([&] { return sends_done == sent.size(); });
  co_return sends_ended && !send_failed;
}
}  // namespace

TEST_CASE("rendezvous messages: a released message's block is taken by the next one that fits - freed when unused",
          "[runtime][oom]") {
  int scenario = 0;
  SECTION("one at a time: one block") { scenario = 1; }
  SECTION("held at once: a block each, all kept, a smaller message takes one") { scenario = 2; }
  SECTION("a small message does not take a far larger block") { scenario = 3; }
  SECTION("blocks above 2 MiB are not kept") { scenario = 4; }
  SECTION("at most 8 blocks are kept") { scenario = 5; }
  SECTION("a message released on another thread frees its block") { scenario = 6; }
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::fabric client(io, test_options({.eager_split_limit = 0}));  // (not split: test/runtime/split.cpp)
  ad::acceptor acc = server.listen(test_host(), 0);
  failure f;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c;
    ad::connection s = co_await connect_pair(client, acc, c);
    REQUIRE(c.eager_limit() < 12000);  // every size below is a rendezvous message
    std::uint32_t seed = 0;
    auto exchange = [&](std::vector<std::size_t> sizes) { return exchange_held(c, s, seed, std::move(sizes)); };
    bool ok = true;
    if (scenario == 1) {
      watch w(block_of(20000));
      ok = co_await exchange(sizes_of(300000));  // a block the 20000-byte messages never take
      CHECK(ok);
      for (int i = 0; i < 10 && ok; ++i) ok = co_await exchange(sizes_of(20000));
      CHECK(ok);
      CHECK(w.count() == 1);
      CHECK(server.stats().kept_blocks == 2);
      CHECK(server.stats().kept_bytes == block_of(20000) + block_of(300000));
      // In use now and then for longer than the quiet time (2 to 3 s): kept;
      // the other block, unused meanwhile, is freed.
      asio::steady_timer pause(co_await asio::this_coro::executor);
      for (int i = 0; i < 40 && ok; ++i) {
        pause.expires_after(std::chrono::milliseconds(100));
        co_await pause.async_wait(use_awaitable);
        ok = co_await exchange(sizes_of(20000));
      }
      CHECK(ok);
      CHECK(w.count() == 1);
      CHECK(server.stats().kept_blocks == 1);
      CHECK(server.stats().kept_bytes == block_of(20000));
      // Unused: freed within a few seconds.
      const bool freed = co_await until([&] { return server.stats().kept_blocks == 0; }, std::chrono::seconds(8));
      CHECK(freed);
      CHECK(server.stats().kept_bytes == 0);
      ok = co_await exchange(sizes_of(20000));
      CHECK(ok);
      CHECK(w.count() == 2);
    } else if (scenario == 2) {
      {
        watch w(block_of(20000));
        ok = co_await exchange(sizes_of(20000, 20000, 20000));
        CHECK(ok);
        CHECK(w.count() == 3);
        ok = co_await exchange(sizes_of(20000, 20000, 20000));
        CHECK(ok);
        CHECK(w.count() == 3);
      }
      // Into a kept 20 KiB block (over an older message's bytes): exactly its own.
      watch w(block_of(12000));
      ok = co_await exchange(sizes_of(12000, 12000));
      CHECK(ok);
      CHECK(w.count() == 0);
    } else if (scenario == 3) {
      ok = co_await exchange(sizes_of(300000));
      CHECK(ok);
      {
        watch w(block_of(20000));
        for (int i = 0; i < 3 && ok; ++i) ok = co_await exchange(sizes_of(20000));
        CHECK(ok);
        CHECK(w.count() == 1);
      }
      watch again(block_of(300000));
      ok = co_await exchange(sizes_of(300000));
      CHECK(ok);
      CHECK(again.count() == 0);  // kept, and taken by its own size
    } else if (scenario == 4) {
      const std::size_t big = (std::size_t{3} << 20) + 100;
      watch w(block_of(big));
      for (int i = 0; i < 2 && ok; ++i) ok = co_await exchange(sizes_of(big));
      CHECK(ok);
      CHECK(w.count() == 2);
      CHECK(server.stats().kept_blocks == 0);
      CHECK(server.stats().kept_bytes == 0);
    } else if (scenario == 5) {
      // Ten held at once, released: eight kept; ten again need two more.
      watch w(block_of(22000));
      ok = co_await exchange(std::vector<std::size_t>(10, 22000));
      CHECK(ok);
      CHECK(w.count() == 10);
      CHECK(server.stats().kept_blocks == 8);
      CHECK(server.stats().kept_bytes == 8 * block_of(22000));
      ok = co_await exchange(std::vector<std::size_t>(10, 22000));
      CHECK(ok);
      CHECK(w.count() == 12);
    } else if (scenario == 6) {
      // A message released on another thread: its block is freed there
      // (the fabric's lists are its own thread's), not kept.
      const auto b = pattern(20000, 7);
      c.async_send(asio::buffer(b), [](ad::error_code, std::size_t) {});
      auto [ec, m] = co_await s.async_receive(asio::as_tuple(use_awaitable));
      REQUIRE_FALSE(ec);
      REQUIRE(m.size() == b.size());
      std::thread([held = std::move(m)]() mutable { held = ad::message{}; }).join();
      CHECK(server.stats().kept_blocks == 0);
      ok = co_await exchange(sizes_of(20000));  // and the next one is whole
      CHECK(ok);
      CHECK(server.stats().kept_blocks == 1);
    }
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io, std::chrono::seconds(60));
  f.check();
}

// No memory for the holder a delivered rendezvous message needs: the
// receive fails with not_enough_memory, the sender hears that the peer ran
// out of memory, and the connection carries the next message.
namespace {

// One message of `size` bytes sent from `client` while the receiving side
// (accepted from `acc`) cannot allocate `refuse` bytes, then another one.
struct refused_delivery {
  std::error_code recv_ec, send_ec, after_recv, after_send;
  std::uint64_t refused = 0;
  bool after_ok = false;
  ad::connection_stats sender;
};

refused_delivery deliver_refusing(asio::io_context& io, ad::fabric& client, ad::acceptor& acc, std::size_t size,
                                  std::size_t refuse) {
  refused_delivery r;
  failure f;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c;
    ad::connection s = co_await connect_pair(client, acc, c);
    const auto small = pattern(64, 1), large = pattern(size, 2);
    // Operation nodes for what follows, made before memory runs out (eight
    // sends in flight at once), and back in the fabric's list.
    int warm_sends = 0;
    for (int i = 0; i < 8; ++i) c.async_send(asio::buffer(small), [&](ad::error_code, std::size_t) { ++warm_sends; });
    for (int i = 0; i < 8; ++i) {
      auto [re, rm] = co_await s.async_receive(asio::as_tuple(use_awaitable));
      REQUIRE_FALSE(re);
    }
    const bool warm = co_await until([&] { return warm_sends == 8; });
    REQUIRE(warm);
    co_await asio::post(co_await asio::this_coro::executor, use_awaitable);
    {
      anydoor::test::alloc::refused = 0;
      anydoor::test::alloc::fail_size = refuse;
      bool sent = false;
      c.async_send(asio::buffer(large), [&](ad::error_code ec, std::size_t) {
        r.send_ec = ec;
        sent = true;
      });
      auto [re, rm] = co_await s.async_receive(asio::as_tuple(use_awaitable));
      r.recv_ec = re;
      CHECK(rm.size() == 0);
      const bool ended = co_await until([&] { return sent; });
      CHECK(ended);
      anydoor::test::alloc::fail_size = 0;
      r.refused = anydoor::test::alloc::refused;
    }
    c.async_send(asio::buffer(large), [&](ad::error_code ec, std::size_t) { r.after_send = ec; });
    auto [re, rm] = co_await s.async_receive(asio::as_tuple(use_awaitable));
    r.after_recv = re;
    r.after_ok = rm.size() == large.size() && std::equal(large.begin(), large.end(), rm.bytes().begin());
    r.sender = c.stats();
    co_await c.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(io, std::chrono::seconds(30));
  anydoor::test::alloc::fail_size = 0;
  f.check();
  return r;
}

}  // namespace

TEST_CASE("rendezvous messages: no memory to deliver one fails that message on both sides and nothing else",
          "[runtime][oom]") {
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::fabric client(io, test_options({.eager_split_limit = 0}));
  ad::acceptor acc = server.listen(test_host(), 0);
  const refused_delivery r = deliver_refusing(io, client, acc, 50000, sizeof(anydoor::detail::op_node));
  CHECK(r.refused >= 1);
  CHECK(r.recv_ec == kNoMemory);
  CHECK(r.send_ec == ad::errc::peer_out_of_memory);
  CHECK_FALSE(r.after_recv);
  CHECK_FALSE(r.after_send);
  CHECK(r.after_ok);
  CHECK(r.sender.rendezvous_sends == 2);
}

TEST_CASE("split messages: no memory for the block or the holder fails that message at the receiver and nothing else",
          "[runtime][oom]") {
  std::size_t refuse = 0;
  SECTION("the block") { refuse = block_of(20000); }
  SECTION("the holder") { refuse = sizeof(anydoor::detail::op_node); }
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::fabric client(io, test_options());
  ad::acceptor acc = server.listen(test_host(), 0);
  const refused_delivery r = deliver_refusing(io, client, acc, 20000, refuse);
  CHECK(r.refused >= 1);
  CHECK(r.recv_ec == kNoMemory);
  CHECK_FALSE(r.send_ec);  // (a split send completes once its pieces are handed over, as an eager one)
  CHECK_FALSE(r.after_recv);
  CHECK_FALSE(r.after_send);
  CHECK(r.after_ok);
  CHECK(r.sender.split_sends == 2);
}
