// A pool of pre-registered, page-aligned buffers of one size.
//
// Slabs of `buffers_per_slab` buffers are allocated page-aligned and
// registered once; buffers come and go through a free list (an index stack),
// so getting and putting one allocates nothing. The pool grows slab by slab
// while it stays under the `max_bytes` watermark; past it, try_get() reports
// exhaustion and callers wait for a put (the runtime bounds that wait).
// Not thread-safe: a pool belongs to one reactor thread.
#pragma once

#include <anydoor/transport/provider.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

namespace anydoor {

struct buffer_pool_options {
  std::size_t buffer_size = 8192 + 64;        // bytes per buffer, rounded up to a multiple of 64
  std::size_t buffers_per_slab = 256;         // 1..65536
  std::size_t initial_slabs = 1;              // registered at construction
  std::size_t max_bytes = std::size_t{256} << 20;  // watermark: no slab beyond this many bytes in total
};

struct buffer_pool_stats {
  std::uint64_t slabs = 0;
  std::uint64_t buffers = 0;        // in all slabs
  std::uint64_t free = 0;           // on the free list now
  std::uint64_t gets = 0;           // successful try_get calls
  std::uint64_t puts = 0;
  std::uint64_t exhausted = 0;      // try_get calls that found nothing (at the watermark)
  std::uint64_t bytes = 0;          // registered bytes in all slabs
};

class buffer_pool {
 public:
  static constexpr std::uint32_t npos = std::numeric_limits<std::uint32_t>::max();

  // Throws std::system_error (errc::invalid_argument for bad options,
  // errc::registration_failed when the first slabs cannot be registered).
  buffer_pool(transport::protection_domain& pd, const buffer_pool_options& options,
              transport::access acc = transport::access::local_write);
  ~buffer_pool();
  buffer_pool(const buffer_pool&) = delete;
  buffer_pool& operator=(const buffer_pool&) = delete;

  // A free buffer's index, or npos when none is free and the watermark stops
  // growth (or a new slab could not be registered; logged).
  std::uint32_t try_get() noexcept;
  void put(std::uint32_t index) noexcept;

  std::byte* data(std::uint32_t index) const noexcept {
    return slabs_[index / per_slab_].base + std::size_t{index % per_slab_} * buffer_size_;
  }
  std::uint32_t lkey(std::uint32_t index) const noexcept { return slabs_[index / per_slab_].mr->lkey(); }
  transport::sge slice(std::uint32_t index, std::size_t offset, std::uint32_t length) const noexcept {
    return {reinterpret_cast<std::uint64_t>(data(index) + offset), length, lkey(index)};
  }
  std::size_t buffer_size() const noexcept { return buffer_size_; }
  std::size_t capacity() const noexcept;  // buffers the watermark allows
  const buffer_pool_stats& stats() const noexcept { return stats_; }

 private:
  struct slab {
    std::byte* base = nullptr;
    std::size_t bytes = 0;
    std::unique_ptr<transport::memory_region> mr;
  };
  bool grow() noexcept;

  transport::protection_domain& pd_;
  transport::access access_;
  std::size_t buffer_size_;
  std::uint32_t per_slab_;
  std::size_t max_bytes_;
  std::size_t slab_bytes_;
  std::vector<slab> slabs_;
  std::vector<std::uint32_t> free_;
  buffer_pool_stats stats_;
};

}  // namespace anydoor
