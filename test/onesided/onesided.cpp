// One-sided operations on a real provider (ANYDOOR_TEST_PROVIDER): memory
// regions and their remote descriptors, put/get (through a region and
// through the registration cache, scatter-gather), atomics, put with
// notification, flush, the registration cache, and remote access errors
// under RC rules. Every test drives io.run() to its natural end under a
// watchdog.
//
// With the tcp provider the target's process makes the progress, so the
// target side of each test waits in a receive while the initiator works.
#include "../support/onesided.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

using namespace anydoor::test;
using asio::awaitable;
using asio::use_awaitable;

namespace {

bool atomics_supported(const ad::fabric& f) {
  return const_cast<ad::fabric&>(f).device().caps().atomics;
}

}  // namespace

TEST_CASE("remote_region: at() is bounds-checked: pack and unpack round-trip and reject garbage", "[onesided]") {
  const ad::remote_region r{0x7f0000001000, 4096, 0x1234};
  CHECK(r.at(0, 4096) == r);
  CHECK(r.at(100, 10) == ad::remote_region{0x7f0000001064, 10, 0x1234});
  CHECK(r.at(4096, 0).length == 0);
  auto code = [&](std::uint64_t off, std::uint64_t len) { return thrown([&] { (void)r.at(off, len); }); };
  CHECK(code(4097, 0) == ad::errc::out_of_range);
  CHECK(code(4000, 97) == ad::errc::out_of_range);
  CHECK(code(1, ~std::uint64_t{0}) == ad::errc::out_of_range);  // no wrap-around

  auto packed = r.pack();
  ad::remote_region back;
  REQUIRE_FALSE(ad::remote_region::unpack(packed, back));
  CHECK(back == r);

  ad::remote_region untouched{1, 2, 3};
  CHECK(ad::remote_region::unpack(std::span(packed).first(31), untouched) == ad::errc::protocol_error);
  std::vector<std::byte> longer(packed.begin(), packed.end());
  longer.push_back(std::byte{0});
  CHECK(ad::remote_region::unpack(longer, untouched) == ad::errc::protocol_error);
  auto bad = packed;
  bad[0] = std::byte{'X'};  // magic
  CHECK(ad::remote_region::unpack(bad, untouched) == ad::errc::protocol_error);
  bad = packed;
  bad[9] ^= std::byte{1};  // a flipped bit in addr: the check fails
  CHECK(ad::remote_region::unpack(bad, untouched) == ad::errc::protocol_error);
  bad = packed;
  bad[4] = std::byte{3};  // another version, sealed
  reseal(bad);
  CHECK(ad::remote_region::unpack(bad, untouched) == ad::errc::version_mismatch);
  bad = packed;
  bad[6] = std::byte{1};  // reserved, sealed
  reseal(bad);
  CHECK(ad::remote_region::unpack(bad, untouched) == ad::errc::protocol_error);
  CHECK(ad::remote_region::unpack(ad::remote_region{0x1000, 0, 1}.pack(), untouched) == ad::errc::protocol_error);
  CHECK(ad::remote_region::unpack(ad::remote_region{~std::uint64_t{0} - 10, 100, 1}.pack(), untouched) ==
        ad::errc::protocol_error);
  std::array<std::byte, 32> zeros{};
  CHECK(ad::remote_region::unpack(zeros, untouched) == ad::errc::protocol_error);
  CHECK(untouched == ad::remote_region{1, 2, 3});  // unchanged on every error
}

TEST_CASE("memory_region: exactly the requested access, bounds-checked ranges, deregistration", "[onesided]") {
  asio::io_context io;
  ad::fabric fab(io, test_options());
  std::vector<std::byte> buf(8192);
  for (const ad::access acc : {ad::access::none, ad::access::local_write, ad::access::remote_read,
                               ad::access::remote_write | ad::access::local_write,
                               ad::access::remote_atomic | ad::access::remote_write | ad::access::local_write}) {
    ad::memory_region mr = fab.register_memory(buf, acc);
    CHECK(mr.access() == acc);
    CHECK(mr.data() == buf.data());
    CHECK(mr.size() == buf.size());
    const ad::remote_region r = mr.remote();
    CHECK(r.addr == reinterpret_cast<std::uint64_t>(buf.data()));
    CHECK(r.length == buf.size());
    CHECK(r.rkey == mr.rkey());
  }
  ad::memory_region mr = fab.register_memory(buf, ad::access::local_write);
  const ad::local_range part = mr.at(100, 200);
  CHECK(part.data() == buf.data() + 100);
  CHECK(part.size() == 200);
  CHECK(part.region() == &mr);
  auto code = [&](std::size_t off, std::size_t len) { return thrown([&] { (void)mr.at(off, len); }); };
  CHECK(code(8192, 1) == ad::errc::out_of_range);
  CHECK(code(1, 8192) == ad::errc::out_of_range);
  CHECK_FALSE(code(8192, 0));
  ad::memory_region moved = std::move(mr);
  CHECK_FALSE(mr);  // NOLINT(bugprone-use-after-move): moved-from is empty
  CHECK(moved);
  moved.reset();
  CHECK_FALSE(moved);
  CHECK(moved.size() == 0);
  CHECK(thrown([&] { (void)fab.register_memory({}, ad::access::local_write); }) == ad::errc::invalid_argument);
}

TEST_CASE("put and get move data both ways, 8 B to 4 MiB, through regions and through the cache", "[onesided]") {
  onesided_pair p;
  const std::size_t max = std::size_t{4} << 20;
  std::vector<std::byte> target(max + 64);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write | ad::access::remote_read);
  // The target's descriptor travels as a message, as in a real program.
  std::vector<std::byte> local(max);
  ad::memory_region lr = p.fa.register_memory(local, ad::access::local_write);
  const std::vector<std::size_t> sizes = {8, 64, 4096, 65536 + 3, std::size_t{1} << 20, max};
  p.run([&](ad::connection& c) -> awaitable<void> {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const std::size_t n = sizes[i];
      const auto data = pattern(n, static_cast<std::uint32_t>(i));
      const ad::remote_region dst = tr.remote().at(i, n);  // odd offsets too
      // put from a plain buffer (the cache), get into a region
      const auto r1 = co_await c.async_put(asio::buffer(data), dst, use_awaitable);
      CHECK(r1 == n);
      CHECK(std::memcmp(target.data() + i, data.data(), n) == 0);
      std::memset(local.data(), 0, n);
      const auto r2 = co_await c.async_get(lr.at(0, n), dst, use_awaitable);
      CHECK(r2 == n);
      CHECK(std::memcmp(local.data(), data.data(), n) == 0);
      // put from a region, get into a plain buffer (the cache)
      const auto data2 = pattern(n, static_cast<std::uint32_t>(100 + i));
      std::memcpy(local.data(), data2.data(), n);
      const auto r3 = co_await c.async_put(lr.at(0, n), dst, use_awaitable);
      CHECK(r3 == n);
      CHECK(std::memcmp(target.data() + i, data2.data(), n) == 0);
      std::vector<std::byte> back(n);
      const auto r4 = co_await c.async_get(asio::buffer(back), dst, use_awaitable);
      CHECK(r4 == n);
      CHECK(back == data2);
    }
    // A zero-length put completes at once.
    const auto r5 = co_await c.async_put(asio::buffer(local.data(), 0), tr.remote(), use_awaitable);
    CHECK(r5 == 0);
    const ad::connection_stats s = c.stats();
    CHECK(s.puts == 2 * sizes.size());
    CHECK(s.gets == 2 * sizes.size());
    CHECK(s.bytes_put == 2 * std::accumulate(sizes.begin(), sizes.end(), std::uint64_t{0}));
  });
  CHECK(p.a.is_open());
}

TEST_CASE("scatter-gather: a put gathers several local ranges, a get scatters into several", "[onesided]") {
  onesided_pair p;
  std::vector<std::byte> target(4096);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write | ad::access::remote_read);
  const auto x = pattern(100, 1), y = pattern(3000, 2), z = pattern(7, 3);
  p.run([&](ad::connection& c) -> awaitable<void> {
    const std::array<ad::local_range, 4> pieces{asio::buffer(x), asio::buffer(y), asio::const_buffer(), asio::buffer(z)};
    const auto r6 =
        co_await c.async_put(std::span<const ad::local_range>(pieces), tr.remote().at(10, 3107), use_awaitable);
    CHECK(r6 == 3107);
    CHECK(std::memcmp(target.data() + 10, x.data(), 100) == 0);
    CHECK(std::memcmp(target.data() + 110, y.data(), 3000) == 0);
    CHECK(std::memcmp(target.data() + 3110, z.data(), 7) == 0);
    std::vector<std::byte> u(7), v(3000), w(100);
    const std::array<ad::local_range, 3> out{asio::buffer(u), asio::buffer(v), asio::buffer(w)};
    const auto r7 = co_await c.async_get(std::span<const ad::local_range>(out), tr.remote().at(10, 3107), use_awaitable);
    CHECK(r7 == 3107);
    CHECK(std::memcmp(u.data(), x.data(), 7) == 0);
    CHECK(std::memcmp(v.data(), x.data() + 7, 93) == 0);
    CHECK(std::memcmp(v.data() + 93, y.data(), 2907) == 0);
    CHECK(std::memcmp(w.data(), y.data() + 2907, 93) == 0);
    CHECK(std::memcmp(w.data() + 93, z.data(), 7) == 0);
    // 17 ranges: more than a work request may gather
    std::vector<std::byte> one(17);
    std::vector<ad::local_range> many;
    for (std::size_t i = 0; i < 17; ++i) many.emplace_back(asio::buffer(one.data() + i, 1));
    auto [ec, n] = co_await c.async_put(std::span<const ad::local_range>(many), tr.remote(), asio::as_tuple(use_awaitable));
    CHECK(ec == ad::errc::invalid_argument);
    CHECK(n == 0);
  });
  CHECK(p.a.is_open());
}

TEST_CASE("gathers issued in one turn beyond the batch's gather staging still go out whole and in order",
          "[onesided]") {
  // 12 puts of 16 ranges each, then 12 gets scattering into 16: 192
  // gather entries per burst where a batch stages send_queue + 16 = 144.
  // The later ones take fewer entries per work request or wait for the
  // next doorbell; every byte must land where it belongs.
  onesided_pair p;
  constexpr std::size_t kOps = 12, kRanges = 16, kPiece = 256;
  std::vector<std::byte> target(kOps * kRanges * kPiece);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write |
                                                          ad::access::remote_read);
  const auto src = pattern(target.size(), 9);
  std::vector<std::byte> back(target.size());
  std::size_t puts_done = 0, gets_done = 0;
  p.run([&](ad::connection& c) -> awaitable<void> {
    std::vector<std::array<ad::local_range, kRanges>> in(kOps), out(kOps);
    for (std::size_t op = 0; op < kOps; ++op) {
      for (std::size_t r = 0; r < kRanges; ++r) {
        // ranges in reverse order within each op: a mix-up shows
        const std::size_t at = (op * kRanges + (kRanges - 1 - r)) * kPiece;
        in[op][r] = asio::buffer(src.data() + at, kPiece);
        out[op][r] = asio::buffer(back.data() + at, kPiece);
      }
    }
    const std::uint64_t doorbells_before = c.stats().doorbells;
    for (std::size_t op = 0; op < kOps; ++op) {
      const std::size_t len = kRanges * kPiece;
      // the remote range of op: the ranges above, reversed, land in order
      c.async_put(std::span<const ad::local_range>(in[op]), tr.remote().at(op * len, len),
                  [&](ad::error_code ec, std::size_t n) {
                    CHECK_FALSE(ec);
                    CHECK(n == len);
                    ++puts_done;
                  });
    }
    co_await c.async_flush(use_awaitable);
    CHECK(puts_done == kOps);
    // the burst did not fit one batch (the case this test is about)
    CHECK(c.stats().doorbells - doorbells_before >= 2);
    for (std::size_t op = 0; op < kOps; ++op) {
      const std::size_t len = kRanges * kPiece;
      c.async_get(std::span<const ad::local_range>(out[op]), tr.remote().at(op * len, len),
                  [&](ad::error_code ec, std::size_t n) {
                    CHECK_FALSE(ec);
                    CHECK(n == len);
                    ++gets_done;
                  });
    }
    co_await c.async_flush(use_awaitable);
  });
  CHECK(gets_done == kOps);
  for (std::size_t op = 0; op < kOps; ++op) {
    for (std::size_t r = 0; r < kRanges; ++r) {
      const std::size_t from = (op * kRanges + (kRanges - 1 - r)) * kPiece;
      const std::size_t to = (op * kRanges + r) * kPiece;
      CHECK(std::memcmp(target.data() + to, src.data() + from, kPiece) == 0);
    }
  }
  CHECK(back == src);
}

TEST_CASE("atomics: fetch_add and compare_swap return the value before and act on the peer's memory", "[onesided]") {
  onesided_pair p;
  alignas(8) std::array<std::uint64_t, 4> words{};
  ad::memory_region tr = p.fb.register_memory(std::as_writable_bytes(std::span(words)),
                                              ad::access::local_write | ad::access::remote_atomic | ad::access::remote_read);
  const bool supported = atomics_supported(p.fa);
  p.run([&](ad::connection& c) -> awaitable<void> {
    const ad::remote_region w1 = tr.remote().at(8, 8);
    if (!supported) {
      auto [ec, v] = co_await c.async_fetch_add(w1, 1, asio::as_tuple(use_awaitable));
      CHECK(ec == ad::errc::not_supported);
      co_return;
    }
    const auto r8 = co_await c.async_fetch_add(w1, 5, use_awaitable);
    CHECK(r8 == 0);
    const auto r9 = co_await c.async_fetch_add(w1, 5, use_awaitable);
    CHECK(r9 == 5);
    const auto r10 = co_await c.async_fetch_add(w1, ~std::uint64_t{0}, use_awaitable);  // wraps: adds -1
    CHECK(r10 == 10);
    CHECK(words[1] == 9);
    const auto r11 = co_await c.async_compare_swap(w1, 9, 100, use_awaitable);  // swapped
    CHECK(r11 == 9);
    CHECK(words[1] == 100);
    const auto r12 = co_await c.async_compare_swap(w1, 9, 200, use_awaitable);  // not swapped
    CHECK(r12 == 100);
    CHECK(words[1] == 100);
    CHECK(words[0] == 0);
    CHECK(words[2] == 0);
    // misaligned or short targets fail on the operation; the connection stays
    auto [e1, v1] = co_await c.async_fetch_add(tr.remote().at(4, 8), 1, asio::as_tuple(use_awaitable));
    CHECK(e1 == ad::errc::invalid_argument);
    auto [e2, v2] = co_await c.async_compare_swap(tr.remote().at(8, 4), 0, 1, asio::as_tuple(use_awaitable));
    CHECK(e2 == ad::errc::invalid_argument);
    CHECK(c.stats().atomics == 5);
  });
  CHECK(p.a.is_open());
}

TEST_CASE("put_with_notify: the peer receives the value and the written range, after the data", "[onesided]") {
  onesided_pair p;
  std::vector<std::byte> target(65536);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write);
  const auto data = pattern(5000, 7);
  const ad::remote_region dst = tr.remote().at(1000, 5000);
  std::vector<ad::notification> got;
  bool data_there = false;
  failure f;
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    for (int i = 0; i < 3; ++i) {
      got.push_back(co_await p.b.async_receive_notification(use_awaitable));
      if (i == 0) data_there = std::memcmp(target.data() + 1000, data.data(), data.size()) == 0;
    }
    CHECK(p.b.stats().notifications_received == 3);
  }, f.handler());
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    const auto r13 = co_await p.a.async_put_with_notify(asio::buffer(data), dst, 42, use_awaitable);
    CHECK(r13 == 5000);
    const auto r14 = co_await p.a.async_put_with_notify(asio::buffer(data.data(), 10), tr.remote().at(0, 10), 0xffffffffu,
                                             use_awaitable);
    CHECK(r14 == 10);
    // no data: only the notification
    const auto r15 = co_await p.a.async_put_with_notify(asio::const_buffer(), tr.remote().at(7, 0), 7, use_awaitable);
    CHECK(r15 == 0);
    CHECK(p.a.stats().notifications_sent == 3);
  }, f.handler());
  run_to_completion(p.io);
  f.check();
  REQUIRE(got.size() == 3);
  CHECK(data_there);
  CHECK(got[0].value == 42);
  CHECK(got[0].range == dst);
  CHECK(got[1].value == 0xffffffffu);
  CHECK(got[1].range == tr.remote().at(0, 10));
  CHECK(got[2].value == 7);
  CHECK(got[2].range.length == 0);
}

TEST_CASE("small puts from host memory go inline - larger ones and gets do not - and every byte arrives",
          "[onesided]") {
  onesided_pair p;
  // The runtime's inline bound for puts: the device's max_inline, at most 64 bytes.
  const std::size_t cap = std::min<std::size_t>(p.fa.device().caps().max_inline, 64);
  if (cap < 16) {
    WARN("this device carries no inline data (max_inline " << cap << "): nothing to test");
    return;
  }
  std::vector<std::byte> target(8192);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write | ad::access::remote_read);
  std::vector<std::byte> local(8192);
  ad::memory_region lr = p.fa.register_memory(local, ad::access::local_write);
  p.run([&](ad::connection& c) -> awaitable<void> {
    std::uint32_t seed = 0;
    for (const std::size_t n : {std::size_t{1}, std::size_t{8}, cap - 1, cap, cap + 1, std::size_t{4096}}) {
      for (const bool region : {true, false}) {
        INFO(n << " bytes from " << (region ? "a region" : "a plain buffer"));
        const auto data = pattern(n, ++seed);
        std::memcpy(local.data() + 3, data.data(), n);
        const std::uint64_t before = c.stats().inline_puts;
        const ad::remote_region dst = tr.remote().at(5, n);
        const auto put = region ? co_await c.async_put(lr.at(3, n), dst, use_awaitable)
                                : co_await c.async_put(asio::const_buffer(local.data() + 3, n), dst, use_awaitable);
        CHECK(put == n);
        CHECK(std::memcmp(target.data() + 5, data.data(), n) == 0);
        CHECK(c.stats().inline_puts - before == (n <= cap ? 1u : 0u));
      }
    }
    // A gather whose pieces fit goes inline as one work request.
    const auto x = pattern(5, 41), y = pattern(11, 42);
    const std::array<ad::local_range, 2> pieces{asio::buffer(x), asio::buffer(y)};
    std::uint64_t before = c.stats().inline_puts;
    const auto gathered = co_await c.async_put(std::span<const ad::local_range>(pieces), tr.remote().at(100, 16), use_awaitable);
    CHECK(gathered == 16);
    CHECK(std::memcmp(target.data() + 100, x.data(), 5) == 0);
    CHECK(std::memcmp(target.data() + 105, y.data(), 11) == 0);
    CHECK(c.stats().inline_puts - before == 1);
    // A get never goes inline; a small put_with_notify's data does.
    before = c.stats().inline_puts;
    std::vector<std::byte> back(16);
    const auto got = co_await c.async_get(asio::buffer(back), tr.remote().at(100, 16), use_awaitable);
    CHECK(got == 16);
    CHECK(std::memcmp(back.data(), x.data(), 5) == 0);
    CHECK(c.stats().inline_puts == before);
    const auto note = pattern(12, 43);
    const auto notified = co_await c.async_put_with_notify(asio::buffer(note), tr.remote().at(200, 12), 9, use_awaitable);
    CHECK(notified == 12);
    CHECK(c.stats().inline_puts - before == 1);
  });
  CHECK(std::memcmp(target.data() + 200, pattern(12, 43).data(), 12) == 0);
  CHECK(p.a.is_open());
}

TEST_CASE("a small put takes its bytes when it starts - a region reset and memory overwritten while it waits in the "
          "queue change nothing",
          "[onesided]") {
  onesided_pair p;
  if (p.fa.device().caps().max_inline < 40) {
    WARN("this device carries no 40-byte inline data: nothing to test");
    return;
  }
  std::vector<std::byte> target(4096);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write);
  std::vector<std::byte> local(4096);
  ad::memory_region lr = p.fa.register_memory(local, ad::access::local_write);
  const auto data = pattern(40, 77);
  std::memcpy(local.data(), data.data(), data.size());
  constexpr int kSends = 300;  // beyond the peer's credits: the put waits behind them
  int sent = 0, received = 0;
  boost::system::error_code put_ec = asio::error::would_block;
  std::size_t put_n = 0;
  std::uint64_t inline_at_start = 99, inline_at_end = 99;
  failure f;
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    for (; received < kSends; ++received) (void)co_await p.b.async_receive(use_awaitable);
    auto [ec, m] = co_await p.b.async_receive(asio::as_tuple(use_awaitable));  // the close
    CHECK(ec == ad::errc::connection_closed);
  }, f.handler());
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    const std::array<std::byte, 8> msg{};
    for (int i = 0; i < kSends; ++i) {
      p.a.async_send(asio::buffer(msg), [&](ad::error_code ec, std::size_t) { sent += ec ? 0 : 1; });
    }
    p.a.async_put(lr.at(0, 40), tr.remote().at(8, 40), [&](ad::error_code ec, std::size_t n) {
      put_ec = ec;
      put_n = n;
    });
    inline_at_start = p.a.stats().inline_puts;  // 0: queued behind the sends, not posted yet
    std::memset(local.data(), 0, local.size());
    lr.reset();  // deregistered: a put that read it now would fail at the device
    co_await p.a.async_flush(use_awaitable);
    inline_at_end = p.a.stats().inline_puts;
    co_await p.a.async_close(use_awaitable);
  }, f.handler());
  run_to_completion(p.io);
  f.check();
  CHECK(inline_at_start == 0);
  CHECK(inline_at_end == 1);
  CHECK(sent == kSends);
  CHECK(received == kSends);
  CHECK_FALSE(put_ec);
  CHECK(put_n == 40);
  CHECK(std::memcmp(target.data() + 8, data.data(), data.size()) == 0);
}

TEST_CASE("a small put from a plain buffer is copied and never registered - the registration cache is not touched",
          "[onesided]") {
  onesided_pair p;
  if (p.fa.device().caps().max_inline < 64) {
    WARN("this device carries no 64-byte inline data: nothing to test");
    return;
  }
  std::vector<std::byte> target(8192);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write);
  const auto small = pattern(40, 3);
  const auto first = pattern(24, 4);
  const auto large = pattern(4096, 5);
  ad::registration_cache_stats after_small{}, after_large{};
  std::uint64_t inline_puts = 0;
  p.run([&](ad::connection& c) -> awaitable<void> {
    for (int i = 0; i < 5; ++i) {
      co_await c.async_put(asio::buffer(small), tr.remote().at(64 * static_cast<std::size_t>(i), small.size()),
                           use_awaitable);
    }
    // Two pieces in one put, 40 + 24 = 64 bytes: inline too.
    const std::array<ad::local_range, 2> two{asio::buffer(small), asio::buffer(first)};
    co_await c.async_put(std::span<const ad::local_range>(two), tr.remote().at(512, 64), use_awaitable);
    after_small = p.fa.stats().cache;
    co_await c.async_put(asio::buffer(large), tr.remote().at(4096, large.size()), use_awaitable);
    after_large = p.fa.stats().cache;
    inline_puts = c.stats().inline_puts;
  });
  CHECK(inline_puts == 6);
  CHECK(after_small.hits == 0);
  CHECK(after_small.misses == 0);
  CHECK(after_small.registrations == 0);
  CHECK(after_large.misses == 1);  // a large one is registered as before
  CHECK(after_large.registrations == 1);
  for (std::size_t i = 0; i < 5; ++i) CHECK(std::memcmp(target.data() + 64 * i, small.data(), small.size()) == 0);
  CHECK(std::memcmp(target.data() + 512, small.data(), small.size()) == 0);
  CHECK(std::memcmp(target.data() + 552, first.data(), first.size()) == 0);
  CHECK(std::memcmp(target.data() + 4096, large.data(), large.size()) == 0);
}

TEST_CASE("ranges reaching the end of the address space or whose sizes add up past 2^64 are refused - sends too",
          "[onesided]") {
  onesided_pair p;
  std::vector<std::byte> target(4096);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write);
  std::vector<std::byte> src(64, std::byte{7});
  ad::error_code wrapped, past_end, in_last_page, send_wrapped, after;
  p.run([&](ad::connection& c) -> awaitable<void> {
    // 2 x (2^63 + 16) wraps to 32: a "32-byte" put of two huge pieces,
    // each within the address space.
    constexpr std::size_t kHalf = (std::size_t{1} << 63) + 16;
    const std::array<ad::local_range, 2> pieces{asio::const_buffer(src.data(), kHalf),
                                                asio::const_buffer(src.data(), kHalf)};
    auto [e1, n1] = co_await c.async_put(std::span<const ad::local_range>(pieces), tr.remote(),
                                         asio::as_tuple(use_awaitable));
    (void)n1;
    wrapped = e1;
    const std::uintptr_t near_end = ~std::uintptr_t{0} - 15;
    auto [e2, n2] = co_await c.async_put(asio::const_buffer(reinterpret_cast<const void*>(near_end), 32), tr.remote(),
                                         asio::as_tuple(use_awaitable));
    (void)n2;
    past_end = e2;
    // In the last page, not reaching the end: 100 bytes (not inline: the
    // cache would round its end up past 2^64).
    const std::uintptr_t last_page = ~std::uintptr_t{0} - 200;
    auto [e5, n5] = co_await c.async_put(asio::const_buffer(reinterpret_cast<const void*>(last_page), 100), tr.remote(),
                                         asio::as_tuple(use_awaitable));
    (void)n5;
    in_last_page = e5;
    const std::array<asio::const_buffer, 2> message{asio::const_buffer(src.data(), kHalf),
                                                    asio::const_buffer(src.data(), kHalf)};
    auto [e3, n3] = co_await c.async_send(message, asio::as_tuple(use_awaitable));
    (void)n3;
    send_wrapped = e3;
    auto [e4, n4] = co_await c.async_put(asio::buffer(src), tr.remote(), asio::as_tuple(use_awaitable));
    (void)n4;
    after = e4;
  });
  CHECK(wrapped == ad::errc::invalid_argument);
  CHECK(past_end == ad::errc::invalid_argument);
  CHECK(in_last_page == ad::errc::invalid_argument);  // (the registration cache's refusal)
  CHECK(send_wrapped == ad::errc::invalid_argument);
  CHECK_FALSE(after);  // the connection goes on
  CHECK(std::all_of(target.begin(), target.begin() + 64, [](std::byte b) { return b == std::byte{7}; }));
}

TEST_CASE("flush completes once every earlier operation is complete at the peer", "[onesided]") {
  onesided_pair p;
  std::vector<std::byte> target(1 << 20);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write);
  const auto data = pattern(1 << 20, 9);
  std::vector<int> order;
  p.run([&](ad::connection& c) -> awaitable<void> {
    co_await c.async_flush(use_awaitable);  // nothing outstanding: completes at once
    for (int i = 0; i < 8; ++i) {
      const std::size_t chunk = data.size() / 8;
      const std::size_t off = static_cast<std::size_t>(i) * chunk;
      c.async_put(asio::buffer(data.data() + off, chunk), tr.remote().at(off, chunk),
                  [&order, i](ad::error_code ec, std::size_t) {
                    CHECK_FALSE(ec);
                    order.push_back(i);
                  });
    }
    co_await c.async_flush(use_awaitable);
    order.push_back(100);
    CHECK(target == data);
    CHECK(c.stats().flushes == 2);
  });
  REQUIRE(order.size() == 9);
  CHECK(order.back() == 100);
}

TEST_CASE("in a ping-pong a lone operation rings inside its call - a burst shares one doorbell at its turn's end",
          "[onesided]") {
  onesided_pair p;
  std::vector<std::byte> target(4096);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write |
                                                          ad::access::remote_read);
  const auto data = pattern(4096, 21);
  std::vector<std::byte> back(64);
  struct step {
    std::uint64_t at_once = 99, total = 0, posts = 0;
  };
  std::array<step, 7> st{};
  p.run([&](ad::connection& c) -> awaitable<void> {
    auto ex = co_await asio::this_coro::executor;
    int done = 0;
    std::size_t next = 0;
    auto put = [&] {
      const std::size_t i = next++;
      c.async_put(asio::buffer(data.data() + 64 * i, 64), tr.remote().at(64 * i, 64), [&](ad::error_code ec, std::size_t) {
        CHECK_FALSE(ec);
        ++done;
      });
    };
    // Each step in a turn of its own, outside any completion, after the
    // last one's operations completed.
    auto measure = [&](step& s, auto issue) -> awaitable<void> {
      co_await asio::post(ex, use_awaitable);
      const ad::connection_stats before = c.stats();
      issue();
      s.at_once = c.stats().doorbells - before.doorbells;  // before any io_context round
      co_await c.async_flush(use_awaitable);
      s.total = c.stats().doorbells - before.doorbells;
      s.posts = c.stats().posts - before.posts;
    };
    co_await measure(st[0], put);
    co_await measure(st[1], put);
    co_await measure(st[2], put);
    co_await measure(st[3], [&] {
      for (int i = 0; i < 8; ++i) put();
    });
    co_await measure(st[4], put);
    co_await measure(st[5], put);
    co_await measure(st[6], [&] {
      c.async_get(asio::buffer(back), tr.remote().at(0, 64), [&](ad::error_code ec, std::size_t) {
        CHECK_FALSE(ec);
        ++done;
      });
    });
    CHECK(done == 14);
  });
  // Two turns of one operation each make a ping-pong: the third rings in its call.
  CHECK(st[0].at_once == 0);
  CHECK(st[1].at_once == 0);
  CHECK(st[2].at_once == 1);
  for (std::size_t i : {0u, 1u, 2u, 4u, 5u, 6u}) {
    INFO("step " << i);
    CHECK(st[i].total == 1);
    CHECK(st[i].posts == 1);
  }
  // A burst: its first rings at once, the other seven share one doorbell.
  CHECK(st[3].at_once == 1);
  CHECK(st[3].total == 2);
  CHECK(st[3].posts == 8);
  // It ended the ping-pong: two lone turns again before one rings at once (a get).
  CHECK(st[4].at_once == 0);
  CHECK(st[5].at_once == 0);
  CHECK(st[6].at_once == 1);
  CHECK(std::memcmp(target.data(), data.data(), 13 * 64) == 0);
  CHECK(std::memcmp(back.data(), data.data(), 64) == 0);
}

TEST_CASE("in a ping-pong a send issued inside the reactor's pass or by a handler a flush runs is batched - never run "
          "inline",
          "[onesided]") {
  onesided_pair p;
  std::vector<std::byte> target(64);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write);
  const auto data = pattern(64, 23);
  constexpr std::uint64_t kUnset = 99;
  std::uint64_t in_pass = kUnset, from_flush_handler = kUnset;
  bool ran_in_call = true, handler_ran = false;
  p.run([&](ad::connection& c) -> awaitable<void> {
    co_await asio::post(co_await asio::this_coro::executor, use_awaitable);
    // Lone puts, each awaited: a ping-pong. Each resumes this coroutine
    // inside the reactor's pass that completed it.
    for (int i = 0; i < 3; ++i) co_await c.async_put(asio::buffer(data), tr.remote().at(0, 64), use_awaitable);
    const std::uint64_t d = c.stats().doorbells;
    bool ran = false;
    c.async_send(asio::buffer("x", 1), [&](ad::error_code ec, std::size_t) {
      CHECK_FALSE(ec);
      ran = true;
      handler_ran = true;
      // Run by the flush at the pass's end, right after its doorbell.
      const std::uint64_t d1 = c.stats().doorbells;
      c.async_put(asio::buffer(data), tr.remote().at(0, 64), [](ad::error_code e, std::size_t) { CHECK_FALSE(e); });
      from_flush_handler = c.stats().doorbells - d1;
    });
    ran_in_call = ran;
    in_pass = c.stats().doorbells - d;
    co_await c.async_flush(use_awaitable);
  });
  CHECK(in_pass == 0);
  CHECK_FALSE(ran_in_call);
  CHECK(handler_ran);
  CHECK(from_flush_handler == 0);
  CHECK(target == data);
}

TEST_CASE("coroutines that each await a put on one connection keep sharing a doorbell per turn", "[onesided]") {
  // (On a device whose completions of one doorbell may arrive across
  // polls, the coroutines drift apart whatever rings: the bound is the
  // tcp provider's, which completes them in one pass.)
  if (!testing_tcp()) {
    WARN("the doorbell bound holds for the tcp provider only: nothing to test on " << provider_under_test());
    return;
  }
  onesided_pair p;
  constexpr std::size_t kCoroutines = 8, kRounds = 50;
  std::vector<std::byte> target(64 * kCoroutines);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write);
  const auto data = pattern(64 * kCoroutines, 22);
  std::uint64_t doorbells = 0, posts = 0;
  p.run([&](ad::connection& c) -> awaitable<void> {
    auto ex = co_await asio::this_coro::executor;
    const ad::connection_stats before = c.stats();
    std::size_t finished = 0;
    for (std::size_t k = 0; k < kCoroutines; ++k) {
      asio::co_spawn(ex, [&, k]() -> awaitable<void> {
        for (std::size_t r = 0; r < kRounds; ++r) {
          co_await c.async_put(asio::buffer(data.data() + 64 * k, 64), tr.remote().at(64 * k, 64), use_awaitable);
          co_await asio::post(ex, use_awaitable);
        }
        ++finished;
      }, asio::detached);
    }
    while (finished < kCoroutines) co_await asio::post(ex, use_awaitable);
    doorbells = c.stats().doorbells - before.doorbells;
    posts = c.stats().posts - before.posts;
  });
  CHECK(posts == kCoroutines * kRounds);
  // One doorbell per round of the eight, give or take the start: never one
  // put rung apart from the others, which would then complete apart and
  // split every round after.
  INFO(doorbells << " doorbells for " << posts << " puts");
  CHECK(doorbells <= kRounds + kRounds / 5);
  CHECK(target == data);
}

TEST_CASE("registration cache: a buffer is registered once and reused: forget_memory and eviction drop entries",
          "[onesided]") {
  ad::fabric_options o = test_options();
  o.cache_max_entries = 2;
  onesided_pair p(o);
  std::vector<std::byte> target(1 << 16);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write);
  std::vector<std::byte> src(3 * 8192 + 4096);
  auto page_aligned = [&](std::size_t k) {
    auto p0 = (reinterpret_cast<std::uintptr_t>(src.data()) + 4095) & ~std::uintptr_t{4095};
    return reinterpret_cast<std::byte*>(p0) + k * 8192;
  };
  p.run([&](ad::connection& c) -> awaitable<void> {
    for (int i = 0; i < 10; ++i) co_await c.async_put(asio::buffer(page_aligned(0), 4096), tr.remote(), use_awaitable);
    ad::registration_cache_stats s = p.fa.stats().cache;
    CHECK(s.registrations == 1);
    CHECK(s.misses == 1);
    CHECK(s.hits == 9);
    CHECK(s.entries == 1);
    // a part of a cached page: still a hit (larger than an inline put, which is copied, not registered)
    co_await c.async_put(asio::buffer(page_aligned(0) + 100, 200), tr.remote(), use_awaitable);
    CHECK(p.fa.stats().cache.hits == 10);
    // forget: the next use registers again
    CHECK(p.fa.forget_memory(page_aligned(0), 4096) == 1);
    CHECK(p.fa.stats().cache.entries == 0);
    co_await c.async_put(asio::buffer(page_aligned(0), 4096), tr.remote(), use_awaitable);
    s = p.fa.stats().cache;
    CHECK(s.registrations == 2);
    CHECK(s.invalidations == 1);
    // three buffers on separate pages with room for two: the oldest goes
    co_await c.async_put(asio::buffer(page_aligned(1), 4096), tr.remote(), use_awaitable);
    co_await c.async_put(asio::buffer(page_aligned(2), 4096), tr.remote(), use_awaitable);
    s = p.fa.stats().cache;
    CHECK(s.registrations == 4);
    CHECK(s.evictions == 1);
    CHECK(s.entries == 2);
    CHECK(s.deregistrations == 2);
    CHECK(s.bytes == 2 * 4096);
  });
  CHECK(p.fa.forget_memory(nullptr, 0) == 0);
}

TEST_CASE("remote access errors fail that operation and, as RC requires, the connection: a new one works",
          "[onesided]") {
  onesided_pair p;
  std::vector<std::byte> target(8192);
  ad::memory_region rw = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write | ad::access::remote_read);
  std::vector<std::byte> ro_mem(4096);
  ad::memory_region ro = p.fb.register_memory(ro_mem, ad::access::remote_read);
  const auto data = pattern(256, 3);
  struct bad_case {
    const char* what;
    ad::remote_region dst;
  };
  const std::vector<bad_case> cases = {
      {"beyond the region", ad::remote_region{rw.remote().addr + 8192 - 100, 256, rw.rkey()}},
      {"an unknown key", ad::remote_region{rw.remote().addr, 256, rw.rkey() ^ 0x5a5a5a}},
      {"a region without remote write", ro.remote()},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    INFO(cases[i].what);
    if (i > 0) p.connect();
    ad::error_code target_ended;
    p.run([&](ad::connection& c) -> awaitable<void> {
      auto [ec, n] = co_await c.async_put(asio::buffer(data), cases[i].dst, asio::as_tuple(use_awaitable));
      CHECK(ec == anydoor::transport::wc_status::remote_access_error);
      CHECK(n == 0);
      CHECK_FALSE(c.is_open());
      auto [ec2, n2] = co_await c.async_put(asio::buffer(data), rw.remote(), asio::as_tuple(use_awaitable));
      CHECK(ec2);  // the connection is in error
      // the target's pending receive ends too (its queue pair follows)
      p.b.abort();
    }, &target_ended);
    CHECK(target_ended);
  }
  p.connect();  // a new connection to the same peer works
  p.run([&](ad::connection& c) -> awaitable<void> {
    const auto r16 = co_await c.async_put(asio::buffer(data), rw.remote(), use_awaitable);
    CHECK(r16 == data.size());
  });
  CHECK(std::memcmp(target.data(), data.data(), data.size()) == 0);
}

TEST_CASE("a deregistered region can no longer be written or read remotely", "[onesided]") {
  onesided_pair p;
  std::vector<std::byte> target(4096);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write | ad::access::remote_read);
  const ad::remote_region r = tr.remote();
  const auto data = pattern(64, 5);
  p.run([&](ad::connection& c) -> awaitable<void> {
    const auto r17 = co_await c.async_put(asio::buffer(data), r, use_awaitable);
    CHECK(r17 == 64);
    tr.reset();  // the target deregisters
    auto [ec, n] = co_await c.async_put(asio::buffer(pattern(64, 6)), r, asio::as_tuple(use_awaitable));
    CHECK(ec == anydoor::transport::wc_status::remote_access_error);
    p.b.abort();
  });
  CHECK(std::memcmp(target.data(), data.data(), 64) == 0);  // the second put did not land
  p.connect();
  p.run([&](ad::connection& c) -> awaitable<void> {
    std::vector<std::byte> back(64);
    auto [ec, n] = co_await c.async_get(asio::buffer(back), r, asio::as_tuple(use_awaitable));
    CHECK(ec == anydoor::transport::wc_status::remote_access_error);
    p.b.abort();
  });
}

TEST_CASE("errors on the operation itself leave the connection usable", "[onesided]") {
  onesided_pair p;
  std::vector<std::byte> target(4096);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write | ad::access::remote_read);
  std::vector<std::byte> mine(4096);
  ad::memory_region readable = p.fa.register_memory(mine, ad::access::none);
  p.run([&](ad::connection& c) -> awaitable<void> {
    const auto big = pattern(5000, 1);
    auto [e1, n1] = co_await c.async_put(asio::buffer(big), tr.remote(), asio::as_tuple(use_awaitable));
    CHECK(e1 == ad::errc::out_of_range);  // more local data than the remote range holds
    const std::vector<std::byte> konst(16);
    auto [e2, n2] = co_await c.async_get(asio::buffer(konst), tr.remote(), asio::as_tuple(use_awaitable));
    CHECK(e2 == ad::errc::invalid_argument);  // a const buffer cannot be a destination
    auto [e3, n3] = co_await c.async_get(readable.at(0, 16), tr.remote(), asio::as_tuple(use_awaitable));
    CHECK(e3 == ad::errc::invalid_argument);  // a region without local_write neither
    const ad::local_range stale = readable.at(0, 16);
    readable.reset();
    auto [e4, n4] = co_await c.async_put(stale, tr.remote(), asio::as_tuple(use_awaitable));
    CHECK(e4 == ad::errc::invalid_argument);  // the region is gone
    CHECK(c.is_open());
    const auto r18 = co_await c.async_put(asio::buffer(big.data(), 4096), tr.remote(), use_awaitable);
    CHECK(r18 == 4096);
  });
  CHECK(p.a.is_open());
}

TEST_CASE("one-sided operations: cancellation, closed connections, empty handles", "[onesided]") {
  onesided_pair p;
  std::vector<std::byte> target(4096);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write);
  asio::cancellation_signal sig;
  ad::error_code note_ec;
  failure f;
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    auto [ec, n] = co_await p.b.async_receive_notification(
        asio::bind_cancellation_slot(sig.slot(), asio::as_tuple(use_awaitable)));
    note_ec = ec;
  }, f.handler());
  asio::post(p.io, [&] { sig.emit(asio::cancellation_type::terminal); });
  run_to_completion(p.io);
  f.check();
  CHECK(note_ec == std::errc::operation_canceled);

  // after a close, operations fail with connection_closed on both sides
  asio::co_spawn(p.io, [&]() -> awaitable<void> { co_await p.a.async_close(use_awaitable); }, f.handler());
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    auto [ec, m] = co_await p.b.async_receive(asio::as_tuple(use_awaitable));
    CHECK(ec == ad::errc::connection_closed);
    auto [e2, v] = co_await p.b.async_receive_notification(asio::as_tuple(use_awaitable));
    CHECK(e2 == ad::errc::connection_closed);
  }, f.handler());
  run_to_completion(p.io);
  f.check();
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    auto [e1, n1] = co_await p.a.async_put(asio::buffer(target.data(), 8), tr.remote(), asio::as_tuple(use_awaitable));
    CHECK(e1 == ad::errc::connection_closed);
    auto [e2] = co_await p.a.async_flush(asio::as_tuple(use_awaitable));
    CHECK(e2 == ad::errc::connection_closed);
    ad::connection none;
    auto [e3, v3] = co_await none.async_fetch_add(tr.remote(), 1, asio::as_tuple(use_awaitable));
    CHECK(e3 == ad::errc::not_connected);
  }, f.handler());
  run_to_completion(p.io);
  f.check();
}

TEST_CASE("fabric options of the registration cache are checked", "[onesided]") {
  asio::io_context io;
  auto code = [&](const ad::fabric_options& o) { return thrown([&] { ad::fabric f(io, o); }); };
  ad::fabric_options o = test_options();
  o.cache_max_entries = 0;
  CHECK(code(o) == ad::errc::invalid_argument);
  o.cache_max_entries = (std::size_t{1} << 20) + 1;
  CHECK(code(o) == ad::errc::invalid_argument);
  o.cache_max_entries = 1;
  o.cache_max_bytes = 4095;
  CHECK(code(o) == ad::errc::invalid_argument);
  o.cache_max_bytes = 4096;
  CHECK_FALSE(code(o));
}

namespace {
// An 8-deep send queue and 4 KiB fragments: the queue reaches 32 KiB.
ad::fabric_options short_queue_options() {
  ad::fabric_options o = test_options();
  o.connection.send_queue = 8;
  o.connection.signal_interval = 4;
  o.connection.fragment_size = 4096;
  return o;
}
}  // namespace

TEST_CASE("put, get and put_with_notify many times the send queue's reach start in pieces and complete",
          "[onesided]") {
  // send_queue 8 and 4 KiB fragments: the queue reaches 32 KiB; each
  // transfer needs 256 work requests. Before, such a transfer never started
  // and blocked everything behind it.
  const ad::fabric_options o = short_queue_options();
  onesided_pair p(o);
  constexpr std::size_t kLen = std::size_t{1} << 20;
  std::vector<std::byte> target(kLen);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write |
                                                          ad::access::remote_read);
  const auto src = pattern(kLen, 42);
  std::vector<std::byte> back(kLen);
  std::vector<std::byte> halves(kLen);
  p.run([&](ad::connection& c) -> awaitable<void> {
    // gather from two ranges, many fragments
    const std::array<ad::local_range, 2> two{ad::local_range(asio::buffer(src.data(), kLen / 2)),
                                             ad::local_range(asio::buffer(src.data() + kLen / 2, kLen / 2))};
    const std::size_t put = co_await c.async_put(std::span<const ad::local_range>(two), tr.remote(), use_awaitable);
    CHECK(put == kLen);
    const std::size_t got = co_await c.async_get(asio::buffer(back), tr.remote(), use_awaitable);
    CHECK(got == kLen);
    const std::size_t put2 = co_await c.async_put_with_notify(asio::buffer(src), tr.remote(), 77, use_awaitable);
    CHECK(put2 == kLen);
    co_await c.async_flush(use_awaitable);
  });
  CHECK(target == src);
  CHECK(back == src);
}

TEST_CASE("a transfer started in parts ends exactly once when the peer closes or the connection aborts",
          "[onesided]") {
  // 4 MiB in 4 KiB pieces through an 8-deep send queue: it is partly on the
  // wire when the target closes (or the initiator aborts). It must complete
  // once, with an error unless it finished first, and only after its posted
  // pieces are back (its memory is in use until then), and run() returns.
  const ad::fabric_options o = short_queue_options();
  const bool abort_self = GENERATE(false, true);
  const bool get = GENERATE(false, true);
  onesided_pair p(o);
  constexpr std::size_t kLen = std::size_t{4} << 20;
  std::vector<std::byte> target(kLen);
  ad::memory_region tr = p.fb.register_memory(target, ad::access::local_write | ad::access::remote_write |
                                                          ad::access::remote_read);
  auto local = pattern(kLen, 5);
  int completions = 0;
  ad::error_code op_ec;
  auto done = [&](ad::error_code ec, std::size_t) {
    ++completions;
    op_ec = ec;
  };
  if (get) {
    p.a.async_get(asio::buffer(local), tr.remote(), done);
  } else {
    p.a.async_put(asio::buffer(local), tr.remote(), done);
  }
  failure f;
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    asio::steady_timer t(co_await asio::this_coro::executor, std::chrono::milliseconds(3));
    co_await t.async_wait(use_awaitable);
    if (abort_self) {
      p.a.abort();
    } else {
      auto [ec] = co_await p.b.async_close(asio::as_tuple(use_awaitable));
      (void)ec;
    }
  }, f.handler());
  run_to_completion(p.io);
  f.check();
  INFO("abort " << abort_self << ", get " << get << ": " << op_ec.message());
  CHECK(completions == 1);
  if (op_ec) CHECK((op_ec == ad::errc::connection_closed || abort_self));
}

TEST_CASE("progress_thread: puts - gets and atomics on a fabric whose io_context is no longer run", "[onesided]") {
  // The target's io_context stands still (an application busy elsewhere).
  // With the tcp provider the target's process is the NIC: with the option
  // its thread serves the peer; without it (checked below) nothing moves
  // until the target polls. verbs: the NIC serves them either way.
  for (const bool threaded : {true, false}) {
    if (!threaded && !testing_tcp()) continue;
    INFO("progress_thread " << threaded);
    asio::io_context sio, cio;
    ad::fabric_options so = test_options();
    so.progress_thread = threaded;
    ad::fabric server(sio, so);
    ad::fabric client(cio, test_options());
    ad::acceptor acc = server.listen(test_host(), 0);
    auto [s, c] = connect_across(sio, cio, client, acc);
    std::vector<std::byte> target(64 * 1024, std::byte{0});
    alignas(8) std::array<std::uint64_t, 1> word{7};
    ad::memory_region tr =
        server.register_memory(target, ad::access::local_write | ad::access::remote_write | ad::access::remote_read);
    ad::memory_region wr = server.register_memory(std::as_writable_bytes(std::span(word)),
                                                  ad::access::local_write | ad::access::remote_atomic);
    const std::vector<std::byte> data = pattern(target.size(), 5);
    std::vector<std::byte> back(target.size());
    const bool atomics = atomics_supported(client);
    int done = 0;
    ad::error_code e1, e2, e3;
    std::uint64_t before = 0;
    c.async_put(asio::buffer(data), tr.remote(), [&](ad::error_code ec, std::size_t) {
      e1 = ec;
      ++done;
      c.async_get(asio::buffer(back), tr.remote(), [&](ad::error_code ec2, std::size_t) {
        e2 = ec2;
        ++done;
        if (!atomics) return;
        c.async_fetch_add(wr.remote(), 3, [&](ad::error_code ec3, std::uint64_t v) {
          e3 = ec3;
          before = v;
          ++done;
        });
      });
    });
    const int want = atomics ? 3 : 2;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(threaded ? 10 : 1);
    while (done < want && std::chrono::steady_clock::now() < until) {
      cio.restart();
      cio.run_for(std::chrono::milliseconds(5));
    }
    if (!threaded) {
      CHECK(done == 0);  // (the put waits for the target's poll; polled now, it serves it)
      while (done < want && std::chrono::steady_clock::now() < until + std::chrono::seconds(10)) {
        sio.restart();
        sio.poll();
        cio.restart();
        cio.run_for(std::chrono::milliseconds(5));
      }
    }
    REQUIRE(done == want);
    CHECK_FALSE(e1);
    CHECK_FALSE(e2);
    CHECK(back == data);
    (void)s.stats();  // (its queue pair's counters take the queue's mutex: what the thread wrote is seen here)
    CHECK(target == data);
    if (atomics) {
      CHECK_FALSE(e3);
      CHECK(before == 7);
      CHECK(word[0] == 10);
    }
  }
}
