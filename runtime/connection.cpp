// The connection's lifecycle (setup, operations, ending) and the message and
// connection handles; the data path is in connection_{send,onesided,receive}.cpp.
#include "connection_impl.hpp"

#include <anydoor/error.hpp>

#include "log.hpp"
#include "cuda/driver.hpp"
#include "scoped_region.hpp"
#include "registration_cache.hpp"
#include "staging.hpp"

#include <algorithm>
#include <string_view>
#include <utility>

namespace anydoor::detail {

namespace {
const std::error_code kCancelled = std::make_error_code(std::errc::operation_canceled);
}  // namespace

// ---------------------------------------------------------------- op_list

void op_list::push_back(op_node* n) noexcept {
  n->next = nullptr;
  n->prev = tail;
  if (tail != nullptr) {
    tail->next = n;
  } else {
    head = n;
  }
  tail = n;
}

op_node* op_list::pop_front() noexcept {
  op_node* n = head;
  if (n != nullptr) remove(n);
  return n;
}

void op_list::remove(op_node* n) noexcept {
  if (n->prev != nullptr) {
    n->prev->next = n->next;
  } else {
    head = n->next;
  }
  if (n->next != nullptr) {
    n->next->prev = n->prev;
  } else {
    tail = n->prev;
  }
  n->next = n->prev = nullptr;
}

// ---------------------------------------------------------------- setup

connection_impl::connection_impl(std::shared_ptr<fabric_state> fab)
    : fab_(std::move(fab)), opt_(fab_->options.connection), setup_timer_(fab_->io), buffer_timer_(fab_->io) {
  send_op_.c = this;
  recv_op_.c = this;
}

connection_impl::~connection_impl() {
  revoke_windows();
  buffer_timer_.cancel();
  setup_timer_.cancel();
  if (early_auth_ != buffer_pool::npos) release_received(early_auth_);
  if (auth_ != nullptr && auth_->waiter != nullptr) {
    // Every ending reports to the waiter (end_auth): this is a last resort,
    // so that a connect or an accept never waits forever.
    log().error("connection: destroyed while authenticating");
    fab_->own_nonces.forget(auth_->exchange);
    fab_->idle();
    auth_->waiter->done(errc::connection_closed, nullptr);
  }
  // Normally empty: flush() or fail() completes them within the pass. (No
  // work request is outstanding: self_ held the connection until then.)
  drop_unposted();  // (parks what only an unposted slot refers to: a put, get, atomic or bind)
  end_all_waiting(errc::connection_closed);  // (a close_waiting_'s transfers dropped)
  if (send_base_ != 0) fab_->reactor->untrack(send_base_);
  if (recv_base_ != 0) fab_->reactor->untrack(recv_base_);
  fab_->forget(this);
  if (registered_) fab_->remove(this);
  // Buffers still posted when the queue pair goes away (it never connected,
  // or the peer tore it down with nothing flushed) return to the pool, once
  // the device has let go of them.
  qp_.reset();
  for (std::uint64_t i = rq_done_; i < rq_queued_; ++i) fab_->pool->put(rq_[ring_slot(i, rq_.size())]);
  for (std::uint64_t i = inbox_head_; i < inbox_tail_; ++i) release_received(inbox_[ring_slot(i, inbox_.size())].buffer);
  for (std::uint64_t i = notes_head_; i < notes_tail_; ++i) release_received(notes_[ring_slot(i, notes_.size())]);
  drop_fins();
  for (std::uint64_t i = sq_retired_; i < sq_queued_; ++i) {
    const sq_slot& s = sq_[ring_slot(i, sq_.size())];
    if (s.buffer != buffer_pool::npos) fab_->pool->put(s.buffer);
  }
  if (batch_ != nullptr) {
    batch_->wrs.clear();
    return_batch();
  }
  srq_release();
  if (counted_) --fab_->open_connections;
}

void connection_impl::srq_release() noexcept {
  if (!srq_attached_ || qp_ != nullptr) return;
  // The queue pair is gone: nothing of the peer's can take a receive now.
  fab_->srq_detach(qpn_);
  srq_attached_ = false;
  fab_->srq_promised -= static_cast<std::uint64_t>(std::max<std::int64_t>(promised_, 0));
  promised_ = 0;
}

void connection_impl::on_cq_lost(std::error_code ec) noexcept {
  if (setup_holds_qp_) {
    fail(ec);  // (on_connected or on_setup_failed lets the queue pair go)
    return;
  }
  if (qp_ != nullptr) log().debug("connection qp {}: its completion queue is lost: the queue pair goes", qp_num());
  fail_without_queue_pair(ec);
}

void connection_impl::fail_without_queue_pair(std::error_code ec) noexcept {
  drop_queue_pair();
  fail(ec);
  drop_unposted();  // (a closed connection's: fail() did a failed one's)
  return_posted_receives();
}

void connection_impl::drop_queue_pair() noexcept {
  if (qp_ == nullptr) return;
  const transport::qp_counters c = qp_->counters();
  stats_.rnr_naks = c.rnr_naks_sent + c.rnr_naks_received;
  qp_.reset();
}

void connection_impl::return_posted_receives() noexcept {
  for (std::uint64_t i = rq_done_; i < rq_posted_; ++i) fab_->put_buffer(rq_[ring_slot(i, rq_.size())]);
  rq_done_ = rq_posted_;
  srq_release();
}

void connection_impl::prepare() {
  fabric_state& f = *fab_;
  f.refuse_if_cq_lost("a new connection");
  if (f.open_connections >= f.options.max_connections) {
    throw std::system_error(errc::too_many_connections,
                            "fabric: " + std::to_string(f.options.max_connections) + " connections already");
  }
  transport::qp_attributes a;
  a.send_cq = a.recv_cq = f.cq.get();
  a.max_send_wr = opt_.send_queue;
  a.max_recv_wr = opt_.credits;
  srq_ = f.srq != nullptr;
  if (srq_) {
    a.srq = f.srq.get();
    if (f.srq_spare() < fabric_state::kSrqMinCredits) {
      throw std::system_error(errc::no_buffer_space,
                              "fabric: the shared receive queue (srq_buffers " + std::to_string(f.options.srq_buffers) +
                                  ") has " + std::to_string(f.srq_posted) + " receives posted, " +
                                  std::to_string(f.srq_promised) + " of them granted to " +
                                  std::to_string(f.open_connections) + " other connections");
    }
  }
  sge_per_wr_ = std::clamp<std::uint32_t>(f.device->caps().max_sge, 1, static_cast<std::uint32_t>(kMaxGather));
  a.max_send_sge = sge_per_wr_;
  a.max_recv_sge = 1;
  a.max_inline_data = f.inline_cap;
  // With an auth token the peer may touch none of our memory (RDMA WRITE,
  // READ, atomics on any key it knows or guesses) until it has proven the
  // token: handle_auth opens the queue pair then.
  if (f.auth) a.remote_access = transport::access::none;
  qp_ = f.pd->create_qp(a);
  qpn_ = qp_->qp_num();
  if (auto ec = qp_->modify(transport::qp_state::init)) throw std::system_error(ec, "connection: queue pair to init");
  send_base_ = f.reactor->track_persistent(send_op_);
  recv_base_ = f.reactor->track_persistent(recv_op_);
  if (send_base_ == 0 || recv_base_ == 0) {
    throw std::system_error(errc::too_many_connections, "connection: the reactor has no operation slot left");
  }
  if (srq_) {
    f.srq_attach(qpn_, this);
    srq_attached_ = true;
    promised_ = std::min<std::int64_t>(opt_.credits, fabric_state::kSrqMinCredits);  // the hello's credits
    f.srq_promised += static_cast<std::uint64_t>(promised_);
  }
  ++f.open_connections;
  counted_ = true;
  f.add(this);
  registered_ = true;
  const std::size_t q = opt_.send_queue;
  sq_.assign(q, sq_slot{});
  atomic_results_.assign(q, 0);
  atomic_mr_ = f.pd->register_memory(atomic_results_.data(), q * sizeof(std::uint64_t), transport::access::local_write);
  notes_.assign(opt_.credits, buffer_pool::npos);
  stage_control_.assign(q * protocol::kHeaderSize + protocol::kAuthSize, std::byte{0});
  // (A shared receive queue's connection posts no receives of its own.)
  const std::size_t own_receives = srq_ ? 0 : opt_.credits;
  rq_.assign(own_receives, buffer_pool::npos);
  rq_sge_.assign(own_receives, transport::sge{});
  recv_batch_.reserve(own_receives);
  inbox_.assign(opt_.credits, inbox_entry{});
  fins_.reserve(opt_.credits);
  const std::uint64_t max_msg = f.device->caps().max_msg_size;
  fragment_ = max_msg == 0 ? (std::uint64_t{1} << 30) : std::min<std::uint64_t>(max_msg, std::uint64_t{1} << 30);
  if (opt_.fragment_size != 0) fragment_ = std::min<std::uint64_t>(fragment_, opt_.fragment_size);
  eager_limit_ = opt_.eager_limit;
  for (std::uint32_t i = 0; i < (srq_ ? 0u : opt_.credits); ++i) {
    const std::uint32_t b = f.pool->try_get();
    if (b == buffer_pool::npos) {
      throw std::system_error(errc::no_buffer_space, "connection: the buffer pool cannot hold another connection's receives");
    }
    queue_recv(b);
  }
  std::size_t bad = 0;
  if (!recv_batch_.empty()) {
    if (auto ec = qp_->post_recv(recv_batch_, &bad)) throw std::system_error(ec, "connection: posting the receives");
  }
  stats_.recv_posts += recv_batch_.size();
  recv_batch_.clear();
  rq_posted_ = rq_queued_;
  setup_holds_qp_ = true;  // (the caller hands the queue pair to the connect or accept thread now)
  self_ = shared_from_this();
}

void connection_impl::on_connected(const protocol::hello& peer, std::unique_ptr<auth_setup> auth) {
  setup_holds_qp_ = false;
  peer_ = {peer.credits, peer.max_credits, peer.recv_buffer, peer.eager_limit, peer.max_message};
  if (qp_ != nullptr) connected_path_ = qp_->path();
  // What we granted in our hello (fabric_state::local_hello).
  const std::uint32_t granted = srq_ ? std::min<std::uint32_t>(opt_.credits, fabric_state::kSrqMinCredits) : opt_.credits;
  if (auth != nullptr) {
    // Until the peer proves the token it gets one credit (its auth message)
    // and we use one (ours): protocol.hpp.
    auth_ = std::move(auth);
    credits_ += 1;
    peer_view_ += 1;
    withheld_ = granted - 1u;
    fab_->busy();  // the reactor watches for the peer's proof
  } else {
    credits_ += peer.credits;
    peer_view_ += granted;
  }
  eager_limit_ = std::min<std::uint32_t>(opt_.eager_limit, peer.recv_buffer - static_cast<std::uint32_t>(protocol::kHeaderSize));
  // Heartbeats serve the stricter of the two keepalives (the peer's held
  // to our own bounds).
  const auto own = static_cast<std::uint64_t>(opt_.keepalive.count());
  const std::uint64_t theirs =
      peer.keepalive_ms == 0 ? 0 : std::clamp<std::uint64_t>(peer.keepalive_ms, kMinKeepalive, kMaxKeepalive);
  const std::uint64_t strict = own == 0 ? theirs : theirs == 0 ? own : std::min(own, theirs);
  heartbeat_ = std::chrono::milliseconds(strict / 4);
  if (strict != 0 && heartbeat_ < fabric_state::kMinTick) heartbeat_ = fabric_state::kMinTick;
  start_liveness();
  if (state_ == state::failed) {
    // It failed while the setup thread still held the queue pair (a
    // malformed early message): the queue pair goes to error only now.
    // (Or the reactor gave up meanwhile: nothing will poll the flushes, so
    // the queue pair goes.)
    if (fab_->reactor->failed()) {
      drop_queue_pair();
      return_posted_receives();
    } else if (qp_ != nullptr) {
      (void)qp_->modify(transport::qp_state::error);
    }
    end_auth(error_);
    maybe_release_self();
    return;
  }
  if (state_ == state::setup) state_ = state::open;
  // What early messages queued (re-posted receives, credits) waited for the
  // setup thread to let go of the queue pair.
  // (batch_failed_: flush_now fails it; fins_: answers to a withdrawal that came during setup)
  if (!recv_batch_.empty() || queued_sends() != 0 || batch_failed_ || !fins_.empty()) schedule();
  if (credits_ > static_cast<std::int64_t>(peer.max_credits)) {  // returned before the handshake completed here
    log().warn("connection qp {}: the peer returned more credits than its window ({} > {})", qp_num(),
               credits_, peer.max_credits);
    fail(errc::protocol_error);
    return;
  }
  if (auth_ == nullptr && early_auth_ != buffer_pool::npos) {
    log().warn("connection qp {}: the peer sent an auth message to a connection without authentication",
               qp_num());
    fail(errc::protocol_error);
    return;
  }
  if (auth_ != nullptr) {
    if (inbox_tail_ != inbox_head_ || notes_tail_ != notes_head_ || peer_closed_) {
      log().warn("connection qp {}: the peer sent messages before authenticating", qp_num());
      fail(errc::protocol_error);
      return;
    }
    setup_timer_.expires_after(opt_.handshake_timeout);
    setup_timer_.async_wait([w = weak_from_this()](const boost::system::error_code& ec) {
      auto self = w.lock();
      if (ec || self == nullptr || self->auth_ == nullptr) return;
      if (self->state_ == state::failed || self->state_ == state::closed) {
        self->end_auth(self->error_);  // ended some other way: the waiter hears it at the latest now
        return;
      }
      log().warn("connection qp {}: the peer did not authenticate within the handshake timeout ({} ms)",
                 self->qp_num(), self->opt_.handshake_timeout.count());
      self->fail(errc::timed_out);
    });
    if (auth_->exchange.local == auth::role::client && !send_auth(protocol::auth_status::proof)) {
      fail(auth_send_error());
      return;
    }
    if (early_auth_ != buffer_pool::npos) {
      const std::uint32_t b = std::exchange(early_auth_, buffer_pool::npos);
      handle_auth(early_auth_header_, b);
      return;
    }
  }
  log().debug("connection qp {}: open (peer credits {}, receive buffer {}, eager limit {}, max message {})",
              qp_num(), peer.credits, peer.recv_buffer, eager_limit_, peer.max_message);
}

void connection_impl::speak_first() noexcept {
  // (With authentication the proof, sent at once, is the first word. The
  // last credit stays for control messages, as for a heartbeat.)
  if (state_ != state::open || auth_ != nullptr || credits_ < 2) return;
  (void)enqueue_control(protocol::msg_type::credit, 0, 0);
}

void connection_impl::on_setup_failed() noexcept {
  auto keep = shared_from_this();
  setup_holds_qp_ = false;
  state_ = state::failed;
  error_ = errc::not_connected;
  revoke_windows();
  // The queue pair never carried anything: no completion will come for its
  // receives. They return to the pool once it is gone (the device lets go
  // of them then).
  qp_.reset();
  for (std::uint64_t i = rq_done_; i < rq_queued_; ++i) fab_->pool->put(rq_[ring_slot(i, rq_.size())]);
  rq_done_ = rq_posted_ = rq_queued_;
  recv_batch_.clear();
  srq_release();
  if (recv_base_ != 0) fab_->reactor->untrack(recv_base_);
  if (send_base_ != 0) fab_->reactor->untrack(send_base_);
  recv_base_ = send_base_ = 0;
  if (draining_) {  // (a fail() during setup began a drain)
    draining_ = false;
    fab_->idle();
  }
  self_.reset();
}

// ---------------------------------------------------------------- operations

op_node* connection_impl::acquire(op_kind kind) {
  op_node* n = fab_->take_node();
  n->owner = this;
  n->kind = kind;
  n->phase = op_phase::queued;
  n->nbufs = 0;
  n->length = 0;
  n->deadline = {};
  n->dest = {};
  n->cookie = 0;
  n->stalled_credit = n->stalled_buffer = false;
  n->npins = 0;
  n->split_mask = 0;
  n->read_only = false;
  n->prepared = false;
  n->device_mask = 0;
  n->inline_len = 0;
  n->cur_buf = 0;
  n->cur_off = 0;
  n->issued = 0;
  n->remote = {};
  n->operand = n->operand2 = n->result = 0;
  n->value = 0;
  n->note = {};
  fab_->busy();
  return n;
}

void connection_impl::unpin(op_node* n) noexcept {
  for (std::uint8_t i = 0; i < n->npins; ++i) fab_->cache->unpin(*static_cast<registration_cache::entry*>(n->pins[i]));
  n->npins = 0;
}

void connection_impl::drop_source(op_node* n, bool peer_read) noexcept {
  // A rendezvous source the peer may have read (its key went out in a
  // request, and the peer did not answer that it dropped the request
  // unread): a stale duplicate of the peer's READ may still come, while
  // the queue pair can execute one (open or closing; not once it failed or
  // closed: in error, or gone).
  if (peer_read && n->kind == op_kind::send && n->cookie != 0 && n->mr != nullptr &&
      (state_ == state::open || state_ == state::closing) && fab_->device->caps().late_duplicates) {
    fab_->retire_source(std::move(n->mr), std::move(n->large), n->length);
  }
  n->mr.reset();
  n->large.reset();
}

void connection_impl::release(op_node* n) noexcept {
  unpin(n);
  drop_source(n, true);
  for (unsigned i = 0; n->split_mask != 0; ++i, n->split_mask = static_cast<std::uint16_t>(n->split_mask >> 1)) {
    if ((n->split_mask & 1u) != 0) n->split[i].reset();
  }
  n->phase = op_phase::done;
  fab_->give_node(n);
  fab_->idle();
}

void connection_impl::complete(op_node* n, bool post, std::error_code ec, std::size_t size) noexcept {
  n->phase = op_phase::done;
  unpin(n);  // the operation is over for the cache before its handler runs
  switch (n->kind) {
    case op_kind::send:
    case op_kind::receive_buffer:
    case op_kind::put:
    case op_kind::get:
    case op_kind::put_notify: n->handler.complete(post, ec, size); break;
    case op_kind::receive_message: n->handler.complete(post, ec, message{}); break;
    case op_kind::close:
    case op_kind::flush: n->handler.complete(post, ec); break;
    case op_kind::fetch_add:
    case op_kind::compare_swap: n->handler.complete(post, ec, ec ? std::uint64_t{0} : n->result); break;
    case op_kind::receive_notification: n->handler.complete(post, ec, ec ? notification{} : n->note); break;
    case op_kind::register_memory:
      // Its bind is over (completed or flushed): a revoke that came meanwhile
      // destroys the window now. On error the region (n->mr) goes with the
      // node: revoked, then deregistered.
      if (n->mr != nullptr) static_cast<scoped_region*>(n->mr.get())->slot().end_bind();
      n->handler.complete(post, ec, ec ? memory_region{} : memory_region(std::move(n->mr)));
      break;
  }
  release(n);
}

void connection_impl::complete_message(op_node* n, bool post, message m) noexcept {
  n->phase = op_phase::done;
  n->handler.complete(post, std::error_code{}, std::move(m));
  release(n);
}

// start_send and start_receive run no handler inline (completions are
// posted): the caller's connection handle keeps *this alive throughout.
void connection_impl::start_send(op_node* n) {
  if (refuses_sends()) {
    complete(n, true, send_refusal());
    return;
  }
  // GPU device memory is copied out (eager) or registered as such
  // (rendezvous); managed memory is refused (it migrates). Asked once per
  // message, and only in a process with CUDA.
  if (n->nbufs != 0xff && cuda::detail::any_gpu_memory()) {
    for (std::uint8_t i = 0; i < n->nbufs; ++i) {
      if (n->bufs[i].size() == 0) continue;
      const memory_kind k = cuda::detail::kind_here(n->bufs[i].data());
      if (k == memory_kind::cuda_managed) {
        complete(n, true, errc::not_supported);
        return;
      }
      if (k == memory_kind::cuda_device) n->device_mask = static_cast<std::uint16_t>(n->device_mask | (1u << i));
    }
  }
  if (staged_ != 0) {
    behind_staged_.push_back(n);  // after the staged transfers (release_held)
    return;
  }
  queue_send(n);
}

std::error_code connection_impl::send_refusal() const noexcept {
  if (const std::error_code ec = ended_refusal()) return ec;
  if (close_op_ != nullptr || close_waiting_ != nullptr) return errc::connection_closed;
  return {};
}

std::error_code connection_impl::ended_refusal() const noexcept {
  if (ended()) {
    // (never empty once ended: refuses_sends() and ended() promise a refusal)
    return state_ == state::failed && error_ && error_ != errc::connection_closed ? error_ : errc::connection_closed;
  }
  return {};
}

void connection_impl::queue_send(op_node* n) {
  send_waiting_.push_back(n);
  if (state_ == state::setup) return;  // started once connected
  progress_sends(true);
}

void connection_impl::start_receive(op_node* n) {
  if (n->kind == op_kind::receive_buffer && n->dest.size() != 0 && cuda::detail::any_gpu_memory()) {
    // GPU device memory: eager messages are copied in, rendezvous ones
    // read into it as registered device memory; managed memory is refused.
    const memory_kind k = cuda::detail::kind_here(n->dest.data());
    if (k == memory_kind::cuda_managed) {
      complete(n, true, errc::not_supported);
      return;
    }
    if (k == memory_kind::cuda_device) n->device_mask = 1;
  }
  recv_waiting_.push_back(n);
  deliver(true);
}

void connection_impl::start_close(op_node* n) {
  auto keep = shared_from_this();
  if (close_op_ != nullptr) {
    complete(n, true, errc::invalid_state);
    return;
  }
  if (state_ == state::closed || (state_ == state::failed && error_ == errc::connection_closed)) {
    complete(n, true, {});
    return;
  }
  if (state_ == state::failed) {
    complete(n, true, error_);
    return;
  }
  if (staged_ != 0) {
    // Staged transfers started before the close still queue their chunks:
    // the close goes once they are done (complete_staged).
    if (close_waiting_ != nullptr) {
      complete(n, true, errc::invalid_state);
      return;
    }
    close_waiting_ = n;
    return;
  }
  close_op_ = n;
  if (state_ == state::open || state_ == state::setup) state_ = state::closing;
  if (peer_closed_) {
    // The peer closed first: it sends nothing more and tears down.
    close_op_ = nullptr;
    on_close_acked();
    complete(n, true, {});
    return;
  }
  progress_sends(true);
  schedule();
}

void connection_impl::cancel(op_node* n, asio::cancellation_type /*type*/) {
  auto keep = shared_from_this();
  // A rendezvous send whose request is out: the peer is asked to drop it.
  if (n->kind == op_kind::send && n->phase == op_phase::posted && n->cookie != 0 && n->mr != nullptr) {
    withdraw(n);
    return;
  }
  // A queued operation is in its kind's waiting list; any other is on the
  // wire (or done) and runs to completion.
  if (n->phase != op_phase::queued) return;
  for (const auto& w : staging_now_) {
    const auto t = w.lock();  // (held: cancel() changes staging_now_; the loop ends with it)
    if (t == nullptr || t->parent() != n) continue;
    (void)t->cancel(kCancelled);  // (false: its first chunk started meanwhile; it runs to completion)
    return;
  }
  if (n->kind == op_kind::send || is_onesided(n->kind)) {
    for (op_node* h = behind_staged_.head; h != nullptr; h = h->next) {
      if (h != n) continue;
      behind_staged_.remove(n);  // behind a staged transfer: never started
      complete(n, true, kCancelled);
      return;
    }
    if (stages(n)) return;  // a staged transfer that ended meanwhile: in no list
    const bool was_head = send_waiting_.head == n;
    send_waiting_.remove(n);
    complete(n, true, kCancelled);
    if (was_head) progress_sends(true);
  } else if (n->kind == op_kind::receive_message || n->kind == op_kind::receive_buffer) {
    recv_waiting_.remove(n);
    complete(n, true, kCancelled);
  } else if (n->kind == op_kind::receive_notification) {
    note_waiting_.remove(n);
    complete(n, true, kCancelled);
  }
}

void connection_impl::abort() noexcept {
  auto keep = shared_from_this();
  if (state_ == state::failed || state_ == state::closed) return;
  fail(errc::connection_closed);
}

void connection_impl::on_handle_released() noexcept {
  auto keep = shared_from_this();
  if (state_ == state::setup) return;  // the setup path owns it until it ends
  if (state_ != state::failed && state_ != state::closed) fail(errc::connection_closed);
  if (state_ == state::closed && qp_ != nullptr && qp_->state() != transport::qp_state::error) {
    (void)qp_->modify(transport::qp_state::error);
  }
  maybe_release_self();
}

connection_stats connection_impl::stats() const noexcept {
  connection_stats s = stats_;
  if (qp_ != nullptr) {
    const auto c = qp_->counters();
    s.rnr_naks = c.rnr_naks_sent + c.rnr_naks_received;
  }
  return s;
}

// ---------------------------------------------------------------- liveness

// Silence and idleness count from now; the fabric's tick comes often
// enough for both the heartbeat and the keepalive check.
void connection_impl::start_liveness() noexcept {
  last_rx_ = last_tx_ = std::chrono::steady_clock::now();
  if (heartbeat_.count() > 0) fab_->want_tick(heartbeat_);
  if (opt_.keepalive.count() > 0) fab_->want_tick(opt_.keepalive / 8);
}

std::chrono::milliseconds connection_impl::liveness(std::chrono::steady_clock::time_point now) noexcept {
  const state was = state_;
  const std::chrono::milliseconds withdrawals = watch_withdrawals(now);
  if (state_ != was) return fabric_state::kMaxTick;  // (it failed the connection)
  return std::max(fabric_state::kMinTick, std::min(withdrawals, watch_peer(now)));
}

std::chrono::milliseconds connection_impl::watch_withdrawals(std::chrono::steady_clock::time_point now) noexcept {
  std::chrono::milliseconds next = fabric_state::kMaxTick;
  if (withdrawing_ == 0 || (state_ != state::open && state_ != state::closing)) return next;
  const std::chrono::milliseconds grace = withdraw_grace();
  std::uint32_t asked = 0;
  for (op_node* p = active_.head; p != nullptr; p = p->next) {
    if (p->kind != op_kind::send || p->operand == 0 || p->operand == 3) continue;
    ++asked;
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - p->deadline);
    if (waited >= grace) {
      // Its memory stays readable until the queue pair goes: failing the
      // connection is what ends the send.
      log().warn("connection qp {}: the peer did not answer the withdrawal of a {}-byte rendezvous message in {} ms "
                 "({}): failing the connection",
                 qp_num(), p->length, waited.count(),
                 p->operand == 1 ? "not sent: no credit" : "sent");
      auto keep = shared_from_this();
      fail(errc::timed_out);
      return fabric_state::kMaxTick;
    }
    next = std::min(next, grace - waited);
  }
  withdrawing_ = asked;
  return next;
}

std::chrono::milliseconds connection_impl::watch_peer(std::chrono::steady_clock::time_point now) noexcept {
  constexpr std::chrono::milliseconds idle = fabric_state::kMaxTick;
  // On a shared receive queue, a queue pair can fail with no completion at
  // all (no receive of its own to flush, nothing sent): its state tells.
  // (At most once a second: on verbs asking is a system call.)
  if (srq_ && qp_ != nullptr && (state_ == state::open || state_ == state::closing) &&
      now - srq_state_checked_ >= std::chrono::seconds(1) &&
      (srq_state_checked_ = now, qp_->state() == transport::qp_state::error)) {
    auto keep = shared_from_this();
    on_receive_failed({.wr_id = 0, .status = transport::wc_status::work_request_flushed, .qp_num = qpn_});
    return idle;
  }
  // The marker behind an unsignaled tail, posted once the queue pair was in
  // error (cover_tail), has not come back although everything before the
  // tail has: the provider completes no request posted in error (siw's
  // user-space queue pairs). What is left holds nothing (inline messages,
  // the zero-length marker), so it retires unanswered after the grace.
  if (cover_waits_ && sq_retired_ < sq_posted_) {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - cover_at_);
    if (sq_retired_ < cover_from_ || waited < kPeerCloseGrace) {
      return std::max(fabric_state::kMinTick, kPeerCloseGrace - std::min(waited, kPeerCloseGrace));
    }
    log().warn("connection qp {}: the marker behind {} unsignaled requests did not come back in {} ms after the "
               "move to error: they retire unanswered",
               qp_num(), sq_posted_ - 1 - cover_from_, waited.count());
    cover_waits_ = false;
    asio::post(fab_->io, [self = shared_from_this()] {
      if (self->sq_retired_ >= self->sq_posted_) return;  // (it came back meanwhile)
      self->settle_tail_ = true;
      self->sq_signaled_end_ = self->cover_from_;  // (the marker is part of what retires unanswered)
      self->settle_tail(false);
      self->maybe_release_self();
    });
    return idle;
  }
  // The peer closed and our work requests are still unanswered: once the
  // grace runs out nothing will answer them (its queue pair is in error), so
  // the connection closes as when our close is acknowledged: the queue pair
  // goes to error and they come back flushed. (Posted: the handlers that
  // ends run outside this tick's walk over the connections. An unsignaled
  // tail past sq_signaled_end_ waits for no answer: flush_now.)
  if (peer_closed_ && qp_ != nullptr && (state_ == state::open || state_ == state::closing) &&
      !flushed_after_peer_close_ && sq_retired_ < sq_signaled_end_) {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - peer_closed_at_);
    if (waited < kPeerCloseGrace) return std::max(fabric_state::kMinTick, kPeerCloseGrace - waited);
    log().info("connection qp {}: {} work requests still unanswered {} ms after the peer's close: flushing them",
               qp_num(), sq_posted_ - sq_retired_, waited.count());
    flushed_after_peer_close_ = true;
    asio::post(fab_->io, [self = shared_from_this()] {
      if (self->state_ == state::open || self->state_ == state::closing) self->on_close_acked();
    });
    return idle;
  }
  // Setup and authentication have their own deadlines; an ended connection
  // has nothing to watch.
  if ((state_ != state::open && state_ != state::closing) || auth_ != nullptr || qp_ == nullptr || peer_closed_) {
    return idle;
  }
  // What the peer's device answered since the last tick: a completion of
  // ours (an RC request completes once the responder acknowledged it).
  const bool acked = sq_retired_ != ack_mark_;
  ack_mark_ = sq_retired_;
  if (rx_count_ != rx_mark_) {
    rx_mark_ = rx_count_;
    last_rx_ = now;
  } else if (peer_view_ <= 1 && opt_.keepalive.count() > 0) {
    // The peer cannot speak: it holds at most the credit kept for control
    // messages (our application has not taken its messages, or we owe it
    // credits we have none to return with: its own application holds
    // ours, which an honest peer may do for as long as it likes). Its
    // device still answers: an acknowledged request of ours counts as word
    // from it, and when none is due a probe asks, a zero-length RDMA WRITE
    // (no credit, no receive, no memory named; nothing reaches the peer's
    // application). A frozen process or a host gone answers nothing; a
    // hostile peer's device answers, so it can still hold the connection
    // open until our side closes it (README "Liveness").
    if (acked) {
      last_rx_ = now;
    } else if (now - last_rx_ >= opt_.keepalive / 4 && !close_sent_) {
      probe();
    }
  }
  if (tx_count_ != tx_mark_) {
    tx_mark_ = tx_count_;
    last_tx_ = now;
  }
  // Silent for 7/8 of keepalive (ticks come every keepalive/8 at most, so
  // it is noticed within keepalive); the peer's heartbeats come at least
  // every keepalive/2.
  const auto keepalive = opt_.keepalive;
  if (keepalive.count() > 0 && now - last_rx_ >= keepalive * 7 / 8) {
    log().warn("connection qp {}: the peer has been silent for {} ms (keepalive {} ms): failing the connection",
               qp_num(), std::chrono::duration_cast<std::chrono::milliseconds>(now - last_rx_).count(),
               keepalive.count());
    auto keep = shared_from_this();
    fail(errc::timed_out);
    return idle;
  }
  if (heartbeat_.count() == 0) return keepalive.count() > 0 ? std::max(fabric_state::kMinTick, keepalive / 8) : idle;
  if (now - last_tx_ >= heartbeat_ && !close_sent_ && (credits_ >= 2 || owed_ > 0)) {
    // A credit message returns what we owe and shows we are alive. The last
    // credit stays for control messages unless the heartbeat returns some:
    // two sides both down to it would otherwise spend it at once and be
    // left unable to return credits.
    if (enqueue_control(protocol::msg_type::credit, 0, 0)) {
      ++stats_.heartbeats;
      --stats_.credit_messages;  // counted as a heartbeat, not a credit update
      last_tx_ = now;
      tx_mark_ = tx_count_;
    }
  }
  const auto next = keepalive.count() > 0 ? std::min(heartbeat_, keepalive / 8) : heartbeat_;
  return std::max(fabric_state::kMinTick, std::min(next, idle));
}

// ---------------------------------------------------------------- ending

void connection_impl::fail(std::error_code ec) noexcept {
  if (state_ == state::failed || state_ == state::closed) return;
  const state was = state_;
  state_ = state::failed;
  error_ = peer_closed_ || !ec ? std::error_code(errc::connection_closed) : ec;  // (never empty once failed)
  if (error_ != errc::connection_closed) fab_->count_failure(error_);
  revoke_windows();
  if (ec == errc::connection_closed) {
    log().debug("connection qp {}: aborted", qp_num());
  } else {
    log().warn("connection qp {}: failed in state {}: {}", qp_num(), static_cast<int>(was),
               ec.message());
  }
  // During setup the connect/accept thread owns the queue pair (provider
  // contract): on_connected moves it to error.
  if (qp_ != nullptr && was != state::setup) (void)qp_->modify(transport::qp_state::error);
  drop_unposted();
  begin_drain();
  drop_fins();
  end_waiting_sends(error_);
  while (op_node* n = behind_staged_.pop_front()) complete(n, true, error_);  // never started (issued after those)
  end_waiting_staged(error_);
  while (op_node* n = at_doorbell_.pop_front()) complete(n, true, error_);  // dropped unposted
  end_rendezvous_sends(error_);
  park_partial_reads();  // their last fragment will never be posted
  if (close_op_ != nullptr) {
    op_node* n = close_op_;
    close_op_ = nullptr;
    complete(n, true, error_);
  }
  while (op_node* n = flushes_.pop_front()) complete(n, true, error_);
  deliver(true);
  end_auth(error_);
}

bool connection_impl::fail_unless_ending(const transport::completion& wc, std::string_view queue) noexcept {
  const bool expected = state_ == state::failed || state_ == state::closed || peer_closed_;
  if (!expected) {
    log().warn("connection qp {}: {} completion {}: failing the connection", qp_num(), queue,
               transport::to_string(wc.status));
    fail(make_error_code(wc.status));
  }
  return expected;
}

// Staged transfers that wait for a first staging buffer end now (one under
// way ends as its next chunk is refused).
void connection_impl::end_waiting_staged(std::error_code ec) noexcept {
  for (std::size_t i = staging_now_.size(); i-- > 0;) {
    if (i >= staging_now_.size()) continue;  // (cancel() erases from it)
    if (const auto t = staging_now_[i].lock()) (void)t->cancel(ec);
  }
}

void connection_impl::end_waiting_sends(std::error_code ec) noexcept {
  while (op_node* n = send_waiting_.pop_front()) {
    if (n->phase == op_phase::posted) {
      park(n);  // started in part: it ends when its posted parts are back
      continue;
    }
    complete(n, true, ec);
  }
}

void connection_impl::drop_fins() noexcept {
  for (const fin_entry& f : fins_) {
    if (f.held) release_received(f.word);
  }
  fins_.clear();
}

void connection_impl::end_rendezvous_sends(std::error_code ec) noexcept {
  withdrawing_ = withdraw_unsent_ = 0;
  for (op_node* n = active_.head; n != nullptr;) {
    op_node* next = n->next;
    if (n->kind == op_kind::send) {  // rendezvous sends: the fin will never come
      active_.remove(n);
      complete(n, true, ec);
    }
    n = next;
  }
}

void connection_impl::begin_drain() noexcept {
  cover_tail();  // (the queue pair is in error now)
  if (draining_ || (sq_retired_ == sq_posted_ && rq_done_ == rq_posted_)) return;
  draining_ = true;
  fab_->busy();
}

void connection_impl::abandon() noexcept {
  if (self_ == nullptr || setup_holds_qp_) return;  // (setup: the helper's ending releases it)
  auto keep = shared_from_this();
  // The queue pair goes before any operation ends: the device lets go of
  // every buffer posted. (The verbs provider keeps one that shares a
  // receive queue, in error, until the shared queue goes with the fabric's
  // state: in error it places no more data.)
  log().debug("connection qp {}: abandoned by its fabric's destructor (its flushes will not be polled)", qp_num());
  drop_queue_pair();
  fail(errc::connection_closed);  // (nothing when failed or closed already)
  drop_unposted();                // (a closed connection's; fail() dropped a failed one's)
  const std::error_code ec = error_ ? error_ : std::error_code(errc::connection_closed);
  while (sq_retired_ < sq_posted_) {
    const sq_slot s = std::exchange(sq_[ring_slot(sq_retired_, sq_.size())], {});
    ++sq_retired_;
    if (s.buffer != buffer_pool::npos) fab_->pool->put(s.buffer);
    if (s.signaled) fab_->idle();
    if (s.op == nullptr) continue;
    if (s.kind == slot_kind::read_last) {
      active_.remove(s.op);
      if (s.op->kind == op_kind::receive_message) rendezvous_held_ -= s.op->length;
      complete(s.op, true, ec);
    } else if (s.kind == slot_kind::onesided_last) {
      complete(s.op, true, ec);
    }
  }
  complete_parked(true);
  end_all_waiting(ec);  // (a closed connection's flush waiting for a target that will never retire)
  for (std::uint64_t i = rq_done_; i < rq_posted_; ++i) fab_->pool->put(rq_[ring_slot(i, rq_.size())]);
  rq_done_ = rq_posted_;
  srq_release();
  if (send_base_ != 0) fab_->reactor->untrack(send_base_);
  if (recv_base_ != 0) fab_->reactor->untrack(recv_base_);
  send_base_ = recv_base_ = 0;
  maybe_release_self();
}

// Whatever still waits ends with ec, posted: nothing is left to complete it.
void connection_impl::end_all_waiting(std::error_code ec) noexcept {
  for (op_list* l : {&send_waiting_, &behind_staged_, &at_doorbell_, &recv_waiting_, &note_waiting_, &active_,
                     &flushes_, &parked_}) {
    while (op_node* n = l->pop_front()) complete(n, true, ec);
  }
  if (op_node* n = std::exchange(close_waiting_, nullptr)) complete(n, true, ec);
}

void connection_impl::maybe_release_self() noexcept {
  if (self_ == nullptr) return;
  if (sq_retired_ != sq_posted_ || rq_done_ != rq_posted_) return;
  if (state_ != state::failed && state_ != state::closed) return;
  if (draining_) {
    draining_ = false;
    fab_->idle();
  }
  self_.reset();  // the caller holds a reference until it returns
}

// ---------------------------------------------------------------- free functions for the templates

op_node* acquire_node(connection_impl& c, op_kind kind) { return c.acquire(kind); }
asio::io_context::executor_type io_executor(const connection_impl& c) noexcept {
  return const_cast<connection_impl&>(c).fabric().io.get_executor();
}
void cancel_node(void* node, asio::cancellation_type type) {
  auto* n = static_cast<op_node*>(node);
  n->owner->cancel(n, type);
}
void start_send(connection_impl& c, op_node* n) { c.issue(n, &connection_impl::start_send); }
void start_receive(connection_impl& c, op_node* n) { c.start_receive(n); }
void start_close(connection_impl& c, op_node* n) { c.start_close(n); }
void start_onesided(connection_impl& c, op_node* n) { c.issue(n, &connection_impl::start_onesided); }

void set_local(op_node& n, std::span<const local_range> ranges) noexcept {
  std::size_t i = 0;
  for (const local_range& r : ranges) {
    if (r.size() == 0) continue;
    if (i == kMaxGather) {
      n.nbufs = 0xff;
      return;
    }
    if (r.size() > ~std::uintptr_t{0} - reinterpret_cast<std::uintptr_t>(r.data()) || !add_length(n.length, r.size())) {
      n.nbufs = 0xff;
      return;
    }
    n.bufs[i] = asio::const_buffer(r.data(), r.size());
    n.regions[i] = r.region();
    n.read_only = n.read_only || r.read_only();
    ++i;
  }
  n.nbufs = static_cast<std::uint8_t>(i);
}

}  // namespace anydoor::detail

namespace anydoor {

// ---------------------------------------------------------------- message

message::message() noexcept = default;
message::message(message&& o) noexcept
    : owner_(std::move(o.owner_)), data_(o.data_), size_(o.size_), buffer_(o.buffer_), large_(std::move(o.large_)) {
  o.data_ = nullptr;
  o.size_ = 0;
  o.buffer_ = 0xffffffffu;
}
message& message::operator=(message&& o) noexcept {
  if (this != &o) {
    release();
    owner_ = std::move(o.owner_);
    data_ = o.data_;
    size_ = o.size_;
    buffer_ = o.buffer_;
    large_ = std::move(o.large_);
    o.data_ = nullptr;
    o.size_ = 0;
    o.buffer_ = 0xffffffffu;
  }
  return *this;
}
message::~message() {
  // (Most messages destroyed are moved-from husks: nothing to give back.)
  if (owner_ != nullptr || large_ != nullptr) release();
}

void message::release() noexcept {
  // A rendezvous message's block is kept for the next one, on the fabric's
  // thread only (elsewhere it is freed here, its registration first).
  if (large_ != nullptr && owner_ != nullptr && owner_->fabric().io.get_executor().running_in_this_thread()) {
    owner_->fabric().keep_block(std::move(large_));
  }
  large_.reset();
  if (owner_ != nullptr && buffer_ != 0xffffffffu) owner_->return_buffer(buffer_);
  owner_.reset();
  buffer_ = 0xffffffffu;
  data_ = nullptr;
  size_ = 0;
}

// ---------------------------------------------------------------- connection

connection::connection() noexcept = default;
connection::connection(std::shared_ptr<detail::connection_impl> impl) noexcept : impl_(std::move(impl)) {}
connection::connection(connection&&) noexcept = default;
connection& connection::operator=(connection&& o) noexcept {
  if (this != &o) {
    if (impl_ != nullptr) impl_->on_handle_released();
    impl_ = std::move(o.impl_);
  }
  return *this;
}
connection::~connection() {
  if (impl_ != nullptr) impl_->on_handle_released();
}

asio::io_context::executor_type connection::get_executor() const {
  if (!impl_) throw std::system_error(make_error_code(errc::not_connected), "connection::get_executor: empty");
  return detail::io_executor(*impl_);
}

bool connection::is_open() const noexcept { return impl_ != nullptr && impl_->is_open(); }
void connection::abort() noexcept {
  if (impl_ != nullptr) impl_->abort();
}
connection_stats connection::stats() const noexcept { return impl_ ? impl_->stats() : connection_stats{}; }
transport::path_info connection::path() const noexcept { return impl_ ? impl_->path() : transport::path_info{}; }
const peer_parameters& connection::peer() const noexcept {
  static const peer_parameters none{};
  return impl_ ? impl_->peer() : none;
}
std::uint32_t connection::eager_limit() const noexcept { return impl_ ? impl_->send_eager_limit() : 0; }

}  // namespace anydoor
