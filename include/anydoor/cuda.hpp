// GPU memory as the runtime sees it: which kind of memory a pointer is, and
// whether a CUDA driver is there to ask. The library never links the CUDA
// driver: built with ANYDOOR_WITH_CUDA it opens libcuda.so.1 at run time
// (dlopen) the first time it is asked, so one binary runs on hosts with and
// without a GPU, and says which it found. Built without CUDA, every pointer
// is host memory and driver() says why.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace anydoor {

// What a pointer points to (cuPointerGetAttribute's CU_POINTER_ATTRIBUTE_
// MEMORY_TYPE and IS_MANAGED).
enum class memory_kind : std::uint8_t {
  host,         // ordinary memory, or any pointer CUDA does not know
  cuda_device,  // cuMemAlloc / cudaMalloc: only the GPU (and a NIC through GPUDirect) reaches it
  cuda_managed, // cuMemAllocManaged: migrates between host and GPU
  cuda_host,    // cuMemHostAlloc / cudaHostAlloc: pinned host memory CUDA knows
};
std::string_view to_string(memory_kind k) noexcept;

namespace cuda {

// Whether this library was built with CUDA support (ANYDOOR_WITH_CUDA).
bool built_with_cuda() noexcept;

struct driver_status {
  bool usable = false;     // libcuda.so.1 loaded, cuInit(0) succeeded, at least one GPU
  int version = 0;         // cuDriverGetVersion: 13000 = 13.0 (0 when not loaded)
  int devices = 0;         // cuDeviceGetCount
  std::string why;         // when not usable: what is missing, in words
};

// Loads the driver once (thread-safe) and reports what it found. Never
// throws; never fails a host without a GPU.
const driver_status& driver() noexcept;

// The kind of memory p points to. host when the driver is not usable (or
// the library was built without CUDA) and for pointers CUDA does not know.
memory_kind kind_of(const void* p) noexcept;

}  // namespace cuda
}  // namespace anydoor
