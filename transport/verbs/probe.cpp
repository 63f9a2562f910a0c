#include "verbs/probe.hpp"

#ifdef ANYDOOR_HAVE_VERBS
#include <infiniband/verbs.h>

#include <cerrno>
#include <cstring>
#endif

namespace anydoor::transport::verbs {

probe_result probe_devices() {
  probe_result r;
#ifdef ANYDOOR_HAVE_VERBS
  int count = 0;
  ibv_device** list = ibv_get_device_list(&count);
  if (list == nullptr) {
    r.detail = std::string("no RDMA devices: ") + std::strerror(errno);
    return r;
  }
  for (int i = 0; i < count && r.active_device.empty(); ++i) {
    ibv_context* ctx = ibv_open_device(list[i]);
    if (ctx == nullptr) continue;
    ibv_device_attr attr{};
    if (ibv_query_device(ctx, &attr) == 0) {
      for (std::uint8_t port = 1; port <= attr.phys_port_cnt; ++port) {
        ibv_port_attr pattr{};
        if (ibv_query_port(ctx, port, &pattr) == 0 && pattr.state == IBV_PORT_ACTIVE) {
          r.active_device = ibv_get_device_name(list[i]);
          break;
        }
      }
    }
    ibv_close_device(ctx);
  }
  r.detail = std::to_string(count) + " verbs device(s) found";
  ibv_free_device_list(list);
#else
  r.detail = "built without ANYDOOR_WITH_VERBS";
#endif
  return r;
}

}  // namespace anydoor::transport::verbs
