#include "layout.hpp"

#include <array>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace anydoor::apps::kv {

namespace {

constexpr std::array<std::uint32_t, 256> make_table() {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) != 0 ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr auto kTable = make_table();

std::uint32_t crc_soft(std::uint32_t c, const std::uint8_t* p, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) c = kTable[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) std::uint32_t crc_hw(std::uint32_t c, const std::uint8_t* p,
                                                       std::size_t n) noexcept {
  std::uint64_t c64 = c;
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
    p += 8;
    n -= 8;
  }
  c = static_cast<std::uint32_t>(c64);
  while (n-- > 0) c = _mm_crc32_u8(c, *p++);
  return c;
}
const bool kHaveHw = __builtin_cpu_supports("sse4.2");
#endif

}  // namespace

std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t n) noexcept {
  const auto* p = static_cast<const std::uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  crc = kHaveHw ? crc_hw(crc, p, n) : crc_soft(crc, p, n);
#else
  crc = crc_soft(crc, p, n);
#endif
  return ~crc;
}

std::uint64_t key_hash(std::uint64_t seed, std::string_view key) noexcept {
  auto mix = [](std::uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
  };
  std::uint64_t h = mix(seed ^ (key.size() * 0x9e3779b97f4a7c15ull));
  std::size_t i = 0;
  for (; i + 8 <= key.size(); i += 8) {
    std::uint64_t w;
    std::memcpy(&w, key.data() + i, 8);
    h = mix(h ^ w) + 0x9e3779b97f4a7c15ull;
  }
  std::uint64_t tail = 0;
  if (key.size() > i) std::memcpy(&tail, key.data() + i, key.size() - i);
  return mix(h ^ tail ^ (std::uint64_t{key.size() - i} << 56));
}

}  // namespace anydoor::apps::kv
