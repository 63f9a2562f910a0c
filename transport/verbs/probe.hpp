// Asks rdma-core whether this host has an RDMA device with an active port
// (for provider=auto). Without ANYDOOR_WITH_VERBS it reports none.
#pragma once

#include <string>

namespace anydoor::transport::verbs {

struct probe_result {
  std::string active_device;  // empty: none
  std::string detail;         // what was found, for the log
};

probe_result probe_devices();

}  // namespace anydoor::transport::verbs
