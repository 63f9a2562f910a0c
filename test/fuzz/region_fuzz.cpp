// libFuzzer target: remote_region::unpack, the descriptor a peer hands over
// for one-sided access (one key, or one per piece). A region that unpacks
// has a nonzero length that does not wrap, pieces that cover exactly its
// range, packs back to the same bytes, and at() never yields a sub-range
// outside it or a key that is not the region's for that address.
#include <anydoor/error.hpp>
#include <anydoor/memory.hpp>

#include <cstdlib>
#include <cstring>
#include <span>
#include <system_error>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);
  anydoor::remote_region r{1, 2, 3};
  const anydoor::remote_region before = r;
  const std::error_code ec = anydoor::remote_region::unpack(in, r);
  if (ec) {
    if (!(r == before)) std::abort();  // unchanged on error
    return 0;
  }
  if (r.length == 0 || r.addr + r.length < r.addr) std::abort();
  if (anydoor::remote_region::packed_length_of(in) != size || r.packed_length() != size) std::abort();
  const anydoor::remote_pieces& p = r.pieces;
  if (!p.empty() && (p.count() < 2 || !p.covers(r.addr, r.length) || p.base() != r.addr >> p.shift() ||
                     ((r.addr + r.length - 1) >> p.shift()) - p.base() != p.count() - 1 || p.key(0) != r.rkey)) {
    std::abort();
  }
  const auto again = r.pack();
  if (again.size() != size || std::memcmp(again.data(), data, again.size()) != 0) std::abort();
  // Sub-ranges from the bytes after the descriptor's own fields.
  std::uint64_t off = 0, len = 0;
  std::memcpy(&off, data + 8, 8);
  std::memcpy(&len, data + 16, 8);
  for (auto [o, l] : {std::pair{off, len}, std::pair{off % (r.length + 1), len % (r.length + 1)}}) {
    try {
      const anydoor::remote_region s = r.at(o, l);
      if (s.addr < r.addr || s.length > r.length || s.addr - r.addr > r.length - s.length) std::abort();
      if (p.empty() && s.rkey != r.rkey) std::abort();
      if (!p.empty() && s.length != 0) {
        // Every piece of the sub-range is the region's piece there.
        if (s.rkey != p.key_at(s.addr)) std::abort();
        if (!s.pieces.empty()) {
          if (!s.pieces.covers(s.addr, s.length)) std::abort();
          for (std::uint64_t a = s.addr; a - s.addr < s.length; a = s.pieces.piece_end(a)) {
            if (s.pieces.key_at(a) != p.key_at(a)) std::abort();
            if (s.pieces.piece_end(a) <= a) break;  // the top of the address space
          }
        }
      }
    } catch (const std::system_error& e) {
      if (e.code() != anydoor::errc::out_of_range) std::abort();
    }
  }
  return 0;
}
