// Registrations in pieces (fabric_options::max_piece_bytes, standing in for
// a device whose max_mr_size is smaller than the memory): a region larger
// than one registration is one memory_region to its user, its remote
// descriptor carries every piece's key, and put, get, scatter-gather,
// atomics and put_with_notify reach each piece with its own keys, on both
// ends. A work request that crossed a piece with one key would fail with
// remote_access_error (the provider checks every access against its
// registration), so these tests fail if the split is wrong.
#include "../support/onesided.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <cstring>

using namespace anydoor::test;
using asio::awaitable;
using asio::use_awaitable;

namespace {

constexpr unsigned kShift = 14;  // 16 KiB pieces
constexpr std::uint64_t kPiece = std::uint64_t{1} << kShift;

ad::fabric_options piece_options() {
  ad::fabric_options o = test_options();
  o.max_piece_bytes = kPiece + 1000;  // not a power of two: the pieces are the largest one below
  return o;
}

std::uint64_t blocks_touched(const void* p, std::size_t n) {
  const auto a = reinterpret_cast<std::uint64_t>(p);
  return ((a + n - 1) >> kShift) - (a >> kShift) + 1;
}

void put_u32(std::vector<std::byte>& p, std::size_t at, std::uint32_t v) {
  for (std::size_t i = 0; i < 4; ++i) p[at + i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

bool same(const std::byte* a, const std::byte* b, std::size_t n) { return std::memcmp(a, b, n) == 0; }

}  // namespace

TEST_CASE("pieces: memory larger than max_piece_bytes is one region of several registrations", "[onesided]") {
  asio::io_context io;
  ad::fabric fab(io, piece_options());
  std::vector<std::byte> buf(512 << 10);
  const std::span<std::byte> mem(buf.data() + 100, 200000);  // starts mid-block
  const std::uint64_t n = blocks_touched(mem.data(), mem.size());
  REQUIRE(n >= 13);
  REQUIRE(n <= ad::remote_region::max_pieces);
  // Up to 16 pieces; more than a descriptor carries are refused, with the way out.
  const auto misalign = reinterpret_cast<std::uintptr_t>(buf.data()) % kPiece;
  std::byte* const aligned = buf.data() + (misalign == 0 ? 0 : kPiece - misalign);
  CHECK(fab.register_memory(std::span(aligned, 16 * kPiece), ad::access::local_write).pieces() == 16);
  try {
    (void)fab.register_memory(std::span(aligned, 16 * kPiece + 1), ad::access::local_write);
    FAIL("17 pieces were registered");
  } catch (const std::system_error& e) {
    CHECK(e.code() == ad::errc::registration_failed);
    CHECK(std::string(e.what()).find("register it as several regions") != std::string::npos);
  }
  ad::memory_region mr = fab.register_memory(mem, ad::access::local_write | ad::access::remote_write);
  CHECK(mr.pieces() == n);
  CHECK(mr.data() == mem.data());
  CHECK(mr.size() == mem.size());
  // At most one piece's worth is one registration, even across a block edge.
  CHECK(fab.register_memory(std::span(buf.data() + 100, kPiece), ad::access::local_write).pieces() == 1);
  CHECK(fab.register_memory(std::span(buf.data() + 100, kPiece + 1), ad::access::local_write).pieces() == 2);

  const ad::remote_region r = mr.remote();
  REQUIRE(r.pieces.count() == n);
  CHECK(r.pieces.shift() == kShift);
  CHECK(r.pieces.base() == reinterpret_cast<std::uint64_t>(mem.data()) >> kShift);
  CHECK(r.rkey == r.pieces.key(0));
  CHECK(r.rkey == mr.rkey());
  for (std::uint32_t i = 1; i < n; ++i) CHECK(r.pieces.key(i) != r.pieces.key(i - 1));  // each its own registration

  // at(): only the pieces the range touches; within one piece a plain region.
  const std::uint64_t to_edge = kPiece - (reinterpret_cast<std::uint64_t>(mem.data()) & (kPiece - 1));
  const ad::remote_region inside = r.at(to_edge + kPiece + 10, 100);  // in piece 2
  CHECK(inside.pieces.empty());
  CHECK(inside.rkey == r.pieces.key(2));
  const ad::remote_region across = r.at(to_edge + 10, 2 * kPiece);  // pieces 1, 2, 3
  REQUIRE(across.pieces.count() == 3);
  CHECK(across.pieces.key(0) == r.pieces.key(1));
  CHECK(across.pieces.key(2) == r.pieces.key(3));
  CHECK(across.rkey == r.pieces.key(1));
  CHECK(across.at(kPiece, 10).rkey == r.pieces.key(2));  // at() of at()
  CHECK(r.at(mem.size(), 0).rkey == r.pieces.key(static_cast<std::uint32_t>(n - 1)));
  CHECK(thrown([&] { (void)r.at(1, mem.size()); }) == ad::errc::out_of_range);

  // The wire form: version 2, 32 + 4 bytes per piece, round-trips.
  std::vector<std::byte> packed = r.pack();
  REQUIRE(packed.size() == 32 + 4 * n);
  CHECK(r.packed_length() == packed.size());
  CHECK(std::to_integer<int>(packed[4]) == 2);
  ad::remote_region back;
  REQUIRE_FALSE(ad::remote_region::unpack(packed, back));
  CHECK(back == r);
  CHECK_FALSE(back == inside);
  REQUIRE_FALSE(ad::remote_region::unpack(across.pack(), back));
  CHECK(back == across);
  std::vector<std::byte> longer = packed;
  longer.resize(packed.size() + 7);
  CHECK(ad::remote_region::packed_length_of(longer) == packed.size());
  CHECK(ad::remote_region::packed_length_of(inside.pack()) == 32);
  CHECK(ad::remote_region::packed_length_of(std::span(packed).first(31)) == 0);

  // Garbage is refused and leaves `out` alone.
  const ad::remote_region before{1, 2, 3};
  ad::remote_region untouched = before;
  auto refused = [&](std::vector<std::byte> bad, bool seal = true) {
    if (seal) reseal(bad);
    return ad::remote_region::unpack(bad, untouched);
  };
  CHECK(refused(longer) == ad::errc::protocol_error);  // one descriptor, exactly
  CHECK(refused(std::vector<std::byte>(packed.begin(), packed.end() - 4)) == ad::errc::protocol_error);
  {
    auto bad = packed;
    bad[40] ^= std::byte{1};  // a key, unsealed
    CHECK(refused(bad, false) == ad::errc::protocol_error);
  }
  for (const std::uint8_t shift : {std::uint8_t{11}, std::uint8_t{63}, std::uint8_t{kShift + 1}, std::uint8_t{kShift - 1}}) {
    auto bad = packed;
    bad[5] = std::byte{shift};  // the pieces no longer match the range
    CHECK(refused(bad) == ad::errc::protocol_error);
  }
  {
    auto bad = packed;
    put_u32(bad, 24, static_cast<std::uint32_t>(n + 1));  // a count that is not the blocks touched
    bad.resize(bad.size() + 4);
    CHECK(refused(bad) == ad::errc::protocol_error);
  }
  {
    std::vector<std::byte> bad = packed;  // 17 pieces: more than any descriptor carries
    put_u32(bad, 24, 17);
    bad.resize(32 + 4 * 17);
    CHECK(refused(bad) == ad::errc::protocol_error);
    CHECK(ad::remote_region::packed_length_of(bad) == 0);
  }
  {
    std::vector<std::byte> bad(packed.begin(), packed.begin() + 36);  // one piece in version 2
    put_u32(bad, 24, 1);
    CHECK(refused(bad) == ad::errc::protocol_error);
  }
  {
    auto bad = packed;
    bad[16] = bad[17] = bad[18] = bad[19] = std::byte{0};  // length 0
    bad[20] = bad[21] = bad[22] = bad[23] = std::byte{0};
    CHECK(refused(bad) == ad::errc::protocol_error);
  }
  {
    auto bad = packed;
    bad[7] = std::byte{1};  // reserved
    CHECK(refused(bad) == ad::errc::protocol_error);
  }
  CHECK(untouched == before);

  ad::memory_region moved = std::move(mr);
  CHECK(moved.pieces() == n);
  CHECK(mr.pieces() == 0);  // NOLINT(bugprone-use-after-move): moved-from is empty
  CHECK(mr.remote().pieces.empty());
  moved.reset();
  CHECK(moved.pieces() == 0);
  CHECK(moved.remote() == ad::remote_region{});

  // The option itself.
  for (const std::uint64_t bad : {std::uint64_t{1}, std::uint64_t{4095}}) {
    ad::fabric_options o = test_options();
    o.max_piece_bytes = bad;
    CHECK(thrown([&] { ad::fabric f(io, o); }) == ad::errc::invalid_argument);
  }
}

TEST_CASE("pieces: put, get, scatter-gather, the cache, atomics and notifications reach every piece",
          "[onesided]") {
  onesided_pair p(piece_options());
  const bool atomics = p.fa.device().caps().atomics;
  std::vector<std::byte> tbuf(256 << 10);
  const std::span<std::byte> tmem(tbuf.data() + 104, 200000);
  ad::memory_region tr = p.fb.register_memory(
      tmem, ad::access::local_write | ad::access::remote_write | ad::access::remote_read | ad::access::remote_atomic);
  REQUIRE(tr.pieces() > 10);
  // The descriptor as a peer gets it: packed and unpacked.
  ad::remote_region dst;
  REQUIRE_FALSE(ad::remote_region::unpack(tr.remote().pack(), dst));

  // The local side in pieces too, at another alignment (its edges fall
  // elsewhere than the target's).
  std::vector<std::byte> lbuf(256 << 10);
  const std::span<std::byte> lmem(lbuf.data() + 3000, 200000);
  ad::memory_region lr = p.fa.register_memory(lmem, ad::access::local_write);
  REQUIRE(lr.pieces() > 10);
  const auto data = pattern(lmem.size(), 7);
  std::memcpy(lmem.data(), data.data(), data.size());
  std::vector<std::byte> gbuf(256 << 10);
  const std::span<std::byte> gmem(gbuf.data() + 5000, 200000);
  ad::memory_region gr = p.fa.register_memory(gmem, ad::access::local_write);
  std::vector<std::byte> plain = pattern(100000, 9);  // through the cache, which registers it in pieces
  std::vector<std::byte> plain_back(100000);

  // Where the target's pieces meet: an aligned word on each side of an edge.
  const auto t0 = reinterpret_cast<std::uint64_t>(tmem.data());
  const std::uint64_t edge = ((t0 >> kShift) + 3) << kShift;
  const std::uint64_t word_after = edge - t0;
  const std::uint64_t word_before = word_after - 8;

  ad::notification note;
  ad::error_code note_ec;
  failure f;
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    auto [ec, n] = co_await p.b.async_receive_notification(asio::as_tuple(use_awaitable));
    note_ec = ec;
    note = n;
  }, f.handler());
  std::size_t moved_bytes[8] = {};
  std::uint64_t before[3] = {};
  std::uint64_t words[2] = {};
  std::uint32_t pieces_in_targets = 0;
  std::uint64_t puts = 0;
  bool whole = false, part = false, read = false, gathered = false, scattered = false, cached = false;
  p.run([&](ad::connection& c) -> awaitable<void> {
    // The whole region, piece to piece.
    moved_bytes[0] = co_await c.async_put(lr, dst, use_awaitable);
    whole = same(tmem.data(), data.data(), data.size());
    // Parts at odd offsets.
    std::memset(tmem.data(), 0, tmem.size());
    moved_bytes[1] = co_await c.async_put(lr.at(5000, 70000), dst.at(30001, 70000), use_awaitable);
    part = same(tmem.data() + 30001, data.data() + 5000, 70000) && tmem[30000] == std::byte{0} &&
           tmem[100001] == std::byte{0};
    // Read back into a third region in pieces.
    std::memcpy(tmem.data(), data.data(), data.size());
    moved_bytes[2] = co_await c.async_get(gr.at(1, 150000), dst.at(1234, 150000), use_awaitable);
    read = same(gmem.data() + 1, data.data() + 1234, 150000);
    // Gather two ranges, scatter them back.
    const ad::local_range srcs[] = {lr.at(0, 40000), lr.at(100000, 40000)};
    moved_bytes[3] = co_await c.async_put(std::span<const ad::local_range>(srcs), dst.at(20000, 80000), use_awaitable);
    gathered = same(tmem.data() + 20000, data.data(), 40000) && same(tmem.data() + 60000, data.data() + 100000, 40000);
    const ad::local_range dsts[] = {gr.at(0, 30000), gr.at(90000, 50000)};
    moved_bytes[4] = co_await c.async_get(std::span<const ad::local_range>(dsts), dst.at(20000, 80000), use_awaitable);
    scattered = same(gmem.data(), tmem.data() + 20000, 30000) && same(gmem.data() + 90000, tmem.data() + 50000, 50000);
    // Plain buffers: the registration cache makes pieces as well.
    moved_bytes[5] = co_await c.async_put(asio::buffer(plain), dst.at(7, plain.size()), use_awaitable);
    cached = same(tmem.data() + 7, plain.data(), plain.size());
    moved_bytes[6] = co_await c.async_get(asio::buffer(plain_back), dst.at(7, plain.size()), use_awaitable);
    // Atomics on both sides of an edge.
    if (atomics) {
      // Targets that still carry pieces (a range over the edge, and the
      // whole region moved to the word): the word's own piece key is used.
      std::memset(tmem.data() + word_before, 0, 16);
      const ad::remote_region over_edge = dst.at(word_before, 16);
      ad::remote_region at_after = dst;
      at_after.addr += word_after;
      at_after.length = 8;
      pieces_in_targets = over_edge.pieces.count() + at_after.pieces.count();
      before[0] = co_await c.async_fetch_add(over_edge, 5, use_awaitable);
      before[1] = co_await c.async_fetch_add(at_after, 6, use_awaitable);
      before[2] = co_await c.async_compare_swap(at_after, 6, 60, use_awaitable);
      std::memcpy(words, tmem.data() + word_before, 16);
    }
    // A notification names the range and the key of its first piece.
    moved_bytes[7] = co_await c.async_put_with_notify(lr.at(0, 50000), dst.at(10000, 50000), 77, use_awaitable);
    puts = c.stats().puts;
  });
  CHECK(moved_bytes[0] == lmem.size());
  CHECK(whole);
  CHECK(moved_bytes[1] == 70000);
  CHECK(part);
  CHECK(moved_bytes[2] == 150000);
  CHECK(read);
  CHECK(moved_bytes[3] == 80000);
  CHECK(gathered);
  CHECK(moved_bytes[4] == 80000);
  CHECK(scattered);
  CHECK(moved_bytes[5] == plain.size());
  CHECK(cached);
  CHECK(moved_bytes[6] == plain.size());
  CHECK(plain_back == plain);
  if (atomics) {
    CHECK(pieces_in_targets == 2 + dst.pieces.count());
    CHECK(before[0] == 0);
    CHECK(before[1] == 0);
    CHECK(before[2] == 6);
    CHECK(words[0] == 5);
    CHECK(words[1] == 60);
  }
  CHECK(moved_bytes[7] == 50000);
  CHECK(puts == 5);
  f.check();
  CHECK_FALSE(note_ec);
  CHECK(note.value == 77);
  CHECK(note.range.addr == dst.addr + 10000);
  CHECK(note.range.length == 50000);
  CHECK(note.range.rkey == dst.at(10000, 50000).rkey);
  CHECK(same(tmem.data() + 10000, data.data(), 50000));
  CHECK(p.a.is_open());
}

TEST_CASE("pieces: ranges outside the pieces are refused, large messages still go, deregistered pieces open nothing",
          "[onesided]") {
  onesided_pair p(piece_options());
  std::vector<std::byte> tbuf(256 << 10);
  const std::span<std::byte> tmem(tbuf.data() + 64, 200000);
  ad::memory_region tr =
      p.fb.register_memory(tmem, ad::access::local_write | ad::access::remote_write | ad::access::remote_atomic);
  const ad::remote_region dst = tr.remote();
  REQUIRE(dst.pieces.count() > 10);
  std::vector<std::byte> src = pattern(100000, 3);
  // A message larger than a piece: the rendezvous registration is the
  // device's own (max_piece_bytes does not apply to it).
  const std::vector<std::byte> big = pattern(std::size_t{1} << 20, 4);
  std::vector<std::byte> got;
  bool open_after = false;
  std::size_t put_after = 0;
  failure f;
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    auto m = co_await p.b.async_receive(use_awaitable);
    got.assign(m.bytes().begin(), m.bytes().end());
  }, f.handler());
  p.run([&](ad::connection& c) -> awaitable<void> {
    co_await c.async_send(asio::buffer(big), use_awaitable);
    // Fields changed by hand beyond what the pieces cover: refused before
    // anything is sent, and the connection stays.
    ad::remote_region moved = dst;
    moved.addr += std::uint64_t{1} << 20;
    auto [e1, n1] = co_await c.async_put(asio::buffer(src), moved, asio::as_tuple(use_awaitable));
    CHECK(e1 == ad::errc::out_of_range);
    ad::remote_region longer = dst;
    longer.length += std::uint64_t{1} << 20;
    const std::vector<std::byte> too_much(dst.length + 2 * kPiece);  // past the last piece
    auto [e2, n2] = co_await c.async_put(asio::buffer(too_much), longer, asio::as_tuple(use_awaitable));
    CHECK(e2 == ad::errc::out_of_range);
    if (c.is_open() && p.fa.device().caps().atomics) {
      auto [e3, v3] = co_await c.async_fetch_add(moved, 1, asio::as_tuple(use_awaitable));
      CHECK(e3 == ad::errc::out_of_range);
    }
    // A connection-scoped registration is one window: no pieces (siw has
    // no windows at all, which says not_supported before the size does).
    if (p.fa.device().caps().memory_windows) {
      std::vector<std::byte> scoped(3 * kPiece);
      auto [e4, sr] = co_await c.async_register_memory(scoped, ad::access::local_write | ad::access::remote_write,
                                                       asio::as_tuple(use_awaitable));
      CHECK(e4 == ad::errc::not_supported);
      auto [e5, fits] = co_await c.async_register_memory(std::span(scoped).first(kPiece),
                                                         ad::access::local_write | ad::access::remote_write,
                                                         asio::as_tuple(use_awaitable));
      CHECK_FALSE(e5);
      CHECK(fits.connection_scoped());
    }
    open_after = c.is_open();
    put_after = co_await c.async_put(asio::buffer(src), dst.at(1000, src.size()), use_awaitable);
  });
  f.check();
  CHECK(open_after);
  CHECK(put_after == src.size());
  CHECK(got == big);
  CHECK(same(tmem.data() + 1000, src.data(), src.size()));

  // A plain buffer the cache would need 17 pieces for: registration_failed
  // on the operation, and the connection stays.
  std::vector<std::byte> wide(std::size_t{2} << 20);
  const auto skew = reinterpret_cast<std::uintptr_t>(wide.data()) % kPiece;
  std::byte* const edge = wide.data() + (skew == 0 ? 0 : kPiece - skew);  // a block edge
  ad::memory_region wr = p.fb.register_memory(std::span(edge, 16 * kPiece), ad::access::local_write | ad::access::remote_write);
  REQUIRE(wr.pieces() == 16);
  ad::error_code too_wide;
  bool open_after_wide = false;
  p.run([&](ad::connection& c) -> awaitable<void> {
    auto [ec, n] = co_await c.async_put(asio::buffer(edge + 4096 + 8, 16 * kPiece - 8), wr.remote().at(8, 16 * kPiece - 8),
                                        asio::as_tuple(use_awaitable));
    too_wide = ec;
    open_after_wide = c.is_open();
  });
  CHECK(too_wide == ad::errc::registration_failed);
  CHECK(open_after_wide);

  // Every piece deregisters with the region: a put to a middle piece fails.
  tr.reset();
  ad::error_code after;
  p.run([&](ad::connection& c) -> awaitable<void> {
    auto [ec, n] = co_await c.async_put(asio::buffer(src.data(), 100), dst.at(5 * kPiece, 100),
                                        asio::as_tuple(use_awaitable));
    after = ec;
  });
  CHECK(after == anydoor::transport::wc_status::remote_access_error);
}
