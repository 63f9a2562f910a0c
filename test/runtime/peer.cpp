// anydoor-test-peer HOST:PORT [flood]: a runtime client in its own process,
// for tests that need a peer to die or freeze for real (kill -9, SIGSTOP).
// It connects (provider from ANYDOOR_TEST_PROVIDER, default tcp), sends
// "ready", then receives until the connection ends. With "flood" it grants
// the server 4 credits and takes none of its messages, and sends 200
// messages of 100 bytes after "ready" without waiting for them (those past
// its credits wait for the server's application to take some) until one
// fails (the connection ended). Exit status 0 when the connection ended, 1
// on error.
#include <anydoor/anydoor.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace asio = boost::asio;
namespace ad = anydoor;

int main(int argc, char** argv) {
  const bool flood = argc == 3 && std::string(argv[2]) == "flood";
  if (argc != 2 && !flood) {
    std::fprintf(stderr, "usage: anydoor-test-peer HOST:PORT [flood]\n");
    return 2;
  }
  try {
    asio::io_context io;
    ad::fabric_options o;
    const char* p = std::getenv("ANYDOOR_TEST_PROVIDER");
    o.device.provider = p != nullptr && *p != '\0' ? p : "tcp";
    o.max_connections = 2;
    if (flood) o.connection.credits = 4;
    ad::fabric fab(io, o);
    int status = 1;
    asio::co_spawn(io, [&]() -> asio::awaitable<void> {
      ad::connection c = co_await fab.async_connect(argv[1], asio::use_awaitable);
      co_await c.async_send(asio::buffer("ready", 5), asio::use_awaitable);
      if (flood) {
        static const std::string payload(100, 'f');
        asio::steady_timer ended(io, asio::steady_timer::time_point::max());
        for (int i = 0; i < 200; ++i) {
          c.async_send(asio::buffer(payload), [&ended](ad::error_code ec, std::size_t) {
            if (ec) ended.cancel();
          });
        }
        co_await ended.async_wait(asio::as_tuple(asio::use_awaitable));
        status = 0;
        co_return;
      }
      for (;;) {
        auto [ec, m] = co_await c.async_receive(asio::as_tuple(asio::use_awaitable));
        if (ec) break;
      }
      status = 0;
    }, [](std::exception_ptr e) {
      if (!e) return;
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& ex) {
        std::fprintf(stderr, "anydoor-test-peer: %s\n", ex.what());
      }
    });
    io.run();
    return status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "anydoor-test-peer: %s\n", e.what());
    return 1;
  }
}
