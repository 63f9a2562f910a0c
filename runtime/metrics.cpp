// anydoor/metrics.hpp: snapshots, the Prometheus text, the HTTP endpoint.
#include <anydoor/metrics.hpp>

#include "log.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>

#include <arpa/inet.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <string_view>

namespace anydoor {

namespace {

using tcp = asio::ip::tcp;
constexpr auto tuple = asio::as_tuple(asio::use_awaitable);

// "10.0.0.1" for an IPv4-mapped GID or address, else the IPv6 text; empty
// for none.
std::string address_text(const std::array<std::uint8_t, 16>& a) {
  if (std::all_of(a.begin(), a.end(), [](std::uint8_t b) { return b == 0; })) return {};
  char buf[INET6_ADDRSTRLEN] = {};
  const bool v4 = std::all_of(a.begin(), a.begin() + 10, [](std::uint8_t b) { return b == 0; }) && a[10] == 0xff &&
                  a[11] == 0xff;
  if (v4) {
    inet_ntop(AF_INET, a.data() + 12, buf, sizeof buf);
  } else {
    inet_ntop(AF_INET6, a.data(), buf, sizeof buf);
  }
  return buf;
}

void append_label_value(std::string& out, std::string_view v) {
  for (const char c : v) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
}

struct family {
  const char* name;
  const char* type;  // "counter" or "gauge"
  const char* help;
};

class writer {
 public:
  explicit writer(std::string& out) : out_(out) {}
  void begin(const family& f) {
    out_ += "# HELP ";
    out_ += f.name;
    out_ += ' ';
    out_ += f.help;
    out_ += "\n# TYPE ";
    out_ += f.name;
    out_ += ' ';
    out_ += f.type;
    out_ += '\n';
    name_ = f.name;
  }
  // labels: name, value pairs
  void sample(std::initializer_list<std::pair<std::string_view, std::string_view>> labels, std::uint64_t v) {
    out_ += name_;
    out_ += '{';
    bool first = true;
    for (const auto& [k, val] : labels) {
      if (!first) out_ += ',';
      first = false;
      out_ += k;
      out_ += "=\"";
      append_label_value(out_, val);
      out_ += '"';
    }
    out_ += "} ";
    out_ += std::to_string(v);
    out_ += '\n';
  }

 private:
  std::string& out_;
  const char* name_ = "";
};

}  // namespace

metrics_snapshot snapshot(fabric& f, std::string reactor_label) {
  metrics_snapshot s;
  s.reactor = std::move(reactor_label);
  s.provider = std::string(f.provider());
  s.fabric = f.stats();
  s.device = f.device().counters();
  s.connections = f.connection_reports();
  s.failures = f.failure_counts();
  return s;
}

std::string prometheus_text(const std::vector<metrics_snapshot>& snaps) {
  std::string out;
  writer w(out);
  using getter = std::uint64_t (*)(const metrics_snapshot&);
  struct reactor_family {
    family f;
    getter get;
  };
  static const reactor_family reactor_families[] = {
      {{"anydoor_connections_open", "gauge", "Connections open now."},
       [](const metrics_snapshot& s) { return s.fabric.connections; }},
      {{"anydoor_connections_accepted_total", "counter", "Connections accepted."},
       [](const metrics_snapshot& s) { return s.fabric.accepted; }},
      {{"anydoor_connections_connected_total", "counter", "Connections made (async_connect)."},
       [](const metrics_snapshot& s) { return s.fabric.connected; }},
      {{"anydoor_connections_refused_total", "counter", "Connection attempts refused (handshake failed or fabric full)."},
       [](const metrics_snapshot& s) { return s.fabric.refused; }},
      {{"anydoor_reactor_polls_total", "counter", "Completion queue polls."},
       [](const metrics_snapshot& s) { return s.fabric.reactor.polls; }},
      {{"anydoor_reactor_empty_polls_total", "counter", "Polls that found nothing."},
       [](const metrics_snapshot& s) { return s.fabric.reactor.empty_polls; }},
      {{"anydoor_reactor_completions_total", "counter", "Completions dispatched."},
       [](const metrics_snapshot& s) { return s.fabric.reactor.completions; }},
      {{"anydoor_reactor_wakeups_total", "counter", "Completion channel wakeups."},
       [](const metrics_snapshot& s) { return s.fabric.reactor.wakeups; }},
      {{"anydoor_pool_buffers", "gauge", "Registered pool buffers."},
       [](const metrics_snapshot& s) { return s.fabric.pool.buffers; }},
      {{"anydoor_pool_free_buffers", "gauge", "Pool buffers free now."},
       [](const metrics_snapshot& s) { return s.fabric.pool.free; }},
      {{"anydoor_pool_registered_bytes", "gauge", "Bytes registered by the buffer pool."},
       [](const metrics_snapshot& s) { return s.fabric.pool.bytes; }},
      {{"anydoor_pool_exhausted_total", "counter", "Buffer requests that found the pool at its watermark."},
       [](const metrics_snapshot& s) { return s.fabric.pool.exhausted; }},
      {{"anydoor_srq_posted", "gauge", "Receives in the shared receive queue (0 without one)."},
       [](const metrics_snapshot& s) { return s.fabric.srq_posted; }},
      {{"anydoor_srq_spare", "gauge", "Shared receives no connection has been granted."},
       [](const metrics_snapshot& s) { return s.fabric.srq_spare; }},
      {{"anydoor_rendezvous_kept_bytes", "gauge",
        "Registered memory of released large messages kept for the next ones."},
       [](const metrics_snapshot& s) { return s.fabric.kept_bytes; }},
      {{"anydoor_rendezvous_retired_bytes", "gauge",
        "Registered sources of ended rendezvous sends held for late duplicate READs (late_read_grace)."},
       [](const metrics_snapshot& s) { return s.fabric.retired_bytes; }},
      {{"anydoor_rendezvous_retired_early_total", "counter",
        "Rendezvous sources deregistered before late_read_grace (the 256 or 64 MiB reached)."},
       [](const metrics_snapshot& s) { return s.fabric.retired_early; }},
  };
  for (const reactor_family& rf : reactor_families) {
    w.begin(rf.f);
    for (const auto& s : snaps) w.sample({{"reactor", s.reactor}, {"provider", s.provider}}, rf.get(s));
  }
  // The device's RNR counters, where it reads them.
  using opt_getter = const std::optional<std::uint64_t>& (*)(const metrics_snapshot&);
  struct device_family {
    family f;
    opt_getter get;
  };
  static const device_family device_families[] = {
      {{"anydoor_device_rnr_naks_sent_total", "counter", "RNR NAKs the device sent (port-wide on verbs)."},
       [](const metrics_snapshot& s) -> const std::optional<std::uint64_t>& { return s.device.rnr_naks_sent; }},
      {{"anydoor_device_rnr_naks_received_total", "counter", "RNR NAKs the device received (port-wide on verbs)."},
       [](const metrics_snapshot& s) -> const std::optional<std::uint64_t>& { return s.device.rnr_naks_received; }},
      {{"anydoor_device_rnr_retry_exceeded_total", "counter", "Requests failed after their RNR retries."},
       [](const metrics_snapshot& s) -> const std::optional<std::uint64_t>& { return s.device.rnr_retry_exceeded; }},
      {{"anydoor_device_transport_retries_total", "counter",
        "Requests the device sent again after an ACK timeout (port-wide on verbs)."},
       [](const metrics_snapshot& s) -> const std::optional<std::uint64_t>& { return s.device.transport_retries; }},
      {{"anydoor_device_transport_retry_exceeded_total", "counter", "Requests failed after their transport retries."},
       [](const metrics_snapshot& s) -> const std::optional<std::uint64_t>& {
         return s.device.transport_retry_exceeded;
       }},
  };
  // Port-wide counters (verbs) come once per source: reactors that read
  // the same sysfs directory are not added up twice.
  auto first_of_source = [&](std::size_t i) {
    for (std::size_t j = 0; j < i; ++j) {
      if (!snaps[i].device.source.empty() && snaps[j].device.source == snaps[i].device.source) return false;
    }
    return true;
  };
  for (const device_family& df : device_families) {
    if (std::none_of(snaps.begin(), snaps.end(), [&](const metrics_snapshot& s) { return df.get(s).has_value(); })) {
      continue;
    }
    w.begin(df.f);
    for (std::size_t i = 0; i < snaps.size(); ++i) {
      if (df.get(snaps[i]) && first_of_source(i)) w.sample({{"reactor", snaps[i].reactor}}, *df.get(snaps[i]));
    }
  }
  // Asynchronous events: each reactor's own device object took its own.
  static const device_family event_families[] = {
      {{"anydoor_device_async_events_total", "counter", "Asynchronous events the device reported (verbs)."},
       [](const metrics_snapshot& s) -> const std::optional<std::uint64_t>& { return s.device.async_events; }},
      {{"anydoor_device_async_errors_total", "counter",
        "Asynchronous error events: CQ, QP, SRQ, port and device errors (verbs)."},
       [](const metrics_snapshot& s) -> const std::optional<std::uint64_t>& { return s.device.async_errors; }},
  };
  for (const device_family& df : event_families) {
    if (std::none_of(snaps.begin(), snaps.end(), [&](const metrics_snapshot& s) { return df.get(s).has_value(); })) {
      continue;
    }
    w.begin(df.f);
    for (const auto& s : snaps) {
      if (df.get(s)) w.sample({{"reactor", s.reactor}}, *df.get(s));
    }
  }
  w.begin({"anydoor_connection_failures_total", "counter", "Connections that failed, by error."});
  for (const auto& s : snaps) {
    // (by message: two codes that read the same are one series)
    std::vector<std::pair<std::string, std::uint64_t>> by_text;
    for (const failure_count& f : s.failures) {
      const std::string what = f.error.message();
      auto it = std::find_if(by_text.begin(), by_text.end(), [&](const auto& e) { return e.first == what; });
      if (it == by_text.end()) {
        by_text.emplace_back(what, f.count);
      } else {
        it->second += f.count;
      }
    }
    for (const auto& [what, count] : by_text) w.sample({{"reactor", s.reactor}, {"error", what}}, count);
  }
  using conn_getter = std::uint64_t (*)(const connection_stats&);
  struct conn_family {
    family f;
    conn_getter get;
  };
  static const conn_family conn_families[] = {
      {{"anydoor_connection_messages_sent_total", "counter", "Messages sent."},
       [](const connection_stats& c) { return c.messages_sent; }},
      {{"anydoor_connection_messages_received_total", "counter", "Messages received."},
       [](const connection_stats& c) { return c.messages_received; }},
      {{"anydoor_connection_bytes_sent_total", "counter", "Payload bytes sent."},
       [](const connection_stats& c) { return c.bytes_sent; }},
      {{"anydoor_connection_bytes_received_total", "counter", "Payload bytes received."},
       [](const connection_stats& c) { return c.bytes_received; }},
      {{"anydoor_connection_posts_total", "counter", "Send work requests posted."},
       [](const connection_stats& c) { return c.posts; }},
      {{"anydoor_connection_doorbells_total", "counter", "post_send calls (doorbells)."},
       [](const connection_stats& c) { return c.doorbells; }},
      {{"anydoor_connection_credit_stalls_total", "counter", "Sends that waited for credits."},
       [](const connection_stats& c) { return c.credit_stalls; }},
      {{"anydoor_connection_buffer_stalls_total", "counter", "Sends that waited for a pool buffer."},
       [](const connection_stats& c) { return c.buffer_stalls; }},
      {{"anydoor_connection_rnr_naks_total", "counter", "RNR NAKs on the queue pair (should stay 0)."},
       [](const connection_stats& c) { return c.rnr_naks; }},
      {{"anydoor_connection_stray_completions_total", "counter",
        "Completions naming no work request outstanding, dropped (should stay 0)."},
       [](const connection_stats& c) { return c.stray_completions; }},
      {{"anydoor_connection_puts_total", "counter", "Puts completed."},
       [](const connection_stats& c) { return c.puts; }},
      {{"anydoor_connection_gets_total", "counter", "Gets completed."},
       [](const connection_stats& c) { return c.gets; }},
      {{"anydoor_connection_atomics_total", "counter", "Atomics completed."},
       [](const connection_stats& c) { return c.atomics; }},
      {{"anydoor_connection_heartbeats_total", "counter", "Keepalive heartbeats sent."},
       [](const connection_stats& c) { return c.heartbeats; }},
  };
  // Labels per connection, made once.
  struct conn_labels {
    std::string qp, peer;
    const char* state;
  };
  std::vector<std::vector<conn_labels>> labels(snaps.size());
  for (std::size_t i = 0; i < snaps.size(); ++i) {
    for (const connection_report& c : snaps[i].connections) {
      labels[i].push_back({std::to_string(c.qp_num), address_text(c.path.dgid), c.open ? "open" : "ended"});
    }
  }
  for (const conn_family& cf : conn_families) {
    w.begin(cf.f);
    for (std::size_t i = 0; i < snaps.size(); ++i) {
      for (std::size_t j = 0; j < snaps[i].connections.size(); ++j) {
        const conn_labels& l = labels[i][j];
        w.sample({{"reactor", snaps[i].reactor}, {"qp", l.qp}, {"peer", l.peer}, {"state", l.state}},
                 cf.get(snaps[i].connections[j].stats));
      }
    }
  }
  return out;
}

// ---------------------------------------------------------------- endpoint

namespace {

// One client being served.
struct session {
  session(tcp::socket s, asio::io_context& io)
      : sock(std::move(s)), ready(io, asio::steady_timer::time_point::max()), deadline(io) {}
  tcp::socket sock;
  asio::steady_timer ready;     // cancelled when the collector's text is in
  asio::steady_timer deadline;  // the whole exchange within 5 s
  std::optional<std::string> text;
  void end() noexcept {
    error_code ignored;
    sock.close(ignored);
    ready.cancel();
  }
};

std::string response(std::string_view status, std::string_view body, std::string_view type = "text/plain") {
  std::string r = "HTTP/1.1 ";
  r += status;
  r += "\r\nContent-Type: ";
  r += type;
  r += "\r\nContent-Length: ";
  r += std::to_string(body.size());
  r += "\r\nConnection: close\r\n\r\n";
  r += body;
  return r;
}

}  // namespace

struct metrics_endpoint::state : std::enable_shared_from_this<state> {
  state(asio::io_context& ctx, collector c, std::size_t max) : io(ctx), acc(ctx), collect(std::move(c)), max_clients(max) {}
  asio::io_context& io;
  tcp::acceptor acc;
  collector collect;
  std::size_t max_clients;
  std::vector<std::shared_ptr<session>> open;
  bool stopped = false;
  std::uint64_t scrapes = 0, rejected = 0;

  asio::awaitable<void> accept_loop();
  asio::awaitable<void> serve(std::shared_ptr<session> ss);
};

asio::awaitable<void> metrics_endpoint::state::accept_loop() {
  auto self = shared_from_this();
  while (!stopped) {
    auto [ec, sock] = co_await acc.async_accept(tuple);
    if (stopped) co_return;
    if (ec) {
      if (ec == asio::error::operation_aborted) co_return;
      asio::steady_timer t(io, std::chrono::milliseconds(100));  // out of descriptors, say
      co_await t.async_wait(tuple);
      continue;
    }
    if (open.size() >= max_clients) {
      ++rejected;
      error_code ignored;
      sock.close(ignored);
      continue;
    }
    auto ss = std::make_shared<session>(std::move(sock), io);
    open.push_back(ss);
    asio::co_spawn(io, serve(std::move(ss)), asio::detached);
  }
}

asio::awaitable<void> metrics_endpoint::state::serve(std::shared_ptr<session> ss) {
  auto self = shared_from_this();
  struct forget {
    state& st;
    session* p;
    ~forget() {
      std::erase_if(st.open, [this](const std::shared_ptr<session>& s) { return s.get() == p; });
    }
  } f{*this, ss.get()};
  // A slow or silent client is cut off (the handler holds the session, so
  // it may run after this coroutine has ended).
  ss->deadline.expires_after(std::chrono::seconds(5));
  ss->deadline.async_wait([ss](const error_code& ec) {
    if (!ec) ss->end();
  });
  std::string req;
  auto [ec, n] = co_await asio::async_read_until(ss->sock, asio::dynamic_buffer(req, 8192), "\r\n\r\n", tuple);
  std::string page;
  if (ec) {
    ++rejected;  // too large (not_found at the limit), too slow (closed), or gone
    if (ec == asio::error::not_found && ss->sock.is_open()) page = response("431 Request Header Fields Too Large", "too large\n");
  } else {
    const std::string_view line(req.data(), std::min(req.find("\r\n"), req.size()));
    const auto sp1 = line.find(' ');
    const auto sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
    if (sp2 == std::string_view::npos) {
      ++rejected;
      page = response("400 Bad Request", "bad request\n");
    } else if (line.substr(0, sp1) != "GET") {
      ++rejected;
      page = response("405 Method Not Allowed", "only GET\n");
    } else {
      std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
      target = target.substr(0, target.find('?'));
      if (target != "/metrics") {
        page = response("404 Not Found", "try /metrics\n");
      } else {
        // The collector answers from any thread: the text comes back here.
        // (weak: a collection that outlives the session frees nothing of
        // this io_context on another thread)
        collect([weak = std::weak_ptr<session>(ss), ex = io.get_executor()](std::string text) {
          asio::post(ex, [weak, text = std::move(text)]() mutable {
            if (auto live = weak.lock()) {
              live->text = std::move(text);
              live->ready.cancel();
            }
          });
        });
        if (!ss->text && ss->sock.is_open()) co_await ss->ready.async_wait(tuple);
        if (ss->text && ss->sock.is_open()) {
          ++scrapes;
          page = response("200 OK", *ss->text, "text/plain; version=0.0.4; charset=utf-8");
        } else {
          ++rejected;  // the deadline or stop() came first
        }
      }
    }
  }
  if (!page.empty() && ss->sock.is_open()) {
    co_await asio::async_write(ss->sock, asio::buffer(page), tuple);
    // Our side done; what the client still sends is read and dropped until
    // it closes (or the deadline): closing with unread input would reset
    // the connection and could cut the answer off.
    error_code ignored;
    ss->sock.shutdown(tcp::socket::shutdown_send, ignored);
    std::array<char, 4096> sink;
    for (;;) {
      auto [rec, got] = co_await ss->sock.async_read_some(asio::buffer(sink), tuple);
      if (rec) break;
    }
  }
  ss->deadline.cancel();
  error_code ignored;
  ss->sock.close(ignored);
}

metrics_endpoint::metrics_endpoint(asio::io_context& io, const std::string& host, std::uint16_t port,
                                   collector collect, std::size_t max_clients)
    : state_(std::make_shared<state>(io, std::move(collect), std::max<std::size_t>(max_clients, 1))) {
  error_code ec;
  const auto addr = asio::ip::make_address(host.empty() ? "0.0.0.0" : host, ec);
  if (ec) throw std::system_error(ec, "metrics: bad listen address '" + host + "'");
  const tcp::endpoint ep(addr, port);
  state_->acc.open(ep.protocol());
  state_->acc.set_option(tcp::acceptor::reuse_address(true));
  state_->acc.bind(ep, ec);
  if (ec) throw std::system_error(ec, "metrics: cannot listen on " + host + ":" + std::to_string(port));
  state_->acc.listen();
  asio::co_spawn(io, state_->accept_loop(), asio::detached);
  log().info("metrics: serving GET /metrics on {}:{}", host, this->port());
}

metrics_endpoint::~metrics_endpoint() { stop(); }

std::uint16_t metrics_endpoint::port() const noexcept {
  error_code ec;
  const auto ep = state_->acc.local_endpoint(ec);
  return ec ? 0 : ep.port();
}

void metrics_endpoint::stop() noexcept {
  if (state_->stopped) return;
  state_->stopped = true;
  error_code ignored;
  state_->acc.close(ignored);
  for (const auto& ss : state_->open) ss->end();
}

std::uint64_t metrics_endpoint::scrapes() const noexcept { return state_->scrapes; }
std::uint64_t metrics_endpoint::rejected() const noexcept { return state_->rejected; }

metrics_endpoint::collector collect(fabric& f) {
  // On the fabric's thread: at once when called there, else posted to it.
  return [&f](std::function<void(std::string)> done) {
    asio::dispatch(f.get_executor(), [&f, done = std::move(done)] {
      std::string text;
      try {
        text = prometheus_text({snapshot(f, "0")});
      } catch (const std::exception& e) {
        log().error("metrics: collecting: {}", e.what());
      }
      done(std::move(text));
    });
  };
}

metrics_endpoint::collector collect(reactor_group& g) {
  return [&g](std::function<void(std::string)> done) {
    struct gather {
      std::mutex m;
      std::vector<metrics_snapshot> snaps;
      std::size_t left = 0;
      std::function<void(std::string)> done;
    };
    auto all = std::make_shared<gather>();
    all->snaps.resize(g.size());
    all->left = g.size();
    all->done = std::move(done);
    for (std::size_t i = 0; i < g.size(); ++i) {
      asio::post(g.get_executor(i), [&g, all, i] {
        // (nothing may escape onto a reactor thread: a failed snapshot
        // leaves that reactor's part empty)
        std::optional<metrics_snapshot> s;
        try {
          s = snapshot(g.at(i), std::to_string(i));
        } catch (const std::exception& e) {
          log().error("metrics: reactor {}: {}", i, e.what());
        }
        std::unique_lock lk(all->m);
        if (s) all->snaps[i] = std::move(*s);
        if (--all->left != 0) return;
        std::vector<metrics_snapshot> snaps = std::move(all->snaps);
        lk.unlock();
        std::string text;
        try {
          text = prometheus_text(snaps);
        } catch (const std::exception& e) {
          log().error("metrics: rendering: {}", e.what());
        }
        all->done(std::move(text));
      });
    }
  };
}

}  // namespace anydoor
