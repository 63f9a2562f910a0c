// Runtime-internal: the parts of the CUDA driver API the runtime calls,
// loaded at run time (see include/anydoor/cuda.hpp). Every call returns an
// error code, never throws; with the driver not usable every call fails
// with errc::not_supported.
#pragma once

#include <anydoor/cuda.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <system_error>

namespace anydoor::cuda::detail {

// Whether this process has loaded the CUDA driver (libcuda.so.1) yet:
// without it no pointer can be GPU memory. Never loads it. Once loaded it
// stays true; before, it looks again at most every 10 ms (a data-path
// check costs a clock read, not a dlopen), or now with look_now. (So GPU
// memory allocated within 10 ms of the process's first loading CUDA, and
// passed at once, can slip through a message check.)
bool process_has_cuda(bool look_now = false) noexcept;

// Whether the CPU can read and write p (memcpy): false only for GPU device
// memory, as the driver says. No driver call in a process without CUDA.
inline bool cpu_reachable(const void* p, bool look_now = false) noexcept {
  return !process_has_cuda(look_now) || !driver().usable || kind_of(p) != memory_kind::cuda_device;
}

// Whether p may be registered as host memory (ibv_reg_mr, the software
// NIC's table): not GPU device memory, and not managed memory, which
// migrates (fabric::register_memory refuses both the same way).
inline bool host_registrable(const void* p, bool look_now = false) noexcept {
  if (!process_has_cuda(look_now) || !driver().usable) return true;
  const memory_kind k = kind_of(p);
  return k != memory_kind::cuda_device && k != memory_kind::cuda_managed;
}

// A dma-buf of GPU memory (cuMemGetHandleForAddressRange): the fd covers
// the host-page-aligned range around [p, p + n); p's byte is at `offset`
// in it. The caller closes fd.
struct dmabuf_export {
  int fd = -1;
  std::uint64_t offset = 0;
};
std::error_code export_dmabuf(const void* p, std::size_t n, dmabuf_export& out, std::string& why) noexcept;

// The range's page-aligned cover, as export_dmabuf asks the driver for it.
struct aligned_range {
  std::uintptr_t start = 0;
  std::size_t length = 0;
};
aligned_range page_cover(const void* p, std::size_t n, std::size_t page) noexcept;

}  // namespace anydoor::cuda::detail
