// The verbs provider: the contract on rdma-core (libibverbs + librdmacm).
//
// Queue pairs are created with ibv_create_qp on the protection domain and
// connected through rdma_cm with a user-managed QP (conn_param.qp_num): the
// provider moves them through init/rtr/rts with rdma_init_qp_attr. The
// device's ibv_context comes from rdma_get_devices(), so cm ids resolve to
// the same context as the domain.
//
// Work-request ids: the provider posts its own wr_id, (generation, queue
// pair index on the CQ, slot), and keeps the caller's wr_id in the slot, so
// that a completion finds its queue pair without a lookup table and the send
// queue's occupancy (signaled completions retire the unsignaled requests
// before them) is known exactly. post_send's own checks refuse a batch
// whole; an error from ibv_post_send itself leaves the requests before the
// bad one posted (counted here, and by the runtime: provider contract).
#pragma once

#include <anydoor/transport/provider.hpp>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace anydoor::transport::verbs {

class verbs_cq;
class verbs_qp;
class verbs_srq;

// A queue pair of a shared receive queue that its owner destroyed. It may
// hold a shared receive it was filling: moved to error, the device flushes
// that receive to the completion queue, and then reports
// IBV_EVENT_QP_LAST_WQE_REACHED; destroying it before would lose the
// receive (mlx5 also removes a destroyed queue pair's completions from the
// CQ), and the queue would shrink by one with every connection cut in the
// middle of a message. So the device keeps it until that event (or, for
// devices that never send it, such as rxe, until a deadline) and until a
// poll that began after it has emptied the completion queue (or after as
// many completions as the queue holds were taken since: it is FIFO, so what
// it held then is gone even if it never runs empty).
struct retired_qp {
  ibv_qp* qp = nullptr;
  verbs_cq* cq = nullptr;  // its receive completion queue, whose poll destroys it
  std::chrono::steady_clock::time_point deadline;
  bool last_wqe = false;   // the event came
  bool armed = false;      // the event (or the deadline) was seen when a poll began
  std::uint64_t armed_at = 0;  // the CQ's completions taken until then (verbs_cq::taken_)
};

// What every device_state on one ibv_context shares: librdmacm hands the
// same contexts to every fabric of the process (rdma_get_devices), so
// their asynchronous events come from one queue that any of them may
// read. One lock covers reading, handling and acknowledging an event, and
// every change of a queue pair's qp_context; and one list holds the
// retired queue pairs, so that an event for one is recognized whoever
// reads it. (Holding the lock, nobody holds an unacknowledged event, so
// ibv_destroy_qp/cq/srq do not wait under it.)
struct context_shared {
  std::mutex async_mutex;
  std::vector<std::unique_ptr<retired_qp>> retired;
};
// The one for ctx (made on first use, kept for the process).
std::shared_ptr<context_shared> shared_for(ibv_context* ctx);

struct device_state {
  ibv_context* ctx = nullptr;  // owned by rdma_cm (rdma_get_devices)
  ibv_context** cm_list = nullptr;
  std::uint8_t port = 1;
  // The first RoCE v2 GID with an IPv4 address (logged), or the one
  // ANYDOOR_GID_INDEX forces: connections then leave from its address.
  int gid_index = -1;
  bool gid_forced = false;
  std::uint32_t gid_ipv4 = 0;     // the GID's IPv4 address (network order)
  bool iwarp = false;  // iWARP (siw, ...): the CM itself moves QPs to RTR/RTS
  std::string name;
  capabilities caps;
  std::shared_ptr<context_shared> shared;  // with ctx
  std::mutex& async_mutex() noexcept { return shared->async_mutex; }
  std::atomic<std::uint64_t> async_events{0};  // every asynchronous event taken
  std::atomic<std::uint64_t> async_errors{0};  // of them, the errors
  // Shared receive queues, found by their wr_ids' index (see verbs_srq):
  // registered and removed under srq_mutex, looked up without a lock.
  static constexpr std::uint32_t kMaxSrqs = 1u << 16;
  std::mutex srq_mutex;
  std::unique_ptr<std::atomic<verbs_srq*>[]> srqs = std::make_unique<std::atomic<verbs_srq*>[]>(kMaxSrqs);
  std::uint32_t srq_next = 0;  // where the search for a free index starts
  std::uint8_t srq_generation = 0;
  ~device_state();
  // index: the receive's wr_id field (see verbs_srq); false when its queue
  // is gone.
  bool complete_srq(const ibv_wc& wc, std::uint32_t index, std::uint32_t slot, completion& out) noexcept;
  // Reads pending asynchronous events (non-blocking), logs them, and turns
  // CQ errors into overflow and QP errors into queue-pair error state.
  void drain_async_events() noexcept;
  static void log_destroy_failed(std::uint32_t qpn, int err) noexcept;
  // Keeps a queue pair of a shared receive queue, moved to error, until its
  // last receive is back (retired_qp); destroys it now when it cannot be
  // kept (no memory, or the move to error failed).
  // last_wqe: IBV_EVENT_QP_LAST_WQE_REACHED came while it was alive.
  void retire(ibv_qp* qp, verbs_cq* cq, const std::atomic<bool>& last_wqe) noexcept;
  // With async_mutex() held: destroys the retired queue pairs (of the
  // whole context) `pred` selects.
  template <class Pred>
  void destroy_retired_locked(Pred pred) noexcept;
  // How long a retired queue pair waits for IBV_EVENT_QP_LAST_WQE_REACHED.
  static constexpr std::chrono::milliseconds kLastWqeWait{200};
};

class verbs_device final : public device {
 public:
  explicit verbs_device(const std::string& name);
  std::string_view provider() const noexcept override { return "verbs"; }
  std::string_view name() const noexcept override { return state_->name; }
  const capabilities& caps() const noexcept override { return state_->caps; }
  device_counters counters() const override;
  std::unique_ptr<protection_domain> alloc_pd() override;
  using device::create_cq;
  std::unique_ptr<completion_queue> create_cq(std::uint32_t depth, const cq_options& options) override;
  std::unique_ptr<listener> listen(const std::string& host, std::uint16_t port,
                                   const listen_options& options) override;
  using device::connect;
  connect_result connect(queue_pair& qp, const std::string& host, std::uint16_t port,
                         std::span<const std::byte> private_data, std::chrono::milliseconds timeout,
                         std::stop_token stop) noexcept override;

 private:
  std::shared_ptr<device_state> state_;
};

class verbs_pd final : public protection_domain {
 public:
  explicit verbs_pd(std::shared_ptr<device_state> dev);
  ~verbs_pd() override;
  std::unique_ptr<memory_region> register_memory(void* addr, std::size_t length, access acc) override;
  std::unique_ptr<memory_region> register_dmabuf(int fd, std::uint64_t offset, std::size_t length, std::uint64_t iova,
                                                 access acc) override;
  std::unique_ptr<queue_pair> create_qp(const qp_attributes& attr) override;
  std::unique_ptr<memory_window> alloc_window() override;
  std::unique_ptr<shared_receive_queue> create_srq(const srq_attributes& attr) override;

 private:
  std::shared_ptr<device_state> dev_;
  ibv_pd* pd_ = nullptr;
};

// A shared receive queue (ibv_srq). Its receives carry the provider's
// wr_id, (generation 0, this queue's registry index and generation, slot):
// generation 0 tells a completion queue the receive is a shared queue's.
// The caller's wr_id waits in the slot; slots are taken at post time (any
// thread) and freed when a completion queue polls their completion, under
// a mutex, since queue pairs on different threads consume in any order.
class verbs_srq final : public shared_receive_queue {
 public:
  verbs_srq(std::shared_ptr<device_state> dev, ibv_pd* pd, const srq_attributes& attr);
  ~verbs_srq() override;
  std::error_code post_recv(std::span<const recv_request> wrs, std::size_t* bad) noexcept override;
  std::error_code arm_limit(std::uint32_t limit) noexcept override;
  bool limit_reached() noexcept override;
  const srq_attributes& attributes() const noexcept override { return attr_; }

  ibv_srq* raw() const noexcept { return srq_; }
  std::uint32_t tag() const noexcept { return tag_; }  // registry index | generation << 16
  // The completion queue's half: the caller's wr_id, and the slot freed.
  void complete(const ibv_wc& wc, std::uint32_t slot, completion& out) noexcept;
  void on_limit() noexcept { limit_hit_.store(true, std::memory_order_release); }

 private:
  std::shared_ptr<device_state> dev_;
  srq_attributes attr_;
  ibv_srq* srq_ = nullptr;
  std::uint32_t tag_ = 0;
  std::mutex mutex_;
  std::vector<std::uint64_t> wr_ids_;   // per slot: the caller's
  std::vector<std::uint32_t> free_;     // free slots (a stack)
  std::vector<ibv_recv_wr> rwr_;        // post-time scratch
  std::vector<ibv_sge> rsge_;
  std::atomic<bool> limit_hit_{false};
};

class verbs_mr final : public memory_region {
 public:
  verbs_mr(ibv_mr* mr, transport::access acc) noexcept;
  // A dma-buf registration: addressed from iova (libibverbs leaves the
  // dma-buf offset in mr->addr).
  verbs_mr(ibv_mr* mr, transport::access acc, std::uint64_t iova) noexcept;
  ~verbs_mr() override;
  ibv_mr* raw() const noexcept { return mr_; }

 private:
  ibv_mr* mr_;
};

class verbs_window final : public memory_window {
 public:
  explicit verbs_window(ibv_mw* mw) noexcept;
  ~verbs_window() override;
  ibv_mw* raw() const noexcept { return mw_; }
  // post_send: the bind was posted with this new key.
  void posted(std::uint32_t rkey) noexcept { set_bound(rkey); }

 private:
  ibv_mw* mw_;
};

class verbs_cq final : public completion_queue {
 public:
  verbs_cq(std::shared_ptr<device_state> dev, std::uint32_t depth);
  ~verbs_cq() override;
  std::size_t poll(std::span<completion> out, std::error_code& ec) noexcept override;
  std::error_code arm() noexcept override;
  // An epoll set: the completion channel, the device's async-event fd and
  // the rdma_cm event channel of each connected queue pair on this queue, so
  // that a reactor asleep on it wakes for a disconnect too (arm() processes
  // those events).
  int notify_fd() const noexcept override { return epfd_; }
  void watch(int fd) noexcept;    // thread-safe (epoll_ctl)
  void unwatch(int fd) noexcept;
  std::size_t ack_events() noexcept override;
  std::uint32_t depth() const noexcept override { return static_cast<std::uint32_t>(cq_->cqe); }
  cq_counters counters() const noexcept override { return counters_; }

  ibv_cq* raw() const noexcept { return cq_; }
  // Returns the queue pair's index on this CQ; wrs: the work requests it
  // can have outstanding here.
  std::uint32_t attach(verbs_qp* qp, std::uint32_t wrs);
  void detach(std::uint32_t index, std::uint32_t wrs) noexcept;
  // IBV_EVENT_CQ_ERR, read by any device's thread on this context (under
  // async_mutex()): noted, and the notify fd woken; this queue's own poll
  // or arm takes it (on_overflow), so that only its thread touches its state.
  void note_overflow() noexcept;
  void check_events() noexcept;  // asynchronous and connection events
  // The queue pair holds receives the provider completes itself (posted in
  // error): poll() returns them, and the notify fd wakes a reactor for them.
  void flush_later(verbs_qp* qp) noexcept;
  void drain_flush_fd() noexcept;
  // Retired queue pairs (device_state::retire) that this queue's poll
  // destroys; the timer wakes a reactor asleep on notify_fd at the earliest
  // deadline.
  void retired_added(std::chrono::steady_clock::time_point deadline) noexcept;
  // (These two and wake_retired with async_mutex() held.)
  void retired_gone() noexcept {
    if (retiring_.fetch_sub(1, std::memory_order_relaxed) == 1) set_retire_timer({});  // (else it would fire for good)
  }
  // Its IBV_EVENT_QP_LAST_WQE_REACHED came: the next poll looks at once.
  void wake_retired() noexcept;

 private:
  struct qp_entry {
    verbs_qp* qp = nullptr;
    std::uint8_t generation = 0;
  };
  std::shared_ptr<device_state> dev_;
  int epfd_ = -1;
  ibv_comp_channel* channel_ = nullptr;
  ibv_cq* cq_ = nullptr;
  std::vector<qp_entry> qps_;
  std::vector<verbs_qp*> flushing_;  // see flush_later
  int flush_fd_ = -1;                // an eventfd in the epoll set, readable while flushing_ is not empty
  std::atomic<std::uint32_t> retiring_{0};  // retired queue pairs whose receive queue this is
  int retire_fd_ = -1;                      // a timerfd in the epoll set (retired_added)
  int overflow_fd_ = -1;                    // an eventfd in the epoll set: note_overflow
  std::atomic<bool> overflow_noted_{false};
  void take_overflow() noexcept;  // poll's thread: a noted overflow becomes overflow_
  void destroy_unbuilt_cq() noexcept;
  void on_overflow() noexcept;
  // poll()'s halves: marks those whose event or deadline came (true: some
  // are), and destroys the marked once a poll has emptied the queue.
  bool arm_retired() noexcept;
  void destroy_armed(bool emptied) noexcept;
  std::uint64_t taken_ = 0;  // poll's thread: every completion taken off the CQ (ours or dropped)
  // Poll's thread: the next look (at most one a ms, unless a deadline is
  // due or wake_retired asked), whether some of ours are marked.
  std::chrono::steady_clock::time_point retire_check_{};
  std::chrono::steady_clock::time_point next_due_ = std::chrono::steady_clock::time_point::max();
  bool retire_armed_ = false;
  std::atomic<bool> retire_wake_{false};
  std::chrono::steady_clock::time_point timer_at_{};  // under async_mutex(): the timer's expiry (none: {})
  void set_retire_timer(std::chrono::steady_clock::time_point at) noexcept;  // {}: disarms
  std::uint64_t wrs_ = 0;
  bool overflow_ = false;
  std::uint32_t empty_streak_ = 0;
  std::chrono::steady_clock::time_point events_checked_{};
  cq_counters counters_;
  friend class verbs_qp;
};

class verbs_qp final : public queue_pair {
 public:
  verbs_qp(std::shared_ptr<device_state> dev, ibv_pd* pd, const qp_attributes& attr);
  ~verbs_qp() override;

  std::uint32_t qp_num() const noexcept override { return qp_->qp_num; }
  qp_state state() const noexcept override;
  std::error_code modify(qp_state next) noexcept override;
  std::error_code post_send(std::span<const work_request> wrs, std::size_t* bad) noexcept override;
  std::error_code post_recv(std::span<const recv_request> wrs, std::size_t* bad) noexcept override;
  std::error_code set_remote_access(access acc) noexcept override;
  const qp_attributes& attributes() const noexcept override { return attr_; }
  qp_counters counters() const noexcept override { return counters_; }
  path_info path() const noexcept override;
  void note_peer_message() noexcept override { peer_message_.store(true, std::memory_order_release); }

  // Connection manager.
  ibv_context* context() const noexcept { return dev_->ctx; }
  bool iwarp() const noexcept { return dev_->iwarp; }
  bool can_connect() const noexcept;
  // Moves the QP to `target` with rdma_init_qp_attr's attributes for the id.
  std::error_code cm_transition(rdma_cm_id* id, ibv_qp_state target) noexcept;
  void adopt(rdma_cm_id* id, rdma_event_channel* channel) noexcept;
  // A message of the peer's came before the accept saw ESTABLISHED.
  bool peer_message_seen() const noexcept { return peer_message_.load(std::memory_order_acquire); }

  // Completion translation (called by the CQ).
  void complete(const ibv_wc& wc, std::uint32_t slot, bool recv, completion& out) noexcept;
  // The receives posted in error, flushed by the provider (see post_recv),
  // once the device has returned those posted before: how many went to out.
  std::size_t complete_flushed(std::span<completion> out) noexcept;
  bool flush_pending() const noexcept { return rq_done_ < rq_posted_ && rq_posted_ > rq_device_; }
  void on_async_error() noexcept;
  void on_last_wqe() noexcept { last_wqe_.store(true, std::memory_order_relaxed); }  // (under async_mutex())
  // Reads this connection's rdma_cm events (non-blocking): DISCONNECTED
  // (the peer destroyed its connection or died) moves the QP to error.
  void poll_cm_events() noexcept;

 private:
  struct send_slot {
    std::uint64_t wr_id = 0;
    std::uint64_t seq = 0;
    opcode op = opcode::send;
    bool signaled = true;
  };
  std::uint64_t make_wr_id(std::uint32_t cq_index, std::uint8_t gen, std::uint32_t slot, bool recv) const noexcept;
  void disconnect() noexcept;
  void mark_binds(std::span<const work_request> posted) noexcept;  // the windows they bound

  std::shared_ptr<device_state> dev_;
  qp_attributes attr_;
  ibv_qp* qp_ = nullptr;
  verbs_cq* scq_;
  verbs_cq* rcq_;
  std::uint32_t sindex_ = 0, rindex_ = 0;  // our index on each CQ
  std::uint8_t sgen_ = 0, rgen_ = 0;
  // The state this provider last set. Posting checks it instead of asking
  // the device (ibv_query_qp is a system call); the device may move the QP
  // to error on its own, where posting is allowed too (requests flush).
  // Atomic: asynchronous events (the CQ's thread) may move it to error while
  // a connecting thread is inside cm_transition/adopt.
  std::atomic<qp_state> posted_state_{qp_state::reset};
  verbs_srq* srq_ = nullptr;  // receives come from it (attr_.srq)
  rdma_cm_id* cm_id_ = nullptr;
  // Stored last by adopt(), which may run on a connecting thread while the
  // completion queue's thread polls it for cm events.
  std::atomic<rdma_event_channel*> cm_channel_{nullptr};
  // Set by the runtime's thread (note_peer_message), read by an accepting one.
  std::atomic<bool> peer_message_{false};
  std::atomic<bool> last_wqe_{false};  // IBV_EVENT_QP_LAST_WQE_REACHED came (shared receive queue)
  qp_counters counters_;
  // send queue accounting: [sq_retired_, sq_posted_) occupy slots
  std::vector<send_slot> sq_;
  std::uint64_t sq_posted_ = 0, sq_retired_ = 0;
  std::vector<std::uint64_t> rq_;  // caller's wr_id per receive slot
  std::uint64_t rq_posted_ = 0, rq_done_ = 0;
  std::uint64_t rq_device_ = 0;  // [rq_device_, rq_posted_): posted in error, never given to the device
  // post-time scratch (no allocation per post)
  std::vector<ibv_send_wr> swr_;
  std::vector<std::uint32_t> bind_keys_;  // per request of a post: a bind's new rkey
  std::vector<ibv_sge> ssge_;
  std::vector<ibv_recv_wr> rwr_;
  std::vector<ibv_sge> rsge_;
};

template <class Pred>
void device_state::destroy_retired_locked(Pred pred) noexcept {
  std::erase_if(shared->retired, [&](const std::unique_ptr<retired_qp>& r) {
    if (!pred(*r)) return false;
    const std::uint32_t qpn = r->qp->qp_num;
    if (ibv_destroy_qp(r->qp) != 0) {
      // (Left to the kernel, which frees it with the context; no event
      // may find this record then.)
      log_destroy_failed(qpn, errno);
      r->qp->qp_context = nullptr;
    }
    r->cq->retired_gone();
    return true;
  });
}

// For open_device: the first device with an active port, or the named one.
std::unique_ptr<device> open(const std::string& name);

}  // namespace anydoor::transport::verbs
