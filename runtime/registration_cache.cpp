#include "registration_cache.hpp"

#include "log.hpp"
#include "cuda/driver.hpp"
#include "cuda/register.hpp"

#include <anydoor/error.hpp>
#include "split_region.hpp"

#include <unistd.h>

#include <algorithm>

namespace anydoor::detail {

namespace {

std::uintptr_t page_size() noexcept {
  static const auto size = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

}  // namespace

registration_cache::~registration_cache() {
  // Pinned entries cannot be left: the connections that pin them are gone
  // before the fabric (they hold it).
  for (auto& [begin, e] : index_) e->mr.reset();
  for (auto& e : retired_) e->mr.reset();
}

registration_cache::entry& registration_cache::pin(const void* p, std::size_t n, access acc) {
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  if (n > ~std::uintptr_t{0} - addr) {  // (set_local refuses such ranges first)
    throw std::system_error(anydoor::errc::invalid_argument, "a range reaching the end of the address space");
  }
  const std::uintptr_t last = addr + n;
  // Valid entries do not overlap: only the one starting at or before addr
  // can hold it.
  auto it = index_.upper_bound(addr);
  if (it != index_.begin()) {
    entry& e = *std::prev(it)->second;
    if (e.end >= last && has(e.acc, acc)) {
      ++stats_.hits;
      ++e.pins;
      lru_front(&e);
      return e;
    }
  }
  ++stats_.misses;
  // GPU device memory: registered as the device takes it, exactly the
  // range (a page around it may be another allocation, or none); managed
  // memory: refused (it migrates).
  const memory_kind kind = cuda::detail::any_gpu_memory() ? cuda::detail::kind_here(p) : memory_kind::host;
  const bool device = kind == memory_kind::cuda_device;
  if (kind == memory_kind::cuda_managed) {
    throw std::system_error(anydoor::errc::not_supported,
                            "CUDA managed memory passed as a plain buffer (it migrates between host and GPU): use "
                            "cuMemAlloc or cuMemHostAlloc memory");
  }
  if (device && device_ == nullptr) {
    throw std::system_error(anydoor::errc::not_supported, "GPU memory passed to a registration cache without a device");
  }
  const std::uintptr_t page = device ? 1 : page_size();
  if (last > ~std::uintptr_t{0} - (page - 1)) {  // (its end, rounded up to a page, would wrap to 0)
    throw std::system_error(anydoor::errc::invalid_argument, "a range in the last page of the address space");
  }
  std::uintptr_t begin = addr & ~(page - 1);
  std::uintptr_t end = (last + page - 1) & ~(page - 1);
  access merged = acc;
  std::vector<entry*> overlapping;
  it = index_.upper_bound(begin);
  if (it != index_.begin()) --it;
  for (; it != index_.end() && it->second->begin < end; ++it) {
    entry* e = it->second.get();
    if (e->end <= begin) continue;
    overlapping.push_back(e);
    begin = std::min(begin, e->begin);
    end = std::max(end, e->end);
    merged = merged | e->acc;
  }
  std::unique_ptr<transport::memory_region> mr;
  auto make = [&] {
    return device ? cuda::detail::register_device_memory(*device_, pd_, reinterpret_cast<void*>(begin), end - begin,
                                                         merged)
                  : register_in_pieces(pd_, reinterpret_cast<void*>(begin), end - begin, merged, piece_shift_);
  };
  try {
    mr = make();
  } catch (const std::system_error& e) {
    if (overlapping.empty()) throw;
    // A neighbour may cover memory that is gone (forget_memory was not
    // called): register the request alone, the neighbours are retired.
    log().debug("registration cache: merged registration failed ({}); registering the request alone", e.what());
    begin = addr & ~(page - 1);
    end = (last + page - 1) & ~(page - 1);
    merged = acc;
    mr = make();
  }
  for (entry* e : overlapping) {
    retire(e);
    if (e->pins == 0) destroy(e);
  }
  auto fresh = std::make_unique<entry>();
  entry& e = *fresh;
  e.begin = begin;
  e.end = end;
  e.acc = merged;
  e.mr = std::move(mr);
  e.split = as_split(e.mr.get());
  e.device = device;
  e.pins = 1;
  index_.emplace(begin, std::move(fresh));
  lru_front(&e);
  ++stats_.registrations;
  ++stats_.entries;
  stats_.bytes += end - begin;
  trim();
  return e;
}

void registration_cache::unpin(entry& e) noexcept {
  if (--e.pins != 0) return;
  if (e.retired) {
    destroy(&e);
    return;
  }
  trim();
}

std::size_t registration_cache::forget(const void* p, std::size_t n) noexcept {
  const auto begin = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t end = begin + n;
  std::vector<entry*> hit;
  auto it = index_.upper_bound(begin);
  if (it != index_.begin()) --it;
  for (; it != index_.end() && it->second->begin < end; ++it) {
    if (it->second->end > begin) hit.push_back(it->second.get());
  }
  for (entry* e : hit) {
    ++stats_.invalidations;
    retire(e);
    if (e->pins == 0) destroy(e);
  }
  return hit.size();
}

void registration_cache::retire(entry* e) noexcept {
  lru_unlink(e);
  e->retired = true;
  auto node = index_.extract(e->begin);
  retired_.push_back(std::move(node.mapped()));
}

void registration_cache::destroy(entry* e) noexcept {
  ++stats_.deregistrations;
  --stats_.entries;
  stats_.bytes -= e->end - e->begin;
  e->mr.reset();
  auto it = std::find_if(retired_.begin(), retired_.end(), [e](const auto& r) { return r.get() == e; });
  if (it != retired_.end()) retired_.erase(it);
}

void registration_cache::trim() noexcept {
  entry* e = lru_tail_;
  while (e != nullptr && (stats_.entries > max_entries_ || stats_.bytes > max_bytes_)) {
    entry* prev = e->lru_prev;
    if (e->pins == 0) {
      ++stats_.evictions;
      retire(e);
      destroy(e);
    }
    e = prev;
  }
}

void registration_cache::lru_unlink(entry* e) noexcept {
  if (e->lru_prev != nullptr) {
    e->lru_prev->lru_next = e->lru_next;
  } else if (lru_head_ == e) {
    lru_head_ = e->lru_next;
  }
  if (e->lru_next != nullptr) {
    e->lru_next->lru_prev = e->lru_prev;
  } else if (lru_tail_ == e) {
    lru_tail_ = e->lru_prev;
  }
  e->lru_prev = e->lru_next = nullptr;
}

void registration_cache::lru_front(entry* e) noexcept {
  if (lru_head_ == e) return;
  lru_unlink(e);
  e->lru_next = lru_head_;
  if (lru_head_ != nullptr) lru_head_->lru_prev = e;
  lru_head_ = e;
  if (lru_tail_ == nullptr) lru_tail_ = e;
}

}  // namespace anydoor::detail
