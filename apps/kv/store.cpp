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
  // Size classes: 32 .. 64 by 8, then four per power of two, up to the largest item.
  const std::size_t largest = kItemHeader + o_.max_key + o_.max_value;
  std::vector<std::size_t> sizes;
  for (std::size_t s = 32; s <= 64; s += 8) sizes.push_back(s);
  for (std::size_t p2 = 64; sizes.back() < largest; p2 *= 2) {
    for (std::size_t q = 1; q <= 4; ++q) sizes.push_back(p2 + q * (p2 / 4));
  }
  class_sizes_ = std::move(sizes);
  free_lists_.resize(class_sizes_.size());
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

std::optional<std::pair<std::uint64_t, std::size_t>> store::allocate(std::size_t c, bool replay) noexcept {
  // Clients get --max-memory; a replay may use the arena's slack (an item
  // may land in the arena on replay where it sat inline before: the
  // neighbourhoods differ under another seed).
  const std::uint64_t limit = replay ? arena_size_ : o_.max_memory;
  const std::size_t bytes = class_sizes_[c];
  if (!free_lists_[c].empty() && st_.used_bytes + bytes <= limit) {
    const std::uint64_t off = free_lists_[c].back();
    free_lists_[c].pop_back();
    st_.used_bytes += bytes;
    return std::pair{off, c};
  }
  if (bump_ + bytes <= limit && st_.used_bytes + bytes <= limit) {
    const std::uint64_t off = bump_;
    bump_ += bytes;
    st_.used_bytes += bytes;
    return std::pair{off, c};
  }
  // A freed block of a larger class (no split: the item keeps the whole
  // block, and gives it back to that class when freed).
  for (std::size_t k = c + 1; k < class_sizes_.size(); ++k) {
    if (free_lists_[k].empty() || st_.used_bytes + class_sizes_[k] > limit) continue;
    const std::uint64_t off = free_lists_[k].back();
    free_lists_[k].pop_back();
    st_.used_bytes += class_sizes_[k];
    return std::pair{off, k};
  }
  return std::nullopt;
}

std::uint64_t store::write_item(std::uint64_t version, std::string_view key, std::span<const std::byte> value,
                                bool replay) {
  const auto got = allocate(item_class(key.size(), value.size()), replay);
  if (!got) return ~std::uint64_t{0};
  const std::uint64_t off = got->first;
  std::byte* p = base_ + arena_offset_ + off;
  item_header h{version, static_cast<std::uint32_t>(key.size()), static_cast<std::uint32_t>(value.size()), 0,
                static_cast<std::uint32_t>(got->second)};
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
  item_header h;
  std::memcpy(&h, base_ + arena_offset_ + offset, sizeof h);
  return h.reserved >= c;
}

bool store::free_block_for(std::size_t c) const noexcept {
  for (std::size_t k = c; k < free_lists_.size(); ++k) {
    if (!free_lists_[k].empty()) return true;
  }
  return false;
}

void store::release_item(std::uint64_t offset) noexcept {
  item_header h;
  std::memcpy(&h, base_ + arena_offset_ + offset, sizeof h);
  // The old bytes stay as they are until the memory is reused: a reader
  // still on its way sees either the whole old item or a CRC mismatch.
  free_lists_[h.reserved].push_back(offset);
  st_.used_bytes -= class_sizes_[h.reserved];
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
    if (was == nullptr) release_item(f.of->second);
    const view v = item_view(f.of->second);
    st_.live_bytes -= v.key.size() + v.value.size();
    overflow_.erase(f.of);
    --header(home).overflow;
    --st_.overflow_keys;
  } else {
    const view v = slot_view(*f.s);
    st_.live_bytes -= v.key.size() + v.value.size();
    const bool inl = (f.s->length & kInlineFlag) != 0;
    publish(*f.s, 0);
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
  // An item in the arena.
  const std::uint64_t off = write_item(version, key, value, replay);
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
    overflow_.emplace(std::string(key), off);
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
