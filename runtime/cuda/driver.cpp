#include "driver.hpp"

#include <anydoor/error.hpp>

#include "log.hpp"

#include <atomic>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <system_error>
#include <utility>

#ifdef ANYDOOR_HAVE_CUDA
#include <cuda.h>
#include <dlfcn.h>
#include <link.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <string_view>
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
namespace {
std::atomic<test_backend*> g_test_backend{nullptr};
}  // namespace

void use_test_backend(test_backend* b) noexcept { g_test_backend.store(b, std::memory_order_release); }
test_backend* installed_test_backend() noexcept { return g_test_backend.load(std::memory_order_acquire); }

memory_kind kind_here(const void* p) noexcept {
  if (test_backend* b = installed_test_backend()) return b->kind(p);
  return kind_of(p);
}

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
  CUresult (*memcpy_dtoh)(void*, CUdeviceptr, size_t) = nullptr;
  CUresult (*memcpy_htod)(CUdeviceptr, const void*, size_t) = nullptr;
  CUresult (*memcpy_dtoh_async)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*memcpy_htod_async)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*stream_create)(CUstream*, unsigned) = nullptr;
  CUresult (*stream_destroy)(CUstream) = nullptr;
  CUresult (*stream_synchronize)(CUstream) = nullptr;
  CUresult (*host_register)(void*, size_t, unsigned) = nullptr;
  CUresult (*host_unregister)(void*) = nullptr;
  CUresult (*ctx_get_device)(CUdevice*) = nullptr;
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
  sym(l.fn.memcpy_dtoh, "cuMemcpyDtoH_v2");
  sym(l.fn.memcpy_htod, "cuMemcpyHtoD_v2");
  sym(l.fn.memcpy_dtoh_async, "cuMemcpyDtoHAsync_v2");
  sym(l.fn.memcpy_htod_async, "cuMemcpyHtoDAsync_v2");
  sym(l.fn.stream_create, "cuStreamCreate");
  sym(l.fn.stream_destroy, "cuStreamDestroy_v2");
  sym(l.fn.stream_synchronize, "cuStreamSynchronize");
  sym(l.fn.host_register, "cuMemHostRegister_v2");
  sym(l.fn.host_unregister, "cuMemHostUnregister");
  sym(l.fn.ctx_get_device, "cuCtxGetDevice");
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

namespace {
// Whether a loaded object's file is named as the driver's library is
// (libcuda.so, libcuda.so.1, libcuda.so.<version>), in any directory.
bool driver_file_name(const char* path) noexcept {
  const char* base = std::strrchr(path, '/');
  base = base == nullptr ? path : base + 1;
  constexpr std::string_view lib = "libcuda.so";
  return std::strncmp(base, lib.data(), lib.size()) == 0 && (base[lib.size()] == '\0' || base[lib.size()] == '.');
}

// One look at the process's loaded objects (dl_iterate_phdr: no system
// call). The loader's count of objects ever added comes with the first
// object: unchanged since the last look, nothing new can be the driver.
struct object_scan {
  unsigned long long last_adds = 0;
  unsigned long long adds = 0;
  bool first = true;
  bool unchanged = false;
  bool driver_named = false;
};

int scan_object(dl_phdr_info* info, std::size_t size, void* data) noexcept {
  auto& s = *static_cast<object_scan*>(data);
  if (s.first) {
    s.first = false;
    if (size >= offsetof(dl_phdr_info, dlpi_adds) + sizeof info->dlpi_adds) {
      s.adds = info->dlpi_adds;
      if (s.adds != 0 && s.adds == s.last_adds) {
        s.unchanged = true;
        return 1;
      }
    }
  }
  if (info->dlpi_name != nullptr && driver_file_name(info->dlpi_name)) {
    s.driver_named = true;
    return 1;
  }
  return 0;
}

std::atomic<std::uint64_t> full_looks{0};
}  // namespace

namespace detail {
bool process_has_cuda(bool look_now) noexcept {
  static std::atomic<bool> seen{false};
  static std::atomic<std::int64_t> next_look{0};
  static std::atomic<unsigned long long> looked_at_adds{0};
  if (seen.load(std::memory_order_relaxed)) return true;
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  const std::int64_t now = std::int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
  if (!look_now && now < next_look.load(std::memory_order_relaxed)) return false;
  next_look.store(now + 10000000, std::memory_order_relaxed);
  // Asking the loader (dlopen with RTLD_NOLOAD) searches the library path
  // when the driver is not loaded: six failed openat calls and about 40 us,
  // which a message on the data path paid every 10 ms. The loaded objects'
  // names are read instead, and only when something was loaded since.
  object_scan s;
  s.last_adds = looked_at_adds.load(std::memory_order_relaxed);
  ::dl_iterate_phdr(scan_object, &s);
  if (s.unchanged) return false;
  full_looks.fetch_add(1, std::memory_order_relaxed);
  looked_at_adds.store(s.adds, std::memory_order_relaxed);
  // A file so named is the driver if the loader knows it by the name the
  // runtime opens (its soname, as before): asked only then.
  if (!s.driver_named) return false;
  if (void* h = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD)) {
    ::dlclose(h);  // (NOLOAD took a reference)
    seen.store(true, std::memory_order_relaxed);
    return true;
  }
  return false;
}

std::uint64_t loaded_object_looks() noexcept { return full_looks.load(std::memory_order_relaxed); }
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

namespace {

// The context GPU memory at ptr belongs to, made current for a scope: the
// pointer's own, or for memory of no context (cuMemCreate, stream-ordered
// pools) its device's primary context if the application made it active
// (retained meanwhile; the runtime never creates a context of its own).
class context_scope {
 public:
  context_scope() = default;
  context_scope(const context_scope&) = delete;
  context_scope& operator=(const context_scope&) = delete;
  ~context_scope() {
    if (pushed_) {
      CUcontext popped = nullptr;
      fn_->ctx_pop(&popped);
    }
    if (primary_) fn_->primary_release(dev_);
  }
  // Finds and retains the context (not current yet).
  std::error_code find(const loaded& d, CUdeviceptr ptr, std::string& why) noexcept {
    fn_ = &d.fn;
    if (CUresult r = d.fn.pointer_attribute(&ctx_, CU_POINTER_ATTRIBUTE_CONTEXT, ptr); r != CUDA_SUCCESS) {
      why = "the pointer's CUDA context: " + result_text(d.fn, r);
      return make_error_code(errc::invalid_argument);
    }
    if (ctx_ != nullptr) return {};
    int ordinal = -1;
    unsigned flags = 0;
    int active = 0;
    CUresult r = d.fn.pointer_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr);
    if (r == CUDA_SUCCESS) r = d.fn.device_get(&dev_, ordinal);
    if (r == CUDA_SUCCESS) r = d.fn.primary_state(dev_, &flags, &active);
    if (r != CUDA_SUCCESS) {
      why = "the pointer's device: " + result_text(d.fn, r);
      return make_error_code(errc::invalid_argument);
    }
    if (active == 0) {
      why = "the memory belongs to no CUDA context and its device's primary context is not active";
      return make_error_code(errc::invalid_argument);
    }
    r = d.fn.primary_retain(&ctx_, dev_);
    if (r != CUDA_SUCCESS || ctx_ == nullptr) {
      why = "the device's primary context: " + (r != CUDA_SUCCESS ? result_text(d.fn, r) : std::string("none"));
      return make_error_code(errc::invalid_argument);
    }
    primary_ = true;
    return {};
  }
  CUresult enter() noexcept {
    const CUresult r = fn_->ctx_push(ctx_);
    pushed_ = r == CUDA_SUCCESS;
    return r;
  }
  // Hands the retained context over (the caller releases a primary one).
  CUcontext take(bool& primary, CUdevice& dev) noexcept {
    primary = std::exchange(primary_, false);
    dev = dev_;
    return ctx_;
  }

 private:
  const api* fn_ = nullptr;
  CUcontext ctx_ = nullptr;
  CUdevice dev_ = 0;
  bool primary_ = false;
  bool pushed_ = false;
};

CUdeviceptr as_device(const void* p) noexcept { return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p)); }

std::error_code sync_copy(bool to_host, void* dst, const void* src, std::size_t n, std::string& why) noexcept {
  const loaded& d = the_driver();
  if (!d.status.usable) {
    why = d.status.why;
    return make_error_code(errc::not_supported);
  }
  context_scope scope;
  if (std::error_code ec = scope.find(d, as_device(to_host ? src : dst), why)) {
    return make_error_code(errc::device_copy_failed);
  }
  // On the calling thread's default stream, waited for: a synchronous
  // cuMemcpyHtoD from pageable memory returns once the bytes are staged,
  // before they are in place (a kernel on another stream could read the
  // old ones after the runtime said the message arrived); the stream's
  // synchronize waits for the copy itself.
  const char* call = "cuCtxPushCurrent";
  CUresult r = scope.enter();
  if (r == CUDA_SUCCESS) {
    call = to_host ? "cuMemcpyDtoHAsync" : "cuMemcpyHtoDAsync";
    r = to_host ? d.fn.memcpy_dtoh_async(dst, as_device(src), n, CU_STREAM_PER_THREAD)
                : d.fn.memcpy_htod_async(as_device(dst), src, n, CU_STREAM_PER_THREAD);
  }
  if (r == CUDA_SUCCESS) {
    call = "cuStreamSynchronize";
    r = d.fn.stream_synchronize(CU_STREAM_PER_THREAD);
  }
  if (r != CUDA_SUCCESS) {
    why = std::string(call) + ": " + result_text(d.fn, r);
    return make_error_code(errc::device_copy_failed);
  }
  return {};
}

// A context the runtime holds: a primary one retained until the last
// holder goes (a copier; the bounce buffers pinned in it).
struct held_context {
  const api& fn;
  CUcontext ctx;
  bool primary;
  CUdevice dev;
  held_context(const api& f, CUcontext c, bool p, CUdevice d) noexcept : fn(f), ctx(c), primary(p), dev(d) {}
  ~held_context() {
    if (primary) fn.primary_release(dev);
  }
  held_context(const held_context&) = delete;
  held_context& operator=(const held_context&) = delete;
};

// Undoes cuMemHostRegister of q in held's context; false when it could
// not (the memory must then stay allocated: freed, its pages could come
// back from the heap while the driver takes them for pinned). A driver
// shut down (the process exiting) or memory not registered counts as
// done.
bool unpin(const held_context& held, void* q) noexcept {
  CUresult r = held.fn.ctx_push(held.ctx);
  if (r == CUDA_SUCCESS) {
    r = held.fn.host_unregister(q);
    CUcontext popped = nullptr;
    held.fn.ctx_pop(&popped);
  }
  return r == CUDA_SUCCESS || r == CUDA_ERROR_DEINITIALIZED || r == CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
}

// The tcp provider's way into GPU memory: copies on a stream of its own
// in the memory's context, one at a time (the provider's threads share
// it), each waited for.
class cuda_copier final : public transport::memory_copier {
 public:
  cuda_copier(const loaded& d, std::shared_ptr<held_context> ctx, CUstream stream) noexcept
      : d_(d), held_(std::move(ctx)), ctx_(held_->ctx), stream_(stream) {}
  ~cuda_copier() override {
    if (d_.fn.ctx_push(ctx_) == CUDA_SUCCESS) {
      d_.fn.stream_destroy(stream_);
      CUcontext popped = nullptr;
      d_.fn.ctx_pop(&popped);
    }
  }
  cuda_copier(const cuda_copier&) = delete;
  cuda_copier& operator=(const cuda_copier&) = delete;
  std::error_code to_host(void* dst, const void* src, std::size_t n) noexcept override {
    return copy(true, dst, src, n);
  }
  std::error_code to_device(void* dst, const void* src, std::size_t n) noexcept override {
    return copy(false, dst, src, n);
  }
  // Started on the copier's stream; finish() synchronizes it.
  std::error_code start_to_host(void* dst, const void* src, std::size_t n) noexcept override {
    return start(true, dst, src, n);
  }
  std::error_code start_to_device(void* dst, const void* src, std::size_t n) noexcept override {
    return start(false, dst, src, n);
  }
  std::error_code finish() noexcept override {
    std::lock_guard lock(mutex_);
    CUresult r = d_.fn.ctx_push(ctx_);
    if (r != CUDA_SUCCESS) return failed(r);
    r = d_.fn.stream_synchronize(stream_);
    CUcontext popped = nullptr;
    d_.fn.ctx_pop(&popped);
    return r == CUDA_SUCCESS ? std::error_code{} : failed(r);
  }
  // Page-locked (cuMemHostRegister, portable: pinned for every context)
  // while the buffer lives, in the primary context of the memory's device,
  // retained meanwhile (the buffer outlives the copier, and an
  // application's own context may be destroyed first); ordinary memory,
  // with a word in the log once, where the driver refuses (a memlock
  // limit, say): copies still work, slower.
  std::shared_ptr<std::byte> bounce_buffer(std::size_t n) noexcept override {
    const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    const std::size_t len = (n + page - 1) / page * page;
    auto* p = static_cast<std::byte*>(std::aligned_alloc(page, len));
    if (p == nullptr) return nullptr;
    std::shared_ptr<held_context> primary;
    CUdevice dev = 0;
    CUresult r = d_.fn.ctx_push(ctx_);
    if (r == CUDA_SUCCESS) {
      r = d_.fn.ctx_get_device(&dev);
      CUcontext popped = nullptr;
      d_.fn.ctx_pop(&popped);
    }
    CUcontext pctx = nullptr;
    if (r == CUDA_SUCCESS) r = d_.fn.primary_retain(&pctx, dev);
    if (r == CUDA_SUCCESS) {
      try {
        primary = std::make_shared<held_context>(d_.fn, pctx, true, dev);
      } catch (const std::bad_alloc&) {
        d_.fn.primary_release(dev);
        r = CUDA_ERROR_OUT_OF_MEMORY;
      }
    }
    if (r == CUDA_SUCCESS) r = d_.fn.ctx_push(pctx);
    if (r == CUDA_SUCCESS) {
      r = d_.fn.host_register(p, len, CU_MEMHOSTREGISTER_PORTABLE);
      CUcontext popped = nullptr;
      d_.fn.ctx_pop(&popped);
    }
    const bool pinned = r == CUDA_SUCCESS;
    if (!pinned) {
      primary.reset();
      if (!bounce_warned_.exchange(true)) {
        log().warn("cuda: a {}-byte bounce buffer for GPU memory copies could not be page-locked ({}): its copies "
                   "are slower", len, result_text(d_.fn, r));
      }
    }
    try {
      return std::shared_ptr<std::byte>(p, [primary](std::byte* q) noexcept {
        if (primary == nullptr) {
          std::free(q);
          return;
        }
        if (unpin(*primary, q)) std::free(q);
        // (else still registered: freed, the pages could come back to
        // the heap while the driver thinks them pinned; kept instead)
      });
    } catch (const std::bad_alloc&) {  // (the deleter ran)
      return nullptr;
    }
  }

 private:
  std::error_code copy(bool to_host, void* dst, const void* src, std::size_t n) noexcept {
    std::lock_guard lock(mutex_);
    CUresult r = d_.fn.ctx_push(ctx_);
    if (r != CUDA_SUCCESS) return failed(r);
    r = to_host ? d_.fn.memcpy_dtoh_async(dst, as_device(src), n, stream_)
                : d_.fn.memcpy_htod_async(as_device(dst), src, n, stream_);
    if (r == CUDA_SUCCESS) r = d_.fn.stream_synchronize(stream_);
    CUcontext popped = nullptr;
    d_.fn.ctx_pop(&popped);
    return r == CUDA_SUCCESS ? std::error_code{} : failed(r);
  }
  std::error_code start(bool to_host, void* dst, const void* src, std::size_t n) noexcept {
    std::lock_guard lock(mutex_);
    CUresult r = d_.fn.ctx_push(ctx_);
    if (r != CUDA_SUCCESS) return failed(r);
    r = to_host ? d_.fn.memcpy_dtoh_async(dst, as_device(src), n, stream_)
                : d_.fn.memcpy_htod_async(as_device(dst), src, n, stream_);
    CUcontext popped = nullptr;
    d_.fn.ctx_pop(&popped);
    return r == CUDA_SUCCESS ? std::error_code{} : failed(r);
  }
  std::error_code failed(CUresult r) noexcept {
    // The provider logs the error code; the driver's words, once, here.
    if (!warned_.exchange(true)) log().warn("cuda: a copy for the tcp provider failed: {}", result_text(d_.fn, r));
    return make_error_code(errc::device_copy_failed);
  }
  const loaded& d_;
  std::shared_ptr<held_context> held_;
  CUcontext ctx_;
  CUstream stream_;
  std::mutex mutex_;
  std::atomic<bool> warned_{false};
  std::atomic<bool> bounce_warned_{false};
};

}  // namespace

namespace {
std::shared_ptr<transport::memory_copier> driver_copier(const void* p, std::size_t n) {
  const loaded& d = the_driver();
  if (!d.status.usable) throw std::system_error(errc::not_supported, d.status.why);
  // The range lies in one allocation (a copy past its end would fail
  // later, in the provider, as a memory error of the connection).
  const CUdeviceptr ptr = as_device(p);
  CUdeviceptr start = 0;
  std::size_t size = 0;
  if (d.fn.pointer_attribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr) == CUDA_SUCCESS &&
      d.fn.pointer_attribute(&size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr) == CUDA_SUCCESS &&
      (ptr < start || n > size || ptr - start > size - n)) {
    throw std::system_error(errc::invalid_argument, "register_memory: GPU memory: [" + std::to_string(ptr) + ", +" +
                                                        std::to_string(n) + ") ends past its allocation of " +
                                                        std::to_string(size) + " bytes");
  }
  context_scope scope;
  std::string why;
  if (std::error_code ec = scope.find(d, ptr, why)) throw std::system_error(ec, why);
  CUresult r = scope.enter();
  if (r != CUDA_SUCCESS) throw std::system_error(errc::registration_failed, "cuCtxPushCurrent: " + result_text(d.fn, r));
  CUstream stream = nullptr;
  r = d.fn.stream_create(&stream, CU_STREAM_NON_BLOCKING);
  if (r != CUDA_SUCCESS) throw std::system_error(errc::registration_failed, "cuStreamCreate: " + result_text(d.fn, r));
  bool primary = false;
  CUdevice dev = 0;
  CUcontext ctx = scope.take(primary, dev);
  // (no memory for what holds them: the stream goes, in its context)
  auto drop_stream = [&] {
    if (d.fn.ctx_push(ctx) == CUDA_SUCCESS) {
      d.fn.stream_destroy(stream);
      CUcontext popped = nullptr;
      d.fn.ctx_pop(&popped);
    }
  };
  std::shared_ptr<held_context> held;
  try {
    held = std::make_shared<held_context>(d.fn, ctx, primary, dev);
  } catch (...) {
    drop_stream();
    if (primary) d.fn.primary_release(dev);
    throw;
  }
  try {
    return std::make_shared<cuda_copier>(d, held, stream);
  } catch (...) {
    drop_stream();  // (held, alive until the throw leaves, still holds the context)
    throw;
  }
}
}  // namespace

std::shared_ptr<void> pin_host(void* p, std::size_t n) noexcept {
  const loaded& d = the_driver();
  if (!d.status.usable || installed_test_backend() != nullptr || !process_has_cuda(true)) return nullptr;
  // The first device whose primary context the application made active
  // (retained while the memory is pinned; portable: pinned for every
  // context). None active: nothing is pinned.
  for (int i = 0; i < d.status.devices; ++i) {
    CUdevice dev = 0;
    unsigned flags = 0;
    int active = 0;
    if (d.fn.device_get(&dev, i) != CUDA_SUCCESS || d.fn.primary_state(dev, &flags, &active) != CUDA_SUCCESS ||
        active == 0) {
      continue;
    }
    CUcontext ctx = nullptr;
    if (d.fn.primary_retain(&ctx, dev) != CUDA_SUCCESS) continue;
    std::shared_ptr<held_context> held;
    try {
      held = std::make_shared<held_context>(d.fn, ctx, true, dev);
    } catch (const std::bad_alloc&) {
      d.fn.primary_release(dev);
      return nullptr;
    }
    CUresult r = d.fn.ctx_push(ctx);
    if (r == CUDA_SUCCESS) {
      r = d.fn.host_register(p, n, CU_MEMHOSTREGISTER_PORTABLE);
      CUcontext popped = nullptr;
      d.fn.ctx_pop(&popped);
    }
    if (r != CUDA_SUCCESS) {
      log().warn("cuda: {} bytes of staging buffers could not be page-locked ({}): their copies are slower", n,
                 result_text(d.fn, r));
      return nullptr;
    }
    try {
      // (a primary context retained: only a driver shutting down, which
      // unpins everything, keeps the unpin from happening)
      return std::shared_ptr<void>(p, [held](void* q) noexcept { (void)unpin(*held, q); });
    } catch (const std::bad_alloc&) {  // (the deleter ran)
      return nullptr;
    }
  }
  log().info("cuda: no GPU's primary context is active: {} bytes of staging buffers stay pageable (their copies are "
             "slower)", n);
  return nullptr;
}

std::error_code export_dmabuf(const void* p, std::size_t n, dmabuf_export& out, std::string& why) noexcept {
  const loaded& d = the_driver();
  if (!d.status.usable) {
    why = d.status.why;
    return make_error_code(errc::not_supported);
  }
  context_scope scope;
  if (std::error_code ec = scope.find(d, as_device(p), why)) return ec;
  // The driver exports host-page-aligned ranges only.
  const aligned_range a = page_cover(p, n, static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)));
  int fd = -1;
  CUresult r = scope.enter();
  if (r == CUDA_SUCCESS) {
    r = d.fn.range_handle(&fd, static_cast<CUdeviceptr>(a.start), a.length, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  }
  // (the scope pops the context, and releases a primary one: the dma-buf
  // holds the memory, not the context)
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
std::uint64_t loaded_object_looks() noexcept { return 0; }

namespace {
std::error_code sync_copy(bool, void*, const void*, std::size_t, std::string& why) noexcept {
  why = driver().why;
  return make_error_code(errc::not_supported);
}

std::shared_ptr<transport::memory_copier> driver_copier(const void*, std::size_t) {
  throw std::system_error(errc::not_supported, driver().why);
}
}  // namespace

std::shared_ptr<void> pin_host(void*, std::size_t) noexcept { return nullptr; }

std::error_code export_dmabuf(const void*, std::size_t, dmabuf_export&, std::string& why) noexcept {
  why = driver().why;
  return make_error_code(errc::not_supported);
}
}  // namespace detail

#endif

namespace detail {

// The test's stand-in first (both builds), else the driver.
std::error_code copy_to_host(void* dst, const void* src, std::size_t n, std::string& why) noexcept {
  test_backend* b = installed_test_backend();
  if (b == nullptr) return sync_copy(true, dst, src, n, why);
  const std::error_code ec = b->to_host(dst, src, n);
  if (ec) why = "the test's stand-in failed the copy: " + ec.message();
  return ec;
}

std::error_code copy_to_device(void* dst, const void* src, std::size_t n, std::string& why) noexcept {
  test_backend* b = installed_test_backend();
  if (b == nullptr) return sync_copy(false, dst, src, n, why);
  const std::error_code ec = b->to_device(dst, src, n);
  if (ec) why = "the test's stand-in failed the copy: " + ec.message();
  return ec;
}

std::shared_ptr<transport::memory_copier> make_copier(const void* p, std::size_t n) {
  if (test_backend* b = installed_test_backend()) return b->copier(p, n);
  return driver_copier(p, n);
}

}  // namespace detail

}  // namespace cuda
}  // namespace anydoor
