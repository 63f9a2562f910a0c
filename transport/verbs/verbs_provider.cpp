#include "verbs/verbs_provider.hpp"

#include <anydoor/error.hpp>

#include "contract_checks.hpp"
#include "log.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/epoll.h>
#include <unistd.h>
#include <netdb.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <system_error>

namespace anydoor::transport::verbs {

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

using clock = std::chrono::steady_clock;
constexpr std::uint32_t kSlotMask = 0x7fffffffu;
constexpr std::uint64_t kRecvBit = 1ull << 31;
constexpr std::uint32_t kMaxPollBatch = 32;
// Local ACK timeout: 4.096 us * 2^14 = 67 ms per transport retry, 7 retries:
// a dead peer is reported in about half a second.
constexpr std::uint8_t kAckTimeout = 14;
// One length byte precedes the caller's private data (rdma_cm delivers the
// transport's full private-data area, not the length that was sent).
constexpr std::size_t kConnectPrivateData = 56;
constexpr std::size_t kMaxUserPrivateData = kConnectPrivateData - 1;

std::system_error sys_error(int err, const std::string& what) {
  return std::system_error(err, std::system_category(), what);
}

int set_nonblocking(int fd) { return ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

unsigned ibv_access(access acc) {
  unsigned a = 0;
  if (has(acc, access::local_write)) a |= IBV_ACCESS_LOCAL_WRITE;
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

// Waits for the next event on a private cm channel, until the deadline
// (timed_out) or a stop request (operation_canceled, seen within 50 ms).
std::error_code next_event(rdma_event_channel* ch, clock::time_point deadline, rdma_cm_event** ev,
                           const std::stop_token& stop = {}) {
  for (;;) {
    if (rdma_get_cm_event(ch, ev) == 0) return {};
    if (errno != EAGAIN && errno != EWOULDBLOCK) return {errno, std::system_category()};
    if (stop.stop_requested()) return std::make_error_code(std::errc::operation_canceled);
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()).count();
    if (left <= 0) return errc::timed_out;
    pollfd p{ch->fd, POLLIN, 0};
    ::poll(&p, 1, static_cast<int>(std::min<long long>(left, stop.stop_possible() ? 50 : 1 << 30)));
  }
}

std::vector<std::byte> user_private_data(const rdma_conn_param& p) {
  const auto* data = static_cast<const std::byte*>(p.private_data);
  if (data == nullptr || p.private_data_len == 0) return {};
  const std::size_t n = std::min<std::size_t>(static_cast<std::size_t>(data[0]), p.private_data_len - 1u);
  return {data + 1, data + 1 + n};
}

std::array<std::byte, kConnectPrivateData> wrap_private_data(std::span<const std::byte> pdata) {
  std::array<std::byte, kConnectPrivateData> b{};
  b[0] = static_cast<std::byte>(pdata.size());
  std::copy(pdata.begin(), pdata.end(), b.begin() + 1);
  return b;
}

rdma_conn_param conn_param(const verbs_qp& qp, const std::array<std::byte, kConnectPrivateData>& pdata,
                           const ibv_device_attr& attr) {
  rdma_conn_param p{};
  p.private_data = pdata.data();
  p.private_data_len = static_cast<std::uint8_t>(pdata.size());
  p.responder_resources = static_cast<std::uint8_t>(std::min(attr.max_qp_rd_atom, 16));
  p.initiator_depth = static_cast<std::uint8_t>(std::min(attr.max_qp_init_rd_atom, 16));
  p.retry_count = 7;
  p.rnr_retry_count = qp.attributes().rnr_retry;
  p.qp_num = qp.qp_num();
  return p;
}

void set_ack_timeout(rdma_cm_id* id) {
  // 4.096 us * 2^14 = 67 ms per transport retry: a dead peer is noticed in
  // about half a second instead of rdma_cm's default of several seconds.
  std::uint8_t timeout = kAckTimeout;
  if (rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &timeout, sizeof timeout) != 0) {
    log().debug("verbs: RDMA_OPTION_ID_ACK_TIMEOUT not supported: {}", std::strerror(errno));
  }
}

}  // namespace

// ---------------------------------------------------------------- device

device_state::~device_state() {
  if (cm_list != nullptr) rdma_free_devices(cm_list);
}

void device_state::drain_async_events() noexcept {
  std::unique_lock lock(async_mutex, std::try_to_lock);
  if (!lock.owns_lock()) return;
  ibv_async_event ev;
  while (ibv_get_async_event(ctx, &ev) == 0) {
    switch (ev.event_type) {
      case IBV_EVENT_CQ_ERR:
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
      case IBV_EVENT_PORT_ERR:
      case IBV_EVENT_DEVICE_FATAL:
      case IBV_EVENT_SRQ_ERR:
        log().warn("verbs {}: asynchronous event: {}", name, ibv_event_type_str(ev.event_type));
        break;
      default:
        log().info("verbs {}: asynchronous event: {}", name, ibv_event_type_str(ev.event_type));
        break;
    }
    switch (ev.event_type) {
      case IBV_EVENT_CQ_ERR:
        if (ev.element.cq != nullptr && ev.element.cq->cq_context != nullptr) {
          static_cast<verbs_cq*>(ev.element.cq->cq_context)->on_overflow();
        }
        break;
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
        if (ev.element.qp != nullptr && ev.element.qp->qp_context != nullptr) {
          static_cast<verbs_qp*>(ev.element.qp->qp_context)->on_async_error();
        }
        break;
      default:
        break;
    }
    ibv_ack_async_event(&ev);
  }
}

verbs_device::verbs_device(const std::string& wanted) : state_(std::make_shared<device_state>()) {
  int n = 0;
  state_->cm_list = rdma_get_devices(&n);
  if (state_->cm_list == nullptr || n == 0) {
    throw std::system_error(errc::no_device, "verbs: no RDMA device (rdma_get_devices found none)");
  }
  std::string seen;
  for (int i = 0; i < n && state_->ctx == nullptr; ++i) {
    ibv_context* ctx = state_->cm_list[i];
    const std::string name = ibv_get_device_name(ctx->device);
    seen += (seen.empty() ? "" : ", ") + name;
    if (!wanted.empty() && name != wanted) continue;
    ibv_device_attr attr{};
    if (ibv_query_device(ctx, &attr) != 0) continue;
    for (std::uint8_t port = 1; port <= attr.phys_port_cnt; ++port) {
      ibv_port_attr pattr{};
      if (ibv_query_port(ctx, port, &pattr) == 0 && pattr.state == IBV_PORT_ACTIVE) {
        state_->ctx = ctx;
        state_->port = port;
        state_->iwarp = ctx->device->transport_type == IBV_TRANSPORT_IWARP;
        state_->name = name;
        auto& c = state_->caps;
        c.max_qp_wr = static_cast<std::uint32_t>(attr.max_qp_wr);
        c.max_sge = static_cast<std::uint32_t>(std::min(attr.max_sge, 16));
        c.max_mr_size = attr.max_mr_size;
        c.max_msg_size = pattr.max_msg_sz;
        c.max_cqe = static_cast<std::uint32_t>(attr.max_cqe);
        c.max_private_data = kMaxUserPrivateData;
        c.atomics = attr.atomic_cap != IBV_ATOMIC_NONE;
        c.gpu_memory = false;
        // GID: rdma_cm picks the source GID of a connection from its source
        // address (the route's, or the forced GID's), of the port's default
        // RoCE type (v2 on rxe and current mlx5 kernels). The first RoCE v2
        // GID with an IPv4 address is logged as the expected one;
        // ANYDOOR_GID_INDEX forces a GID: connections then leave from its
        // IPv4 address, and a GID without one cannot be forced (refused).
        auto ipv4_of = [](const ibv_gid& g) -> std::uint32_t {
          const bool v4 = std::all_of(g.raw, g.raw + 10, [](std::uint8_t b) { return b == 0; }) &&
                          g.raw[10] == 0xff && g.raw[11] == 0xff;
          std::uint32_t a = 0;
          if (v4) std::memcpy(&a, g.raw + 12, 4);
          return a;
        };
        if (const char* g = std::getenv("ANYDOOR_GID_INDEX"); g != nullptr && *g != '\0') {
          char* end = nullptr;
          const long gi = std::strtol(g, &end, 10);
          ibv_gid_entry e{};
          if (end == g || *end != '\0' || gi < 0 || gi >= pattr.gid_tbl_len ||
              ibv_query_gid_ex(ctx, port, static_cast<std::uint32_t>(gi), &e, 0) != 0) {
            throw std::system_error(errc::invalid_argument, "ANYDOOR_GID_INDEX=" + std::string(g) + ": no such GID on " +
                                                                name + " port " + std::to_string(port));
          }
          if (ipv4_of(e.gid) == 0) {
            throw std::system_error(errc::invalid_argument,
                                    "ANYDOOR_GID_INDEX=" + std::string(g) + ": GID " + std::to_string(gi) + " of " +
                                        name + " has no IPv4 address, and rdma_cm selects a GID only through "
                                        "the connection's source address");
          }
          state_->gid_index = static_cast<int>(gi);
          state_->gid_forced = true;
          state_->gid_ipv4 = ipv4_of(e.gid);
        } else {
          for (int gi = 0; gi < pattr.gid_tbl_len && state_->gid_index < 0; ++gi) {
            ibv_gid_entry e{};
            if (ibv_query_gid_ex(ctx, port, static_cast<std::uint32_t>(gi), &e, 0) != 0) continue;
            if (e.gid_type == IBV_GID_TYPE_ROCE_V2 && ipv4_of(e.gid) != 0) {
              state_->gid_index = gi;
              state_->gid_ipv4 = ipv4_of(e.gid);
            }
          }
        }
        break;
      }
    }
  }
  if (state_->ctx == nullptr) {
    throw std::system_error(errc::no_device, wanted.empty()
                                                 ? "verbs: no device with an active port (found: " + seen + ")"
                                                 : "verbs: no active device named '" + wanted + "' (found: " + seen + ")");
  }
  set_nonblocking(state_->ctx->async_fd);
  // Largest inline size the device takes, probed with a throw-away QP.
  ibv_pd* pd = ibv_alloc_pd(state_->ctx);
  ibv_cq* cq = pd != nullptr ? ibv_create_cq(state_->ctx, 4, nullptr, nullptr, 0) : nullptr;
  for (std::uint32_t inl = 1024; cq != nullptr && inl >= 32; inl /= 2) {
    ibv_qp_init_attr ia{};
    ia.send_cq = ia.recv_cq = cq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1, .max_inline_data = inl};
    if (ibv_qp* qp = ibv_create_qp(pd, &ia)) {
      state_->caps.max_inline = ia.cap.max_inline_data;
      ibv_destroy_qp(qp);
      break;
    }
  }
  if (cq != nullptr) ibv_destroy_cq(cq);
  if (pd != nullptr) ibv_dealloc_pd(pd);
  log().info("verbs: opened {} port {} ({} GID index {}, max_inline {}, atomics {})", state_->name, state_->port,
             state_->gid_forced ? "forced" : "first RoCE v2 IPv4", state_->gid_index, state_->caps.max_inline,
             state_->caps.atomics ? "yes" : "no");
}

// RNR counters from the port's sysfs hw_counters, under the names each
// driver gives them (rxe; mlx5: out_of_buffer counts receives that found no
// WQE, which on RC are the RNR NAKs sent; mana). A counter no known name
// has stays empty.
device_counters verbs_device::counters() const {
  struct name_set {
    const char* sent;
    const char* received;
    const char* exceeded;
  };
  static constexpr name_set kNames[] = {
      {"send_rnr_err", "rcvd_rnr_err", "retry_rnr_exceeded_err"},                         // rxe
      {"out_of_buffer", nullptr, "rnr_nak_retry_err"},                                    // mlx5
      {"responder_rnr_nak", "requester_rnr_nak", "requester_rnr_nak_retries_exceeded"},  // mana
  };
  device_counters c;
  const std::string base = "/sys/class/infiniband/" + state_->name;
  const std::string dirs[] = {base + "/ports/" + std::to_string(state_->port) + "/hw_counters", base + "/hw_counters"};
  auto read = [](const std::string& path) -> std::optional<std::uint64_t> {
    std::FILE* f = std::fopen(path.c_str(), "r");
    if (f == nullptr) return std::nullopt;
    unsigned long long v = 0;
    const bool ok = std::fscanf(f, "%llu", &v) == 1;
    std::fclose(f);
    return ok ? std::optional<std::uint64_t>(v) : std::nullopt;
  };
  for (const std::string& dir : dirs) {
    for (const name_set& n : kNames) {
      auto sent = n.sent != nullptr ? read(dir + "/" + n.sent) : std::nullopt;
      auto received = n.received != nullptr ? read(dir + "/" + n.received) : std::nullopt;
      auto exceeded = n.exceeded != nullptr ? read(dir + "/" + n.exceeded) : std::nullopt;
      if (!sent && !received && !exceeded) continue;
      c.rnr_naks_sent = sent;
      c.rnr_naks_received = received;
      c.rnr_retry_exceeded = exceeded;
      c.source = dir;
      return c;
    }
  }
  c.source = "no RNR counters under " + dirs[0] + " or " + dirs[1];
  return c;
}

std::unique_ptr<protection_domain> verbs_device::alloc_pd() { return std::make_unique<verbs_pd>(state_); }

std::unique_ptr<completion_queue> verbs_device::create_cq(std::uint32_t depth) {
  if (depth == 0 || depth > state_->caps.max_cqe) {
    throw std::system_error(errc::invalid_argument,
                            "create_cq: depth must be in 1.." + std::to_string(state_->caps.max_cqe));
  }
  return std::make_unique<verbs_cq>(state_, depth);
}

// ---------------------------------------------------------------- pd, mr

verbs_pd::verbs_pd(std::shared_ptr<device_state> dev) : dev_(std::move(dev)), pd_(ibv_alloc_pd(dev_->ctx)) {
  if (pd_ == nullptr) throw sys_error(errno, "ibv_alloc_pd");
}

verbs_pd::~verbs_pd() { ibv_dealloc_pd(pd_); }

std::unique_ptr<memory_region> verbs_pd::register_memory(void* addr, std::size_t length, access acc) {
  check_registration(addr, length, acc);
  ibv_mr* mr = ibv_reg_mr(pd_, addr, length, ibv_access(acc));  // exactly the requested access
  if (mr == nullptr) {
    throw std::system_error(errc::registration_failed,
                            std::string("ibv_reg_mr: ") + std::strerror(errno));
  }
  return std::make_unique<verbs_mr>(mr, acc);
}

verbs_mr::verbs_mr(ibv_mr* mr, transport::access acc) noexcept
    : memory_region(mr->addr, mr->length, mr->lkey, mr->rkey, acc), mr_(mr) {}

verbs_mr::~verbs_mr() {
  if (ibv_dereg_mr(mr_) != 0) log().error("ibv_dereg_mr: {}", std::strerror(errno));
}

std::unique_ptr<queue_pair> verbs_pd::create_qp(const qp_attributes& attr) {
  return std::make_unique<verbs_qp>(dev_, pd_, attr);
}

// ---------------------------------------------------------------- completion queue

verbs_cq::verbs_cq(std::shared_ptr<device_state> dev, std::uint32_t depth) : dev_(std::move(dev)) {
  channel_ = ibv_create_comp_channel(dev_->ctx);
  if (channel_ == nullptr) throw sys_error(errno, "ibv_create_comp_channel");
  set_nonblocking(channel_->fd);
  cq_ = ibv_create_cq(dev_->ctx, static_cast<int>(depth), this, channel_, 0);
  if (cq_ == nullptr) {
    const int err = errno;
    ibv_destroy_comp_channel(channel_);
    throw sys_error(err, "ibv_create_cq");
  }
  epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (epfd_ < 0) {
    const int err = errno;
    ibv_destroy_cq(cq_);
    ibv_destroy_comp_channel(channel_);
    throw sys_error(err, "epoll_create1");
  }
  watch(channel_->fd);
  watch(dev_->ctx->async_fd);
}

verbs_cq::~verbs_cq() {
  ack_events();
  ::close(epfd_);
  if (ibv_destroy_cq(cq_) != 0) log().error("ibv_destroy_cq: {} (queue pairs still on it?)", std::strerror(errno));
  ibv_destroy_comp_channel(channel_);
}

void verbs_cq::watch(int fd) noexcept {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = fd;
  if (::epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev) != 0 && errno != EEXIST) {
    log().warn("verbs: epoll_ctl(add {}): {}", fd, std::strerror(errno));
  }
}

void verbs_cq::unwatch(int fd) noexcept { ::epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr); }

std::uint32_t verbs_cq::attach(verbs_qp* qp, std::uint32_t wrs) {
  wrs_ += wrs;
  if (wrs_ > static_cast<std::uint64_t>(cq_->cqe)) {
    log().warn("completion queue depth {} is below the {} work requests of its queue pairs: it can overflow",
               cq_->cqe, wrs_);
  }
  for (std::uint32_t i = 0; i < qps_.size(); ++i) {
    if (qps_[i].qp == nullptr) {
      qps_[i].qp = qp;
      ++qps_[i].generation;
      return i;
    }
  }
  if (qps_.size() >= (1u << 24)) throw std::system_error(errc::invalid_argument, "too many queue pairs on one CQ");
  qps_.push_back({qp, 1});
  return static_cast<std::uint32_t>(qps_.size() - 1);
}

void verbs_cq::detach(std::uint32_t index, std::uint32_t wrs) noexcept {
  if (index < qps_.size()) qps_[index].qp = nullptr;
  wrs_ -= wrs;
}

void verbs_cq::on_overflow() noexcept {
  if (overflow_) return;
  overflow_ = true;
  log().error("verbs: completion queue overflow (depth {}): completions were lost; queue pairs on it move to error",
              cq_->cqe);
  for (auto& e : qps_) {
    if (e.qp != nullptr) e.qp->on_async_error();
  }
}

std::size_t verbs_cq::poll(std::span<completion> out, std::error_code& ec) noexcept {
  ++counters_.polls;
  std::size_t n = 0;
  while (!overflow_ && n < out.size()) {
    ibv_wc wcs[kMaxPollBatch];
    const int want = static_cast<int>(std::min<std::size_t>(kMaxPollBatch, out.size() - n));
    const int got = ibv_poll_cq(cq_, want, wcs);
    if (got < 0) {
      ec = {-got, std::system_category()};
      return n;
    }
    for (int i = 0; i < got; ++i) {
      const ibv_wc& wc = wcs[i];
      const auto gen = static_cast<std::uint8_t>(wc.wr_id >> 56);
      const auto index = static_cast<std::uint32_t>((wc.wr_id >> 32) & 0xffffff);
      const bool recv = (wc.wr_id & kRecvBit) != 0;
      const auto slot = static_cast<std::uint32_t>(wc.wr_id & kSlotMask);
      if (index >= qps_.size() || qps_[index].qp == nullptr || qps_[index].generation != gen) {
        log().debug("verbs: dropped a completion of a destroyed queue pair {}", wc.qp_num);
        continue;
      }
      qps_[index].qp->complete(wc, slot, recv, out[n++]);
    }
    if (got < want) break;
  }
  if (n == 0) {
    ++counters_.empty_polls;
    // Asynchronous and connection events (CQ overflow, a peer's disconnect)
    // are looked at when idle, at most once a millisecond: each look is two
    // system calls.
    if ((++empty_streak_ & 63) == 0) {
      const auto now = clock::now();
      if (now - events_checked_ >= std::chrono::milliseconds(1)) {
        events_checked_ = now;
        check_events();
      }
    }
  } else {
    empty_streak_ = 0;
  }
  counters_.completions += n;
  if (overflow_ && n == 0) {
    ec = errc::cq_overflow;
    return 0;
  }
  ec.clear();
  return n;
}

void verbs_cq::check_events() noexcept {
  dev_->drain_async_events();
  for (std::size_t i = 0; i < qps_.size(); ++i) {
    if (qps_[i].qp != nullptr) qps_[i].qp->poll_cm_events();
  }
}

std::error_code verbs_cq::arm() noexcept {
  check_events();
  if (overflow_) return errc::cq_overflow;
  if (ibv_req_notify_cq(cq_, 0) != 0) return {errno, std::system_category()};
  return {};
}

std::size_t verbs_cq::ack_events() noexcept {
  unsigned count = 0;
  ibv_cq* ev_cq = nullptr;
  void* ctx = nullptr;
  while (ibv_get_cq_event(channel_, &ev_cq, &ctx) == 0) ++count;
  if (count > 0) ibv_ack_cq_events(cq_, count);
  counters_.events += count;
  return count;
}

// ---------------------------------------------------------------- queue pair

verbs_qp::verbs_qp(std::shared_ptr<device_state> dev, ibv_pd* pd, const qp_attributes& attr)
    : dev_(std::move(dev)), attr_(attr), scq_(dynamic_cast<verbs_cq*>(attr.send_cq)),
      rcq_(dynamic_cast<verbs_cq*>(attr.recv_cq)) {
  const char* why = nullptr;
  if (scq_ == nullptr || rcq_ == nullptr) why = "send_cq and recv_cq of the verbs provider are required";
  else if (attr_.max_send_wr == 0 || attr_.max_send_wr > dev_->caps.max_qp_wr) why = "max_send_wr out of range";
  else if (attr_.max_recv_wr == 0 || attr_.max_recv_wr > dev_->caps.max_qp_wr) why = "max_recv_wr out of range";
  else if (attr_.max_send_sge == 0 || attr_.max_send_sge > dev_->caps.max_sge) why = "max_send_sge out of range";
  else if (attr_.max_recv_sge == 0 || attr_.max_recv_sge > dev_->caps.max_sge) why = "max_recv_sge out of range";
  else if (attr_.max_inline_data > dev_->caps.max_inline) why = "max_inline_data above the device's max_inline";
  else if (attr_.rnr_retry > 7) why = "rnr_retry must be in 0..7";
  if (why != nullptr) throw std::system_error(errc::invalid_argument, std::string("create_qp: ") + why);
  ibv_qp_init_attr ia{};
  ia.qp_context = this;
  ia.send_cq = scq_->raw();
  ia.recv_cq = rcq_->raw();
  ia.qp_type = IBV_QPT_RC;
  ia.sq_sig_all = 0;
  ia.cap = {.max_send_wr = attr_.max_send_wr, .max_recv_wr = attr_.max_recv_wr, .max_send_sge = attr_.max_send_sge,
            .max_recv_sge = attr_.max_recv_sge, .max_inline_data = attr_.max_inline_data};
  qp_ = ibv_create_qp(pd, &ia);
  if (qp_ == nullptr) throw sys_error(errno, "ibv_create_qp");
  sq_.resize(attr_.max_send_wr);
  rq_.resize(attr_.max_recv_wr);
  swr_.resize(attr_.max_send_wr);
  ssge_.resize(std::size_t{attr_.max_send_wr} * attr_.max_send_sge);
  rwr_.resize(attr_.max_recv_wr);
  rsge_.resize(std::size_t{attr_.max_recv_wr} * attr_.max_recv_sge);
  sindex_ = scq_->attach(this, attr_.max_send_wr);
  sgen_ = scq_->qps_[sindex_].generation;
  rindex_ = rcq_->attach(this, attr_.max_recv_wr);
  rgen_ = rcq_->qps_[rindex_].generation;
}

verbs_qp::~verbs_qp() {
  disconnect();
  if (ibv_destroy_qp(qp_) != 0) log().error("ibv_destroy_qp: {}", std::strerror(errno));
  scq_->detach(sindex_, attr_.max_send_wr);
  rcq_->detach(rindex_, attr_.max_recv_wr);
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
      a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
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
    rq_done_ = rq_posted_;
  }
  log().debug("qp {}: {} -> {}", qp_num(), to_string(prev), to_string(next));
  return {};
}

std::error_code verbs_qp::cm_transition(rdma_cm_id* id, ibv_qp_state target) noexcept {
  ibv_qp_attr a{};
  int mask = 0;
  a.qp_state = target;
  if (rdma_init_qp_attr(id, &a, &mask) != 0) return {errno, std::system_category()};
  if (target == IBV_QPS_INIT) {
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
    mask |= IBV_QP_ACCESS_FLAGS;
  }
  if (target == IBV_QPS_RTR) {
    a.min_rnr_timer = rnr_timer_code(attr_.min_rnr_timer_us);
    mask |= IBV_QP_MIN_RNR_TIMER;
  }
  if (target == IBV_QPS_RTS) {
    log().debug("qp {}: rdma_cm suggests ack timeout {}, retry count {}", qp_num(), a.timeout, a.retry_cnt);
    a.rnr_retry = attr_.rnr_retry;
    // A dead peer must surface as retry_exceeded, never as a hang: an ack
    // timeout of 0 means "wait forever" to some drivers (rxe among them).
    a.timeout = kAckTimeout;
    a.retry_cnt = 7;
    mask |= IBV_QP_RNR_RETRY | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT;
  }
  if (ibv_modify_qp(qp_, &a, mask) != 0) return {errno, std::system_category()};
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
    if (is_atomic(wr.op)) {
      w.wr.atomic = {wr.remote_addr, wr.compare_add, wr.swap, wr.rkey};
    } else {
      w.wr.rdma = {wr.remote_addr, wr.rkey};
    }
  }
  ibv_send_wr* bad_wr = nullptr;
  if (const int rc = ibv_post_send(qp_, swr_.data(), &bad_wr); rc != 0) {
    const auto i = static_cast<std::size_t>(bad_wr - swr_.data());
    // Requests before bad_wr were posted (verbs semantics); report the first refused one.
    sq_posted_ += i;
    counters_.send_wrs += i;
    ++counters_.doorbells;
    if (bad != nullptr) *bad = i;
    log().warn("qp {}: ibv_post_send refused request {}: {}", qp_num(), i, std::strerror(rc));
    return {rc, std::system_category()};
  }
  sq_posted_ += wrs.size();
  counters_.send_wrs += wrs.size();
  ++counters_.doorbells;
  return {};
}

std::error_code verbs_qp::post_recv(std::span<const recv_request> wrs, std::size_t* bad) noexcept {
  if (posted_state_ == qp_state::reset) return errc::invalid_state;
  if (auto ec = check_recv(wrs, attr_.max_recv_sge, attr_.max_recv_wr, rq_posted_ - rq_done_, bad)) return ec;
  if (wrs.empty()) return {};
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
    counters_.recv_wrs += i;
    if (bad != nullptr) *bad = i;
    return {rc, std::system_category()};
  }
  rq_posted_ += wrs.size();
  counters_.recv_wrs += wrs.size();
  return {};
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

// ---------------------------------------------------------------- connection manager

namespace {

class verbs_request final : public connection_request {
 public:
  verbs_request(rdma_cm_id* id, std::vector<std::byte> pdata, std::chrono::milliseconds timeout)
      : id_(id), pdata_(std::move(pdata)), timeout_(timeout) {}
  ~verbs_request() override {
    if (id_ != nullptr) {
      rdma_reject(id_, nullptr, 0);
      rdma_destroy_id(id_);
    }
  }
  std::span<const std::byte> private_data() const noexcept override { return pdata_; }

  std::error_code accept(queue_pair& qp, std::span<const std::byte> pdata,
                         std::stop_token stop) noexcept override {
    auto* vqp = dynamic_cast<verbs_qp*>(&qp);
    if (vqp == nullptr || pdata.size() > kMaxUserPrivateData) return errc::invalid_argument;
    if (id_ == nullptr || !vqp->can_connect()) return errc::invalid_state;
    if (id_->verbs != vqp->context()) {
      log().warn("verbs: connection request arrived on another device than the queue pair's");
      return errc::invalid_argument;
    }
    // A private channel, so that waiting for ESTABLISHED does not consume
    // the listener's events.
    rdma_event_channel* ch = rdma_create_event_channel();
    if (ch == nullptr || rdma_migrate_id(id_, ch) != 0) {
      const std::error_code ec(errno, std::system_category());
      if (ch != nullptr) rdma_destroy_event_channel(ch);
      return ec;
    }
    set_nonblocking(ch->fd);
    set_ack_timeout(id_);
    if (vqp->state() == qp_state::reset) {
      if (auto ec = vqp->cm_transition(id_, IBV_QPS_INIT)) return fail(ch, ec);
    }
    if (!vqp->iwarp()) {
      if (auto ec = vqp->cm_transition(id_, IBV_QPS_RTR)) return fail(ch, ec);
    }
    ibv_device_attr attr{};
    ibv_query_device(id_->verbs, &attr);
    const auto wrapped = wrap_private_data(pdata);
    rdma_conn_param p = conn_param(*vqp, wrapped, attr);
    if (rdma_accept(id_, &p) != 0) return fail(ch, {errno, std::system_category()});
    rdma_cm_event* ev = nullptr;
    // The peer's establishment, within the listener's handshake timeout.
    if (auto ec = next_event(ch, clock::now() + timeout_, &ev, stop)) return fail(ch, ec);
    const rdma_cm_event_type type = ev->event;
    rdma_ack_cm_event(ev);
    if (type != RDMA_CM_EVENT_ESTABLISHED) {
      log().warn("verbs: accept: expected ESTABLISHED, got {}", rdma_event_str(type));
      return fail(ch, errc::connection_refused);
    }
    if (!vqp->iwarp()) {
      if (auto ec = vqp->cm_transition(id_, IBV_QPS_RTS)) return fail(ch, ec);
    }
    vqp->adopt(id_, ch);
    id_ = nullptr;
    return {};
  }

  void reject(std::span<const std::byte> pdata) noexcept override {
    if (id_ == nullptr) return;
    const auto wrapped = wrap_private_data(pdata.first(std::min(pdata.size(), kMaxUserPrivateData)));
    rdma_reject(id_, wrapped.data(), static_cast<std::uint8_t>(wrapped.size()));
    rdma_destroy_id(id_);
    id_ = nullptr;
  }

 private:
  std::error_code fail(rdma_event_channel* ch, std::error_code ec) {
    log().warn("verbs: accept failed: {}", ec.message());
    rdma_destroy_id(id_);
    id_ = nullptr;
    rdma_destroy_event_channel(ch);
    return ec;
  }
  rdma_cm_id* id_;
  std::vector<std::byte> pdata_;
  std::chrono::milliseconds timeout_;
};

class verbs_listener final : public listener {
 public:
  verbs_listener(rdma_event_channel* ch, rdma_cm_id* id, const listen_options& o) : ch_(ch), id_(id), opt_(o) {}
  ~verbs_listener() override {
    rdma_destroy_id(id_);
    rdma_destroy_event_channel(ch_);
  }
  int fd() const noexcept override { return ch_->fd; }
  std::uint16_t port() const noexcept override { return ntohs(rdma_get_src_port(id_)); }
  // rdma_cm refuses malformed requests itself; the runtime counts its own refusals.
  std::uint64_t refused() const noexcept override { return 0; }

  std::unique_ptr<connection_request> get_request(std::chrono::milliseconds timeout,
                                                  std::error_code& ec) noexcept override {
    const auto deadline = clock::now() + timeout;
    for (;;) {
      rdma_cm_event* ev = nullptr;
      ec = next_event(ch_, deadline, &ev);
      if (ec) return nullptr;
      if (ev->event == RDMA_CM_EVENT_CONNECT_REQUEST) {
        rdma_cm_id* id = ev->id;
        auto pdata = user_private_data(ev->param.conn);
        rdma_ack_cm_event(ev);
        return std::make_unique<verbs_request>(id, std::move(pdata), opt_.handshake_timeout);
      }
      log().debug("verbs listener: ignoring {}", rdma_event_str(ev->event));
      rdma_ack_cm_event(ev);
    }
  }

 private:
  rdma_event_channel* ch_;
  rdma_cm_id* id_;
  listen_options opt_;
};

// Resolves host:port for rdma_cm; nullptr with ec set on failure.
rdma_addrinfo* resolve(const std::string& host, std::uint16_t port, bool passive, std::error_code& ec) {
  rdma_addrinfo hints{};
  hints.ai_port_space = RDMA_PS_TCP;
  hints.ai_flags = passive ? RAI_PASSIVE : 0;
  rdma_addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (rdma_getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res) != 0) {
    log().warn("verbs: cannot resolve '{}:{}'", host, port);
    ec = errc::address_error;
    return nullptr;
  }
  return res;
}

}  // namespace

std::unique_ptr<listener> verbs_device::listen(const std::string& host, std::uint16_t port,
                                               const listen_options& options) {
  if (options.handshake_timeout.count() <= 0 || options.max_pending == 0) {
    throw std::system_error(errc::invalid_argument, "listen: handshake_timeout and max_pending must be positive");
  }
  std::error_code ec;
  rdma_addrinfo* res = resolve(host, port, true, ec);
  if (res == nullptr) throw std::system_error(ec, "listen: cannot resolve '" + host + "'");
  rdma_event_channel* ch = rdma_create_event_channel();
  rdma_cm_id* id = nullptr;
  if (ch == nullptr || rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP) != 0) {
    const int err = errno;
    rdma_freeaddrinfo(res);
    if (ch != nullptr) rdma_destroy_event_channel(ch);
    throw sys_error(err, "rdma_create_id");
  }
  set_nonblocking(ch->fd);
  const int rc = rdma_bind_addr(id, res->ai_src_addr);
  const int err = errno;
  rdma_freeaddrinfo(res);
  if (rc != 0 || rdma_listen(id, 128) != 0) {
    rdma_destroy_id(id);
    rdma_destroy_event_channel(ch);
    throw sys_error(rc != 0 ? err : errno, "listen: cannot bind " + host + ":" + std::to_string(port));
  }
  return std::make_unique<verbs_listener>(ch, id, options);
}

connect_result verbs_device::connect(queue_pair& qp, const std::string& host, std::uint16_t port,
                                     std::span<const std::byte> pdata, std::chrono::milliseconds timeout,
                                     std::stop_token stop) noexcept {
  connect_result result;
  auto* vqp = dynamic_cast<verbs_qp*>(&qp);
  if (vqp == nullptr || pdata.size() > kMaxUserPrivateData) {
    result.ec = errc::invalid_argument;
    return result;
  }
  if (!vqp->can_connect()) {
    result.ec = errc::invalid_state;
    return result;
  }
  if (stop.stop_requested()) {
    result.ec = std::make_error_code(std::errc::operation_canceled);
    return result;
  }
  const auto deadline = clock::now() + timeout;
  const int timeout_ms = static_cast<int>(std::max<long long>(timeout.count(), 1));
  rdma_addrinfo* res = resolve(host, port, false, result.ec);
  if (res == nullptr) return result;
  rdma_event_channel* ch = rdma_create_event_channel();
  rdma_cm_id* id = nullptr;
  auto fail = [&](std::error_code ec, const char* what) {
    log().warn("verbs: connect to {}:{} failed at {}: {}", host, port, what, ec.message());
    if (id != nullptr) rdma_destroy_id(id);
    if (ch != nullptr) rdma_destroy_event_channel(ch);
    result.ec = ec;
    return result;
  };
  auto expect = [&](rdma_cm_event_type want, std::error_code on_other, const char* what) -> std::error_code {
    rdma_cm_event* ev = nullptr;
    if (auto ec = next_event(ch, deadline, &ev, stop)) return ec;
    const rdma_cm_event_type got = ev->event;
    std::error_code ec;
    if (got != want) {
      ec = on_other;
      if (got == RDMA_CM_EVENT_REJECTED) {
        // status 28: the consumer (our listener) rejected; anything else: no listener or unreachable
        ec = ev->status == 28 ? std::error_code(errc::connection_rejected) : std::error_code(errc::connection_refused);
        result.private_data = user_private_data(ev->param.conn);
        if (ec == errc::connection_refused) result.private_data.clear();
      } else if (got == RDMA_CM_EVENT_UNREACHABLE) {
        ec = errc::connection_refused;
      } else if (got == RDMA_CM_EVENT_ADDR_ERROR || got == RDMA_CM_EVENT_ROUTE_ERROR) {
        ec = errc::address_error;
      }
      log().debug("verbs: {}: got {} (status {})", what, rdma_event_str(got), ev->status);
    } else if (got == RDMA_CM_EVENT_CONNECT_RESPONSE || got == RDMA_CM_EVENT_ESTABLISHED) {
      result.private_data = user_private_data(ev->param.conn);
    }
    rdma_ack_cm_event(ev);
    return ec;
  };
  if (ch == nullptr || rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP) != 0) {
    rdma_freeaddrinfo(res);
    return fail({errno, std::system_category()}, "rdma_create_id");
  }
  set_nonblocking(ch->fd);
  sockaddr_in gid_src{};
  sockaddr* src = res->ai_src_addr;
  if (state_->gid_forced) {
    if (res->ai_dst_addr->sa_family != AF_INET) {
      rdma_freeaddrinfo(res);
      return fail(errc::address_error, "address resolution (ANYDOOR_GID_INDEX forces an IPv4 source GID; "
                                       "the destination is not IPv4)");
    }
    gid_src.sin_family = AF_INET;
    gid_src.sin_addr.s_addr = state_->gid_ipv4;
    src = reinterpret_cast<sockaddr*>(&gid_src);
  }
  const int rc = rdma_resolve_addr(id, src, res->ai_dst_addr, timeout_ms);
  rdma_freeaddrinfo(res);
  if (rc != 0) return fail(errc::address_error, "rdma_resolve_addr");
  if (auto ec = expect(RDMA_CM_EVENT_ADDR_RESOLVED, errc::address_error, "address resolution")) {
    return fail(ec, "address resolution");
  }
  if (id->verbs != state_->ctx) {
    return fail(errc::address_error, "address resolution (the address routes through another RDMA device)");
  }
  set_ack_timeout(id);
  if (rdma_resolve_route(id, timeout_ms) != 0) return fail({errno, std::system_category()}, "rdma_resolve_route");
  if (auto ec = expect(RDMA_CM_EVENT_ROUTE_RESOLVED, errc::address_error, "route resolution")) {
    return fail(ec, "route resolution");
  }
  if (vqp->state() == qp_state::reset) {
    if (auto ec = vqp->cm_transition(id, IBV_QPS_INIT)) return fail(ec, "INIT");
  }
  ibv_device_attr attr{};
  ibv_query_device(state_->ctx, &attr);
  const auto wrapped = wrap_private_data(pdata);
  rdma_conn_param p = conn_param(*vqp, wrapped, attr);
  if (rdma_connect(id, &p) != 0) return fail({errno, std::system_category()}, "rdma_connect");
  // IB/RoCE with a user-managed QP: CONNECT_RESPONSE, then RTR, RTS and
  // rdma_establish. iWARP: the CM moves the QP and reports ESTABLISHED.
  const rdma_cm_event_type reply = vqp->iwarp() ? RDMA_CM_EVENT_ESTABLISHED : RDMA_CM_EVENT_CONNECT_RESPONSE;
  if (auto ec = expect(reply, errc::connection_refused, "connect")) {
    const auto keep = result.private_data;
    fail(ec, "connect");
    result.private_data = keep;
    vqp->modify(qp_state::reset);
    return result;
  }
  if (!vqp->iwarp()) {
    if (auto ec = vqp->cm_transition(id, IBV_QPS_RTR)) return fail(ec, "RTR");
    if (auto ec = vqp->cm_transition(id, IBV_QPS_RTS)) return fail(ec, "RTS");
    if (rdma_establish(id) != 0) return fail({errno, std::system_category()}, "rdma_establish");
  }
  vqp->adopt(id, ch);
  return result;
}

std::unique_ptr<device> open(const std::string& name) { return std::make_unique<verbs_device>(name); }

}  // namespace anydoor::transport::verbs
