// The verbs provider's queue pair: state changes, batched posting, and
// the translation of its work completions.
#include "verbs/verbs_provider.hpp"
#include "verbs/verbs_util.hpp"

#include <anydoor/error.hpp>

#include "contract_checks.hpp"
#include "log.hpp"

#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>

namespace anydoor::transport::verbs {
using namespace detail;

static_assert(static_cast<int>(wc_status::success) == IBV_WC_SUCCESS);
static_assert(static_cast<int>(wc_status::local_length_error) == IBV_WC_LOC_LEN_ERR);
static_assert(static_cast<int>(wc_status::local_protection_error) == IBV_WC_LOC_PROT_ERR);
static_assert(static_cast<int>(wc_status::work_request_flushed) == IBV_WC_WR_FLUSH_ERR);
static_assert(static_cast<int>(wc_status::bad_response) == IBV_WC_BAD_RESP_ERR);
static_assert(static_cast<int>(wc_status::remote_invalid_request) == IBV_WC_REM_INV_REQ_ERR);
static_assert(static_cast<int>(wc_status::remote_access_error) == IBV_WC_REM_ACCESS_ERR);
static_assert(static_cast<int>(wc_status::remote_operation_error) == IBV_WC_REM_OP_ERR);
static_assert(static_cast<int>(wc_status::retry_exceeded) == IBV_WC_RETRY_EXC_ERR);
static_assert(static_cast<int>(wc_status::rnr_retry_exceeded) == IBV_WC_RNR_RETRY_EXC_ERR);
static_assert(static_cast<int>(wc_status::general_error) == IBV_WC_GENERAL_ERR);

namespace {

unsigned qp_access_flags(access acc) noexcept {
  unsigned a = 0;
  if (has(acc, access::remote_write)) a |= IBV_ACCESS_REMOTE_WRITE;
  if (has(acc, access::remote_read)) a |= IBV_ACCESS_REMOTE_READ;
  if (has(acc, access::remote_atomic)) a |= IBV_ACCESS_REMOTE_ATOMIC;
  return a;
}

ibv_wr_opcode ibv_op(opcode op) {
  switch (op) {
    case opcode::send: return IBV_WR_SEND;
    case opcode::send_with_imm: return IBV_WR_SEND_WITH_IMM;
    case opcode::write: return IBV_WR_RDMA_WRITE;
    case opcode::write_with_imm: return IBV_WR_RDMA_WRITE_WITH_IMM;
    case opcode::read: return IBV_WR_RDMA_READ;
    case opcode::fetch_add: return IBV_WR_ATOMIC_FETCH_AND_ADD;
    case opcode::compare_swap: return IBV_WR_ATOMIC_CMP_AND_SWP;
    case opcode::bind_window: return IBV_WR_BIND_MW;
  }
  return IBV_WR_SEND;
}

// IB's encoded RNR NAK timer: the smallest code whose delay is >= us.
std::uint8_t rnr_timer_code(std::uint32_t us) {
  static constexpr std::uint32_t table_us[32] = {
      655360, 10,   20,   30,   40,    60,    80,    120,   160,   240,   320,    480,    640,    960,    1280,   1920,
      2560,   3840, 5120, 7680, 10240, 15360, 20480, 30720, 40960, 61440, 81920, 122880, 163840, 245760, 327680, 491520};
  for (std::uint8_t code = 1; code < 32; ++code) {
    if (table_us[code] >= us) return code;
  }
  return 0;  // 655.36 ms, the largest
}

qp_state from_ibv(ibv_qp_state s) {
  switch (s) {
    case IBV_QPS_RESET: return qp_state::reset;
    case IBV_QPS_INIT: return qp_state::init;
    case IBV_QPS_RTR: return qp_state::rtr;
    case IBV_QPS_RTS: return qp_state::rts;
    default: return qp_state::error;  // SQD, SQE, ERR, UNKNOWN
  }
}

}  // namespace

// ---------------------------------------------------------------- queue pair

verbs_qp::verbs_qp(std::shared_ptr<device_state> dev, ibv_pd* pd, const qp_attributes& attr)
    : dev_(std::move(dev)), attr_(attr), scq_(dynamic_cast<verbs_cq*>(attr.send_cq)),
      rcq_(dynamic_cast<verbs_cq*>(attr.recv_cq)) {
  attr_.remote_access = attr_.remote_access & (access::remote_write | access::remote_read | access::remote_atomic);
  const char* why = nullptr;
  if (scq_ == nullptr || rcq_ == nullptr) why = "send_cq and recv_cq of the verbs provider are required";
  else if (attr_.max_send_wr == 0 || attr_.max_send_wr > dev_->caps.max_qp_wr) why = "max_send_wr out of range";
  else if (attr_.srq == nullptr && (attr_.max_recv_wr == 0 || attr_.max_recv_wr > dev_->caps.max_qp_wr)) why = "max_recv_wr out of range";
  else if (attr_.max_send_sge == 0 || attr_.max_send_sge > dev_->caps.max_sge) why = "max_send_sge out of range";
  else if (attr_.srq == nullptr && (attr_.max_recv_sge == 0 || attr_.max_recv_sge > dev_->caps.max_sge)) why = "max_recv_sge out of range";
  else if (attr_.max_inline_data > dev_->caps.max_inline) why = "max_inline_data above the device's max_inline";
  else if (attr_.rnr_retry > 7) why = "rnr_retry must be in 0..7";
  if (why != nullptr) throw std::system_error(errc::invalid_argument, std::string("create_qp: ") + why);
  if (attr_.srq != nullptr) {
    srq_ = dynamic_cast<verbs_srq*>(attr_.srq);
    if (srq_ == nullptr || srq_->raw()->pd != pd) {
      throw std::system_error(errc::invalid_argument, "create_qp: a shared receive queue of another protection domain");
    }
  }
  ibv_qp_init_attr ia{};
  ia.qp_context = this;
  ia.send_cq = scq_->raw();
  ia.recv_cq = rcq_->raw();
  ia.qp_type = IBV_QPT_RC;
  ia.sq_sig_all = 0;
  ia.srq = srq_ != nullptr ? srq_->raw() : nullptr;
  // With a shared receive queue, the queue pair has no receive queue of its own.
  const std::uint32_t own_rwr = srq_ != nullptr ? 0 : attr_.max_recv_wr;
  const std::uint32_t own_rsge = srq_ != nullptr ? 0 : attr_.max_recv_sge;
  ia.cap = {.max_send_wr = attr_.max_send_wr, .max_recv_wr = own_rwr, .max_send_sge = attr_.max_send_sge,
            .max_recv_sge = own_rsge, .max_inline_data = attr_.max_inline_data};
  qp_ = ibv_create_qp(pd, &ia);
  if (qp_ == nullptr) throw sys_error(errno, "ibv_create_qp");
  sq_.resize(attr_.max_send_wr);
  rq_.resize(own_rwr);
  swr_.resize(attr_.max_send_wr);
  bind_keys_.resize(attr_.max_send_wr);
  ssge_.resize(std::size_t{attr_.max_send_wr} * attr_.max_send_sge);
  rwr_.resize(own_rwr);
  rsge_.resize(std::size_t{own_rwr} * own_rsge);
  sindex_ = scq_->attach(this, attr_.max_send_wr);
  sgen_ = scq_->qps_[sindex_].generation;
  rindex_ = rcq_->attach(this, own_rwr);  // a shared queue's receives are the consumer's to count
  rgen_ = rcq_->qps_[rindex_].generation;
}

verbs_qp::~verbs_qp() {
  disconnect();
  // A queue pair of a shared receive queue that reached RTR may be filling
  // one of its receives: the device keeps it (moved to error) until that
  // receive has come back flushed (device_state::retire).
  const qp_state now = srq_ != nullptr ? state() : qp_state::reset;
  if (now != qp_state::reset && now != qp_state::init) {
    dev_->retire(qp_, rcq_, last_wqe_);
  } else if (ibv_destroy_qp(qp_) != 0) {
    log().error("ibv_destroy_qp: {}", std::strerror(errno));
    std::lock_guard lock(dev_->async_mutex());
    qp_->qp_context = nullptr;  // it lives on: no event may find this verbs_qp once it is gone
  }
  scq_->detach(sindex_, attr_.max_send_wr);
  rcq_->detach(rindex_, srq_ != nullptr ? 0 : attr_.max_recv_wr);
}

void verbs_qp::disconnect() noexcept {
  if (cm_id_ != nullptr) {
    rdma_disconnect(cm_id_);
    rdma_destroy_id(cm_id_);
    cm_id_ = nullptr;
  }
  if (rdma_event_channel* ch = cm_channel_.exchange(nullptr)) {
    scq_->unwatch(ch->fd);
    if (rcq_ != scq_) rcq_->unwatch(ch->fd);
    rdma_destroy_event_channel(ch);
  }
}

qp_state verbs_qp::state() const noexcept {
  ibv_qp_attr a{};
  ibv_qp_init_attr ia{};
  if (ibv_query_qp(qp_, &a, IBV_QP_STATE, &ia) != 0) return qp_state::error;
  return from_ibv(a.qp_state);
}

bool verbs_qp::can_connect() const noexcept {
  const qp_state s = state();
  return cm_id_ == nullptr && (s == qp_state::reset || s == qp_state::init);
}

// In reset the rights wait for the move to init; in init and rts they
// change in place (rtr has no such transition in verbs: invalid_state).
std::error_code verbs_qp::set_remote_access(access acc) noexcept {
  const qp_state now = state();
  if (now == qp_state::error || now == qp_state::rtr) return errc::invalid_state;
  const access rights = acc & (access::remote_write | access::remote_read | access::remote_atomic);
  if (now != qp_state::reset) {
    ibv_qp_attr a{};
    a.qp_access_flags = qp_access_flags(rights);
    if (ibv_modify_qp(qp_, &a, IBV_QP_ACCESS_FLAGS) != 0) return {errno, std::system_category()};
  }
  attr_.remote_access = rights;
  log().debug("qp {}: remote access {:#x}", qp_num(), static_cast<std::uint32_t>(rights));
  return {};
}

std::error_code verbs_qp::modify(qp_state next) noexcept {
  const qp_state prev = state();
  ibv_qp_attr a{};
  int mask = IBV_QP_STATE;
  switch (next) {
    case qp_state::error:
      a.qp_state = IBV_QPS_ERR;
      break;
    case qp_state::reset:
      disconnect();
      a.qp_state = IBV_QPS_RESET;
      break;
    case qp_state::init:
      if (prev != qp_state::reset) return errc::invalid_state;
      a.qp_state = IBV_QPS_INIT;
      a.port_num = dev_->port;
      a.pkey_index = 0;
      a.qp_access_flags = qp_access_flags(attr_.remote_access);
      mask |= IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
      break;
    case qp_state::rtr:
    case qp_state::rts:
      // Path and peer attributes come from the connection manager.
      if (next == qp_state::rtr && prev == qp_state::init) return errc::not_connected;
      return errc::invalid_state;
  }
  if (ibv_modify_qp(qp_, &a, mask) != 0) return {errno, std::system_category()};
  posted_state_ = next;
  if (next == qp_state::reset) {
    sq_retired_ = sq_posted_;
    rq_done_ = rq_device_ = rq_posted_;  // (those waiting for a flush are discarded too)
  }
  log().debug("qp {}: {} -> {}", qp_num(), to_string(prev), to_string(next));
  return {};
}

std::error_code verbs_qp::cm_transition(rdma_cm_id* id, ibv_qp_state target) noexcept {
  ibv_qp_attr a{};
  int mask = 0;
  a.qp_state = target;
  if (rdma_init_qp_attr(id, &a, &mask) != 0) {
    const std::error_code ec(errno, std::system_category());
    log().warn("qp {}: rdma_init_qp_attr for {} failed: {} (the connection's rdma_cm state allows no such move)",
               qp_num(), to_string(from_ibv(target)), ec.message());
    return ec;
  }
  if (target == IBV_QPS_INIT) {
    a.qp_access_flags = qp_access_flags(attr_.remote_access);
    mask |= IBV_QP_ACCESS_FLAGS;
  }
  // Read depths: rdma_cm suggests the peer's values until its REP or
  // ours goes out (the passive side moves to RTS before its REP): never
  // more than this device takes, nor more than the 16 conn_param offers.
  ibv_device_attr dev{};
  const bool have_dev = ibv_query_device(qp_->context, &dev) == 0;
  if (target == IBV_QPS_RTR) {
    a.min_rnr_timer = rnr_timer_code(attr_.min_rnr_timer_us);
    mask |= IBV_QP_MIN_RNR_TIMER;
    if ((mask & IBV_QP_MAX_DEST_RD_ATOMIC) != 0 && have_dev) {
      a.max_dest_rd_atomic = static_cast<std::uint8_t>(std::min<int>({a.max_dest_rd_atomic, dev.max_qp_rd_atom, 16}));
    }
  }
  if (target == IBV_QPS_RTS && (mask & IBV_QP_MAX_QP_RD_ATOMIC) != 0 && have_dev) {
    a.max_rd_atomic = static_cast<std::uint8_t>(std::min<int>({a.max_rd_atomic, dev.max_qp_init_rd_atom, 16}));
  }
  if (target == IBV_QPS_RTS) {
    log().debug("qp {}: rdma_cm suggests ack timeout {}, retry count {}", qp_num(), a.timeout, a.retry_cnt);
    a.rnr_retry = attr_.rnr_retry;
    // A dead peer must surface as retry_exceeded, never as a hang: an ack
    // timeout of 0 means "wait forever" to some drivers (rxe among them).
    // (rxe also reads a retry count of 7 as for ever: see kRetryCount.)
    a.timeout = kAckTimeout;
    a.retry_cnt = kRetryCount;
    mask |= IBV_QP_RNR_RETRY | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT;
  }
  if (ibv_modify_qp(qp_, &a, mask) != 0) {
    const std::error_code ec(errno, std::system_category());
    ibv_qp_attr now{};
    ibv_qp_init_attr init{};
    const bool known = ibv_query_qp(qp_, &now, IBV_QP_STATE, &init) == 0;
    log().warn("qp {}: modify to {} (mask {:#x}) failed: {}; the queue pair is in {}", qp_num(),
               to_string(from_ibv(target)), mask, ec.message(),
               known ? to_string(from_ibv(now.qp_state)) : std::string_view("an unknown state"));
    return ec;
  }
  posted_state_ = from_ibv(target);
  log().debug("qp {}: -> {}", qp_num(), to_string(posted_state_));
  return {};
}

path_info verbs_qp::path() const noexcept {
  path_info p;
  // Before rdma_cm connected it, the address vector is whatever the
  // device left there (not zeros on rxe).
  if (cm_channel_.load(std::memory_order_acquire) == nullptr) return p;
  ibv_qp_attr a{};
  ibv_qp_init_attr init{};
  if (ibv_query_qp(qp_, &a, IBV_QP_AV, &init) != 0 || a.ah_attr.is_global == 0) return p;
  p.sgid_index = a.ah_attr.grh.sgid_index;
  std::memcpy(p.dgid.data(), a.ah_attr.grh.dgid.raw, 16);
  ibv_gid g{};
  if (ibv_query_gid(dev_->ctx, dev_->port, p.sgid_index, &g) == 0) std::memcpy(p.sgid.data(), g.raw, 16);
  return p;
}

void verbs_qp::adopt(rdma_cm_id* id, rdma_event_channel* channel) noexcept {
  cm_id_ = id;
  posted_state_ = qp_state::rts;
  cm_channel_.store(channel, std::memory_order_release);
  // A disconnect wakes a reactor asleep on either completion queue.
  scq_->watch(channel->fd);
  if (rcq_ != scq_) rcq_->watch(channel->fd);
}

void verbs_qp::on_async_error() noexcept {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  if (ibv_modify_qp(qp_, &a, IBV_QP_STATE) == 0) posted_state_ = qp_state::error;
}

void verbs_qp::poll_cm_events() noexcept {
  rdma_event_channel* ch = cm_channel_.load(std::memory_order_acquire);
  if (ch == nullptr) return;
  rdma_cm_event* ev = nullptr;
  while (rdma_get_cm_event(ch, &ev) == 0) {
    const rdma_cm_event_type type = ev->event;
    rdma_ack_cm_event(ev);
    if (type == RDMA_CM_EVENT_DISCONNECTED || type == RDMA_CM_EVENT_DEVICE_REMOVAL) {
      log().warn("qp {}: {}: moving the queue pair to error", qp_num(), rdma_event_str(type));
      on_async_error();
    } else {
      log().debug("qp {}: connection event {}", qp_num(), rdma_event_str(type));
    }
  }
}

std::uint64_t verbs_qp::make_wr_id(std::uint32_t cq_index, std::uint8_t gen, std::uint32_t slot,
                                   bool recv) const noexcept {
  return (std::uint64_t{gen} << 56) | (std::uint64_t{cq_index} << 32) | (recv ? kRecvBit : 0) | slot;
}

std::error_code verbs_qp::post_send(std::span<const work_request> wrs, std::size_t* bad) noexcept {
  if (posted_state_ != qp_state::rts && posted_state_ != qp_state::error) return errc::invalid_state;
  const send_limits lim{attr_.max_send_sge, attr_.max_inline_data, dev_->caps.max_msg_size, attr_.max_send_wr,
                        sq_posted_ - sq_retired_};
  if (auto ec = check_send(wrs, lim, bad)) return ec;
  if (wrs.empty()) return {};
  // A window and a region of this queue pair's protection domain only.
  for (std::size_t i = 0; i < wrs.size(); ++i) {
    if (wrs[i].op != opcode::bind_window) continue;
    const auto* w = dynamic_cast<const verbs_window*>(wrs[i].bind.window);
    const auto* r = dynamic_cast<const verbs_mr*>(wrs[i].bind.region);
    if (w == nullptr || r == nullptr || w->raw()->pd != qp_->pd || r->raw()->pd != qp_->pd) {
      if (bad != nullptr) *bad = i;
      return errc::invalid_argument;
    }
  }
  std::size_t sge_used = 0;
  for (std::size_t i = 0; i < wrs.size(); ++i) {
    const work_request& wr = wrs[i];
    const std::uint64_t seq = sq_posted_ + i;
    const auto slot = static_cast<std::uint32_t>(seq % attr_.max_send_wr);
    sq_[slot] = {wr.wr_id, seq, wr.op, wr.signaled};
    ibv_send_wr& w = swr_[i];
    w = {};
    w.wr_id = make_wr_id(sindex_, sgen_, slot, false);
    w.next = i + 1 < wrs.size() ? &swr_[i + 1] : nullptr;
    w.sg_list = &ssge_[sge_used];
    w.num_sge = static_cast<int>(wr.sg_list.size());
    for (const sge& g : wr.sg_list) ssge_[sge_used++] = {g.addr, g.length, g.lkey};
    w.opcode = ibv_op(wr.op);
    w.send_flags = (wr.signaled ? unsigned{IBV_SEND_SIGNALED} : 0u) | (wr.inline_data ? unsigned{IBV_SEND_INLINE} : 0u);
    if (wr.op == opcode::send_with_imm || wr.op == opcode::write_with_imm) w.imm_data = htonl(wr.imm);
    if (wr.op == opcode::bind_window) {
      // Type 2: the consumer picks the new key (the same window, the next
      // key byte); the window reports it once the post is accepted.
      auto* mw = static_cast<verbs_window*>(wr.bind.window);
      bind_keys_[i] = ibv_inc_rkey(mw->rkey());
      w.bind_mw.mw = mw->raw();
      w.bind_mw.rkey = bind_keys_[i];
      w.bind_mw.bind_info.mr = static_cast<const verbs_mr*>(wr.bind.region)->raw();
      w.bind_mw.bind_info.addr = wr.bind.addr;
      w.bind_mw.bind_info.length = wr.bind.length;
      w.bind_mw.bind_info.mw_access_flags = qp_access_flags(wr.bind.rights);
    } else if (is_atomic(wr.op)) {
      w.wr.atomic = {wr.remote_addr, wr.compare_add, wr.swap, wr.rkey};
    } else {
      w.wr.rdma = {wr.remote_addr, wr.rkey};
    }
  }
  ibv_send_wr* bad_wr = nullptr;
  if (const int rc = ibv_post_send(qp_, swr_.data(), &bad_wr); rc != 0) {
    const auto i = static_cast<std::size_t>(bad_wr - swr_.data());
    // Requests before bad_wr were posted (verbs semantics); report the first refused one.
    mark_binds(wrs.first(i));
    sq_posted_ += i;
    counters_.send_wrs += i;
    ++counters_.doorbells;
    if (bad != nullptr) *bad = i;
    log().warn("qp {}: ibv_post_send refused request {}: {}", qp_num(), i, std::strerror(rc));
    return {rc, std::system_category()};
  }
  mark_binds(wrs);
  sq_posted_ += wrs.size();
  counters_.send_wrs += wrs.size();
  ++counters_.doorbells;
  return {};
}

void verbs_qp::mark_binds(std::span<const work_request> posted) noexcept {
  for (std::size_t i = 0; i < posted.size(); ++i) {
    if (posted[i].op == opcode::bind_window) static_cast<verbs_window*>(posted[i].bind.window)->posted(bind_keys_[i]);
  }
}

std::error_code verbs_qp::post_recv(std::span<const recv_request> wrs, std::size_t* bad) noexcept {
  if (srq_ != nullptr) return errc::invalid_argument;  // its receives come from the shared queue
  if (posted_state_ == qp_state::reset) return errc::invalid_state;
  if (auto ec = check_recv(wrs, attr_.max_recv_sge, attr_.max_recv_wr, rq_posted_ - rq_done_, bad)) return ec;
  if (wrs.empty()) return {};
  if (posted_state_ == qp_state::error) {
    // The contract flushes a receive posted in error. rxe (Linux 6.1) never
    // completes one the device gets after its move to error: the provider
    // completes them itself (work_request_flushed), after those the device
    // still owes, so that they keep their order.
    for (std::size_t i = 0; i < wrs.size(); ++i) rq_[(rq_posted_ + i) % attr_.max_recv_wr] = wrs[i].wr_id;
    rq_posted_ += wrs.size();
    counters_.recv_wrs += wrs.size();
    rcq_->flush_later(this);
    return {};
  }
  std::size_t sge_used = 0;
  for (std::size_t i = 0; i < wrs.size(); ++i) {
    const auto slot = static_cast<std::uint32_t>((rq_posted_ + i) % attr_.max_recv_wr);
    rq_[slot] = wrs[i].wr_id;
    ibv_recv_wr& w = rwr_[i];
    w = {};
    w.wr_id = make_wr_id(rindex_, rgen_, slot, true);
    w.next = i + 1 < wrs.size() ? &rwr_[i + 1] : nullptr;
    w.sg_list = &rsge_[sge_used];
    w.num_sge = static_cast<int>(wrs[i].sg_list.size());
    for (const sge& g : wrs[i].sg_list) rsge_[sge_used++] = {g.addr, g.length, g.lkey};
  }
  ibv_recv_wr* bad_wr = nullptr;
  if (const int rc = ibv_post_recv(qp_, rwr_.data(), &bad_wr); rc != 0) {
    const auto i = static_cast<std::size_t>(bad_wr - rwr_.data());
    rq_posted_ += i;
    rq_device_ = rq_posted_;
    counters_.recv_wrs += i;
    if (bad != nullptr) *bad = i;
    return {rc, std::system_category()};
  }
  rq_posted_ += wrs.size();
  rq_device_ = rq_posted_;
  counters_.recv_wrs += wrs.size();
  return {};
}

std::size_t verbs_qp::complete_flushed(std::span<completion> out) noexcept {
  if (rq_done_ < rq_device_) return 0;  // the device's flushes of earlier receives come first
  std::size_t n = 0;
  for (; n < out.size() && rq_done_ < rq_posted_; ++n) {
    out[n] = {};
    out[n].wr_id = rq_[rq_done_ % attr_.max_recv_wr];
    out[n].status = wc_status::work_request_flushed;
    out[n].opcode = wc_opcode::recv;
    out[n].qp_num = qp_num();
    ++rq_done_;
  }
  return n;
}

void verbs_qp::complete(const ibv_wc& wc, std::uint32_t slot, bool recv, completion& out) noexcept {
  out.status = static_cast<wc_status>(wc.status);
  out.qp_num = wc.qp_num;
  out.byte_len = wc.byte_len;
  out.has_imm = (wc.wc_flags & IBV_WC_WITH_IMM) != 0;
  out.imm = out.has_imm ? ntohl(wc.imm_data) : 0;
  if (recv) {
    out.wr_id = rq_[slot % attr_.max_recv_wr];
    out.opcode = wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM ? wc_opcode::recv_rdma_with_imm
                                                                                       : wc_opcode::recv;
    ++rq_done_;
    return;
  }
  const send_slot& s = sq_[slot % attr_.max_send_wr];
  out.wr_id = s.wr_id;
  out.opcode = completion_opcode(s.op);  // wc.opcode is undefined on errors
  sq_retired_ = std::max(sq_retired_, s.seq + 1);  // retires the unsignaled requests before it
}

}  // namespace anydoor::transport::verbs
