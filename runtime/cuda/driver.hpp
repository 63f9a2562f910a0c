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
