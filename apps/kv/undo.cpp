#include "undo.hpp"

#include <cstring>

namespace anydoor::apps::kv {

void undo_journal::note(std::string_view key, const prior& was) {
  entry e;
  e.at = bytes_.size();
  e.key_size = static_cast<std::uint32_t>(key.size());
  e.what = was.what;
  e.item = was.item;
  const std::span<const std::byte> v = was.what == prior::kind::inline_value ? was.value() : std::span<const std::byte>();
  e.value_size = static_cast<std::uint32_t>(v.size());
  e.value_at = e.at + key.size();
  entries_.reserve(entries_.size() + 1);  // (before bytes_ grows: a throw leaves both as they were)
  bytes_.resize(e.at + key.size() + v.size());
  std::memcpy(bytes_.data() + e.at, key.data(), key.size());
  if (!v.empty()) std::memcpy(bytes_.data() + e.at + key.size(), v.data(), v.size());
  entries_.push_back(e);
  if (e.what == prior::kind::item) ++kept_;
}

void undo_journal::set_lsn(std::uint64_t lsn) noexcept {
  if (head_ != entries_.size()) entries_.back().lsn = lsn;
}

void undo_journal::reset() noexcept {
  entries_.clear();
  bytes_.clear();
  head_ = 0;
  kept_ = 0;
  constexpr std::size_t kKeep = std::size_t{1} << 20;
  if (bytes_.capacity() > kKeep) bytes_.shrink_to_fit();
  if (entries_.capacity() * sizeof(entry) > kKeep) entries_.shrink_to_fit();
}

void undo_journal::compact() noexcept {
  if (head_ == entries_.size()) {
    reset();
    return;
  }
  const std::size_t shift = entries_[head_].at;
  if (head_ < 64 || head_ * 2 < entries_.size() || shift * 2 < bytes_.size()) return;
  std::memmove(bytes_.data(), bytes_.data() + shift, bytes_.size() - shift);
  bytes_.resize(bytes_.size() - shift);
  entries_.erase(entries_.begin(), entries_.begin() + static_cast<std::ptrdiff_t>(head_));
  for (entry& e : entries_) {
    e.at -= shift;
    e.value_at -= shift;
  }
  head_ = 0;
}

}  // namespace anydoor::apps::kv

