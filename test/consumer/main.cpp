// Uses the runtime through the installed headers and library, as a user
// would: a fabric on the tcp provider, listen + async_accept,
// async_connect, and coroutines that send one message and echo it back.
// Exits non-zero on any error or mismatch.
#include <anydoor/anydoor.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <chrono>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>

namespace ad = anydoor;
namespace asio = boost::asio;
using asio::awaitable;
using asio::use_awaitable;

int main() {
  asio::io_context io;
  const ad::fabric_options options{.device = {.provider = "tcp"}, .connection = {.auth_token = "consumer"}};
  ad::fabric server(io, options);
  ad::fabric client(io, options);
  ad::acceptor acc = server.listen("127.0.0.1", 0);
  const std::string_view text = "hello from the consumer";
  std::string echoed;
  int failures = 0;
  auto on_done = [&](const char* who) {
    return [&failures, who](std::exception_ptr e) {
      if (!e) return;
      ++failures;
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& ex) {
        std::fprintf(stderr, "consumer: %s: %s\n", who, ex.what());
      }
    };
  };
  // The server echoes one message, then waits for the client's close.
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await acc.async_accept(use_awaitable);
    ad::message m = co_await c.async_receive(use_awaitable);
    co_await c.async_send(m.buffer(), use_awaitable);
    auto [ec, rest] = co_await c.async_receive(asio::as_tuple(use_awaitable));
    if (ec != ad::errc::connection_closed) throw std::runtime_error("expected the close, got: " + ec.message());
  }, on_done("server"));
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection c = co_await client.async_connect("127.0.0.1:" + std::to_string(acc.port()), use_awaitable);
    co_await c.async_send(asio::buffer(text.data(), text.size()), use_awaitable);
    ad::message m = co_await c.async_receive(use_awaitable);
    echoed.assign(reinterpret_cast<const char*>(m.data()), m.size());
    co_await c.async_close(use_awaitable);
  }, on_done("client"));
  // run() returns by itself once both sides are done; the limit is a watchdog.
  try {
    io.run_for(std::chrono::seconds(30));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
  const bool timed_out = !io.stopped();
  std::printf("consumer: echoed '%s'\n", echoed.c_str());
  if (timed_out) {
    std::fprintf(stderr, "consumer: timed out\n");
    return 1;
  }
  if (failures != 0) return 1;
  if (echoed != text) {
    std::fprintf(stderr, "consumer: the echo differs from '%.*s'\n", static_cast<int>(text.size()), text.data());
    return 1;
  }
  return 0;
}
