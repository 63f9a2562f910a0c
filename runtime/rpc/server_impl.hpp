// The server engine (runtime-internal): the method table, one session per
// connection served (call slots, the receive loop with its concurrency
// limit, deadlines, replies) and the accept loops.
#pragma once

#include <anydoor/rpc/server.hpp>

#include "deadline_list.hpp"
#include "wire.hpp"

#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/steady_timer.hpp>

#include <array>
#include <chrono>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace anydoor::rpc::detail {

using clock = std::chrono::steady_clock;

struct handler_entry {
  std::string name;
  sync_fn sync;
  coro_fn coro;
  maybe_fn maybe;
};

class accept_loop;

struct server_state {
  server_options opts;
  std::unordered_map<std::uint64_t, handler_entry> methods;
  std::vector<session*> sessions;
  std::vector<accept_loop*> acceptors;
  server_stats stats;
  bool stopped = false;
};

// Linked in its session's deadline list by deadline_hook::due (the
// request's deadline, as server_call::deadline() shows it).
struct call_slot : server_call, deadline_hook {
  session* owner = nullptr;
  std::uint32_t index = 0;
  bool busy = false;
  bool running = false;     // a coroutine handler runs
  // Its co_spawn has not completed: the spawn's cancellation handler still
  // lives in `signal` (Asio touches it once more after the coroutine has
  // ended the call), so the slot is not reused until then.
  bool spawned = false;
  bool expired = false;
  bool client_cancelled = false;
  std::uint8_t sends = 0;
  status pre;               // a framing problem found before the handler: reply this
  message request_msg;      // the request's receive buffer(s), held while the handler runs
  message payload_msg;
  asio::cancellation_signal signal;
  std::array<std::byte, wire::kHeaderSize> reply_header{};
  std::string status_text;  // an error reply's message
};

class session : public std::enable_shared_from_this<session> {
 public:
  session(std::shared_ptr<server_state> st, connection c, ::anydoor::detail::pending_handler* done);
  ~session();
  session(const session&) = delete;
  session& operator=(const session&) = delete;

  void start() noexcept { ensure_receiving(); }
  // Ends the session: aborts the connection, cancels running handlers,
  // completes async_serve with `why`.
  void end(std::error_code why, bool post) noexcept;
  // Graceful: no more requests; once the running calls have replied, the
  // connection is closed cleanly; aborted when `grace` passes first.
  void drain(std::chrono::milliseconds grace) noexcept;

 private:
  void maybe_close() noexcept;
  void ensure_receiving() noexcept;
  void on_message(const error_code& ec, message m) noexcept;
  void on_request(const wire::header& h, message m) noexcept;
  void on_cancel(std::uint64_t call_id) noexcept;
  call_slot& take_slot();
  void dispatch(call_slot& s) noexcept;
  // A coroutine handler's call, spawned: it ends the call itself (see dispatch).
  static asio::awaitable<void> run_call(std::shared_ptr<session> self, call_slot& s, asio::awaitable<status> body);
  void on_handler_done(call_slot& s, std::exception_ptr e, status st) noexcept;
  void finish(call_slot& s, status st) noexcept;
  void send_reply(call_slot& s, const status& st) noexcept;
  template <class Buffers>
  void send(call_slot& s, const Buffers& bufs, bool payload = false) noexcept;
  void on_sent(call_slot& s, const error_code& ec, bool payload) noexcept;
  void free_slot(call_slot& s) noexcept;
  void cancel_running(call_slot& s) noexcept;
  void arm_timer() noexcept;
  void on_timer(std::uint64_t seq) noexcept;

  std::shared_ptr<server_state> st_;
  connection conn_;
  asio::io_context::executor_type ex_;
  ::anydoor::detail::pending_handler* done_;
  std::vector<std::unique_ptr<call_slot>> slots_;
  std::vector<std::uint32_t> free_;
  std::uint32_t active_ = 0;
  bool receiving_ = false;
  bool ended_ = false;
  bool draining_ = false;
  bool closing_ = false;
  call_slot* awaiting_payload_ = nullptr;
  deadline_list deadlines_;  // running calls with a deadline
  asio::steady_timer timer_;
  clock::time_point timer_at_ = clock::time_point::max();
  std::uint64_t timer_seq_ = 0;
  asio::steady_timer drain_timer_;
};

class accept_loop : public std::enable_shared_from_this<accept_loop> {
 public:
  accept_loop(std::shared_ptr<server_state> st, acceptor a, ::anydoor::detail::pending_handler* done);
  ~accept_loop();
  void next() noexcept;
  void close() noexcept { acc_.close(); }

 private:
  void on_accept(const error_code& ec, connection c) noexcept;
  std::shared_ptr<server_state> st_;
  acceptor acc_;
  asio::io_context::executor_type ex_;
  ::anydoor::detail::pending_handler* done_;
};

}  // namespace anydoor::rpc::detail
