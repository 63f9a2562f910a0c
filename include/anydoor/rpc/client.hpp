// An RPC client over one connection: many calls in flight, replies in any
// order, each handed out zero-copy in its receive buffer.
//
//   rpc::client cli(std::move(conn));
//   auto [ec, r] = co_await cli.async_call(0x1234, asio::buffer(req), asio::as_tuple(asio::use_awaitable));
//   std::int64_t sum = co_await cli.async_call(add, add_req{1, 2}, asio::use_awaitable);   // typed
//   co_await cli.async_call(store, key, {.timeout = 5ms, .bulk = mr.remote()}, asio::use_awaitable);
//
// async_call(method, request, [call_options,] token):
// The request buffer is free once the call completes. An untyped request
// above the eager limit goes split (copied, up to the connection's
// eager_split_limit, when the credits allow) or is read by the server
// straight from the caller's memory (rendezvous, zero copy); if a read one
// ends early (deadline, cancel), it completes when that read is done or the
// connection fails, so a server that has stopped reading delays it. A typed
// request is the call's own copy and ends on time.
//   untyped: method is an id, request a buffer; void(error_code, rpc::reply).
//            The request buffer must stay valid until the call completes.
//   typed:   method is an rpc::method<Request, Reply>; the request is encoded
//            (copied) at the call; void(error_code, Reply).
// A call completes exactly once: ok; the server's status (rpc::errc, with
// reply::status_message() on an untyped call); deadline_exceeded when its
// deadline passes (a late reply is dropped); std::errc::operation_canceled
// when cancelled through its cancellation slot (the server is told, best
// effort; a late reply is dropped); unavailable when the connection fails
// (every pending call, once) or has failed; resource_exhausted for a request
// above the peer's max_message or with client_options::max_calls in flight;
// invalid_argument when the request cannot be encoded or the reply cannot
// be decoded.
// A request or reply up to the connection's eager limit travels as one
// message; a larger one as a header message and the payload as a second
// message (split into eager pieces up to eager_split_limit when the credits
// allow, else rendezvous: the peer reads it straight from the sender's
// memory).
// Like the connection, a client belongs to its fabric's io_context thread;
// calls must be made there, and a reply (like a message) must be destroyed
// there (with use_future, copy what you need on the io thread or use a typed
// call, whose reply is a value). A moved-from client throws
// std::system_error from async_call. Destroying the client aborts its connection and
// completes pending calls with operation_canceled.
#pragma once

#include <anydoor/connection.hpp>
#include <anydoor/rpc/codec.hpp>
#include <anydoor/rpc/detail/call_op.hpp>
#include <anydoor/rpc/detail/caller.hpp>
#include <anydoor/rpc/status.hpp>

#include <boost/asio/async_result.hpp>
#include <boost/asio/buffer.hpp>

#include <chrono>
#include <cstdint>
#include <memory>

namespace anydoor::rpc {

struct client_options {
  // The default deadline of a call (call_options::timeout overrides it);
  // 0: none; at most 1 hour (a longer per-call timeout is cut to 1 hour:
  // the wire carries 32-bit microseconds).
  std::chrono::milliseconds timeout{30000};
  // Calls in flight at once; one more completes with resource_exhausted.
  // 1..2^24.
  std::uint32_t max_calls = 65536;
};

struct client_stats {
  std::uint64_t calls = 0;              // calls started
  std::uint64_t ok = 0;                 // completed with a reply (status ok)
  std::uint64_t failed = 0;             // completed with a server status other than ok
  std::uint64_t deadline_exceeded = 0;  // expired on this side
  std::uint64_t cancelled = 0;          // cancelled by the caller
  std::uint64_t unavailable = 0;        // failed with the connection
  std::uint64_t late_replies = 0;       // replies to calls already completed (dropped)
  std::uint64_t in_flight = 0;          // pending now
  std::uint64_t large_requests = 0;     // requests sent as header + payload messages
};

class client : public detail::caller<client> {
 public:
  client() noexcept;
  // Takes the connection. Throws std::system_error (errc::invalid_argument)
  // for bad options or an empty connection.
  explicit client(anydoor::connection conn, client_options options = {});
  client(client&&) noexcept;
  client& operator=(client&&) noexcept;
  ~client();

  // async_call(method, request, [call_options,] token): see the top of this file.
  using detail::caller<client>::async_call;

  // Still usable: the connection has not failed.
  bool is_open() const noexcept;
  // The connection (for one-sided operations next to the calls); do not
  // receive on it: the client takes every message.
  anydoor::connection& connection();
  client_stats stats() const noexcept;
  // Aborts the connection: pending calls complete with unavailable.
  void abort() noexcept;
  asio::io_context::executor_type get_executor() const;

 private:
  friend class detail::caller<client>;
  detail::client_impl* call_target(std::error_code& why) const noexcept {
    why = make_error_code(errc::unavailable);
    return impl_.get();
  }
  asio::io_context::executor_type call_executor() const;
  std::shared_ptr<detail::client_impl> impl_;
};

}  // namespace anydoor::rpc
