// An RPC server: handlers by method, serving an acceptor (every connection
// it accepts) or one connection.
//
//   rpc::server srv({.max_concurrent_calls = 64});
//   srv.add(echo, [](const std::string& req, rpc::server_call&) -> rpc::result<std::string> { return req; });
//   srv.add(slow, [](const job& j, rpc::server_call& call) -> asio::awaitable<rpc::result<done>> {
//     co_await call.async_bulk_get(buf, asio::use_awaitable);   // the caller's memory, by RDMA
//     co_return done{...};
//   });
//   srv.add(0x1234, [](rpc::server_call& call) -> rpc::status {  // untyped: bytes in, bytes out
//     call.reply(call.request());
//     return {};
//   });
//   srv.async_serve(fab.listen("0.0.0.0", 7480), asio::detached);
//
// Handlers: a callable taking (server_call&) (untyped) or (const Request&,
// server_call&) (typed), returning the outcome directly (it runs inline, on
// the io thread: keep it short), as asio::awaitable (a coroutine, spawned
// on the connection's executor; it may co_await anything; one that returns
// without suspending replies within the same turn, as a direct one does,
// at about the same cost per call), or, untyped, as rpc::outcome (the
// status now, or a coroutine only when it must wait). Untyped handlers
// return rpc::status and set the reply payload with server_call::reply*;
// typed ones return rpc::result<Reply> (a reply or a status).
//
// Each call: the request is a zero-copy view into its receive buffer, valid
// until the handler ends; the deadline the client sent is deadline(); when
// it passes, when the client cancels, or when the connection ends, the
// handler's cancellation slot is emitted (terminal: whatever it awaits with
// use_awaitable throws operation_aborted) and cancelled() turns true. The
// reply then carries deadline_exceeded or cancelled, whatever the handler
// returned. A handler that throws yields internal with the exception's
// what(); an unknown method yields unimplemented; a request the server can
// frame but not accept (bad flags, a broken bulk region, a payload the codec
// refuses) yields invalid_argument and the connection keeps serving; one it
// cannot frame (too short, another version or kind) ends that connection
// only (errc::protocol_error).
//
// Backpressure: at most max_concurrent_calls handlers run (or replies are
// being sent, or a coroutine handler's spawn is completing: one more turn)
// per connection; beyond that the server takes no more messages
// from the connection, so its receive credits run out and the client's
// sends wait. Requests are never failed for it.
//
// A server and the connections it serves belong to one io_context thread;
// add() handlers before serving. Destroying the server stops it (stop()).
#pragma once

#include <anydoor/connection.hpp>
#include <anydoor/detail/pending_handler.hpp>
#include <anydoor/fabric.hpp>
#include <anydoor/memory.hpp>
#include <anydoor/rpc/codec.hpp>
#include <anydoor/rpc/detail/call_op.hpp>
#include <anydoor/rpc/status.hpp>

#include <boost/asio/async_result.hpp>
#include <boost/asio/awaitable.hpp>

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace anydoor::rpc {

namespace detail {
class session;
struct call_slot;
struct server_state;
}  // namespace detail

// A typed handler's outcome: the reply, or a status that is not ok.
template <class T>
class result {
 public:
  result(T value) : value_(std::move(value)) {}  // NOLINT
  result(status s) : status_(std::move(s)) {     // NOLINT
    if (status_.is_ok()) status_ = status(errc::internal, "the handler returned an ok status without a reply");
  }
  result(errc code, std::string message = {}) : result(status(code, std::move(message))) {}  // NOLINT

  bool is_ok() const noexcept { return value_.has_value(); }
  T& value() & { return *value_; }
  const status& error() const& noexcept { return status_; }
  status&& error() && noexcept { return std::move(status_); }

 private:
  std::optional<T> value_;
  status status_;
};

// One call as its handler sees it.
class server_call {
 public:
  server_call(const server_call&) = delete;
  server_call& operator=(const server_call&) = delete;

  std::span<const std::byte> request() const noexcept { return request_; }
  std::uint64_t method() const noexcept { return method_; }
  std::uint64_t call_id() const noexcept { return call_id_; }
  // When the client gives up (time_point::max(): never).
  std::chrono::steady_clock::time_point deadline() const noexcept { return deadline_; }
  // The client cancelled, the deadline passed or the connection ended.
  bool cancelled() const noexcept { return cancelled_; }
  // The caller's memory the request carries (length 0: none).
  const remote_region& bulk() const noexcept { return bulk_; }

  // The reply payload (untyped handlers): copied now, or written in place.
  void reply(std::span<const std::byte> payload) {
    reply_.assign(payload.begin(), payload.end());
  }
  void reply(std::string_view payload) {
    reply(std::span<const std::byte>(reinterpret_cast<const std::byte*>(payload.data()), payload.size()));
  }
  std::span<std::byte> reply_buffer(std::size_t n) {
    reply_.resize(n);
    return reply_;
  }
  writer reply_writer() noexcept { return writer(reply_); }

  anydoor::connection& connection() noexcept { return *conn_; }
  asio::io_context::executor_type get_executor() const { return conn_->get_executor(); }

  // Reads bulk() [offset, offset + dst.size()) into dst / writes src there,
  // by RDMA straight between the two memories. void(error_code, std::size_t).
  // Errors: errc::invalid_argument (the request carries no bulk region),
  // errc::out_of_range (outside it), and those of connection::async_get/put.
  template <class Token>
  auto async_bulk_get(local_range dst, Token&& token) {
    return async_bulk_get(dst, 0, std::forward<Token>(token));
  }
  template <class Token>
  auto async_bulk_get(local_range dst, std::uint64_t offset, Token&& token) {
    return bulk_op(dst, offset, false, std::forward<Token>(token));
  }
  template <class Token>
  auto async_bulk_put(local_range src, Token&& token) {
    return async_bulk_put(src, 0, std::forward<Token>(token));
  }
  template <class Token>
  auto async_bulk_put(local_range src, std::uint64_t offset, Token&& token) {
    return bulk_op(src, offset, true, std::forward<Token>(token));
  }

 protected:
  server_call() = default;
  ~server_call() = default;

 private:
  friend class detail::session;
  friend struct detail::call_slot;

  template <class Token>
  auto bulk_op(local_range local, std::uint64_t offset, bool put, Token&& token) {
    return asio::async_initiate<Token, void(error_code, std::size_t)>(
        [this](auto handler, local_range l, std::uint64_t off, bool is_put) {
          std::error_code ec;
          if (bulk_.length == 0) {
            ec = make_error_code(anydoor::errc::invalid_argument);
          } else if (off > bulk_.length || l.size() > bulk_.length - off) {
            ec = make_error_code(anydoor::errc::out_of_range);
          }
          if (ec) return detail::complete_later(std::move(handler), conn_->get_executor(), ec, std::size_t{0});
          const remote_region r = bulk_.at(off, l.size());  // keeps its pieces, if any
          if (is_put) {
            conn_->async_put(l, r, std::move(handler));
          } else {
            conn_->async_get(l, r, std::move(handler));
          }
        },
        token, local, offset, put);
  }

  std::span<const std::byte> request_;
  std::uint64_t method_ = 0;
  std::uint64_t call_id_ = 0;
  std::chrono::steady_clock::time_point deadline_ = std::chrono::steady_clock::time_point::max();
  bool cancelled_ = false;
  remote_region bulk_{};
  std::vector<std::byte> reply_;
  anydoor::connection* conn_ = nullptr;
};

struct server_options {
  // Handlers running (or replies being sent) at once per connection;
  // beyond it the server stops taking requests. 1..65536. A running call
  // holds one of the connection's receive buffers (its request, zero copy),
  // so the credits (64 by default) bound it too. A server at the limit reads
  // nothing from that connection, cancels included: a client's cancel
  // reaches a handler only once a call ends (handlers with a deadline end
  // by themselves).
  std::uint32_t max_concurrent_calls = 32;
  // A call slot keeps a reply buffer up to this size for the next call.
  std::size_t retained_reply_bytes = std::size_t{64} << 10;
};

struct server_stats {
  std::uint64_t connections = 0;         // served now
  std::uint64_t connections_served = 0;  // in all
  std::uint64_t calls = 0;               // requests taken
  std::uint64_t ok = 0;                  // replies with status ok
  std::uint64_t errors = 0;              // replies with another status
  std::uint64_t unimplemented = 0;
  std::uint64_t malformed = 0;           // requests answered with invalid_argument by the framing
  std::uint64_t exceptions = 0;          // handlers that threw
  std::uint64_t cancelled = 0;           // calls the client cancelled
  std::uint64_t deadline_exceeded = 0;   // calls whose deadline passed while they ran
  std::uint64_t throttled = 0;           // times a connection reached max_concurrent_calls
  std::uint64_t protocol_errors = 0;     // connections ended for frames that could not be framed
};

// What an untyped handler that answers at once when it can, and waits only
// when it must, returns: the status now, or a coroutine that ends with it
// (spawned then, as an awaitable handler is; the reply may be set before
// and inside it). A handler that mostly has nothing to wait for saves the
// coroutine on those calls. The coroutine outlives the handler's own
// frame: give it its arguments by value, never references to the
// handler's locals.
using outcome = std::variant<status, asio::awaitable<status>>;

namespace detail {

using sync_fn = std::function<status(server_call&)>;
using coro_fn = std::function<asio::awaitable<status>(server_call&)>;
using maybe_fn = std::function<outcome(server_call&)>;

template <class M>
bool decode_request(const server_call& call, typename M::request_type& out) {
  try {
    return M::request_codec::decode(call.request(), out);
  } catch (const std::exception&) {
    return false;
  }
}
template <class M>
status finish_typed_reply(server_call& call, result<typename M::reply_type>& r) {
  if (!r.is_ok()) return std::move(r).error();
  writer w = call.reply_writer();
  M::reply_codec::encode(r.value(), w);  // a throw becomes internal
  return {};
}
inline status malformed_request() { return {errc::invalid_argument, "the request could not be decoded"}; }

void serve_connection(const std::shared_ptr<server_state>& st, connection c,
                      ::anydoor::detail::pending_handler* done);
void serve_acceptor(const std::shared_ptr<server_state>& st, acceptor a, ::anydoor::detail::pending_handler* done);

}  // namespace detail

class server {
 public:
  explicit server(server_options options = {});
  ~server();
  server(const server&) = delete;
  server& operator=(const server&) = delete;

  // Untyped: handler(server_call&) -> status, asio::awaitable<status> or
  // rpc::outcome. Throws std::system_error (rpc::errc::already_exists) when
  // the id is taken.
  template <class Handler>
  void add(std::uint64_t method, Handler&& h) {
    using H = std::decay_t<Handler>;
    if constexpr (requires(H& fn, server_call& c) {
                    { fn(c) } -> std::same_as<outcome>;
                  }) {
      add_entry(method, {}, {}, {}, detail::maybe_fn(std::forward<Handler>(h)));
    } else if constexpr (std::is_invocable_r_v<asio::awaitable<status>, H&, server_call&>) {
      add_entry(method, {}, {}, detail::coro_fn(std::forward<Handler>(h)));
    } else {
      static_assert(std::is_invocable_r_v<status, H&, server_call&>,
                    "an untyped handler takes (rpc::server_call&) and returns rpc::status, "
                    "asio::awaitable<rpc::status> or rpc::outcome");
      add_entry(method, {}, detail::sync_fn(std::forward<Handler>(h)), {});
    }
  }

  // Typed: handler(const Request&, server_call&) -> result<Reply> or
  // asio::awaitable<result<Reply>>. Throws std::system_error
  // (rpc::errc::already_exists) when the method's id is taken, naming both
  // methods when their names differ (a hash collision).
  template <typed_method M, class Handler>
  void add(const M& m, Handler&& h) {
    using req_t = typename M::request_type;
    using rep_t = typename M::reply_type;
    using H = std::decay_t<Handler>;
    if constexpr (std::is_invocable_r_v<asio::awaitable<result<rep_t>>, H&, const req_t&, server_call&>) {
      add_entry(m.id, m.name, {},
                detail::coro_fn([fn = H(std::forward<Handler>(h))](server_call& call) mutable -> asio::awaitable<status> {
                  req_t req{};
                  if (!detail::decode_request<M>(call, req)) co_return detail::malformed_request();
                  result<rep_t> r = co_await fn(req, call);
                  co_return detail::finish_typed_reply<M>(call, r);
                }));
    } else {
      static_assert(std::is_invocable_r_v<result<rep_t>, H&, const req_t&, server_call&>,
                    "a typed handler takes (const Request&, rpc::server_call&) and returns rpc::result<Reply> or "
                    "asio::awaitable<rpc::result<Reply>>");
      add_entry(m.id, m.name,
                detail::sync_fn([fn = H(std::forward<Handler>(h))](server_call& call) mutable -> status {
                  req_t req{};
                  if (!detail::decode_request<M>(call, req)) return detail::malformed_request();
                  result<rep_t> r = fn(req, call);
                  return detail::finish_typed_reply<M>(call, r);
                }),
                {});
    }
  }

  // Serves one connection until it ends. void(error_code): the reason
  // (errc::connection_closed when the client closed, a completion status
  // when it died, errc::protocol_error for frames it could not take,
  // operation_canceled after stop()).
  template <class Token>
  auto async_serve(connection c, Token&& token) {
    return asio::async_initiate<Token, void(error_code)>(
        [this](auto handler, connection conn) {
          auto ex = conn.get_executor();
          auto* done = new ::anydoor::detail::pending_handler;  // setup path: once per connection
          done->template store<>(std::move(handler), ex, nullptr, nullptr);
          detail::serve_connection(state_, std::move(conn), done);
        },
        token, std::move(c));
  }
  // Serves every connection the acceptor accepts, until it is closed (by
  // stop()). void(error_code): operation_canceled after stop(), or the
  // listener's failure.
  template <class Token>
  auto async_serve(acceptor a, Token&& token) {
    return asio::async_initiate<Token, void(error_code)>(
        [this](auto handler, acceptor acc) {
          auto ex = acc.get_executor();
          auto* done = new ::anydoor::detail::pending_handler;
          done->template store<>(std::move(handler), ex, nullptr, nullptr);
          detail::serve_acceptor(state_, std::move(acc), done);
        },
        token, std::move(a));
  }

  // Closes the acceptors it serves and aborts its connections (running
  // handlers are cancelled; their replies are dropped).
  void stop() noexcept;
  // Graceful stop: closes the acceptors, takes no more requests, lets the
  // running calls finish and send their replies, then closes each
  // connection cleanly (async_close: the client's later calls fail with
  // unavailable); async_serve then completes without an error. A connection
  // still busy after `grace` is aborted (as stop() does). On the io thread.
  void shutdown(std::chrono::milliseconds grace = std::chrono::seconds(5)) noexcept;
  server_stats stats() const noexcept;
  const server_options& options() const noexcept;

 private:
  void add_entry(std::uint64_t id, std::string_view name, detail::sync_fn s, detail::coro_fn c,
                 detail::maybe_fn m = {});
  std::shared_ptr<detail::server_state> state_;
};

}  // namespace anydoor::rpc
