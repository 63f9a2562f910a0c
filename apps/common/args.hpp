// Command-line helpers the apps share: a small option scanner, numbers with
// size suffixes, HOST:PORT, and one-line failures (exit code 2).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <string>
#include <string_view>

namespace anydoor::apps {

// Prints "PROGRAM: WHY" and the usage to stderr, exits with 2.
[[noreturn]] void usage_error(const char* program, const std::string& why, const char* usage);

// "123", "4K", "64k", "1M", "2G" (binary multiples: K = 1024). Returns
// false for anything else, for values above `max`, or below `min`.
bool parse_size(std::string_view s, std::uint64_t& out, std::uint64_t min = 0,
                std::uint64_t max = ~std::uint64_t{0}) noexcept;
// Seconds with an optional fraction: "3", "0.5".
bool parse_seconds(std::string_view s, double& out) noexcept;
// A --timeout in seconds as a deadline: at least 1 ms (a shorter one would
// read as "none"), at most 1 hour (the longest an RPC deadline carries).
std::chrono::milliseconds timeout_ms(double seconds) noexcept;

// "host:port", "[v6]:port"; port 0..65535 (port 0: any, for listeners).
struct endpoint {
  std::string host;
  std::uint16_t port = 0;
  std::string str() const;  // "host:port" ("[v6]:port")
};
bool parse_endpoint(std::string_view s, endpoint& out);

// Walks argv from index `first`: `next()` yields each argument, `value()`
// the one after the current option (or fails with "missing value after").
class arg_scanner {
 public:
  arg_scanner(int argc, char** argv, int first, const char* usage) noexcept
      : argc_(argc), argv_(argv), i_(first - 1), usage_(usage) {}
  bool next() noexcept { return ++i_ < argc_; }
  std::string_view arg() const noexcept { return argv_[i_]; }
  std::string_view value();
  std::uint64_t size_value(std::uint64_t min = 0, std::uint64_t max = ~std::uint64_t{0});
  [[noreturn]] void fail(const std::string& why) const { usage_error(argv_[0], why, usage_); }

 private:
  int argc_;
  char** argv_;
  int i_;
  const char* usage_;
};

}  // namespace anydoor::apps
