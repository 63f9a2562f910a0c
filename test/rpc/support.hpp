// RPC test support: a server fabric serving an rpc::server on an acceptor,
// a client fabric, on one io_context; and a way to wait for callbacks.
#pragma once

#include "../support/runtime.hpp"
#include "methods.hpp"

#include <anydoor/rpc.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <string>

namespace anydoor::test {

namespace rpc = anydoor::rpc;
using asio::awaitable;
using asio::use_awaitable;

struct rpc_env {
  asio::io_context io;
  ad::fabric server_fab;
  ad::fabric client_fab;
  rpc::server srv;
  std::string address;
  ad::error_code serve_ec;
  bool serve_done = false;

  explicit rpc_env(rpc::server_options so = {}, ad::connection_options co = {}, std::uint64_t max_piece_bytes = 0)
      : server_fab(io, with_pieces(test_options(co), max_piece_bytes)),
        client_fab(io, with_pieces(test_options(co), max_piece_bytes)), srv(so) {}
  static ad::fabric_options with_pieces(ad::fabric_options o, std::uint64_t max_piece_bytes) {
    o.max_piece_bytes = max_piece_bytes;
    return o;
  }

  void serve() {
    ad::acceptor acc = server_fab.listen(test_host(), 0);
    address = addr(acc);
    srv.async_serve(std::move(acc), [this](ad::error_code ec) {
      serve_ec = ec;
      serve_done = true;
    });
  }
  awaitable<rpc::client> connect(rpc::client_options o = {}) {
    ad::connection c = co_await client_fab.async_connect(address, use_awaitable);
    co_return rpc::client(std::move(c), o);
  }
};

// Waits (a coroutine) until done() is true, polling every millisecond.
template <class Pred>
awaitable<void> wait_until(Pred done, std::chrono::milliseconds limit = std::chrono::milliseconds(20000)) {
  auto ex = co_await asio::this_coro::executor;
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    REQUIRE(std::chrono::steady_clock::now() < end);
    asio::steady_timer t(ex, std::chrono::milliseconds(1));
    co_await t.async_wait(use_awaitable);
  }
}

inline std::string str(std::span<const std::byte> b) { return {reinterpret_cast<const char*>(b.data()), b.size()}; }

}  // namespace anydoor::test
