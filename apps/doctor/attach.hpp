// anydoor-doctor --attach HOST:PORT: reads a running service's live
// counters (its metrics endpoint, GET /metrics) and prints them as a table,
// again every --interval seconds.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace anydoor::apps::doctor {

struct sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// Parses the Prometheus text format (comments skipped). false with `why`
// on a line that is not a sample.
bool parse_metrics(std::string_view text, std::vector<sample>& out, std::string& why);

// GET /metrics from host:port; false with `why` when unreachable or not 200.
bool fetch_metrics(const std::string& host, std::uint16_t port, std::string& body, std::string& why);

struct attach_options {
  std::string host;
  std::uint16_t port = 0;
  double interval = 1;     // seconds between refreshes
  std::uint64_t count = 0;  // refreshes; 0: until SIGINT/SIGTERM
  std::size_t top = 20;     // connection rows shown
};
// Exit code: 0, or 1 when a scrape fails (the reason on stderr).
int attach(const attach_options& o);

}  // namespace anydoor::apps::doctor
