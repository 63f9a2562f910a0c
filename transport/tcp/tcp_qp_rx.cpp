// The tcp queue pair's receiver and progress: frames parsed, requests
// checked and executed, responses matched to the oldest outstanding request.
#include "tcp/tcp_provider.hpp"
#include "tcp/tcp_qp_parts.hpp"

#include "log.hpp"

#include <anydoor/error.hpp>

#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

namespace anydoor::transport::tcp {
using namespace detail;
namespace {

constexpr std::size_t kDirectReadMin = 16 * 1024;
constexpr int kMaxFramesPerProgress = 256;
// What one progress pass of a queue pair in error reads and drops.
constexpr std::size_t kMaxDiscardPerPass = 4 * kRxBufferSize;

bool psn_le(std::uint32_t a, std::uint32_t b) noexcept { return static_cast<std::int32_t>(b - a) >= 0; }

// Requests a responder can refuse as receiver not ready: those that consume a receive.
bool takes_receive(opcode op) noexcept {
  return op == opcode::send || op == opcode::send_with_imm || op == opcode::write_with_imm;
}

}  // namespace

// ---------------------------------------------------------------- receive

void tcp_qp::progress() noexcept {
  if (!wants_progress()) return;
  auto* cq = static_cast<tcp_cq*>(attr_.send_cq);
  if (!tx_idle() && !(cq != nullptr && cq->defers_held_acks() && only_ack_pending())) flush();
  receive();
  // A lone ACK waits for company: it leaves with the next request posted
  // (one segment instead of two in request/reply traffic), or at the start
  // of the next progress pass, or when the completion queue is armed — and
  // at once if it already is: a consumer that armed and then drained (the
  // arm-then-drain rule) sleeps after this pass, and one-sided requests
  // produce no completion here to wake it. (A progress thread's pass, the
  // owner busy elsewhere, sends it at once too: tcp_cq::holds_lone_acks.)
  if (!tx_idle()) {
    if (!only_ack_pending() || (cq != nullptr && !cq->holds_lone_acks())) {
      flush();
    } else if (cq != nullptr) {
      cq->note_thread_hold();
    }
  }
  check_fatal();
  check_local_error();
  if (has_pending_work()) {
    if (auto* s = static_cast<tcp_cq*>(attr_.send_cq)) s->note_pending(this, noted_send_);
    if (auto* r = static_cast<tcp_cq*>(attr_.recv_cq); r != nullptr && r != attr_.send_cq) r->note_pending(this, noted_recv_);
  }
}

bool tcp_qp::only_ack_pending() const noexcept {
  return iov_pos_ == iov_count_ && sq_tx_ == sq_tail_ && resp_tail_ - resp_queued_ == 1 &&
         resp_[ring_slot(resp_tail_ - 1, resp_.size())].h.type == frame_type::ack;
}

void tcp_qp::flush_acks() noexcept {
  if (!wants_progress() || resp_queued_ == resp_tail_) return;
  flush();
  check_fatal();
}

// The socket is watched just before the queue pair goes live (see
// attach_socket): an event in between is for a queue pair that still
// belongs to the connecting thread (its signal() after going live wakes the
// consumer again).
void tcp_qp::on_events(std::uint32_t /*events*/) noexcept {
  if (wants_progress()) progress();
}

void tcp_qp::on_timer(std::chrono::steady_clock::time_point now) noexcept {
  if (!wants_progress()) return;
  if (faults_ != nullptr) {
    if (rx_stalled_ && faults_->stall_ms != 0) {
      if (now < rx_stall_until_) {
        static_cast<tcp_cq*>(attr_.send_cq)->schedule(rx_stall_until_);
      } else {
        rx_stalled_ = false;
        log().warn("qp {}: fault injection: reads again", qpn_);
        update_interest();
        progress();
        if (!wants_progress()) return;
      }
    }
    if (tx_hold_until_ != clock_point{}) {
      flush();  // sends the held batch, or schedules the timer again
      check_fatal();
      if (!wants_progress()) return;
    }
  }
  if (!rnr_waiting_) return;
  if (now < rnr_until_) {
    static_cast<tcp_cq*>(attr_.send_cq)->schedule(rnr_until_);
    return;
  }
  rnr_waiting_ = false;
  flush();
  check_fatal();
}

// In error, with a NAK still to send: whatever the peer sends is dropped, so
// that a level-triggered notify fd does not stay readable.
// At most kMaxDiscardPerPass bytes per pass: a peer that keeps sending
// cannot hold the completion queue's thread here.
void tcp_qp::discard_input() noexcept {
  for (std::size_t dropped = 0; dropped < kMaxDiscardPerPass;) {
    const ssize_t n = ::recv(fd_, rx_buf_.data(), rx_buf_.size(), MSG_DONTWAIT);
    ++counters_.rx_syscalls;
    if (n > 0) {
      dropped += static_cast<std::size_t>(n);
      continue;
    }
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) close_socket();
    return;
  }
}

// A pass borrows the staging buffer and returns it unless bytes wait in it.
void tcp_qp::receive() noexcept {
  rx_more_ = false;  // (receive_frames says again whether the socket may hold more)
  if (fd_ < 0 || !borrow_staging()) return;
  receive_frames();
  // A copy into copied memory still running ends with the pass (its
  // destination is pinned only until then); one that failed loses the
  // frame it belongs to (always the current one: the copy that ends a
  // segment is waited for at once).
  if (rx_copy_pending_ && !settle_rx_copy()) lose_payload();
  return_staging();
}

bool tcp_qp::borrow_staging_slow() noexcept {
  rx_buf_.bytes = rx_buf_.pool->take();
  if (rx_buf_.bytes != nullptr) return true;
  if (state_ == qp_state::error) {
    close_socket();
  } else {
    peer_gone("no memory for a receive staging buffer");
  }
  return false;
}

void tcp_qp::receive_frames() noexcept {
  if (state_ == qp_state::error) {
    // What was read but not processed goes too: left in the staging
    // buffer it would count as pending work, and a consumer that arms
    // would be woken again at once for as long as a NAK waits to leave.
    rx_begin_ = rx_end_ = 0;
    rx_bounce_fill_ = 0;
    (void)settle_rx_copy();
    if (fd_ >= 0) discard_input();
    return;
  }
  // A read that returns less than asked for has emptied the socket: the
  // pass ends when the bytes it brought are used, instead of asking again
  // (a system call that would only say EAGAIN: a quarter of the round trip
  // of a ping-pong). What arrives meanwhile is taken by the next pass, and
  // a sleeping consumer is woken for it (the socket is watched level-triggered).
  bool drained = false;
  // Payload bytes read only to be dropped (a request refused or discarded,
  // with no destination): at most kMaxDiscardPerPass a pass, as in error,
  // or a peer streaming gigabyte frames past an RNR NAK holds the pass
  // (and every queue pair behind it) for as long as it keeps sending.
  std::size_t dropped = 0;
  // A NAK that ends a poisoned read is on its way: the queue pair goes to
  // error once it is out, so no later request may execute meanwhile.
  for (int frames = 0; frames < kMaxFramesPerProgress && fd_ >= 0 && state_ != qp_state::error && !fatal_pending_;) {
    if (faults_ != nullptr && phase_ == rx_phase::header) {
      if (!rx_stall_done_ && faults_->stop_reading_after && frames_received_ >= *faults_->stop_reading_after) {
        begin_rx_stall();
      }
      if (rx_stalled_) {
        // No frame is read, but a connection that failed (reset, even with
        // bytes still queued: SO_ERROR; or closed with nothing left to
        // read: a peek sees the end) still ends the queue pair. epoll
        // reports such an error whatever the interest, and nothing else
        // would take it (the reactor would spin).
        int err = 0;
        socklen_t len = sizeof err;
        if (::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err != 0) {
          peer_gone(std::strerror(err));
          return;
        }
        std::byte probe{};
        const ssize_t n = ::recv(fd_, &probe, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0) peer_gone("peer closed the connection");
        else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) peer_gone(std::strerror(errno));
        return;
      }
    }
    if (phase_ == rx_phase::header) {
      if (rx_end_ - rx_begin_ < kHeaderSize) {
        if (rx_begin_ == rx_end_) {
          rx_begin_ = rx_end_ = 0;  // the usual case: every byte read was used
        } else if (rx_begin_ > 0) {
          std::memmove(rx_buf_.data(), rx_buf_.data() + rx_begin_, rx_end_ - rx_begin_);
          rx_end_ -= rx_begin_;
          rx_begin_ = 0;
        }
        if (drained) return;
        const std::size_t room = rx_header_only_ ? kHeaderSize - rx_end_ : rx_buf_.size() - rx_end_;
        const ssize_t n = ::recv(fd_, rx_buf_.data() + rx_end_, room, MSG_DONTWAIT);
        ++counters_.rx_syscalls;
        if (n > 0) {
          drained = static_cast<std::size_t>(n) < room;
          rx_end_ += static_cast<std::size_t>(n);
          counters_.bytes_received += static_cast<std::uint64_t>(n);
          continue;
        }
        if (n == 0) peer_gone("peer closed the connection");
        else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) peer_gone(std::strerror(errno));
        return;
      }
      // A request needs room for its response; wait for the transmitter to drain.
      if (resp_tail_ - resp_head_ >= resp_.size()) {
        // Only a peer over its read/atomic limit gets here: stop reading
        // (and watching) the socket until responses drain.
        if (!rx_paused_) {
          rx_paused_ = true;
          update_interest();
        }
        return;
      }
      const decode_error err =
          decode(std::span<const std::byte, kHeaderSize>(rx_buf_.data() + rx_begin_, kHeaderSize), cur_);
      if (err != decode_error::none) {
        protocol_error(to_string(err));
        return;
      }
      rx_begin_ += kHeaderSize;
      rx_header_only_ = cur_.length >= kDirectReadMin;
      ++frames;
      ++frames_received_;
      seg_count_ = seg_index_ = 0;
      payload_left_ = cur_.length;
      after_ = after_payload::none;
      payload_lost_ = false;
      // An ACK carried by a request is taken first, whatever becomes of
      // the request (one dropped after an RNR NAK is sent again without it).
      if ((cur_.flags & kFlagAck) != 0) {
        frame_header a;
        a.type = frame_type::ack;
        a.psn = cur_.ack_psn;
        if (!handle_response(a) || fd_ < 0 || state_ == qp_state::error) return;
      }
      const bool ok = is_request(cur_.type) ? handle_request(cur_) : handle_response(cur_);
      if (!ok || fd_ < 0 || state_ == qp_state::error) return;
      if (payload_left_ == 0) {
        finish_payload();
        continue;
      }
      phase_ = rx_phase::payload;
    }
    // payload: staging buffer first, then straight from the socket when
    // large or the end of a large frame (copied memory: into the bounce
    // buffer); each piece pins its destination while it moves
    while (payload_left_ > 0) {
      segment* s = seg_index_ < seg_count_ ? &seg_[seg_index_] : nullptr;
      std::uint64_t want = s != nullptr ? std::min(s->len, payload_left_) : payload_left_;
      std::size_t got = 0;
      if (rx_begin_ < rx_end_) {
        got = static_cast<std::size_t>(std::min<std::uint64_t>(want, rx_end_ - rx_begin_));
        if (s != nullptr && s->key != 0) {
          memory_copier* copier = nullptr;
          if (std::byte* p = table_.pin(s->key, s->addr, got, s->need, via(s->need), copier)) {
            std::error_code ec;
            if (copier == nullptr) {
              std::memcpy(p, rx_buf_.data() + rx_begin_, got);
            } else {
              ec = copier->to_device(p, rx_buf_.data() + rx_begin_, got);
            }
            payload_via_staging_ += got;
            table_.unpin(s->key);
            if (ec) {
              log().warn("qp {}: copying {} arriving bytes into copied memory failed: {}", qpn_, got, ec.message());
              lose_payload();
            }
          } else {
            lose_payload();
          }
        }
        rx_begin_ += got;
      } else {
        if (drained) return;
        rx_begin_ = rx_end_ = 0;
        std::byte* direct = nullptr;
        bool bounce = false;
        // Straight into the destination when the piece is large, or when it
        // ends a large frame (a tail the staging read left: reading it with
        // the next header puts a stream of large frames back in step, where
        // staging reads would copy every byte of it twice). Copied memory
        // the same way into the bounce buffer, and the bounce's bytes go
        // into place in one copy per kCopyBounce (a read fills what it can,
        // the next read goes on filling it).
        if (s != nullptr && s->key != 0 &&
            (rx_bounce_fill_ != 0 || want >= kDirectReadMin ||
             (want == payload_left_ && cur_.length >= kDirectReadMin))) {
          memory_copier* copier = nullptr;
          direct = table_.pin(s->key, s->addr, want, s->need, via(s->need), copier);
          if (direct == nullptr) {
            lose_payload();
          } else if (copier != nullptr) {
            table_.unpin(s->key);
            direct = nullptr;
            if (rx_bounce_ == nullptr) rx_bounce_ = copier->bounce_buffer(kCopyBounce);
            if (rx_spare_ == nullptr) rx_spare_ = copier->bounce_buffer(kCopyBounce);  // (none: no overlap)
            if (rx_bounce_ != nullptr) {  // (else through the staging buffer, above)
              if (rx_bounce_fill_ == 0) {
                rx_bounce_key_ = s->key;
                rx_bounce_need_ = s->need;
                rx_bounce_addr_ = s->addr;
              }
              direct = rx_bounce_.get() + rx_bounce_fill_;
              want = std::min<std::uint64_t>(want, kCopyBounce - rx_bounce_fill_);
              bounce = true;
            }
          }
        }
        ssize_t n = 0;
        std::size_t asked = rx_buf_.size();
        if (direct != nullptr) {
          // The read that ends the payload also asks for the next frame's
          // header, into the staging buffer (empty here): a stream of large
          // frames then takes one call per frame, not two.
          iovec v[2] = {{direct, static_cast<std::size_t>(want)}, {rx_buf_.data(), kHeaderSize}};
          msghdr m{};
          m.msg_iov = v;
          m.msg_iovlen = want == payload_left_ ? 2 : 1;
          asked = static_cast<std::size_t>(want) + (m.msg_iovlen == 2 ? kHeaderSize : 0);
          n = ::recvmsg(fd_, &m, MSG_DONTWAIT);
          if (!bounce) table_.unpin(s->key);
        } else {
          n = ::recv(fd_, rx_buf_.data(), rx_buf_.size(), MSG_DONTWAIT);
        }
        ++counters_.rx_syscalls;
        if (n <= 0) {
          if (n == 0) peer_gone("peer closed the connection");
          else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) peer_gone(std::strerror(errno));
          return;
        }
        counters_.bytes_received += static_cast<std::uint64_t>(n);
        drained = static_cast<std::size_t>(n) < asked;
        if (direct == nullptr) {
          rx_end_ = static_cast<std::size_t>(n);
          if ((s == nullptr || s->key == 0) && (dropped += static_cast<std::size_t>(n)) >= kMaxDiscardPerPass &&
              !drained) {
            rx_more_ = true;  // pending work: the next pass goes on (phase_ and payload_left_ say where)
            return;
          }
          continue;
        }
        got = std::min(static_cast<std::size_t>(n), static_cast<std::size_t>(want));
        rx_end_ = static_cast<std::size_t>(n) - got;  // what came of the next header
        if (bounce) rx_bounce_fill_ += got;
      }
      payload_left_ -= got;
      if (s != nullptr) {
        s->addr += got;
        s->len -= got;
        // The bounce's bytes go into place when it is full and where its
        // segment (contiguous memory) ends; there a copy still running is
        // waited for too (the segment's end may have come another way).
        const bool ends = s->len == 0 || payload_left_ == 0;
        if (rx_bounce_fill_ != 0 && (rx_bounce_fill_ == kCopyBounce || ends)) {
          if (!flush_rx_bounce(ends)) lose_payload();
        } else if (ends && rx_copy_pending_ && !settle_rx_copy()) {
          lose_payload();
        }
        if (s->len == 0) ++seg_index_;
      }
    }
    phase_ = rx_phase::header;
    if (rx_copy_pending_ && !settle_rx_copy()) lose_payload();  // (settled above, where the segment ended)
    finish_payload();
  }
  // Out of the loop at the frame cap (every other way out returns), with
  // the socket not seen empty: more may wait there even where none of its
  // bytes is in the staging buffer (large frames, read header by header).
  // It is pending work (has_pending_input), so that the next pass takes it
  // and an arm() wakes the consumer for it: a watcher of the notify fd that
  // is edge-triggered and does not re-arm has had its edge for those bytes
  // already. (Asio's async_wait re-arms, EPOLL_CTL_MOD per wait, and would
  // see them anyway: the promise is arm_reports_queued's, for any watcher.)
  rx_more_ = !drained && fd_ >= 0 && state_ != qp_state::error && !fatal_pending_;
}

// The bounce buffer's bytes into their place; false when the destination
// went away or a copy failed (the bytes are dropped either way). Not the
// `last` of a segment, and with a spare buffer: the copy is started, and
// the spare fills meanwhile (the copy started before is settled first).
bool tcp_qp::flush_rx_bounce(bool last) noexcept {
  const std::size_t n = std::exchange(rx_bounce_fill_, 0);
  if (!settle_rx_copy()) return false;
  memory_copier* copier = nullptr;
  std::byte* p = table_.pin(rx_bounce_key_, rx_bounce_addr_, n, rx_bounce_need_, via(rx_bounce_need_), copier);
  if (p == nullptr) return false;
  std::error_code ec;
  if (copier == nullptr) {
    // (only a copier's memory is read into the bounce: a key that names
    // other memory now is not the one the bytes were for)
    ec = make_error_code(errc::invalid_argument);
  } else if (!last && rx_spare_ != nullptr) {
    ec = copier->start_to_device(p, rx_bounce_.get(), n);
    if (!ec) {
      rx_copy_pending_ = true;
      rx_copy_key_ = rx_bounce_key_;  // (pinned until settled)
      rx_copy_copier_ = copier;
      std::swap(rx_bounce_, rx_spare_);  // the segment goes on in the other buffer
      return true;
    }
  } else {
    ec = copier->to_device(p, rx_bounce_.get(), n);
  }
  table_.unpin(rx_bounce_key_);
  if (ec) log().warn("qp {}: copying {} arriving bytes into copied memory failed: {}", qpn_, n, ec.message());
  return !ec;
}

// Waits for the copy flush_rx_bounce started, and lets its destination go.
bool tcp_qp::settle_rx_copy() noexcept {
  if (!rx_copy_pending_) return true;
  rx_copy_pending_ = false;
  const std::error_code ec = rx_copy_copier_->finish();
  table_.unpin(rx_copy_key_);
  if (ec) log().warn("qp {}: copying arriving bytes into copied memory failed: {}", qpn_, ec.message());
  return !ec;
}

// A destination was deregistered while its payload arrived: the rest of
// the payload is read and dropped, and finish_payload fails the frame.
void tcp_qp::lose_payload() noexcept {
  rx_bounce_fill_ = 0;
  if (!payload_lost_) {
    log().warn("qp {}: the destination of an arriving payload is not (or no longer) memory it may be written to",
               qpn_);
  }
  payload_lost_ = true;
  for (std::size_t i = seg_index_; i < seg_count_; ++i) seg_[i].key = 0;
}

bool tcp_qp::take_recv(std::uint32_t length, bool& rnr) noexcept {
  rnr = false;
  rq_entry r;
  const sge* sges = nullptr;
  if (srq_ != nullptr) {
    if (!srq_->take(srq_taken_)) {
      rnr = true;
      return false;
    }
    r = {srq_taken_.wr_id, srq_taken_.num_sge};
    sges = srq_taken_.sges.data();
  } else {
    if (rq_head_ == rq_tail_) {
      rnr = true;
      return false;
    }
    const std::uint64_t idx = rq_head_++;
    r = rq_[ring_slot(idx, attr_.max_recv_wr)];
    sges = rq_sges_of(idx);
  }
  std::uint64_t room = 0;
  for (std::uint32_t i = 0; i < r.num_sge; ++i) room += sges[i].length;
  if (length > room) {
    push_recv({.wr_id = r.wr_id, .status = wc_status::local_length_error, .opcode = wc_opcode::recv,
               .qp_num = qpn_});
    log().warn("qp {}: {}-byte message does not fit the {}-byte receive buffer", qpn_, length, room);
    nak(cur_.psn, nak_code::invalid_request, true);
    return false;
  }
  // The whole destination is checked before a byte lands: the pins that
  // follow cover only the bytes that have arrived. A message that has all
  // arrived and goes into the first buffer is checked by the one pin that
  // copies it (which fails the receive the same way, before a byte lands:
  // lose_payload, finish_payload), not twice. (Key 0 marks a lost
  // segment there, so it is refused here.)
  const bool one_pin =
      length > 0 && rx_end_ - rx_begin_ >= length && r.num_sge > 0 && sges[0].length >= length && sges[0].lkey != 0;
  std::uint64_t left = length;
  for (std::uint32_t i = 0; i < r.num_sge && left > 0; ++i) {
    const std::uint64_t n = std::min<std::uint64_t>(sges[i].length, left);
    if (!(one_pin && i == 0) && table_.check(sges[i].lkey, sges[i].addr, n, access::local_write, 0) == nullptr) {
      push_recv({.wr_id = r.wr_id, .status = wc_status::local_protection_error, .opcode = wc_opcode::recv,
                 .qp_num = qpn_});
      nak(cur_.psn, nak_code::remote_operation, true);
      return false;
    }
    seg_[seg_count_++] = {sges[i].lkey, access::local_write, sges[i].addr, n};
    left -= n;
  }
  recv_wr_id_ = r.wr_id;
  return true;
}

bool tcp_qp::handle_request(const frame_header& h) noexcept {
  auto discard = [this] {
    seg_count_ = seg_index_ = 0;
    after_ = after_payload::none;
    return true;
  };
  if (h.psn != expected_psn_) {
    if (rnr_discard_) return discard();  // go-back-N after an RNR NAK
    protocol_error("request sequence " + std::to_string(h.psn) + ", expected " + std::to_string(expected_psn_));
    return false;
  }
  rnr_discard_ = false;
  // The queue pair's own rights first (verbs' qp_access_flags): without
  // them the request fails whatever the key, with an Invalid Request NAK
  // (an operation the queue pair does not support: the IB spec, and rxe).
  const access need = h.type == frame_type::write          ? access::remote_write
                      : h.type == frame_type::read_request ? access::remote_read
                      : h.type == frame_type::fetch_add || h.type == frame_type::compare_swap
                          ? access::remote_atomic
                          : access::none;
  if (need != access::none && !has(attr_.remote_access, need)) {
    log().warn("qp {}: the peer's {} request {} is refused: the queue pair does not admit it", qpn_,
               need == access::remote_write ? "write" : need == access::remote_read ? "read" : "atomic", h.psn);
    nak(h.psn, nak_code::invalid_request, true);
    return false;
  }
  const bool imm = (h.flags & kFlagImm) != 0;
  bool rnr = false;
  // take_recv failed: with no receive posted, an RNR NAK (and the frame is
  // dropped); otherwise it has queued a fatal NAK already.
  auto no_recv = [&] { return rnr && rnr_nak(h.psn) && discard(); };
  switch (h.type) {
    case frame_type::send:
      if (!take_recv(h.length, rnr)) return no_recv();
      after_ = after_payload::recv_done;
      break;
    case frame_type::write: {
      if (h.length != 0 && table_.check(h.rkey, h.remote_addr, h.length, access::remote_write, serial_) == nullptr) {
        nak(h.psn, nak_code::remote_access, true);
        return false;
      }
      if (imm && !take_recv(0, rnr)) return no_recv();
      seg_count_ = 0;
      if (h.length != 0) seg_[seg_count_++] = {h.rkey, access::remote_write, h.remote_addr, h.length};
      after_ = imm ? after_payload::write_imm_done : after_payload::ack_only;
      break;
    }
    case frame_type::read_request:
      if (h.read_length != 0 &&
          table_.check(h.rkey, h.remote_addr, h.read_length, access::remote_read, serial_) == nullptr) {
        nak(h.psn, nak_code::remote_access, true);
        return false;
      }
      queue_read_response(h);
      break;
    case frame_type::fetch_add:
    case frame_type::compare_swap: {
      if (h.remote_addr % 8 != 0) {
        nak(h.psn, nak_code::invalid_request, true);
        return false;
      }
      memory_copier* copier = nullptr;
      std::byte* p = table_.pin(h.rkey, h.remote_addr, 8, access::remote_atomic, serial_, copier);
      if (p != nullptr && copier != nullptr) {
        // Copied memory (a window granting atomics on it): an atomic needs
        // the memory itself.
        table_.unpin(h.rkey);
        log().warn("qp {}: the peer's atomic {} targets copied memory, which takes no atomics", qpn_, h.psn);
        p = nullptr;
      }
      if (p == nullptr) {
        nak(h.psn, nak_code::remote_access, true);
        return false;
      }
      std::atomic_ref<std::uint64_t> word(*reinterpret_cast<std::uint64_t*>(p));
      std::uint64_t old;
      if (h.type == frame_type::fetch_add) {
        old = word.fetch_add(h.compare_add, std::memory_order_acq_rel);
      } else {
        old = h.compare_add;
        word.compare_exchange_strong(old, h.swap, std::memory_order_acq_rel);
      }
      table_.unpin(h.rkey);
      frame_header r;
      r.type = frame_type::atomic_response;
      r.psn = h.psn;
      r.compare_add = old;
      queue_response(r);
      break;
    }
    default:
      protocol_error("response type on the request path");
      return false;
  }
  ++expected_psn_;
  return true;
}

// No receive for a send (or a write with immediate): an RNR NAK, and the
// requests after it are dropped until the requester sends it again.
bool tcp_qp::rnr_nak(std::uint32_t psn) noexcept {
  ++counters_.rnr_naks_sent;
  shared_->sent.fetch_add(1, std::memory_order_relaxed);
  rnr_discard_ = true;
  nak(psn, nak_code::rnr, false);
  return true;
}

void tcp_qp::finish_payload() noexcept {
  const after_payload after = std::exchange(after_, after_payload::none);
  if (payload_lost_) {
    // A destination was deregistered while the payload arrived.
    payload_lost_ = false;
    switch (after) {
      case after_payload::none: return;
      case after_payload::recv_done:
        push_recv({.wr_id = recv_wr_id_, .status = wc_status::local_protection_error, .opcode = wc_opcode::recv,
                   .qp_num = qpn_});
        nak(cur_.psn, nak_code::remote_operation, true);
        return;
      case after_payload::write_imm_done:
        push_recv({.wr_id = recv_wr_id_, .status = wc_status::work_request_flushed,
                   .opcode = wc_opcode::recv_rdma_with_imm, .qp_num = qpn_});
        nak(cur_.psn, nak_code::remote_access, true);
        return;
      case after_payload::ack_only:
        nak(cur_.psn, nak_code::remote_access, true);
        return;
      case after_payload::read_fragment:
      case after_payload::read_done:
        log().warn("qp {}: the destination of read {} was deregistered", qpn_, cur_.psn);
        close_when_flushed_ = false;
        enter_error(wc_status::local_protection_error);
        return;
    }
    return;
  }
  switch (after) {
    case after_payload::none:
      return;
    case after_payload::recv_done:
    case after_payload::write_imm_done: {
      const bool imm = (cur_.flags & kFlagImm) != 0;
      push_recv({.wr_id = recv_wr_id_, .status = wc_status::success,
                 .opcode = after == after_payload::recv_done ? wc_opcode::recv : wc_opcode::recv_rdma_with_imm,
                 .byte_len = cur_.length, .imm = imm ? cur_.imm : 0, .has_imm = imm, .qp_num = qpn_});
      [[fallthrough]];
    }
    case after_payload::ack_only: {
      frame_header a;
      a.type = frame_type::ack;
      a.psn = cur_.psn;
      queue_response(a);
      break;
    }
    case after_payload::read_fragment:
      break;
    case after_payload::read_done:
      complete_head(wc_status::success, static_cast<std::uint32_t>(rd_done_));
      break;
  }
}

void tcp_qp::complete_head(wc_status status, std::uint32_t byte_len) noexcept {
  if (status != wc_status::success) {
    enter_error(status);
    return;
  }
  const std::uint64_t idx = sq_ack_++;
  const sq_entry& e = sq_[ring_slot(idx, attr_.max_send_wr)];
  rd_done_ = rd_off_ = 0;
  rd_sge_ = 0;
  if (needs_response(e.wr.op)) --rd_atomic_out_;
  if (e.wr.signaled) {
    push_send({.wr_id = e.wr.wr_id, .status = wc_status::success, .opcode = completion_opcode(e.wr.op),
               .byte_len = byte_len, .qp_num = qpn_});
    sq_head_ = sq_ack_;  // retires the unsignaled requests before it too
  }
  rnr_left_ = attr_.rnr_retry;  // progress resets the RNR retry budget
}

void tcp_qp::check_local_error() noexcept {
  if (tx_blocked_ && sq_ack_ == sq_tx_ && sq_tx_ < sq_tail_ && state_ == qp_state::rts) {
    const wc_status s = sq_[ring_slot(sq_ack_, attr_.max_send_wr)].local_error;
    if (s == wc_status::success) {
      // A bind waited for the requests before it: now nothing is
      // outstanding, fill_iov completes it and sends what follows.
      tx_blocked_ = false;
      flush();
      return;
    }
    log().warn("qp {}: work request {} failed locally: {}", qpn_, sq_[ring_slot(sq_ack_, attr_.max_send_wr)].wr.wr_id,
               to_string(s));
    close_when_flushed_ = false;
    enter_error(s);
  }
}

// Where the next `bytes` of the head read go: its scatter list from the
// read cursor on. Moves the cursor.
bool tcp_qp::read_segments(const sq_entry& head, std::uint64_t bytes) noexcept {
  seg_count_ = seg_index_ = 0;
  while (bytes > 0) {
    if (rd_sge_ >= head.wr.sg_list.size() || seg_count_ == seg_.size()) return false;
    const sge& s = head.wr.sg_list[rd_sge_];
    const std::uint64_t take = std::min<std::uint64_t>(s.length - rd_off_, bytes);
    if (take > 0) seg_[seg_count_++] = {s.lkey, access::local_write, s.addr + rd_off_, take};
    bytes -= take;
    rd_off_ += take;
    rd_done_ += take;
    if (rd_off_ == s.length) {
      ++rd_sge_;
      rd_off_ = 0;
    }
  }
  return true;
}

bool tcp_qp::handle_response(const frame_header& h) noexcept {
  // Outstanding: for an ACK or a read's or atomic's answer, in the socket
  // whole (one framed but not all sent yet is one the peer cannot answer:
  // taken, its answer would complete it while its memory is still to be
  // read); for a NAK, framed (a peer refuses a request on its header, an
  // RNR NAK while the rest of it still comes; a NAK completes nothing
  // with success: the request is sent again, or the queue pair fails and
  // stops sending at once).
  if (sq_ack_ == (h.type == frame_type::nak ? sq_tx_ : sq_sent_)) {
    protocol_error("response with no request outstanding");
    return false;
  }
  // After an RNR NAK the peer drops every request until the refused one
  // comes again: nothing it sends meanwhile answers one (taken, it would
  // complete the refused request, and the rewind that follows would put
  // sq_tx_ behind sq_ack_).
  if (rnr_waiting_ || rewind_pending_) {
    protocol_error("response while a request refused as receiver not ready waits to go again");
    return false;
  }
  sq_entry& head = sq_[ring_slot(sq_ack_, attr_.max_send_wr)];
  switch (h.type) {
    case frame_type::ack: {
      const std::uint64_t count = std::uint64_t{h.psn - head.psn} + 1;
      if (!psn_le(head.psn, h.psn) || count > sq_sent_ - sq_ack_) {
        protocol_error("ACK for a request never sent");
        return false;
      }
      for (std::uint64_t k = 0; k < count; ++k) {
        const sq_entry& e = sq_[ring_slot(sq_ack_, attr_.max_send_wr)];
        if (e.wr.op == opcode::read || is_atomic(e.wr.op)) {
          protocol_error("ACK in place of a read or atomic response");
          return false;
        }
        complete_head(wc_status::success, 0);
      }
      return true;
    }
    case frame_type::nak: {
      if (h.psn != head.psn) {
        protocol_error("NAK for a request that is not the oldest outstanding");
        return false;
      }
      const auto code = static_cast<nak_code>(h.imm);
      if (code == nak_code::rnr && !takes_receive(head.wr.op)) {
        protocol_error("RNR NAK for a request that takes no receive");
        return false;
      }
      if (code == nak_code::rnr) {
        ++counters_.rnr_naks_received;
        shared_->received.fetch_add(1, std::memory_order_relaxed);
        if (attr_.rnr_retry != 7) {
          if (rnr_left_ == 0) {
            shared_->retry_exceeded.fetch_add(1, std::memory_order_relaxed);
            log().warn("qp {}: receiver not ready, {} retries exhausted", qpn_, attr_.rnr_retry);
            close_when_flushed_ = false;
            enter_error(wc_status::rnr_retry_exceeded);
            return false;
          }
          --rnr_left_;
        }
        rnr_waiting_ = true;
        rnr_until_ = std::chrono::steady_clock::now() + std::chrono::microseconds(attr_.min_rnr_timer_us);
        static_cast<tcp_cq*>(attr_.send_cq)->schedule(rnr_until_);
        rewind_to_ = sq_ack_;
        rewind_pending_ = true;
        return true;
      }
      wc_status status;
      switch (code) {
        case nak_code::remote_access: status = wc_status::remote_access_error; break;
        case nak_code::invalid_request: status = wc_status::remote_invalid_request; break;
        case nak_code::remote_operation: status = wc_status::remote_operation_error; break;
        default:
          protocol_error("NAK with an unknown code");
          return false;
      }
      log().warn("qp {}: work request {} failed at the peer: {}", qpn_, head.wr.wr_id, to_string(status));
      close_when_flushed_ = false;
      enter_error(status);
      return false;
    }
    case frame_type::read_response: {
      // Fragments in order (offset = bytes already placed), then the last frame.
      const bool last = (h.flags & kFlagLast) != 0;
      if (head.wr.op != opcode::read || h.psn != head.psn || h.remote_addr != rd_done_ ||
          h.length > head.length - rd_done_ || (last && rd_done_ + h.length != head.length)) {
        protocol_error("read response does not match the oldest outstanding request");
        return false;
      }
      if (!read_segments(head, h.length)) {
        protocol_error("read response larger than the read's buffers");
        return false;
      }
      after_ = last ? after_payload::read_done : after_payload::read_fragment;
      return true;
    }
    case frame_type::atomic_response: {
      if (!is_atomic(head.wr.op) || h.psn != head.psn) {
        protocol_error("atomic response does not match the oldest outstanding request");
        return false;
      }
      const sge& dst = head.wr.sg_list[0];
      memory_copier* copier = nullptr;
      std::byte* p = table_.pin(dst.lkey, dst.addr, 8, access::local_write, 0, copier);
      std::error_code ec;
      if (p != nullptr) {
        if (copier == nullptr) {
          std::memcpy(p, &h.compare_add, 8);
        } else {
          ec = copier->to_device(p, &h.compare_add, 8);
        }
        table_.unpin(dst.lkey);
      }
      if (p == nullptr || ec) {
        if (p == nullptr) log().warn("qp {}: the destination of atomic {} was deregistered", qpn_, h.psn);
        else log().warn("qp {}: copying atomic {}'s result into copied memory failed: {}", qpn_, h.psn, ec.message());
        close_when_flushed_ = false;
        enter_error(wc_status::local_protection_error);
        return false;
      }
      complete_head(wc_status::success, 8);
      return true;
    }
    default:
      protocol_error("request type on the response path");
      return false;
  }
}

}  // namespace anydoor::transport::tcp
