// Test support: command-line values of the test tools (soak, netem check).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

namespace anydoor::test {

// A whole decimal number in [lo, hi]; nullopt otherwise.
inline std::optional<std::uint32_t> parse_number(const char* s, unsigned long lo, unsigned long hi) {
  char* end = nullptr;
  const unsigned long v = std::strtoul(s, &end, 10);
  if (end == s || *end != '\0' || v < lo || v > hi) return std::nullopt;
  return static_cast<std::uint32_t>(v);
}

inline std::string number_range_error(const char* s, unsigned long lo, unsigned long hi) {
  return "expected a number in " + std::to_string(lo) + ".." + std::to_string(hi) + ": " + s;
}

}  // namespace anydoor::test
