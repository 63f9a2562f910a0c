// A free list of objects owned by one thread's fabric (operation nodes,
// doorbell batches): it grows to the most in use at once, is reused (no
// allocation once it has), and trim() frees, after a burst, what waits
// beyond max(kKeep, twice the most in use at once since the last trim).
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

namespace anydoor::detail {

template <class T>
class free_list {
 public:
  static constexpr std::size_t kKeep = 16;

  // One waiting, or nullptr when none does (then add a new one).
  T* take() noexcept {
    if (free_.empty()) return nullptr;
    T* p = free_.back();
    free_.pop_back();
    note_use();
    return p;
  }
  // A new one, in use. Throws std::bad_alloc (nothing added then).
  T* add(std::unique_ptr<T> p) {
    // Room for every one to come back without allocating (give is
    // noexcept), grown geometrically: a burst costs O(n), not a
    // reallocation per object.
    if (free_.capacity() < all_.size() + 1) free_.reserve(std::max<std::size_t>(8, 2 * free_.capacity()));
    if (all_.capacity() < all_.size() + 1) all_.reserve(std::max<std::size_t>(8, 2 * all_.capacity()));
    all_.push_back(std::move(p));
    note_use();
    return all_.back().get();
  }
  void give(T* p) noexcept { free_.push_back(p); }  // p from take or add: within the capacity
  // Frees what waits beyond max(kKeep, twice the most in use at once since
  // the last trim), the longest waiting first, then starts that count again
  // from those in use now (hysteresis: a load that comes back between two
  // trims keeps what it needs).
  void trim() noexcept {
    const std::size_t in_use = all_.size() - free_.size();
    const std::size_t keep = std::max({kKeep, 2 * hwm_, 2 * in_use});
    hwm_ = in_use;
    if (free_.size() <= keep) return;
    // The longest waiting go (the front: the list is taken from the back).
    const auto first = free_.begin();
    const auto last = first + static_cast<std::ptrdiff_t>(free_.size() - keep);
    const std::less<T*> before;
    std::sort(first, last, before);
    // (Moving a kept one over a freed one's owner deletes the freed one.)
    all_.erase(std::remove_if(all_.begin(), all_.end(),
                              [&](const std::unique_ptr<T>& p) { return std::binary_search(first, last, p.get(), before); }),
               all_.end());
    free_.erase(first, last);
  }
  std::size_t made() const noexcept { return all_.size(); }
  std::size_t free_count() const noexcept { return free_.size(); }

 private:
  void note_use() noexcept { hwm_ = std::max(hwm_, all_.size() - free_.size()); }

  std::vector<T*> free_;                  // capacity >= all_.size()
  std::vector<std::unique_ptr<T>> all_;   // every one, waiting or in use
  std::size_t hwm_ = 0;                   // most in use at once since the last trim
};

}  // namespace anydoor::detail
