// A channel: calls to "host:port" over a connection it makes on first use
// and makes again after a failure.
//
//   rpc::channel ch(fab, "10.0.0.2:7480");
//   auto v = co_await ch.async_call(get, key, asio::use_awaitable);
//
// The first call dials; calls made while it dials wait (their deadlines
// run). When the dial fails, the waiting calls complete with unavailable
// and, for the backoff (initial_backoff, doubling up to max_backoff, with
// +-20 % jitter), every call fails at once with unavailable; the first call
// after the backoff dials again. When an open connection fails, its pending
// calls complete with unavailable and the next call dials at once (the
// backoff starts over). Calls have rpc::client's signatures and errors.
// The fabric must outlive the channel; a channel belongs to the fabric's
// io_context thread. Destroying it completes pending calls with
// operation_canceled.
#pragma once

#include <anydoor/fabric.hpp>
#include <anydoor/rpc/client.hpp>

#include <boost/asio/async_result.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <system_error>

namespace anydoor::rpc {

struct channel_options {
  client_options client;
  std::chrono::milliseconds initial_backoff{100};  // at least 1 ms
  std::chrono::milliseconds max_backoff{5000};     // at least initial_backoff
};

struct channel_stats {
  std::uint64_t dials = 0;          // connection attempts
  std::uint64_t dial_failures = 0;
  std::uint64_t fast_failures = 0;  // calls failed at once during a backoff
  client_stats client;              // the current connection's client
};

namespace detail {
class channel_state;
client_impl* channel_client(channel_state& ch, std::error_code& why);
asio::io_context::executor_type channel_executor(const channel_state& ch) noexcept;
}  // namespace detail

class channel {
 public:
  // Throws std::system_error (errc::invalid_argument) for bad options.
  channel(fabric& fab, std::string address, channel_options options = {});
  channel(channel&&) noexcept;
  channel& operator=(channel&&) noexcept;
  ~channel();

  template <class Token>
  auto async_call(std::uint64_t method, asio::const_buffer request, Token&& token) {
    return async_call(method, request, call_options{}, std::forward<Token>(token));
  }
  template <class Token>
  auto async_call(std::uint64_t method, asio::const_buffer request, const call_options& o, Token&& token) {
    return asio::async_initiate<Token, void(error_code, reply)>(
        [this](auto handler, std::uint64_t m, asio::const_buffer req, const call_options& opts) {
          std::error_code why;
          detail::client_impl* c = detail::channel_client(state(), why);
          detail::initiate_untyped(c, why, detail::channel_executor(state()), std::move(handler), m, req, opts);
        },
        token, method, request, o);
  }
  template <typed_method M, class Token>
  auto async_call(const M& m, const typename M::request_type& request, Token&& token) {
    return async_call(m, request, call_options{}, std::forward<Token>(token));
  }
  template <typed_method M, class Token>
  auto async_call(const M& m, const typename M::request_type& request, const call_options& o, Token&& token) {
    return asio::async_initiate<Token, void(error_code, typename M::reply_type)>(
        [this](auto handler, const M& method, const typename M::request_type& req, const call_options& opts) {
          std::error_code why;
          detail::client_impl* c = detail::channel_client(state(), why);
          detail::initiate_typed(c, why, detail::channel_executor(state()), std::move(handler), method, req, opts);
        },
        token, m, request, o);
  }

  // A connection is open now.
  bool connected() const noexcept;
  // Why the last dial or connection failed (empty: none did).
  std::error_code last_error() const noexcept;
  const std::string& address() const noexcept;
  channel_stats stats() const noexcept;

 private:
  // Throws std::system_error (errc::not_connected) on a moved-from channel.
  detail::channel_state& state() const;
  std::shared_ptr<detail::channel_state> state_;
};

}  // namespace anydoor::rpc
