// The connection engine's receive side: posted receives, incoming messages,
// rendezvous reads, delivery to the waiting receives, and the peer's close.
#include "connection_impl.hpp"

#include <anydoor/error.hpp>

#include "cuda/driver.hpp"
#include "cuda/register.hpp"
#include "log.hpp"

#include <boost/asio/post.hpp>

#include <algorithm>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <utility>

namespace anydoor::detail {

// ---------------------------------------------------------------- receiving

void connection_impl::queue_recv(std::uint32_t buffer) noexcept {
  const std::size_t slot = ring_slot(rq_queued_, rq_.size());
  rq_[slot] = buffer;
  rq_sge_[slot] = fab_->pool->slice(buffer, 0, fab_->recv_buffer);
  recv_batch_.push_back({reactor::persistent_id(recv_base_, static_cast<std::uint32_t>(rq_queued_ & kTagMask)),
                         {&rq_sge_[slot], 1}});
  ++rq_queued_;
}

void connection_impl::repost(std::uint32_t buffer) noexcept {
  if (qp_ == nullptr || state_ == state::failed || state_ == state::closed || peer_closed_) {
    release_received(buffer);
    return;
  }
  if (srq_) {
    --held_;
    fab_->srq_repost(buffer);
    const std::uint32_t g = grant();
    if (g == 0) {
      // The credit stays with the queue (the window shrinks); one owed
      // earlier still goes out if the peer is down to its control credit.
      if (owed_ > 0 && peer_view_ <= 1) schedule();
      return;
    }
    owed_ += g;
    promised_ += g;
    fab_->srq_promised += g;
  } else {
    queue_recv(buffer);
    ++owed_;
  }
  schedule();
}

void connection_impl::release_received(std::uint32_t buffer) noexcept {
  if (srq_) {
    --held_;
    fab_->srq_repost(buffer);
  } else {
    fab_->put_buffer(buffer);
  }
}

std::uint32_t connection_impl::grant() noexcept {
  const auto window = static_cast<std::int64_t>(opt_.credits);
  const auto floor = std::min<std::int64_t>(window, fabric_state::kSrqMinCredits);
  const auto spare = static_cast<std::int64_t>(fab_->srq_spare());
  // What the peer may still send plus what we hold must fit the window
  // (the inbox's size): a slow reader gets nothing until it gives back.
  const std::int64_t room = window - promised_ - held_;
  if (room <= 0 || spare == 0) return 0;
  // Back to the floor, counting what it holds (a connection's share of the
  // queue is its grants plus the buffers it holds, as without a shared
  // queue its receives are the credits minus what it holds: so the floors
  // of max_connections connections always fit). The buffer just re-posted
  // is spare, so a connection holding nothing gets its floor back at once:
  // a window never dries up.
  std::int64_t g = std::min(std::max<std::int64_t>(floor - promised_ - held_, 0), spare);
  // With room to spare beyond the floors of the connections the fabric may
  // still accept (max_connections, so that growth never locks a new
  // connection out): this credit back and one more (a busy connection's
  // window grows by one per message). Else nothing above the floor: the
  // window shrinks toward it, to the queue's benefit.
  const std::uint64_t may_come =
      fab_->options.max_connections > fab_->open_connections ? fab_->options.max_connections - fab_->open_connections : 0;
  const auto reserve = static_cast<std::int64_t>(may_come * fabric_state::kSrqMinCredits);
  if (spare > reserve) g = std::max(g, std::min<std::int64_t>(2, spare - reserve));
  return static_cast<std::uint32_t>(std::min(g, room));
}

void connection_impl::on_srq_completion(const transport::completion& wc, std::uint32_t buffer) noexcept {
  auto keep = shared_from_this();
  ++fab_->in_completion;
  if (wc.status != transport::wc_status::success) {
    fab_->srq_repost(buffer);
    // verbs reuses queue pair numbers: a flushed receive of a destroyed
    // queue pair may name ours. Only our own queue pair's failure counts.
    if (qp_ != nullptr && qp_->state() == transport::qp_state::error) {
      if (promised_ > 0) {
        --promised_;
        --fab_->srq_promised;
      }
      ++rx_count_;
      on_receive_failed(wc);
    } else {
      log().debug("connection qp {}: a failed receive of an earlier queue pair with this number ({}); ignored",
                  qpn_, transport::to_string(wc.status));
    }
  } else if (promised_ <= 0) {
    // More messages than credits granted: they took receives granted to
    // other connections.
    // (Once: a burst behind the first one arrives after the connection
    // failed, and a hostile peer must not flood the log.)
    if (state_ != state::failed && state_ != state::closed) {
      log().warn("connection qp {}: the peer sent more messages than it had credits", qpn_);
    }
    fab_->srq_repost(buffer);
    fail(errc::protocol_error);
  } else {
    --promised_;
    --fab_->srq_promised;
    ++held_;
    ++rx_count_;
    if (state_ == state::setup && qp_ != nullptr) qp_->note_peer_message();  // (the accept may wait for it)
    handle_message(buffer, wc.byte_len);
    // The peer is down to its control credit and we owe it some (a short
    // queue grants one at a time): the flush sends them (maybe_send_credits).
    if (owed_ > 0 && peer_view_ <= 1 && qp_ != nullptr) schedule();
  }
  progress_sends(false);
  deliver(false);
  maybe_release_self();
  --fab_->in_completion;
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
  if (reactor_gave_up(wc)) {
    on_cq_lost(make_error_code(wc.status));
    maybe_release_self();
    return;
  }
  if (qp_ == nullptr) return;  // left in the queue by a queue pair that is gone (on_post_failed)
  const std::uint64_t seq = full_seq(reactor::tag_of(wc.wr_id), rq_done_);
  if (seq != rq_done_ || rq_done_ >= rq_posted_) {
    ++stats_.stray_completions;
    log().error("connection qp {}: receive completion out of order (#{} expected #{}, {} posted); dropped",
                qp_num(), seq, rq_done_, rq_posted_);
    return;
  }
  const std::uint32_t buffer = rq_[ring_slot(seq, rq_.size())];
  ++rq_done_;
  ++rx_count_;
  if (wc.status != transport::wc_status::success) {
    release_received(buffer);
    on_receive_failed(wc);
  } else {
    if (state_ == state::setup && qp_ != nullptr) qp_->note_peer_message();  // (the accept may wait for it)
    handle_message(buffer, wc.byte_len);
  }
  progress_sends(false);
  deliver(false);
  maybe_release_self();
}

void connection_impl::on_receive_failed(const transport::completion& wc) noexcept {
  if (fail_unless_ending(wc, "receive") && peer_closed_ && state_ != state::failed && state_ != state::closed) {
    state_ = state::closed;  // the peer tore the queue pair down after its close
    error_ = errc::connection_closed;
    revoke_windows();
    park_partial_reads();
    begin_drain();
    end_auth(error_);
  }
}

void connection_impl::push_inbox(const inbox_entry& e) noexcept {
  if (inbox_tail_ - inbox_head_ >= inbox_.size()) {
    release_received(e.buffer);
    fail(errc::protocol_error);
    return;
  }
  inbox_[ring_slot(inbox_tail_++, inbox_.size())] = e;
}

void connection_impl::handle_message(std::uint32_t buffer, std::uint32_t length) noexcept {
  const std::byte* data = fab_->pool->data(buffer);
  protocol::header h;
  if (length > fab_->recv_buffer || !protocol::decode({data, length}, h)) {
    log().warn("connection qp {}: malformed message ({} bytes, type {}) from the peer", qp_num(), length,
               length > 0 ? std::to_integer<int>(data[0]) : -1);
    release_received(buffer);
    fail(errc::protocol_error);
    return;
  }
  credits_ += h.credits;
  --peer_view_;
  if (state_ != state::setup && peer_view_ < 0) {
    // A message past the credits we gave: its receive was posted only
    // because we re-posted others (an honest peer counts what we return,
    // and our count of its credits is never below its own). Taken, such a
    // peer could queue fins and credit replies without bound while
    // returning none of ours. (During setup the hello's grant is counted
    // only by on_connected: the next message checks what came before.)
    log().warn("connection qp {}: the peer sent past the credits it was given ({} over)", qp_num(), -peer_view_);
    release_received(buffer);
    fail(errc::protocol_error);
    return;
  }
  if (state_ != state::setup && credits_ > static_cast<std::int64_t>(peer_.max_credits)) {
    log().warn("connection qp {}: the peer returned more credits than its window ({} > {})", qp_num(),
               credits_, peer_.max_credits);
    release_received(buffer);
    fail(errc::protocol_error);
    return;
  }
  if (h.type == protocol::msg_type::auth) {
    if (state_ == state::setup && early_auth_ == buffer_pool::npos) {  // before on_connected: it waits for it
      early_auth_ = buffer;
      early_auth_header_ = h;
      return;
    }
    handle_auth(h, buffer);
    return;
  }
  // Before the peer has proven the token nothing but its proof is taken:
  // during setup (on_connected has not run yet) the fabric says whether it
  // will have to.
  if (auth_ != nullptr || (state_ == state::setup && fab_->auth)) {
    log().warn("connection qp {}: a message (type {}) before authentication", qp_num(),
               static_cast<int>(h.type));
    release_received(buffer);
    fail(errc::protocol_error);
    return;
  }
  // Between the pieces of a split message the peer sends nothing but more
  // pieces, credits and fins (it stages the pieces all at once).
  if (split_left_ != 0 && h.type != protocol::msg_type::split && h.type != protocol::msg_type::credit &&
      h.type != protocol::msg_type::fin && h.type != protocol::msg_type::withdraw) {
    log().warn("connection qp {}: a message (type {}) inside a split one ({} of its {} bytes still to come)",
               qp_num(), static_cast<int>(h.type), split_left_, split_total_);
    release_received(buffer);
    fail(errc::protocol_error);
    return;
  }
  switch (h.type) {
    case protocol::msg_type::auth: break;  // above
    case protocol::msg_type::split: {
      // Pieces of one message, consecutive: the first says how long it is
      // (at most 64 of our receive buffers, as the sender splits), the
      // others must say the same, and the last brings it to that.
      const std::uint32_t piece = length - static_cast<std::uint32_t>(protocol::kHeaderSize);
      const bool first = split_left_ == 0;
      const std::uint64_t most =
          std::min<std::uint64_t>(opt_.max_message, kMaxSplitPieces * (fab_->recv_buffer - protocol::kHeaderSize));
      if ((first && (h.aux == 0 || h.aux > most)) || (!first && h.aux != split_total_) ||
          piece > (first ? h.aux : split_left_)) {
        log().warn("connection qp {}: a bad piece of a split message ({} bytes of {}, {} still to come)",
                   qp_num(), piece, h.aux, split_left_);
        release_received(buffer);
        fail(errc::protocol_error);
        return;
      }
      if (first) {
        split_total_ = h.aux;
        split_left_ = h.aux;
      }
      split_left_ -= piece;
      push_inbox({.buffer = buffer, .length = length, .split_total = split_total_, .split_last = split_left_ == 0});
      return;
    }
    case protocol::msg_type::eager:
    case protocol::msg_type::rts: {
      std::uint32_t cookie = 0;
      if (h.type == protocol::msg_type::rts) {
        const protocol::rts_body b = protocol::decode_rts(data + protocol::kHeaderSize);
        cookie = b.cookie;
        if (b.length == 0 || b.length > opt_.max_message) {
          log().warn("connection qp {}: rendezvous request of {} bytes (maximum {})", qp_num(), b.length,
                     opt_.max_message);
          release_received(buffer);
          fail(errc::protocol_error);
          return;
        }
      }
      push_inbox({.buffer = buffer, .length = length, .cookie = cookie, .rts = h.type == protocol::msg_type::rts});
      return;
    }
    case protocol::msg_type::fin: {
      op_node* n = active_.head;
      while (n != nullptr && !(n->kind == op_kind::send && n->cookie == h.aux)) n = n->next;
      repost(buffer);
      if (n == nullptr) {
        log().warn("connection qp {}: fin for unknown rendezvous {}", qp_num(), h.aux);
        fail(errc::protocol_error);
        return;
      }
      active_.remove(n);
      // (Before the handler runs: its buffer is the application's again. A
      // request the peer dropped unread had no READ that could come late.)
      drop_source(n, static_cast<protocol::fin_status>(h.status) != protocol::fin_status::withdrawn);
      std::error_code ec;
      // (Withdrawn only when we asked and the peer has not said it reads it;
      // withdrawing_ is recounted by watch_withdrawals.)
      const bool asked = n->operand == 2;
      switch (static_cast<protocol::fin_status>(h.status)) {
        case protocol::fin_status::ok: break;
        case protocol::fin_status::withdrawn:
          if (!asked) {
            log().warn("connection qp {}: rendezvous {} withdrawn unasked", qp_num(), h.aux);
            complete(n, false, errc::protocol_error);
            fail(errc::protocol_error);
            return;
          }
          ec = std::make_error_code(std::errc::operation_canceled);
          break;
        case protocol::fin_status::message_size: ec = errc::message_size; break;
        case protocol::fin_status::no_memory: ec = errc::peer_out_of_memory; break;
        case protocol::fin_status::read_failed: ec = errc::protocol_error; break;
        default:
          log().warn("connection qp {}: fin with unknown status {}", qp_num(), h.status);
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
    case protocol::msg_type::withdraw:
      repost(buffer);
      if (h.status == static_cast<std::uint8_t>(protocol::withdraw_status::request)) {
        withdraw_received(h.aux);
      } else {
        withdraw_refused(h.aux);
      }
      return;
    case protocol::msg_type::notify: {
      if (notes_tail_ - notes_head_ >= notes_.size()) {  // cannot happen with a conforming peer
        release_received(buffer);
        fail(errc::protocol_error);
        return;
      }
      notes_[ring_slot(notes_tail_++, notes_.size())] = buffer;  // decoded when taken (deliver_notes)
      return;
    }
    case protocol::msg_type::credit: {
      const std::uint32_t before = owed_;
      repost(buffer);
      if (h.credits > 0 && owed_ > before) owed_echo_ += owed_ - before;
      return;
    }
    case protocol::msg_type::close:
      release_received(buffer);
      on_peer_close();
      return;
  }
}

void connection_impl::handle_auth(const protocol::header& h, std::uint32_t buffer) noexcept {
  if (auth_ == nullptr || auth_->waiter == nullptr) {
    log().warn("connection qp {}: an auth message {}", qp_num(),
               auth_ == nullptr ? "after authentication (or without it)" : "after refusing the peer");
    release_received(buffer);
    fail(errc::protocol_error);
    return;
  }
  const bool client = auth_->exchange.local == auth::role::client;
  if (h.status == static_cast<std::uint8_t>(protocol::auth_status::refused)) {
    release_received(buffer);
    log().warn("connection qp {}: the peer refused our proof of the auth token", qp_num());
    fail(errc::authentication_failed);
    return;
  }
  if (h.status == static_cast<std::uint8_t>(protocol::auth_status::confirmed)) {
    repost(buffer);
    if (client || !auth_->answered) {
      log().warn("connection qp {}: an auth confirmation out of turn", qp_num());
      fail(errc::protocol_error);
      return;
    }
    end_auth({});  // the peer has checked our proof and opened its queue pair to us
    return;
  }
  if (!client && auth_->answered) {
    repost(buffer);
    log().warn("connection qp {}: a second proof of the auth token", qp_num());
    fail(errc::protocol_error);
    return;
  }
  const bool ok = auth::equal({fab_->pool->data(buffer) + protocol::kHeaderSize, protocol::kMacSize},
                              auth_->exchange.expect);
  repost(buffer);
  if (!ok) {
    log().warn("connection qp {}: the peer's proof of the auth token is wrong", qp_num());
    if (client || !send_auth(protocol::auth_status::refused)) {
      fail(errc::authentication_failed);
      return;
    }
    // The listener tells the peer why before it disconnects: once the
    // refusal is out (retire_through), or at the handshake deadline.
    refusal_seq_ = sq_queued_ - 1;
    end_auth(errc::authentication_failed);
    return;
  }
  // Proven: the queue pair admits the peer's one-sided operations (before
  // our answer or confirmation goes out: nothing the peer does after reading
  // it may find the door still shut), and the withheld credits go to the
  // peer with that message.
  if (qp_->state() == transport::qp_state::error) {
    // The peer's one-sided request before we opened (refused by the queue
    // pair) failed it: the peer broke the protocol.
    log().warn("connection qp {}: the queue pair failed before authentication completed "
               "(the peer used one-sided operations too early?)", qp_num());
    fail(errc::protocol_error);
    return;
  }
  if (auto ec = qp_->set_remote_access(transport::access::remote_write | transport::access::remote_read |
                                       transport::access::remote_atomic)) {
    log().warn("connection qp {}: opening the queue pair to the authenticated peer: {}", qp_num(), ec.message());
    fail(ec);
    return;
  }
  owed_ += std::exchange(withheld_, 0u);
  if (!send_auth(client ? protocol::auth_status::confirmed : protocol::auth_status::proof)) {
    fail(auth_send_error());
    return;
  }
  schedule();
  if (client) {
    end_auth({});
  } else {
    auth_->answered = true;  // the accept completes with the peer's confirmation
  }
}

bool connection_impl::send_auth(protocol::auth_status status) noexcept {
  if (credits_ < 1 || sq_free() == 0) return false;
  const bool proof = status == protocol::auth_status::proof;
  const auto wire = static_cast<std::uint32_t>(proof ? protocol::kAuthSize : protocol::kHeaderSize);
  std::uint32_t buf = buffer_pool::npos;
  if (!can_inline_control(wire)) {
    buf = fab_->pool->try_get();
    if (buf == buffer_pool::npos) return false;
  }
  std::byte* out = stage_send(slot_kind::control, buf, nullptr, wire);
  --credits_;
  protocol::encode(protocol::header{protocol::msg_type::auth, static_cast<std::uint8_t>(status), take_owed(), 0}, out);
  if (proof) std::memcpy(out + protocol::kHeaderSize, auth_->exchange.send.data(), protocol::kMacSize);
  schedule();
  return true;
}

void connection_impl::end_auth(std::error_code ec) noexcept {
  if (auth_ == nullptr || auth_->waiter == nullptr) return;
  if (refusal_seq_ == ~std::uint64_t{0}) setup_timer_.cancel();
  fab_->idle();  // on_connected's busy()
  // Posted: the waiter's handlers (the user's connect or accept) never run
  // inside this connection's completion handling.
  fab_->own_nonces.forget(auth_->exchange);
  asio::post(fab_->io, [w = std::move(auth_->waiter), ec, self = shared_from_this()] { w->done(ec, self); });
  if (!ec) {
    auth_.reset();
    log().debug("connection qp {}: the peer is authenticated", qp_num());
    start_liveness();  // again: the peer's silence counts from now
  }
}

void connection_impl::on_peer_close() noexcept {
  peer_closed_ = true;
  peer_closed_at_ = std::chrono::steady_clock::now();
  log().debug("connection qp {}: the peer closed", qp_num());
  // What is still unanswered when the grace runs out is flushed (liveness:
  // a tick comes within kMaxTick, which asks for the rest of the grace).
  end_waiting_sends(errc::connection_closed);
  end_waiting_staged(errc::connection_closed);  // (those under way end as their chunks are refused)
  complete_parked(true);
  end_rendezvous_sends(errc::connection_closed);
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
  revoke_windows();
  if (close_op_ != nullptr) {
    op_node* n = close_op_;
    close_op_ = nullptr;
    complete(n, false, {});
  }
  // Flush the receives: their buffers go back to the pool (those not
  // posted yet at once).
  if (qp_ != nullptr) (void)qp_->modify(transport::qp_state::error);
  drop_unposted_receives();
  park_partial_reads();
  begin_drain();
  deliver(false);
}

void connection_impl::withdraw_received(std::uint32_t cookie) noexcept {
  // After our close we send nothing more (the close ends the sender's send);
  // an ended connection sends nothing at all. (During setup the answer
  // waits with what else is queued: a fast peer's request and withdrawal
  // can come before our side of the handshake has ended.)
  if (close_sent_ || state_ == state::failed || state_ == state::closed) return;
  // Still in the inbox: no receive has started reading it (start_read
  // takes it out), so it goes unread, and the others close up behind it.
  const std::size_t cap = inbox_.size();
  for (std::uint64_t i = inbox_head_; i < inbox_tail_; ++i) {
    const inbox_entry& e = inbox_[ring_slot(i, cap)];
    if (!e.rts || e.cookie != cookie) continue;
    const std::uint32_t buffer = e.buffer;
    if (i == inbox_head_) budget_blocked_ = false;  // (it was what waited for rendezvous_memory, if anything)
    for (std::uint64_t j = i; j + 1 < inbox_tail_; ++j) inbox_[ring_slot(j, cap)] = inbox_[ring_slot(j + 1, cap)];
    --inbox_tail_;
    fins_.push_back({buffer, protocol::fin_status::withdrawn, protocol::msg_type::fin, true});  // (reposted once out)
    schedule();
    return;
  }
  // Being read: the sender is told at once (once: a repeated withdraw is
  // ignored), its fin comes when the read ends. Else the read has ended and
  // its fin is out or queued (ahead of anything we would send now), or the
  // cookie is unknown: nothing to say. (op_node::operand 1 on a receive:
  // answered too late.)
  for (op_node* p = active_.head; p != nullptr; p = p->next) {
    if ((p->kind != op_kind::receive_message && p->kind != op_kind::receive_buffer) || p->cookie != cookie) continue;
    if (p->operand != 0) return;
    p->operand = 1;
    fins_.push_back({cookie, protocol::fin_status::ok, protocol::msg_type::withdraw});
    schedule();
    return;
  }
}

void connection_impl::withdraw_refused(std::uint32_t cookie) noexcept {
  // Only for a send of ours whose withdrawal we asked and that the peer
  // has not finished (its fin comes after this answer).
  for (op_node* p = active_.head; p != nullptr; p = p->next) {
    if (p->kind != op_kind::send || p->cookie != cookie) continue;
    if (p->operand != 2) break;
    p->operand = 3;  // (watch_withdrawals no longer times it)
    return;
  }
  log().warn("connection qp {}: an answer to a withdrawal of rendezvous {} never asked", qp_num(), cookie);
  fail(errc::protocol_error);
}

// Starts reading a rendezvous message: its destination is registered (and,
// for async_receive(), allocated within the rendezvous_memory budget), then
// the READs go out in fragments as the send queue has room.
bool connection_impl::start_read(op_node* n, const protocol::rts_body& b) noexcept {
  if (sq_free() == 0) return false;
  const bool allocate = n->kind == op_kind::receive_message;
  if (allocate && rendezvous_held_ + b.length > opt_.rendezvous_memory) {  // after earlier reads
    budget_blocked_ = true;
    return false;
  }
  // Off the waiting list before it joins another (the lists share the node's links).
  recv_waiting_.remove(n);
  try {
    // Into GPU memory where the device does not reach it (or with
    // gpu_staging): read into host memory, copied in when complete.
    const bool staged = !allocate && n->device_mask != 0 &&
                        (fab_->options.gpu_staging || !cuda::detail::reaches_gpu_memory(*fab_->device));
    std::byte* dst;
    std::size_t span = b.length;  // what is registered
    if (!allocate && !staged) {
      dst = static_cast<std::byte*>(n->dest.data());
    } else if (allocate && fab_->take_block(b.length, n->large, n->mr)) {
      dst = n->large.get();  // a kept block, registered
    } else {
      // A block for async_receive is a multiple of 4 KiB, kept when the message is
      // released (fabric_state::keep_block).
      if (allocate) span = fabric_state::block_size(b.length);
      n->large.reset(new std::byte[span]);
      dst = n->large.get();
    }
    if (n->mr == nullptr) {
      n->mr = fab_->register_releasing([&] {
        return cuda::detail::register_any(*fab_->device, *fab_->pd, dst, span, transport::access::local_write,
                                          !allocate && !staged && n->device_mask != 0);
      });
    }
  } catch (const std::exception& e2) {
    log().warn("connection: cannot receive a {}-byte message: {}", b.length, e2.what());
    n->mr.reset();
    n->large.reset();
    return true;  // the caller sees no mr and fails the operation
  }
  if (allocate) {
    rendezvous_held_ += b.length;
    if (std::exchange(budget_blocked_, false)) ++stats_.rendezvous_waits;
  }
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
    transport::sge* sg = take_sges(1);
    *sg = n->mr->slice(off, len);
    transport::work_request& wr = next_wr(last ? slot_kind::read_last : slot_kind::none, buffer_pool::npos,
                                          last ? n : nullptr, {sg, 1});
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
  for (op_node* p = active_.head; p != nullptr; p = p->next) {
    if (p->kind == op_kind::send || p->issued >= p->length) continue;  // (before sq_free: it borrows the batch)
    if (sq_free() == 0) return;
    issue_reads(p);
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
  std::unique_ptr<op_node> holder;  // what the delivered message keeps (async_receive)
  if (n->kind == op_kind::receive_message && (holder = fab_->take_holder()) == nullptr) {
    log().warn("connection qp {}: no memory to deliver a {}-byte message", qp_num(), n->length);
    fins_.push_back({n->cookie, protocol::fin_status::no_memory});
    schedule();
    complete(n, false, std::make_error_code(std::errc::not_enough_memory));
    return;
  }
  fins_.push_back({n->cookie, protocol::fin_status::ok});
  schedule();
  ++stats_.messages_received;
  stats_.bytes_received += n->length;
  const auto len = static_cast<std::size_t>(n->length);
  if (n->kind == op_kind::receive_buffer) {
    std::error_code ec;
    if (n->large != nullptr) {  // staged: the host copy into GPU memory
      n->mr.reset();
      std::string why;
      ec = cuda::detail::copy_to_device(n->dest.data(), n->large.get(), len, why);
      if (ec) log().warn("connection: copying a {}-byte message into GPU memory failed: {}", len, why);
      n->large.reset();
    }
    complete(n, false, ec, ec ? 0 : len);
    return;
  }
  message m;
  m.owner_ = shared_from_this();
  m.large_ = std::move(holder);
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
      end_receives(recv_waiting_, post);
      return;
    }
    const inbox_entry e = inbox_[ring_slot(inbox_head_, inbox_.size())];
    op_node* n = recv_waiting_.head;
    const std::byte* data = fab_->pool->data(e.buffer);
    if (e.split_total != 0) {
      if (!deliver_split(n, post)) {
        end_receives(recv_waiting_, post);  // (when the connection has ended; else the rest is awaited)
        return;
      }
      continue;
    }
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
        std::error_code ec;
        if (len > 0 && n->device_mask != 0) {
          std::string why;
          ec = cuda::detail::copy_to_device(n->dest.data(), data + protocol::kHeaderSize, len, why);
          if (ec) log().warn("connection: copying a {}-byte message into GPU memory failed: {}", len, why);
        } else if (len > 0) {
          std::memcpy(n->dest.data(), data + protocol::kHeaderSize, len);
        }
        repost(e.buffer);
        if (!ec) {
          ++stats_.messages_received;
          stats_.bytes_received += len;
        }
        complete(n, post, ec, ec ? 0 : len);
      }
      continue;
    }
    const protocol::rts_body b = protocol::decode_rts(data + protocol::kHeaderSize);
    if (state_ == state::failed || state_ == state::closed) {
      ++inbox_head_;
      recv_waiting_.remove(n);
      release_received(e.buffer);
      complete(n, post, state_ == state::failed && error_ ? error_ : std::error_code(errc::connection_closed));
      continue;
    }
    // Larger than the caller's buffer, or than what this connection may
    // allocate for it: refused on both sides, never truncated.
    if ((n->kind == op_kind::receive_buffer && b.length > n->dest.size()) ||
        (n->kind == op_kind::receive_message && b.length > opt_.rendezvous_memory)) {
      if (n->kind == op_kind::receive_message) {
        log().warn("connection qp {}: a {}-byte message exceeds rendezvous_memory ({} bytes); refused",
                   qp_num(), b.length, opt_.rendezvous_memory);
      }
      ++inbox_head_;
      recv_waiting_.remove(n);
      fins_.push_back({b.cookie, protocol::fin_status::message_size});
      repost(e.buffer);
      complete(n, post, errc::message_size);
      continue;
    }
    if (!start_read(n, b)) {  // no room now: retried after completions (start_read took n off the list)
      return_batch();         // (when it queued nothing)
      return;
    }
    ++inbox_head_;
    repost(e.buffer);
    if (n->mr == nullptr) {
      fins_.push_back({b.cookie, protocol::fin_status::no_memory});
      complete(n, post, errc::registration_failed);
    }
  }
}

bool connection_impl::deliver_split(op_node* n, bool post) noexcept {
  const std::size_t cap = inbox_.size();
  std::uint64_t end = inbox_head_;
  while (end != inbox_tail_ && !inbox_[ring_slot(end, cap)].split_last) ++end;
  if (end == inbox_tail_) return false;
  const std::uint64_t first = inbox_head_;
  inbox_head_ = ++end;
  recv_waiting_.remove(n);
  const std::size_t total = inbox_[ring_slot(first, cap)].split_total;
  std::error_code ec;
  std::byte* dst = nullptr;
  bool to_device = false;
  std::unique_ptr<std::byte[]> block;  // (declared before its registration: destroyed after it)
  std::unique_ptr<transport::memory_region> mr;
  std::unique_ptr<op_node> holder;
  if (n->kind == op_kind::receive_buffer) {
    if (total > n->dest.size()) {
      ec = errc::message_size;
    } else {
      dst = static_cast<std::byte*>(n->dest.data());
      to_device = n->device_mask != 0;
    }
  } else if (total > opt_.rendezvous_memory) {
    // (As a rendezvous message's would be: async_receive() allocates no
    // more for the peer; the sender's send has completed.)
    log().warn("connection qp {}: a {}-byte message exceeds rendezvous_memory ({} bytes); refused", qp_num(),
               total, opt_.rendezvous_memory);
    ec = errc::message_size;
  } else {
    // A block as a rendezvous message's (kept when the message is released,
    // for either kind): one that was kept, or a new one, registered so that
    // it can be kept (without, or above what is kept, it is freed at the
    // release; a split block is never the target of an RDMA operation).
    if (!fab_->take_block(total, block, mr)) {
      const std::size_t span = fabric_state::block_size(total);
      block.reset(new (std::nothrow) std::byte[span]);
      if (block != nullptr && span <= fabric_state::kKeptBlockMax) {
        try {
          mr = fab_->register_releasing(
              [&] { return fab_->pd->register_memory(block.get(), span, transport::access::local_write); });
        } catch (const std::exception&) {
          mr.reset();
        }
      }
    }
    if (block == nullptr || (holder = fab_->take_holder()) == nullptr) {
      log().warn("connection qp {}: no memory to deliver a {}-byte message", qp_num(), total);
      ec = std::make_error_code(std::errc::not_enough_memory);
    }
    dst = block.get();
  }
  std::string why;
  for (std::uint64_t i = first; i < end; ++i) {
    const inbox_entry& e = inbox_[ring_slot(i, cap)];
    const std::size_t len = e.length - protocol::kHeaderSize;
    if (!ec) {
      const std::byte* src = fab_->pool->data(e.buffer) + protocol::kHeaderSize;
      if (to_device) {
        ec = cuda::detail::copy_to_device(dst, src, len, why);
        if (ec) log().warn("connection: copying a {}-byte message into GPU memory failed: {}", total, why);
      } else {
        std::memcpy(dst, src, len);
      }
      dst += len;
    }
    repost(e.buffer);
  }
  if (ec) {
    complete(n, post, ec);
    return true;
  }
  ++stats_.messages_received;
  stats_.bytes_received += total;
  if (n->kind == op_kind::receive_buffer) {
    complete(n, post, {}, total);
    return true;
  }
  message m;
  m.owner_ = shared_from_this();
  m.large_ = std::move(holder);
  m.large_->large = std::move(block);
  m.large_->mr = std::move(mr);
  m.data_ = m.large_->large.get();
  m.size_ = total;
  complete_message(n, post, std::move(m));
  return true;
}

}  // namespace anydoor::detail
