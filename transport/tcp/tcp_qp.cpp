// The tcp provider's queue pair: requester and responder of one RC
// connection over a TCP socket.
//
// Requester: post_send encodes each work request's header into its send
// queue slot; flush() gathers whole frames (header + payload straight from
// registered memory) into sendmsg calls of at most 2 MiB each (one call for
// all but large batches). A request completes when the peer's
// response arrives (ACK, NAK, read or atomic response), in order.
// Responder: receive() parses frames, checks every remote access against the
// protection domain's registrations, places payloads (straight from the socket
// into the destination when large, with the next frame's header in the same
// read), executes atomics, and queues responses.
// RNR: a send (or write with immediate) that finds no receive is NAKed; the
// responder drops later requests until the NAKed one comes again; the
// requester waits min_rnr_timer_us, then sends again from the NAKed request
// (go-back-N), at most rnr_retry times (7: forever).
// This file: construction, the state machine and posting; the transmitter
// is in tcp_qp_tx.cpp, the receiver in tcp_qp_rx.cpp.
#include "tcp/tcp_provider.hpp"
#include "tcp/tcp_qp_parts.hpp"

#include <anydoor/error.hpp>

#include "contract_checks.hpp"
#include "log.hpp"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <system_error>
#include <utility>

namespace anydoor::transport::tcp {
using namespace detail;
namespace {

std::atomic<std::uint32_t> g_next_qpn{1};
std::atomic<std::uint64_t> g_next_serial{1};

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

void check_attr(const qp_attributes& a) {
  const char* why = nullptr;
  if (a.send_cq == nullptr || a.recv_cq == nullptr) why = "send_cq and recv_cq are required";
  else if (a.max_send_wr == 0 || a.max_send_wr > (1u << 15)) why = "max_send_wr must be in 1..32768";
  else if (a.srq == nullptr && (a.max_recv_wr == 0 || a.max_recv_wr > (1u << 15))) why = "max_recv_wr must be in 1..32768";
  else if (a.max_send_sge == 0 || a.max_send_sge > 16) why = "max_send_sge must be in 1..16";
  else if (a.srq == nullptr && (a.max_recv_sge == 0 || a.max_recv_sge > 16)) why = "max_recv_sge must be in 1..16";
  else if (a.max_inline_data > 1024) why = "max_inline_data must be at most 1024";
  else if (a.rnr_retry > 7) why = "rnr_retry must be in 0..7";
  if (why != nullptr) throw std::system_error(errc::invalid_argument, std::string("create_qp: ") + why);
  const auto* scq = dynamic_cast<tcp_cq*>(a.send_cq);
  const auto* rcq = dynamic_cast<tcp_cq*>(a.recv_cq);
  if (scq == nullptr || rcq == nullptr) {
    throw std::system_error(errc::invalid_argument, "create_qp: completion queues of another provider");
  }
  if ((scq->threaded() || rcq->threaded()) && scq != rcq) {
    throw std::system_error(errc::invalid_argument,
                            "create_qp: a completion queue with a progress thread must be both the send and the "
                            "receive completion queue of its queue pairs");
  }
}

// The receive work requests the queue pair adds to its receive completion
// queue's count: its own queue's (a shared queue's receives are the
// consumer's to count once, not once per queue pair).
std::uint32_t recv_wrs(const qp_attributes& a) noexcept { return a.srq != nullptr ? 0 : a.max_recv_wr; }

}  // namespace

tcp_qp::tcp_qp(const registration_table& table, const qp_attributes& attr, std::shared_ptr<device_state> shared)
    : table_(table), attr_(attr), qpn_(g_next_qpn.fetch_add(1, std::memory_order_relaxed)),
      serial_(g_next_serial.fetch_add(1, std::memory_order_relaxed)), shared_(std::move(shared)) {
  check_attr(attr_);
  if (attr_.srq != nullptr) {
    auto* srq = dynamic_cast<tcp_srq*>(attr_.srq);
    if (srq == nullptr || srq->shared()->table != &table_) {
      throw std::system_error(errc::invalid_argument, "create_qp: a shared receive queue of another protection domain");
    }
    srq_ = srq->shared();
  }
  attr_.remote_access = attr_.remote_access & (access::remote_write | access::remote_read | access::remote_atomic);
  sq_.resize(attr_.max_send_wr);
  sq_stride_ = std::max<std::size_t>(attr_.max_send_sge, (attr_.max_inline_data + sizeof(sge) - 1) / sizeof(sge));
  sq_sges_.resize(std::size_t{attr_.max_send_wr} * sq_stride_);
  if (srq_ == nullptr) {
    rq_.resize(attr_.max_recv_wr);
    rq_sges_.resize(std::size_t{attr_.max_recv_wr} * attr_.max_recv_sge);
  }
  rx_buf_.pool = static_cast<tcp_cq*>(attr_.send_cq)->staging_pool();
  batches_ = static_cast<tcp_cq*>(attr_.send_cq)->batch_pool();
  rnr_left_ = attr_.rnr_retry;
  auto* scq = static_cast<tcp_cq*>(attr_.send_cq);
  auto* rcq = static_cast<tcp_cq*>(attr_.recv_cq);
  const auto lock = guard();  // (a threaded queue's thread walks its queue pairs)
  if (scq == rcq) {
    scq->attach(this, attr_.max_send_wr + recv_wrs(attr_));
  } else {
    scq->attach(this, attr_.max_send_wr);
    rcq->attach(this, recv_wrs(attr_));
  }
  if (srq_ != nullptr) srq_->users.fetch_add(1, std::memory_order_relaxed);
}

tcp_qp::~tcp_qp() {
  const auto lock = guard();
  // A shared receive this queue pair was filling goes back flushed, as a
  // NIC returns it when a queue pair is destroyed (verbs: retired_qp);
  // the queue would lose it otherwise. (Its own receives end with it.)
  if (srq_ != nullptr && state_ != qp_state::error) flush_filling_receive();
  close_socket();  // gives back what it borrowed (close_socket)
  rx_begin_ = rx_end_ = 0;
  return_staging();
  if (tx_ != nullptr) batches_->give(std::exchange(tx_, nullptr));
  if (srq_ != nullptr) srq_->users.fetch_sub(1, std::memory_order_relaxed);
  if (attr_.send_cq != nullptr && attr_.send_cq == attr_.recv_cq) {
    static_cast<tcp_cq*>(attr_.send_cq)->detach(this, attr_.max_send_wr + recv_wrs(attr_));
    return;
  }
  if (attr_.send_cq != nullptr) static_cast<tcp_cq*>(attr_.send_cq)->detach(this, attr_.max_send_wr);
  if (attr_.recv_cq != nullptr) static_cast<tcp_cq*>(attr_.recv_cq)->detach(this, recv_wrs(attr_));
}

void tcp_qp::forget_cq(const tcp_cq* cq) noexcept {
  close_socket();
  if (attr_.send_cq == cq) attr_.send_cq = nullptr;
  if (attr_.recv_cq == cq) attr_.recv_cq = nullptr;
}

// ---------------------------------------------------------------- state machine

std::error_code tcp_qp::modify(qp_state next) noexcept {
  const auto lock = guard();
  const qp_state prev = state_;
  switch (next) {
    case qp_state::error:
      close_when_flushed_ = false;
      enter_error(wc_status::work_request_flushed);
      return {};
    case qp_state::reset:
      close_socket();
      // Like verbs: outstanding work is discarded without completions.
      sq_head_ = sq_ack_ = sq_tx_ = sq_sent_ = sq_tail_ = 0;
      rq_head_ = rq_tail_ = 0;
      next_psn_ = expected_psn_ = 1;
      rnr_left_ = attr_.rnr_retry;
      rnr_waiting_ = rewind_pending_ = rnr_discard_ = tx_blocked_ = false;
      rd_done_ = rd_off_ = 0;
      rd_sge_ = 0;
      rd_atomic_out_ = 0;
      after_ = after_payload::none;  // a receive being filled is discarded too
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
  const auto lock = guard();
  if (!connectable()) {
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
  reset_stream();
  want_write_ = false;
  want_read_ = true;
  const std::uint32_t ordinal = shared_->connected.fetch_add(1, std::memory_order_relaxed) + 1;
  faults_ = shared_->faults.applies_to(ordinal) ? &shared_->faults : nullptr;
  frames_sent_ = frames_received_ = post_calls_ = 0;
  cut_pending_ = rx_stalled_ = rx_stall_done_ = false;
  tx_hold_until_ = rx_stall_until_ = {};
  if (faults_ != nullptr) {
    log().warn("qp {}: fault injection for this queue pair (connection {} of the device): {}", qpn_, ordinal,
               to_string(*faults_));
  }
  log().debug("qp {}: {} -> rts (connected)", qpn_, to_string(state_));
  state_ = qp_state::rts;
  static_cast<tcp_cq*>(attr_.send_cq)->watch(fd_, this, false);
  if (attr_.recv_cq != attr_.send_cq) static_cast<tcp_cq*>(attr_.recv_cq)->watch(fd_, this, false);
  live_.store(true, std::memory_order_release);  // the completion queues may drive it from now on
  // The socket is watched before it is live: a reactor woken by data that
  // arrived in between polled, skipped this not-yet-live queue pair and went
  // back to sleep, and that data brings no new wake-up. Wake it again.
  // (A progress thread's epoll reports the data itself: no owner to wake.)
  if (!static_cast<tcp_cq*>(attr_.send_cq)->threaded()) static_cast<tcp_cq*>(attr_.send_cq)->signal();
  if (attr_.recv_cq != attr_.send_cq) static_cast<tcp_cq*>(attr_.recv_cq)->signal();  // (never threaded: check_attr)
  return {};
}

void tcp_qp::close_socket() noexcept {
  if (fd_ < 0) return;
  live_.store(false, std::memory_order_relaxed);
  if (attr_.send_cq != nullptr) static_cast<tcp_cq*>(attr_.send_cq)->unwatch(fd_);
  if (attr_.recv_cq != nullptr && attr_.recv_cq != attr_.send_cq) static_cast<tcp_cq*>(attr_.recv_cq)->unwatch(fd_);
  ::close(fd_);
  fd_ = -1;
  reset_stream();
  // Nothing more moves on this socket: what the queue pair borrowed goes
  // back now, not at its destruction (a failed connection the application
  // keeps holds neither). Only the driving thread gets here with something
  // borrowed: a queue pair borrows only once live. Every caller inside a
  // pass stops using them once fd_ is closed.
  return_staging();
  if (tx_ != nullptr) batches_->give(std::exchange(tx_, nullptr));
  // The bounce buffers of copied memory (page-locked for CUDA) go too: a
  // closed queue pair holds no pinned memory.
  tx_bounce_.reset();
  tx_next_.reset();
  rx_bounce_.reset();
  rx_spare_.reset();
}

// What belongs to one socket's byte stream: the transmit batch, the
// response ring's positions, the receive staging buffer and frame parser.
void tcp_qp::reset_stream() noexcept {
  settle_tx_copy();  // (copies in flight end before their buffers go)
  (void)settle_rx_copy();
  restart_batch();
  resp_head_ = resp_queued_ = resp_tail_ = 0;
  rx_begin_ = rx_end_ = 0;
  rx_bounce_fill_ = 0;
  rx_header_only_ = false;
  phase_ = rx_phase::header;
  close_when_flushed_ = false;
  rx_paused_ = false;
  rx_more_ = false;
}

void tcp_qp::push_send(const completion& c) noexcept {
  if (attr_.send_cq != nullptr) static_cast<tcp_cq*>(attr_.send_cq)->push(c);
}

void tcp_qp::push_recv(const completion& c) noexcept {
  if (attr_.recv_cq != nullptr) static_cast<tcp_cq*>(attr_.recv_cq)->push(c);
}

void tcp_qp::flush_filling_receive() noexcept {
  if (after_ != after_payload::recv_done && after_ != after_payload::write_imm_done) return;
  push_recv({.wr_id = recv_wr_id_, .status = wc_status::work_request_flushed,
             .opcode = after_ == after_payload::recv_done ? wc_opcode::recv : wc_opcode::recv_rdma_with_imm,
             .qp_num = qpn_});
  after_ = after_payload::none;
}

void tcp_qp::enter_error(wc_status head_status) noexcept {
  if (state_ == qp_state::error) return;
  log().debug("qp {}: {} -> error ({})", qpn_, to_string(state_), to_string(head_status));
  state_ = qp_state::error;
  // Every outstanding request completes exactly once, signaled or not.
  for (std::uint64_t i = sq_ack_; i < sq_tail_; ++i) {
    const sq_entry& e = sq_[ring_slot(i, attr_.max_send_wr)];
    const wc_status s = i == sq_ack_ ? head_status : wc_status::work_request_flushed;
    push_send({.wr_id = e.wr.wr_id, .status = s, .opcode = completion_opcode(e.wr.op), .qp_num = qpn_});
  }
  sq_head_ = sq_ack_ = sq_tx_ = sq_sent_ = sq_tail_;
  // The receive a message was filling when the connection failed: taken
  // from the queue (its own or the shared one), so it flushes first.
  flush_filling_receive();
  for (std::uint64_t i = rq_head_; i < rq_tail_; ++i) {
    push_recv({.wr_id = rq_[ring_slot(i, attr_.max_recv_wr)].wr_id, .status = wc_status::work_request_flushed,
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

std::error_code tcp_qp::set_remote_access(access acc) noexcept {
  const auto lock = guard();
  if (state_ == qp_state::error || state_ == qp_state::rtr) return errc::invalid_state;  // as verbs
  attr_.remote_access = acc & (access::remote_write | access::remote_read | access::remote_atomic);
  log().debug("qp {}: remote access {:#x}", qpn_, static_cast<std::uint32_t>(attr_.remote_access));
  return {};
}

// ---------------------------------------------------------------- posting

std::error_code tcp_qp::post_recv(std::span<const recv_request> wrs, std::size_t* bad) noexcept {
  const auto lock = guard();
  if (srq_ != nullptr) return errc::invalid_argument;  // its receives come from the shared queue
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
    rq_[ring_slot(idx, attr_.max_recv_wr)] = {wr.wr_id, static_cast<std::uint32_t>(wr.sg_list.size())};
    std::copy(wr.sg_list.begin(), wr.sg_list.end(), rq_sges_of(idx));
  }
  return {};
}

std::error_code tcp_qp::post_send(std::span<const work_request> wrs, std::size_t* bad) noexcept {
  const auto lock = guard();
  return post_send_locked(wrs, bad);
}

std::error_code tcp_qp::post_send_locked(std::span<const work_request> wrs, std::size_t* bad) noexcept {
  if (state_ != qp_state::rts && state_ != qp_state::error) return errc::invalid_state;
  const send_limits lim{attr_.max_send_sge, attr_.max_inline_data, kMaxPayload, attr_.max_send_wr,
                        sq_tail_ - sq_head_};
  if (auto ec = check_send(wrs, lim, bad)) return ec;
  // A window and a region of this protection domain only.
  for (std::size_t i = 0; i < wrs.size(); ++i) {
    if (wrs[i].op != opcode::bind_window) continue;
    const auto* w = dynamic_cast<const tcp_window*>(wrs[i].bind.window);
    const registration_table* rt = nullptr;
    if (const auto* r = dynamic_cast<const tcp_mr*>(wrs[i].bind.region)) rt = r->table();
    if (const auto* r = dynamic_cast<const tcp_dmabuf_mr*>(wrs[i].bind.region)) rt = r->table();
    if (const auto* r = dynamic_cast<const tcp_copied_mr*>(wrs[i].bind.region)) rt = r->table();
    if (w == nullptr || rt == nullptr || w->table() != &table_ || rt != &table_) {
      if (bad != nullptr) *bad = i;
      return errc::invalid_argument;
    }
  }
  if (faults_ != nullptr && faults_->post_fail && wrs.size() >= 2 && ++post_calls_ == *faults_->post_fail) {
    // Fault injection: a device error past the checks, the requests before
    // the last posted (what ibv_post_send can leave behind).
    const std::size_t posted = wrs.size() - 1;  // (>= 1)
    log().warn("qp {}: fault injection: post_send #{} fails after posting {} of its {} requests", qpn_,
               post_calls_, posted, wrs.size());
    (void)post_send_locked(wrs.first(posted), nullptr);
    if (bad != nullptr) *bad = posted;
    return {ENOMEM, std::system_category()};
  }
  counters_.send_wrs += wrs.size();
  if (state_ == qp_state::error) {
    if (faults_ != nullptr && faults_->lose_late) {
      log().warn("qp {}: fault injection: {} requests posted in error never complete", qpn_, wrs.size());
      return {};
    }
    for (const work_request& wr : wrs) {
      push_send({.wr_id = wr.wr_id, .status = wc_status::work_request_flushed,
                 .opcode = completion_opcode(wr.op), .qp_num = qpn_});
    }
    return {};
  }
  ++counters_.doorbells;
  for (const work_request& wr : wrs) {
    const std::uint64_t idx = sq_tail_++;
    sq_entry& e = sq_[ring_slot(idx, attr_.max_send_wr)];
    sge* sges = sges_of(idx);
    e.wr = wr;
    e.local_error = wc_status::success;
    e.length = 0;
    if (wr.op == opcode::bind_window) {
      // In effect from now on (the peer learns the key from a later
      // request); completes in order, at its turn (fill_iov). It fails only
      // if the region was deregistered meanwhile: as on a NIC, the queue
      // pair then goes to error when the request's turn comes.
      e.wr.sg_list = {};
      if (!static_cast<tcp_window*>(wr.bind.window)->bind(wr.bind, serial_)) {
        e.local_error = wc_status::memory_window_bind_error;
      }
      e.psn = 0;  // nothing goes on the wire
      continue;
    }
    if (wr.inline_data) {
      auto* buf = reinterpret_cast<std::byte*>(sges);  // room for max_inline_data (sq_stride_)
      std::size_t off = 0;
      for (const sge& s : wr.sg_list) {
        std::memcpy(buf + off, reinterpret_cast<const void*>(s.addr), s.length);
        off += s.length;
      }
      e.wr.sg_list = {};  // the bytes are the slot's (fill_iov)
      e.length = static_cast<std::uint32_t>(off);
    } else {
      const access need = carries_data(wr.op) ? access::none : access::local_write;
      std::copy(wr.sg_list.begin(), wr.sg_list.end(), sges);
      e.wr.sg_list = {sges, wr.sg_list.size()};
      for (const sge& s : wr.sg_list) {
        e.length += s.length;
        if (s.length != 0 && table_.check(s.lkey, s.addr, s.length, need, 0) == nullptr) {
          e.local_error = wc_status::local_protection_error;
        }
      }
    }
    e.psn = next_psn_++;
  }
  if (!send_solo()) flush();
  check_fatal();
  check_local_error();
  return {};
}

// At the frame's turn in a batch (fill_iov): again for a request sent
// again after an RNR NAK, with the same bytes.
void tcp_qp::encode_request_header(const sq_entry& e, std::span<std::byte, kHeaderSize> out,
                                   std::optional<std::uint32_t> ack) const noexcept {
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
    case opcode::bind_window: break;  // local: never framed
  }
  if (e.wr.op == opcode::send_with_imm || e.wr.op == opcode::write_with_imm) {
    h.flags = kFlagImm;
    h.imm = e.wr.imm;
  }
  if (ack) {  // (never a read request's: fill_requests)
    h.flags |= kFlagAck;
    h.ack_psn = *ack;
  }
  encode(h, out);
}

}  // namespace anydoor::transport::tcp
