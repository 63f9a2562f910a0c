// anydoor-echo server --listen HOST:PORT [--provider auto|tcp|verbs] [--max-message BYTES]
//                     [--max-connections N] [--threads N] [--credits N] [--srq BUFFERS]
//                     [--metrics-listen HOST:PORT]
// anydoor-echo client --connect HOST:PORT [--size BYTES] [--count N | --duration SECONDS]
//                     [--in-flight N] [--connections N] [--credits N] [--timeout SECONDS] [--verify]
//                     [--json] [--provider auto|tcp|verbs]
#include "echo.hpp"

#include <cstring>
#include <exception>

namespace {

constexpr const char* kUsage =
    "anydoor-echo server --listen HOST:PORT [--provider auto|tcp|verbs] [--max-message BYTES] "
    "[--max-connections N] [--threads N] [--credits N] [--srq BUFFERS] [--metrics-listen HOST:PORT]\n"
    "       anydoor-echo client --connect HOST:PORT [--size BYTES] [--count N | --duration SECONDS] "
    "[--in-flight N] [--connections N] [--credits N] [--timeout SECONDS] [--verify] [--json] [--threads N] [--provider auto|tcp|verbs]";

using anydoor::apps::arg_scanner;

std::string provider_value(arg_scanner& a) {
  std::string p(a.value());
  if (p != "auto" && p != "tcp" && p != "verbs") a.fail("--provider takes auto, tcp or verbs, not '" + p + "'");
  return p;
}

anydoor::apps::endpoint endpoint_value(arg_scanner& a) {
  const std::string opt(a.arg());
  const std::string_view v = a.value();
  anydoor::apps::endpoint e;
  if (!anydoor::apps::parse_endpoint(v, e)) a.fail(opt + " takes HOST:PORT, not '" + std::string(v) + "'");
  return e;
}

double seconds_value(arg_scanner& a) {
  const std::string opt(a.arg());
  const std::string_view v = a.value();
  double d = 0;
  if (!anydoor::apps::parse_seconds(v, d)) a.fail(opt + " takes a positive number of seconds, not '" + std::string(v) + "'");
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  namespace echo = anydoor::apps::echo;
  if (argc < 2) anydoor::apps::usage_error(argv[0], "say server or client", kUsage);
  const std::string_view mode = argv[1];
  if (mode == "--help" || mode == "-h") {
    std::printf("usage: %s\n", kUsage);
    return 0;
  }
  arg_scanner a(argc, argv, 2, kUsage);
  try {
    if (mode == "server") {
      echo::server_options o;
      bool listen = false;
      while (a.next()) {
        const std::string_view opt = a.arg();
        if (opt == "--listen") o.listen = endpoint_value(a), listen = true;
        else if (opt == "--provider") o.provider = provider_value(a);
        else if (opt == "--max-message") o.max_message = a.size_value(1, std::uint64_t{1} << 30);
        else if (opt == "--max-connections") o.max_connections = static_cast<std::uint32_t>(a.size_value(1, 4096));
        else if (opt == "--threads") o.threads = static_cast<std::size_t>(a.size_value(1, 256));
        else if (opt == "--credits") o.credits = static_cast<std::uint16_t>(a.size_value(4, 4096));
        else if (opt == "--srq") o.srq = static_cast<std::uint32_t>(a.size_value(8, 1u << 20));
        else if (opt == "--metrics-listen") o.metrics = endpoint_value(a);
        else a.fail("unknown option " + std::string(opt));
      }
      if (!listen) a.fail("server needs --listen HOST:PORT");
      return echo::run_server(o);
    }
    if (mode == "client") {
      echo::client_options o;
      bool connect = false;
      while (a.next()) {
        const std::string_view opt = a.arg();
        if (opt == "--connect") o.connect = endpoint_value(a), connect = true;
        else if (opt == "--provider") o.provider = provider_value(a);
        else if (opt == "--size") o.size = a.size_value(1, std::uint64_t{1} << 30);
        else if (opt == "--count") o.count = a.size_value(1);
        else if (opt == "--duration") o.duration = seconds_value(a);
        else if (opt == "--in-flight") o.in_flight = static_cast<std::uint32_t>(a.size_value(1, 4096));
        else if (opt == "--connections") o.connections = static_cast<std::uint32_t>(a.size_value(1, 4096));
        else if (opt == "--credits") o.credits = static_cast<std::uint16_t>(a.size_value(4, 4096));
        else if (opt == "--timeout") o.timeout = seconds_value(a);
        else if (opt == "--verify") o.verify = true;
        else if (opt == "--json") o.json = true;
        else if (opt == "--threads") o.threads = static_cast<std::uint32_t>(a.size_value(1, 256));
        else a.fail("unknown option " + std::string(opt));
      }
      if (!connect) a.fail("client needs --connect HOST:PORT");
      if (o.threads > o.connections) a.fail("--threads must not exceed --connections (each thread drives its own)");
      if (o.count != 0 && o.duration != 0) a.fail("give --count or --duration, not both");
      if (o.count == 0 && o.duration == 0) o.count = 10000;
      return echo::run_client(o);
    }
    anydoor::apps::usage_error(argv[0], "unknown mode '" + std::string(mode) + "' (server or client)", kUsage);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "anydoor-echo: %s\n", e.what());
    return 1;
  }
}
