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
#include <anydoor/rpc/detail/caller.hpp>

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

class channel : public detail::caller<channel> {
 public:
  // Throws std::system_error (errc::invalid_argument) for bad options.
  channel(fabric& fab, std::string address, channel_options options = {});
  channel(channel&&) noexcept;
  channel& operator=(channel&&) noexcept;
  ~channel();

  // async_call(method, request, [call_options,] token): as rpc::client's.
  using detail::caller<channel>::async_call;

  // A connection is open now.
  bool connected() const noexcept;
  // Why the last dial or connection failed (empty: none did).
  std::error_code last_error() const noexcept;
  const std::string& address() const noexcept;
  channel_stats stats() const noexcept;

 private:
  friend class detail::caller<channel>;
  // Throw std::system_error (errc::not_connected) on a moved-from channel.
  detail::channel_state& state() const;
  detail::client_impl* call_target(std::error_code& why) const { return detail::channel_client(state(), why); }
  asio::io_context::executor_type call_executor() const { return detail::channel_executor(state()); }
  std::shared_ptr<detail::channel_state> state_;
};

}  // namespace anydoor::rpc
