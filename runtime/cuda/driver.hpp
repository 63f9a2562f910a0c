// Runtime-internal: the parts of the CUDA driver API the runtime calls,
// loaded at run time (see include/anydoor/cuda.hpp). Every call returns an
// error code, never throws; with the driver not usable every call fails
// with errc::not_supported.
#pragma once

#include <anydoor/cuda.hpp>
#include <anydoor/transport/provider.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <system_error>

namespace anydoor::cuda::detail {

// What stands in for the CUDA driver where a test makes host memory play
// GPU memory (test/support/fake_device_memory.hpp): which kind a pointer
// is, and copies. Installed with use_test_backend; the runtime asks it
// instead of the driver while it is installed.
class test_backend {
 public:
  virtual ~test_backend() = default;
  virtual memory_kind kind(const void* p) noexcept = 0;
  virtual std::error_code to_host(void* dst, const void* src, std::size_t n) noexcept = 0;
  virtual std::error_code to_device(void* dst, const void* src, std::size_t n) noexcept = 0;
  virtual std::shared_ptr<transport::memory_copier> copier(const void* p, std::size_t n) = 0;
};
// Tests only: b answers for the driver until the next call (nullptr: the
// driver again). Call it while no fabric is using memory.
void use_test_backend(test_backend* b) noexcept;
test_backend* installed_test_backend() noexcept;

// Whether this process has loaded the CUDA driver (libcuda.so.1) yet:
// without it no pointer can be GPU memory. Never loads it. Once loaded it
// stays true; before, it looks again at most every 10 ms (a data-path
// check costs a clock read; a look walks the loader's list of objects, no
// system call, and reads their names only when one was added since the
// last look), or now with look_now. (So GPU
// memory allocated within 10 ms of the process's first loading CUDA, and
// passed at once, can slip through a message check.)
bool process_has_cuda(bool look_now = false) noexcept;
// How many times process_has_cuda has read the names of the loaded objects
// (it does only when something was loaded since it last did; tests). 0 in
// a build without CUDA.
std::uint64_t loaded_object_looks() noexcept;

// Whether any pointer may be GPU memory now: the process has loaded a
// usable driver, or a test backend is installed. Cheap (see above).
inline bool any_gpu_memory(bool look_now = false) noexcept {
  return installed_test_backend() != nullptr || (process_has_cuda(look_now) && driver().usable);
}

// The kind of p as the runtime treats it: the test backend's answer while
// one is installed, else the driver's (kind_of).
memory_kind kind_here(const void* p) noexcept;

// Whether the CPU can read and write p (memcpy): false only for GPU device
// memory. No driver call in a process without CUDA.
inline bool cpu_reachable(const void* p, bool look_now = false) noexcept {
  return !any_gpu_memory(look_now) || kind_here(p) != memory_kind::cuda_device;
}

// Whether p may be registered as host memory (ibv_reg_mr, the software
// NIC's table): not GPU device memory, and not managed memory, which
// migrates (fabric::register_memory refuses both the same way).
inline bool host_registrable(const void* p, bool look_now = false) noexcept {
  if (!any_gpu_memory(look_now)) return true;
  const memory_kind k = kind_here(p);
  return k != memory_kind::cuda_device && k != memory_kind::cuda_managed;
}

// Synchronous copies between host memory and GPU device memory (the
// pointer's context; the calling thread's default stream, waited for
// until the bytes are in place): errc::device_copy_failed with the
// driver's reason in `why`.
std::error_code copy_to_host(void* dst, const void* src, std::size_t n, std::string& why) noexcept;
std::error_code copy_to_device(void* dst, const void* src, std::size_t n, std::string& why) noexcept;

// Page-locks host memory [p, p + n) for the GPU's copies
// (cuMemHostRegister, portable) until the returned handle goes, which must
// be before the memory is freed; null (nothing pinned, copies of it are
// only slower) without a driver, with a test backend, when no device's
// primary context is active, or when the driver refuses (logged).
std::shared_ptr<void> pin_host(void* p, std::size_t n) noexcept;

// What a device that reaches GPU memory by copies (caps().copied_memory:
// the tcp provider) gets for [p, p + n): a copier bound to the memory's
// context, with its own stream. Throws std::system_error with the reason:
// errc::not_supported (no driver), errc::invalid_argument (the range ends
// past its allocation; no context), errc::registration_failed (the driver
// refused a stream).
std::shared_ptr<transport::memory_copier> make_copier(const void* p, std::size_t n);

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
