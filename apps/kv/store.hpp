// The store: the hash table of layout.hpp in one memory area (the index and
// the arena), which the server registers for remote reads. Updates are out
// of place (a new item or slot, then the slot points at it). Keys whose
// neighbourhood is full go to a server-only overflow table (their items
// still in the arena), counted in their home bucket's header so a reader
// knows to ask by RPC.
//
// Memory: --max-memory bounds the arena (items: header, key, value,
// rounded to a size class); small items live inline in their slot. A put
// that does not fit fails with out_of_memory and changes nothing. Freed
// blocks merge with free neighbours and go back to the top, and a larger
// free block is split for a smaller item: memory freed by one size of
// item serves any other (a client that fills the store with small items
// and deletes them leaves it as empty as it found it).
// Single-threaded (the server's io thread).
#pragma once

#include "layout.hpp"

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace anydoor::apps::kv {

struct store_options {
  std::uint64_t max_memory = std::uint64_t{64} << 20;  // arena bytes
  std::uint32_t max_key = 1024;
  std::uint32_t max_value = std::uint32_t{1} << 20;
  std::uint64_t buckets = 0;  // 0: one per 1 KiB of max_memory (a power of two, at least 1024)
};

struct store_stats {
  std::uint64_t keys = 0;
  std::uint64_t inline_keys = 0;
  std::uint64_t overflow_keys = 0;
  std::uint64_t used_bytes = 0;  // arena bytes held by items
  // Heap the overflow table takes for its keys (an estimate per entry:
  // its node, and the key where it does not fit the string itself),
  // counted against --max-memory with used_bytes: a client that aims keys
  // at full neighbourhoods cannot grow the heap past the limit.
  std::uint64_t overflow_bytes = 0;
  std::uint64_t live_bytes = 0;  // key + value bytes of every key
};

enum class put_status { ok, too_large, out_of_memory };

// What a key held before a put or del changed it: nothing, a small value
// that lived in its slot (copied here), or an item in the arena, which the
// store then keeps allocated (store::release, or restored) so that the
// write can be taken back (the kv service's undo journal).
struct prior {
  enum class kind : std::uint8_t { absent, inline_value, item };
  kind what = kind::absent;
  std::uint32_t size = 0;  // inline_value
  std::uint64_t item = 0;  // item: its offset in the arena
  std::array<std::byte, kInlineBytes> bytes;  // inline_value: the first `size` (left uninitialized: a copy per write)
  std::span<const std::byte> value() const noexcept { return {bytes.data(), size}; }
};

class store {
 public:
  explicit store(const store_options& o);
  ~store();
  store(const store&) = delete;
  store& operator=(const store&) = delete;

  // The whole table (index + arena), to register with remote read access.
  std::span<std::byte> memory() const noexcept { return {base_, total_}; }
  // The layout descriptor, without the region (the server adds it).
  layout describe() const noexcept;
  const store_options& options() const noexcept { return o_; }

  // `replay`: from the log at start (may use the arena's slack above
  // max_memory, since items can be placed differently than before).
  // `was` (if given): what the key held before, set when the put is ok or
  // the del found the key; an arena item there is not released.
  put_status put(std::string_view key, std::span<const std::byte> value, bool replay = false, prior* was = nullptr);
  bool del(std::string_view key, prior* was = nullptr) noexcept;
  // An arena item a put or del left allocated (prior::kind::item): its
  // value, and its release.
  std::span<const std::byte> item_value(std::uint64_t offset) const noexcept { return item_view(offset).value; }
  void release(std::uint64_t offset) noexcept { release_item(offset); }
  // The arena's size class of an item of this key and value size.
  std::size_t item_class(std::size_t key_size, std::size_t value_size) const noexcept;
  // Whether that kept item's block, once released (merged with the free
  // blocks beside it, or given back to the top), can take an item of
  // class `c` at once.
  bool block_fits(std::uint64_t offset, std::size_t c) const noexcept;
  // Whether a free block of class `c` or larger waits, or the top has room
  // for one. When a put of that class has just failed, --max-memory kept
  // it out, not the blocks (only so after a restart placed items in the
  // arena's slack: otherwise the blocks in use and free never add up to
  // more than --max-memory), and releasing any item brings it closer.
  bool free_block_for(std::size_t c) const noexcept;
  // The arena's blocks walked and checked against the free lists and
  // used_bytes (for tests): empty when consistent, else the first fault.
  std::string check_arena() const;
  std::uint64_t free_blocks() const noexcept { return free_count_; }  // (for tests)
  // A view of the value, valid until the next put or del.
  std::optional<std::span<const std::byte>> get(std::string_view key) const noexcept;
  bool contains(std::string_view key) const noexcept { return get(key).has_value(); }

  // Every key and value (order unspecified); `f` must not modify the store.
  void for_each(const std::function<void(std::string_view, std::span<const std::byte>)>& f) const;
  // The same in steps, with the store changed in between (a compaction's
  // snapshot, taken while requests go on), of the keys written before
  // version `before` (next_version() when the snapshot began: what was
  // written since has records of its own after it, and leaving it out
  // keeps the snapshot a part of the store as it was then, never more).
  // The slot table from bucket `from` on, until `budget` is spent (each
  // bucket visited costs kBucketSize, each key what f returns: the bytes
  // the snapshot wrote for it, its record; checked
  // per bucket, so a step may pass it by a bucket's keys); returns where
  // the next step starts, slot_buckets() once done, and leaves in `budget`
  // what is left of it. Then the overflow table (each key visited costs
  // 64 bytes besides what f returns), in key order after
  // `after` ("" to begin; keys are never empty), `after` set to the last
  // key seen; true once done. A key stays in its slot, or in the overflow
  // table, until it is deleted, so a key left alone is seen exactly once.
  using charged_fn = std::function<std::size_t(std::string_view, std::span<const std::byte>)>;
  std::uint64_t for_each_from(std::uint64_t from, std::size_t& budget, std::uint64_t before,
                              const charged_fn& f) const;
  bool for_each_overflow_from(std::string& after, std::size_t& budget, std::uint64_t before,
                              const charged_fn& f) const;
  std::uint64_t next_version() const noexcept { return next_version_; }
  std::uint64_t slot_buckets() const noexcept { return buckets_ + 1; }
  store_stats stats() const noexcept { return st_; }
  // What counts against max_memory: the arena's blocks in use and the
  // overflow table's heap (INFO's used_memory).
  std::uint64_t charged_bytes() const noexcept { return st_.used_bytes + st_.overflow_bytes; }
  // The index was faulted in at construction (not when it would take more
  // than half the RAM or the memory cgroup's limit, nor when the kernel
  // refused: it is then faulted in as keys arrive).
  bool index_resident() const noexcept { return index_resident_; }

 private:
  struct found {
    slot* s = nullptr;                          // in the index
    std::map<std::string, std::uint64_t, std::less<>>::iterator of;  // else in the overflow table
    bool in_overflow = false;
  };
  struct view {
    std::string_view key;
    std::span<const std::byte> value;
  };
  bucket_header& header(std::uint64_t b) const noexcept {
    return *reinterpret_cast<bucket_header*>(base_ + b * kBucketSize);
  }
  slot& slot_at(std::uint64_t b, std::size_t i) const noexcept {
    return *reinterpret_cast<slot*>(base_ + b * kBucketSize + kBucketHeader + i * kSlotSize);
  }
  view item_view(std::uint64_t offset) const noexcept;
  view slot_view(const slot& s) const noexcept;
  std::optional<found> find(std::uint64_t h, std::string_view key) const noexcept;
  slot* free_slot(std::uint64_t home, const slot* except) const noexcept;

  std::uint64_t write_item(std::uint64_t version, std::string_view key, std::span<const std::byte> value,
                           bool replay, std::uint64_t extra = 0);
  void release_item(std::uint64_t offset) noexcept;
  void fill_inline(slot& s, std::uint64_t version, std::uint64_t h, std::string_view key,
                   std::span<const std::byte> value) noexcept;
  void point(slot& s, std::uint64_t version, std::uint64_t h, std::uint64_t offset, std::uint32_t length) noexcept;
  // `was`: as del's (the item kept).
  void forget(const found& f, std::uint64_t home, prior* was) noexcept;
  void capture(const found& f, prior& was) const noexcept;  // what f holds, into was

  // The arena: blocks from offset 0 up to bump_ (the top, free above),
  // each a multiple of 8 bytes, at least kMinBlock. Every block starts
  // with an item_header whose last word (`reserved`, outside the item's
  // CRC: readers never look at it) is the block's tag: its size | kFree |
  // kPrevFree (the block below it is free). A free block's header has
  // version 0 (no slot points at it; a reader still on its way to it
  // fails its checks), links to the next (bytes 8..16) and previous
  // (24..32) free block of its bin, and its size in its last 8 bytes, for
  // the block above to find its start. Bins: one per size class, holding
  // the free blocks at least that class's size and below the next's.
  // Freed blocks merge with free neighbours (up to kMaxBlock) and return
  // to the top when they reach it.
  std::size_t size_class(std::size_t n) const noexcept;
  struct grant {
    std::uint64_t offset;
    std::uint32_t tag;  // for the item's header
  };
  // `extra`: bytes charged besides the block (an overflow entry's).
  std::optional<grant> allocate(std::size_t c, bool replay, std::uint64_t extra = 0) noexcept;
  std::byte* arena_at(std::uint64_t off) const noexcept { return base_ + arena_offset_ + off; }
  std::uint32_t tag_at(std::uint64_t off) const noexcept;
  void set_tag(std::uint64_t off, std::uint32_t tag) noexcept;
  std::uint64_t word_at(std::uint64_t off) const noexcept;
  void set_word(std::uint64_t off, std::uint64_t v) noexcept;
  std::size_t bin_of(std::uint64_t size) const noexcept;
  void link_free(std::uint64_t off, std::uint64_t size, std::uint32_t prev_free) noexcept;
  void unlink_free(std::uint64_t off) noexcept;
  void mark_prev_free(std::uint64_t next, bool free) noexcept;

  store_options o_;
  std::byte* base_ = nullptr;
  std::size_t total_ = 0;
  std::uint64_t buckets_ = 0;
  std::uint64_t arena_offset_ = 0;
  std::uint64_t arena_size_ = 0;  // max_memory and a quarter more (for replays)
  std::uint64_t seed_ = 0;
  std::uint64_t next_version_ = 1;
  bool index_resident_ = false;
  std::uint64_t bump_ = 0;  // the top: the arena's blocks end here
  std::vector<std::size_t> class_sizes_;
  std::vector<std::uint64_t> bins_;      // each bin's first free block (kNoBlock: none)
  std::vector<std::uint64_t> bin_bits_;  // bit k: bins_[k] has one
  std::uint64_t free_count_ = 0;
  // Overflowed keys: key -> item offset.
  // (ordered: a snapshot resumes after the last key it took)
  mutable std::map<std::string, std::uint64_t, std::less<>> overflow_;
  store_stats st_;
};

}  // namespace anydoor::apps::kv
