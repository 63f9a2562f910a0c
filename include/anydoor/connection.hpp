// A connection: one reliable-connected queue pair carrying messages (not a
// byte stream) between two anydoor endpoints.
//
//   co_await conn.async_send(asio::buffer(data), asio::use_awaitable);
//   anydoor::message m = co_await conn.async_receive(asio::use_awaitable);
//   std::size_t n = co_await conn.async_receive(asio::buffer(dst), asio::use_awaitable);
//
// Every operation takes any Asio completion token; signatures carry
// anydoor::error_code (boost::system::error_code, Asio's error type) first:
// it holds anydoor's std::error_code categories unchanged and compares equal
// to anydoor::errc and transport::wc_status values, and use_awaitable and
// use_future throw boost::system::system_error from it. Operations of one connection run on its fabric's
// io_context thread. In a coroutine, co_await op(asio::deferred) behaves as
// use_awaitable does at less cost (no coroutine frame to start each
// operation); it starts when awaited, so the connection, and what its
// arguments point to (buffers, the ranges of a span), must last until then.
//
// Sending: a message up to the eager limit is copied (inline into the work
// request when small, else into a pooled registered buffer) and async_send
// completes once it is posted; the data is on its way and the caller's buffer
// is free. A larger one, up to connection_options::eager_split_limit (64 KiB,
// host memory), is split into eager pieces when the credits and buffers for
// all of them are there at once, and completes the same way (a receiver that
// then refuses it, with message_size or not_enough_memory, does so alone).
// Otherwise it goes by rendezvous: the peer RDMA-READs it straight from the
// caller's buffer, which must stay untouched until async_send completes (on
// the peer's fin; its refusals, message_size and peer_out_of_memory, come
// back to the sender). A message above the peer's maximum fails with
// errc::message_size. Sends wait (never fail) for credits; for a pool buffer
// they wait at most connection_options::buffer_wait (errc::no_buffer_space).
//
// Receiving: async_receive() hands out the message in its pooled receive
// buffer (zero copy); destroying the message re-posts that buffer and returns
// its credit to the peer. async_receive(buffer) copies an eager message or
// reads a rendezvous message straight into the buffer (a split one is copied
// in piece by piece; async_receive() copies it into memory of its own, as
// large as the message, bounded by rendezvous_memory); a message larger than
// the buffer fails with errc::message_size and is dropped (never truncated).
// Messages are taken in order of arrival; with several receives outstanding a
// rendezvous message may complete after an eager one that arrived later.
//
// Cancellation (per operation, through the handler's cancellation slot): a
// waiting receive or a queued send completes with operation_canceled and the
// connection stays usable; a rendezvous send on the wire is withdrawn (README,
// Cancellation); other work already on the wire runs to completion.
//
// Close: async_close() sends what is queued, tells the peer, and completes
// when the peer has closed too; the peer's pending and later receives fail
// with errc::connection_closed once it has taken every earlier message. On a
// queue-pair error (peer death) every pending operation completes exactly
// once with the error; messages already received can still be taken.
// Destroying an open connection aborts it (the peer sees an error).
//
// One-sided operations (RDMA WRITE, READ and atomics on the peer's memory,
// described by a remote_region the peer sent; see memory.hpp) queue with
// the sends and start in order:
//   async_put(local, remote)       void(error_code, std::size_t): writes local into remote
//   async_get(local, remote)       void(error_code, std::size_t): reads remote into local
//   async_put_with_notify(local, remote, value)
//                                  a put, then the peer's async_receive_notification()
//                                  yields {value, the range written}; like a message, a
//                                  notification holds one of the peer's receive credits
//                                  until it is taken
//   async_fetch_add(remote, add)   void(error_code, std::uint64_t before)
//   async_compare_swap(remote, expected, desired)
//                                  void(error_code, std::uint64_t before); swapped iff before == expected
//   async_flush()                  void(error_code): every earlier one-sided operation and
//                                  eager message is complete at the peer (a rendezvous
//                                  message is complete when its async_send completes)
// `local` is a local_range: a range of a memory_region, or any buffer (the
// fabric's registration cache registers it); put and get also take a span
// of up to 16 local ranges (gather / scatter; read when the operation
// starts). The local memory, and a memory_region it lies in, must stay
// valid until the operation completes (a region destroyed earlier fails the
// transfer at the device, like any deregistered key).
// A put or get completes when it is complete at the peer (RC: acknowledged);
// the transfer is split at the device's message limit. Errors on the
// operation itself: errc::out_of_range (local data larger than the remote
// range; a remote region in pieces whose addr or length were changed so
// that its pieces no longer cover the range), errc::invalid_argument (more than 16 ranges, a range reaching
// the end of the address space or sizes that add up past 2^64, a const buffer as a
// get's destination, a region without local_write as one, an atomic target
// that is not 8 bytes aligned and long), errc::not_supported (atomics on a
// device without them), errc::registration_failed (also: a buffer the
// cache would register in more than remote_region::max_pieces pieces).
// The peer refusing the
// access (outside its region, an unknown or deregistered key, missing
// access) completes that operation with wc_status::remote_access_error (or
// remote_invalid_request) and, as RC requires, fails the connection: later
// operations complete with the same error; a new connection works. With the
// tcp provider the peer's process makes the progress: it must be running
// its io_context with an operation pending (a receive, say), or have
// fabric_options::progress_thread.
#pragma once

#include <anydoor/detail/op_node.hpp>
#include <anydoor/error.hpp>
#include <anydoor/memory.hpp>

#include <boost/asio/async_result.hpp>
#include <boost/asio/buffer.hpp>
#include <boost/asio/io_context.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <system_error>
#include <tuple>

namespace anydoor {

namespace asio = boost::asio;
using error_code = boost::system::error_code;

class message;
class connection;

namespace detail {
class fabric_state;
op_node* acquire_node(connection_impl& c, op_kind kind);
asio::io_context::executor_type io_executor(const connection_impl& c) noexcept;
void cancel_node(void* node, asio::cancellation_type type);
void start_send(connection_impl& c, op_node* n);
void start_receive(connection_impl& c, op_node* n);
void start_close(connection_impl& c, op_node* n);
void start_onesided(connection_impl& c, op_node* n);

// Completes an operation started on an empty (moved-from) handle with
// errc::not_connected.
template <class Handler, class... Args>
void complete_not_connected(Handler handler, Args... defaults) {
  auto ex = asio::get_associated_executor(handler);
  asio::post(ex, [h = std::move(handler),
                  t = std::make_tuple(boost::system::error_code(make_error_code(errc::not_connected)), std::move(defaults)...)]() mutable {
    std::apply(std::move(h), std::move(t));
  });
}
}  // namespace detail

// A received message. Holds its receive buffer until destroyed (or moved
// from); then the buffer is re-posted for the peer, or a large message's
// memory kept for the next one (fabric_stats::kept_bytes). Destroy every
// message on its fabric's io_context thread (a large one destroyed
// elsewhere frees its memory instead of keeping it).
class message {
 public:
  message() noexcept;
  message(message&& other) noexcept;
  message& operator=(message&& other) noexcept;
  ~message();

  const std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  std::span<const std::byte> bytes() const noexcept { return {data_, size_}; }
  asio::const_buffer buffer() const noexcept { return {data_, size_}; }

 private:
  friend class detail::connection_impl;
  void release() noexcept;

  std::shared_ptr<detail::connection_impl> owner_;
  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::uint32_t buffer_ = 0xffffffffu;  // pool buffer to re-post
  std::unique_ptr<detail::op_node> large_;  // a rendezvous message's own memory (node.large, node.mr)
};

struct connection_stats {
  std::uint64_t messages_sent = 0;
  std::uint64_t messages_received = 0;
  std::uint64_t bytes_sent = 0;        // payload bytes of completed sends
  std::uint64_t bytes_received = 0;    // payload bytes of received messages
  std::uint64_t eager_sends = 0;
  std::uint64_t inline_sends = 0;
  std::uint64_t rendezvous_sends = 0;
  std::uint64_t split_sends = 0;       // messages sent as eager pieces (connection_options::eager_split_limit)
  std::uint64_t split_pieces = 0;      // ... and their pieces
  std::uint64_t posts = 0;             // send work requests posted
  std::uint64_t doorbells = 0;         // post_send calls
  std::uint64_t signaled = 0;          // signaled send work requests
  std::uint64_t recv_posts = 0;        // receive work requests posted
  std::uint64_t credit_stalls = 0;     // sends that had to wait for credits
  std::uint64_t buffer_stalls = 0;     // sends that had to wait for a pool buffer
  std::uint64_t credit_messages = 0;   // explicit credit updates sent
  std::uint64_t rendezvous_waits = 0;  // rendezvous reads that waited for rendezvous_memory to free
  std::uint64_t rnr_naks = 0;          // from the provider: RNR NAKs sent + received (should stay 0)
  std::uint64_t stray_completions = 0; // completions naming no work request outstanding, dropped (should stay 0)
  std::uint64_t puts = 0;              // one-sided operations completed successfully
  std::uint64_t gets = 0;
  std::uint64_t atomics = 0;
  std::uint64_t flushes = 0;
  std::uint64_t bytes_put = 0;
  std::uint64_t bytes_got = 0;
  std::uint64_t inline_puts = 0;       // puts whose bytes went in their work request (<= 64 B, host memory)
  std::uint64_t notifications_sent = 0;
  std::uint64_t notifications_received = 0;
  std::uint64_t heartbeats = 0;        // and liveness probes, sent while idle (keepalive)
  std::uint64_t scoped_registrations = 0;  // async_register_memory completed successfully
};

// What the peer announced in the handshake.
struct peer_parameters {
  std::uint16_t credits = 0;      // granted to us at the start
  std::uint16_t max_credits = 0;  // the peer's window: the most it grants at once
  std::uint32_t recv_buffer = 0;
  std::uint32_t eager_limit = 0;
  std::uint64_t max_message = 0;
};

class connection {
 public:
  connection() noexcept;
  explicit connection(std::shared_ptr<detail::connection_impl> impl) noexcept;
  connection(connection&&) noexcept;
  connection& operator=(connection&&) noexcept;
  ~connection();

  bool is_open() const noexcept;
  explicit operator bool() const noexcept { return impl_ != nullptr; }

  // Sends one message made of the buffers of `buffers` (at most 16 buffers,
  // their sizes adding up to at most 2^64 - 1, else errc::invalid_argument;
  // a rendezvous message must be a single buffer). void(error_code, std::size_t).
  // Buffers may be GPU device memory (README "GPU memory"): a failed copy
  // out of it ends the send with errc::device_copy_failed, having sent
  // nothing; CUDA managed memory: errc::not_supported.
  template <class ConstBufferSequence, class Token>
  auto async_send(const ConstBufferSequence& buffers, Token&& token) {
    return asio::async_initiate<Token, void(error_code, std::size_t)>(
        [this]<class H>(H&& handler, const ConstBufferSequence& bufs) {
          if (!impl_) return detail::complete_not_connected(std::forward<H>(handler), std::size_t{0});
          detail::op_node* n = detail::acquire_node(*impl_, detail::op_kind::send);
          std::size_t i = 0;
          bool too_many = false;
          for (auto it = asio::buffer_sequence_begin(bufs); it != asio::buffer_sequence_end(bufs); ++it) {
            const asio::const_buffer b(*it);
            if (b.size() == 0) continue;
            if (i == n->bufs.size() || !detail::add_length(n->length, b.size())) {
              too_many = true;  // (or sizes past 2^64)
              break;
            }
            n->bufs[i++] = b;
          }
          n->nbufs = static_cast<std::uint8_t>(i);
          if (too_many) n->nbufs = 0xff;
          n->handler.template store<std::size_t>(std::forward<H>(handler), detail::io_executor(*impl_),
                                                 &detail::cancel_node, n);
          detail::start_send(*impl_, n);
        },
        token, buffers);
  }

  // Receives the next message in its pooled buffer. void(error_code, message).
  template <class Token>
  auto async_receive(Token&& token) {
    return asio::async_initiate<Token, void(error_code, message)>(
        [this]<class H>(H&& handler) {
          if (!impl_) return detail::complete_not_connected(std::forward<H>(handler), message{});
          detail::op_node* n = detail::acquire_node(*impl_, detail::op_kind::receive_message);
          n->handler.template store<message>(std::forward<H>(handler), detail::io_executor(*impl_),
                                             &detail::cancel_node, n);
          detail::start_receive(*impl_, n);
        },
        token);
  }

  // Receives the next message into `buffer`. void(error_code, std::size_t).
  // `buffer` may be GPU device memory: a failed copy into it ends the
  // receive with errc::device_copy_failed (the message is consumed); CUDA
  // managed memory: errc::not_supported.
  template <class Token>
  auto async_receive(asio::mutable_buffer buffer, Token&& token) {
    return asio::async_initiate<Token, void(error_code, std::size_t)>(
        [this]<class H>(H&& handler, asio::mutable_buffer b) {
          if (!impl_) return detail::complete_not_connected(std::forward<H>(handler), std::size_t{0});
          detail::op_node* n = detail::acquire_node(*impl_, detail::op_kind::receive_buffer);
          n->dest = b;
          n->handler.template store<std::size_t>(std::forward<H>(handler), detail::io_executor(*impl_),
                                                 &detail::cancel_node, n);
          detail::start_receive(*impl_, n);
        },
        token, buffer);
  }

  // Graceful close. void(error_code).
  template <class Token>
  auto async_close(Token&& token) {
    return asio::async_initiate<Token, void(error_code)>(
        [this]<class H>(H&& handler) {
          if (!impl_) return detail::complete_not_connected(std::forward<H>(handler));
          detail::op_node* n = detail::acquire_node(*impl_, detail::op_kind::close);
          n->handler.template store<>(std::forward<H>(handler), detail::io_executor(*impl_), nullptr, nullptr);
          detail::start_close(*impl_, n);
        },
        token);
  }

  // One-sided operations (see the top of this file).
  template <class Token>
  auto async_put(local_range src, const remote_region& dst, Token&& token) {
    return onesided<std::size_t>(detail::op_kind::put, std::forward<Token>(token), [src, dst](detail::op_node& n) {
      detail::set_local(n, {&src, 1});
      n.remote = dst;
    });
  }
  template <class Token>
  auto async_put(std::span<const local_range> srcs, const remote_region& dst, Token&& token) {
    return onesided<std::size_t>(detail::op_kind::put, std::forward<Token>(token), [srcs, dst](detail::op_node& n) {
      detail::set_local(n, srcs);
      n.remote = dst;
    });
  }
  template <class Token>
  auto async_get(local_range dst, const remote_region& src, Token&& token) {
    return onesided<std::size_t>(detail::op_kind::get, std::forward<Token>(token), [dst, src](detail::op_node& n) {
      detail::set_local(n, {&dst, 1});
      n.remote = src;
    });
  }
  template <class Token>
  auto async_get(std::span<const local_range> dsts, const remote_region& src, Token&& token) {
    return onesided<std::size_t>(detail::op_kind::get, std::forward<Token>(token), [dsts, src](detail::op_node& n) {
      detail::set_local(n, dsts);
      n.remote = src;
    });
  }
  template <class Token>
  auto async_put_with_notify(local_range src, const remote_region& dst, std::uint32_t value, Token&& token) {
    return onesided<std::size_t>(detail::op_kind::put_notify, std::forward<Token>(token),
                                 [src, dst, value](detail::op_node& n) {
                                   detail::set_local(n, {&src, 1});
                                   n.remote = dst;
                                   n.value = value;
                                 });
  }
  template <class Token>
  auto async_fetch_add(const remote_region& target, std::uint64_t add, Token&& token) {
    return onesided<std::uint64_t>(detail::op_kind::fetch_add, std::forward<Token>(token),
                                   [target, add](detail::op_node& n) {
                                     n.remote = target;
                                     n.operand = add;
                                   });
  }
  template <class Token>
  auto async_compare_swap(const remote_region& target, std::uint64_t expected, std::uint64_t desired, Token&& token) {
    return onesided<std::uint64_t>(detail::op_kind::compare_swap, std::forward<Token>(token),
                                   [target, expected, desired](detail::op_node& n) {
                                     n.remote = target;
                                     n.operand = expected;
                                     n.operand2 = desired;
                                   });
  }
  template <class Token>
  auto async_flush(Token&& token) {
    return onesided<>(detail::op_kind::flush, std::forward<Token>(token), [](detail::op_node&) {});
  }
  // Registers `memory` for this connection's peer only, with `acc` (local
  // reads always; local_write; at least one of remote_write, remote_read,
  // remote_atomic): the region's rkey is a type-2 memory window bound to
  // this connection's queue pair. Any other connection, even of the same
  // fabric, presenting it fails with remote_access_error (and, as RC
  // requires, that connection fails); so does the registration itself,
  // which has no remote rights. The window is revoked when the connection
  // ends (closed, failed, aborted or destroyed) or the region is destroyed,
  // whichever comes first; memory_region::revoked() tells. Queued with the
  // sends and started in order: a message sent after it completes may
  // carry its remote() to the peer. void(error_code, memory_region).
  // Errors: errc::not_supported (a device without memory windows: siw;
  // memory larger than one registration, fabric_options::max_piece_bytes),
  // invalid_argument (empty memory, no remote right, a flag other than
  // local_write and remote_*, remote_write or remote_atomic without
  // local_write), registration_failed, wc_status::memory_window_bind_error
  // (the device refused the bind: as RC requires, the connection fails), and
  // the connection's own errors (connection_closed once it has ended).
  template <class Token>
  auto async_register_memory(std::span<std::byte> memory, access acc, Token&& token) {
    return onesided<memory_region>(detail::op_kind::register_memory, std::forward<Token>(token),
                                   [memory, acc](detail::op_node& n) {
                                     n.dest = asio::mutable_buffer(memory.data(), memory.size());
                                     n.operand = static_cast<std::uint64_t>(acc);
                                   });
  }
  // The next notification of the peer's async_put_with_notify.
  // void(error_code, notification); errors as async_receive's.
  template <class Token>
  auto async_receive_notification(Token&& token) {
    return onesided<notification>(detail::op_kind::receive_notification, std::forward<Token>(token),
                                  [](detail::op_node&) {});
  }

  // Aborts: the queue pair goes to error, pending operations complete with
  // errc::connection_closed, the peer sees an error.
  void abort() noexcept;

  connection_stats stats() const noexcept;
  // The executor of the fabric's io_context (the thread the connection
  // belongs to). Throws std::system_error (errc::not_connected) when empty.
  asio::io_context::executor_type get_executor() const;
  // The path the connection's queue pair uses (verbs: the GIDs and the
  // source GID's index; tcp: the socket's addresses); zeros once it is gone.
  transport::path_info path() const noexcept;
  const peer_parameters& peer() const noexcept;
  std::uint32_t eager_limit() const noexcept;  // effective: ours capped by the peer's receive buffer

 private:
  template <class... Results, class Token, class Setup>
  auto onesided(detail::op_kind kind, Token&& token, Setup setup) {
    return asio::async_initiate<Token, void(error_code, Results...)>(
        [this, kind]<class H>(H&& handler, Setup s) {
          if (!impl_) return detail::complete_not_connected(std::forward<H>(handler), Results{}...);
          detail::op_node* n = detail::acquire_node(*impl_, kind);
          s(*n);
          n->handler.template store<Results...>(std::forward<H>(handler), detail::io_executor(*impl_),
                                                &detail::cancel_node, n);
          detail::start_onesided(*impl_, n);
        },
        token, std::move(setup));
  }

  std::shared_ptr<detail::connection_impl> impl_;
};

}  // namespace anydoor
