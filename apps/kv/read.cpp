#include "read.hpp"

#include <algorithm>
#include <bit>

namespace anydoor::apps::kv {

neighbourhood scan_neighbourhood(std::span<const std::byte> bytes, std::uint64_t hash) noexcept {
  neighbourhood n;
  if (bytes.size() < kNeighbourhoodBytes) {
    n.torn = true;
    return n;
  }
  std::memcpy(&n.overflow, bytes.data(), sizeof n.overflow);
  for (std::size_t b = 0; b < kNeighborhood; ++b) {
    for (std::size_t i = 0; i < kSlotsPerBucket; ++i) {
      slot s;
      std::memcpy(&s, bytes.data() + b * kBucketSize + kBucketHeader + i * kSlotSize, sizeof s);
      if (s.version == 0 || s.hash != hash) continue;
      if ((s.length & kInlineFlag) != 0 && (s.length & ~kInlineFlag) > kInlineBytes) {
        n.torn = true;  // the CRC would read past the slot
        continue;
      }
      if (slot_crc(s) != s.crc) {
        n.torn = true;
        continue;
      }
      n.cand[n.n++] = s;
    }
  }
  std::sort(n.cand.begin(), n.cand.begin() + static_cast<std::ptrdiff_t>(n.n),
            [](const slot& a, const slot& b) { return a.version > b.version; });
  return n;
}

match check_inline(const slot& s, std::string_view key, std::span<const std::byte>& value) noexcept {
  std::uint16_t k, v;
  std::memcpy(&k, s.data, 2);
  std::memcpy(&v, s.data + 2, 2);
  if (std::size_t{k} + v != (s.length & ~kInlineFlag) || k == 0) return match::torn;
  if (std::string_view(reinterpret_cast<const char*>(s.data + 4), k) != key) return match::other_key;
  value = std::span<const std::byte>(reinterpret_cast<const std::byte*>(s.data + 4 + k), v);
  return match::yes;
}

bool item_in_bounds(const slot& s, const layout& l) noexcept {
  const std::uint64_t len = s.length;
  return (s.length & kInlineFlag) == 0 && len > kItemHeader &&
         len <= kItemHeader + std::uint64_t{l.max_key} + l.max_value && s.offset <= l.arena_size &&
         len <= l.arena_size - s.offset;
}

match check_item(std::span<const std::byte> item, const slot& s, std::string_view key,
                 std::span<const std::byte>& value) noexcept {
  if (item.size() != s.length || item.size() < kItemHeader) return match::torn;
  item_header h;
  std::memcpy(&h, item.data(), sizeof h);
  if (h.version != s.version || std::uint64_t{kItemHeader} + h.key_len + h.value_len != item.size()) {
    return match::torn;
  }
  const std::string_view k(reinterpret_cast<const char*>(item.data() + kItemHeader), h.key_len);
  const std::span<const std::byte> v = item.subspan(kItemHeader + h.key_len, h.value_len);
  if (item_crc(h, k, v) != h.crc) return match::torn;
  if (k != key) return match::other_key;
  value = v;
  return match::yes;
}

bool layout_usable(const layout& l, std::uint64_t region_length) noexcept {
  if (l.magic != layout::kMagic || l.bucket_size != kBucketSize || l.slot_size != kSlotSize ||
      l.slots_per_bucket != kSlotsPerBucket || l.buckets == 0 || !std::has_single_bit(l.buckets) ||
      l.buckets > (std::uint64_t{1} << 40) || l.max_key == 0 || l.max_key > 65535 ||
      l.max_value > (std::uint32_t{1} << 30)) {
    return false;
  }
  const std::uint64_t index = (l.buckets + 1) * kBucketSize;
  return index <= l.arena_offset && l.arena_offset <= region_length && l.arena_size <= region_length - l.arena_offset;
}

}  // namespace anydoor::apps::kv
