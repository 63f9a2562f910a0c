#include "undo.hpp"

#include <algorithm>
#include <cstring>

namespace anydoor::apps::kv {

void undo_journal::note(std::string_view key, const prior& was) {
  entry e;
  e.at = size_;
  e.key_size = static_cast<std::uint32_t>(key.size());
  e.what = was.what;
  e.item = was.item;
  const std::span<const std::byte> v = was.what == prior::kind::inline_value ? was.value() : std::span<const std::byte>();
  e.value_size = static_cast<std::uint32_t>(v.size());
  e.value_at = e.at + key.size();
  // Room first (doubling), so that a throw leaves both as they were.
  if (entries_.size() == entries_.capacity()) entries_.reserve(std::max<std::size_t>(64, 2 * entries_.capacity()));
  reserve(e.at + key.size() + v.size());
  std::memcpy(bytes_.get() + e.at, key.data(), key.size());
  if (!v.empty()) std::memcpy(bytes_.get() + e.value_at, v.data(), v.size());
  size_ = e.value_at + v.size();
  entries_.push_back(e);
  if (e.what == prior::kind::item) {
    ++kept_;
    ++items_noted_;
  }
}

void undo_journal::reserve(std::size_t need) {
  if (need <= capacity_) return;
  const std::size_t cap = std::max<std::size_t>({4096, need, 2 * capacity_});
  auto grown = std::make_unique_for_overwrite<std::byte[]>(cap);
  if (size_ != 0) std::memcpy(grown.get(), bytes_.get(), size_);
  bytes_ = std::move(grown);
  capacity_ = cap;
}

void undo_journal::set_lsn(std::uint64_t lsn) noexcept {
  if (head_ != entries_.size()) entries_.back().lsn = lsn;
}

void undo_journal::reset() noexcept {
  entries_.clear();
  size_ = 0;
  head_ = 0;
  kept_ = 0;
  first_kept_ = 0;
  constexpr std::size_t kKeep = std::size_t{1} << 20;
  if (capacity_ > kKeep) {
    bytes_.reset();
    capacity_ = 0;
  }
  if (entries_.capacity() * sizeof(entry) > kKeep) entries_.shrink_to_fit();
}

void undo_journal::compact() noexcept {
  if (head_ == entries_.size()) {
    reset();
    return;
  }
  const std::size_t shift = entries_[head_].at;
  if (head_ < 64 || head_ * 2 < entries_.size() || shift * 2 < size_) return;
  std::memmove(bytes_.get(), bytes_.get() + shift, size_ - shift);
  size_ -= shift;
  entries_.erase(entries_.begin(), entries_.begin() + static_cast<std::ptrdiff_t>(head_));
  for (entry& e : entries_) {
    e.at -= shift;
    e.value_at -= shift;
  }
  first_kept_ = first_kept_ > head_ ? first_kept_ - head_ : 0;
  head_ = 0;
}

}  // namespace anydoor::apps::kv

