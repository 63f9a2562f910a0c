// The descriptor limit of a process that opens many connections.
#pragma once

#include <cstdint>

namespace anydoor::apps {

// Raises the soft RLIMIT_NOFILE to `need` descriptors when it is lower (up
// to the hard limit, or beyond it where the process may: root). When that
// is not enough, prints one line to stderr naming the limit and what is
// needed, and returns false (the program goes on: connections beyond the
// limit then fail with "too many open files").
bool ensure_fd_limit(std::uint64_t need, const char* program) noexcept;

}  // namespace anydoor::apps
