// The key-value store's table as the server lays it out in registered
// memory and clients READ it (one-sided GET). Server and client share this
// header; the layout descriptor travels by RPC (kv.layout).
//
// The region: the index, then the arena.
//   index: buckets + 1 buckets of kBucketSize bytes (a key homed in bucket
//          b lives in a slot of bucket b or b + 1: one READ of 2 buckets
//          sees every slot it can be in), each a 64-byte header (the count
//          of keys homed here that overflowed into the server-only table)
//          and kSlotsPerBucket slots.
//   slot:  version (0: empty), the key's 64-bit hash, the item's arena
//          offset and length, a CRC-32C of those (and of the inline bytes);
//          a small key and value live in the slot itself (inline).
//   item:  version, key length, value length, CRC-32C of all that and the
//          key and value bytes; then the key, then the value.
// Updates are out of place: a new item (or slot) is written completely
// before the slot points at it, and an old item's memory may be reused
// only after that. A reader validates the slot's CRC, then the item's
// version (equal to the slot's), key and CRC; anything else is a torn or
// moved read, retried a bounded number of times.
// Every integer is little-endian (the x86-64 and arm64 hosts this runs on).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>

namespace anydoor::apps::kv {

inline constexpr std::size_t kBucketSize = 512;
inline constexpr std::size_t kBucketHeader = 64;
inline constexpr std::size_t kSlotSize = 112;
inline constexpr std::size_t kSlotsPerBucket = 4;
inline constexpr std::size_t kNeighborhood = 2;  // buckets one READ covers
inline constexpr std::size_t kInlineBytes = 76;  // key + value bytes a slot holds
inline constexpr std::uint32_t kInlineFlag = 0x80000000u;
inline constexpr std::size_t kItemHeader = 24;
static_assert(kBucketHeader + kSlotsPerBucket * kSlotSize == kBucketSize);

struct slot {
  std::uint64_t version;  // 0: empty
  std::uint64_t hash;
  std::uint64_t offset;   // the item's offset in the arena (inline: 0)
  std::uint32_t length;   // the item's bytes; inline: kInlineFlag | (key + value bytes)
  std::uint32_t crc;      // CRC-32C of the 28 bytes before it (and, inline, of data[0 .. 4 + k + v])
  std::uint8_t data[80];  // inline: u16 key length, u16 value length, key, value
};
static_assert(sizeof(slot) == kSlotSize);

struct bucket_header {
  std::uint32_t overflow;  // keys homed in this bucket kept in the server-only table
  std::uint8_t reserved[60];
};
static_assert(sizeof(bucket_header) == kBucketHeader);

struct item_header {
  std::uint64_t version;
  std::uint32_t key_len;
  std::uint32_t value_len;
  std::uint32_t crc;  // CRC-32C of version, key_len, value_len, key, value
  std::uint32_t reserved;
};
static_assert(sizeof(item_header) == kItemHeader);

// CRC-32C (Castagnoli); hardware where the CPU has it.
std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t n) noexcept;

// The key's 64-bit hash under the table's seed (random per server start).
std::uint64_t key_hash(std::uint64_t seed, std::string_view key) noexcept;

inline std::uint32_t slot_crc(const slot& s) noexcept {
  std::uint32_t c = crc32c(0, &s, 28);
  if ((s.length & kInlineFlag) != 0) c = crc32c(c, s.data, 4 + (s.length & ~kInlineFlag));
  return c;
}
inline std::uint32_t item_crc(const item_header& h, std::string_view key, std::span<const std::byte> value) noexcept {
  std::uint32_t c = crc32c(0, &h, 16);
  c = crc32c(c, key.data(), key.size());
  return crc32c(c, value.data(), value.size());
}

// The descriptor kv.layout returns (fixed size, validated by the client).
struct layout {
  static constexpr std::uint32_t kMagic = 0x314c564b;  // "KVL1"
  std::uint32_t magic = kMagic;
  std::uint32_t bucket_size = kBucketSize;
  std::uint32_t slot_size = kSlotSize;
  std::uint32_t slots_per_bucket = kSlotsPerBucket;
  std::uint64_t seed = 0;
  std::uint64_t buckets = 0;        // a power of two; the index holds buckets + 1
  std::uint64_t arena_offset = 0;   // the index starts at 0
  std::uint64_t arena_size = 0;
  std::uint32_t max_key = 0;
  std::uint32_t max_value = 0;
  std::uint8_t region[32] = {};     // remote_region::pack() of the whole table (remote read only)
};
static_assert(sizeof(layout) == 88);

}  // namespace anydoor::apps::kv
