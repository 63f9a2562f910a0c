// The command line both benchmark programs share:
//   (--server | --connect HOST) [--port P] [--test T] [-s SIZE] [-n ITERS]
//   [--window W] [--slots N] [--provider auto|tcp|verbs]
// A bad command line prints `usage` with the reason and exits with 2.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <string_view>

namespace anydoor::bench {

struct cli_options {
  bool server = false;
  std::string host;
  std::uint16_t port = 0;
  std::string test;
  std::uint32_t size = 0;   // 0: the program's default for the test
  std::uint32_t iters = 0;  // likewise
  std::uint32_t window = 0;
  std::uint32_t slots = 0;  // 0: the program's default
  std::string provider = "auto";
};

// `defaults` gives port, test and window; `tests` the valid --test values.
inline cli_options parse_cli(int argc, char** argv, const char* usage, cli_options defaults,
                             std::initializer_list<std::string_view> tests) {
  auto fail = [&](const std::string& why) {
    std::fprintf(stderr, "%s: %s\nusage: %s\n", argv[0], why.c_str(), usage);
    std::exit(2);
  };
  auto number = [&](const char* s) {
    char* end = nullptr;
    const unsigned long v = std::strtoul(s, &end, 10);
    if (end == s || *end != '\0' || v == 0 || v > 0xffffffffUL) fail(std::string("expected a positive number: ") + s);
    return static_cast<std::uint32_t>(v);
  };
  cli_options o = std::move(defaults);
  bool port_zero = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) fail("missing value after " + a);
      return argv[++i];
    };
    if (a == "--server") o.server = true;
    else if (a == "--connect") o.host = next();
    else if (a == "--port") {
      // 0..65535 (0: the server's, any free port, printed); a wider value
      // was once taken modulo 65536.
      const char* v = next();
      const std::string_view digits(v);
      const bool ok = !digits.empty() && digits.size() <= 5 &&
                      digits.find_first_not_of("0123456789") == std::string_view::npos;
      const unsigned long p = ok ? std::strtoul(v, nullptr, 10) : 0;
      if (!ok || p > 65535) fail(std::string("--port must be 0..65535: ") + v);
      o.port = static_cast<std::uint16_t>(p);
      port_zero = p == 0;
    }
    else if (a == "--test") o.test = next();
    else if (a == "-s") o.size = number(next());
    else if (a == "-n") o.iters = number(next());
    else if (a == "--window") o.window = number(next());
    else if (a == "--slots") o.slots = number(next());
    else if (a == "--provider") o.provider = next();
    else fail("unknown option " + a);
  }
  if (o.server == !o.host.empty()) fail("give exactly one of --server and --connect");
  if (port_zero && !o.server) fail("--port 0 is the server's (any free port)");
  bool known = false;
  for (std::string_view t : tests) known |= o.test == t;
  if (!known) fail("unknown --test " + o.test);
  return o;
}

}  // namespace anydoor::bench
