// anydoor-perf's plan: what the client asks the server for, sent in its
// connection request, and the schedule (sizes, iterations, warm-up) both
// sides derive from it alone.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string_view>
#include <vector>

namespace anydoor::bench {

enum class test_kind : std::uint8_t { lat = 1, send_bw, msg_rate, write_bw, read_bw, atomic_lat, write_lat };
inline constexpr std::array<std::string_view, 8> kNames{"",        "lat",     "send_bw",    "msg_rate",
                                                        "write_bw", "read_bw", "atomic_lat", "write_lat"};

inline constexpr std::uint32_t kMaxSize = 64u << 20;
inline constexpr std::uint32_t kMaxWindow = 4096;
inline constexpr std::uint32_t kMaxIters = 1'000'000'000;
inline constexpr std::uint32_t kSweepFirst = 2, kSweepLast = 8u << 20;
inline constexpr std::uint32_t kSweepFullIters = 8192;  // sizes up to this run all the iterations
inline constexpr std::uint32_t kSweepMinIters = 100;

// What the client asks for; sent in its connection request.
struct plan {
  test_kind test = test_kind::lat;
  bool all_sizes = false;
  std::uint32_t size = 64;
  std::uint32_t iters = 10000;
  std::uint32_t window = 32;
};

inline constexpr std::array<std::byte, 3> kPlanMagic{std::byte{'A'}, std::byte{'P'}, std::byte{1}};  // "AP", version 1
inline constexpr std::size_t kPlanSize = 3 + 1 + 1 + 4 + 4 + 4;


inline void put_u32(std::byte* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::byte>(v >> (8 * i));
}
inline std::uint32_t get_u32(const std::byte* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= std::to_integer<std::uint32_t>(p[i]) << (8 * i);
  return v;
}

inline std::array<std::byte, kPlanSize> encode(const plan& p) {
  std::array<std::byte, kPlanSize> b{};
  std::copy(kPlanMagic.begin(), kPlanMagic.end(), b.begin());
  b[3] = static_cast<std::byte>(p.test);
  b[4] = static_cast<std::byte>(p.all_sizes ? 1 : 0);
  put_u32(&b[5], p.size);
  put_u32(&b[9], p.iters);
  put_u32(&b[13], p.window);
  return b;
}

// A client's plan, checked as any peer's input is: throws on anything out of range.
inline plan decode(std::span<const std::byte> b) {
  if (b.size() != kPlanSize || !std::equal(kPlanMagic.begin(), kPlanMagic.end(), b.begin())) {
    throw std::runtime_error("the client sent no anydoor-perf plan (another program, or another version)");
  }
  plan p;
  const auto t = std::to_integer<std::uint8_t>(b[3]);
  const auto all = std::to_integer<std::uint8_t>(b[4]);
  p.size = get_u32(&b[5]);
  p.iters = get_u32(&b[9]);
  p.window = get_u32(&b[13]);
  if (t < 1 || t >= kNames.size() || all > 1 || p.size < 1 || p.size > kMaxSize || p.iters < 1 ||
      p.iters > kMaxIters || p.window < 1 || p.window > kMaxWindow) {
    throw std::runtime_error("the client's plan is out of range");
  }
  p.test = static_cast<test_kind>(t);
  p.all_sizes = all == 1;
  if (p.test == test_kind::atomic_lat && p.size != 8) throw std::runtime_error("the client's plan is out of range");
  return p;
}

inline bool streamed(test_kind t) {
  return t == test_kind::send_bw || t == test_kind::msg_rate || t == test_kind::write_bw || t == test_kind::read_bw;
}

inline std::vector<std::uint32_t> sizes_of(const plan& p) {
  if (!p.all_sizes || p.test == test_kind::atomic_lat) return {p.size};
  std::vector<std::uint32_t> v;
  for (std::uint32_t s = kSweepFirst; s <= kSweepLast; s *= 2) v.push_back(s);
  return v;
}

inline std::uint32_t iters_at(const plan& p, std::uint32_t size) {
  if (!p.all_sizes || size <= kSweepFullIters) return p.iters;
  const std::uint64_t scaled = std::uint64_t{p.iters} * kSweepFullIters / size;
  return static_cast<std::uint32_t>(std::min<std::uint64_t>(p.iters, std::max<std::uint64_t>(scaled, kSweepMinIters)));
}

inline std::uint32_t warmup_for(std::uint32_t iters) { return std::clamp<std::uint32_t>(iters / 10, 10, 1000); }

}  // namespace anydoor::bench
