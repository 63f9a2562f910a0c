// A one-sided GET's checks (pure functions over what a READ brought back):
// the neighbourhood of a key's home bucket, then an inline slot or the
// item it points at. Nothing read is trusted: a slot counts only with a
// good CRC, an item only with the slot's version, the key, and a good CRC;
// a slot pointing outside the arena is torn, never READ.
#pragma once

#include "layout.hpp"

#include <array>
#include <cstdint>
#include <span>
#include <string_view>

namespace anydoor::apps::kv {

inline constexpr std::size_t kNeighbourhoodBytes = kNeighborhood * kBucketSize;

struct neighbourhood {
  std::uint32_t overflow = 0;  // the home bucket's keys kept in the server-only table
  bool torn = false;           // a slot with this hash failed its CRC
  std::array<slot, kNeighborhood * kSlotsPerBucket> cand{};  // hash matches, highest version first
  std::size_t n = 0;
};
neighbourhood scan_neighbourhood(std::span<const std::byte> bytes, std::uint64_t hash) noexcept;

enum class match { yes, other_key, torn };
// An inline slot: `value` points into the slot.
match check_inline(const slot& s, std::string_view key, std::span<const std::byte>& value) noexcept;
// Where the slot's item lies in the arena, if it lies inside it (and is
// not larger than the limits the layout states).
bool item_in_bounds(const slot& s, const layout& l) noexcept;
// The item READ from the slot's offset (s.length bytes): `value` points into `item`.
match check_item(std::span<const std::byte> item, const slot& s, std::string_view key,
                 std::span<const std::byte>& value) noexcept;
// A layout a server sent: every size as this build lays it out, the index
// and arena inside the region. False: do not READ (GET by RPC instead).
bool layout_usable(const layout& l, std::uint64_t region_length) noexcept;

}  // namespace anydoor::apps::kv
