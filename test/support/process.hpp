// Test support: what this process holds and uses now (Linux /proc, getrusage),
// for the checks that memory and file descriptors stay flat (fault injection,
// soak) and that idle sides do not spin.
#pragma once

#include <dirent.h>
#include <sys/resource.h>

#include <cstddef>
#include <fstream>
#include <string>

namespace anydoor::test {

// Resident set size in KiB (VmRSS), 0 when /proc is unreadable.
inline std::size_t rss_kib() {
  std::ifstream in("/proc/self/status");
  std::string key;
  while (in >> key) {
    if (key == "VmRSS:") {
      std::size_t v = 0;
      in >> v;
      return v;
    }
    in.ignore(4096, '\n');
  }
  return 0;
}

// Open file descriptors (not counting the one that lists them).
inline std::size_t open_fds() {
  std::size_t n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (const dirent* e = ::readdir(d)) n += e->d_name[0] != '.' ? 1u : 0u;
    ::closedir(d);
  }
  return n - 1;  // the directory itself
}

// CPU time this process has used so far (user plus system), in seconds:
// the checks that an idle or stalled side does not spin.
inline double process_cpu_seconds() {
  rusage r{};
  ::getrusage(RUSAGE_SELF, &r);
  auto secs = [](const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) / 1e6; };
  return secs(r.ru_utime) + secs(r.ru_stime);
}

}  // namespace anydoor::test
