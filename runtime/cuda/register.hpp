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
// dma-buf (ibv_reg_dmabuf_mr)", "... through nvidia-peermem", or why none.
std::string device_memory_path(const transport::device& dev);

// Registers [p, p + n) of GPU device memory (kind_of(p) == cuda_device):
// with peer memory as it is, else through a dma-buf of it whose iova is p
// (so the region's addr() is p either way). Throws std::system_error:
// errc::not_supported (with the reason) where the device can do neither,
// errc::registration_failed where it refuses.
std::unique_ptr<transport::memory_region> register_device_memory(transport::device& dev,
                                                                 transport::protection_domain& pd, void* p,
                                                                 std::size_t n, transport::access acc);

}  // namespace anydoor::cuda::detail
