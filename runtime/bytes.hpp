// Byte helpers of the runtime's wire forms (runtime-internal): little-endian
// loads and stores, and the FNV-1a check of a packed remote_region.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace anydoor::detail {

// Stores v at p, least significant byte first, and moves p past it.
template <class T>
void put_le(std::byte*& p, T v) noexcept {
  static_assert(std::is_unsigned_v<T>);
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    *p++ = static_cast<std::byte>((static_cast<std::uint64_t>(v) >> (8 * i)) & 0xff);
  }
}

// Loads a T stored by put_le at p and moves p past it.
template <class T>
T get_le(const std::byte*& p) noexcept {
  static_assert(std::is_unsigned_v<T>);
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) v |= std::uint64_t{std::to_integer<std::uint8_t>(*p++)} << (8 * i);
  return static_cast<T>(v);
}

// 32-bit FNV-1a of n bytes.
constexpr std::uint32_t fnv1a32(const std::byte* p, std::size_t n) noexcept {
  std::uint32_t h = 2166136261u;
  for (std::size_t i = 0; i < n; ++i) {
    h ^= std::to_integer<std::uint32_t>(p[i]);
    h *= 16777619u;
  }
  return h;
}

}  // namespace anydoor::detail
