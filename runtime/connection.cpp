#include "connection_impl.hpp"

#include <anydoor/error.hpp>

#include "log.hpp"
#include "registration_cache.hpp"

#include <algorithm>
#include <cstring>
#include <utility>

namespace anydoor::detail {

namespace {
constexpr std::uint32_t kTagMask = 0x7fffffffu;
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
    : fab_(std::move(fab)), opt_(fab_->options.connection), buffer_timer_(fab_->io) {
  send_op_.c = this;
  recv_op_.c = this;
}

connection_impl::~connection_impl() {
  buffer_timer_.cancel();
  // Normally empty: flush() or fail() completes them within the pass.
  while (op_node* n = at_doorbell_.pop_front()) complete(n, true, errc::connection_closed);
  while (op_node* n = parked_.pop_front()) complete(n, true, errc::connection_closed);
  if (send_base_ != 0) fab_->reactor->untrack(send_base_);
  if (recv_base_ != 0) fab_->reactor->untrack(recv_base_);
  fab_->forget(this);
  // Buffers still posted when the queue pair goes away (it never connected,
  // or the peer tore it down with nothing flushed) return to the pool.
  for (std::uint64_t i = rq_done_; i < rq_queued_; ++i) fab_->pool->put(rq_[i % rq_.size()]);
  for (std::uint64_t i = inbox_head_; i < inbox_tail_; ++i) fab_->pool->put(inbox_[i % inbox_.size()].buffer);
  for (std::uint64_t i = notes_head_; i < notes_tail_; ++i) fab_->pool->put(notes_[i % notes_.size()].buffer);
  for (std::uint64_t i = sq_retired_; i < sq_queued_; ++i) {
    const sq_slot& s = sq_[i % sq_.size()];
    if (s.buffer != buffer_pool::npos) fab_->pool->put(s.buffer);
  }
  qp_.reset();
  if (counted_) --fab_->open_connections;
}

void connection_impl::prepare() {
  fabric_state& f = *fab_;
  if (f.open_connections >= f.options.max_connections) {
    throw std::system_error(errc::too_many_connections,
                            "fabric: " + std::to_string(f.options.max_connections) + " connections already");
  }
  transport::qp_attributes a;
  a.send_cq = a.recv_cq = f.cq.get();
  a.max_send_wr = opt_.send_queue;
  a.max_recv_wr = opt_.credits;
  sge_per_wr_ = std::clamp<std::uint32_t>(f.device->caps().max_sge, 1, static_cast<std::uint32_t>(kMaxGather));
  a.max_send_sge = sge_per_wr_;
  a.max_recv_sge = 1;
  a.max_inline_data = f.inline_cap;
  qp_ = f.pd->create_qp(a);
  if (auto ec = qp_->modify(transport::qp_state::init)) throw std::system_error(ec, "connection: queue pair to init");
  send_base_ = f.reactor->track_persistent(send_op_);
  recv_base_ = f.reactor->track_persistent(recv_op_);
  if (send_base_ == 0 || recv_base_ == 0) {
    throw std::system_error(errc::too_many_connections, "connection: the reactor has no operation slot left");
  }
  ++f.open_connections;
  counted_ = true;
  const std::size_t q = opt_.send_queue;
  sq_.assign(q, sq_slot{});
  sq_sge_.assign(q * sge_per_wr_, transport::sge{});
  atomic_results_.assign(q, 0);
  atomic_mr_ = f.pd->register_memory(atomic_results_.data(), q * sizeof(std::uint64_t), transport::access::local_write);
  notes_.assign(opt_.credits, note_entry{});
  inline_stage_.assign(q * f.inline_cap, std::byte{0});
  batch_.reserve(q);
  rq_.assign(opt_.credits, buffer_pool::npos);
  rq_sge_.assign(opt_.credits, transport::sge{});
  recv_batch_.reserve(opt_.credits);
  inbox_.assign(opt_.credits, inbox_entry{});
  fins_.reserve(opt_.credits);
  const std::uint64_t max_msg = f.device->caps().max_msg_size;
  fragment_ = max_msg == 0 ? (std::uint64_t{1} << 30) : std::min<std::uint64_t>(max_msg, std::uint64_t{1} << 30);
  if (opt_.fragment_size != 0) fragment_ = std::min<std::uint64_t>(fragment_, opt_.fragment_size);
  eager_limit_ = opt_.eager_limit;
  for (std::uint32_t i = 0; i < opt_.credits; ++i) {
    const std::uint32_t b = f.pool->try_get();
    if (b == buffer_pool::npos) {
      throw std::system_error(errc::no_buffer_space, "connection: the buffer pool cannot hold another connection's receives");
    }
    queue_recv(b);
  }
  std::size_t bad = 0;
  if (auto ec = qp_->post_recv(recv_batch_, &bad)) throw std::system_error(ec, "connection: posting the receives");
  stats_.recv_posts += recv_batch_.size();
  recv_batch_.clear();
  rq_posted_ = rq_queued_;
  self_ = shared_from_this();
}

void connection_impl::on_connected(const protocol::hello& peer) {
  peer_ = {peer.credits, peer.recv_buffer, peer.eager_limit, peer.max_message};
  credits_ += peer.credits;
  peer_view_ += opt_.credits;
  eager_limit_ = std::min<std::uint32_t>(opt_.eager_limit, peer.recv_buffer - static_cast<std::uint32_t>(protocol::kHeaderSize));
  if (state_ == state::failed) {
    // It failed while the setup thread still held the queue pair (a
    // malformed early message): the queue pair goes to error only now.
    if (qp_ != nullptr) (void)qp_->modify(transport::qp_state::error);
    return;
  }
  if (state_ == state::setup) state_ = state::open;
  // What early messages queued (re-posted receives, credits) waited for the
  // setup thread to let go of the queue pair.
  if (!recv_batch_.empty() || !batch_.empty()) schedule();
  if (credits_ > static_cast<std::int64_t>(peer.credits)) {  // returned before the handshake completed here
    log().warn("connection qp {}: the peer returned more credits than it has receives ({} > {})", qp_->qp_num(),
               credits_, peer.credits);
    fail(errc::protocol_error);
    return;
  }
  log().debug("connection qp {}: open (peer credits {}, receive buffer {}, eager limit {}, max message {})",
              qp_->qp_num(), peer.credits, peer.recv_buffer, eager_limit_, peer.max_message);
}

void connection_impl::on_setup_failed() noexcept {
  auto keep = shared_from_this();
  state_ = state::failed;
  error_ = errc::not_connected;
  // The queue pair never carried anything: no completion will come for its
  // receives. Destroying it returns them (see the destructor).
  for (std::uint64_t i = rq_done_; i < rq_queued_; ++i) fab_->pool->put(rq_[i % rq_.size()]);
  rq_done_ = rq_posted_ = rq_queued_;
  recv_batch_.clear();
  qp_.reset();
  if (recv_base_ != 0) fab_->reactor->untrack(recv_base_);
  if (send_base_ != 0) fab_->reactor->untrack(send_base_);
  recv_base_ = send_base_ = 0;
  self_.reset();
}

// ---------------------------------------------------------------- operations

op_node* connection_impl::acquire(op_kind kind) {
  op_node* n;
  if (free_nodes_.empty()) {
    all_nodes_.push_back(std::make_unique<op_node>());
    n = all_nodes_.back().get();
    free_nodes_.reserve(all_nodes_.size());
  } else {
    n = free_nodes_.back();
    free_nodes_.pop_back();
  }
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
  n->read_only = false;
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

void connection_impl::release(op_node* n) noexcept {
  unpin(n);
  n->mr.reset();
  n->large.reset();
  n->phase = op_phase::done;
  free_nodes_.push_back(n);  // capacity reserved in acquire
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
  if (state_ == state::failed || state_ == state::closed || peer_closed_ || close_op_ != nullptr) {
    complete(n, true, state_ == state::failed && error_ != errc::connection_closed ? error_ : errc::connection_closed);
    return;
  }
  send_waiting_.push_back(n);
  if (state_ == state::setup) return;  // started once connected
  progress_sends(true);
}

void connection_impl::start_receive(op_node* n) {
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
  // A queued operation is in its kind's waiting list; any other is on the
  // wire (or done) and runs to completion.
  if (n->phase != op_phase::queued) return;
  if (n->kind == op_kind::send || is_onesided(n->kind)) {
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

// ---------------------------------------------------------------- sending

std::uint32_t connection_impl::sq_free() const noexcept {
  return static_cast<std::uint32_t>(sq_.size() - (sq_queued_ - sq_retired_));
}

std::uint16_t connection_impl::take_owed() noexcept {
  const auto n = static_cast<std::uint16_t>(std::min<std::uint32_t>(owed_, 0xffff));
  owed_ -= n;
  peer_view_ += n;
  return n;
}

transport::work_request& connection_impl::next_wr(slot_kind kind, std::uint32_t buffer, op_node* op) noexcept {
  const std::size_t slot = sq_queued_ % sq_.size();
  sq_[slot] = {buffer, kind, op, false};
  transport::work_request& wr = batch_.emplace_back();  // capacity = send_queue >= queued
  wr.wr_id = reactor::persistent_id(send_base_, static_cast<std::uint32_t>(sq_queued_ & kTagMask));
  wr.sg_list = {slot_sges(slot), 1};
  ++sq_queued_;
  return wr;  // the caller schedules the flush (after posting its completion)
}

connection_impl::start_result connection_impl::try_start(op_node* n, bool post) noexcept {
  if (is_onesided(n->kind)) return try_start_onesided(n, post);
  if (n->nbufs == 0xff) {
    send_waiting_.remove(n);
    complete(n, post, errc::invalid_argument);
    return start_result::started;
  }
  if (n->length > peer_.max_message) {
    send_waiting_.remove(n);
    complete(n, post, errc::message_size);
    return start_result::started;
  }
  const bool eager = n->length <= eager_limit_;
  if (!eager && n->nbufs != 1) {
    send_waiting_.remove(n);
    complete(n, post, errc::invalid_argument);
    return start_result::started;
  }
  if (credits_ < 2) return credit_stall(n);
  if (sq_free() == 0) return start_result::blocked_queue;
  const std::size_t wire = eager ? protocol::kHeaderSize + n->length : protocol::kRtsSize;
  const bool inl = wire <= fab_->inline_cap;
  std::uint32_t buf = buffer_pool::npos;
  if (!inl && !take_send_buffer(n, buf)) return start_result::blocked_buffer;
  if (!eager) {
    try {
      n->mr = fab_->pd->register_memory(const_cast<void*>(n->bufs[0].data()), n->bufs[0].size(),
                                        transport::access::remote_read);
    } catch (const std::system_error& e) {
      log().warn("connection: registering a {}-byte rendezvous source failed: {}", n->length, e.what());
      if (buf != buffer_pool::npos) fab_->put_buffer(buf);
      send_waiting_.remove(n);
      complete(n, post, e.code());
      return start_result::started;
    }
  }
  if (n->stalled_buffer && buffer_timer_armed_) buffer_timer_.cancel();
  transport::work_request& wr = next_wr(slot_kind::message, buf, nullptr);
  const std::size_t slot = (sq_queued_ - 1) % sq_.size();
  std::byte* out = inl ? inline_stage_.data() + slot * fab_->inline_cap : fab_->pool->data(buf);
  --credits_;
  protocol::header h{eager ? protocol::msg_type::eager : protocol::msg_type::rts, 0, take_owed(), 0};
  protocol::encode(h, out);
  if (eager) {
    std::byte* p = out + protocol::kHeaderSize;
    for (std::uint8_t i = 0; i < n->nbufs; ++i) {
      std::memcpy(p, n->bufs[i].data(), n->bufs[i].size());
      p += n->bufs[i].size();
    }
  } else {
    n->cookie = next_cookie_++;
    if (next_cookie_ == 0) next_cookie_ = 1;
    protocol::encode(protocol::rts_body{n->length, reinterpret_cast<std::uint64_t>(n->bufs[0].data()), n->mr->rkey(),
                                        n->cookie},
                     out + protocol::kHeaderSize);
  }
  *slot_sges(slot) = inl ? transport::sge{reinterpret_cast<std::uint64_t>(out), static_cast<std::uint32_t>(wire), 0}
                         : fab_->pool->slice(buf, 0, static_cast<std::uint32_t>(wire));
  wr.op = transport::opcode::send;
  wr.inline_data = inl;
  send_waiting_.remove(n);
  if (eager) {
    ++stats_.eager_sends;
    if (inl) ++stats_.inline_sends;
    ++stats_.messages_sent;
    stats_.bytes_sent += n->length;
    if (post && n->handler.runs_on_io()) {
      n->phase = op_phase::done;
      if (fab_->in_completion > 0) {
        // Started by a handler of a completion (a reply): completes right
        // after its doorbell, at the end of the reactor's pass, with no
        // handler posted and no io_context round in between.
        at_doorbell_.push_back(n);
      } else {
        ++fab_->posted_completions;  // see fabric_state::flush_all (only for handlers run on our thread)
        n->handler.complete_then({fab_, &fab_->posted_completions}, true, {}, static_cast<std::size_t>(n->length));
        release(n);
      }
    } else {
      complete(n, post, {}, static_cast<std::size_t>(n->length));
    }
  } else {
    ++stats_.rendezvous_sends;
    n->phase = op_phase::posted;
    active_.push_back(n);
  }
  schedule();
  return start_result::started;
}

// A message (or notification) waits for the peer's credits; the last one
// is kept for control messages.
connection_impl::start_result connection_impl::credit_stall(op_node* n) noexcept {
  if (!n->stalled_credit) {
    n->stalled_credit = true;
    ++stats_.credit_stalls;
  }
  return start_result::blocked_credit;
}

bool connection_impl::take_send_buffer(op_node* n, std::uint32_t& buf) noexcept {
  buf = fab_->pool->try_get();
  if (buf != buffer_pool::npos) return true;
  if (!n->stalled_buffer) {
    n->stalled_buffer = true;
    ++stats_.buffer_stalls;
    n->deadline = std::chrono::steady_clock::now() + opt_.buffer_wait;
  }
  if (!waiting_buffer) {
    waiting_buffer = true;
    fab_->wait_for_buffer(this);
  }
  arm_buffer_timer();
  return false;
}

bool connection_impl::enqueue_control(protocol::msg_type type, std::uint8_t status, std::uint32_t aux) noexcept {
  if (credits_ < 1 || sq_free() == 0) return false;
  const bool inl = protocol::kHeaderSize <= fab_->inline_cap;
  std::uint32_t buf = buffer_pool::npos;
  if (!inl) {
    buf = fab_->pool->try_get();
    if (buf == buffer_pool::npos) {
      if (!waiting_buffer) {
        waiting_buffer = true;
        fab_->wait_for_buffer(this);
      }
      return false;
    }
  }
  op_node* op = type == protocol::msg_type::close ? close_op_ : nullptr;
  transport::work_request& wr = next_wr(slot_kind::control, buf, op);
  const std::size_t slot = (sq_queued_ - 1) % sq_.size();
  std::byte* out = inl ? inline_stage_.data() + slot * fab_->inline_cap : fab_->pool->data(buf);
  --credits_;
  protocol::encode(protocol::header{type, status, take_owed(), aux}, out);
  *slot_sges(slot) = inl ? transport::sge{reinterpret_cast<std::uint64_t>(out), protocol::kHeaderSize, 0}
                         : fab_->pool->slice(buf, 0, protocol::kHeaderSize);
  wr.op = transport::opcode::send;
  wr.inline_data = inl;
  if (type == protocol::msg_type::credit) ++stats_.credit_messages;
  schedule();
  return true;
}

void connection_impl::post_fins() noexcept {
  std::size_t done = 0;
  while (done < fins_.size() && enqueue_control(protocol::msg_type::fin, static_cast<std::uint8_t>(fins_[done].status),
                                                fins_[done].cookie)) {
    ++done;
  }
  fins_.erase(fins_.begin(), fins_.begin() + static_cast<std::ptrdiff_t>(done));
}

bool connection_impl::progress_sends(bool post) noexcept {
  if (state_ != state::open && state_ != state::closing) return false;
  if (!fins_.empty()) post_fins();
  continue_reads();
  while (!send_waiting_.empty()) {
    if (try_start(send_waiting_.head, post) != start_result::started) return false;
  }
  if (state_ == state::closing && close_op_ != nullptr && !close_sent_ && fins_.empty()) {
    bool rendezvous_out = false;
    for (op_node* p = active_.head; p != nullptr; p = p->next) rendezvous_out |= p->kind == op_kind::send;
    if (!rendezvous_out && enqueue_control(protocol::msg_type::close, 0, 0)) close_sent_ = true;
  }
  return true;
}

void connection_impl::maybe_send_credits() noexcept {
  if (state_ != state::open && state_ != state::closing) return;
  if (peer_closed_ || owed_ < 2) return;
  if (owed_ >= opt_.credits / 2u || peer_view_ <= 1) (void)enqueue_control(protocol::msg_type::credit, 0, 0);
}

void connection_impl::arm_buffer_timer() noexcept {
  if (buffer_timer_armed_ || send_waiting_.empty()) return;
  buffer_timer_armed_ = true;
  buffer_timer_.expires_at(send_waiting_.head->deadline);
  buffer_timer_.async_wait([w = weak_from_this()](const boost::system::error_code& ec) {
    auto self = w.lock();
    if (!self) return;
    self->buffer_timer_armed_ = false;
    if (ec) return;
    op_node* head = self->send_waiting_.head;
    // A put_with_notify whose data is posted waits for its buffer: its
    // memory is in use until the data is back.
    if (head == nullptr || !head->stalled_buffer || head->phase == op_phase::posted) return;
    if (std::chrono::steady_clock::now() >= head->deadline) {
      log().warn("connection: no pool buffer for {} ms; failing a {}-byte send", self->opt_.buffer_wait.count(),
                 head->length);
      self->send_waiting_.remove(head);
      self->complete(head, true, errc::no_buffer_space);
      self->progress_sends(true);
    }
    self->arm_buffer_timer();
  });
}

void connection_impl::on_buffer_available() noexcept {
  waiting_buffer = false;
  schedule();
}

void connection_impl::schedule() noexcept {
  if (fab_->in_completion > 0) urgent = true;
  if (dirty) return;
  dirty = true;
  fab_->schedule_flush(this);
}

void connection_impl::flush() noexcept {
  flush_now();  // what it queues itself goes out with it: no new flush is scheduled meanwhile
  dirty = false;
  urgent = false;
  // Their work requests are posted now (had the post failed, fail() would
  // have completed them with its error), so they are outstanding and self_
  // keeps this connection alive even if a handler drops its last handle.
  // What the handlers queue starts a new flush; one that aborts the
  // connection does not turn the others' posted sends into failures.
  op_list posted = std::exchange(at_doorbell_, op_list{});
  while (op_node* n = posted.pop_front()) complete(n, false, {}, static_cast<std::size_t>(n->length));
}

void connection_impl::flush_now() noexcept {
  // During setup the connect/accept thread owns the queue pair: what is
  // queued waits for on_connected.
  if (qp_ == nullptr || state_ == state::setup) return;
  if (!send_waiting_.empty() || !fins_.empty() || (close_op_ != nullptr && !close_sent_)) progress_sends(true);
  if (!recv_batch_.empty()) {
    std::size_t bad = 0;
    if (auto ec = qp_->post_recv(recv_batch_, &bad)) {
      log().error("connection qp {}: post_recv failed: {}", qp_->qp_num(), ec.message());
      fail(ec);
      return;
    }
    stats_.recv_posts += recv_batch_.size();
    rq_posted_ = rq_queued_;
    recv_batch_.clear();
  }
  maybe_send_credits();
  if (batch_.empty()) return;
  const std::uint32_t k = opt_.signal_interval;
  for (std::size_t i = 0; i < batch_.size(); ++i) {
    sq_slot& s = sq_[(sq_posted_ + i) % sq_.size()];
    const bool must = s.kind == slot_kind::read_last || s.op != nullptr || i + 1 == batch_.size();
    if (must || ++since_signal_ >= k) {
      since_signal_ = 0;
      s.signaled = true;
      batch_[i].signaled = true;
      ++stats_.signaled;
      fab_->busy();
    } else {
      batch_[i].signaled = false;
    }
  }
  std::size_t bad = 0;
  if (auto ec = qp_->post_send(batch_, &bad)) {
    log().error("connection qp {}: post_send of {} requests failed at {}: {}", qp_->qp_num(), batch_.size(), bad,
                ec.message());
    fail(ec);
    return;
  }
  stats_.posts += batch_.size();
  ++stats_.doorbells;
  sq_posted_ = sq_queued_;
  batch_.clear();
}

// Work requests queued but never posted (the connection failed first).
void connection_impl::drop_unposted() noexcept {
  for (std::uint64_t i = sq_posted_; i < sq_queued_; ++i) {
    sq_slot s = sq_[i % sq_.size()];
    sq_[i % sq_.size()] = {};
    if (s.buffer != buffer_pool::npos) fab_->put_buffer(s.buffer);
    if (s.signaled) fab_->idle();
    // Its last part never goes out; earlier parts may be posted and use its
    // memory: it ends once they are back.
    if (s.kind == slot_kind::read_last && s.op != nullptr) {
      active_.remove(s.op);
      park(s.op);
    }
    if (s.kind == slot_kind::onesided_last && s.op != nullptr) park(s.op);
  }
  sq_queued_ = sq_posted_;
  batch_.clear();
  for (op_node* p = parked_.head; p != nullptr; p = p->next) p->operand = std::min(p->operand, sq_posted_);
  for (std::uint64_t i = rq_posted_; i < rq_queued_; ++i) fab_->put_buffer(rq_[i % rq_.size()]);
  rq_queued_ = rq_posted_;
  recv_batch_.clear();
}

std::uint64_t connection_impl::full_seq(std::uint32_t tag, std::uint64_t base) const noexcept {
  std::uint64_t seq = (base & ~std::uint64_t{kTagMask}) | tag;
  if (seq < base) seq += std::uint64_t{kTagMask} + 1;
  return seq;
}

void connection_impl::retire_through(std::uint64_t seq, transport::wc_status status) noexcept {
  while (sq_retired_ <= seq && sq_retired_ < sq_posted_) {
    const std::uint64_t i = sq_retired_;
    sq_slot s = sq_[i % sq_.size()];
    sq_[i % sq_.size()] = {};
    ++sq_retired_;
    if (s.buffer != buffer_pool::npos) fab_->put_buffer(s.buffer);
    if (s.signaled) fab_->idle();
    const transport::wc_status st = i == seq ? status : transport::wc_status::success;
    if (s.kind == slot_kind::read_last && s.op != nullptr) on_read_done(s.op, st);
    if (s.kind == slot_kind::onesided_last && s.op != nullptr) on_onesided_done(s.op, st, i % sq_.size(), false);
    if (s.kind == slot_kind::control && s.op != nullptr && s.op == close_op_) {
      // Acknowledged; or flushed because both sides closed at once and the
      // peer, its own close acknowledged, tore the queue pair down first:
      // its close arrived, so it has closed too.
      if (st == transport::wc_status::success || peer_closed_) on_close_acked();
    }
  }
  // A flush covers the work requests before its target: those before a
  // failed one succeeded.
  complete_flushes(status == transport::wc_status::success ? sq_retired_ : std::min(seq, sq_retired_));
  complete_parked(false);
}

// An operation that ended early (the connection failed or the peer closed)
// while parts of it were posted: it completes with the error once those
// parts are back, never while the device may still use its memory.
void connection_impl::park(op_node* n) noexcept {
  n->operand = sq_queued_;
  n->phase = op_phase::posted;
  parked_.push_back(n);
}

void connection_impl::complete_parked(bool post) noexcept {
  while (parked_.head != nullptr && parked_.head->operand <= sq_retired_) {
    op_node* n = parked_.pop_front();
    if (n->kind == op_kind::receive_message && n->mr != nullptr) rendezvous_held_ -= n->length;
    complete(n, post, error_ ? error_ : std::error_code(errc::connection_closed));
  }
}

// Rendezvous reads started in part whose last fragment can no longer be
// issued (the connection is failed or closed).
void connection_impl::park_partial_reads() noexcept {
  for (op_node* n = active_.head; n != nullptr;) {
    op_node* next = n->next;
    if (n->kind != op_kind::send && n->issued < n->length) {
      active_.remove(n);
      if (n->issued == 0) {
        if (n->kind == op_kind::receive_message) rendezvous_held_ -= n->length;
        complete(n, true, error_ ? error_ : std::error_code(errc::connection_closed));
      } else {
        park(n);
      }
    }
    n = next;
  }
  complete_parked(true);
}

void connection_impl::on_send_completion(const transport::completion& wc) noexcept {
  auto keep = shared_from_this();
  ++fab_->in_completion;
  on_send_completion_body(wc);
  --fab_->in_completion;
}

void connection_impl::on_send_completion_body(const transport::completion& wc) noexcept {
  const std::uint64_t seq = full_seq(reactor::tag_of(wc.wr_id), sq_retired_);
  if (wc.status == transport::wc_status::fatal && (wc.wr_id & 0xffffffff00000000ull) == reactor::kPersistent) {
    // The reactor gave up on the completion queue: everything outstanding is lost.
    fail(make_error_code(wc.status));
    retire_through(sq_posted_ - 1, transport::wc_status::work_request_flushed);
    maybe_release_self();
    return;
  }
  if (wc.status != transport::wc_status::success) {
    // Failed first: the handlers that retiring runs see a failed connection.
    const bool expected = state_ == state::failed || state_ == state::closed || peer_closed_;
    if (!expected) {
      log().warn("connection qp {}: send completion {}: failing the connection", qp_ ? qp_->qp_num() : 0,
                 transport::to_string(wc.status));
      fail(make_error_code(wc.status));
    }
  }
  retire_through(seq, wc.status);
  progress_sends(false);
  deliver(false);
  maybe_release_self();
}

// ---------------------------------------------------------------- one-sided

void connection_impl::start_onesided(op_node* n) {
  if (n->kind == op_kind::receive_notification) {
    note_waiting_.push_back(n);
    deliver(true);
    return;
  }
  if (state_ == state::failed || state_ == state::closed || peer_closed_ || close_op_ != nullptr) {
    complete(n, true, state_ == state::failed && error_ != errc::connection_closed ? error_ : errc::connection_closed);
    return;
  }
  if (const std::error_code ec = prepare_onesided(n)) {
    complete(n, true, ec);
    return;
  }
  send_waiting_.push_back(n);
  if (state_ == state::setup) return;  // started once connected
  progress_sends(true);
}

std::error_code connection_impl::prepare_onesided(op_node* n) noexcept {
  switch (n->kind) {
    case op_kind::fetch_add:
    case op_kind::compare_swap:
      if (!fab_->device->caps().atomics) return errc::not_supported;
      if (n->remote.length < 8 || n->remote.addr % 8 != 0) return errc::invalid_argument;
      return {};
    case op_kind::flush: return {};
    default: break;
  }
  if (n->nbufs == 0xff) return errc::invalid_argument;
  const bool into_local = n->kind == op_kind::get;
  if (into_local && n->read_only) return errc::invalid_argument;
  if (n->length > n->remote.length) return errc::out_of_range;
  for (std::uint8_t i = 0; i < n->nbufs; ++i) {
    const asio::const_buffer b = n->bufs[i];
    if (const memory_region* r = n->regions[i]) {
      // A range of a region that has since been moved or reset is refused.
      const auto* p = static_cast<const std::byte*>(b.data());
      if (!*r || p < r->data() || b.size() > r->size() || p - r->data() > static_cast<std::ptrdiff_t>(r->size() - b.size())) {
        return errc::invalid_argument;
      }
      if (into_local && !has(r->access(), access::local_write)) return errc::invalid_argument;
      n->lkeys[i] = r->lkey();
      continue;
    }
    try {
      registration_cache::entry& e =
          fab_->cache->pin(b.data(), b.size(), into_local ? access::local_write : access::none);
      n->pins[n->npins++] = &e;
      n->lkeys[i] = e.mr->lkey();
    } catch (const std::exception& e) {
      log().warn("connection: registering {} bytes at {} for a one-sided operation failed: {}", b.size(), b.data(),
                 e.what());
      return errc::registration_failed;
    }
  }
  return {};
}

// A put or get goes out as work requests of at most sge_per_wr_ pieces and
// fragment_ bytes each, the remote address advancing with them; a transfer
// larger than the send queue can hold is queued in parts as it drains.
bool connection_impl::emit_segments(op_node* n, bool last_completes, std::size_t max_wrs) noexcept {
  for (std::size_t wrs = 0; n->cur_buf < n->nbufs && wrs < max_wrs; ++wrs) {
    const std::size_t slot = sq_queued_ % sq_.size();
    transport::sge* sg = slot_sges(slot);
    std::uint64_t bytes = 0;
    std::uint32_t k = 0;
    for (; k < sge_per_wr_ && n->cur_buf < n->nbufs && bytes < fragment_; ++k) {
      const asio::const_buffer& b = n->bufs[n->cur_buf];
      const std::uint64_t take = std::min<std::uint64_t>(b.size() - n->cur_off, fragment_ - bytes);
      sg[k] = {reinterpret_cast<std::uint64_t>(b.data()) + n->cur_off, static_cast<std::uint32_t>(take),
               n->lkeys[n->cur_buf]};
      bytes += take;
      n->cur_off += take;
      if (n->cur_off == b.size()) {
        ++n->cur_buf;
        n->cur_off = 0;
      }
    }
    const bool last = last_completes && n->cur_buf == n->nbufs;
    transport::work_request& wr =
        next_wr(last ? slot_kind::onesided_last : slot_kind::none, buffer_pool::npos, last ? n : nullptr);
    wr.sg_list = {sg, k};
    wr.op = n->kind == op_kind::get ? transport::opcode::read : transport::opcode::write;
    wr.inline_data = false;
    wr.remote_addr = n->remote.addr + n->issued;
    wr.rkey = n->remote.rkey;
    n->issued += bytes;
  }
  return n->cur_buf == n->nbufs;
}

connection_impl::start_result connection_impl::try_start_onesided(op_node* n, bool post) noexcept {
  switch (n->kind) {
    case op_kind::flush:
      // Complete once every work request queued before it has retired
      // (each doorbell ends with a signaled one, so they all will).
      send_waiting_.remove(n);
      n->operand = sq_queued_;
      if (sq_retired_ >= sq_queued_) {
        ++stats_.flushes;
        complete(n, post, {});
      } else {
        n->phase = op_phase::posted;
        flushes_.push_back(n);
      }
      return start_result::started;
    case op_kind::fetch_add:
    case op_kind::compare_swap: {
      if (sq_free() == 0) return start_result::blocked_queue;
      const std::size_t slot = sq_queued_ % sq_.size();
      transport::work_request& wr = next_wr(slot_kind::onesided_last, buffer_pool::npos, n);
      *slot_sges(slot) = atomic_mr_->slice(slot * sizeof(std::uint64_t), sizeof(std::uint64_t));
      wr.op = n->kind == op_kind::fetch_add ? transport::opcode::fetch_add : transport::opcode::compare_swap;
      wr.inline_data = false;
      wr.remote_addr = n->remote.addr;
      wr.rkey = n->remote.rkey;
      wr.compare_add = n->operand;
      wr.swap = n->operand2;
      break;
    }
    default: {  // put, get, put_notify
      const bool notify = n->kind == op_kind::put_notify;
      if (n->length == 0 && !notify) {
        send_waiting_.remove(n);
        complete(n, post, {}, 0);
        return start_result::started;
      }
      // The data first, in parts while the send queue is short of room (the
      // operation stays at the head, so nothing behind it overtakes it).
      if (n->cur_buf < n->nbufs) {
        if (sq_free() == 0) return start_result::blocked_queue;
        n->phase = op_phase::posted;  // on the wire from here: no longer cancellable
        if (!emit_segments(n, !notify, sq_free())) {
          schedule();
          return start_result::blocked_queue;
        }
        if (!notify) break;
      }
      // put_with_notify: then the notify message, which needs a credit.
      if (credits_ < 2) {
        schedule();
        return credit_stall(n);
      }
      if (sq_free() == 0) {
        schedule();
        return start_result::blocked_queue;
      }
      const bool inl = protocol::kRtsSize <= fab_->inline_cap;
      std::uint32_t buf = buffer_pool::npos;
      if (!inl && !take_send_buffer(n, buf)) {
        schedule();
        return start_result::blocked_buffer;
      }
      if (n->stalled_buffer && buffer_timer_armed_) buffer_timer_.cancel();
      {
        // RC order: the peer sees the notification after the data is in place.
        const std::size_t slot = sq_queued_ % sq_.size();
        transport::work_request& wr = next_wr(slot_kind::onesided_last, buf, n);
        std::byte* out = inl ? inline_stage_.data() + slot * fab_->inline_cap : fab_->pool->data(buf);
        --credits_;
        protocol::encode(protocol::header{protocol::msg_type::notify, 0, take_owed(), n->value}, out);
        protocol::encode(protocol::rts_body{n->length, n->remote.addr, n->remote.rkey, 0}, out + protocol::kHeaderSize);
        *slot_sges(slot) = inl ? transport::sge{reinterpret_cast<std::uint64_t>(out), protocol::kRtsSize, 0}
                               : fab_->pool->slice(buf, 0, protocol::kRtsSize);
        wr.op = transport::opcode::send;
        wr.inline_data = inl;
      }
      break;
    }
  }
  send_waiting_.remove(n);
  n->phase = op_phase::posted;
  schedule();
  return start_result::started;
}

void connection_impl::on_onesided_done(op_node* n, transport::wc_status status, std::size_t slot, bool post) noexcept {
  if (status != transport::wc_status::success) {
    complete(n, post, error_ ? error_ : make_error_code(status));
    return;
  }
  switch (n->kind) {
    case op_kind::put:
    case op_kind::put_notify:
      ++stats_.puts;
      stats_.bytes_put += n->length;
      if (n->kind == op_kind::put_notify) ++stats_.notifications_sent;
      break;
    case op_kind::get:
      ++stats_.gets;
      stats_.bytes_got += n->length;
      break;
    default:
      ++stats_.atomics;
      n->result = atomic_results_[slot];
      break;
  }
  complete(n, post, {}, static_cast<std::size_t>(n->length));
}

void connection_impl::complete_flushes(std::uint64_t done) noexcept {
  while (flushes_.head != nullptr && flushes_.head->operand <= done) {
    op_node* n = flushes_.pop_front();
    ++stats_.flushes;
    complete(n, false, {});
  }
}

std::error_code connection_impl::receive_ending() const noexcept {
  if (peer_closed_ || state_ == state::closed) return errc::connection_closed;
  if (state_ == state::failed) return error_;
  return {};
}

void connection_impl::deliver_notes(bool post) noexcept {
  while (!note_waiting_.empty()) {
    if (notes_head_ == notes_tail_) {
      const std::error_code ec = receive_ending();
      if (!ec) return;
      while (op_node* n = note_waiting_.pop_front()) complete(n, post, ec);
      return;
    }
    const note_entry e = notes_[notes_head_++ % notes_.size()];
    op_node* n = note_waiting_.pop_front();
    repost(e.buffer);
    ++stats_.notifications_received;
    n->note = e.note;
    complete(n, post, {});
  }
}

// ---------------------------------------------------------------- receiving

void connection_impl::queue_recv(std::uint32_t buffer) noexcept {
  const std::size_t slot = rq_queued_ % rq_.size();
  rq_[slot] = buffer;
  rq_sge_[slot] = fab_->pool->slice(buffer, 0, fab_->recv_buffer);
  recv_batch_.push_back({reactor::persistent_id(recv_base_, static_cast<std::uint32_t>(rq_queued_ & kTagMask)),
                         {&rq_sge_[slot], 1}});
  ++rq_queued_;
}

void connection_impl::repost(std::uint32_t buffer) noexcept {
  if (qp_ == nullptr || state_ == state::failed || state_ == state::closed || peer_closed_) {
    fab_->put_buffer(buffer);
    return;
  }
  queue_recv(buffer);
  ++owed_;
  schedule();
}

void connection_impl::return_buffer(std::uint32_t index) noexcept {
  // The message holds a reference until this returns.
  repost(index);
  maybe_release_self();
}

void connection_impl::on_recv_completion(const transport::completion& wc) noexcept {
  auto keep = shared_from_this();
  ++fab_->in_completion;
  on_recv_completion_body(wc);
  --fab_->in_completion;
}

void connection_impl::on_recv_completion_body(const transport::completion& wc) noexcept {
  if (wc.status == transport::wc_status::fatal && (wc.wr_id & 0xffffffff00000000ull) == reactor::kPersistent) {
    fail(make_error_code(wc.status));
    for (std::uint64_t i = rq_done_; i < rq_posted_; ++i) fab_->put_buffer(rq_[i % rq_.size()]);
    rq_done_ = rq_posted_;
    maybe_release_self();
    return;
  }
  const std::uint64_t seq = full_seq(reactor::tag_of(wc.wr_id), rq_done_);
  if (seq != rq_done_ || rq_done_ >= rq_posted_) {
    log().error("connection: receive completion out of order (#{} expected #{}); dropped", seq, rq_done_);
    return;
  }
  const std::uint32_t buffer = rq_[seq % rq_.size()];
  ++rq_done_;
  if (wc.status != transport::wc_status::success) {
    fab_->put_buffer(buffer);
    const bool expected = state_ == state::failed || state_ == state::closed || peer_closed_;
    if (!expected) {
      log().warn("connection qp {}: receive completion {}: failing the connection", qp_ ? qp_->qp_num() : 0,
                 transport::to_string(wc.status));
      fail(make_error_code(wc.status));
    } else if (peer_closed_ && state_ != state::failed && state_ != state::closed) {
      state_ = state::closed;  // the peer tore the queue pair down after its close
      error_ = errc::connection_closed;
      park_partial_reads();
      begin_drain();
    }
  } else {
    handle_message(buffer, wc.byte_len);
  }
  progress_sends(false);
  deliver(false);
  maybe_release_self();
}

void connection_impl::handle_message(std::uint32_t buffer, std::uint32_t length) noexcept {
  const std::byte* data = fab_->pool->data(buffer);
  protocol::header h;
  if (length > fab_->recv_buffer || !protocol::decode({data, length}, h)) {
    log().warn("connection qp {}: malformed message ({} bytes, type {}) from the peer", qp_->qp_num(), length,
               length > 0 ? std::to_integer<int>(data[0]) : -1);
    fab_->put_buffer(buffer);
    fail(errc::protocol_error);
    return;
  }
  credits_ += h.credits;
  --peer_view_;
  if (state_ != state::setup && credits_ > static_cast<std::int64_t>(peer_.credits)) {
    log().warn("connection qp {}: the peer returned more credits than it has receives ({} > {})", qp_->qp_num(),
               credits_, peer_.credits);
    fab_->put_buffer(buffer);
    fail(errc::protocol_error);
    return;
  }
  switch (h.type) {
    case protocol::msg_type::eager:
    case protocol::msg_type::rts: {
      if (h.type == protocol::msg_type::rts) {
        const protocol::rts_body b = protocol::decode_rts(data + protocol::kHeaderSize);
        if (b.length == 0 || b.length > opt_.max_message) {
          log().warn("connection qp {}: rendezvous request of {} bytes (maximum {})", qp_->qp_num(), b.length,
                     opt_.max_message);
          fab_->put_buffer(buffer);
          fail(errc::protocol_error);
          return;
        }
      }
      if (inbox_tail_ - inbox_head_ >= inbox_.size()) {  // cannot happen with a conforming peer
        fab_->put_buffer(buffer);
        fail(errc::protocol_error);
        return;
      }
      inbox_[inbox_tail_++ % inbox_.size()] = {buffer, length, h.type == protocol::msg_type::rts};
      return;
    }
    case protocol::msg_type::fin: {
      op_node* n = active_.head;
      while (n != nullptr && !(n->kind == op_kind::send && n->cookie == h.aux)) n = n->next;
      repost(buffer);
      if (n == nullptr) {
        log().warn("connection qp {}: fin for unknown rendezvous {}", qp_->qp_num(), h.aux);
        fail(errc::protocol_error);
        return;
      }
      active_.remove(n);
      n->mr.reset();
      std::error_code ec;
      switch (static_cast<protocol::fin_status>(h.status)) {
        case protocol::fin_status::ok: break;
        case protocol::fin_status::message_size: ec = errc::message_size; break;
        case protocol::fin_status::no_memory: ec = errc::peer_out_of_memory; break;
        case protocol::fin_status::read_failed: ec = errc::protocol_error; break;
        default:
          log().warn("connection qp {}: fin with unknown status {}", qp_->qp_num(), h.status);
          n->mr.reset();
          complete(n, false, errc::protocol_error);
          fail(errc::protocol_error);
          return;
      }
      if (!ec) {
        ++stats_.messages_sent;
        stats_.bytes_sent += n->length;
      }
      complete(n, false, ec, ec ? 0 : static_cast<std::size_t>(n->length));
      return;
    }
    case protocol::msg_type::notify: {
      const protocol::rts_body b = protocol::decode_rts(data + protocol::kHeaderSize);
      if (notes_tail_ - notes_head_ >= notes_.size()) {  // cannot happen with a conforming peer
        fab_->put_buffer(buffer);
        fail(errc::protocol_error);
        return;
      }
      notes_[notes_tail_++ % notes_.size()] = {buffer, notification{h.aux, remote_region{b.addr, b.length, b.rkey}}};
      return;
    }
    case protocol::msg_type::credit: repost(buffer); return;
    case protocol::msg_type::close:
      fab_->put_buffer(buffer);
      on_peer_close();
      return;
  }
}

void connection_impl::on_peer_close() noexcept {
  peer_closed_ = true;
  log().debug("connection qp {}: the peer closed", qp_->qp_num());
  while (op_node* n = send_waiting_.pop_front()) {
    if (n->phase == op_phase::posted) {
      park(n);  // started in part: it ends when its parts are back
      continue;
    }
    complete(n, true, errc::connection_closed);
  }
  complete_parked(true);
  for (op_node* n = active_.head; n != nullptr;) {
    op_node* next = n->next;
    if (n->kind == op_kind::send) {
      active_.remove(n);
      complete(n, true, errc::connection_closed);
    }
    n = next;
  }
  if (close_op_ != nullptr && !close_sent_) {
    op_node* n = close_op_;
    close_op_ = nullptr;
    on_close_acked();
    complete(n, true, {});
  }
  if (!parked_.empty() && state_ != state::failed && state_ != state::closed) {
    // Transfers cut short by the close wait for their posted parts. The peer
    // sends nothing more and its queue pair goes to error once its close is
    // acknowledged, so ours does now: the parts come back at once (flushed)
    // instead of waiting for a transport timeout.
    on_close_acked();
  }
}

void connection_impl::on_close_acked() noexcept {
  state_ = state::closed;
  error_ = errc::connection_closed;
  if (close_op_ != nullptr) {
    op_node* n = close_op_;
    close_op_ = nullptr;
    complete(n, false, {});
  }
  // Flush the receives: their buffers go back to the pool.
  if (qp_ != nullptr) (void)qp_->modify(transport::qp_state::error);
  park_partial_reads();
  begin_drain();
  deliver(false);
}

// Starts reading a rendezvous message: its destination is registered (and,
// for async_receive(), allocated within the rendezvous_memory budget), then
// the READs go out in fragments as the send queue has room.
bool connection_impl::start_read(op_node* n, const protocol::rts_body& b) noexcept {
  if (sq_free() == 0) return false;
  const bool allocate = n->kind == op_kind::receive_message;
  if (allocate && rendezvous_held_ + b.length > opt_.rendezvous_memory) return false;  // after earlier reads
  // Off the waiting list before it joins another (the lists share the node's links).
  recv_waiting_.remove(n);
  try {
    std::byte* dst;
    if (!allocate) {
      dst = static_cast<std::byte*>(n->dest.data());
    } else {
      n->large.reset(new std::byte[b.length]);
      dst = n->large.get();
    }
    n->mr = fab_->pd->register_memory(dst, b.length, transport::access::local_write);
  } catch (const std::exception& e2) {
    log().warn("connection: cannot receive a {}-byte message: {}", b.length, e2.what());
    n->large.reset();
    return true;  // the caller sees no mr and fails the operation
  }
  if (allocate) rendezvous_held_ += b.length;
  n->cookie = b.cookie;
  n->length = b.length;
  n->remote = remote_region{b.addr, b.length, b.rkey};
  n->issued = 0;
  n->phase = op_phase::posted;
  active_.push_back(n);
  issue_reads(n);
  return true;
}

void connection_impl::issue_reads(op_node* n) noexcept {
  bool queued = false;
  while (n->issued < n->length && sq_free() > 0) {
    const std::uint64_t off = n->issued;
    const auto len = static_cast<std::uint32_t>(std::min(fragment_, n->length - off));
    const bool last = off + len == n->length;
    transport::work_request& wr = next_wr(last ? slot_kind::read_last : slot_kind::none, buffer_pool::npos,
                                          last ? n : nullptr);
    *slot_sges((sq_queued_ - 1) % sq_.size()) = n->mr->slice(off, len);
    wr.op = transport::opcode::read;
    wr.inline_data = false;
    wr.remote_addr = n->remote.addr + off;
    wr.rkey = n->remote.rkey;
    n->issued += len;
    queued = true;
  }
  if (queued) schedule();
}

void connection_impl::continue_reads() noexcept {
  for (op_node* p = active_.head; p != nullptr && sq_free() > 0; p = p->next) {
    if (p->kind != op_kind::send && p->issued < p->length) issue_reads(p);
  }
}

void connection_impl::on_read_done(op_node* n, transport::wc_status status) noexcept {
  active_.remove(n);
  if (n->kind == op_kind::receive_message) rendezvous_held_ -= n->length;
  if (status != transport::wc_status::success || state_ == state::failed) {
    fins_.push_back({n->cookie, protocol::fin_status::read_failed});
    complete(n, false, error_ ? error_ : make_error_code(status));
    return;
  }
  fins_.push_back({n->cookie, protocol::fin_status::ok});
  schedule();
  ++stats_.messages_received;
  stats_.bytes_received += n->length;
  const auto len = static_cast<std::size_t>(n->length);
  if (n->kind == op_kind::receive_buffer) {
    complete(n, false, {}, len);
    return;
  }
  message m;
  m.owner_ = shared_from_this();
  m.large_ = std::make_unique<op_node>();
  m.large_->large = std::move(n->large);
  m.large_->mr = std::move(n->mr);
  m.data_ = m.large_->large.get();
  m.size_ = len;
  complete_message(n, false, std::move(m));
}

void connection_impl::deliver(bool post) noexcept {
  if (!note_waiting_.empty()) deliver_notes(post);
  while (!recv_waiting_.empty()) {
    if (inbox_head_ == inbox_tail_) {
      const std::error_code ec = receive_ending();
      if (!ec) return;
      while (op_node* n = recv_waiting_.pop_front()) complete(n, post, ec);
      return;
    }
    const inbox_entry e = inbox_[inbox_head_ % inbox_.size()];
    op_node* n = recv_waiting_.head;
    const std::byte* data = fab_->pool->data(e.buffer);
    if (!e.rts) {
      ++inbox_head_;
      recv_waiting_.remove(n);
      const std::size_t len = e.length - protocol::kHeaderSize;
      if (n->kind == op_kind::receive_message) {
        ++stats_.messages_received;
        stats_.bytes_received += len;
        message m;
        m.owner_ = shared_from_this();
        m.data_ = data + protocol::kHeaderSize;
        m.size_ = len;
        m.buffer_ = e.buffer;
        complete_message(n, post, std::move(m));
      } else if (len > n->dest.size()) {
        repost(e.buffer);
        complete(n, post, errc::message_size);
      } else {
        if (len > 0) std::memcpy(n->dest.data(), data + protocol::kHeaderSize, len);
        repost(e.buffer);
        ++stats_.messages_received;
        stats_.bytes_received += len;
        complete(n, post, {}, len);
      }
      continue;
    }
    const protocol::rts_body b = protocol::decode_rts(data + protocol::kHeaderSize);
    if (state_ == state::failed || state_ == state::closed) {
      ++inbox_head_;
      recv_waiting_.remove(n);
      fab_->put_buffer(e.buffer);
      complete(n, post, state_ == state::failed ? error_ : std::error_code(errc::connection_closed));
      continue;
    }
    // Larger than the caller's buffer, or than what this connection may
    // allocate for it: refused on both sides, never truncated.
    if ((n->kind == op_kind::receive_buffer && b.length > n->dest.size()) ||
        (n->kind == op_kind::receive_message && b.length > opt_.rendezvous_memory)) {
      if (n->kind == op_kind::receive_message) {
        log().warn("connection qp {}: a {}-byte message exceeds rendezvous_memory ({} bytes); refused",
                   qp_->qp_num(), b.length, opt_.rendezvous_memory);
      }
      ++inbox_head_;
      recv_waiting_.remove(n);
      fins_.push_back({b.cookie, protocol::fin_status::message_size});
      repost(e.buffer);
      complete(n, post, errc::message_size);
      continue;
    }
    if (!start_read(n, b)) return;  // no room now: retried after completions (start_read took n off the list)
    ++inbox_head_;
    repost(e.buffer);
    if (n->mr == nullptr) {
      fins_.push_back({b.cookie, protocol::fin_status::no_memory});
      complete(n, post, errc::registration_failed);
    }
  }
}

// ---------------------------------------------------------------- ending

void connection_impl::fail(std::error_code ec) noexcept {
  if (state_ == state::failed || state_ == state::closed) return;
  const state was = state_;
  state_ = state::failed;
  error_ = peer_closed_ ? std::error_code(errc::connection_closed) : ec;
  if (ec == errc::connection_closed) {
    log().debug("connection qp {}: aborted", qp_ ? qp_->qp_num() : 0);
  } else {
    log().warn("connection qp {}: failed in state {}: {}", qp_ ? qp_->qp_num() : 0, static_cast<int>(was),
               ec.message());
  }
  // During setup the connect/accept thread owns the queue pair (provider
  // contract): on_connected moves it to error.
  if (qp_ != nullptr && was != state::setup) (void)qp_->modify(transport::qp_state::error);
  drop_unposted();
  begin_drain();
  fins_.clear();
  while (op_node* n = send_waiting_.pop_front()) {
    if (n->phase == op_phase::posted) {
      park(n);  // started in part: it ends when its posted parts are back
      continue;
    }
    complete(n, true, error_);
  }
  while (op_node* n = at_doorbell_.pop_front()) complete(n, true, error_);  // dropped unposted
  for (op_node* n = active_.head; n != nullptr;) {
    op_node* next = n->next;
    if (n->kind == op_kind::send) {  // rendezvous sends: the fin will never come
      active_.remove(n);
      complete(n, true, error_);
    }
    n = next;
  }
  park_partial_reads();  // their last fragment will never be posted
  if (close_op_ != nullptr) {
    op_node* n = close_op_;
    close_op_ = nullptr;
    complete(n, true, error_);
  }
  while (op_node* n = flushes_.pop_front()) complete(n, true, error_);
  deliver(true);
}

void connection_impl::begin_drain() noexcept {
  if (draining_ || (sq_retired_ == sq_posted_ && rq_done_ == rq_posted_)) return;
  draining_ = true;
  fab_->busy();
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
void start_send(connection_impl& c, op_node* n) { c.start_send(n); }
void start_receive(connection_impl& c, op_node* n) { c.start_receive(n); }
void start_close(connection_impl& c, op_node* n) { c.start_close(n); }
void start_onesided(connection_impl& c, op_node* n) { c.start_onesided(n); }

void set_local(op_node& n, std::span<const local_range> ranges) noexcept {
  std::size_t i = 0;
  for (const local_range& r : ranges) {
    if (r.size() == 0) continue;
    if (i == kMaxGather) {
      n.nbufs = 0xff;
      return;
    }
    n.bufs[i] = asio::const_buffer(r.data(), r.size());
    n.regions[i] = r.region();
    n.read_only = n.read_only || r.read_only();
    n.length += r.size();
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
message::~message() { release(); }

void message::release() noexcept {
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

bool connection::is_open() const noexcept { return impl_ != nullptr && impl_->is_open(); }
void connection::abort() noexcept {
  if (impl_ != nullptr) impl_->abort();
}
connection_stats connection::stats() const noexcept { return impl_ ? impl_->stats() : connection_stats{}; }
const peer_parameters& connection::peer() const noexcept {
  static const peer_parameters none{};
  return impl_ ? impl_->peer() : none;
}
std::uint32_t connection::eager_limit() const noexcept { return impl_ ? impl_->send_eager_limit() : 0; }

}  // namespace anydoor
