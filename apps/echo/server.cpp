// The echo server: one rpc::server with one untyped method, serving every
// connection until SIGINT or SIGTERM; then it shuts down gracefully
// (running calls reply, connections close cleanly) and exits 0. With
// --threads N (N > 1) it runs N reactors (a reactor_group), one rpc::server
// each, behind one listening socket.
#include "echo.hpp"

#include "common/fd_limit.hpp"
#include "common/on_reactor.hpp"

#include <anydoor/fabric.hpp>
#include <anydoor/metrics.hpp>
#include <anydoor/reactor_group.hpp>

#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>

#include <algorithm>
#include <chrono>
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>
#include <csignal>
#include <cstdio>

namespace anydoor::apps::echo {

namespace {

fabric_options make_fabric_options(const server_options& o) {
  fabric_options fo;
  fo.device.provider = o.provider;
  fo.max_connections = o.max_connections;
  fo.connection.max_message = o.max_message;
  fo.connection.credits = o.credits;
  // Receive buffers for every connection's credits, with room to spare.
  fo.pool_max_bytes =
      std::max<std::size_t>(fo.pool_max_bytes, std::size_t{o.max_connections} * o.credits * 9 * 1024 * 5 / 4);
  // --srq: one shared receive queue per reactor instead (credits are then
  // each connection's window).
  fo.srq_buffers = o.srq;
  fo.pool_max_bytes = std::max<std::size_t>(fo.pool_max_bytes, std::size_t{o.srq} * 9 * 1024 * 5 / 4);
  // A request above the eager limit is read into runtime memory: room for
  // the largest one (several wait their turn).
  fo.connection.rendezvous_memory = std::max<std::uint64_t>(std::uint64_t{16} << 20, o.max_message);
  return fo;
}

// ", shared receive queue of N buffers" for the listening line, or nothing.
std::string srq_note(const server_options& o) {
  if (o.srq == 0) return {};
  std::string s = ", shared receive queue of ";
  s += std::to_string(o.srq);
  s += " buffers";
  return s;
}

void add_echo(rpc::server& srv) {
  srv.add(method.id, [](rpc::server_call& call) -> rpc::status {
    call.reply(call.request());
    return {};
  });
}

// --metrics-listen: the live counters, served from `io`.
std::unique_ptr<metrics_endpoint> open_metrics(const server_options& o, asio::io_context& io,
                                               metrics_endpoint::collector c) {
  if (!o.metrics) return nullptr;
  auto m = std::make_unique<metrics_endpoint>(io, o.metrics->host, o.metrics->port, std::move(c));
  endpoint bound = *o.metrics;
  bound.port = m->port();
  std::printf("anydoor-echo: metrics on %s (GET /metrics)\n", bound.str().c_str());
  return m;
}

}  // namespace

// --threads N: a reactor_group; reactor i serves the connections placed on
// it with its own rpc::server; the test's thread waits for the signal and
// shuts every server down on its own reactor.
int run_group(const server_options& o) {
  // Outlives the group: a metrics collection still on a reactor when the
  // group stops posts its page here.
  asio::io_context main_io;
  reactor_group group({.threads = o.threads, .fabric = make_fabric_options(o)});
  std::vector<acceptor> accs = group.listen(o.listen.host, o.listen.port);
  endpoint bound = o.listen;
  bound.port = accs[0].port();
  const std::size_t n = group.size();
  std::vector<std::unique_ptr<rpc::server>> servers;
  std::atomic<std::size_t> serving{n};
  std::atomic<bool> failed{false};
  asio::signal_set signals(main_io, SIGINT, SIGTERM);
  std::unique_ptr<metrics_endpoint> metrics = open_metrics(o, main_io, collect(group));
  auto shutdown_all = [&] {
    if (metrics) metrics->stop();
    for (std::size_t i = 0; i < n; ++i) {
      asio::post(group.get_executor(i), [srv = servers[i].get()] { srv->shutdown(std::chrono::seconds(2)); });
    }
  };
  for (std::size_t i = 0; i < n; ++i) {
    servers.push_back(std::make_unique<rpc::server>());
    add_echo(*servers.back());
  }
  for (std::size_t i = 0; i < n; ++i) {
    asio::post(group.get_executor(i), [&, i] {
      servers[i]->async_serve(std::move(accs[i]), [&](error_code ec) {
        if (ec && ec != std::errc::operation_canceled) {
          std::fprintf(stderr, "anydoor-echo: the listener failed: %s\n", ec.message().c_str());
          failed = true;
          asio::post(main_io, [&] { signals.cancel(); shutdown_all(); });
        }
        // the last server done: the main thread stops waiting
        if (--serving == 0) {
          asio::post(main_io, [&] {
            signals.cancel();
            if (metrics) metrics->stop();
          });
        }
      });
    });
  }
  signals.async_wait([&](const error_code& ec, int sig) {
    if (ec) return;
    std::uint64_t open = 0;
    for (std::size_t i = 0; i < n; ++i) {
      open += on_reactor_within(group, i, std::chrono::seconds(5),
                                [srv = servers[i].get()] { return srv->stats().connections; })
                  .value_or(0);
    }
    std::fprintf(stderr, "anydoor-echo: %s: closing %llu connection(s) on %zu reactors\n",
                 sig == SIGINT ? "SIGINT" : "SIGTERM", static_cast<unsigned long long>(open), n);
    shutdown_all();
  });
  std::printf("anydoor-echo: listening on %s (provider %.*s, max message %llu bytes%s, %zu reactor threads)\n",
              bound.str().c_str(), static_cast<int>(group.at(0).provider().size()), group.at(0).provider().data(),
              static_cast<unsigned long long>(o.max_message), srq_note(o).c_str(), n);
  std::fflush(stdout);
  main_io.run();  // until the signal's shutdown (or a failure) has ended every server's accepting
  while (serving > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  // The servers' connections drain (running calls reply, then each closes)
  // within the shutdown's grace; only then do the reactors stop.
  const auto drain_until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  for (;;) {
    std::uint64_t open = 0;
    for (std::size_t i = 0; i < n; ++i) {
      // (a reactor that does not answer counts as one still open)
      open += on_reactor_within(group, i, std::chrono::seconds(1),
                                [srv = servers[i].get()] { return srv->stats().connections; })
                  .value_or(1);
    }
    if (open == 0 || std::chrono::steady_clock::now() > drain_until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  group.stop();
  std::uint64_t calls = 0, conns = 0;
  std::string per;
  for (auto& srv : servers) {
    const rpc::server_stats st = srv->stats();
    calls += st.calls;
    conns += st.connections_served;
    per.push_back(' ');  // (not " " + to_string(): GCC 12 at -O3 warns falsely, -Wrestrict)
    per += std::to_string(st.connections_served);
  }
  servers.clear();
  std::printf("anydoor-echo: served %llu calls on %llu connection(s) (per reactor:%s)\n",
              static_cast<unsigned long long>(calls), static_cast<unsigned long long>(conns), per.c_str());
  return failed ? 1 : 0;
}

int run_server(const server_options& o) {
  ensure_fd_limit((std::uint64_t{o.max_connections} + 16) * o.threads + 64, "anydoor-echo");
  if (o.threads > 1) return run_group(o);
  asio::io_context io{1};  // hint 1: one thread runs it (Asio queues what that thread posts without a lock)
  fabric fab(io, make_fabric_options(o));
  acceptor acc = fab.listen(o.listen.host, o.listen.port);
  endpoint bound = o.listen;
  bound.port = acc.port();

  rpc::server srv;
  add_echo(srv);
  bool failed = false;
  asio::signal_set signals(io, SIGINT, SIGTERM);
  std::unique_ptr<metrics_endpoint> metrics = open_metrics(o, io, collect(fab));
  srv.async_serve(std::move(acc), [&](error_code ec) {
    if (ec && ec != std::errc::operation_canceled) {
      std::fprintf(stderr, "anydoor-echo: the listener failed: %s\n", ec.message().c_str());
      failed = true;
      signals.cancel();
      if (metrics) metrics->stop();
      srv.shutdown(std::chrono::seconds(2));
    }
  });
  signals.async_wait([&](const error_code& ec, int sig) {
    if (ec) return;
    std::fprintf(stderr, "anydoor-echo: %s: closing %llu connection(s)\n", sig == SIGINT ? "SIGINT" : "SIGTERM",
                 static_cast<unsigned long long>(srv.stats().connections));
    if (metrics) metrics->stop();
    srv.shutdown(std::chrono::seconds(2));
  });
  std::printf("anydoor-echo: listening on %s (provider %.*s, max message %llu bytes%s)\n", bound.str().c_str(),
              static_cast<int>(fab.provider().size()), fab.provider().data(),
              static_cast<unsigned long long>(o.max_message), srq_note(o).c_str());
  std::fflush(stdout);
  io.run();
  const rpc::server_stats st = srv.stats();
  std::printf("anydoor-echo: served %llu calls on %llu connection(s)\n", static_cast<unsigned long long>(st.calls),
              static_cast<unsigned long long>(st.connections_served));
  return failed ? 1 : 0;
}

}  // namespace anydoor::apps::echo
