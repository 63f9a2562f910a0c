// libFuzzer target: remote_region::unpack, the descriptor a peer hands over
// for one-sided access. A region that unpacks has a nonzero length that does
// not wrap, packs back to the same bytes, and at() never yields a sub-range
// outside it.
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
  if (size != anydoor::remote_region::packed_size || r.length == 0 || r.addr + r.length < r.addr) std::abort();
  const auto again = r.pack();
  if (std::memcmp(again.data(), data, again.size()) != 0) std::abort();
  // Sub-ranges from the bytes after the descriptor's own fields.
  std::uint64_t off = 0, len = 0;
  std::memcpy(&off, data + 8, 8);
  std::memcpy(&len, data + 16, 8);
  for (auto [o, l] : {std::pair{off, len}, std::pair{off % (r.length + 1), len % (r.length + 1)}}) {
    try {
      const anydoor::remote_region s = r.at(o, l);
      if (s.addr < r.addr || s.length > r.length || s.addr - r.addr > r.length - s.length || s.rkey != r.rkey) {
        std::abort();
      }
    } catch (const std::system_error& e) {
      if (e.code() != anydoor::errc::out_of_range) std::abort();
    }
  }
  return 0;
}
