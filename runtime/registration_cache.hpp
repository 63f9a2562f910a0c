// The registration cache (runtime-internal): registers user memory for
// one-sided operations once and reuses the registration. One thread (the
// fabric's io_context).
//
// Entries cover whole pages and carry local access only (never remote: the
// cache does not expose user memory to peers). Valid entries do not overlap:
// a miss registers the union of the request and every valid entry it
// touches, with the union of their access, and retires those. An operation
// pins the entry it uses; eviction (least recently used first, to stay
// within the entry and byte limits) and invalidation (forget) never
// deregister a pinned entry: it is retired and deregistered when its last
// pin goes.
#pragma once

#include <anydoor/memory.hpp>
#include <anydoor/transport/provider.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

namespace anydoor::detail {

class split_region;

class registration_cache {
 public:
  struct entry {
    std::uintptr_t begin = 0;
    std::uintptr_t end = 0;
    access acc = access::none;
    std::unique_ptr<transport::memory_region> mr;
    const split_region* split = nullptr;  // mr itself when it is in pieces
    std::uint32_t pins = 0;
    bool device = false;   // GPU device memory (the CPU cannot read it)
    bool retired = false;  // out of the index; deregistered at the last unpin
    entry* lru_prev = nullptr;  // valid entries, most recent first
    entry* lru_next = nullptr;
  };

  // Registrations above 2^piece_shift bytes are made in pieces (split_region).
  // GPU device memory is registered as the device takes it (cuda/
  // register.hpp), exactly the range asked for and never in pieces; without
  // `device` it is refused.
  registration_cache(transport::protection_domain& pd, std::size_t max_bytes, std::size_t max_entries,
                     unsigned piece_shift = 63, transport::device* device = nullptr) noexcept
      : pd_(pd), device_(device), max_bytes_(max_bytes), max_entries_(max_entries), piece_shift_(piece_shift) {}
  ~registration_cache();
  registration_cache(const registration_cache&) = delete;
  registration_cache& operator=(const registration_cache&) = delete;

  // An entry covering [p, p + n) with at least `acc` (plus local read),
  // pinned. Throws std::system_error when registering fails.
  entry& pin(const void* p, std::size_t n, access acc);
  void unpin(entry& e) noexcept;

  // Deregisters every entry that overlaps [p, p + n) (pinned ones when
  // their operations end). Returns how many entries it retired.
  std::size_t forget(const void* p, std::size_t n) noexcept;

  const registration_cache_stats& stats() const noexcept { return stats_; }

 private:
  void retire(entry* e) noexcept;  // out of the index and the LRU list
  void destroy(entry* e) noexcept;
  void trim() noexcept;            // evicts unpinned entries beyond the limits
  void lru_front(entry* e) noexcept;
  void lru_unlink(entry* e) noexcept;

  transport::protection_domain& pd_;
  transport::device* device_;
  std::size_t max_bytes_;
  std::size_t max_entries_;
  unsigned piece_shift_;
  std::map<std::uintptr_t, std::unique_ptr<entry>> index_;  // valid entries by begin
  std::vector<std::unique_ptr<entry>> retired_;             // pinned, waiting for their last unpin
  entry* lru_head_ = nullptr;
  entry* lru_tail_ = nullptr;
  registration_cache_stats stats_;
};

}  // namespace anydoor::detail
