#include <anydoor/buffer_pool.hpp>
#include <anydoor/error.hpp>

#include "log.hpp"

#include <unistd.h>

#include <cstdlib>
#include <new>
#include <system_error>

namespace anydoor {

namespace {

std::size_t page_size() noexcept {
  const long p = ::sysconf(_SC_PAGESIZE);
  return p > 0 ? static_cast<std::size_t>(p) : 4096;
}

std::size_t round_up(std::size_t n, std::size_t to) noexcept { return (n + to - 1) / to * to; }

}  // namespace

buffer_pool::buffer_pool(transport::protection_domain& pd, const buffer_pool_options& o, transport::access acc)
    : pd_(pd), access_(acc), buffer_size_(round_up(o.buffer_size, 64)),
      per_slab_(static_cast<std::uint32_t>(o.buffers_per_slab)), max_bytes_(o.max_bytes) {
  if (o.buffer_size == 0 || o.buffer_size > (std::size_t{1} << 30)) {
    throw std::system_error(errc::invalid_argument, "buffer_pool: buffer_size must be in 1..1 GiB");
  }
  if (o.buffers_per_slab == 0 || o.buffers_per_slab > 65536) {
    throw std::system_error(errc::invalid_argument, "buffer_pool: buffers_per_slab must be in 1..65536");
  }
  slab_bytes_ = round_up(buffer_size_ * per_slab_, page_size());
  if (o.initial_slabs * slab_bytes_ > max_bytes_) {
    throw std::system_error(errc::invalid_argument, "buffer_pool: initial slabs exceed max_bytes");
  }
  if (max_bytes_ < slab_bytes_) {
    throw std::system_error(errc::invalid_argument, "buffer_pool: max_bytes is below one slab");
  }
  // Indices must fit below npos.
  if (max_bytes_ / slab_bytes_ * per_slab_ >= npos) {
    throw std::system_error(errc::invalid_argument, "buffer_pool: max_bytes allows too many buffers");
  }
  slabs_.reserve(max_bytes_ / slab_bytes_);
  free_.reserve(max_bytes_ / slab_bytes_ * per_slab_);
  for (std::size_t i = 0; i < o.initial_slabs; ++i) {
    if (!grow()) throw std::system_error(errc::registration_failed, "buffer_pool: cannot register the initial slabs");
  }
}

buffer_pool::~buffer_pool() {
  for (slab& s : slabs_) {
    s.mr.reset();
    std::free(s.base);
  }
}

std::size_t buffer_pool::capacity() const noexcept { return max_bytes_ / slab_bytes_ * per_slab_; }

bool buffer_pool::grow() noexcept {
  if ((slabs_.size() + 1) * slab_bytes_ > max_bytes_) return false;
  auto* base = static_cast<std::byte*>(std::aligned_alloc(page_size(), slab_bytes_));
  if (base == nullptr) {
    log().warn("buffer_pool: cannot allocate a slab of {} bytes", slab_bytes_);
    return false;
  }
  slab s{base, slab_bytes_, nullptr};
  try {
    s.mr = pd_.register_memory(base, slab_bytes_, access_);
  } catch (const std::exception& e) {
    log().warn("buffer_pool: cannot register a slab of {} bytes: {}", slab_bytes_, e.what());
    std::free(base);
    return false;
  }
  const auto first = static_cast<std::uint32_t>(slabs_.size()) * per_slab_;
  slabs_.push_back(std::move(s));  // capacity reserved: no reallocation
  for (std::uint32_t i = per_slab_; i > 0; --i) free_.push_back(first + i - 1);
  ++stats_.slabs;
  stats_.buffers += per_slab_;
  stats_.bytes += slab_bytes_;
  stats_.free = free_.size();
  log().debug("buffer_pool: slab {} registered ({} buffers of {} bytes)", slabs_.size(), per_slab_, buffer_size_);
  return true;
}

std::uint32_t buffer_pool::try_get() noexcept {
  if (free_.empty() && !grow()) {
    ++stats_.exhausted;
    return npos;
  }
  const std::uint32_t index = free_.back();
  free_.pop_back();
  ++stats_.gets;
  stats_.free = free_.size();
  return index;
}

void buffer_pool::put(std::uint32_t index) noexcept {
  free_.push_back(index);  // reserved for every buffer: never reallocates
  ++stats_.puts;
  stats_.free = free_.size();
}

}  // namespace anydoor
