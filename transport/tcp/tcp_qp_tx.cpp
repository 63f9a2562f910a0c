// The tcp queue pair's transmitter: request and response frames gathered
// into a batch and sent with sendmsg (at most 2 MiB a call), with the
// registered memory they point into pinned.
#include "tcp/tcp_provider.hpp"
#include "tcp/tcp_qp_parts.hpp"

#include "log.hpp"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

namespace anydoor::transport::tcp {
using namespace detail;
namespace {

// Reads and atomics a requester has outstanding at most (like verbs'
// max_rd_atomic): each needs a response slot at the peer, whose ring holds
// 2 x kMaxResponseSlots + 8, so conforming peers never fill it.
constexpr std::uint32_t kMaxReadAtomic = kMaxResponseSlots;

frame_header nak_header(std::uint32_t psn, nak_code code) noexcept {
  frame_header h;
  h.type = frame_type::nak;
  h.psn = psn;
  h.imm = static_cast<std::uint32_t>(code);
  return h;
}
// Sent in place of read-response data whose source was deregistered while
// its fragment was on its way (the response then ends with a NAK).
std::byte g_zeros[kReadFragment];

}  // namespace

// ---------------------------------------------------------------- transmit

void tcp_qp::add_iov(const void* p, std::size_t n, iov_ref ref) noexcept {
  tx_pins_ = tx_pins_ || ref.kind == iov_kind::request_payload || ref.kind == iov_kind::read_payload;
  tx_->ref[iov_count_] = ref;
  tx_->iov[iov_count_++] = {const_cast<void*>(p), n};
}

void tcp_qp::add_header(const void* p, iov_ref ref) noexcept {
  ref.header = true;
  add_iov(p, kHeaderSize, ref);
}

void tcp_qp::add_header(const void* p) noexcept { add_header(p, iov_ref{}); }

void tcp_qp::mark_request_end(std::uint64_t next) noexcept {
  iov_ref& r = tx_->ref[iov_count_ - 1];
  r.request_end = true;
  r.resp = next;
}

bool tcp_qp::fill_iov() noexcept {
  hdr_used_ = 0;
  const std::size_t cap = resp_.size();
  const bool requests = may_send_requests() && sq_tx_ < sq_tail_;
  // An ACK that ends the responses rides in the first request's header
  // (kFlagAck) when requests follow it in this batch: framed alone only
  // if none can carry it (below).
  std::optional<std::uint32_t> ack;
  while (resp_queued_ < resp_tail_) {
    response& r = resp_[ring_slot(resp_queued_, cap)];
    if (r.h.type == frame_type::read_response) {
      if (!fill_read(r, resp_queued_)) return true;
    } else {
      if (iov_count_ + 1 > kMaxIov) return iov_count_ > 0;
      if (requests && r.h.type == frame_type::ack && resp_queued_ + 1 == resp_tail_) {
        ack = r.h.psn;
        ++resp_queued_;
        break;
      }
      const auto hdr = batch_header();
      encode(r.h.frame(), hdr);
      add_header(hdr.data());
    }
    ++resp_queued_;
  }
  // (A read response whose source went away ends with a fatal NAK: no
  // request is framed after it once that is known here; one found gone
  // later, at pin time, may have requests behind it in the batch, which
  // the peer drops and the error flushes.)
  if (requests && !fatal_pending_ && !fill_requests(ack)) return false;
  if (ack) add_ack_frame(*ack);  // no request took it (there is room: the loop above and fill_requests keep one iovec)
  return iov_count_ > 0;
}

void tcp_qp::add_ack_frame(std::uint32_t psn) noexcept {
  frame_header a;
  a.type = frame_type::ack;
  a.psn = psn;
  const auto hdr = batch_header();
  encode(a, hdr);
  add_header(hdr.data());
}

// The send queue's requests from sq_tx_ on, as many as the batch holds;
// the first carries `ack` unless it is a read request (the ACK then goes
// alone, before it, in the order it was queued). False: the queue pair
// went to error meanwhile.
bool tcp_qp::fill_requests(std::optional<std::uint32_t>& ack) noexcept {
  while (sq_tx_ < sq_tail_) {
    sq_entry& e = sq_[ring_slot(sq_tx_, attr_.max_send_wr)];
    if (e.local_error != wc_status::success || e.wr.op == opcode::bind_window) {
      if (e.local_error == wc_status::success && sq_ack_ == sq_tx_) {
        ++sq_tx_;  // a bind with nothing before it outstanding: complete now
        sq_sent_ = sq_tx_;
        complete_head(wc_status::success, 0);
        // A completion queue that overflowed moved the queue pair to error,
        // which may have closed the socket and given the batch back.
        if (tx_ == nullptr || fd_ < 0) return false;
        continue;
      }
      // Completes (with its error, or a bind with success) once everything
      // before it is acknowledged: check_local_error.
      tx_blocked_ = true;
      break;
    }
    std::size_t need = ack ? 2 : 1;  // (room for the ACK alone, should this request not carry it)
    if (e.wr.inline_data) {
      need += e.length > 0 ? 1 : 0;
    } else if (carries_data(e.wr.op)) {
      for (const sge& s : e.wr.sg_list) need += s.length > 0 ? 1 : 0;
    }
    if (iov_count_ + need > kMaxIov) break;
    if (needs_response(e.wr.op)) {
      if (rd_atomic_out_ >= kMaxReadAtomic) break;  // sent when earlier ones are answered
      ++rd_atomic_out_;
    }
    if (ack && e.wr.op == opcode::read) {
      add_ack_frame(*ack);
      ack.reset();
    }
    const auto hdr = batch_header();
    encode_request_header(e, hdr, ack);
    ack.reset();
    add_header(hdr.data());
    if (e.wr.inline_data) {
      // Inline data lives in the provider: in the slot, in place of its gather list.
      if (e.length > 0) add_iov(sges_of(sq_tx_), e.length, {});
    } else if (carries_data(e.wr.op)) {
      // Pinned per sendmsg.
      for (const sge& s : e.wr.sg_list) {
        if (s.length != 0) add_iov(reinterpret_cast<const void*>(s.addr), s.length, {iov_kind::request_payload, false, s.lkey, 0});
      }
    }
    mark_request_end(sq_tx_ + 1);
    ++sq_tx_;
  }
  return true;
}

// The latency path: one inline request that needs no response (a small
// send or write), with no batch in progress and nothing to send before it
// but a held-back ACK (which it carries), goes out in one sendmsg from its
// slot and a header of its own, without a batch. Whatever does not fit
// (the socket full) goes on in a batch, as fill_iov would have framed it.
bool tcp_qp::send_solo() noexcept {
  if (tx_ != nullptr || fd_ < 0 || faults_ != nullptr || !may_send_requests() || close_when_flushed_ ||
      sq_tx_ + 1 != sq_tail_) {
    return false;
  }
  const sq_entry& e = sq_[ring_slot(sq_tx_, attr_.max_send_wr)];
  if (!e.wr.inline_data || e.local_error != wc_status::success || needs_response(e.wr.op) ||
      e.wr.op == opcode::bind_window) {
    return false;
  }
  std::optional<std::uint32_t> ack;
  if (resp_queued_ != resp_tail_) {
    const response& r = resp_[ring_slot(resp_queued_, resp_.size())];
    if (resp_queued_ + 1 != resp_tail_ || r.h.type != frame_type::ack) return false;
    ack = r.h.psn;
  }
  std::array<std::byte, kHeaderSize> header;  // (what does not go now is copied into the batch)
  encode_request_header(e, header, ack);
  iovec v[2] = {{header.data(), kHeaderSize}, {sges_of(sq_tx_), e.length}};
  msghdr msg{};
  msg.msg_iov = v;
  msg.msg_iovlen = e.length > 0 ? 2 : 1;
  const std::size_t total = kHeaderSize + e.length;
  const ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  ++counters_.tx_syscalls;
  // Nothing went: flush() frames it in a batch and tries again (one more
  // system call on EAGAIN), and sees the error or waits for room.
  if (n < 0) return false;
  // The request (and the ACK) is on its way, at least in part.
  ++sq_tx_;
  if (static_cast<std::size_t>(n) == kHeaderSize + e.length) sq_sent_ = sq_tx_;
  resp_head_ = resp_queued_ = resp_tail_;
  largest_send_ = std::max(largest_send_, total);
  counters_.bytes_sent += static_cast<std::uint64_t>(n);
  const auto sent = static_cast<std::size_t>(n);
  if (sent == total) return true;
  ++solo_partial_;
  if ((tx_ = batches_->take()) == nullptr) {
    peer_gone("no memory for a transmit batch");
    return true;
  }
  restart_batch();
  hdr_used_ = 0;
  if (sent < kHeaderSize) {
    const auto hdr = batch_header();
    std::memcpy(hdr.data(), header.data(), kHeaderSize);
    add_iov(hdr.data() + sent, kHeaderSize - sent, {});
  }
  const std::size_t skip = sent > kHeaderSize ? sent - kHeaderSize : 0;
  if (e.length > skip) add_iov(reinterpret_cast<std::byte*>(sges_of(sq_tx_ - 1)) + skip, e.length - skip, {});
  mark_request_end(sq_tx_);
  flush();
  return true;
}

// Frames what fits of a read response: data fragments, then the last
// frame. A source that is no longer registered turns the rest into a NAK.
bool tcp_qp::fill_read(response& r, std::uint64_t pos) noexcept {
  if (!r.poisoned && r.left > 0 &&
      table_.check(r.key, r.addr, std::min<std::uint64_t>(r.left, kReadFragment), access::remote_read, serial_) ==
          nullptr) {
    r.poisoned = true;
    log().warn("qp {}: the source of read {} was deregistered while its data was being sent", qpn_, r.h.psn);
  }
  if (r.poisoned) {
    if (iov_count_ + 1 > kMaxIov) return false;
    const auto hdr = batch_header();
    encode(nak_header(r.h.psn, nak_code::remote_access), hdr);
    add_header(hdr.data());
    fatal_pending_ = true;
    return true;
  }
  while (r.left > 0) {
    if (iov_count_ + 2 > kMaxIov) return false;  // (a header per header iovec: hdr has room)
    const auto n = static_cast<std::uint32_t>(std::min<std::uint64_t>(r.left, kReadFragment));
    frame_header f;
    f.type = frame_type::read_response;
    f.psn = r.h.psn;
    f.length = n;
    f.remote_addr = r.offset;
    const auto hdr = batch_header();
    encode(f, hdr);
    add_header(hdr.data());
    add_iov(reinterpret_cast<const void*>(r.addr), n, {iov_kind::read_payload, false, r.key, pos});
    r.addr += n;
    r.offset += n;
    r.left -= n;
  }
  if (iov_count_ + 1 > kMaxIov) return false;
  frame_header last;
  last.type = frame_type::read_response;
  last.flags = kFlagLast;
  last.psn = r.h.psn;
  last.remote_addr = r.offset;
  const auto hdr = batch_header();
  encode(last, hdr);
  add_header(hdr.data(), {iov_kind::read_end, false, 0, pos});
  return true;
}

bool tcp_qp::iov_holds_requests() const noexcept {
  for (std::size_t i = iov_pos_; i < iov_count_; ++i) {
    if (tx_->ref[i].kind == iov_kind::request_payload) return true;
  }
  return false;
}

// Pins every registration the unsent part of the batch points into, for
// the sendmsg that follows. A read source that is gone is replaced by
// zeros and its response ends with a NAK; a request's own memory that is
// gone cuts the stream (false).
bool tcp_qp::pin_iov() noexcept {
  npinned_ = 0;
  iov_end_ = iov_count_;
  if (!tx_pins_) return true;  // (headers and inline bytes: the provider's own)
  for (std::size_t i = iov_pos_; i < iov_end_; ++i) {
    iov_ref& ref = tx_->ref[i];
    if (ref.kind != iov_kind::request_payload && ref.kind != iov_kind::read_payload) continue;
    const access need = ref.kind == iov_kind::read_payload ? access::remote_read : access::none;
    // iov_base holds the registered address until it is first pinned, then
    // where the bytes are (a dma-buf registration's mapping): delta undoes it.
    const auto addr = reinterpret_cast<std::uint64_t>(tx_->iov[i].iov_base) - ref.delta;
    memory_copier* copier = nullptr;
    std::byte* p = table_.pin(ref.key, addr, tx_->iov[i].iov_len, need, via(need), copier);
    if (p != nullptr && copier == nullptr) {
      tx_->pinned[npinned_++] = ref.key;
      tx_->iov[i].iov_base = p;
      ref.delta = reinterpret_cast<std::uint64_t>(p) - addr;
      continue;
    }
    if (p != nullptr) {
      // Copied memory: this sendmsg ends with a piece of it (or before it,
      // at the per-call limit), copied out
      // (the next one sends the rest; the bounce holds the bytes, so the
      // registration need not stay pinned, only be there now, or until
      // the copy of the next piece, started meanwhile, is settled).
      bool keep = false;
      const bool copied = bounce(i, addr, p, *copier, keep);
      if (keep) tx_->pinned[npinned_++] = ref.key;
      else table_.unpin(ref.key);
      if (copied) {
        iov_end_ = i + 1;
        break;
      }
      p = nullptr;
    }
    if (ref.kind == iov_kind::request_payload) {
      unpin_iov();
      return false;
    }
    tx_->iov[i].iov_base = g_zeros;  // the rest of this fragment (at most kReadFragment bytes)
    ref.kind = iov_kind::plain;
    poison_read(ref.resp);
  }
  return true;
}

bool tcp_qp::bounce(std::size_t i, std::uint64_t addr, const std::byte* p, memory_copier& copier,
                    bool& keep) noexcept {
  keep = false;
  if (tx_bounce_ == nullptr) tx_bounce_ = copier.bounce_buffer(kCopyBounce);
  if (tx_bounce_ == nullptr) {
    log().warn("qp {}: no memory for the bounce buffer of copied memory", qpn_);
    return false;
  }
  if (tx_next_ == nullptr) tx_next_ = copier.bounce_buffer(kCopyBounce);  // (none: no copies ahead)
  std::size_t skip = 0;
  if (held_iov_ == i && addr >= held_addr_ && addr - held_addr_ < held_len_) {
    skip = static_cast<std::size_t>(addr - held_addr_);  // still there from the last sendmsg
  } else if (next_iov_ == i && addr == next_addr_) {
    // Copied out during the last sendmsg (and settled after it).
    std::swap(tx_bounce_, tx_next_);
    next_iov_ = kNoBounce;
    held_iov_ = i;
    held_addr_ = addr;
    held_len_ = next_len_;
  } else {
    const std::size_t n = std::min(tx_->iov[i].iov_len, kCopyBounce);
    held_iov_ = kNoBounce;
    if (const std::error_code ec = copier.to_host(tx_bounce_.get(), p, n)) {
      log().warn("qp {}: copying {} bytes out of copied memory failed: {}", qpn_, n, ec.message());
      return false;
    }
    held_iov_ = i;
    held_addr_ = addr;
    held_len_ = n;
  }
  bounced_ = i;
  bounced_addr_ = addr;
  bounced_full_ = tx_->iov[i].iov_len;
  bounced_base_ = tx_bounce_.get() + skip;
  bounced_len_ = std::min(held_len_ - skip, tx_->iov[i].iov_len);
  // The iovec's next piece is copied out while this one is sent.
  const std::size_t after = bounced_full_ - bounced_len_;
  if (tx_next_ != nullptr && after > 0 && next_iov_ != i) {
    const std::size_t n = std::min(after, kCopyBounce);
    next_iov_ = kNoBounce;
    if (copier.start_to_host(tx_next_.get(), p + bounced_len_, n)) {
      // (no copy ahead: the next bounce copies the piece itself, and says
      // what failed)
    } else {
      next_iov_ = i;
      next_addr_ = addr + bounced_len_;
      next_len_ = n;
      next_pending_ = true;
      next_copier_ = &copier;
      keep = true;
    }
  }
  tx_->iov[i].iov_base = bounced_base_;
  tx_->iov[i].iov_len = bounced_len_;
  return true;
}

// The copy ahead started by bounce() is waited for (while its memory is
// still pinned); one that failed is forgotten (the next bounce copies the
// piece again and reports it).
void tcp_qp::settle_tx_copy() noexcept {
  if (!next_pending_) return;
  next_pending_ = false;
  if (next_copier_->finish()) next_iov_ = kNoBounce;
}

void tcp_qp::unbounce() noexcept {
  if (bounced_ == kNoBounce) return;
  const std::size_t i = bounced_;
  bounced_ = kNoBounce;
  // What of the piece went: all of it once iov_pos_ is past the iovec,
  // the part before its base while it is the current one, else none.
  std::size_t sent = 0;
  if (iov_pos_ > i) sent = bounced_len_;
  else if (iov_pos_ == i) sent = static_cast<std::size_t>(static_cast<std::byte*>(tx_->iov[i].iov_base) - bounced_base_);
  const std::size_t left = bounced_full_ - sent;
  tx_->iov[i].iov_base = reinterpret_cast<void*>(bounced_addr_ + sent);  // a registered address again
  tx_->iov[i].iov_len = left;
  tx_->ref[i].delta = 0;
  if (left != 0 && iov_pos_ > i) iov_pos_ = i;
}

void tcp_qp::unpin_iov() noexcept {
  settle_tx_copy();
  for (std::size_t i = 0; i < npinned_; ++i) table_.unpin(tx_->pinned[i]);
  npinned_ = 0;
}

// A read response whose source went away: no more of its data, and its
// last frame becomes a NAK (remote access error), so the requester fails
// the read instead of completing it with zeros.
void tcp_qp::poison_read(std::uint64_t pos) noexcept {
  response& r = resp_[ring_slot(pos, resp_.size())];
  if (r.poisoned) return;
  r.poisoned = true;
  r.left = 0;
  fatal_pending_ = true;
  log().warn("qp {}: the source of read {} was deregistered while its data was being sent", qpn_, r.h.psn);
  for (std::size_t i = iov_pos_; i < iov_count_; ++i) {
    if (tx_->ref[i].kind != iov_kind::read_end || tx_->ref[i].resp != pos) continue;
    encode(nak_header(r.h.psn, nak_code::remote_access),
           std::span<std::byte, kHeaderSize>(static_cast<std::byte*>(tx_->iov[i].iov_base), kHeaderSize));
    tx_->ref[i].kind = iov_kind::plain;
    return;
  }
  // Its last frame is not in the batch yet: fill_read sends the NAK.
}

// A NAK that ended a read response is queued: the queue pair goes to
// error, sending what is queued first (as after any fatal NAK).
void tcp_qp::check_fatal() noexcept {
  if (!fatal_pending_ || state_ == qp_state::error) return;
  fatal_pending_ = false;
  close_when_flushed_ = true;
  enter_error(wc_status::work_request_flushed);
}

// The batch is borrowed when there are frames to send and given back once
// they are all out.
void tcp_qp::flush() noexcept {
  flush_batch();
  if (tx_ != nullptr && iov_pos_ == iov_count_) batches_->give(std::exchange(tx_, nullptr));
}

void tcp_qp::flush_batch() noexcept {
  while (fd_ >= 0) {
    if (iov_pos_ == iov_count_) {
      if (cut_pending_) {
        cut_pending_ = false;
        peer_gone("fault injection: connection cut after " + std::to_string(frames_sent_) + " frames");
        return;
      }
      resp_head_ = resp_queued_;
      restart_batch();
      if (rewind_pending_) {
        rewind_pending_ = false;
        counters_.retransmits += sq_tx_ - rewind_to_;
        for (std::uint64_t i = rewind_to_; i < sq_tx_; ++i) {
          if (needs_response(sq_[ring_slot(i, attr_.max_send_wr)].wr.op)) --rd_atomic_out_;
        }
        sq_tx_ = rewind_to_;
        sq_sent_ = std::min(sq_sent_, rewind_to_);
        rd_done_ = rd_off_ = 0;
        rd_sge_ = 0;
        // A bind or failed request that waited at the old sq_tx_ waits again
        // when fill_iov reaches it (the requests before it go out again first).
        tx_blocked_ = false;
      }
      if (close_when_flushed_ && resp_head_ == resp_tail_) {
        close_socket();
        return;
      }
      if (resp_queued_ == resp_tail_ && sq_tx_ == sq_tail_) break;  // nothing to frame
      if (tx_ == nullptr && (tx_ = batches_->take()) == nullptr) {
        peer_gone("no memory for a transmit batch");
        return;
      }
      if (!fill_iov()) break;
      if (faults_ != nullptr) inject_tx_faults();
    }
    if (faults_ != nullptr && tx_held(std::chrono::steady_clock::now())) break;
    if (!pin_iov()) {
      log().warn("qp {}: memory of a request in flight was deregistered; the connection is cut", qpn_);
      close_when_flushed_ = false;
      close_socket();
      enter_error(wc_status::local_protection_error);
      return;
    }
    // At most kMaxSendBytes per call: the iovec that crosses the limit is
    // cut short for this call and whole again after it.
    std::size_t end = iov_pos_, bytes = 0;
    while (end < iov_end_ && bytes < tx_batch::kMaxSendBytes) bytes += tx_->iov[end++].iov_len;
    iovec* const cut = bytes > tx_batch::kMaxSendBytes ? &tx_->iov[end - 1] : nullptr;
    const std::size_t cut_len = cut != nullptr ? cut->iov_len : 0;
    if (cut != nullptr) cut->iov_len -= bytes - tx_batch::kMaxSendBytes;
    const std::size_t given = std::min(bytes, tx_batch::kMaxSendBytes);
    largest_send_ = std::max(largest_send_, given);
    msghdr msg{};
    msg.msg_iov = &tx_->iov[iov_pos_];
    msg.msg_iovlen = end - iov_pos_;
    const ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (cut != nullptr) cut->iov_len = cut_len;
    unpin_iov();
    if (n < 0) unbounce();  // (nothing went)
    ++counters_.tx_syscalls;
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      peer_gone(std::strerror(errno));
      return;
    }
    counters_.bytes_sent += static_cast<std::uint64_t>(n);
    auto left = static_cast<std::size_t>(n);
    const std::size_t from = iov_pos_;
    while (left > 0 && iov_pos_ < iov_count_) {
      iovec& v = tx_->iov[iov_pos_];
      const std::size_t take = std::min(left, v.iov_len);
      v.iov_base = static_cast<std::byte*>(v.iov_base) + take;
      v.iov_len -= take;
      left -= take;
      if (v.iov_len == 0) ++iov_pos_;
    }
    unbounce();  // (may step back into a copied piece not all sent)
    for (std::size_t i = from; i < iov_pos_; ++i) {
      if (tx_->ref[i].request_end) sq_sent_ = std::max(sq_sent_, tx_->ref[i].resp);
    }
  }
  if (rx_paused_ && resp_tail_ - resp_head_ < resp_.size()) {
    rx_paused_ = false;  // room again: read on (what arrived meanwhile waits in the socket)
  }
  update_interest();
}

void tcp_qp::watch(bool write, bool read) noexcept {
  want_write_ = write;
  want_read_ = read;
  static_cast<tcp_cq*>(attr_.send_cq)->watch(fd_, this, write, read);
  if (attr_.recv_cq != attr_.send_cq) static_cast<tcp_cq*>(attr_.recv_cq)->watch(fd_, this, write, read);
}

// ---------------------------------------------------------------- fault injection

// A new batch: counts its frames, corrupts or cuts where the plan says,
// and starts its delay.
void tcp_qp::inject_tx_faults() noexcept {
  const fault_plan& f = *faults_;
  for (std::size_t i = 0; i < iov_count_; ++i) {
    if (!tx_->ref[i].header) continue;
    ++frames_sent_;
    if (f.corrupt && frames_sent_ == *f.corrupt) {
      // A header the peer's checks refuse (its version byte inverted).
      std::memcpy(corrupt_hdr_.data(), tx_->iov[i].iov_base, kHeaderSize);
      corrupt_hdr_[0] = ~corrupt_hdr_[0];
      tx_->iov[i].iov_base = corrupt_hdr_.data();
      log().warn("qp {}: fault injection: frame {} goes out corrupt", qpn_, frames_sent_);
    }
    if (f.cut_after && frames_sent_ == *f.cut_after) {
      std::size_t end = i + 1;  // this frame's payload still goes
      while (end < iov_count_ && !tx_->ref[end].header) ++end;
      iov_count_ = end;
      cut_pending_ = true;
      break;
    }
  }
  if (f.delay_ms != 0) tx_hold_until_ = clock::now() + std::chrono::milliseconds(f.delay_ms);
}

// True while the batch waits out its injected delay (the timer flushes it).
bool tcp_qp::tx_held(clock_point now) noexcept {
  if (tx_hold_until_ == clock_point{}) return false;
  if (now < tx_hold_until_) {
    static_cast<tcp_cq*>(attr_.send_cq)->schedule(tx_hold_until_);
    update_interest();
    return true;
  }
  tx_hold_until_ = {};
  return false;
}

void tcp_qp::begin_rx_stall() noexcept {
  rx_stalled_ = true;
  rx_stall_done_ = true;
  log().warn("qp {}: fault injection: stops reading after {} frames{}", qpn_, frames_received_,
             faults_->stall_ms != 0 ? " for " + std::to_string(faults_->stall_ms) + " ms" : std::string{});
  if (faults_->stall_ms != 0) {
    rx_stall_until_ = clock::now() + std::chrono::milliseconds(faults_->stall_ms);
    static_cast<tcp_cq*>(attr_.send_cq)->schedule(rx_stall_until_);
  }
  update_interest();
}

void tcp_qp::queue_response(const frame_header& h) noexcept {
  const std::size_t cap = resp_.size();
  if (h.type == frame_type::ack && resp_tail_ > resp_queued_) {
    response& last = resp_[ring_slot(resp_tail_ - 1, cap)];
    if (last.h.type == frame_type::ack) {  // cumulative: one ACK covers both
      last.h.psn = h.psn;
      return;
    }
  }
  response& r = resp_[ring_slot(resp_tail_++, cap)];
  r = response{};
  r.h = h;
}

// The data of a checked read request: framed by fill_read as the
// transmitter gets to it, the source looked up again each time.
void tcp_qp::queue_read_response(const frame_header& request) noexcept {
  response& r = resp_[ring_slot(resp_tail_++, resp_.size())];
  r = response{};
  r.h.type = frame_type::read_response;
  r.h.psn = request.psn;
  r.key = request.rkey;
  r.addr = request.remote_addr;
  r.left = request.read_length;
}

void tcp_qp::nak(std::uint32_t psn, nak_code code, bool fatal) noexcept {
  queue_response(nak_header(psn, code));
  if (fatal) {
    log().warn("qp {}: request {} from peer failed (NAK code {}); moving the queue pair to error", qpn_, psn,
               static_cast<std::uint32_t>(code));
    close_when_flushed_ = true;
    enter_error(wc_status::work_request_flushed);
  }
}

}  // namespace anydoor::transport::tcp
