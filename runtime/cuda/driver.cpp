#include "driver.hpp"

#include <anydoor/error.hpp>

#include <atomic>
#include <ctime>
#include <mutex>

#ifdef ANYDOOR_HAVE_CUDA
#include <cuda.h>
#include <dlfcn.h>
#include <unistd.h>
#endif

namespace anydoor {

std::string_view to_string(memory_kind k) noexcept {
  switch (k) {
    case memory_kind::host: return "host";
    case memory_kind::cuda_device: return "cuda_device";
    case memory_kind::cuda_managed: return "cuda_managed";
    case memory_kind::cuda_host: return "cuda_host";
  }
  return "unknown";
}

namespace cuda {

namespace detail {
aligned_range page_cover(const void* p, std::size_t n, std::size_t page) noexcept {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t start = a & ~(static_cast<std::uintptr_t>(page) - 1);
  const std::uintptr_t end = (a + n + page - 1) & ~(static_cast<std::uintptr_t>(page) - 1);
  return {start, static_cast<std::size_t>(end - start)};
}
}  // namespace detail

#ifdef ANYDOOR_HAVE_CUDA

bool built_with_cuda() noexcept { return true; }

namespace {

// The entry points, resolved by their versioned names (cuda.h maps the
// plain names to these).
struct api {
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*driver_version)(int*) = nullptr;
  CUresult (*device_count)(int*) = nullptr;
  CUresult (*error_string)(CUresult, const char**) = nullptr;
  CUresult (*pointer_attribute)(void*, CUpointer_attribute, CUdeviceptr) = nullptr;
  CUresult (*ctx_push)(CUcontext) = nullptr;
  CUresult (*ctx_pop)(CUcontext*) = nullptr;
  CUresult (*range_handle)(void*, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*primary_state)(CUdevice, unsigned*, int*) = nullptr;
  CUresult (*primary_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*primary_release)(CUdevice) = nullptr;
};

struct loaded {
  driver_status status;
  api fn;
};

std::string result_text(const api& fn, CUresult r) {
  const char* s = nullptr;
  if (fn.error_string != nullptr && fn.error_string(r, &s) == CUDA_SUCCESS && s != nullptr) {
    return std::string(s) + " (CUresult " + std::to_string(static_cast<int>(r)) + ")";
  }
  return "CUresult " + std::to_string(static_cast<int>(r));
}

loaded load() noexcept {
  loaded l;
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    l.status.why = "libcuda.so.1 cannot be loaded (no NVIDIA driver installed): " + std::string(::dlerror());
    return l;
  }
  bool all = true;
  auto sym = [&](auto& f, const char* name) {
    f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(::dlsym(lib, name));
    if (f == nullptr) all = false;
  };
  sym(l.fn.init, "cuInit");
  sym(l.fn.driver_version, "cuDriverGetVersion");
  sym(l.fn.device_count, "cuDeviceGetCount");
  sym(l.fn.error_string, "cuGetErrorString");
  sym(l.fn.pointer_attribute, "cuPointerGetAttribute");
  sym(l.fn.ctx_push, "cuCtxPushCurrent_v2");
  sym(l.fn.ctx_pop, "cuCtxPopCurrent_v2");
  sym(l.fn.range_handle, "cuMemGetHandleForAddressRange");
  sym(l.fn.device_get, "cuDeviceGet");
  sym(l.fn.primary_state, "cuDevicePrimaryCtxGetState");
  sym(l.fn.primary_retain, "cuDevicePrimaryCtxRetain");
  sym(l.fn.primary_release, "cuDevicePrimaryCtxRelease_v2");
  if (!all) {
    l.status.why = "libcuda.so.1 lacks driver API entry points the runtime needs (a driver older than CUDA 11.7?)";
    l.fn = {};
    return l;  // (the library stays loaded: unloading a driver buys nothing)
  }
  const CUresult r = l.fn.init(0);
  if (r == CUDA_ERROR_STUB_LIBRARY) {
    l.status.why = "libcuda.so.1 is the CUDA toolkit's stub library (CUDA_ERROR_STUB_LIBRARY): no NVIDIA driver "
                   "is installed";
  } else if (r == CUDA_ERROR_NO_DEVICE) {
    l.status.why = "the NVIDIA driver sees no GPU (CUDA_ERROR_NO_DEVICE)";
  } else if (r != CUDA_SUCCESS) {
    l.status.why = "cuInit failed: " + result_text(l.fn, r) + " (is the kernel module loaded? nvidia-smi)";
  }
  if (r != CUDA_SUCCESS) return l;
  l.fn.driver_version(&l.status.version);
  l.fn.device_count(&l.status.devices);
  if (l.status.devices <= 0) {
    l.status.why = "the NVIDIA driver sees no GPU";
    return l;
  }
  l.status.usable = true;
  return l;
}

const loaded& the_driver() noexcept {
  static const loaded l = load();  // thread-safe once
  return l;
}

}  // namespace

const driver_status& driver() noexcept { return the_driver().status; }

namespace detail {
bool process_has_cuda(bool look_now) noexcept {
  static std::atomic<bool> seen{false};
  static std::atomic<std::int64_t> next_look{0};
  if (seen.load(std::memory_order_relaxed)) return true;
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  const std::int64_t now = std::int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
  if (!look_now && now < next_look.load(std::memory_order_relaxed)) return false;
  next_look.store(now + 10000000, std::memory_order_relaxed);
  if (void* h = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD)) {
    ::dlclose(h);  // (NOLOAD took a reference)
    seen.store(true, std::memory_order_relaxed);
    return true;
  }
  return false;
}
}  // namespace detail

memory_kind kind_of(const void* p) noexcept {
  const loaded& d = the_driver();
  if (!d.status.usable || p == nullptr) return memory_kind::host;
  const auto ptr = static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p));
  unsigned int type = 0;
  // CUDA_ERROR_INVALID_VALUE: memory CUDA does not know, which is host memory.
  if (d.fn.pointer_attribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr) != CUDA_SUCCESS) return memory_kind::host;
  unsigned int managed = 0;
  if (d.fn.pointer_attribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, ptr) == CUDA_SUCCESS && managed != 0) {
    return memory_kind::cuda_managed;
  }
  if (type == CU_MEMORYTYPE_DEVICE) return memory_kind::cuda_device;
  if (type == CU_MEMORYTYPE_HOST) return memory_kind::cuda_host;
  return memory_kind::host;
}

namespace detail {

std::error_code export_dmabuf(const void* p, std::size_t n, dmabuf_export& out, std::string& why) noexcept {
  const loaded& d = the_driver();
  if (!d.status.usable) {
    why = d.status.why;
    return make_error_code(errc::not_supported);
  }
  const auto ptr = static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p));
  CUcontext ctx = nullptr;
  if (CUresult r = d.fn.pointer_attribute(&ctx, CU_POINTER_ATTRIBUTE_CONTEXT, ptr); r != CUDA_SUCCESS) {
    why = "the pointer's CUDA context: " + result_text(d.fn, r);
    return make_error_code(errc::invalid_argument);
  }
  bool release_primary = false;
  CUdevice dev = 0;
  if (ctx == nullptr) {
    // Memory of no context (cuMemCreate, stream-ordered pools): its
    // device's primary context exports it, if the application made it
    // active (the runtime never creates a context of its own).
    int ordinal = -1;
    unsigned flags = 0;
    int active = 0;
    CUresult r = d.fn.pointer_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr);
    if (r == CUDA_SUCCESS) r = d.fn.device_get(&dev, ordinal);
    if (r == CUDA_SUCCESS) r = d.fn.primary_state(dev, &flags, &active);
    if (r != CUDA_SUCCESS) {
      why = "the pointer's device: " + result_text(d.fn, r);
      return make_error_code(errc::invalid_argument);
    }
    if (active == 0) {
      why = "the memory belongs to no CUDA context and its device's primary context is not active";
      return make_error_code(errc::invalid_argument);
    }
    r = d.fn.primary_retain(&ctx, dev);
    if (r != CUDA_SUCCESS || ctx == nullptr) {
      why = "the device's primary context: " + (r != CUDA_SUCCESS ? result_text(d.fn, r) : std::string("none"));
      return make_error_code(errc::invalid_argument);
    }
    release_primary = true;
  }
  // The driver exports host-page-aligned ranges only.
  const aligned_range a = page_cover(p, n, static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)));
  int fd = -1;
  CUresult r = d.fn.ctx_push(ctx);
  if (r == CUDA_SUCCESS) {
    r = d.fn.range_handle(&fd, static_cast<CUdeviceptr>(a.start), a.length, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
    CUcontext popped = nullptr;
    d.fn.ctx_pop(&popped);
  }
  if (release_primary) d.fn.primary_release(dev);  // the dma-buf holds the memory, not the context
  if (r != CUDA_SUCCESS || fd < 0) {
    why = "cuMemGetHandleForAddressRange (dma-buf): " + result_text(d.fn, r);
    return make_error_code(r == CUDA_ERROR_NOT_SUPPORTED ? errc::not_supported : errc::registration_failed);
  }
  out.fd = fd;
  out.offset = reinterpret_cast<std::uintptr_t>(p) - a.start;
  return {};
}

}  // namespace detail

#else  // built without CUDA

bool built_with_cuda() noexcept { return false; }

const driver_status& driver() noexcept {
  static const driver_status s{.usable = false, .version = 0, .devices = 0,
                               .why = "anydoor was built without CUDA (ANYDOOR_WITH_CUDA=OFF or no toolkit found)"};
  return s;
}

memory_kind kind_of(const void*) noexcept { return memory_kind::host; }

namespace detail {
bool process_has_cuda(bool) noexcept { return false; }

std::error_code export_dmabuf(const void*, std::size_t, dmabuf_export&, std::string& why) noexcept {
  why = driver().why;
  return make_error_code(errc::not_supported);
}
}  // namespace detail

#endif

}  // namespace cuda
}  // namespace anydoor
