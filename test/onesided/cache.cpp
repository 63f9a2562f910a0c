// The registration cache behind one-sided operations on plain buffers
// (runtime/registration_cache.hpp), seen through fabric::stats().cache:
// overlapping registrations merge into one entry, an entry in use by an
// operation is pinned against forget_memory and eviction, the byte limit
// holds, and eviction takes the least recently used entry.
//
// With the tcp provider the target's process makes the progress, so the
// target side waits in a receive while the initiator works (onesided_pair).
#include "../support/onesided.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <optional>

using namespace anydoor::test;
using asio::awaitable;
using asio::use_awaitable;

namespace {

const std::size_t kPage = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));

// `count` pages of memory, page-aligned; at(k) is the start of page k.
struct pages {
  std::vector<std::byte> mem;
  std::byte* base;
  explicit pages(std::size_t count) : mem(pattern((count + 1) * kPage, static_cast<std::uint32_t>(count))) {
    const auto p = (reinterpret_cast<std::uintptr_t>(mem.data()) + kPage - 1) & ~std::uintptr_t{kPage - 1};
    base = reinterpret_cast<std::byte*>(p);
  }
  std::byte* at(std::size_t k) const { return base + k * kPage; }
};

}  // namespace

TEST_CASE("registration cache: overlapping buffers merge into one entry covering both", "[onesided]") {
  onesided_pair p;
  std::vector<std::byte> target(16 * kPage);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write);
  pages src(4);
  // A spans pages 0-1, B pages 1-2 (neither page-aligned): their union is
  // pages 0-2.
  std::byte* a = src.at(0) + 100;
  const std::size_t a_len = 2 * kPage - 200;
  std::byte* b = src.at(1) + 50;
  const std::size_t b_len = 2 * kPage - 100;
  p.run([&](ad::connection& c) -> awaitable<void> {
    co_await c.async_put(asio::buffer(a, a_len), tr.remote(), use_awaitable);
    ad::registration_cache_stats s = p.fa.stats().cache;
    CHECK(s.entries == 1);
    CHECK(s.bytes == 2 * kPage);
    co_await c.async_put(asio::buffer(b, b_len), tr.remote(), use_awaitable);
    s = p.fa.stats().cache;
    CHECK(s.misses == 2);
    CHECK(s.registrations == 2);
    CHECK(s.entries == 1);          // one entry: A's was merged into the new one, not kept beside it
    CHECK(s.bytes == 3 * kPage);    // the union, in whole pages
    CHECK(s.deregistrations == 1);  // A's own registration went
    // the union, and A and B again, are hits
    co_await c.async_put(asio::buffer(a, static_cast<std::size_t>(b + b_len - a)), tr.remote(), use_awaitable);
    co_await c.async_put(asio::buffer(a, a_len), tr.remote(), use_awaitable);
    co_await c.async_put(asio::buffer(b, b_len), tr.remote(), use_awaitable);
    s = p.fa.stats().cache;
    CHECK(s.hits == 3);
    CHECK(s.misses == 2);
    CHECK(s.entries == 1);
  });
  CHECK(std::memcmp(target.data(), b, b_len) == 0);  // the last put's data
}

TEST_CASE("registration cache: an entry in use is deregistered neither by forget_memory nor by eviction "
          "until its operation completes",
          "[onesided]") {
  ad::fabric_options o = test_options();
  o.cache_max_entries = 2;
  // With tcp the target answers the get at once (its fabric watches for
  // requests while idle): every batch of frames waits 150 ms before it is
  // sent (fault injection, both sides), so the get stays in flight while
  // this side's io_context runs.
  if (testing_tcp()) REQUIRE(::setenv("ANYDOOR_TCP_FAULTS", "delay=150", 1) == 0);
  std::optional<onesided_pair> pair;
  try {
    pair.emplace(o);
  } catch (...) {
    ::unsetenv("ANYDOOR_TCP_FAULTS");
    throw;
  }
  ::unsetenv("ANYDOOR_TCP_FAULTS");
  onesided_pair& p = *pair;
  std::vector<std::byte> target = pattern(4 * kPage, 7);
  ad::memory_region tr =
      p.fb.register_memory(target, ad::access::local_write | ad::access::remote_read | ad::access::remote_write);
  pages local(10);  // buffers at pages 0 (two pages), 2, 4, 6 and 8: separate entries
  failure f;
  // b waits in a receive for the final "done".
  auto target_side = [&]() -> awaitable<void> {
    auto [ec, m] = co_await p.b.async_receive(asio::as_tuple(use_awaitable));
    CHECK_FALSE(ec);
  };
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    ad::connection& c = p.a;
    asio::steady_timer t(p.io);
    // 1. forget_memory while a get into the buffer is in flight.
    bool done = false;
    ad::error_code get_ec;
    std::size_t got = 0;
    std::uint64_t deregs_at_completion = 0;
    c.async_get(asio::buffer(local.at(0), 2 * kPage), tr.remote().at(0, 2 * kPage),
                [&](ad::error_code ec, std::size_t n) {
                  get_ec = ec;
                  got = n;
                  deregs_at_completion = p.fa.stats().cache.deregistrations;
                  done = true;
                });
    CHECK(p.fa.stats().cache.entries == 1);  // pinned by the get, which has not completed
    CHECK(p.fa.forget_memory(local.at(0), 2 * kPage) == 1);
    ad::registration_cache_stats s = p.fa.stats().cache;
    CHECK(s.invalidations == 1);
    CHECK(s.deregistrations == 0);  // still in use: kept until the get completes
    CHECK(s.entries == 1);
    if (testing_tcp()) {
      // The frames wait: the get stays in flight a while.
      t.expires_after(std::chrono::milliseconds(50));
      co_await t.async_wait(use_awaitable);
      CHECK_FALSE(done);
      CHECK(p.fa.stats().cache.deregistrations == 0);
    }
    asio::co_spawn(p.io, target_side(), f.handler());
    while (!done) {
      t.expires_after(std::chrono::milliseconds(1));
      co_await t.async_wait(use_awaitable);
    }
    CHECK_FALSE(get_ec);
    CHECK(got == 2 * kPage);
    CHECK(std::memcmp(local.at(0), target.data(), 2 * kPage) == 0);  // the data landed, in the right place
    CHECK(deregs_at_completion == 1);  // deregistered as the operation ended, before its handler
    s = p.fa.stats().cache;
    CHECK(s.deregistrations == 1);
    CHECK(s.entries == 0);
    CHECK(s.bytes == 0);

    // 2. eviction while a get is in flight; room for two entries.
    co_await c.async_put(asio::buffer(local.at(2), kPage), tr.remote(), use_awaitable);  // Y, unpinned
    done = false;
    c.async_get(asio::buffer(local.at(4), kPage), tr.remote().at(kPage, kPage),
                [&](ad::error_code ec, std::size_t n) {
                  get_ec = ec;
                  got = n;
                  done = true;
                });  // E, pinned; Y is now the least recently used
    const std::uint64_t before = p.fa.stats().cache.deregistrations;
    // Z: a third entry; Y (unpinned) goes to make room.
    c.async_put(asio::buffer(local.at(6), kPage), tr.remote(), [](ad::error_code ec, std::size_t) { CHECK_FALSE(ec); });
    s = p.fa.stats().cache;
    CHECK(s.evictions == 1);
    CHECK(s.deregistrations == before + 1);
    // W: a third entry again; E is the least recently used now, but pinned,
    // as is Z: nothing can go, the cache is over its limit for now.
    bool w_done = false;
    c.async_put(asio::buffer(local.at(8), kPage), tr.remote(), [&](ad::error_code ec, std::size_t) {
      CHECK_FALSE(ec);
      w_done = true;
    });
    s = p.fa.stats().cache;
    CHECK(s.evictions == 1);
    CHECK(s.deregistrations == before + 1);
    CHECK(s.entries == 3);
    CHECK_FALSE(done);
    while (!done || !w_done) {
      t.expires_after(std::chrono::milliseconds(1));
      co_await t.async_wait(use_awaitable);
    }
    CHECK_FALSE(get_ec);
    CHECK(got == kPage);
    CHECK(std::memcmp(local.at(4), target.data() + kPage, kPage) == 0);
    s = p.fa.stats().cache;
    CHECK(s.entries <= 2);  // back within the limit once the operations ended
    co_await c.async_send(asio::buffer("done", 4), use_awaitable);
  }, f.handler());
  run_to_completion(p.io);
  f.check();
}

TEST_CASE("registration cache: cache_max_bytes bounds the bytes registered", "[onesided]") {
  ad::fabric_options o = test_options();
  o.cache_max_bytes = 3 * kPage;
  onesided_pair p(o);
  std::vector<std::byte> target(8 * kPage);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write);
  pages src(16);
  p.run([&](ad::connection& c) -> awaitable<void> {
    co_await c.async_put(asio::buffer(src.at(0), 2 * kPage), tr.remote(), use_awaitable);  // A: 2 pages
    co_await c.async_put(asio::buffer(src.at(3), kPage), tr.remote(), use_awaitable);      // B: 1 page
    ad::registration_cache_stats s = p.fa.stats().cache;
    CHECK(s.bytes == 3 * kPage);  // at the limit, not beyond
    CHECK(s.evictions == 0);
    co_await c.async_put(asio::buffer(src.at(5), kPage), tr.remote(), use_awaitable);  // C: 1 page; A must go
    s = p.fa.stats().cache;
    CHECK(s.evictions == 1);
    CHECK(s.entries == 2);
    CHECK(s.bytes == 2 * kPage);
    CHECK(s.bytes <= 3 * kPage);
    co_await c.async_put(asio::buffer(src.at(0), 2 * kPage), tr.remote(), use_awaitable);  // A again: a miss
    s = p.fa.stats().cache;
    CHECK(s.misses == 4);
    CHECK(s.bytes <= 3 * kPage);
    // A buffer larger than the limit is registered for its operation and
    // does not stay.
    co_await c.async_put(asio::buffer(src.at(8), 5 * kPage), tr.remote(), use_awaitable);
    s = p.fa.stats().cache;
    CHECK(s.bytes <= 3 * kPage);
    CHECK(s.deregistrations == s.registrations - s.entries);
  });
}

TEST_CASE("registration cache: eviction takes the least recently used entry", "[onesided]") {
  ad::fabric_options o = test_options();
  o.cache_max_entries = 2;
  onesided_pair p(o);
  std::vector<std::byte> target(4 * kPage);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write);
  pages src(6);
  std::byte* buf_a = src.at(0);
  std::byte* buf_b = src.at(2);
  std::byte* buf_c = src.at(4);
  p.run([&](ad::connection& c) -> awaitable<void> {
    auto put = [&](std::byte* buf) { return c.async_put(asio::buffer(buf, kPage), tr.remote(), use_awaitable); };
    co_await put(buf_a);  // miss
    co_await put(buf_b);  // miss
    co_await put(buf_a);  // hit: A is now the most recently used, B the least
    ad::registration_cache_stats s = p.fa.stats().cache;
    CHECK(s.hits == 1);
    CHECK(s.misses == 2);
    co_await put(buf_c);  // C, a miss: one entry must go, and it is B
    s = p.fa.stats().cache;
    CHECK(s.evictions == 1);
    CHECK(s.entries == 2);
    co_await put(buf_a);  // still there
    s = p.fa.stats().cache;
    CHECK(s.hits == 2);
    CHECK(s.misses == 3);
    co_await put(buf_b);  // gone
    s = p.fa.stats().cache;
    CHECK(s.hits == 2);
    CHECK(s.misses == 4);
  });
}
