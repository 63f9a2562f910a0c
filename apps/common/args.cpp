#include "args.hpp"

#include <algorithm>
#include <cmath>
#include <charconv>

namespace anydoor::apps {

void usage_error(const char* program, const std::string& why, const char* usage) {
  std::fprintf(stderr, "%s: %s\nusage: %s\n", program, why.c_str(), usage);
  std::exit(2);
}

bool parse_size(std::string_view s, std::uint64_t& out, std::uint64_t min, std::uint64_t max) noexcept {
  std::uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p == s.data()) return false;
  std::string_view rest(p, static_cast<std::size_t>(s.data() + s.size() - p));
  unsigned shift = 0;
  if (rest == "k" || rest == "K" || rest == "KiB") shift = 10;
  else if (rest == "m" || rest == "M" || rest == "MiB") shift = 20;
  else if (rest == "g" || rest == "G" || rest == "GiB") shift = 30;
  else if (!rest.empty()) return false;
  if (shift != 0 && v > (~std::uint64_t{0} >> shift)) return false;
  v <<= shift;
  if (v < min || v > max) return false;
  out = v;
  return true;
}

std::chrono::milliseconds timeout_ms(double seconds) noexcept {
  const double ms = std::clamp(seconds * 1000.0, 1.0, 3600.0 * 1000.0);
  return std::chrono::milliseconds(std::llround(ms));
}

bool parse_seconds(std::string_view s, double& out) noexcept {
  double v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || !(v > 0) || v > 1e7) return false;
  out = v;
  return true;
}

std::string endpoint::str() const {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

bool parse_endpoint(std::string_view s, endpoint& out) {
  std::string_view host, port;
  if (!s.empty() && s.front() == '[') {
    const auto close = s.find(']');
    if (close == std::string_view::npos || close + 1 >= s.size() || s[close + 1] != ':') return false;
    host = s.substr(1, close - 1);
    port = s.substr(close + 2);
  } else {
    const auto colon = s.rfind(':');
    if (colon == std::string_view::npos) return false;
    host = s.substr(0, colon);
    port = s.substr(colon + 1);
    if (host.find(':') != std::string_view::npos) return false;  // v6 needs brackets
  }
  unsigned v = 0;
  auto [p, ec] = std::from_chars(port.data(), port.data() + port.size(), v);
  if (host.empty() || port.empty() || ec != std::errc() || p != port.data() + port.size() || v > 65535) return false;
  out.host = std::string(host);
  out.port = static_cast<std::uint16_t>(v);
  return true;
}

std::string_view arg_scanner::value() {
  const std::string_view opt = arg();
  if (i_ + 1 >= argc_) fail("missing value after " + std::string(opt));
  return argv_[++i_];
}

std::uint64_t arg_scanner::size_value(std::uint64_t min, std::uint64_t max) {
  const std::string opt(arg());
  const std::string_view v = value();
  std::uint64_t out = 0;
  if (!parse_size(v, out, min, max)) {
    fail(opt + " takes a number from " + std::to_string(min) + " to " + std::to_string(max) +
         " (suffixes K, M, G), not '" + std::string(v) + "'");
  }
  return out;
}

}  // namespace anydoor::apps
