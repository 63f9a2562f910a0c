// A client call waiting inside the RPC layer: pooled per client (a free list
// that grows to the high-water mark of calls in flight and is then reused),
// so a call allocates nothing in steady state.
#pragma once

#include <anydoor/connection.hpp>
#include <anydoor/detail/pending_handler.hpp>
#include <anydoor/memory.hpp>
#include <anydoor/rpc/codec.hpp>
#include <anydoor/rpc/status.hpp>

#include <boost/asio/buffer.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/cancellation_type.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string_view>
#include <system_error>
#include <vector>

namespace anydoor::rpc {

namespace asio = boost::asio;

// A reply: the payload in its receive buffer (zero copy). Holds one of the
// connection's receive credits until destroyed, as a message does.
class reply {
 public:
  reply() noexcept = default;
  reply(message m, std::size_t offset, errc status) noexcept
      : msg_(std::move(m)), offset_(offset), status_(status) {}

  const std::byte* data() const noexcept { return msg_.data() + offset_; }
  std::size_t size() const noexcept { return msg_.size() - offset_; }
  bool empty() const noexcept { return size() == 0; }
  std::span<const std::byte> bytes() const noexcept { return {data(), size()}; }
  asio::const_buffer buffer() const noexcept { return {data(), size()}; }
  // The server's status and, when it is not ok, its message.
  errc status() const noexcept { return status_; }
  std::string_view status_message() const noexcept {
    if (status_ == errc::ok) return {};
    return {reinterpret_cast<const char*>(data()), size()};
  }

 private:
  message msg_;
  std::size_t offset_ = 0;
  errc status_ = errc::ok;
};

struct call_options {
  // The call's deadline, from now: negative: the client's default
  // (client_options::timeout); zero: none. Sent to the server with the
  // request, so its handler sees it and is cancelled when it passes.
  std::chrono::microseconds timeout{-1};
  // A region of the caller's memory the handler may read or write by RDMA
  // (server_call::async_bulk_get / async_bulk_put). length 0: none.
  remote_region bulk{};
};

namespace detail {

class client_impl;

inline constexpr std::size_t kFrameBytes = 24;  // the RPC header (runtime/rpc/wire.hpp)

// A place in a deadline_list (runtime/rpc/deadline_list.hpp).
struct deadline_hook {
  using clock = std::chrono::steady_clock;
  deadline_hook* dl_next = nullptr;
  deadline_hook* dl_prev = nullptr;
  clock::time_point due = clock::time_point::max();  // max: never
  bool dl_linked = false;
};

struct call_op : deadline_hook {
  enum class state : std::uint8_t { free, unsent, sent, done };

  call_op* queue_next = nullptr;  // calls waiting for the connection (a channel's)
  client_impl* owner = nullptr;
  std::uint32_t index = 0;
  std::uint32_t generation = 1;
  state st = state::free;
  std::uint8_t sends = 0;  // our sends that still read this op's memory
  // A request's payload sent as its own message may be read (rendezvous)
  // from the caller's memory until that send completes (a split or eager
  // one completes once posted): a call that ends early (deadline, cancel)
  // completes only then.
  bool payload_pending = false;
  bool deferred = false;
  std::error_code deferred_ec;
  std::uint64_t method = 0;
  asio::const_buffer request{};  // the payload: the caller's memory, or `encoded`
  remote_region bulk{};
  void (*finish)(call_op& op, std::error_code ec, reply&& r, bool post) = nullptr;
  ::anydoor::detail::pending_handler handler;
  // The header and, when the call carries one, the packed bulk region after
  // it (one buffer, so it can go in one work request at any eager limit).
  // (room for a region in pieces: remote_region::max_packed_size)
  std::array<std::byte, kFrameBytes + remote_region::max_packed_size> header{};
  std::array<std::byte, kFrameBytes> cancel_frame{};
  asio::cancellation_signal send_cancel;  // withdraws a one-message request still queued
  std::vector<std::byte> encoded;  // a typed request, encoded

  std::uint64_t id() const noexcept { return (std::uint64_t{generation} << 32) | index; }
};

// Non-template entry points (runtime/rpc/client.cpp).
call_op* acquire_call(client_impl& c, std::error_code& ec) noexcept;
void start_call(client_impl& c, call_op* op, const call_options& o) noexcept;
void abandon_call(client_impl& c, call_op* op) noexcept;  // acquired, never started (encoding failed)
void cancel_call(void* op, asio::cancellation_type type);
asio::io_context::executor_type client_executor(const client_impl& c) noexcept;

inline void finish_untyped(call_op& op, std::error_code ec, reply&& r, bool post) {
  op.handler.complete(post, ec, std::move(r));
}

template <class M>
void finish_typed(call_op& op, std::error_code ec, reply&& r, bool post) {
  typename M::reply_type value{};
  if (!ec) {
    try {
      if (!M::reply_codec::decode(r.bytes(), value)) ec = make_error_code(errc::invalid_argument);
    } catch (const std::exception&) {
      ec = make_error_code(errc::invalid_argument);
    }
  }
  r = reply{};  // the receive buffer goes back before the caller runs
  op.handler.complete(post, ec, std::move(value));
}

// Completes a call that could not start, on the handler's executor (the
// client's io_context for a plain callback), never inline.
template <class Handler, class... Args>
void complete_later(Handler handler, const asio::io_context::executor_type& io, std::error_code ec, Args... args) {
  auto ex = asio::get_associated_executor(handler, io);
  asio::post(ex, [h = std::move(handler), ec, t = std::make_tuple(std::move(args)...)]() mutable {
    std::apply([&](auto&&... a) { std::move(h)(boost::system::error_code(ec), std::move(a)...); }, std::move(t));
  });
}

// The initiation shared by client and channel. `impl` null: fail with `why`.
template <class Handler>
void initiate_untyped(client_impl* impl, std::error_code why, const asio::io_context::executor_type& io,
                      Handler handler, std::uint64_t method, asio::const_buffer request, const call_options& o) {
  call_op* op = impl != nullptr ? acquire_call(*impl, why) : nullptr;
  if (op == nullptr) return complete_later(std::move(handler), io, why, reply{});
  op->method = method;
  op->request = request;
  op->finish = &finish_untyped;
  op->handler.template store<reply>(std::move(handler), io, &cancel_call, op);
  start_call(*impl, op, o);
}

template <class M, class Handler>
void initiate_typed(client_impl* impl, std::error_code why, const asio::io_context::executor_type& io,
                    Handler handler, const M& m, const typename M::request_type& request, const call_options& o) {
  using reply_t = typename M::reply_type;
  call_op* op = impl != nullptr ? acquire_call(*impl, why) : nullptr;
  if (op == nullptr) return complete_later(std::move(handler), io, why, reply_t{});
  op->encoded.clear();
  try {
    writer w(op->encoded);
    M::request_codec::encode(request, w);
  } catch (const std::exception&) {
    abandon_call(*impl, op);
    return complete_later(std::move(handler), io, make_error_code(errc::invalid_argument), reply_t{});
  }
  op->method = m.id;
  op->request = asio::buffer(op->encoded);
  op->finish = &finish_typed<M>;
  op->handler.template store<reply_t>(std::move(handler), io, &cancel_call, op);
  start_call(*impl, op, o);
}

}  // namespace detail
}  // namespace anydoor::rpc
