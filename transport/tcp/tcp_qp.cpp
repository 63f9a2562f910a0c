// The tcp provider's queue pair: requester and responder of one RC
// connection over a TCP socket.
//
// Requester: post_send encodes each work request's header into its send
// queue slot; flush() gathers whole frames (header + payload straight from
// registered memory) into one sendmsg. A request completes when the peer's
// response arrives (ACK, NAK, read or atomic response), in order.
// Responder: receive() parses frames, checks every remote access against the
// protection domain's registrations, places payloads (straight from the socket
// into the destination when large), executes atomics, and queues responses.
// RNR: a send (or write with immediate) that finds no receive is NAKed; the
// responder drops later requests until the NAKed one comes again; the
// requester waits min_rnr_timer_us, then sends again from the NAKed request
// (go-back-N), at most rnr_retry times (7: forever).
#include "tcp/tcp_provider.hpp"

#include <anydoor/error.hpp>

#include "contract_checks.hpp"
#include "log.hpp"

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <system_error>

namespace anydoor::transport::tcp {
namespace {

std::atomic<std::uint32_t> g_next_qpn{1};

// A socket address as a 16-byte GID-like value (IPv4 mapped to ::ffff:0:0/96).
std::array<std::uint8_t, 16> as_gid(const sockaddr_storage& a) noexcept {
  std::array<std::uint8_t, 16> g{};
  if (a.ss_family == AF_INET) {
    g[10] = g[11] = 0xff;
    std::memcpy(g.data() + 12, &reinterpret_cast<const sockaddr_in&>(a).sin_addr, 4);
  } else if (a.ss_family == AF_INET6) {
    std::memcpy(g.data(), &reinterpret_cast<const sockaddr_in6&>(a).sin6_addr, 16);
  }
  return g;
}

path_info socket_path(int fd) noexcept {
  path_info p;
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) p.sgid = as_gid(a);
  len = sizeof a;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) p.dgid = as_gid(a);
  return p;
}
constexpr std::size_t kRxBufferSize = 64 * 1024;
constexpr std::size_t kDirectReadMin = 16 * 1024;
constexpr int kMaxFramesPerProgress = 256;
// What one progress pass of a queue pair in error reads and drops.
constexpr std::size_t kMaxDiscardPerPass = 4 * kRxBufferSize;
// Responses queued per connection: enough to keep the link busy; a peer
// with more requests outstanding waits (its frames stay in the socket).
constexpr std::size_t kMaxResponseSlots = 1024;
// Reads and atomics a requester has outstanding at most (like verbs'
// max_rd_atomic): each needs a response slot at the peer, whose ring holds
// 2 x kMaxResponseSlots + 8, so conforming peers never fill it.
constexpr std::uint32_t kMaxReadAtomic = kMaxResponseSlots;

bool needs_response(opcode op) noexcept { return op == opcode::read || is_atomic(op); }

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

bool psn_le(std::uint32_t a, std::uint32_t b) noexcept { return static_cast<std::int32_t>(b - a) >= 0; }

void check_attr(const qp_attributes& a) {
  const char* why = nullptr;
  if (a.send_cq == nullptr || a.recv_cq == nullptr) why = "send_cq and recv_cq are required";
  else if (a.max_send_wr == 0 || a.max_send_wr > (1u << 15)) why = "max_send_wr must be in 1..32768";
  else if (a.max_recv_wr == 0 || a.max_recv_wr > (1u << 15)) why = "max_recv_wr must be in 1..32768";
  else if (a.max_send_sge == 0 || a.max_send_sge > 16) why = "max_send_sge must be in 1..16";
  else if (a.max_recv_sge == 0 || a.max_recv_sge > 16) why = "max_recv_sge must be in 1..16";
  else if (a.max_inline_data > 1024) why = "max_inline_data must be at most 1024";
  else if (a.rnr_retry > 7) why = "rnr_retry must be in 0..7";
  if (why != nullptr) throw std::system_error(errc::invalid_argument, std::string("create_qp: ") + why);
  if (dynamic_cast<tcp_cq*>(a.send_cq) == nullptr || dynamic_cast<tcp_cq*>(a.recv_cq) == nullptr) {
    throw std::system_error(errc::invalid_argument, "create_qp: completion queues of another provider");
  }
}

}  // namespace

tcp_qp::tcp_qp(const registration_table& table, const qp_attributes& attr, std::shared_ptr<rnr_totals> totals)
    : table_(table), attr_(attr), qpn_(g_next_qpn.fetch_add(1, std::memory_order_relaxed)), totals_(std::move(totals)) {
  check_attr(attr_);
  sq_.resize(attr_.max_send_wr);
  sq_sges_.resize(std::size_t{attr_.max_send_wr} * attr_.max_send_sge);
  inline_.resize(std::size_t{attr_.max_send_wr} * attr_.max_inline_data);
  rq_.resize(attr_.max_recv_wr);
  rq_sges_.resize(std::size_t{attr_.max_recv_wr} * attr_.max_recv_sge);
  rx_buf_.resize(kRxBufferSize);
  rnr_left_ = attr_.rnr_retry;
  auto* scq = static_cast<tcp_cq*>(attr_.send_cq);
  auto* rcq = static_cast<tcp_cq*>(attr_.recv_cq);
  if (scq == rcq) {
    scq->attach(this, attr_.max_send_wr + attr_.max_recv_wr);
  } else {
    scq->attach(this, attr_.max_send_wr);
    rcq->attach(this, attr_.max_recv_wr);
  }
}

tcp_qp::~tcp_qp() {
  close_socket();
  if (attr_.send_cq != nullptr && attr_.send_cq == attr_.recv_cq) {
    static_cast<tcp_cq*>(attr_.send_cq)->detach(this, attr_.max_send_wr + attr_.max_recv_wr);
    return;
  }
  if (attr_.send_cq != nullptr) static_cast<tcp_cq*>(attr_.send_cq)->detach(this, attr_.max_send_wr);
  if (attr_.recv_cq != nullptr) static_cast<tcp_cq*>(attr_.recv_cq)->detach(this, attr_.max_recv_wr);
}

void tcp_qp::forget_cq(const tcp_cq* cq) noexcept {
  close_socket();
  if (attr_.send_cq == cq) attr_.send_cq = nullptr;
  if (attr_.recv_cq == cq) attr_.recv_cq = nullptr;
}

// ---------------------------------------------------------------- state machine

std::error_code tcp_qp::modify(qp_state next) noexcept {
  const qp_state prev = state_;
  switch (next) {
    case qp_state::error:
      close_when_flushed_ = false;
      enter_error(wc_status::work_request_flushed);
      return {};
    case qp_state::reset:
      close_socket();
      // Like verbs: outstanding work is discarded without completions.
      sq_head_ = sq_ack_ = sq_tx_ = sq_tail_ = 0;
      rq_head_ = rq_tail_ = 0;
      next_psn_ = expected_psn_ = 1;
      rnr_left_ = attr_.rnr_retry;
      rnr_waiting_ = rewind_pending_ = rnr_discard_ = tx_blocked_ = false;
      rd_done_ = rd_off_ = 0;
      rd_sge_ = 0;
      rd_atomic_out_ = 0;
      state_ = qp_state::reset;
      break;
    case qp_state::init:
      if (state_ != qp_state::reset) return errc::invalid_state;
      state_ = qp_state::init;
      break;
    case qp_state::rtr:
      if (state_ != qp_state::init) return errc::invalid_state;
      if (fd_ < 0) return errc::not_connected;
      state_ = qp_state::rtr;
      break;
    case qp_state::rts:
      if (state_ != qp_state::rtr) return errc::invalid_state;
      state_ = qp_state::rts;
      break;
  }
  log().debug("qp {}: {} -> {}", qpn_, to_string(prev), to_string(state_));
  return {};
}

std::error_code tcp_qp::attach_socket(int fd, std::uint32_t peer_max_send_wr) noexcept {
  if (!can_connect()) {
    ::close(fd);
    return errc::invalid_state;
  }
  fd_ = fd;
  path_ = socket_path(fd);
  // Each request of the peer yields at most one response; the ring bounds
  // what a peer can make us hold (the handshake checked the value too).
  resp_.assign(std::min<std::size_t>(std::max<std::uint32_t>(peer_max_send_wr, 1), kMaxResponseSlots) * 2 + 8,
               response{});
  fatal_pending_ = false;
  rx_paused_ = false;
  resp_head_ = resp_queued_ = resp_tail_ = 0;
  iov_count_ = iov_pos_ = 0;
  rx_begin_ = rx_end_ = 0;
  phase_ = rx_phase::header;
  close_when_flushed_ = false;
  want_write_ = false;
  log().debug("qp {}: {} -> rts (connected)", qpn_, to_string(state_));
  state_ = qp_state::rts;
  static_cast<tcp_cq*>(attr_.send_cq)->watch(fd_, this, false);
  if (attr_.recv_cq != attr_.send_cq) static_cast<tcp_cq*>(attr_.recv_cq)->watch(fd_, this, false);
  live_.store(true, std::memory_order_release);  // the completion queues may drive it from now on
  // The socket is watched before it is live: a reactor woken by data that
  // arrived in between polled, skipped this not-yet-live queue pair and went
  // back to sleep, and that data brings no new wake-up. Wake it again.
  static_cast<tcp_cq*>(attr_.send_cq)->signal();
  if (attr_.recv_cq != attr_.send_cq) static_cast<tcp_cq*>(attr_.recv_cq)->signal();
  return {};
}

void tcp_qp::close_socket() noexcept {
  if (fd_ < 0) return;
  live_.store(false, std::memory_order_relaxed);
  if (attr_.send_cq != nullptr) static_cast<tcp_cq*>(attr_.send_cq)->unwatch(fd_);
  if (attr_.recv_cq != nullptr && attr_.recv_cq != attr_.send_cq) static_cast<tcp_cq*>(attr_.recv_cq)->unwatch(fd_);
  ::close(fd_);
  fd_ = -1;
  iov_count_ = iov_pos_ = 0;
  resp_head_ = resp_queued_ = resp_tail_ = 0;
  rx_begin_ = rx_end_ = 0;
  phase_ = rx_phase::header;
  close_when_flushed_ = false;
  rx_paused_ = false;
}

void tcp_qp::push_send(const completion& c) noexcept {
  if (attr_.send_cq != nullptr) static_cast<tcp_cq*>(attr_.send_cq)->push(c);
}

void tcp_qp::push_recv(const completion& c) noexcept {
  if (attr_.recv_cq != nullptr) static_cast<tcp_cq*>(attr_.recv_cq)->push(c);
}

void tcp_qp::enter_error(wc_status head_status) noexcept {
  if (state_ == qp_state::error) return;
  log().debug("qp {}: {} -> error ({})", qpn_, to_string(state_), to_string(head_status));
  state_ = qp_state::error;
  // Every outstanding request completes exactly once, signaled or not.
  for (std::uint64_t i = sq_ack_; i < sq_tail_; ++i) {
    const sq_entry& e = sq_[i % attr_.max_send_wr];
    const wc_status s = i == sq_ack_ ? head_status : wc_status::work_request_flushed;
    push_send({.wr_id = e.wr.wr_id, .status = s, .opcode = completion_opcode(e.wr.op), .qp_num = qpn_});
  }
  sq_head_ = sq_ack_ = sq_tx_ = sq_tail_;
  for (std::uint64_t i = rq_head_; i < rq_tail_; ++i) {
    push_recv({.wr_id = rq_[i % attr_.max_recv_wr].wr_id, .status = wc_status::work_request_flushed,
               .opcode = wc_opcode::recv, .qp_num = qpn_});
  }
  rq_head_ = rq_tail_;
  rnr_waiting_ = rewind_pending_ = tx_blocked_ = false;
  rd_done_ = rd_off_ = 0;
  rd_sge_ = 0;
  rd_atomic_out_ = 0;
  // The requests just completed (flushed) may still have payload in the
  // transmit batch: their memory is the caller's again, so nothing more of
  // the batch may be sent; the stream is cut.
  if (fd_ >= 0 && iov_holds_requests()) close_when_flushed_ = false;
  // Acknowledgements already generated (a NIC would have sent them at once;
  // this one may hold a lone ACK back) still reach the peer before the close.
  else if (fd_ >= 0 && resp_queued_ < resp_tail_) close_when_flushed_ = true;
  if (close_when_flushed_ && fd_ >= 0) {
    // A NAK still has to reach the peer; flush() closes once it is out.
    flush();
  } else {
    close_socket();
  }
}

void tcp_qp::peer_gone(std::string_view why) noexcept {
  if (sq_ack_ < sq_tail_ || phase_ == rx_phase::payload || rx_begin_ < rx_end_) {
    log().warn("qp {}: connection lost with work outstanding: {}", qpn_, why);
  } else {
    log().info("qp {}: disconnected: {}", qpn_, why);
  }
  close_when_flushed_ = false;
  close_socket();
  enter_error(sq_ack_ < sq_tx_ ? wc_status::retry_exceeded : wc_status::work_request_flushed);
}

void tcp_qp::protocol_error(std::string_view why) noexcept {
  log().warn("qp {}: bad frame from peer: {}; moving the queue pair to error", qpn_, why);
  close_when_flushed_ = false;
  close_socket();
  enter_error(sq_ack_ < sq_tx_ ? wc_status::bad_response : wc_status::work_request_flushed);
}

void tcp_qp::on_cq_overflow() noexcept {
  // A queue pair not yet live belongs to the thread connecting it (which
  // may be writing its state now): it is never driven by this overflowed
  // queue, and the consumer tears everything down on cq_overflow anyway.
  if (!wants_progress()) return;
  close_when_flushed_ = false;
  enter_error(wc_status::work_request_flushed);
}

// ---------------------------------------------------------------- posting

std::error_code tcp_qp::post_recv(std::span<const recv_request> wrs, std::size_t* bad) noexcept {
  if (state_ == qp_state::reset) return errc::invalid_state;
  if (auto ec = check_recv(wrs, attr_.max_recv_sge, attr_.max_recv_wr, rq_tail_ - rq_head_, bad)) return ec;
  counters_.recv_wrs += wrs.size();
  for (const recv_request& wr : wrs) {
    if (state_ == qp_state::error) {
      push_recv({.wr_id = wr.wr_id, .status = wc_status::work_request_flushed, .opcode = wc_opcode::recv,
                 .qp_num = qpn_});
      continue;
    }
    const std::uint64_t idx = rq_tail_++;
    rq_[idx % attr_.max_recv_wr] = {wr.wr_id, static_cast<std::uint32_t>(wr.sg_list.size())};
    std::copy(wr.sg_list.begin(), wr.sg_list.end(), rq_sges_of(idx));
  }
  return {};
}

std::error_code tcp_qp::post_send(std::span<const work_request> wrs, std::size_t* bad) noexcept {
  if (state_ != qp_state::rts && state_ != qp_state::error) return errc::invalid_state;
  const send_limits lim{attr_.max_send_sge, attr_.max_inline_data, kMaxPayload, attr_.max_send_wr,
                        sq_tail_ - sq_head_};
  if (auto ec = check_send(wrs, lim, bad)) return ec;
  counters_.send_wrs += wrs.size();
  if (state_ == qp_state::error) {
    for (const work_request& wr : wrs) {
      push_send({.wr_id = wr.wr_id, .status = wc_status::work_request_flushed,
                 .opcode = completion_opcode(wr.op), .qp_num = qpn_});
    }
    return {};
  }
  ++counters_.doorbells;
  for (const work_request& wr : wrs) {
    const std::uint64_t idx = sq_tail_++;
    sq_entry& e = sq_[idx % attr_.max_send_wr];
    sge* sges = sges_of(idx);
    e.wr = wr;
    e.local_error = wc_status::success;
    e.length = 0;
    if (wr.inline_data) {
      std::byte* buf = &inline_[(idx % attr_.max_send_wr) * attr_.max_inline_data];
      std::size_t off = 0;
      for (const sge& s : wr.sg_list) {
        std::memcpy(buf + off, reinterpret_cast<const void*>(s.addr), s.length);
        off += s.length;
      }
      sges[0] = {reinterpret_cast<std::uint64_t>(buf), static_cast<std::uint32_t>(off), 0};
      e.wr.sg_list = {sges, 1};
      e.length = static_cast<std::uint32_t>(off);
    } else {
      const access need = carries_data(wr.op) ? access::none : access::local_write;
      std::copy(wr.sg_list.begin(), wr.sg_list.end(), sges);
      e.wr.sg_list = {sges, wr.sg_list.size()};
      for (const sge& s : wr.sg_list) {
        e.length += s.length;
        if (s.length != 0 && table_.check(s.lkey, s.addr, s.length, need) == nullptr) {
          e.local_error = wc_status::local_protection_error;
        }
      }
    }
    e.psn = next_psn_++;
    build_request_header(e);
  }
  flush();
  check_fatal();
  check_local_error();
  return {};
}

void tcp_qp::build_request_header(sq_entry& e) noexcept {
  frame_header h;
  h.psn = e.psn;
  h.remote_addr = e.wr.remote_addr;
  h.rkey = e.wr.rkey;
  switch (e.wr.op) {
    case opcode::send:
    case opcode::send_with_imm:
      h.type = frame_type::send;
      h.length = e.length;
      break;
    case opcode::write:
    case opcode::write_with_imm:
      h.type = frame_type::write;
      h.length = e.length;
      break;
    case opcode::read:
      h.type = frame_type::read_request;
      h.read_length = e.length;
      break;
    case opcode::fetch_add:
      h.type = frame_type::fetch_add;
      h.compare_add = e.wr.compare_add;
      break;
    case opcode::compare_swap:
      h.type = frame_type::compare_swap;
      h.compare_add = e.wr.compare_add;
      h.swap = e.wr.swap;
      break;
  }
  if (e.wr.op == opcode::send_with_imm || e.wr.op == opcode::write_with_imm) {
    h.flags = kFlagImm;
    h.imm = e.wr.imm;
  }
  encode(h, e.header);
}

// ---------------------------------------------------------------- transmit

void tcp_qp::add_iov(const void* p, std::size_t n, iov_ref ref) noexcept {
  iov_ref_[iov_count_] = ref;
  iov_[iov_count_++] = {const_cast<void*>(p), n};
}

bool tcp_qp::fill_iov() noexcept {
  frag_used_ = 0;
  const std::size_t cap = resp_.size();
  while (resp_queued_ < resp_tail_) {
    response& r = resp_[resp_queued_ % cap];
    if (r.h.type == frame_type::read_response) {
      if (!fill_read(r, resp_queued_)) return true;
    } else {
      if (iov_count_ + 1 > kMaxIov) return iov_count_ > 0;
      add_iov(r.header.data(), kHeaderSize, {});
    }
    ++resp_queued_;
  }
  if (state_ != qp_state::rts || rnr_waiting_ || rewind_pending_ || tx_blocked_ || fatal_pending_) {
    return iov_count_ > 0;
  }
  while (sq_tx_ < sq_tail_) {
    sq_entry& e = sq_[sq_tx_ % attr_.max_send_wr];
    if (e.local_error != wc_status::success) {
      tx_blocked_ = true;  // completes with the error once everything before it is acknowledged
      break;
    }
    std::size_t need = 1;
    if (carries_data(e.wr.op)) {
      for (const sge& s : e.wr.sg_list) need += s.length > 0 ? 1 : 0;
    }
    if (iov_count_ + need > kMaxIov) break;
    if (needs_response(e.wr.op)) {
      if (rd_atomic_out_ >= kMaxReadAtomic) break;  // sent when earlier ones are answered
      ++rd_atomic_out_;
    }
    add_iov(e.header.data(), kHeaderSize, {});
    if (carries_data(e.wr.op)) {
      for (const sge& s : e.wr.sg_list) {
        if (s.length == 0) continue;
        // Inline data lives in the provider (lkey 0); the rest is pinned per sendmsg.
        add_iov(reinterpret_cast<const void*>(s.addr), s.length,
            {e.wr.inline_data ? iov_kind::plain : iov_kind::request_payload, s.lkey, 0});
      }
    }
    ++sq_tx_;
  }
  return iov_count_ > 0;
}

// Frames what fits of a read response: data fragments, then the last
// frame. A source that is no longer registered turns the rest into a NAK.
bool tcp_qp::fill_read(response& r, std::uint64_t pos) noexcept {
  if (!r.poisoned && r.left > 0 &&
      table_.check(r.key, r.addr, std::min<std::uint64_t>(r.left, kReadFragment), access::remote_read) == nullptr) {
    r.poisoned = true;
    log().warn("qp {}: the source of read {} was deregistered while its data was being sent", qpn_, r.h.psn);
  }
  if (r.poisoned) {
    if (iov_count_ + 1 > kMaxIov) return false;
    encode(nak_header(r.h.psn, nak_code::remote_access), r.header);
    add_iov(r.header.data(), kHeaderSize, {});
    fatal_pending_ = true;
    return true;
  }
  while (r.left > 0) {
    if (iov_count_ + 2 > kMaxIov || frag_used_ == frag_hdr_.size()) return false;
    const auto n = static_cast<std::uint32_t>(std::min<std::uint64_t>(r.left, kReadFragment));
    frame_header f;
    f.type = frame_type::read_response;
    f.psn = r.h.psn;
    f.length = n;
    f.remote_addr = r.offset;
    auto& hdr = frag_hdr_[frag_used_++];
    encode(f, hdr);
    add_iov(hdr.data(), kHeaderSize, {});
    add_iov(reinterpret_cast<const void*>(r.addr), n, {iov_kind::read_payload, r.key, pos});
    r.addr += n;
    r.offset += n;
    r.left -= n;
  }
  if (iov_count_ + 1 > kMaxIov || frag_used_ == frag_hdr_.size()) return false;
  frame_header last;
  last.type = frame_type::read_response;
  last.flags = kFlagLast;
  last.psn = r.h.psn;
  last.remote_addr = r.offset;
  auto& hdr = frag_hdr_[frag_used_++];
  encode(last, hdr);
  add_iov(hdr.data(), kHeaderSize, {iov_kind::read_end, 0, pos});
  return true;
}

bool tcp_qp::iov_holds_requests() const noexcept {
  for (std::size_t i = iov_pos_; i < iov_count_; ++i) {
    if (iov_ref_[i].kind == iov_kind::request_payload) return true;
  }
  return false;
}

// Pins every registration the unsent part of the batch points into, for
// the sendmsg that follows. A read source that is gone is replaced by
// zeros and its response ends with a NAK; a request's own memory that is
// gone cuts the stream (false).
bool tcp_qp::pin_iov() noexcept {
  npinned_ = 0;
  for (std::size_t i = iov_pos_; i < iov_count_; ++i) {
    iov_ref& ref = iov_ref_[i];
    if (ref.kind != iov_kind::request_payload && ref.kind != iov_kind::read_payload) continue;
    const access need = ref.kind == iov_kind::read_payload ? access::remote_read : access::none;
    const auto addr = reinterpret_cast<std::uint64_t>(iov_[i].iov_base);
    if (table_.pin(ref.key, addr, iov_[i].iov_len, need) != nullptr) {
      pinned_[npinned_++] = ref.key;
      continue;
    }
    if (ref.kind == iov_kind::request_payload) {
      unpin_iov();
      return false;
    }
    iov_[i].iov_base = g_zeros;  // the rest of this fragment (at most kReadFragment bytes)
    ref.kind = iov_kind::plain;
    poison_read(ref.resp);
  }
  return true;
}

void tcp_qp::unpin_iov() noexcept {
  for (std::size_t i = 0; i < npinned_; ++i) table_.unpin(pinned_[i]);
  npinned_ = 0;
}

// A read response whose source went away: no more of its data, and its
// last frame becomes a NAK (remote access error), so the requester fails
// the read instead of completing it with zeros.
void tcp_qp::poison_read(std::uint64_t pos) noexcept {
  response& r = resp_[pos % resp_.size()];
  if (r.poisoned) return;
  r.poisoned = true;
  r.left = 0;
  fatal_pending_ = true;
  log().warn("qp {}: the source of read {} was deregistered while its data was being sent", qpn_, r.h.psn);
  for (std::size_t i = iov_pos_; i < iov_count_; ++i) {
    if (iov_ref_[i].kind != iov_kind::read_end || iov_ref_[i].resp != pos) continue;
    encode(nak_header(r.h.psn, nak_code::remote_access),
           std::span<std::byte, kHeaderSize>(static_cast<std::byte*>(iov_[i].iov_base), kHeaderSize));
    iov_ref_[i].kind = iov_kind::plain;
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

void tcp_qp::flush() noexcept {
  while (fd_ >= 0) {
    if (iov_pos_ == iov_count_) {
      resp_head_ = resp_queued_;
      iov_count_ = iov_pos_ = 0;
      if (rewind_pending_) {
        rewind_pending_ = false;
        counters_.retransmits += sq_tx_ - rewind_to_;
        for (std::uint64_t i = rewind_to_; i < sq_tx_; ++i) {
          if (needs_response(sq_[i % attr_.max_send_wr].wr.op)) --rd_atomic_out_;
        }
        sq_tx_ = rewind_to_;
        rd_done_ = rd_off_ = 0;
        rd_sge_ = 0;
      }
      if (close_when_flushed_ && resp_head_ == resp_tail_) {
        close_socket();
        return;
      }
      if (!fill_iov()) break;
    }
    if (!pin_iov()) {
      log().warn("qp {}: memory of a request in flight was deregistered; the connection is cut", qpn_);
      close_when_flushed_ = false;
      close_socket();
      enter_error(wc_status::local_protection_error);
      return;
    }
    msghdr msg{};
    msg.msg_iov = &iov_[iov_pos_];
    msg.msg_iovlen = iov_count_ - iov_pos_;
    const ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    unpin_iov();
    ++counters_.tx_syscalls;
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      peer_gone(std::strerror(errno));
      return;
    }
    counters_.bytes_sent += static_cast<std::uint64_t>(n);
    auto left = static_cast<std::size_t>(n);
    while (left > 0 && iov_pos_ < iov_count_) {
      iovec& v = iov_[iov_pos_];
      const std::size_t take = std::min(left, v.iov_len);
      v.iov_base = static_cast<std::byte*>(v.iov_base) + take;
      v.iov_len -= take;
      left -= take;
      if (v.iov_len == 0) ++iov_pos_;
    }
  }
  if (rx_paused_ && resp_tail_ - resp_head_ < resp_.size()) {
    rx_paused_ = false;  // room again: read on (what arrived meanwhile waits in the socket)
    want_write_ = !want_write_;  // force the update below
  }
  update_interest();
}

void tcp_qp::update_interest() noexcept {
  if (fd_ < 0) return;
  const bool want = iov_pos_ < iov_count_;
  if (want == want_write_ && !rx_paused_) return;
  want_write_ = want;
  static_cast<tcp_cq*>(attr_.send_cq)->watch(fd_, this, want, !rx_paused_);
  if (attr_.recv_cq != attr_.send_cq) static_cast<tcp_cq*>(attr_.recv_cq)->watch(fd_, this, want, !rx_paused_);
}

void tcp_qp::queue_response(const frame_header& h) noexcept {
  const std::size_t cap = resp_.size();
  if (h.type == frame_type::ack && resp_tail_ > resp_queued_) {
    response& last = resp_[(resp_tail_ - 1) % cap];
    if (last.h.type == frame_type::ack) {  // cumulative: one ACK covers both
      last.h.psn = h.psn;
      encode(last.h, last.header);
      return;
    }
  }
  response& r = resp_[resp_tail_++ % cap];
  r = response{};
  r.h = h;
  encode(r.h, r.header);
}

// The data of a checked read request: framed by fill_read as the
// transmitter gets to it, the source looked up again each time.
void tcp_qp::queue_read_response(const frame_header& request) noexcept {
  response& r = resp_[resp_tail_++ % resp_.size()];
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

// ---------------------------------------------------------------- receive

void tcp_qp::progress() noexcept {
  if (!wants_progress()) return;
  flush();
  receive();
  // A lone ACK waits for company: it leaves with the next request posted
  // (one segment instead of two in request/reply traffic), or at the start
  // of the next progress pass, or when the completion queue is armed — and
  // at once if it already is: a consumer that armed and then drained (the
  // arm-then-drain rule) sleeps after this pass, and one-sided requests
  // produce no completion here to wake it.
  const auto* cq = static_cast<const tcp_cq*>(attr_.send_cq);
  if (!only_ack_pending() || (cq != nullptr && cq->armed())) flush();
  check_fatal();
  check_local_error();
}

bool tcp_qp::only_ack_pending() const noexcept {
  return iov_pos_ == iov_count_ && sq_tx_ == sq_tail_ && resp_tail_ - resp_queued_ == 1 &&
         resp_[(resp_tail_ - 1) % resp_.size()].h.type == frame_type::ack;
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
  if (!wants_progress() || !rnr_waiting_) return;
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

void tcp_qp::receive() noexcept {
  if (state_ == qp_state::error) {
    if (fd_ >= 0) discard_input();
    return;
  }
  // A NAK that ends a poisoned read is on its way: the queue pair goes to
  // error once it is out, so no later request may execute meanwhile.
  for (int frames = 0; frames < kMaxFramesPerProgress && fd_ >= 0 && state_ != qp_state::error && !fatal_pending_;) {
    if (phase_ == rx_phase::header) {
      if (rx_end_ - rx_begin_ < kHeaderSize) {
        if (rx_begin_ > 0) {
          std::memmove(rx_buf_.data(), rx_buf_.data() + rx_begin_, rx_end_ - rx_begin_);
          rx_end_ -= rx_begin_;
          rx_begin_ = 0;
        }
        const ssize_t n = ::recv(fd_, rx_buf_.data() + rx_end_, rx_buf_.size() - rx_end_, MSG_DONTWAIT);
        ++counters_.rx_syscalls;
        if (n > 0) {
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
      ++frames;
      seg_count_ = seg_index_ = 0;
      payload_left_ = cur_.length;
      after_ = after_payload::none;
      payload_lost_ = false;
      const bool ok = is_request(cur_.type) ? handle_request(cur_) : handle_response(cur_);
      if (!ok || fd_ < 0 || state_ == qp_state::error) return;
      if (payload_left_ == 0) {
        finish_payload();
        continue;
      }
      phase_ = rx_phase::payload;
    }
    // payload: staging buffer first, then straight from the socket when
    // large; each piece pins its destination while it moves
    while (payload_left_ > 0) {
      segment* s = seg_index_ < seg_count_ ? &seg_[seg_index_] : nullptr;
      const std::uint64_t want = s != nullptr ? std::min(s->len, payload_left_) : payload_left_;
      std::size_t got = 0;
      if (rx_begin_ < rx_end_) {
        got = static_cast<std::size_t>(std::min<std::uint64_t>(want, rx_end_ - rx_begin_));
        if (s != nullptr && s->key != 0) {
          if (std::byte* p = table_.pin(s->key, s->addr, got, s->need)) {
            std::memcpy(p, rx_buf_.data() + rx_begin_, got);
            table_.unpin(s->key);
          } else {
            lose_payload();
          }
        }
        rx_begin_ += got;
      } else {
        rx_begin_ = rx_end_ = 0;
        std::byte* direct = nullptr;
        if (s != nullptr && s->key != 0 && want >= kDirectReadMin) {
          direct = table_.pin(s->key, s->addr, want, s->need);
          if (direct == nullptr) lose_payload();
        }
        const ssize_t n = direct != nullptr ? ::recv(fd_, direct, static_cast<std::size_t>(want), MSG_DONTWAIT)
                                            : ::recv(fd_, rx_buf_.data(), rx_buf_.size(), MSG_DONTWAIT);
        if (direct != nullptr) table_.unpin(s->key);
        ++counters_.rx_syscalls;
        if (n <= 0) {
          if (n == 0) peer_gone("peer closed the connection");
          else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) peer_gone(std::strerror(errno));
          return;
        }
        counters_.bytes_received += static_cast<std::uint64_t>(n);
        if (direct == nullptr) {
          rx_end_ = static_cast<std::size_t>(n);
          continue;
        }
        got = static_cast<std::size_t>(n);
      }
      payload_left_ -= got;
      if (s != nullptr) {
        s->addr += got;
        s->len -= got;
        if (s->len == 0) ++seg_index_;
      }
    }
    phase_ = rx_phase::header;
    finish_payload();
  }
}

// A destination was deregistered while its payload arrived: the rest of
// the payload is read and dropped, and finish_payload fails the frame.
void tcp_qp::lose_payload() noexcept {
  if (!payload_lost_) log().warn("qp {}: the destination of an arriving payload was deregistered", qpn_);
  payload_lost_ = true;
  for (std::size_t i = seg_index_; i < seg_count_; ++i) seg_[i].key = 0;
}

bool tcp_qp::take_recv(std::uint32_t length, bool& rnr) noexcept {
  rnr = false;
  if (rq_head_ == rq_tail_) {
    rnr = true;
    return false;
  }
  const std::uint64_t idx = rq_head_++;
  const rq_entry& r = rq_[idx % attr_.max_recv_wr];
  const sge* sges = rq_sges_of(idx);
  std::uint64_t room = 0;
  for (std::uint32_t i = 0; i < r.num_sge; ++i) room += sges[i].length;
  if (length > room) {
    push_recv({.wr_id = r.wr_id, .status = wc_status::local_length_error, .opcode = wc_opcode::recv,
               .qp_num = qpn_});
    log().warn("qp {}: {}-byte message does not fit the {}-byte receive buffer", qpn_, length, room);
    nak(cur_.psn, nak_code::invalid_request, true);
    return false;
  }
  std::uint64_t left = length;
  for (std::uint32_t i = 0; i < r.num_sge && left > 0; ++i) {
    const std::uint64_t n = std::min<std::uint64_t>(sges[i].length, left);
    if (table_.check(sges[i].lkey, sges[i].addr, n, access::local_write) == nullptr) {
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
  const bool imm = (h.flags & kFlagImm) != 0;
  bool rnr = false;
  switch (h.type) {
    case frame_type::send:
      if (!take_recv(h.length, rnr)) {
        if (!rnr) return false;
        return rnr_nak(h.psn) && discard();
      }
      after_ = after_payload::recv_done;
      break;
    case frame_type::write: {
      if (h.length != 0 && table_.check(h.rkey, h.remote_addr, h.length, access::remote_write) == nullptr) {
        nak(h.psn, nak_code::remote_access, true);
        return false;
      }
      if (imm && !take_recv(0, rnr)) {
        if (!rnr) return false;
        return rnr_nak(h.psn) && discard();
      }
      seg_count_ = 0;
      if (h.length != 0) seg_[seg_count_++] = {h.rkey, access::remote_write, h.remote_addr, h.length};
      after_ = imm ? after_payload::write_imm_done : after_payload::ack_only;
      break;
    }
    case frame_type::read_request:
      if (h.read_length != 0 &&
          table_.check(h.rkey, h.remote_addr, h.read_length, access::remote_read) == nullptr) {
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
      std::byte* p = table_.pin(h.rkey, h.remote_addr, 8, access::remote_atomic);
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
  totals_->sent.fetch_add(1, std::memory_order_relaxed);
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
  const sq_entry& e = sq_[idx % attr_.max_send_wr];
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
  if (tx_blocked_ && sq_ack_ == sq_tx_ && state_ == qp_state::rts) {
    const wc_status s = sq_[sq_ack_ % attr_.max_send_wr].local_error;
    log().warn("qp {}: work request {} failed locally: {}", qpn_, sq_[sq_ack_ % attr_.max_send_wr].wr.wr_id,
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
  if (sq_ack_ == sq_tx_) {
    protocol_error("response with no request outstanding");
    return false;
  }
  sq_entry& head = sq_[sq_ack_ % attr_.max_send_wr];
  switch (h.type) {
    case frame_type::ack: {
      const std::uint64_t count = std::uint64_t{h.psn - head.psn} + 1;
      if (!psn_le(head.psn, h.psn) || count > sq_tx_ - sq_ack_) {
        protocol_error("ACK for a request never sent");
        return false;
      }
      for (std::uint64_t k = 0; k < count; ++k) {
        const sq_entry& e = sq_[sq_ack_ % attr_.max_send_wr];
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
      if (code == nak_code::rnr) {
        ++counters_.rnr_naks_received;
        totals_->received.fetch_add(1, std::memory_order_relaxed);
        if (attr_.rnr_retry != 7) {
          if (rnr_left_ == 0) {
            totals_->retry_exceeded.fetch_add(1, std::memory_order_relaxed);
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
      std::byte* p = table_.pin(dst.lkey, dst.addr, 8, access::local_write);
      if (p == nullptr) {
        log().warn("qp {}: the destination of atomic {} was deregistered", qpn_, h.psn);
        close_when_flushed_ = false;
        enter_error(wc_status::local_protection_error);
        return false;
      }
      std::memcpy(p, &h.compare_add, 8);
      table_.unpin(dst.lkey);
      complete_head(wc_status::success, 8);
      return true;
    }
    default:
      protocol_error("request type on the response path");
      return false;
  }
}

}  // namespace anydoor::transport::tcp
