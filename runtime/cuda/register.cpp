#include "register.hpp"

#include "driver.hpp"

#include <anydoor/error.hpp>

#include <unistd.h>

#include <system_error>

namespace anydoor::cuda::detail {

std::string device_memory_path(const transport::device& dev) {
  const std::string where = std::string(dev.provider()) + " device " + std::string(dev.name());
  if (!driver().usable && installed_test_backend() == nullptr) return "none: " + driver().why;
  const transport::capabilities& c = dev.caps();
  if (c.peer_memory) return "GPUDirect RDMA through nvidia-peermem (ibv_reg_mr on device pointers) on " + where;
  // (A device that reaches memory by copies maps dma-bufs of host memory
  // only: a GPU's are not mappable.)
  if (c.dmabuf && !c.copied_memory) return "GPUDirect RDMA through dma-buf (ibv_reg_dmabuf_mr) on " + where;
  if (c.copied_memory) {
    return "CUDA copies by the software NIC on " + where + " (a stream of its own, through its host buffers)";
  }
  return "none on " + where + ": it has neither dma-buf registration nor nvidia-peermem";
}

std::unique_ptr<transport::memory_region> register_device_memory(transport::device& dev,
                                                                 transport::protection_domain& pd, void* p,
                                                                 std::size_t n, transport::access acc) {
  const transport::capabilities& c = dev.caps();
  const bool usable = driver().usable || installed_test_backend() != nullptr;
  if (!usable || (!c.peer_memory && !c.dmabuf && !c.copied_memory)) {
    throw std::system_error(errc::not_supported, "register_memory: GPU memory cannot be registered: " +
                                                     device_memory_path(dev));
  }
  if (c.peer_memory) return pd.register_memory(p, n, acc);
  if (c.copied_memory) return pd.register_copied(p, n, acc, make_copier(p, n));
  dmabuf_export e;
  std::string why;
  if (std::error_code ec = export_dmabuf(p, n, e, why)) {
    throw std::system_error(ec, "register_memory: GPU memory: " + why);
  }
  try {
    auto mr = pd.register_dmabuf(e.fd, e.offset, n, reinterpret_cast<std::uintptr_t>(p), acc);
    ::close(e.fd);  // the registration holds the buffer
    return mr;
  } catch (...) {
    ::close(e.fd);
    throw;
  }
}

bool reaches_gpu_memory(const transport::device& dev) noexcept {
  const transport::capabilities& c = dev.caps();
  return (driver().usable || installed_test_backend() != nullptr) && (c.peer_memory || c.dmabuf || c.copied_memory);
}

std::unique_ptr<transport::memory_region> register_any(transport::device& dev, transport::protection_domain& pd,
                                                       void* p, std::size_t n, transport::access acc, bool device) {
  return device ? register_device_memory(dev, pd, p, n, acc) : pd.register_memory(p, n, acc);
}

}  // namespace anydoor::cuda::detail
