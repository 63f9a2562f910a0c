// The echo server: one rpc::server with one untyped method, serving every
// connection until SIGINT or SIGTERM; then it shuts down gracefully
// (running calls reply, connections close cleanly) and exits 0.
#include "echo.hpp"

#include <anydoor/fabric.hpp>

#include <boost/asio/signal_set.hpp>

#include <algorithm>
#include <csignal>
#include <cstdio>

namespace anydoor::apps::echo {

int run_server(const server_options& o) {
  asio::io_context io;
  fabric_options fo;
  fo.device.provider = o.provider;
  fo.max_connections = o.max_connections;
  fo.connection.max_message = o.max_message;
  // A request above the eager limit is read into runtime memory: room for
  // the largest one (several wait their turn).
  fo.connection.rendezvous_memory = std::max<std::uint64_t>(std::uint64_t{16} << 20, o.max_message);
  fabric fab(io, fo);
  acceptor acc = fab.listen(o.listen.host, o.listen.port);
  endpoint bound = o.listen;
  bound.port = acc.port();

  rpc::server srv;
  srv.add(method.id, [](rpc::server_call& call) -> rpc::status {
    call.reply(call.request());
    return {};
  });
  bool failed = false;
  asio::signal_set signals(io, SIGINT, SIGTERM);
  srv.async_serve(std::move(acc), [&](error_code ec) {
    if (ec && ec != std::errc::operation_canceled) {
      std::fprintf(stderr, "anydoor-echo: the listener failed: %s\n", ec.message().c_str());
      failed = true;
      signals.cancel();
      srv.shutdown(std::chrono::seconds(2));
    }
  });
  signals.async_wait([&](const error_code& ec, int sig) {
    if (ec) return;
    std::fprintf(stderr, "anydoor-echo: %s: closing %llu connection(s)\n", sig == SIGINT ? "SIGINT" : "SIGTERM",
                 static_cast<unsigned long long>(srv.stats().connections));
    srv.shutdown(std::chrono::seconds(2));
  });
  std::printf("anydoor-echo: listening on %s (provider %.*s, max message %llu bytes)\n", bound.str().c_str(),
              static_cast<int>(fab.provider().size()), fab.provider().data(),
              static_cast<unsigned long long>(o.max_message));
  std::fflush(stdout);
  io.run();
  const rpc::server_stats st = srv.stats();
  std::printf("anydoor-echo: served %llu calls on %llu connection(s)\n", static_cast<unsigned long long>(st.calls),
              static_cast<unsigned long long>(st.connections_served));
  return failed ? 1 : 0;
}

}  // namespace anydoor::apps::echo
