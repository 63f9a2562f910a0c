// anydoor-rpc-test-server: an RPC server in its own process, for the test
// that kills a server mid-call (kill -9). Listens on ANYDOOR_TEST_HOST
// (default 127.0.0.1), port 0, prints "PORT <n>" on stdout and serves
// test.echo and test.hang (never replies) until killed.
#include "methods.hpp"

#include <boost/asio/awaitable.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <cstdio>
#include <cstdlib>

namespace asio = boost::asio;
namespace ad = anydoor;
namespace rpc = anydoor::rpc;
namespace m = anydoor::test::rpc_methods;

int main() {
  try {
    asio::io_context io;
    ad::fabric_options o;
    const char* p = std::getenv("ANYDOOR_TEST_PROVIDER");
    o.device.provider = p != nullptr && *p != '\0' ? p : "tcp";
    o.max_connections = 4;
    const char* h = std::getenv("ANYDOOR_TEST_HOST");
    ad::fabric fab(io, o);
    rpc::server srv;
    srv.add(m::echo, [](const std::string& s, rpc::server_call&) -> rpc::result<std::string> { return s; });
    srv.add(m::hang, [](const std::uint32_t&, rpc::server_call&) -> asio::awaitable<rpc::result<std::uint32_t>> {
      asio::steady_timer t(co_await asio::this_coro::executor, std::chrono::hours(1));
      co_await t.async_wait(asio::use_awaitable);
      co_return 0u;
    });
    ad::acceptor acc = fab.listen(h != nullptr && *h != '\0' ? h : "127.0.0.1", 0);
    std::printf("PORT %u\n", static_cast<unsigned>(acc.port()));
    std::fflush(stdout);
    srv.async_serve(std::move(acc), asio::detached);
    io.run();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "anydoor-rpc-test-server: %s\n", e.what());
    return 1;
  }
}
