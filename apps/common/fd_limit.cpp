#include "common/fd_limit.hpp"

#include <sys/resource.h>

#include <cstdio>

namespace anydoor::apps {

bool ensure_fd_limit(std::uint64_t need, const char* program) noexcept {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= need) return true;
  rlimit want = rl;
  want.rlim_cur = need;
  if (want.rlim_max < need) want.rlim_max = need;  // only root (CAP_SYS_RESOURCE) may
  if (::setrlimit(RLIMIT_NOFILE, &want) == 0) return true;
  want.rlim_max = rl.rlim_max;
  want.rlim_cur = rl.rlim_max;  // as far as the hard limit allows
  ::setrlimit(RLIMIT_NOFILE, &want);
  ::getrlimit(RLIMIT_NOFILE, &rl);
  std::fprintf(stderr,
               "%s: %llu descriptors are needed, more than the descriptor limit allows (RLIMIT_NOFILE: soft %llu, "
               "hard %llu); connections beyond it fail with 'too many open files' (raise it with ulimit -n)\n",
               program, static_cast<unsigned long long>(need), static_cast<unsigned long long>(rl.rlim_cur),
               static_cast<unsigned long long>(rl.rlim_max));
  return false;
}

}  // namespace anydoor::apps
