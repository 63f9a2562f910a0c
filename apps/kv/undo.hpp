// The writes the store has applied that the log has not yet made durable:
// for each, its key and what the key held before (store.hpp's prior:
// nothing, a small value copied from its slot, or an arena item the store
// keeps allocated meanwhile), oldest first. Should the log fail, the
// service takes back those whose records the file does not hold, newest
// first, so that the store holds again what the log holds (README,
// "Durability"): a write that never reached the file is never read
// afterwards.
//
// Memory: for each write on its way to the log (with always until its
// fsync, with everysec and no until the io thread's write at the end of
// its turn), its key and at most kInlineBytes of old value here (about
// what its record takes in the log's buffer), and an old arena item kept
// in the arena until then. Should a put find the arena full, kept items
// are copied here and released (spill), as few as the put needs (see
// service::put), so --max-memory bounds the live data as before, not the
// writes in flight. The two buffers are
// reused once they drain, so no allocation per write once they have grown.
// Single-threaded (the store's io thread).
#pragma once

#include "store.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

namespace anydoor::apps::kv {

class undo_journal {
 public:
  // One write, as f sees it: its key and what the key held before (for an
  // inline value, `value`; for an item, its offset).
  struct before {
    std::string_view key;
    prior::kind what = prior::kind::absent;
    std::uint64_t item = 0;
    std::span<const std::byte> value;
  };

  // A write of `key` changed the store; the key held `was` before. Its log
  // position is set once it is appended (0 until then).
  void note(std::string_view key, const prior& was);
  void set_lsn(std::uint64_t lsn) noexcept;
  // Calls f(before) for the last noted write, then forgets it.
  template <class F>
  void take_back_last(F&& f) {
    if (head_ == entries_.size()) return;
    const entry& e = entries_.back();
    f(view(e));
    if (e.what == prior::kind::item) --kept_;
    // Its bytes are given back when they end the buffer (not when values
    // spilled after them follow: those stay until the journal drains).
    if (std::max(e.at + e.key_size, e.value_at + e.value_size) == size_) size_ = e.at;
    entries_.pop_back();
    first_kept_ = std::min(first_kept_, entries_.size());
    if (head_ == entries_.size()) reset();
  }
  // Forgets the writes with positions up to `durable` (made durable),
  // calling release(offset) for each old item they kept.
  template <class R>
  void forget_until(std::uint64_t durable, R&& release) {
    while (head_ < entries_.size() && entries_[head_].lsn != 0 && entries_[head_].lsn <= durable) {
      if (entries_[head_].what == prior::kind::item) {
        release(entries_[head_].item);
        --kept_;
      }
      ++head_;
    }
    compact();
  }
  // Calls f(before) for every write above `held` (or without a position),
  // newest first; then forgets every write, calling release(offset) for
  // the old items of those at or below `held`. Returns how many were taken back.
  template <class F, class R>
  std::size_t take_back(std::uint64_t held, F&& f, R&& release) {
    std::size_t n = 0;
    std::size_t i = entries_.size();
    for (; i > head_; --i) {
      const entry& e = entries_[i - 1];
      if (e.lsn != 0 && e.lsn <= held) break;
      f(view(e));
      ++n;
    }
    for (std::size_t k = head_; k < i; ++k) {
      if (entries_[k].what == prior::kind::item) release(entries_[k].item);
    }
    reset();
    return n;
  }

  // Copies the values of old items kept (value_of(offset): its bytes)
  // into the journal, oldest first, releasing each (release(offset)) once
  // copied: at least one item, then on until `at_least` bytes of values
  // have moved (by default all of them). Returns the bytes moved. A throw
  // (no memory) leaves the rest kept.
  template <class V, class R>
  std::size_t spill(V&& value_of, R&& release, std::size_t at_least = ~std::size_t{0}) {
    return spill_if(value_of, release, at_least, [](std::uint64_t) { return true; });
  }
  // The same, among the kept items for which eligible(offset) holds.
  // (The scan starts at the first entry that may still keep an item:
  // those spilled before stay in front until the journal drains.)
  template <class V, class R, class E>
  std::size_t spill_if(V&& value_of, R&& release, std::size_t at_least, E&& eligible) {
    std::size_t moved = 0;
    bool any = false;
    bool leading = true;  // no entry from the scan's start to here keeps an item
    for (std::size_t i = std::max(head_, first_kept_); i < entries_.size() && kept_ != 0 && (!any || moved < at_least);
         ++i) {
      entry& e = entries_[i];
      if (e.what != prior::kind::item || !eligible(e.item)) {
        if (e.what == prior::kind::item) leading = false;
        if (leading) first_kept_ = i + 1;
        continue;
      }
      const std::span<const std::byte> v = value_of(e.item);
      const std::size_t at = size_;
      reserve(at + v.size());
      if (!v.empty()) std::memcpy(bytes_.get() + at, v.data(), v.size());
      size_ = at + v.size();
      e.what = prior::kind::inline_value;  // (its value here now, whatever its size)
      e.value_at = at;
      e.value_size = static_cast<std::uint32_t>(v.size());
      release(e.item);
      --kept_;
      moved += v.size();
      any = true;
      if (leading) first_kept_ = i + 1;
    }
    return moved;
  }
  // How many writes that kept an item were noted, ever (it only grows).
  std::uint64_t items_noted() const noexcept { return items_noted_; }

  std::size_t kept_items() const noexcept { return kept_; }
  std::size_t writes() const noexcept { return entries_.size() - head_; }
  // Bytes held for the writes not yet forgotten, and what the byte buffer
  // holds, forgotten writes included (until they are moved out: compact).
  std::size_t bytes() const noexcept { return size_ - (head_ == entries_.size() ? 0 : entries_[head_].at); }
  std::size_t footprint() const noexcept { return size_; }

 private:
  struct entry {
    std::uint64_t lsn = 0;
    std::uint64_t item = 0;
    std::size_t at = 0;        // the key, in bytes_
    std::size_t value_at = 0;  // an old value copied, in bytes_ (after the key, or spilled later)
    std::uint32_t key_size = 0;
    std::uint32_t value_size = 0;
    prior::kind what = prior::kind::absent;
  };
  before view(const entry& e) const noexcept {
    return {std::string_view(reinterpret_cast<const char*>(bytes_.get() + e.at), e.key_size), e.what, e.item,
            std::span<const std::byte>(bytes_.get() + e.value_at, e.value_size)};
  }
  // Empties both buffers (their memory kept, unless far larger than a
  // steady load needs: a burst's is given back).
  void reset() noexcept;
  // Under a steady load the journal never drains: once the forgotten part
  // is at least as large as the rest, in entries and in bytes, the rest
  // moves to the front (each byte moved at most as often as one forgotten).
  void compact() noexcept;
  std::vector<entry> entries_;
  // Room for `need` bytes in bytes_ (doubling; may throw, changing nothing).
  void reserve(std::size_t need);
  // The keys and old values (not value-initialized: a write copies into it once).
  std::unique_ptr<std::byte[]> bytes_;
  std::size_t size_ = 0, capacity_ = 0;
  std::size_t head_ = 0;  // entries_ before it are forgotten
  std::size_t kept_ = 0;  // entries of kind item from head_ on
  std::size_t first_kept_ = 0;  // entries from head_ up to it keep no item (spill's start)
  std::uint64_t items_noted_ = 0;
};

}  // namespace anydoor::apps::kv
