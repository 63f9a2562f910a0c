// Where the counter `i` falls in a ring of `n` slots: i % n, without a
// division when n is a power of two (the sizes the runtime asks for by
// default). A 64-bit division costs about ten cycles of latency, and one
// message touches several rings on each side.
#pragma once

#include <cassert>
#include <cstddef>
#include <cstdint>

namespace anydoor {

inline std::size_t ring_slot(std::uint64_t i, std::uint64_t n) noexcept {
  assert(n != 0);
  return static_cast<std::size_t>((n & (n - 1)) == 0 ? i & (n - 1) : i % n);
}

}  // namespace anydoor
