// Runtime-internal: how GPU memory is registered with a device, and the
// words that say so (logged once at fabric start, used in errors).
#pragma once

#include <anydoor/cuda.hpp>
#include <anydoor/transport/provider.hpp>

#include <cstddef>
#include <memory>
#include <string>

namespace anydoor::cuda::detail {

// The path device memory takes on `dev`, in words: "GPUDirect RDMA through
// dma-buf (ibv_reg_dmabuf_mr)", "... through nvidia-peermem", "CUDA
// copies by the software NIC" (tcp), or why none.
std::string device_memory_path(const transport::device& dev);

// Registers [p, p + n) of GPU device memory (kind_here(p) == cuda_device):
// with peer memory as it is; on a device that reaches memory by copies
// (tcp) with a copier; else through a dma-buf of it whose iova is p (so
// the region's addr() is p every way). Throws std::system_error:
// errc::not_supported (with the reason) where the device can do none of
// these, and for remote_atomic access by copies; errc::registration_failed
// where it refuses.
std::unique_ptr<transport::memory_region> register_device_memory(transport::device& dev,
                                                                 transport::protection_domain& pd, void* p,
                                                                 std::size_t n, transport::access acc);

// Whether `dev` reaches GPU device memory at all (GPUDirect RDMA, or the
// tcp provider's copies) with a usable driver (or a test's stand-in).
bool reaches_gpu_memory(const transport::device& dev) noexcept;

// Registers [p, p + n) as one region whatever it is: GPU device memory as
// register_device_memory does (`device` says it is), anything else as host
// memory. Throws as those do.
std::unique_ptr<transport::memory_region> register_any(transport::device& dev, transport::protection_domain& pd,
                                                       void* p, std::size_t n, transport::access acc, bool device);

}  // namespace anydoor::cuda::detail
