// The client engine (runtime-internal): call slots, the deadline list and
// its timer, the receive loop, and the connection's state. Shared by
// rpc::client (one connection) and rpc::channel (one engine per connection
// it makes; calls wait in `connecting` until the connection is there).
#pragma once

#include <anydoor/rpc/client.hpp>

#include "deadline_list.hpp"

#include <boost/asio/steady_timer.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

namespace anydoor::rpc::detail {

using clock = std::chrono::steady_clock;

class client_impl : public std::enable_shared_from_this<client_impl> {
 public:
  enum class state : std::uint8_t { connecting, open, failed };

  // Starts connecting (no connection yet: calls queue).
  client_impl(asio::io_context::executor_type ex, const client_options& o);
  ~client_impl();
  client_impl(const client_impl&) = delete;
  client_impl& operator=(const client_impl&) = delete;

  // The connection is there: queued calls go out in order.
  void attach(connection c);
  // It could not be made, or it failed: every pending call completes with
  // `why` (once); later calls fail at once with unavailable.
  // `post`: complete them later (the caller is not a completion).
  void fail(std::error_code why, bool post) noexcept;
  // The owner is gone: abort, pending calls complete with operation_canceled.
  void shutdown() noexcept;

  call_op* acquire(std::error_code& ec) noexcept;
  void start(call_op* op, const call_options& o) noexcept;
  void abandon(call_op* op) noexcept;
  void cancel(call_op* op) noexcept;

  state current_state() const noexcept { return state_; }
  bool ever_open() const noexcept { return ever_open_; }
  anydoor::connection& conn() noexcept { return conn_; }
  const client_stats& stats() const noexcept { return stats_; }
  asio::io_context::executor_type executor() const noexcept { return ex_; }

 private:
  void send_request(call_op& op, bool post) noexcept;
  void send_cancel(call_op& op) noexcept;
  template <class Buffers>
  void send(call_op* op, const Buffers& bufs, bool cancellable, bool payload) noexcept;
  void on_sent(call_op* op, const error_code& ec, bool payload) noexcept;
  void ensure_receiving() noexcept;
  void on_message(const error_code& ec, message m) noexcept;
  void deliver(std::uint64_t call_id, errc status, message m, std::size_t offset) noexcept;
  call_op* find_sent(std::uint64_t call_id) noexcept;
  // Takes the op out of every list and completes it.
  // `early`: the call ends before its reply (deadline, cancel): a request
  // still queued is withdrawn. Early or not (a reply that came before the
  // server had read the payload), a call whose payload may still be read
  // from the caller's memory completes only when that send ends.
  void complete(call_op& op, std::error_code ec, reply&& r, bool post, bool early = false) noexcept;
  void unqueue(call_op& op) noexcept;
  void release(call_op& op) noexcept;
  void arm_timer() noexcept;
  void on_timer(std::uint64_t seq) noexcept;
  void became_idle() noexcept;
  void protocol_failure(const char* what) noexcept;

  asio::io_context::executor_type ex_;
  client_options opts_;
  anydoor::connection conn_;
  state state_ = state::connecting;
  bool ever_open_ = false;
  bool receiving_ = false;
  bool idle_check_posted_ = false;
  asio::cancellation_signal recv_cancel_;  // withdraws the receive when no call waits
  // A reply header that announced its payload as the next message.
  bool awaiting_payload_ = false;
  std::uint64_t payload_call_ = 0;
  errc payload_status_ = errc::ok;

  std::vector<std::unique_ptr<call_op>> ops_;
  // By op index: the reply of a call completed while its payload was still
  // being sent (op.deferred), handed over when that send ends.
  std::vector<reply> held_;
  std::vector<std::uint32_t> free_;
  std::uint32_t pending_ = 0;  // unsent + sent
  std::uint32_t sent_ = 0;     // waiting for a reply
  call_op* queue_head_ = nullptr;  // unsent, in call order
  call_op* queue_tail_ = nullptr;
  deadline_list deadlines_;  // pending calls with a deadline

  asio::steady_timer timer_;
  clock::time_point timer_at_ = clock::time_point::max();  // armed for (max: not armed)
  std::uint64_t timer_seq_ = 0;
  client_stats stats_;
};

}  // namespace anydoor::rpc::detail
