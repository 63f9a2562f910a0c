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

#include <anydoor/transport/types.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <system_error>


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
