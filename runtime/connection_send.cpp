// The connection engine's send side: messages and control messages into the
// send queue, flushing them to the queue pair, and retiring send completions.
#include "connection_impl.hpp"

#include <anydoor/error.hpp>

#include "cuda/driver.hpp"
#include "cuda/register.hpp"
#include "log.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <utility>

namespace anydoor::detail {

// ---------------------------------------------------------------- sending

bool connection_impl::borrow_batch() noexcept {
  if (batch_failed_) return false;
  const std::size_t q = opt_.send_queue;
  batch_ = fab_->take_batch(q, q + sge_per_wr_, std::min<std::size_t>(q * fab_->inline_cap, kInlineStage));
  if (batch_ != nullptr) return true;
  // Nothing can be queued without one, and nothing already posted would
  // bring the connection back here: waiting would stall every operation
  // (and the credits the peer waits for) for good. The next flush fails
  // the connection with not_enough_memory.
  batch_failed_ = true;
  schedule();
  return false;
}

void connection_impl::give_back_batch() noexcept {
  reset_staging();
  fab_->give_batch(std::exchange(batch_, nullptr));
}

std::uint16_t connection_impl::take_owed() noexcept {
  const auto n = static_cast<std::uint16_t>(std::min<std::uint32_t>(owed_, 0xffff));
  owed_ -= n;
  owed_echo_ = std::min(owed_echo_, owed_);
  peer_view_ += n;
  return n;
}

transport::work_request& connection_impl::next_wr(slot_kind kind, std::uint32_t buffer, op_node* op,
                                                  std::span<const transport::sge> sges) noexcept {
  const std::size_t slot = ring_slot(sq_queued_, sq_.size());
  sq_[slot] = {buffer, kind, op, false};
  transport::work_request& wr = batch_->wrs.emplace_back();  // capacity = send_queue >= queued (sq_free held it)
  wr.wr_id = reactor::persistent_id(send_base_, static_cast<std::uint32_t>(sq_queued_ & kTagMask));
  wr.sg_list = sges;
  ++sq_queued_;
  return wr;  // the caller schedules the flush (after posting its completion)
}

std::byte* connection_impl::stage_send(slot_kind kind, std::uint32_t buf, op_node* op, std::uint32_t wire) noexcept {
  const bool inl = buf == buffer_pool::npos;
  ++tx_count_;
  std::byte* out = nullptr;
  if (!inl) {
    out = fab_->pool->data(buf);
  } else if (kind == slot_kind::control) {
    out = stage_control_.data() + stage_control_used_;
    stage_control_used_ += wire;
  } else {
    out = batch_->inline_bytes.data() + stage_inline_used_;
    stage_inline_used_ += wire;
  }
  transport::sge* sg = take_sges(1);
  *sg = inl ? transport::sge{reinterpret_cast<std::uint64_t>(out), wire, 0} : fab_->pool->slice(buf, 0, wire);
  transport::work_request& wr = next_wr(kind, buf, op, {sg, 1});
  wr.op = transport::opcode::send;
  wr.inline_data = inl;
  return out;
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
  if (!eager && n->device_mask == 0 && n->length <= opt_.eager_split_limit && start_split(n, post)) {
    return start_result::started;
  }
  if (credits_ < 2) return credit_stall(n);
  if (sq_free() == 0) return start_result::blocked_queue;
  const std::size_t wire = eager ? protocol::kHeaderSize + n->length : protocol::kRtsSize;
  // An eager message from GPU memory is copied into a pool buffer (never
  // inline: the work request would copy it with the CPU) before anything
  // is staged, so that a failed copy sends nothing.
  const bool from_device = n->device_mask != 0;
  const bool inl = !(eager && from_device) && can_inline(wire);
  std::uint32_t buf = buffer_pool::npos;
  if (!inl && !take_send_buffer(n, buf)) return start_result::blocked_buffer;
  if (eager && from_device) {
    std::byte* p = fab_->pool->data(buf) + protocol::kHeaderSize;
    std::string why;
    for (std::uint8_t i = 0; i < n->nbufs; ++i) {
      std::error_code ec;
      if ((n->device_mask & (1u << i)) != 0) {
        ec = cuda::detail::copy_to_host(p, n->bufs[i].data(), n->bufs[i].size(), why);
      } else if (n->bufs[i].size() != 0) {
        std::memcpy(p, n->bufs[i].data(), n->bufs[i].size());
      }
      if (ec) {
        log().warn("connection: copying a {}-byte message out of GPU memory failed: {}", n->length, why);
        fab_->put_buffer(buf);
        send_waiting_.remove(n);
        complete(n, post, ec);
        return start_result::started;
      }
      p += n->bufs[i].size();
    }
  }
  // A rendezvous message of GPU memory where the device does not reach it
  // (or with gpu_staging): the peer reads a host copy of it.
  const bool staged = !eager && from_device &&
                      (fab_->options.gpu_staging || !cuda::detail::reaches_gpu_memory(*fab_->device));
  const void* source = n->bufs[0].data();
  if (staged) {
    std::string why;
    std::error_code ec;
    try {
      n->large.reset(new std::byte[n->length]);
      ec = cuda::detail::copy_to_host(n->large.get(), source, n->length, why);
    } catch (const std::bad_alloc&) {
      ec = errc::registration_failed;
      why = "no memory for a host copy";
    }
    if (ec) {
      log().warn("connection: staging a {}-byte message of GPU memory failed: {}", n->length, why);
      n->large.reset();
      if (buf != buffer_pool::npos) fab_->put_buffer(buf);
      send_waiting_.remove(n);
      complete(n, post, ec);
      return start_result::started;
    }
    source = n->large.get();
  }
  if (!eager) {
    try {
      n->mr = fab_->register_releasing([&] {
        return cuda::detail::register_any(*fab_->device, *fab_->pd, const_cast<void*>(source), n->length,
                                          transport::access::remote_read, from_device && !staged);
      });
    } catch (const std::system_error& e) {
      log().warn("connection: registering a {}-byte rendezvous source failed: {}", n->length, e.what());
      if (buf != buffer_pool::npos) fab_->put_buffer(buf);
      send_waiting_.remove(n);
      complete(n, post, e.code());
      return start_result::started;
    }
  }
  if (n->stalled_buffer && buffer_timer_armed_) buffer_timer_.cancel();
  std::byte* out = stage_send(slot_kind::message, buf, nullptr, static_cast<std::uint32_t>(wire));
  --credits_;
  protocol::header h{eager ? protocol::msg_type::eager : protocol::msg_type::rts, 0, take_owed(), 0};
  protocol::encode(h, out);
  if (eager) {
    std::byte* p = out + protocol::kHeaderSize;
    for (std::uint8_t i = 0; i < n->nbufs && !from_device; ++i) {  // (from GPU memory: copied above)
      std::memcpy(p, n->bufs[i].data(), n->bufs[i].size());
      p += n->bufs[i].size();
    }
  } else {
    n->cookie = next_cookie_++;
    if (next_cookie_ == 0) next_cookie_ = 1;
    protocol::encode(protocol::rts_body{n->length, reinterpret_cast<std::uint64_t>(source), n->mr->rkey(),
                                        n->cookie},
                     out + protocol::kHeaderSize);
  }
  send_waiting_.remove(n);
  if (eager) {
    ++stats_.eager_sends;
    if (inl) ++stats_.inline_sends;
    copied_send_done(n, post);
  } else {
    ++stats_.rendezvous_sends;
    n->phase = op_phase::posted;
    active_.push_back(n);
  }
  schedule();
  return start_result::started;
}

bool connection_impl::start_split(op_node* n, bool post) noexcept {
  // All pieces or none: each needs a credit (one more stays for control
  // messages), a send queue slot and a pool buffer, now. Else the message
  // goes by rendezvous, which needs one of each.
  const std::uint64_t piece = eager_limit_;
  const std::uint64_t k = (n->length + piece - 1) / piece;
  if (k > kMaxSplitPieces || credits_ < static_cast<std::int64_t>(k) + 1 || sq_free() < k) return false;
  std::array<std::uint32_t, kMaxSplitPieces> bufs;
  for (std::uint64_t i = 0; i < k; ++i) {
    bufs[i] = fab_->pool->try_get();
    if (bufs[i] == buffer_pool::npos) {
      while (i > 0) fab_->put_buffer(bufs[--i]);
      return false;
    }
  }
  if (n->stalled_buffer && buffer_timer_armed_) buffer_timer_.cancel();
  const auto* src = static_cast<const std::byte*>(n->bufs[0].data());
  for (std::uint64_t i = 0, off = 0; i < k; ++i) {
    const std::uint64_t len = std::min(piece, n->length - off);
    std::byte* out = stage_send(slot_kind::message, bufs[i], nullptr,
                                static_cast<std::uint32_t>(protocol::kHeaderSize + len));
    --credits_;
    protocol::encode({protocol::msg_type::split, 0, take_owed(), static_cast<std::uint32_t>(n->length)}, out);
    std::memcpy(out + protocol::kHeaderSize, src + off, static_cast<std::size_t>(len));
    off += len;
  }
  send_waiting_.remove(n);
  ++stats_.split_sends;
  stats_.split_pieces += k;
  copied_send_done(n, post);
  schedule();
  return true;
}

// An eager or split send: its bytes are in the send queue's buffers.
void connection_impl::copied_send_done(op_node* n, bool post) noexcept {
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
  wait_for_buffer();
  arm_buffer_timer();
  return false;
}

void connection_impl::wait_for_buffer() noexcept {
  if (waiting_buffer) return;
  waiting_buffer = true;
  fab_->wait_for_buffer(this);
}

bool connection_impl::enqueue_control(protocol::msg_type type, std::uint8_t status, std::uint32_t aux) noexcept {
  if (credits_ < 1 || sq_free() == 0) return false;
  const bool inl = can_inline_control(protocol::kHeaderSize);
  std::uint32_t buf = buffer_pool::npos;
  if (!inl) {
    buf = fab_->pool->try_get();
    if (buf == buffer_pool::npos) {
      wait_for_buffer();
      return false;
    }
  }
  op_node* op = type == protocol::msg_type::close ? close_op_ : nullptr;
  std::byte* out = stage_send(slot_kind::control, buf, op, protocol::kHeaderSize);
  --credits_;
  protocol::encode(protocol::header{type, status, take_owed(), aux}, out);
  if (type == protocol::msg_type::credit) ++stats_.credit_messages;
  schedule();
  return true;
}

std::uint32_t connection_impl::cookie_of(const fin_entry& f) const noexcept {
  return f.held ? protocol::decode_rts(fab_->pool->data(f.word) + protocol::kHeaderSize).cookie : f.word;
}

void connection_impl::post_fins() noexcept {
  std::size_t done = 0;
  while (done < fins_.size() &&
         enqueue_control(fins_[done].type,
                         fins_[done].type == protocol::msg_type::fin
                             ? static_cast<std::uint8_t>(fins_[done].status)
                             : static_cast<std::uint8_t>(protocol::withdraw_status::too_late),
                         cookie_of(fins_[done]))) {
    if (fins_[done].held) repost(fins_[done].word);
    ++done;
  }
  fins_.erase(fins_.begin(), fins_.begin() + static_cast<std::ptrdiff_t>(done));
}

void connection_impl::withdraw(op_node* n) noexcept {
  if (n->operand != 0 || (state_ != state::open && state_ != state::closing)) return;  // (asked already)
  n->operand = 1;
  n->deadline = std::chrono::steady_clock::now();
  ++withdrawing_;
  ++withdraw_unsent_;
  fab_->want_tick(withdraw_grace());
  schedule();
}

void connection_impl::post_withdraws() noexcept {
  // In the order asked; what finds no credit waits for the next pass.
  std::uint32_t left = 0;
  for (op_node* p = active_.head; p != nullptr; p = p->next) {
    if (p->kind != op_kind::send || p->operand != 1) continue;
    if (left == 0 && enqueue_control(protocol::msg_type::withdraw, 0, p->cookie)) {
      p->operand = 2;
      p->deadline = std::chrono::steady_clock::now();  // (the grace counts from here on)
    } else {
      ++left;
    }
  }
  withdraw_unsent_ = left;
}

// sq_free() borrows the doorbell batch to see the room there is; a pass
// that queued nothing in the end (an operation blocked for credits, a
// buffer or memory, or one that failed) gives it back at once, so that no
// idle connection holds one.
bool connection_impl::progress_sends(bool post) noexcept {
  const bool all = progress_sends_body(post);
  return_batch();  // (only when nothing is queued in it)
  return all;
}

bool connection_impl::progress_sends_body(bool post) noexcept {
  if (state_ != state::open && state_ != state::closing) return false;
  if (!fins_.empty()) post_fins();
  if (withdraw_unsent_ != 0) post_withdraws();
  continue_reads();
  while (!send_waiting_.empty()) {
    if (try_start(send_waiting_.head, post) != start_result::started) return false;
  }
  if (state_ == state::closing && close_op_ != nullptr && !close_sent_ && fins_.empty() && withdraw_unsent_ == 0) {
    bool rendezvous_out = false;
    for (op_node* p = active_.head; p != nullptr; p = p->next) rendezvous_out |= p->kind == op_kind::send;
    if (!rendezvous_out && enqueue_control(protocol::msg_type::close, 0, 0)) close_sent_ = true;
  }
  return true;
}

void connection_impl::maybe_send_credits() noexcept {
  if (state_ != state::open && state_ != state::closing) return;
  if (auth_ != nullptr) return;  // nothing but the auth message before the peer is authenticated
  // (One credit alone is worth a message only when the peer is down to
  // its control credit: it could send nothing until our application let go
  // of what it holds, or until a heartbeat. A shared receive queue grants
  // one at a time; the connecting side's first word takes one of a short
  // window. Not when the credit came from the peer's own lone credit
  // message, without a shared receive queue: two idle peers would pass it
  // back and forth without end.)
  if (peer_closed_ || owed_ == 0) return;
  if (owed_ < 2 && (peer_view_ > 1 || (!srq_ && owed_ <= owed_echo_))) return;
  // Half the window back at once (with a shared receive queue, half of
  // what the peer holds now), or whatever there is when the peer is down
  // to the credit kept for control messages.
  const std::int64_t half = srq_ ? promised_ / 2 : static_cast<std::int64_t>(opt_.credits / 2u);
  if (static_cast<std::int64_t>(owed_) >= half || peer_view_ <= 1) (void)enqueue_control(protocol::msg_type::credit, 0, 0);
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
  if (fab_->in_completion > 0 || fab_->in_handlers > 0) urgent = true;
  if (dirty) return;
  dirty = true;
  if (!ringing) fab_->schedule_flush(this);
}

void connection_impl::issue(op_node* n, void (connection_impl::*start)(op_node*)) {
  if (issue_turn != fab_->turns) {
    // The turn that last queued work is over: one operation extends the
    // streak of lone ones, more end it.
    if (issued != 0) lone_turns = issued == 1 ? std::min(lone_turns + 1, kLoneTurns) : 0;
    issue_turn = fab_->turns;
    issued = 0;
  }
  // (Nothing else queued, !dirty: also no reply waiting at a doorbell,
  // at_doorbell_, which is always dirty.)
  const bool first = lone_turns == kLoneTurns && issued == 0 && !dirty && fab_->in_completion == 0 &&
                     fab_->in_handlers == 0 && fab_->posted_completions == 0;
  const std::uint64_t queued = sq_queued_;
  ringing = first;
  try {
    (this->*start)(n);
  } catch (...) {
    ringing = false;
    if (first && dirty) {
      dirty = false;
      schedule();  // the flush the start left to this call
    }
    throw;
  }
  // Only what queued work requests counts (not a flush, nor a send that
  // waits for credits).
  if (sq_queued_ != queued) ++issued;
  if (!first) return;
  ringing = false;
  if (dirty) flush();
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
  if (posted.empty()) return;
  fabric_state& f = *fab_;  // (read before the handlers run)
  ++f.in_handlers;
  while (op_node* n = posted.pop_front()) complete(n, false, {}, static_cast<std::size_t>(n->length));
  --f.in_handlers;
}

void connection_impl::flush_now() noexcept {
  // During setup the connect/accept thread owns the queue pair: what is
  // queued waits for on_connected.
  if (qp_ == nullptr || state_ == state::setup) return;
  if (!send_waiting_.empty() || !fins_.empty() || withdraw_unsent_ != 0 || (close_op_ != nullptr && !close_sent_)) {
    progress_sends(true);
  }
  if (!recv_batch_.empty() && (state_ == state::closed || state_ == state::failed)) {
    drop_unposted_receives();  // the queue pair is in error: see there
  }
  if (!recv_batch_.empty()) {
    std::size_t bad = 0;
    if (auto ec = qp_->post_recv(recv_batch_, &bad)) {
      log().error("connection qp {}: post_recv of {} receives failed at {}: {}", qp_num(), recv_batch_.size(), bad,
                  ec.message());
      const bool partial = took_part(ec, bad, recv_batch_.size());
      if (partial) {
        stats_.recv_posts += bad;
        rq_posted_ += bad;
      }
      on_post_failed(ec, partial);
      return;
    }
    stats_.recv_posts += recv_batch_.size();
    rq_posted_ = rq_queued_;
    recv_batch_.clear();
  }
  maybe_send_credits();
  if (batch_failed_) {
    fail(std::make_error_code(std::errc::not_enough_memory));
    return;
  }
  if (batch_ == nullptr || batch_->wrs.empty()) {
    return_batch();
    return;
  }
  std::vector<transport::work_request>& batch = batch_->wrs;
  const std::uint32_t k = opt_.signal_interval;
  // A doorbell's last request is signaled too, unless it may stay an
  // uncovered tail: an open connection's message sent inline with no
  // operation (no pool buffer to give back, its handler ran at the
  // doorbell), with every unsignaled request since the last signaled one
  // as lone, no flush waiting, and a slot of the send queue left free
  // after this post (for a marker: cover_tail, try_start_onesided). A
  // ping-pong of small messages then takes one send completion per
  // signal_interval messages instead of one per message.
  const bool room_after = sq_queued_ - sq_retired_ < sq_.size();
  std::size_t last_signaled = batch.size();
  for (std::size_t i = 0; i < batch.size(); ++i) {
    sq_slot& s = sq_[ring_slot(sq_posted_ + i, sq_.size())];
    const bool lone = s.kind == slot_kind::message && s.op == nullptr && s.buffer == buffer_pool::npos;
    const bool tail_may_wait =
        lone && lone_since_signal_ && room_after && flushes_.empty() && state_ == state::open;
    const bool must = s.kind == slot_kind::read_last || s.op != nullptr || (i + 1 == batch.size() && !tail_may_wait);
    if (must || ++since_signal_ >= k) {
      since_signal_ = 0;
      lone_since_signal_ = true;
      last_signaled = i;
      s.signaled = true;
      batch[i].signaled = true;
      ++stats_.signaled;
      fab_->busy();
    } else {
      lone_since_signal_ = lone_since_signal_ && lone;
      batch[i].signaled = false;
    }
  }
  std::size_t bad = 0;
  if (auto ec = qp_->post_send(batch, &bad)) {
    log().error("connection qp {}: post_send of {} requests failed at {}: {}", qp_num(), batch.size(), bad,
                ec.message());
    const bool partial = took_part(ec, bad, batch.size());
    if (partial) {
      stats_.posts += bad;
      ++stats_.doorbells;
      sq_posted_ += bad;
    }
    on_post_failed(ec, partial);
    return;
  }
  stats_.posts += batch.size();
  ++stats_.doorbells;
  if (last_signaled != batch.size()) sq_signaled_end_ = sq_posted_ + last_signaled + 1;
  sq_posted_ = sq_queued_;
  batch.clear();
  return_batch();
}

void connection_impl::queue_tail_marker(transport::work_request& wr) noexcept {
  // A zero-length RDMA WRITE names no memory: the responder checks no key
  // or address for zero bytes (IBTA C9-88; rxe, siw and the tcp provider
  // alike, a conformance case). Signaled, its completion retires every
  // request before it.
  wr.op = transport::opcode::write;
  wr.inline_data = false;
  wr.remote_addr = 0;
  wr.rkey = 0;
  wr.signaled = true;
  // (Not counted in tx_count_: nothing of it reaches the peer's
  // application, so it is no heartbeat.)
}

void connection_impl::probe() noexcept {
  // One at a time: while a signaled request is outstanding, its answer
  // (or its silence) says as much. A tail posted unsignaled has none due:
  // the probe retires it too.
  if (qp_ == nullptr || sq_queued_ != sq_posted_ || sq_retired_ < sq_signaled_end_) return;
  if (sq_free() == 0) {
    return_batch();
    return;
  }
  queue_tail_marker(next_wr(slot_kind::none, buffer_pool::npos, nullptr, {}));
  ++stats_.heartbeats;
  schedule();
}

void connection_impl::cover_tail() noexcept {
  // The queue pair is in error: it completes, flushed, what it has not
  // executed, but a request it executed unsignaled never completes. A
  // signaled request posted now is flushed behind the tail (the way
  // ib_drain_sq drains): its completion retires the tail. (Requests still
  // queued are posted with a signaled last one: flush_now leaves a tail
  // only on an open connection.)
  if (qp_ == nullptr || sq_queued_ != sq_posted_ || !uncovered_tail()) return;
  transport::work_request wr{};
  wr.wr_id = reactor::persistent_id(send_base_, static_cast<std::uint32_t>(sq_posted_ & kTagMask));
  queue_tail_marker(wr);
  std::error_code ec = errc::queue_full;  // (flush_now leaves a slot free behind a tail: never so)
  if (sq_posted_ - sq_retired_ >= sq_.size() || (ec = qp_->post_send({&wr, 1}))) {
    log().warn("connection qp {}: no request could follow {} unsignaled ones in error ({}): they retire unanswered",
               qp_num(), sq_posted_ - sq_signaled_end_, ec.message());
    settle_tail_ = true;
    settle_tail(true);
    return;
  }
  sq_[ring_slot(sq_posted_, sq_.size())] = {buffer_pool::npos, slot_kind::none, nullptr, true};
  cover_waits_ = true;
  cover_from_ = sq_signaled_end_;
  cover_at_ = std::chrono::steady_clock::now();
  fab_->want_tick(kPeerCloseGrace);
  sq_queued_ = sq_posted_ = sq_signaled_end_ = sq_posted_ + 1;
  ++stats_.posts;
  ++stats_.doorbells;
  ++stats_.signaled;
  fab_->busy();
}

void connection_impl::settle_tail(bool post) noexcept {
  // Only once everything signaled is back (a flushed completion of one of
  // them may still name a request before the tail). The tail's requests
  // hold nothing: they only free their slots. (One the device had not
  // executed may still complete, flushed: on_send_completion_body drops
  // it as not outstanding while the connection lives.) The connection has
  // ended: what still waits (a flush over the tail, an operation parked
  // behind it) ends with its error.
  if (sq_retired_ < sq_signaled_end_) return;
  settle_tail_ = false;
  while (sq_retired_ < sq_posted_) {
    const sq_slot s = std::exchange(sq_[ring_slot(sq_retired_++, sq_.size())], {});
    if (s.signaled) fab_->idle();  // (a marker that never came back)
  }
  const std::error_code ec = error_ ? error_ : std::error_code(errc::connection_closed);
  while (op_node* n = flushes_.pop_front()) complete(n, post, ec);
  complete_parked(post);
}

bool connection_impl::took_part(std::error_code ec, std::size_t bad, std::size_t size) noexcept {
  // A device's error past the provider's checks (a system error code, not
  // one of ours) leaves the requests before *bad posted, as ibv_post_send
  // and ibv_post_recv do (provider contract).
  return ec.category() != error_category() && bad > 0 && bad <= size;
}

void connection_impl::on_post_failed(std::error_code ec, bool partial) noexcept {
  if (!partial) {
    fail(ec);
    drop_unposted();  // (a closed connection's: fail() does nothing then)
    cover_tail();     // (a closed connection's tail: the batch that would have covered it is gone)
    // What waited on the work just dropped ends too (a closed connection's:
    // fail() ended a live one's): a flush that covers it now, with the
    // error; an operation parked on it once what is posted is back.
    const std::error_code why = error_ ? error_ : std::error_code(errc::connection_closed);
    for (op_node* n = flushes_.head; n != nullptr;) {
      op_node* next = n->next;
      if (n->operand > sq_posted_) {
        flushes_.remove(n);
        complete(n, true, why);
      }
      n = next;
    }
    complete_parked(true);
    return;
  }
  // What the device took is its own until it lets go, but may never all
  // come back: a request that succeeded unsignaled leaves no completion,
  // and nothing signaled follows it. So the queue pair goes (the device
  // lets go of all of it), as when the completion queue is lost; what it
  // held retires in a handler of its own (not inside this post, which may
  // run in an initiating function), and completions it left in the queue
  // are ignored (the queue pair is gone).
  log().warn("connection qp {}: the device took part of a post: the queue pair goes", qp_num());
  fail_without_queue_pair(ec);
  try {
    asio::post(fab_->io, [self = shared_from_this()] {
      self->retire_through(self->sq_posted_ - 1, transport::wc_status::work_request_flushed, true);
      self->maybe_release_self();
    });
  } catch (...) {
    // No memory for the handler (the device's error may be the same want):
    // retired here then, the queue pair gone already. (maybe_release_self
    // is left to the caller's next event: this call's caller still runs.)
    retire_through(sq_posted_ - 1, transport::wc_status::work_request_flushed, true);
  }
}

// Work requests queued but never posted (the connection failed first).
void connection_impl::drop_unposted() noexcept {
  for (std::uint64_t i = sq_posted_; i < sq_queued_; ++i) {
    sq_slot s = std::exchange(sq_[ring_slot(i, sq_.size())], {});
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
  if (batch_ != nullptr) batch_->wrs.clear();
  reset_staging();
  return_batch();
  for (op_node* p = parked_.head; p != nullptr; p = p->next) p->operand = std::min(p->operand, sq_posted_);
  drop_unposted_receives();
}

// Receives queued but not posted (reposts waiting for the next flush) go
// back to the pool once the queue pair is in error. Nothing can arrive in
// them, and a receive posted after the move to error may never complete:
// rxe (Linux 6.1) flushes what the queue held when it failed but leaves a
// later one, and the connection would wait for it forever before releasing.
void connection_impl::drop_unposted_receives() noexcept {
  for (std::uint64_t i = rq_posted_; i < rq_queued_; ++i) fab_->put_buffer(rq_[ring_slot(i, rq_.size())]);
  rq_queued_ = rq_posted_;
  recv_batch_.clear();
}

std::uint64_t connection_impl::full_seq(std::uint32_t tag, std::uint64_t base) const noexcept {
  std::uint64_t seq = (base & ~std::uint64_t{kTagMask}) | tag;
  if (seq < base) seq += std::uint64_t{kTagMask} + 1;
  return seq;
}

void connection_impl::retire_through(std::uint64_t seq, transport::wc_status status, bool every_one) noexcept {
  const std::uint64_t first_failed = every_one ? sq_retired_ : seq;
  while (sq_retired_ <= seq && sq_retired_ < sq_posted_) {
    const std::uint64_t i = sq_retired_;
    const std::size_t slot = ring_slot(i, sq_.size());
    sq_slot s = std::exchange(sq_[slot], {});
    ++sq_retired_;
    if (s.buffer != buffer_pool::npos) fab_->put_buffer(s.buffer);
    if (s.signaled) fab_->idle();
    const transport::wc_status st = (i == seq || every_one) ? status : transport::wc_status::success;
    if (s.kind == slot_kind::read_last && s.op != nullptr) on_read_done(s.op, st);
    if (s.kind == slot_kind::onesided_last && s.op != nullptr) on_onesided_done(s.op, st, slot, false);
    if (s.kind == slot_kind::control && s.op != nullptr && s.op == close_op_) {
      // Acknowledged; or flushed because both sides closed at once and the
      // peer, its own close acknowledged, tore the queue pair down first:
      // its close arrived, so it has closed too.
      if (st == transport::wc_status::success || peer_closed_) on_close_acked();
    }
  }
  if (refusal_seq_ < sq_retired_ && state_ != state::failed && state_ != state::closed) {
    fail(errc::authentication_failed);  // our refusal of the peer's proof is out
  }
  // A flush covers the work requests before its target: those before a
  // failed one succeeded; the others cover it and end with its error. (A
  // failing connection ended them in fail(); one that is ending, closed or
  // closed by its peer, does not fail, and nothing else would end them.
  // With every_one none before the first retired here succeeded: that
  // matters to a closed connection's flushes, as fail() ended a live one's.)
  complete_flushes(status == transport::wc_status::success ? sq_retired_ : std::min(first_failed, sq_retired_));
  if (status != transport::wc_status::success && !flushes_.empty()) {
    std::error_code ec = error_;
    if (!ec) ec = status == transport::wc_status::work_request_flushed ? errc::connection_closed : make_error_code(status);
    while (op_node* n = flushes_.pop_front()) complete(n, false, ec);
  }
  complete_parked(false);
  if (settle_tail_) settle_tail(false);  // (what is left is the tail: the flushes still waiting cover it)
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
  if (reactor_gave_up(wc)) {
    // The reactor gave up on the completion queue: everything outstanding
    // is lost, none known to have succeeded (a put may have landed, an
    // atomic's old value never came back). The queue pair goes first: the
    // device lets go of every buffer its work requests name (a get's or
    // atomic's target among them) before the operations end.
    on_cq_lost(make_error_code(wc.status));
    retire_through(sq_posted_ - 1, transport::wc_status::work_request_flushed, true);
    maybe_release_self();
    return;
  }
  if (qp_ == nullptr) return;  // left in the queue by a queue pair that is gone (on_post_failed)
  if (seq >= sq_posted_) {
    // Not one of ours outstanding (one retired already, or never counted
    // as posted): retiring through it would end operations the device may
    // still hold.
    ++stats_.stray_completions;
    log().error("connection qp {}: send completion #{} ({}) names no work request outstanding (#{} to #{}); dropped",
                qp_num(), seq, transport::to_string(wc.status), sq_retired_, sq_posted_);
    return;
  }
  if (wc.status != transport::wc_status::success) {
    // Failed first: the handlers that retiring runs see a failed connection.
    (void)fail_unless_ending(wc, "send");
  }
  retire_through(seq, wc.status);
  progress_sends(false);
  deliver(false);
  maybe_release_self();
}

}  // namespace anydoor::detail
