#include "store.hpp"

#include <limits>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <system_error>

#include <sys/mman.h>
#include <unistd.h>

namespace anydoor::apps::kv {

namespace {

constexpr std::uint64_t kPage = 4096;
// Arena blocks (store.hpp): the tag's flags, the smallest block (a free
// one's header, links and size) and the largest a merge makes.
constexpr std::uint32_t kFree = 1;
constexpr std::uint32_t kPrevFree = 2;
constexpr std::uint32_t kSizeMask = ~std::uint32_t{7};
constexpr std::uint64_t kMinBlock = 40;
constexpr std::uint64_t kMaxBlock = std::uint64_t{1} << 31;
constexpr std::uint64_t kNoBlock = ~std::uint64_t{0};
constexpr std::size_t kTagAt = 20;   // item_header::reserved
constexpr std::size_t kNextAt = 8;   // a free block's links
constexpr std::size_t kPrevAt = 24;

// What an overflow table entry takes from the heap (store_stats::overflow_bytes):
// a map node (links, colour, a std::string, the offset) and its
// allocation's overhead, and the key's bytes past the string's own 15.
std::uint64_t overflow_charge(std::size_t key_size) noexcept { return 96 + (key_size > 15 ? key_size + 1 : 0); }
constexpr std::size_t kHugePage = std::size_t{2} << 20;
#ifdef MADV_POPULATE_WRITE
constexpr int kPopulateWrite = MADV_POPULATE_WRITE;
#else
constexpr int kPopulateWrite = 23;  // Linux 5.14; older kernels say EINVAL
#endif

std::uint64_t round_up(std::uint64_t n, std::uint64_t to) { return (n + to - 1) / to * to; }

// The RAM, or the memory cgroup's limit when that is lower (v2
// memory.max, v1 memory.limit_in_bytes; inside a container the cgroup
// file system shows the container's own at its root).
std::uint64_t usable_memory() {
  std::uint64_t m = static_cast<std::uint64_t>(::sysconf(_SC_PHYS_PAGES)) *
                    static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  auto limit_in = [&m](const std::string& file) {
    if (std::FILE* g = std::fopen(file.c_str(), "r")) {
      unsigned long long limit = 0;
      if (std::fscanf(g, "%llu", &limit) == 1 && limit > 0) m = std::min<std::uint64_t>(m, limit);  // ("max": none)
      std::fclose(g);
    }
  };
  if (std::FILE* f = std::fopen("/proc/self/cgroup", "r")) {
    char line[512];
    while (std::fgets(line, sizeof line, f) != nullptr) {
      std::string l = line;
      while (!l.empty() && (l.back() == '\n' || l.back() == '\r')) l.pop_back();
      if (l.rfind("0::", 0) == 0) {
        limit_in("/sys/fs/cgroup" + l.substr(3) + "/memory.max");
        limit_in("/sys/fs/cgroup/memory.max");
      } else if (const auto at = l.find(":memory:"); at != std::string::npos) {
        limit_in("/sys/fs/cgroup/memory" + l.substr(at + 8) + "/memory.limit_in_bytes");
        limit_in("/sys/fs/cgroup/memory/memory.limit_in_bytes");
      }
    }
    std::fclose(f);
  }
  return m;
}

// Publishes a slot's version after everything it covers is written (a NIC
// reads the memory without our locks; a reader checks the CRC anyway).
void publish(slot& s, std::uint64_t version) noexcept {
  std::atomic_thread_fence(std::memory_order_release);
  std::atomic_ref<std::uint64_t>(s.version).store(version, std::memory_order_relaxed);
}

}  // namespace

store::store(const store_options& o) : o_(o) {
  if (o_.max_memory < 4096 || o_.max_memory > (std::uint64_t{1} << 40)) {
    throw std::invalid_argument("max memory must be 4 KiB .. 1 TiB");
  }
  if (o_.max_key < 1 || o_.max_key > 65535 || o_.max_value > (std::uint32_t{1} << 30)) {
    throw std::invalid_argument("max key must be 1 .. 65535 bytes, max value at most 1 GiB");
  }
  buckets_ = o_.buckets != 0 ? o_.buckets : std::max<std::uint64_t>(1024, o_.max_memory / 1024);
  buckets_ = std::bit_ceil(buckets_);
  arena_offset_ = round_up((buckets_ + 1) * kBucketSize, kPage);
  arena_size_ = round_up(o_.max_memory + o_.max_memory / 4, kPage);  // the slack only a replay uses
  total_ = static_cast<std::size_t>(arena_offset_ + arena_size_);
  // Mapped on a huge-page boundary, huge pages asked for the index: every
  // GET and PUT lands on a random bucket, and with 4 KiB pages each one is
  // a TLB miss (a two-level page walk under a hypervisor: 89 ns against
  // 9 ns per random read of a 128 MiB index here). Ignored where THP is
  // off. Not the arena: it fills from the bottom, and a first touch of a
  // huge page there would zero 2 MiB on the io thread at once.
  const std::size_t mapped = total_ + kHugePage;
  void* p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    throw std::system_error(errno, std::generic_category(), "cannot map " + std::to_string(total_) + " bytes");
  }
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t aligned = (at + kHugePage - 1) & ~std::uintptr_t{kHugePage - 1};
  if (aligned > at) ::munmap(p, aligned - at);
  if (const std::size_t tail = at + mapped - (aligned + total_); tail > 0) {
    ::munmap(reinterpret_cast<void*>(aligned + total_), tail);
  }
  base_ = reinterpret_cast<std::byte*>(aligned);
  ::madvise(base_, static_cast<std::size_t>(arena_offset_), MADV_HUGEPAGE);
  // The index is faulted in now, in one call (0.8 us a 4 KiB page here,
  // against 11 us for a fault taken on first touch): otherwise the first
  // write to each page of it pays a fault on the io thread, and a fresh
  // server answers its first 100k SETs at a third of its rate. Not when
  // the index would take more than half the memory this process may use
  // (the RAM, or its cgroup's memory.max when lower): an index that large
  // stays lazy, faulted in as keys arrive. The arena fills from the
  // bottom, a page faulted once per many items.
  if (arena_offset_ <= usable_memory() / 2) {
    if (::madvise(base_, static_cast<std::size_t>(arena_offset_), kPopulateWrite) == 0) {
      index_resident_ = true;
    } else if (errno == EINVAL) {  // kernels before 5.14: one touch a page
      const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
      auto* v = reinterpret_cast<volatile unsigned char*>(base_);
      for (std::uint64_t i = 0; i < arena_offset_; i += page) v[i] = 0;
      index_resident_ = true;
    }
    // (ENOMEM and the like: left lazy, as a larger index is)
  }
  std::random_device rd;
  seed_ = (std::uint64_t{rd()} << 32) ^ rd();
  // Size classes: 40 .. 64 by 8, then four per power of two, up to the
  // largest item (1.25 GiB at most: below kMaxBlock).
  const std::size_t largest = kItemHeader + o_.max_key + o_.max_value;
  std::vector<std::size_t> sizes;
  for (std::size_t s = kMinBlock; s <= 64; s += 8) sizes.push_back(s);
  for (std::size_t p2 = 64; sizes.back() < largest; p2 *= 2) {
    for (std::size_t q = 1; q <= 4; ++q) sizes.push_back(p2 + q * (p2 / 4));
  }
  class_sizes_ = std::move(sizes);
  bins_.assign(class_sizes_.size(), kNoBlock);
  bin_bits_.assign((class_sizes_.size() + 63) / 64, 0);
}

store::~store() { ::munmap(base_, total_); }

layout store::describe() const noexcept {
  layout l;
  l.seed = seed_;
  l.buckets = buckets_;
  l.arena_offset = arena_offset_;
  l.arena_size = total_ - arena_offset_;
  l.max_key = o_.max_key;
  l.max_value = o_.max_value;
  return l;
}

std::size_t store::size_class(std::size_t n) const noexcept {
  return static_cast<std::size_t>(std::lower_bound(class_sizes_.begin(), class_sizes_.end(), n) -
                                  class_sizes_.begin());
}

std::uint32_t store::tag_at(std::uint64_t off) const noexcept {
  std::uint32_t t;
  std::memcpy(&t, arena_at(off) + kTagAt, sizeof t);
  return t;
}

void store::set_tag(std::uint64_t off, std::uint32_t tag) noexcept { std::memcpy(arena_at(off) + kTagAt, &tag, sizeof tag); }

std::uint64_t store::word_at(std::uint64_t off) const noexcept {
  std::uint64_t w;
  std::memcpy(&w, arena_at(off), sizeof w);
  return w;
}

void store::set_word(std::uint64_t off, std::uint64_t v) noexcept { std::memcpy(arena_at(off), &v, sizeof v); }

std::size_t store::bin_of(std::uint64_t size) const noexcept {
  // (size >= kMinBlock = class_sizes_[0]: the last class at most size)
  return static_cast<std::size_t>(std::upper_bound(class_sizes_.begin(), class_sizes_.end(), size) -
                                  class_sizes_.begin()) - 1;
}

void store::link_free(std::uint64_t off, std::uint64_t size, std::uint32_t prev_free) noexcept {
  const std::size_t b = bin_of(size);
  set_word(off, 0);  // version 0: no item (a reader on its way here fails its checks)
  set_tag(off, static_cast<std::uint32_t>(size) | kFree | prev_free);
  set_word(off + size - 8, size);
  set_word(off + kNextAt, bins_[b]);
  set_word(off + kPrevAt, kNoBlock);
  if (bins_[b] != kNoBlock) set_word(bins_[b] + kPrevAt, off);
  bins_[b] = off;
  bin_bits_[b / 64] |= std::uint64_t{1} << (b % 64);
  ++free_count_;
}

void store::unlink_free(std::uint64_t off) noexcept {
  const std::size_t b = bin_of(tag_at(off) & kSizeMask);
  const std::uint64_t next = word_at(off + kNextAt), prev = word_at(off + kPrevAt);
  if (prev != kNoBlock) {
    set_word(prev + kNextAt, next);
  } else {
    bins_[b] = next;
  }
  if (next != kNoBlock) set_word(next + kPrevAt, prev);
  if (bins_[b] == kNoBlock) bin_bits_[b / 64] &= ~(std::uint64_t{1} << (b % 64));
  --free_count_;
}

void store::mark_prev_free(std::uint64_t next, bool free) noexcept {
  if (next >= bump_) return;  // (the top)
  const std::uint32_t t = tag_at(next);
  set_tag(next, free ? t | kPrevFree : t & ~kPrevFree);
}

std::optional<store::grant> store::allocate(std::size_t c, bool replay, std::uint64_t extra) noexcept {
  // Clients get --max-memory; a replay may use the arena's slack (an item
  // may land in the arena on replay where it sat inline before: the
  // neighbourhoods differ under another seed).
  const std::uint64_t limit = replay ? arena_size_ : o_.max_memory;
  const std::uint64_t bytes = class_sizes_[c];
  const std::uint64_t held = charged_bytes() + extra;
  if (held + bytes > limit) return std::nullopt;
  // The smallest bin from c up with a free block (a bin's blocks are all
  // at least its class's size): split, the rest staying free, unless too
  // little would be left.
  for (std::size_t w = c / 64; w < bin_bits_.size(); ++w) {
    std::uint64_t bits = bin_bits_[w];
    if (w == c / 64) bits &= ~std::uint64_t{0} << (c % 64);
    if (bits == 0) continue;
    const std::size_t b = w * 64 + static_cast<std::size_t>(std::countr_zero(bits));
    const std::uint64_t off = bins_[b];
    const std::uint32_t t = tag_at(off);
    const std::uint64_t size = t & kSizeMask;
    const std::uint64_t given = size - bytes >= kMinBlock ? bytes : size;
    if (held + given > limit) break;  // (a few bytes over: the top may do)
    unlink_free(off);
    if (given < size) {
      link_free(off + given, size - given, 0);  // (the block above it still has a free one below)
    } else {
      mark_prev_free(off + size, false);
    }
    st_.used_bytes += given;
    return grant{off, static_cast<std::uint32_t>(given) | (t & kPrevFree)};
  }
  if (bump_ + bytes <= limit) {
    // (The block below the top is never free: a freed one reaching the top goes into it.)
    const std::uint64_t off = bump_;
    bump_ += bytes;
    st_.used_bytes += bytes;
    return grant{off, static_cast<std::uint32_t>(bytes)};
  }
  return std::nullopt;
}

std::uint64_t store::write_item(std::uint64_t version, std::string_view key, std::span<const std::byte> value,
                                bool replay, std::uint64_t extra) {
  const auto got = allocate(item_class(key.size(), value.size()), replay, extra);
  if (!got) return ~std::uint64_t{0};
  const std::uint64_t off = got->offset;
  std::byte* p = arena_at(off);
  item_header h{version, static_cast<std::uint32_t>(key.size()), static_cast<std::uint32_t>(value.size()), 0,
                got->tag};
  h.crc = item_crc(h, key, value);
  std::memcpy(p, &h, sizeof h);
  std::memcpy(p + kItemHeader, key.data(), key.size());
  if (!value.empty()) std::memcpy(p + kItemHeader + key.size(), value.data(), value.size());
  return off;
}

std::size_t store::item_class(std::size_t key_size, std::size_t value_size) const noexcept {
  return size_class(kItemHeader + key_size + value_size);
}

bool store::block_fits(std::uint64_t offset, std::size_t c) const noexcept {
  const std::uint32_t t = tag_at(offset);
  std::uint64_t off = offset, size = t & kSizeMask;
  if (off + size < bump_ && (tag_at(off + size) & kFree) != 0) size += tag_at(off + size) & kSizeMask;
  if ((t & kPrevFree) != 0) {
    const std::uint64_t below = word_at(off - 8);
    off -= below;
    size += below;
  }
  if (off + size >= bump_) return off + class_sizes_[c] <= o_.max_memory;  // back to the top
  return size >= class_sizes_[c];
}

bool store::free_block_for(std::size_t c) const noexcept {
  for (std::size_t b = c; b < bins_.size(); ++b) {
    if (bins_[b] != kNoBlock) return true;
  }
  return bump_ + class_sizes_[c] <= o_.max_memory;
}

void store::release_item(std::uint64_t offset) noexcept {
  const std::uint32_t t = tag_at(offset);
  std::uint64_t off = offset, size = t & kSizeMask;
  st_.used_bytes -= size;
  // Its header (but the tag), key and value cleared: a deleted value, or
  // its CRC to test guesses against, is not left for remote readers of
  // the arena (a reader still on its way fails the item's checks).
  std::memset(arena_at(off), 0, kTagAt);
  std::memset(arena_at(off) + kItemHeader, 0, size - kItemHeader);
  std::uint32_t prev_free = t & kPrevFree;
  if (off + size < bump_) {
    const std::uint32_t above = tag_at(off + size);
    if ((above & kFree) != 0 && size + (above & kSizeMask) <= kMaxBlock) {
      unlink_free(off + size);
      size += above & kSizeMask;
    }
  }
  if (prev_free != 0) {
    const std::uint64_t below = word_at(off - 8);
    if (below + size <= kMaxBlock) {
      unlink_free(off - below);
      off -= below;
      size += below;
      prev_free = tag_at(off) & kPrevFree;
    }
  }
  if (off + size == bump_) {
    // Back to the top, with any free block left below it (one a merge
    // past kMaxBlock kept apart).
    bump_ = off;
    while (prev_free != 0) {
      const std::uint64_t below = word_at(bump_ - 8);
      unlink_free(bump_ - below);
      bump_ -= below;
      prev_free = tag_at(bump_) & kPrevFree;
    }
    return;
  }
  link_free(off, size, prev_free);
  mark_prev_free(off + size, true);
}

std::string store::check_arena() const {
  std::uint64_t off = 0, used = 0, frees = 0;
  bool below_free = false;
  while (off < bump_) {
    const std::uint32_t t = tag_at(off);
    const std::uint64_t size = t & kSizeMask;
    const std::string at = "block at " + std::to_string(off) + " (tag " + std::to_string(t) + ")";
    if (size < kMinBlock || off + size > bump_) return at + ": a size out of the arena";
    if (((t & kPrevFree) != 0) != below_free) return at + ": its flag says otherwise of the block below";
    below_free = (t & kFree) != 0;
    if (below_free) {
      ++frees;
      if (word_at(off) != 0) return at + ": free, with a version";
      if (word_at(off + size - 8) != size) return at + ": free, its size at its end differs";
    } else {
      used += size;
    }
    off += size;
  }
  if (below_free) return "a free block just below the top";
  if (used != st_.used_bytes) {
    return "blocks in use add up to " + std::to_string(used) + ", used_bytes says " + std::to_string(st_.used_bytes);
  }
  std::uint64_t listed = 0;
  for (std::size_t b = 0; b < bins_.size(); ++b) {
    const bool bit = (bin_bits_[b / 64] >> (b % 64) & 1u) != 0;
    if (bit != (bins_[b] != kNoBlock)) return "bin " + std::to_string(b) + ": its bit disagrees";
    std::uint64_t prev = kNoBlock;
    for (std::uint64_t o = bins_[b]; o != kNoBlock; o = word_at(o + kNextAt)) {
      if (o >= bump_ || (tag_at(o) & kFree) == 0) return "bin " + std::to_string(b) + " lists a block not free";
      if (bin_of(tag_at(o) & kSizeMask) != b) return "bin " + std::to_string(b) + " lists a block of another bin";
      if (word_at(o + kPrevAt) != prev) return "bin " + std::to_string(b) + ": a broken back link";
      if (++listed > frees) return "bins list more blocks than are free (a loop?)";
      prev = o;
    }
  }
  if (listed != frees || frees != free_count_) {
    return std::to_string(frees) + " free blocks, " + std::to_string(listed) + " listed, " +
           std::to_string(free_count_) + " counted";
  }
  return {};
}

store::view store::item_view(std::uint64_t offset) const noexcept {
  const std::byte* p = base_ + arena_offset_ + offset;
  item_header h;
  std::memcpy(&h, p, sizeof h);
  return {std::string_view(reinterpret_cast<const char*>(p + kItemHeader), h.key_len),
          std::span<const std::byte>(p + kItemHeader + h.key_len, h.value_len)};
}

store::view store::slot_view(const slot& s) const noexcept {
  if ((s.length & kInlineFlag) == 0) return item_view(s.offset);
  std::uint16_t k, v;
  std::memcpy(&k, s.data, 2);
  std::memcpy(&v, s.data + 2, 2);
  const auto* d = reinterpret_cast<const std::byte*>(s.data + 4);
  return {std::string_view(reinterpret_cast<const char*>(d), k), std::span<const std::byte>(d + k, v)};
}

std::optional<store::found> store::find(std::uint64_t h, std::string_view key) const noexcept {
  const std::uint64_t home = h & (buckets_ - 1);
  for (std::uint64_t b = home; b < home + kNeighborhood; ++b) {
    for (std::size_t i = 0; i < kSlotsPerBucket; ++i) {
      slot& s = slot_at(b, i);
      if (s.version != 0 && s.hash == h && slot_view(s).key == key) return found{&s, {}, false};
    }
  }
  if (header(home).overflow != 0) {
    auto it = overflow_.find(key);
    if (it != overflow_.end()) return found{nullptr, it, true};
  }
  return std::nullopt;
}

slot* store::free_slot(std::uint64_t home, const slot* except) const noexcept {
  for (std::uint64_t b = home; b < home + kNeighborhood; ++b) {
    for (std::size_t i = 0; i < kSlotsPerBucket; ++i) {
      slot& s = slot_at(b, i);
      if (s.version == 0 && &s != except) return &s;
    }
  }
  return nullptr;
}

void store::fill_inline(slot& s, std::uint64_t version, std::uint64_t h, std::string_view key,
                        std::span<const std::byte> value) noexcept {
  const auto k = static_cast<std::uint16_t>(key.size());
  const auto v = static_cast<std::uint16_t>(value.size());
  std::memcpy(s.data, &k, 2);
  std::memcpy(s.data + 2, &v, 2);
  std::memcpy(s.data + 4, key.data(), k);
  if (v != 0) std::memcpy(s.data + 4 + k, value.data(), v);
  // (The rest cleared: a longer value the slot held before is not left
  // for remote readers. Past what the CRC covers: readers never look.)
  std::memset(s.data + 4 + k + v, 0, sizeof s.data - 4 - k - v);
  s.hash = h;
  s.offset = 0;
  s.length = kInlineFlag | static_cast<std::uint32_t>(k + v);
  std::uint64_t keep = s.version;
  s.version = version;
  s.crc = slot_crc(s);
  s.version = keep;
  publish(s, version);
}

void store::point(slot& s, std::uint64_t version, std::uint64_t h, std::uint64_t offset,
                  std::uint32_t length) noexcept {
  // In place when the slot holds the key already: a reader catching the
  // slot half-written fails its CRC and retries.
  const std::uint64_t keep = s.version;
  s.hash = h;
  s.offset = offset;
  s.length = length;
  std::memset(s.data, 0, sizeof s.data);  // (a small value it held is not left behind; outside the CRC)
  s.version = version;
  s.crc = slot_crc(s);
  s.version = keep;
  publish(s, version);
}

void store::capture(const found& f, prior& was) const noexcept {
  was.size = 0;
  was.item = 0;
  if (f.in_overflow) {
    was.what = prior::kind::item;
    was.item = f.of->second;
  } else if ((f.s->length & kInlineFlag) == 0) {
    was.what = prior::kind::item;
    was.item = f.s->offset;
  } else {
    const std::span<const std::byte> v = slot_view(*f.s).value;
    was.what = prior::kind::inline_value;
    was.size = static_cast<std::uint32_t>(v.size());  // (at most kInlineBytes: it fits the slot)
    if (!v.empty()) std::memcpy(was.bytes.data(), v.data(), std::min(v.size(), was.bytes.size()));
  }
}

void store::forget(const found& f, std::uint64_t home, prior* was) noexcept {
  if (was != nullptr) capture(f, *was);
  if (f.in_overflow) {
    const view v = item_view(f.of->second);
    st_.live_bytes -= v.key.size() + v.value.size();
    if (was == nullptr) release_item(f.of->second);  // (after its view: release clears it)
    st_.overflow_bytes -= overflow_charge(f.of->first.size());
    overflow_.erase(f.of);
    --header(home).overflow;
    --st_.overflow_keys;
  } else {
    const view v = slot_view(*f.s);
    st_.live_bytes -= v.key.size() + v.value.size();
    const bool inl = (f.s->length & kInlineFlag) != 0;
    publish(*f.s, 0);
    std::memset(f.s->data, 0, sizeof f.s->data);  // (after: a reader of the slot as it was sees it whole or not valid)
    if (inl) {
      --st_.inline_keys;
    } else if (was == nullptr) {
      release_item(f.s->offset);
    }
  }
  --st_.keys;
}

put_status store::put(std::string_view key, std::span<const std::byte> value, bool replay, prior* was) {
  if (key.empty() || key.size() > o_.max_key || value.size() > o_.max_value) return put_status::too_large;
  const std::uint64_t h = key_hash(seed_, key);
  const std::uint64_t home = h & (buckets_ - 1);
  const auto old = find(h, key);
  if (was != nullptr) {
    if (old) {
      capture(*old, *was);  // (before anything is rewritten in place)
    } else {
      was->what = prior::kind::absent;
      was->size = 0;
      was->item = 0;
    }
  }
  const std::uint64_t version = next_version_++;
  const std::size_t kv = key.size() + value.size();

  // Small: inline, in the key's own slot when it has one (rewritten in
  // place: a reader catching it half-written fails the slot's CRC and
  // retries; moving the key to a fresh slot could let a reader see neither
  // slot), else in a free slot. A key in the overflow table stays there.
  if (kv <= kInlineBytes && (!old || !old->in_overflow)) {
    if (slot* s = old ? old->s : free_slot(home, nullptr)) {
      std::size_t old_kv = 0;
      bool old_arena = false;
      std::uint64_t old_off = 0;
      if (old) {
        const view ov = slot_view(*s);
        old_kv = ov.key.size() + ov.value.size();
        old_arena = (s->length & kInlineFlag) == 0;
        old_off = s->offset;
      }
      fill_inline(*s, version, h, key, value);
      if (!old) {
        ++st_.keys;
        ++st_.inline_keys;
      } else if (old_arena) {
        if (was == nullptr) release_item(old_off);  // after the slot stopped pointing at it
        ++st_.inline_keys;
      }
      st_.live_bytes += kv - old_kv;
      return put_status::ok;
    }
  }
  // An item in the arena (and, for a new key with no free slot, an entry
  // of the overflow table, charged with it).
  const bool to_overflow = !old && free_slot(home, nullptr) == nullptr;
  const std::uint64_t charge = to_overflow ? overflow_charge(key.size()) : 0;
  const std::uint64_t off = write_item(version, key, value, replay, charge);
  if (off == ~std::uint64_t{0}) return put_status::out_of_memory;
  const auto len = static_cast<std::uint32_t>(kItemHeader + kv);
  if (old && !old->in_overflow) {
    const bool was_inline = (old->s->length & kInlineFlag) != 0;
    const view ov = slot_view(*old->s);
    st_.live_bytes -= ov.key.size() + ov.value.size();
    const std::uint64_t old_off = old->s->offset;
    point(*old->s, version, h, off, len);
    if (was_inline) {
      --st_.inline_keys;
    } else if (was == nullptr) {
      release_item(old_off);
    }
  } else if (old) {
    const view ov = item_view(old->of->second);
    st_.live_bytes -= ov.key.size() + ov.value.size();
    if (was == nullptr) release_item(old->of->second);
    old->of->second = off;
  } else if (slot* s = free_slot(home, nullptr)) {
    point(*s, version, h, off, len);
    ++st_.keys;
  } else {
    try {
      overflow_.emplace(std::string(key), off);
    } catch (...) {  // (std::bad_alloc: the put fails whole)
      release_item(off);
      throw;
    }
    st_.overflow_bytes += charge;
    ++header(home).overflow;
    ++st_.overflow_keys;
    ++st_.keys;
  }
  st_.live_bytes += kv;
  return put_status::ok;
}

bool store::del(std::string_view key, prior* was) noexcept {
  if (key.empty() || key.size() > o_.max_key) return false;
  const std::uint64_t h = key_hash(seed_, key);
  const auto f = find(h, key);
  if (!f) return false;
  forget(*f, h & (buckets_ - 1), was);
  return true;
}

std::optional<std::span<const std::byte>> store::get(std::string_view key) const noexcept {
  if (key.empty() || key.size() > o_.max_key) return std::nullopt;
  const auto f = find(key_hash(seed_, key), key);
  if (!f) return std::nullopt;
  return f->in_overflow ? item_view(f->of->second).value : slot_view(*f->s).value;
}

void store::for_each(const std::function<void(std::string_view, std::span<const std::byte>)>& f) const {
  const std::size_t all = std::numeric_limits<std::size_t>::max();
  const std::uint64_t every = std::numeric_limits<std::uint64_t>::max();
  const charged_fn each = [&f](std::string_view k, std::span<const std::byte> v) {
    f(k, v);
    return std::size_t{0};
  };
  std::size_t budget = all;
  (void)for_each_from(0, budget, every, each);
  budget = all;
  std::string after;
  (void)for_each_overflow_from(after, budget, every, each);
}

std::uint64_t store::for_each_from(std::uint64_t from, std::size_t& budget, std::uint64_t before,
                                   const charged_fn& f) const {
  std::size_t spent = 0;
  std::uint64_t b = from;
  for (; b <= buckets_ && spent < budget; ++b) {
    spent += kBucketSize;
    for (std::size_t i = 0; i < kSlotsPerBucket; ++i) {
      const slot& s = slot_at(b, i);
      if (s.version == 0 || s.version >= before) continue;
      const view v = slot_view(s);
      spent += f(v.key, v.value);
    }
  }
  budget -= std::min(spent, budget);
  return b;
}

namespace {
// What visiting one key of the overflow table costs a step, besides what f
// charges: a map node or two, a header read from the arena.
constexpr std::size_t kOverflowVisit = 64;
}  // namespace

bool store::for_each_overflow_from(std::string& after, std::size_t& budget, std::uint64_t before,
                                   const charged_fn& f) const {
  std::size_t spent = 0;
  auto it = after.empty() ? overflow_.begin() : overflow_.upper_bound(after);
  auto last = overflow_.end();
  for (; it != overflow_.end() && spent < budget; last = it++) {
    const view v = item_view(it->second);
    item_header h;
    std::memcpy(&h, base_ + arena_offset_ + it->second, sizeof h);
    spent += kOverflowVisit;  // (a key written since is passed over, at a cost)
    if (h.version < before) spent += f(v.key, v.value);
  }
  if (last != overflow_.end()) after = last->first;
  budget -= std::min(spent, budget);
  return it == overflow_.end();
}

}  // namespace anydoor::apps::kv
