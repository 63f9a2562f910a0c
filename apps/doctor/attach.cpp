#include "attach.hpp"

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <signal.h>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <map>
#include <string>
#include <string_view>
#include <thread>

namespace anydoor::apps::doctor {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

static std::string printable(std::string_view s) {
  // (what a hostile endpoint sends reaches a terminal: no control bytes)
  std::string out;
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    out += u < 0x20 || u == 0x7f ? '?' : c;
  }
  return out;
}

bool parse_metrics(std::string_view text, std::vector<sample>& out, std::string& why) {
  std::size_t line_no = 0;
  while (!text.empty()) {
    const auto nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    ++line_no;
    if (line.empty() || line.front() == '#') continue;
    sample s;
    std::size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    s.name = std::string(line.substr(0, i));
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        const auto eq = line.find('=', i);
        if (eq == std::string_view::npos || eq + 1 >= line.size() || line[eq + 1] != '"') {
          why = "line " + std::to_string(line_no) + ": a label without =\"value\"";
          return false;
        }
        std::string key(line.substr(i, eq - i)), value;
        std::size_t j = eq + 2;
        for (; j < line.size() && line[j] != '"'; ++j) {
          if (line[j] == '\\' && j + 1 < line.size()) {
            ++j;
            value += line[j] == 'n' ? '\n' : line[j];
          } else {
            value += line[j];
          }
        }
        if (j >= line.size()) {
          why = "line " + std::to_string(line_no) + ": an unterminated label value";
          return false;
        }
        s.labels[key] = value;
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
      if (i >= line.size()) {
        why = "line " + std::to_string(line_no) + ": labels without '}'";
        return false;
      }
      ++i;
    }
    while (i < line.size() && line[i] == ' ') ++i;
    const std::string value(line.substr(i));
    char* end = nullptr;
    s.value = std::strtod(value.c_str(), &end);
    if (s.name.empty() || value.empty() || end == value.c_str()) {
      why = "line " + std::to_string(line_no) + ": not a sample";
      return false;
    }
    out.push_back(std::move(s));
  }
  return true;
}

bool fetch_metrics(const std::string& host, std::uint16_t port, std::string& body, std::string& why) {
  // All of it within 10 s, and at most 8 MiB: the endpoint may be anything.
  constexpr std::size_t kMaxPage = std::size_t{8} << 20;
  asio::io_context io{1};  // hint 1: one thread runs it (Asio queues what that thread posts without a lock)
  tcp::resolver resolver(io);
  tcp::socket sock(io);
  std::string resp;
  const std::string req = "GET /metrics HTTP/1.1\r\nHost: " + host + "\r\nConnection: close\r\n\r\n";
  bool done = false;
  boost::system::error_code failed;
  resolver.async_resolve(host, std::to_string(port), [&](const boost::system::error_code& rec, tcp::resolver::results_type eps) {
    if (rec) {
      failed = rec;
      return;
    }
    asio::async_connect(sock, eps, [&](const boost::system::error_code& cec, const tcp::endpoint&) {
      if (cec) {
        failed = cec;
        return;
      }
      asio::async_write(sock, asio::buffer(req), [&](const boost::system::error_code& wec, std::size_t) {
        if (wec) {
          failed = wec;
          return;
        }
        asio::async_read(sock, asio::dynamic_buffer(resp, kMaxPage), [&](const boost::system::error_code& rdec, std::size_t) {
          if (rdec && rdec != asio::error::eof) failed = rdec;
          done = true;
        });
      });
    });
  });
  io.run_for(std::chrono::seconds(10));
  if (failed) {
    why = failed == asio::error::not_found ? "the page is larger than 8 MiB" : failed.message();
    return false;
  }
  if (!done) {
    why = "no complete answer within 10 s";
    return false;
  }
  const auto head_end = resp.find("\r\n\r\n");
  if (head_end == std::string::npos) {
    why = "not an HTTP answer";
    return false;
  }
  const std::string status = resp.substr(0, std::min(resp.find("\r\n"), std::size_t{200}));
  if (status.rfind("HTTP/1.", 0) != 0 || status.find(" 200 ") == std::string::npos) {
    why = "the endpoint answered '" + printable(status) + "'";
    return false;
  }
  body = resp.substr(head_end + 4);
  return true;
}

namespace {

volatile std::sig_atomic_t g_stop = 0;
extern "C" void on_signal(int) { g_stop = 1; }

double value_of(const std::vector<sample>& all, const std::string& name, const std::string& reactor) {
  double v = 0;
  for (const auto& s : all) {
    if (s.name != name) continue;
    auto it = s.labels.find("reactor");
    if (it != s.labels.end() && it->second == reactor) v += s.value;
  }
  return v;
}

void print_table(const std::vector<sample>& all, std::size_t top) {
  std::map<std::string, std::string> reactors;  // reactor -> provider
  for (const auto& s : all) {
    if (s.name != "anydoor_connections_open") continue;
    const auto r = s.labels.find("reactor");
    const auto p = s.labels.find("provider");
    if (r != s.labels.end()) reactors[r->second] = p != s.labels.end() ? p->second : "";
  }
  std::printf("%-8s %-8s %6s %9s %10s %8s %13s %9s\n", "reactor", "provider", "open", "accepted", "connected",
              "refused", "completions", "failures");
  for (const auto& [r, prov] : reactors) {
    std::printf("%-8s %-8s %6.0f %9.0f %10.0f %8.0f %13.0f %9.0f\n", printable(r).c_str(), printable(prov).c_str(),
                value_of(all, "anydoor_connections_open", r), value_of(all, "anydoor_connections_accepted_total", r),
                value_of(all, "anydoor_connections_connected_total", r),
                value_of(all, "anydoor_connections_refused_total", r),
                value_of(all, "anydoor_reactor_completions_total", r),
                value_of(all, "anydoor_connection_failures_total", r));
  }
  // Connections, keyed by reactor and queue pair.
  struct row {
    std::string reactor, qp, peer, state;
    double in = 0, out = 0, bytes_in = 0, bytes_out = 0, stalls = 0, rnr = 0;
  };
  std::map<std::pair<std::string, std::string>, row> rows;
  for (const auto& s : all) {
    if (s.name.rfind("anydoor_connection_", 0) != 0 || s.name == "anydoor_connection_failures_total") continue;
    auto get = [&](const char* k) {
      auto it = s.labels.find(k);
      return it == s.labels.end() ? std::string() : it->second;
    };
    row& r = rows[{get("reactor"), get("qp")}];
    r.reactor = get("reactor");
    r.qp = get("qp");
    r.peer = get("peer");
    r.state = get("state");
    if (s.name == "anydoor_connection_messages_received_total") r.in = s.value;
    if (s.name == "anydoor_connection_messages_sent_total") r.out = s.value;
    if (s.name == "anydoor_connection_bytes_received_total") r.bytes_in = s.value;
    if (s.name == "anydoor_connection_bytes_sent_total") r.bytes_out = s.value;
    if (s.name == "anydoor_connection_credit_stalls_total") r.stalls = s.value;
    if (s.name == "anydoor_connection_rnr_naks_total") r.rnr = s.value;
  }
  std::vector<row> list;
  for (auto& [k, r] : rows) list.push_back(r);
  std::sort(list.begin(), list.end(), [](const row& a, const row& b) { return a.in + a.out > b.in + b.out; });
  std::printf("connections: %zu (the %zu busiest)\n", list.size(), std::min(list.size(), top));
  if (!list.empty()) {
    std::printf("%-8s %-8s %-16s %-6s %10s %10s %12s %12s %8s %5s\n", "reactor", "qp", "peer", "state", "msgs_in",
                "msgs_out", "bytes_in", "bytes_out", "stalls", "rnr");
  }
  for (std::size_t i = 0; i < list.size() && i < top; ++i) {
    const row& r = list[i];
    std::printf("%-8s %-8s %-16s %-6s %10.0f %10.0f %12.0f %12.0f %8.0f %5.0f\n", printable(r.reactor).c_str(),
                printable(r.qp).c_str(), printable(r.peer).c_str(), printable(r.state).c_str(), r.in, r.out, r.bytes_in,
                r.bytes_out, r.stalls, r.rnr);
  }
  // The device's own counters, where it keeps them (anydoor_device_*:
  // RNR, transport retries, asynchronous events), one line per reactor.
  std::map<std::string, std::string> devices;
  for (const auto& s : all) {
    constexpr std::string_view prefix = "anydoor_device_";
    if (s.name.rfind(prefix, 0) != 0) continue;
    std::string what = s.name.substr(prefix.size());
    if (what.ends_with("_total")) what.resize(what.size() - 6);
    const auto r = s.labels.find("reactor");
    char value[32];
    std::snprintf(value, sizeof value, "%.0f", s.value);
    devices[r != s.labels.end() ? r->second : "?"] += " " + printable(what) + " " + value;
  }
  for (const auto& [r, line] : devices) std::printf("device (reactor %s):%s\n", printable(r).c_str(), line.c_str());
  bool header = false;
  for (const auto& s : all) {
    if (s.name != "anydoor_connection_failures_total") continue;
    if (!header) std::printf("failures:\n");
    header = true;
    const auto r = s.labels.find("reactor");
    const auto e = s.labels.find("error");
    std::printf("  reactor %s: %s: %.0f\n", r != s.labels.end() ? printable(r->second).c_str() : "?",
                e != s.labels.end() ? printable(e->second).c_str() : "?", s.value);
  }
}

}  // namespace

int attach(const attach_options& o) {
  struct sigaction sa {};
  sa.sa_handler = on_signal;  // (no SA_RESTART: a signal ends the wait at once)
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  for (std::uint64_t n = 1; o.count == 0 || n <= o.count; ++n) {
    std::string body, why;
    std::vector<sample> all;
    if (!fetch_metrics(o.host, o.port, body, why) || !parse_metrics(body, all, why)) {
      std::fprintf(stderr, "anydoor-doctor: --attach %s:%u: %s\n", o.host.c_str(), o.port, why.c_str());
      return 1;
    }
    const std::time_t now = std::time(nullptr);
    char when[32];
    std::strftime(when, sizeof when, "%H:%M:%S", std::localtime(&now));
    std::printf("anydoor-doctor --attach %s:%u at %s (scrape %llu, %zu samples)\n", o.host.c_str(), o.port, when,
                static_cast<unsigned long long>(n), all.size());
    print_table(all, o.top);
    std::fflush(stdout);
    if (o.count != 0 && n == o.count) break;
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(o.interval);
    while (!g_stop && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (g_stop) break;
    std::printf("\n");
  }
  return 0;
}

}  // namespace anydoor::apps::doctor
