#include "register.hpp"

#include "driver.hpp"

#include <anydoor/error.hpp>

#include <unistd.h>

#include <system_error>

namespace anydoor::cuda::detail {

namespace {
bool is_tcp(const transport::device& dev) { return dev.provider() == "tcp"; }
}  // namespace

std::string device_memory_path(const transport::device& dev) {
  const std::string where = std::string(dev.provider()) + " device " + std::string(dev.name());
  if (!driver().usable) return "none: " + driver().why;
  // The software NIC's dma-bufs are host buffers it maps; a GPU's cannot
  // be mapped that way, and its CUDA-copy path is not built yet.
  if (is_tcp(dev)) return "none on " + where + ": the tcp provider does not reach GPU memory yet";
  if (dev.caps().peer_memory) return "GPUDirect RDMA through nvidia-peermem (ibv_reg_mr on device pointers) on " + where;
  if (dev.caps().dmabuf) return "GPUDirect RDMA through dma-buf (ibv_reg_dmabuf_mr) on " + where;
  return "none on " + where + ": it has neither dma-buf registration nor nvidia-peermem";
}

std::unique_ptr<transport::memory_region> register_device_memory(transport::device& dev,
                                                                 transport::protection_domain& pd, void* p,
                                                                 std::size_t n, transport::access acc) {
  if (!driver().usable || is_tcp(dev) || (!dev.caps().peer_memory && !dev.caps().dmabuf)) {
    throw std::system_error(errc::not_supported, "register_memory: GPU memory cannot be registered: " +
                                                     device_memory_path(dev));
  }
  if (dev.caps().peer_memory) return pd.register_memory(p, n, acc);
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

}  // namespace anydoor::cuda::detail
