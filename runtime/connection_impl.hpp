// The connection engine (runtime-internal): credits, eager and rendezvous
// messages, batching and selective signaling, close and failure. One
// thread: the fabric's io_context.
#pragma once

#include <anydoor/connection.hpp>
#include <anydoor/reactor.hpp>

#include "auth.hpp"
#include "fabric_state.hpp"
#include "protocol.hpp"
#include "ring_slot.hpp"

#include <boost/asio/steady_timer.hpp>

#include <memory>
#include <string_view>
#include <vector>

namespace anydoor::detail {

class window_slot;
class staged_transfer;

// An intrusive FIFO of op nodes.
struct op_list {
  op_node* head = nullptr;
  op_node* tail = nullptr;
  bool empty() const noexcept { return head == nullptr; }
  void push_back(op_node* n) noexcept;
  op_node* pop_front() noexcept;
  void remove(op_node* n) noexcept;
};

class connection_impl;

// The setup path's end of an authenticating connection: done() runs once,
// posted on the io thread, when the peer has proven the token (ec empty)
// or never will (the reason; conn is null only when the connection is being
// destroyed). Until then nobody but the setup path holds the connection.
struct setup_waiter {
  virtual ~setup_waiter() = default;
  virtual void done(std::error_code ec, const std::shared_ptr<connection_impl>& conn) noexcept = 0;
};

struct auth_setup {
  auth::exchange exchange;
  std::unique_ptr<setup_waiter> waiter;
  bool answered = false;  // listener: the peer's proof checked and answered; its confirmation is due
};

class connection_impl : public std::enable_shared_from_this<connection_impl> {
 public:
  enum class state : std::uint8_t { setup, open, closing, closed, failed };

  explicit connection_impl(std::shared_ptr<fabric_state> fab);
  ~connection_impl();
  connection_impl(const connection_impl&) = delete;
  connection_impl& operator=(const connection_impl&) = delete;

  // Setup (io thread): creates the queue pair and posts the receives.
  // Throws std::system_error.
  void prepare();
  transport::queue_pair& qp() noexcept { return *qp_; }
  transport::path_info path() const noexcept { return qp_ != nullptr ? qp_->path() : transport::path_info{}; }
  // (Kept after the queue pair is gone: the logs and the fabric's listing
  // still name the connection.)
  std::uint32_t qp_num() const noexcept { return qpn_; }
  // Whether the device's queue pair is still allocated (for monitoring).
  bool holds_queue_pair() const noexcept { return qp_ != nullptr; }
  // The path as on_connected found it (empty before: during setup another
  // thread may still be writing it), for monitoring without a device query.
  const transport::path_info& connected_path() const noexcept { return connected_path_; }
  // The handshake is done: the peer's parameters are known. With `auth`
  // the connection then runs the authentication exchange (protocol.hpp)
  // within the handshake timeout and reports to auth->waiter.
  void on_connected(const protocol::hello& peer, std::unique_ptr<auth_setup> auth = nullptr);
  void on_setup_failed() noexcept;  // the queue pair never connected
  // The connecting side's first word (capabilities::established_by_message):
  // an empty credit message, so that a listener whose connection manager
  // lost our establishment learns of it at once.
  void speak_first() noexcept;

  // Operations (connection.hpp's templates call these).
  op_node* acquire(op_kind kind);
  void release(op_node* n) noexcept;
  // n's registration and copy: freed, or (a rendezvous source whose key
  // went out, and that the peer may have read) held for late duplicate
  // READs (fabric_state::retire_source).
  void drop_source(op_node* n, bool peer_read) noexcept;
  void unpin(op_node* n) noexcept;  // registration-cache entries the operation held
  void start_send(op_node* n);
  void start_receive(op_node* n);
  void start_close(op_node* n);
  void start_onesided(op_node* n);
  // The application's entry for a send or one-sided operation: starts it
  // with `start`, and rings its doorbell inside the call where the
  // connection is in a ping-pong: its last kLoneTurns turns with work
  // (fabric_state::turns) each queued one operation's work requests
  // (operations issued together in turns, as coroutines that each await
  // their own, are rung apart at most once: the turn that ends a
  // ping-pong may take one doorbell more), this is the turn's first,
  // and it is issued neither inside the reactor's pass, nor by a handler a
  // flush runs, nor while a send's handler the fabric posted is still to
  // run (those likely issue more). A lone request then does not wait for
  // the turn's end, behind an io_context round (Asio's epoll_wait, other
  // handlers). Everything else is batched as before, one doorbell per turn.
  void issue(op_node* n, void (connection_impl::*start)(op_node*));
  // A chunk of a staged transfer: queued at once (never held, see behind_staged_).
  void start_chunk(op_node* n);
  // A put or get that went through the staging pipeline (staging.hpp) ends;
  // after the last, the operations issued meanwhile start, then a close that
  // waited.
  void complete_staged(op_node* n, std::error_code ec, std::size_t size) noexcept;
  void cancel(op_node* n, asio::cancellation_type type);
  void abort() noexcept;
  void on_handle_released() noexcept;
  // ~fabric: nothing will poll the completion queue again, so the flushes
  // this connection waits for (self_) will never come: it gives up what it
  // posted as flushed and lets itself go (handlers are posted, not run).
  void abandon() noexcept;

  // Liveness (fabric_state's tick): fails the connection when the peer has
  // been silent for keepalive, sends a heartbeat when we have been; returns
  // how soon it wants the next tick.
  std::chrono::milliseconds liveness(std::chrono::steady_clock::time_point now) noexcept;
  void start_liveness() noexcept;
  static constexpr std::uint64_t kMinKeepalive = 200;      // ms (connection_options::keepalive)
  static constexpr std::uint64_t kMaxKeepalive = 3600000;  // ms
  // The peer's queue pair goes to error once its close is acknowledged, so
  // our work requests still unanswered this long after its close arrived
  // will never be answered: the tick moves our queue pair to error, and
  // they come back flushed. (A NIC reports retry_exceeded first, in about
  // half a second; rxe retries for ever: transport/verbs/verbs_util.hpp.)
  static constexpr std::chrono::milliseconds kPeerCloseGrace{1000};
  // How long the peer has to answer the withdrawal of a rendezvous message
  // (a cancelled send) without keepalive; with it, keepalive.
  static constexpr std::chrono::milliseconds kWithdrawGrace{10000};

  // Flushing (fabric_state).
  void flush() noexcept;
  void flush_now() noexcept;
  std::size_t queued_sends() const noexcept { return batch_ == nullptr ? 0 : batch_->wrs.size(); }
  bool dirty = false;
  bool ringing = false;  // inside issue(): schedule() leaves the flush to it
  // issue(): turns in a row, up to kLoneTurns, in which the application
  // queued work requests of one operation on this connection; those of
  // turn issue_turn so far.
  static constexpr std::uint32_t kLoneTurns = 2;
  std::uint32_t lone_turns = 0;
  std::uint32_t issued = 0;
  std::uint64_t issue_turn = ~std::uint64_t{0};
  // Queued from a completion handler, or from a handler a flush ran
  // (fabric_state::in_handlers): flushed after the reactor's pass, or by
  // flush_all's second round.
  bool urgent = false;
  bool waiting_buffer = false;
  void on_buffer_available() noexcept;

  // A receive of the fabric's shared receive queue that this connection's
  // queue pair took (fabric_state found it by qp_num).
  void on_srq_completion(const transport::completion& wc, std::uint32_t buffer) noexcept;

  // message
  void return_buffer(std::uint32_t index) noexcept;

  bool is_open() const noexcept { return state_ == state::open || state_ == state::setup; }
  connection_stats stats() const noexcept;
  const peer_parameters& peer() const noexcept { return peer_; }
  std::uint32_t send_eager_limit() const noexcept { return eager_limit_; }
  fabric_state& fabric() noexcept { return *fab_; }

 private:
  struct send_op final : operation {
    connection_impl* c = nullptr;
    void complete(const transport::completion& wc) noexcept override { c->on_send_completion(wc); }
  };
  struct recv_op final : operation {
    connection_impl* c = nullptr;
    void complete(const transport::completion& wc) noexcept override { c->on_recv_completion(wc); }
  };
  // What a send-queue slot holds: read_last and onesided_last complete their
  // op when they retire; a control slot may carry the close.
  enum class slot_kind : std::uint8_t { none, message, control, read_last, onesided_last };
  struct sq_slot {
    std::uint32_t buffer = buffer_pool::npos;
    slot_kind kind = slot_kind::none;
    op_node* op = nullptr;
    bool signaled = false;
  };
  // (20 bytes, 8 for a fin: one of each per credit and connection.)
  struct inbox_entry {
    std::uint32_t buffer = 0;
    std::uint32_t length = 0;       // bytes received (header included)
    std::uint32_t split_total = 0;  // a piece of a split message this long (0: none)
    std::uint32_t cookie = 0;       // a rendezvous request's (rts)
    bool rts = false;
    bool split_last = false;        // its last piece
  };
  // A fin, or the answer to a withdraw that came too late, waiting for a
  // credit. A fin for a withdrawn request holds that request's receive
  // buffer until it goes (so what waits is bounded by the credits the peer
  // spent: it cannot queue answers without end by returning one credit);
  // its cookie is read from there.
  struct fin_entry {
    std::uint32_t word = 0;  // the cookie, or the buffer held
    protocol::fin_status status = protocol::fin_status::ok;
    protocol::msg_type type = protocol::msg_type::fin;
    bool held = false;
  };
  static_assert(sizeof(inbox_entry) == 20 && sizeof(fin_entry) == 8, "per-connection memory (scale-idle-memory-srq)");
  std::uint32_t cookie_of(const fin_entry& f) const noexcept;
  void drop_fins() noexcept;  // forgets them, giving back the buffers they hold

  void on_send_completion(const transport::completion& wc) noexcept;
  void on_recv_completion(const transport::completion& wc) noexcept;
  void on_send_completion_body(const transport::completion& wc) noexcept;
  void on_recv_completion_body(const transport::completion& wc) noexcept;
  // The reactor gave up on the completion queue (its own completion, no work
  // request's): everything outstanding is lost.
  static bool reactor_gave_up(const transport::completion& wc) noexcept {
    return wc.status == transport::wc_status::fatal && (wc.wr_id & 0xffffffff00000000ull) == reactor::kPersistent;
  }
  void handle_message(std::uint32_t buffer, std::uint32_t length) noexcept;
  // Queues a received message (or piece) for delivery; with the inbox full
  // (never with a conforming peer: it holds `credits` entries) releases the
  // buffer and fails the connection with protocol_error.
  void push_inbox(const inbox_entry& e) noexcept;
  // authentication
  void handle_auth(const protocol::header& h, std::uint32_t buffer) noexcept;
  bool send_auth(protocol::auth_status status) noexcept;
  void end_auth(std::error_code ec) noexcept;  // reports to the waiter (once)
  bool authenticating() const noexcept { return auth_ != nullptr; }
  // Retires the send queue's slots through seq: seq's with status, those
  // before it succeeded (a completion covers the unsignaled requests before
  // it), unless every_one (nothing came back for any of them: all fail).
  void retire_through(std::uint64_t seq, transport::wc_status status, bool every_one = false) noexcept;
  std::uint64_t full_seq(std::uint32_t tag, std::uint64_t base) const noexcept;
  // The bits of a queue position that travel in a persistent wr_id's tag.
  static constexpr std::uint32_t kTagMask = 0x7fffffffu;

  // sending
  // Why a send or one-sided operation cannot start (closing, closed,
  // failed); empty while it can.
  std::error_code send_refusal() const noexcept;
  // The connection has ended (failed, closed, or the peer closed): what
  // send_refusal says but for a close of ours that waits (close_waiting_).
  // Chunks of staged transfers and the operations held behind them, all
  // issued before that close, go on unless this says no.
  std::error_code ended_refusal() const noexcept;
  // Whether ended_refusal() and send_refusal() would refuse: what the data
  // path asks first (an empty std::error_code costs a call into the C++
  // library to build).
  bool ended() const noexcept { return state_ == state::failed || state_ == state::closed || peer_closed_; }
  bool refuses_sends() const noexcept { return ended() || close_op_ != nullptr || close_waiting_ != nullptr; }
  void queue_send(op_node* n);  // after the operations already waiting
  bool progress_sends(bool post) noexcept;
  bool progress_sends_body(bool post) noexcept;  // false once nothing more can start now
  enum class start_result : std::uint8_t { started, blocked_credit, blocked_buffer, blocked_queue };
  start_result try_start(op_node* n, bool post) noexcept;
  start_result try_start_onesided(op_node* n, bool post) noexcept;
  std::error_code prepare_onesided(op_node* n) noexcept;  // checks and keys the local memory
  bool stages(const op_node* n) const noexcept;           // GPU memory through the staging pipeline
  void start_staged(op_node* n);
  void dispatch_onesided(op_node* n);  // start_onesided past the hold
  void release_held() noexcept;        // staged_ is 0: behind_staged_ starts, in order, until one stages
  void end_waiting_staged(std::error_code ec) noexcept;  // those still waiting for a first buffer
  std::error_code prepare_window(op_node* n) noexcept;    // register_memory: the region and its window
  void revoke_windows() noexcept;                         // the connection ends: every window it bound
  bool take_send_buffer(op_node* n, std::uint32_t& buf) noexcept;  // false: wait for the pool
  void wait_for_buffer() noexcept;  // on_buffer_available once the pool has one
  start_result credit_stall(op_node* n) noexcept;
  // A message above the eager limit (and at most eager_split_limit) as
  // eager pieces: true when started; false when its credits, send queue
  // slots or pool buffers are not all there now (it goes by rendezvous).
  bool start_split(op_node* n, bool post) noexcept;
  static constexpr std::uint64_t kMaxSplitPieces = 64;
  // An eager or split send's completion (its bytes are copied).
  void copied_send_done(op_node* n, bool post) noexcept;
  // Queues up to max_wrs work requests of a put or get from its cursor;
  // true once all of it is queued.
  bool emit_segments(op_node* n, bool last_completes, std::size_t max_wrs) noexcept;
  void on_onesided_done(op_node* n, transport::wc_status status, std::size_t slot, bool post) noexcept;
  void complete_flushes(std::uint64_t done) noexcept;  // flushes whose target <= done
  void park(op_node* n) noexcept;      // ended early: completes when its posted parts are back
  void complete_parked(bool post) noexcept;
  void park_partial_reads() noexcept;
  bool enqueue_control(protocol::msg_type type, std::uint8_t status, std::uint32_t aux) noexcept;
  // Asks the peer's device for an answer (liveness): a signaled zero-length
  // RDMA WRITE, unless a signaled request is outstanding already.
  void probe() noexcept;
  // Work requests that can be queued now: free send queue slots, and room
  // for one gather entry each (see stage_sge_).
  // (Borrows the doorbell batch: hold_batch.)
  std::uint32_t sq_free() noexcept {
    const auto slots = static_cast<std::uint32_t>(sq_.size() - (sq_queued_ - sq_retired_));
    if (slots == 0 || !hold_batch()) return 0;
    return std::min(slots, sge_room());
  }
  // Queues a work request (its slot records kind, buffer and op) whose
  // gather list is `sges`: staged entries (take_sges), or none.
  transport::work_request& next_wr(slot_kind kind, std::uint32_t buffer, op_node* op,
                                   std::span<const transport::sge> sges) noexcept;
  // The next n entries of the gather-list staging; n <= sge_room().
  transport::sge* take_sges(std::uint32_t n) noexcept {
    transport::sge* p = batch_->sges.data() + stage_sge_used_;
    stage_sge_used_ += n;
    return p;
  }
  std::uint32_t sge_room() const noexcept {
    return batch_ == nullptr ? 0 : static_cast<std::uint32_t>(batch_->sges.size() - stage_sge_used_);
  }
  // A SEND of `wire` bytes can go inline: within max_inline_data, and the
  // inline staging of this batch has room (control messages have their
  // own, which always has room for one per free send queue slot: they
  // never need a pool buffer when the inline limit takes a header).
  bool can_inline(std::size_t wire) const noexcept {
    return batch_ != nullptr && wire <= fab_->inline_cap && stage_inline_used_ + wire <= batch_->inline_bytes.size();
  }
  bool can_inline_control(std::size_t wire) const noexcept {
    return wire <= fab_->inline_cap && stage_control_used_ + wire <= stage_control_.size();
  }
  // Queues a SEND of `wire` bytes and returns where the caller writes them:
  // the inline staging (copied into the work request when it is posted)
  // when buf is buffer_pool::npos (then can_inline(wire) held), else pool
  // buffer buf.
  std::byte* stage_send(slot_kind kind, std::uint32_t buf, op_node* op, std::uint32_t wire) noexcept;
  void reset_staging() noexcept {
    stage_sge_used_ = 0;
    stage_inline_used_ = 0;
    stage_control_used_ = 0;
  }
  std::uint16_t take_owed() noexcept;
  void post_fins() noexcept;
  // A cancelled rendezvous send (its request out): asks the peer to drop
  // it unread (protocol withdraw); it ends with the peer's fin, or fails the
  // connection when none comes within withdraw_grace().
  void withdraw(op_node* n) noexcept;
  void post_withdraws() noexcept;        // the withdraw messages waiting for a credit
  void withdraw_received(std::uint32_t cookie) noexcept;  // drops that request if it is still unread
  void withdraw_refused(std::uint32_t cookie) noexcept;   // the peer is reading it: its fin follows
  std::chrono::milliseconds withdraw_grace() const noexcept {
    return opt_.keepalive.count() > 0 ? opt_.keepalive : kWithdrawGrace;
  }
  // Fails the connection when a withdrawal went unanswered past the grace;
  // else when to look again (kMaxTick when none waits).
  std::chrono::milliseconds watch_withdrawals(std::chrono::steady_clock::time_point now) noexcept;
  std::chrono::milliseconds watch_peer(std::chrono::steady_clock::time_point now) noexcept;
  void maybe_send_credits() noexcept;
  void arm_buffer_timer() noexcept;
  void schedule() noexcept;

  // receiving
  void deliver(bool post) noexcept;
  // The split message at the inbox's head into receive `n`: false (nothing
  // taken) while its last piece has not arrived.
  bool deliver_split(op_node* n, bool post) noexcept;
  void deliver_notes(bool post) noexcept;
  // Why nothing more will arrive (closed, failed); empty while open.
  std::error_code receive_ending() const noexcept;
  // Nothing queued for the waiting receives: they end if receive_ending() says so.
  void end_receives(op_list& waiting, bool post) noexcept;
  bool start_read(op_node* n, const protocol::rts_body& b) noexcept;  // false: no room now
  void issue_reads(op_node* n) noexcept;  // queues what fits of a rendezvous read
  void continue_reads() noexcept;         // reads started in part go on as the queue drains
  void on_read_done(op_node* n, transport::wc_status status) noexcept;
  void repost(std::uint32_t buffer) noexcept;
  // A received buffer that carries no credit back (the connection is
  // ending, the message was refused): to the shared queue, or the pool.
  void release_received(std::uint32_t buffer) noexcept;
  // Shared receive queue: how many credits a re-posted buffer brings the
  // peer (the floor, growth toward the window while the queue has spare
  // receives, none when it is short); and the promises returned to the
  // fabric once the queue pair is gone.
  std::uint32_t grant() noexcept;
  void srq_release() noexcept;
  // The reactor gave up on the completion queue: no completion will come
  // for anything posted. The queue pair goes first (the device lets go of
  // every buffer its work requests name: a get's target, a posted receive),
  // then the connection fails and the receive buffers return to the pool.
  // During setup the setup thread holds the queue pair: the connection only
  // fails, and on_connected or on_setup_failed lets the queue pair go.
  void on_cq_lost(std::error_code ec) noexcept;
  // The queue pair goes first (the device lets go of what it holds), then
  // the connection fails, its unposted work ends and its receives return.
  void fail_without_queue_pair(std::error_code ec) noexcept;
  void return_posted_receives() noexcept;  // (the queue pair gone)
  void drop_queue_pair() noexcept;  // keeps its counters' last word (stats())
  // A post_send or post_recv failed; partial: the device took the requests
  // before *bad (took_part), counted as posted by the caller.
  static bool took_part(std::error_code ec, std::size_t bad, std::size_t size) noexcept;
  void on_post_failed(std::error_code ec, bool partial) noexcept;
  // A receive failed (its queue pair is in error): the connection fails,
  // or closes when the peer tore it down after its close.
  void on_receive_failed(const transport::completion& wc) noexcept;
  void queue_recv(std::uint32_t buffer) noexcept;
  void drop_unposted() noexcept;
  void drop_unposted_receives() noexcept;
  void on_close_acked() noexcept;
  void on_peer_close() noexcept;

  // ending
  void fail(std::error_code ec) noexcept;
  // A completion with an error fails the connection, with a warning naming
  // the queue ("send", "receive"), unless it is ending anyway: then true.
  bool fail_unless_ending(const transport::completion& wc, std::string_view queue) noexcept;
  void end_waiting_sends(std::error_code ec) noexcept;     // not started: end with ec (or park)
  void end_rendezvous_sends(std::error_code ec) noexcept;  // waiting for a fin that will never come
  void complete(op_node* n, bool post, std::error_code ec, std::size_t size = 0) noexcept;
  void complete_message(op_node* n, bool post, message m) noexcept;
  void maybe_release_self() noexcept;
  void end_all_waiting(std::error_code ec) noexcept;  // abandon, ~connection_impl
  void begin_drain() noexcept;  // keeps the reactor polling until every flush is back (cover_tail first)

  std::shared_ptr<fabric_state> fab_;
  std::unique_ptr<transport::queue_pair> qp_;
  const connection_options& opt_;
  state state_ = state::setup;
  std::error_code error_;
  bool counted_ = false;  // in fabric_state::open_connections
  // From prepare() until on_connected or on_setup_failed: the connect or
  // accept thread uses the queue pair (provider contract), whatever the
  // state says (a connection can fail during setup): nothing may destroy it.
  bool setup_holds_qp_ = false;
  bool draining_ = false;  // holds the fabric busy while flushed work requests come back
  bool peer_closed_ = false;   // the peer's close message arrived
  bool close_sent_ = false;
  op_node* close_op_ = nullptr;
  std::uint32_t staged_ = 0;           // staged transfers in progress (staging.hpp)
  op_node* close_waiting_ = nullptr;   // a close issued while staged_ != 0
  // Sends and one-sided operations issued while staged_ != 0 wait here, in
  // order (cancellable), so that nothing overtakes a staged transfer: its
  // chunks reach the send queue only as their copies finish, and what is
  // queued after them is ordered after them (RC), a flush included. A
  // one-sided operation that does not stage itself is prepared before it
  // waits (op_node::prepared): released, it is only queued.
  op_list behind_staged_;
  std::vector<std::weak_ptr<staged_transfer>> staging_now_;  // staged_ of them, for cancel()
  peer_parameters peer_;
  std::uint32_t eager_limit_ = 0;
  std::uint64_t fragment_ = 0;  // largest piece of a put, get or rendezvous read per work request
  std::uint64_t rendezvous_held_ = 0;  // bytes allocated for rendezvous messages being read
  bool budget_blocked_ = false;  // the next read waits for rendezvous_memory to free
  std::shared_ptr<connection_impl> self_;  // while work requests are outstanding

  send_op send_op_;
  recv_op recv_op_;
  std::uint64_t send_base_ = 0;  // persistent wr_id bases
  std::uint64_t recv_base_ = 0;

  // send queue: [sq_retired_, sq_posted_) posted, [sq_posted_, sq_queued_) in batch_
  std::vector<sq_slot> sq_;
  std::uint32_t sge_per_wr_ = 1;
  std::vector<std::uint64_t> atomic_results_;  // one per slot, registered
  std::unique_ptr<transport::memory_region> atomic_mr_;
  // The work requests of the next doorbell and what they point to until
  // they are posted: their gather lists and the bytes of inline sends.
  // post_send copies both (the provider contract), so the batch is empty
  // again after every post: bump allocators, reset by flush_now and
  // drop_unposted (reset_staging). The batch is the fabric's
  // (fabric_state::take_batch), held from the first work request queued
  // (sq_free) until the post, so an idle connection holds none. Sized for a
  // batch rather than per send queue slot: send_queue + sge_per_wr_ gather
  // entries (each work request takes one; a put or get takes fewer pieces
  // per request when they run short) and at most kInlineStage inline bytes
  // (a send that does not fit goes in a pool buffer instead, as a large one
  // does). Control messages (credits, FIN, close, auth) have their own
  // staging, for send_queue headers and one auth message, so that they
  // never need a pool buffer when the inline limit takes a header.
  static constexpr std::size_t kInlineStage = 4096;
  doorbell_batch* batch_ = nullptr;
  bool hold_batch() noexcept {   // false: no memory for one (then nothing can be queued)
    return batch_ != nullptr || borrow_batch();
  }
  bool borrow_batch() noexcept;
  bool batch_failed_ = false;  // no memory for a batch: the next flush fails the connection
  std::error_code auth_send_error() const noexcept {  // why send_auth could not queue its message
    return batch_failed_ ? std::make_error_code(std::errc::not_enough_memory) : make_error_code(errc::no_buffer_space);
  }
  void return_batch() noexcept {  // when nothing is queued in it
    if (batch_ != nullptr && batch_->wrs.empty()) give_back_batch();
  }
  void give_back_batch() noexcept;
  std::size_t stage_sge_used_ = 0;
  std::size_t stage_inline_used_ = 0;
  std::vector<std::byte> stage_control_;
  std::size_t stage_control_used_ = 0;
  std::uint64_t sq_retired_ = 0, sq_posted_ = 0, sq_queued_ = 0;
  std::uint32_t since_signal_ = 0;
  // Unsignaled tails (flush_now): the position after the last signaled
  // request posted, and whether every request posted since holds nothing
  // (an inline message with no operation). Posted requests past
  // sq_signaled_end_ are an uncovered tail: no completion of theirs is due
  // until a signaled one follows (every signal_interval-th, a flush's
  // marker, a close, or cover_tail() once the queue pair is in error).
  std::uint64_t sq_signaled_end_ = 0;
  bool lone_since_signal_ = true;
  bool uncovered_tail() const noexcept { return sq_signaled_end_ < sq_posted_ && sq_retired_ < sq_posted_; }
  // Queues (flush) or posts (after the move to error) a signaled
  // zero-length RDMA WRITE behind an uncovered tail.
  void queue_tail_marker(transport::work_request& wr) noexcept;
  void cover_tail() noexcept;
  bool settle_tail_ = false;  // cover_tail() could not post: the tail retires here once the rest is back
  void settle_tail(bool post) noexcept;  // (post: as complete())
  // A marker cover_tail() posted that has not come back: the position
  // before the tail and when it went (liveness gives up on it after
  // kPeerCloseGrace: a provider that never completes a request posted in
  // error, as siw's user-space queue pairs).
  bool cover_waits_ = false;
  std::uint64_t cover_from_ = 0;
  std::chrono::steady_clock::time_point cover_at_{};

  // receive queue: ring of posted buffers, FIFO
  std::vector<std::uint32_t> rq_;
  std::uint64_t rq_done_ = 0, rq_posted_ = 0, rq_queued_ = 0;
  std::vector<transport::recv_request> recv_batch_;
  std::vector<transport::sge> rq_sge_;

  // credits
  bool srq_ = false;            // receives come from the fabric's shared queue
  std::uint32_t qpn_ = 0;       // our queue pair's number (0 before prepare())
  // srq_: credits granted to the peer and not yet used by a message that
  // arrived (= peer_view_ + owed_ + withheld_ once connected), counted in
  // the fabric's srq_promised.
  std::int64_t promised_ = 0;
  // srq_: buffers of the shared queue this connection received and has not
  // given back (in the inbox, with the application, being read from): with
  // promised_, never more than the window, or the inbox would overflow.
  std::int64_t held_ = 0;
  bool srq_attached_ = false;   // in the fabric's table under qpn_
  std::chrono::steady_clock::time_point srq_state_checked_{};
  std::int64_t credits_ = 0;    // the peer's receives we may use
  std::uint32_t owed_ = 0;      // our receives re-posted, not yet reported
  // Of owed_, those the peer's credit messages that returned credits took:
  // sent back alone they would only move one credit to and fro between two
  // idle peers (maybe_send_credits).
  std::uint32_t owed_echo_ = 0;
  std::int64_t peer_view_ = 0;  // the peer's credits as we know them

  std::vector<inbox_entry> inbox_;  // ring, capacity = credits
  std::uint64_t split_left_ = 0;    // bytes of the split message being received still to come
  std::uint32_t split_total_ = 0;   // ... its length
  std::uint64_t inbox_head_ = 0, inbox_tail_ = 0;
  std::vector<fin_entry> fins_;     // fins waiting for a credit
  // Rendezvous sends of ours in active_ whose withdrawal was asked
  // (op_node::operand 1: its withdraw message not sent yet, 2: sent, 3:
  // the peer answered that it is reading it; op_node::deadline: when asked,
  // then when sent), and of those not sent yet: hints, recounted by the
  // walks over active_ that use them.
  std::uint32_t withdrawing_ = 0, withdraw_unsent_ = 0;

  op_list send_waiting_;   // sends not yet started, in order
  op_list at_doorbell_;    // eager sends queued by completion handlers: complete once posted (flush)
  op_list recv_waiting_;   // receives without a message yet
  op_list active_;         // rendezvous sends waiting for fin, receives reading
  op_list flushes_;        // flushes waiting for their target (in order)
  op_list parked_;         // ended early, waiting for their posted parts (target in operand, in order)
  op_list note_waiting_;   // receive_notification without a notification yet
  // Notifications not yet taken: the buffers they arrived in, held (the
  // peer's credits) and decoded again when taken, since a notification's
  // region (inline keys) is much larger than its wire form.
  std::vector<std::uint32_t> notes_;  // ring, capacity = credits
  std::uint64_t notes_head_ = 0, notes_tail_ = 0;
  std::uint32_t next_cookie_ = 1;

  // Authentication: set from on_connected until the peer has proven the
  // token (or failed to); the credits we withhold from it until then; its
  // auth message when it came before on_connected.
  std::unique_ptr<auth_setup> auth_;
  std::uint32_t withheld_ = 0;
  std::uint32_t early_auth_ = buffer_pool::npos;
  protocol::header early_auth_header_{};
  std::uint64_t refusal_seq_ = ~std::uint64_t{0};  // our refusal's send queue position: fail once it is out
  asio::steady_timer setup_timer_;

  // liveness: completions received and sends staged (counted on the data
  // path), and when the tick last saw each change
  std::uint64_t rx_count_ = 0, rx_mark_ = 0;
  std::uint64_t tx_count_ = 0, tx_mark_ = 0;
  std::uint64_t ack_mark_ = 0;  // sq_retired_ at the last tick
  std::chrono::steady_clock::time_point last_rx_{}, last_tx_{};
  std::chrono::steady_clock::time_point peer_closed_at_{};  // when the peer's close arrived
  bool flushed_after_peer_close_ = false;  // kPeerCloseGrace ran out with work requests unanswered
  std::chrono::milliseconds heartbeat_{0};  // 0: none
  bool registered_ = false;                 // in fabric_state's list

  // The windows of this connection's scoped regions (revoked when it ends).
  std::vector<std::weak_ptr<window_slot>> windows_;

  asio::steady_timer buffer_timer_;
  bool buffer_timer_armed_ = false;
  connection_stats stats_;
  transport::path_info connected_path_;
};

}  // namespace anydoor::detail
