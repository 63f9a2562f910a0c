// The verbs provider's device (opening, capabilities, RNR counters), its
// protection domain and memory registrations.
#include "verbs/verbs_provider.hpp"
#include "verbs/verbs_util.hpp"

#include <anydoor/error.hpp>

#include "contract_checks.hpp"
#include "log.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <system_error>

namespace anydoor::transport::verbs {
using namespace detail;
namespace {

unsigned ibv_access(access acc) {
  unsigned a = 0;
  if (has(acc, access::local_write)) a |= IBV_ACCESS_LOCAL_WRITE;
  if (has(acc, access::remote_write)) a |= IBV_ACCESS_REMOTE_WRITE;
  if (has(acc, access::remote_read)) a |= IBV_ACCESS_REMOTE_READ;
  if (has(acc, access::remote_atomic)) a |= IBV_ACCESS_REMOTE_ATOMIC;
  if (has(acc, access::mw_bind)) a |= IBV_ACCESS_MW_BIND;
  return a;
}

}  // namespace

// ---------------------------------------------------------------- device

device_state::~device_state() {
  if (cm_list != nullptr) rdma_free_devices(cm_list);
}

void device_state::drain_async_events() noexcept {
  std::unique_lock lock(async_mutex(), std::try_to_lock);
  if (!lock.owns_lock()) return;
  ibv_async_event ev;
  while (ibv_get_async_event(ctx, &ev) == 0) {
    async_events.fetch_add(1, std::memory_order_relaxed);
    switch (ev.event_type) {
      case IBV_EVENT_CQ_ERR:
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
      case IBV_EVENT_PORT_ERR:
      case IBV_EVENT_DEVICE_FATAL:
      case IBV_EVENT_SRQ_ERR:
        log().warn("verbs {}: asynchronous event: {}", name, ibv_event_type_str(ev.event_type));
        async_errors.fetch_add(1, std::memory_order_relaxed);
        break;
      case IBV_EVENT_SRQ_LIMIT_REACHED:
      case IBV_EVENT_QP_LAST_WQE_REACHED:  // a queue pair of a shared receive queue went to error
        log().debug("verbs {}: asynchronous event: {}", name, ibv_event_type_str(ev.event_type));
        break;
      default:
        log().info("verbs {}: asynchronous event: {}", name, ibv_event_type_str(ev.event_type));
        break;
    }
    // A retired queue pair's (see retire): its context is not a verbs_qp.
    retired_qp* gone = nullptr;
    if (ev.event_type == IBV_EVENT_QP_FATAL || ev.event_type == IBV_EVENT_QP_REQ_ERR ||
        ev.event_type == IBV_EVENT_QP_ACCESS_ERR || ev.event_type == IBV_EVENT_QP_LAST_WQE_REACHED) {
      for (const auto& r : shared->retired) {
        if (r->qp == ev.element.qp) gone = r.get();
      }
    }
    if (gone != nullptr) {
      if (ev.event_type == IBV_EVENT_QP_LAST_WQE_REACHED && !gone->last_wqe) {
        gone->last_wqe = true;
        gone->cq->wake_retired();
      }
      ibv_ack_async_event(&ev);
      continue;
    }
    // Every device of the process on this context reads its events (they
    // share the async fd): the handlers below may run on another device's
    // thread. A queue's overflow is only noted for its own thread; the
    // flags are atomics. A queue pair's move to error (ibv_modify_qp and
    // its atomic state) runs here: it races only an application's own
    // modify() of the same queue pair to reset, which the runtime never does.
    switch (ev.event_type) {
      case IBV_EVENT_CQ_ERR:
        if (ev.element.cq != nullptr && ev.element.cq->cq_context != nullptr) {
          static_cast<verbs_cq*>(ev.element.cq->cq_context)->note_overflow();
        }
        break;
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
        if (ev.element.qp != nullptr && ev.element.qp->qp_context != nullptr) {
          static_cast<verbs_qp*>(ev.element.qp->qp_context)->on_async_error();
        }
        break;
      case IBV_EVENT_QP_LAST_WQE_REACHED:
        if (ev.element.qp != nullptr && ev.element.qp->qp_context != nullptr) {
          static_cast<verbs_qp*>(ev.element.qp->qp_context)->on_last_wqe();
        }
        break;
      case IBV_EVENT_SRQ_LIMIT_REACHED:
        if (ev.element.srq != nullptr && ev.element.srq->srq_context != nullptr) {
          static_cast<verbs_srq*>(ev.element.srq->srq_context)->on_limit();
        }
        break;
      default:
        break;
    }
    ibv_ack_async_event(&ev);
  }
}

void device_state::log_destroy_failed(std::uint32_t qpn, int err) noexcept {
  log().error("ibv_destroy_qp (qp {}, retired): {}", qpn, std::strerror(err));
}

std::shared_ptr<context_shared> shared_for(ibv_context* ctx) {
  static std::mutex m;
  static std::vector<std::pair<ibv_context*, std::shared_ptr<context_shared>>> all;
  std::lock_guard lock(m);
  for (const auto& [c, s] : all) {
    if (c == ctx) return s;
  }
  all.emplace_back(ctx, std::make_shared<context_shared>());
  return all.back().second;
}

void device_state::retire(ibv_qp* qp, verbs_cq* cq, const std::atomic<bool>& last_wqe_flag) noexcept {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  const auto deadline = std::chrono::steady_clock::now() + kLastWqeWait;
  std::unique_ptr<retired_qp> r;
  std::lock_guard lock(async_mutex());
  const bool last_wqe = last_wqe_flag.load(std::memory_order_relaxed);  // (set under this lock)
  try {
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE) != 0) throw std::system_error(errno, std::system_category());
    r = std::make_unique<retired_qp>();
    r->qp = qp;
    r->cq = cq;
    r->deadline = deadline;
    r->last_wqe = last_wqe;
    shared->retired.push_back(std::move(r));
  } catch (const std::exception& e) {
    log().warn("verbs: qp {} destroyed at once ({}): a shared receive it was filling is lost", qp->qp_num, e.what());
    if (ibv_destroy_qp(qp) != 0) {
      log_destroy_failed(qp->qp_num, errno);
      qp->qp_context = nullptr;  // it lives on: no event may find the verbs_qp about to go
    }
    return;
  }
  qp->qp_context = shared->retired.back().get();
  cq->retired_added(deadline);
  if (last_wqe) cq->wake_retired();
  log().debug("verbs: qp {} retired: destroyed once its last shared receive is back", qp->qp_num);
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
        state_->shared = shared_for(ctx);
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
        // dmabuf: probed below; peer_memory: ibv_reg_mr on GPU pointers
        // works once nvidia-peermem (or the older nv_peer_mem) is loaded.
        c.peer_memory = std::filesystem::exists("/sys/module/nvidia_peermem") ||
                        std::filesystem::exists("/sys/module/nv_peer_mem");
        c.max_srq = attr.max_srq > 0 && attr.max_srq_wr > 0 ? static_cast<std::uint32_t>(attr.max_srq) : 0;
        c.max_srq_wr = c.max_srq != 0 ? static_cast<std::uint32_t>(attr.max_srq_wr) : 0;
        // Type-2 windows (rxe has 2B; siw none).
        // InfiniBand and RoCE connect with REQ, REP and RTU; iWARP's MPA
        // exchange ends on the listener's side.
        c.established_by_message = !state_->iwarp;
        c.late_duplicates = !state_->iwarp;  // (iWARP runs over TCP: in order, exactly once)
        c.memory_windows = attr.max_mw > 0 && (attr.device_cap_flags & (IBV_DEVICE_MEM_WINDOW_TYPE_2A |
                                                                        IBV_DEVICE_MEM_WINDOW_TYPE_2B)) != 0;
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
          if (e.gid_type != IBV_GID_TYPE_ROCE_V2) {
            // rdma_cm would use the port's default RoCE type for that
            // address, not this entry: forcing it would be a lie.
            throw std::system_error(errc::invalid_argument,
                                    "ANYDOOR_GID_INDEX=" + std::string(g) + ": GID " + std::to_string(gi) + " of " +
                                        name + " is not RoCE v2; only RoCE v2 GIDs can be forced");
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
  // dma-buf registration: the kernel refuses a driver without it
  // (EOPNOTSUPP, as rxe and siw do) before it looks at the fd, so a
  // registration of fd -1 tells the two apart (EBADF: supported).
  if (pd != nullptr) {
    errno = 0;
    if (ibv_mr* mr = ibv_reg_dmabuf_mr(pd, 0, 4096, 0, -1, IBV_ACCESS_LOCAL_WRITE)) {
      ibv_dereg_mr(mr);
      state_->caps.dmabuf = true;
    } else {
      state_->caps.dmabuf = errno != EOPNOTSUPP && errno != ENOSYS && errno != EPROTONOSUPPORT && errno != 0;
    }
  }
  if (pd != nullptr) ibv_dealloc_pd(pd);
  log().info("verbs: opened {} port {} ({} GID index {}, max_inline {}, atomics {}, dma-buf {}, peer memory {})",
             state_->name, state_->port, state_->gid_forced ? "forced" : "first RoCE v2 IPv4", state_->gid_index,
             state_->caps.max_inline, state_->caps.atomics ? "yes" : "no", state_->caps.dmabuf ? "yes" : "no",
             state_->caps.peer_memory ? "yes" : "no");
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
  state_->drain_async_events();  // (a busy-polling reactor may not have taken them yet)
  c.async_events = state_->async_events.load(std::memory_order_relaxed);
  c.async_errors = state_->async_errors.load(std::memory_order_relaxed);
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
      // Transport retries: rxe counts each retry its completer makes, mlx5
      // the ACK timeouts (each one a retry); retry_cnt running out is rxe's
      // retry_exceeded_err, mlx5's req_transport_retries_exceeded.
      for (const char* r : {"completer_retry_err", "local_ack_timeout_err"}) {
        if ((c.transport_retries = read(dir + "/" + r))) break;
      }
      for (const char* r : {"retry_exceeded_err", "req_transport_retries_exceeded"}) {
        if ((c.transport_retry_exceeded = read(dir + "/" + r))) break;
      }
      return c;
    }
  }
  c.source = "no RNR counters under " + dirs[0] + " or " + dirs[1];
  return c;
}

std::unique_ptr<protection_domain> verbs_device::alloc_pd() { return std::make_unique<verbs_pd>(state_); }

// (options.progress_thread: the NIC executes the peers' operations itself.)
std::unique_ptr<completion_queue> verbs_device::create_cq(std::uint32_t depth, const cq_options& /*options*/) {
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

verbs_pd::~verbs_pd() {
  {
    std::lock_guard lock(dev_->async_mutex());
    dev_->destroy_retired_locked([&](const retired_qp& r) { return r.qp->pd == pd_; });
  }
  ibv_dealloc_pd(pd_);
}

std::unique_ptr<memory_region> verbs_pd::register_memory(void* addr, std::size_t length, access acc) {
  check_registration(addr, length, acc);
  ibv_mr* mr = ibv_reg_mr(pd_, addr, length, ibv_access(acc));  // exactly the requested access
  if (mr == nullptr) {
    throw std::system_error(errc::registration_failed,
                            std::string("ibv_reg_mr: ") + std::strerror(errno));
  }
  return std::make_unique<verbs_mr>(mr, acc);
}

std::unique_ptr<memory_region> verbs_pd::register_dmabuf(int fd, std::uint64_t offset, std::size_t length,
                                                        std::uint64_t iova, access acc) {
  check_dmabuf_registration(fd, offset, length, iova, acc);
  if (!dev_->caps.dmabuf) {
    throw std::system_error(errc::not_supported,
                            "register_dmabuf: " + dev_->name + "'s driver has no dma-buf registration");
  }
  // The buffer's end, as tcp checks it (a dma-buf's inode has its size;
  // 0 means not known: the device checks).
  struct stat st{};
  if (::fstat(fd, &st) == 0 && st.st_size > 0) {
    const auto size = static_cast<std::uint64_t>(st.st_size);
    if (offset > size || length > size - offset) {
      throw std::system_error(errc::invalid_argument, "register_dmabuf: [" + std::to_string(offset) + ", +" +
                                                          std::to_string(length) + ") ends past the buffer's " +
                                                          std::to_string(size) + " bytes");
    }
  }
  ibv_mr* mr = ibv_reg_dmabuf_mr(pd_, offset, length, iova, fd, static_cast<int>(ibv_access(acc)));
  if (mr == nullptr) {
    const int e = errno;
    throw std::system_error(e == EOPNOTSUPP ? make_error_code(errc::not_supported) : make_error_code(errc::registration_failed),
                            std::string("ibv_reg_dmabuf_mr: ") + std::strerror(e));
  }
  return std::make_unique<verbs_mr>(mr, acc, iova);
}

verbs_mr::verbs_mr(ibv_mr* mr, transport::access acc) noexcept
    : memory_region(mr->addr, mr->length, mr->lkey, mr->rkey, acc), mr_(mr) {}
verbs_mr::verbs_mr(ibv_mr* mr, transport::access acc, std::uint64_t iova) noexcept
    : memory_region(reinterpret_cast<void*>(iova), mr->length, mr->lkey, mr->rkey, acc), mr_(mr) {}

verbs_mr::~verbs_mr() {
  if (ibv_dereg_mr(mr_) != 0) log().error("ibv_dereg_mr: {}", std::strerror(errno));
}

std::unique_ptr<queue_pair> verbs_pd::create_qp(const qp_attributes& attr) {
  return std::make_unique<verbs_qp>(dev_, pd_, attr);
}

std::unique_ptr<memory_window> verbs_pd::alloc_window() {
  if (!dev_->caps.memory_windows) {
    throw std::system_error(errc::not_supported, "alloc_window: " + dev_->name + " has no type-2 memory windows");
  }
  ibv_mw* mw = ibv_alloc_mw(pd_, IBV_MW_TYPE_2);
  if (mw == nullptr) throw std::system_error(errc::registration_failed, std::string("ibv_alloc_mw: ") + std::strerror(errno));
  return std::make_unique<verbs_window>(mw);
}

verbs_window::verbs_window(ibv_mw* mw) noexcept : memory_window(mw->rkey), mw_(mw) {}

verbs_window::~verbs_window() {
  if (ibv_dealloc_mw(mw_) != 0) log().error("ibv_dealloc_mw: {}", std::strerror(errno));
}

std::unique_ptr<device> open(const std::string& name) { return std::make_unique<verbs_device>(name); }

}  // namespace anydoor::transport::verbs
