// The tcp provider: a software RC NIC. One TCP connection per queue pair;
// requests (send, write, read, atomics) are executed by the target's
// provider against its registrations, and answered with ACK/NAK or response
// frames, so the initiator's completion means what it means on a real NIC.
// Progress happens inside completion_queue::poll().
#pragma once

#include <anydoor/transport/provider.hpp>

#include "tcp/faults.hpp"
#include "ring_slot.hpp"
#include "tcp/wire.hpp"

#include <sys/uio.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

namespace anydoor::transport::tcp {

class tcp_cq;
class tcp_qp;

// Keys and lookups of a protection domain's registrations and memory
// windows. Lookups are lock-free (they run on the data path of every
// completion queue's thread); register/deregister/bind take a mutex.
//
// A key is (slot index << 18) | generation: 14 bits of index, 18 bits of a
// per-slot generation that starts at a random value and advances on every
// reuse (and bind), and freed slots are reused least recently freed first,
// so a stale key comes back only after 16383 x 2^18 (about 4 * 10^9)
// registrations and a peer cannot predict a key from the ones it saw.
//
// Like a NIC, the provider never touches a region after deregistration
// returns: every access to registered memory goes through pin(), which
// holds the slot while the bytes move (one memcpy, recv or sendmsg), and
// remove() invalidates the key and then waits for the slot's pins to drop.
//
// Every lookup names who asks: `via` is the responder queue pair's serial
// for a peer's request (an rkey), 0 for local use (an lkey). A memory window
// answers only to the queue pair it is bound to (never to local use); its
// bytes are those of its parent registration, which a lookup through the
// window pins as well, so deregistering the parent cuts the window off too.
class registration_table {
 public:
  static constexpr std::uint32_t kCapacity = 1u << 14;
  static constexpr unsigned kGenerationBits = 18;

  registration_table();
  // Every generation starts at `generation` instead of a random value:
  // deterministic keys, for the fuzz target's fixed inputs only.
  explicit registration_table(std::uint32_t generation);
  std::uint32_t add(std::byte* addr, std::uint64_t length, access acc);  // 0 when full
  // A registration addressed as [iova, iova + length) whose bytes are at
  // `mapped` (a dma-buf's mapping): lookups translate. 0 when full.
  std::uint32_t add_mapped(std::uint64_t iova, std::uint64_t length, access acc, std::byte* mapped);
  // A registration of memory the CPU cannot reach, whose bytes move
  // through `copier` (register_copied): pin() says so. 0 when full.
  std::uint32_t add_copied(std::byte* addr, std::uint64_t length, access acc, memory_copier* copier);
  std::uint32_t add_window();                                            // unbound; 0 when full
  // Binds the unbound window `key` to [addr, addr+length) of registration
  // `parent` for queue pair `owner` (its serial); returns the window's new
  // key, 0 when the window or the parent is not there (or already bound).
  std::uint32_t bind(std::uint32_t key, std::uint32_t parent, std::uint64_t addr, std::uint64_t length,
                     access rights, std::uint64_t owner) noexcept;
  void remove(std::uint32_t key) noexcept;
  // The registration behind key when [addr, addr+len) lies inside it, it
  // grants `need` and answers to `via`; nullptr otherwise. Only for checks:
  // the memory may go away right after it returns. The pointer is where
  // addr's byte is (addr itself, but for a registration made by
  // add_mapped, or a window on one).
  std::byte* check(std::uint32_t key, std::uint64_t addr, std::uint64_t len, access need,
                   std::uint64_t via) const noexcept;
  // As check(), and on success the registration stays until unpin(key):
  // the caller may read or write [addr, addr+len) meanwhile.
  std::byte* pin(std::uint32_t key, std::uint64_t addr, std::uint64_t len, access need,
                 std::uint64_t via) const noexcept {
    memory_copier* copier = nullptr;
    return pin(key, addr, len, need, via, copier);
  }
  // As pin(), and `copier` is the registration's (add_copied): the bytes
  // at the pointer then move only through it (nullptr: the CPU's).
  std::byte* pin(std::uint32_t key, std::uint64_t addr, std::uint64_t len, access need, std::uint64_t via,
                 memory_copier*& copier) const noexcept;
  void unpin(std::uint32_t key) const noexcept;

 private:
  // owner: 0 for a registration (any queue pair, and local use);
  // kUnbound for a window not bound yet; else the bound queue pair.
  static constexpr std::uint64_t kUnbound = ~std::uint64_t{0};
  struct entry {
    std::atomic<std::uint32_t> key{0};
    std::atomic<std::uint64_t> addr{0};
    std::atomic<std::uint64_t> length{0};
    std::atomic<std::uint32_t> acc{0};
    std::atomic<std::uint64_t> owner{0};
    std::atomic<std::uint32_t> parent{0};  // a window's registration
    std::atomic<std::uint64_t> delta{0};   // where the bytes are, less addr (add_mapped; modulo 2^64)
    std::atomic<memory_copier*> copier{nullptr};  // add_copied's (the region holds it)
    mutable std::atomic<std::uint32_t> pins{0};
    std::uint32_t generation = 0;
  };
  static std::uint32_t index_of(std::uint32_t key) noexcept { return key >> kGenerationBits; }
  std::uint32_t take_slot(std::uint64_t addr, std::uint64_t length, access acc, std::uint64_t owner,
                          std::uint64_t delta, memory_copier* copier);
  std::byte* lookup(const entry& e, std::uint32_t key, std::uint64_t addr, std::uint64_t len, access need,
                    std::uint64_t via, std::uint32_t& parent, memory_copier*& copier) const noexcept;
  std::byte* pin_one(std::uint32_t key, std::uint64_t addr, std::uint64_t len, access need, std::uint64_t via,
                     std::uint32_t& parent, memory_copier*& copier) const noexcept;
  std::mutex mutex_;
  std::unique_ptr<entry[]> entries_;
  std::vector<std::uint32_t> free_;  // a ring of free slot indices, oldest first
  std::size_t free_head_ = 0, free_count_ = 0;
};

class tcp_mr final : public memory_region {
 public:
  tcp_mr(std::shared_ptr<registration_table> table, void* addr, std::size_t length,
         std::uint32_t key, transport::access acc) noexcept;
  ~tcp_mr() override;
  const registration_table* table() const noexcept { return table_.get(); }

 private:
  std::shared_ptr<registration_table> table_;
};

// A dma-buf registration (register_dmabuf): the buffer is mapped shared,
// and addressed as [iova, iova + length). Deregistering removes the key
// (waiting for accesses in flight) before the mapping goes.
class tcp_dmabuf_mr final : public memory_region {
 public:
  tcp_dmabuf_mr(std::shared_ptr<registration_table> table, std::uint64_t iova, std::size_t length, std::uint32_t key,
                transport::access acc, void* map, std::size_t map_length) noexcept;
  ~tcp_dmabuf_mr() override;
  const registration_table* table() const noexcept { return table_.get(); }

 private:
  std::shared_ptr<registration_table> table_;
  void* map_;
  std::size_t map_length_;
};

class tcp_window final : public memory_window {
 public:
  tcp_window(std::shared_ptr<registration_table> table, std::uint32_t key) noexcept
      : memory_window(key), table_(std::move(table)) {}
  ~tcp_window() override;
  const registration_table* table() const noexcept { return table_.get(); }
  // post_send, having checked the request: binds in the table.
  bool bind(const window_binding& b, std::uint64_t owner) noexcept;

 private:
  std::shared_ptr<registration_table> table_;
};

// A shared receive queue. Queue pairs of any completion queue's thread
// take from it, and any thread posts: a mutex guards it (held for one
// take or one post, never while bytes move). Its queue pairs keep its
// state alive (shared), so destroying it first is logged, not a crash.
class tcp_srq final : public shared_receive_queue {
 public:
  struct taken {
    std::uint64_t wr_id = 0;
    std::uint32_t num_sge = 0;
    std::array<sge, 16> sges{};
  };
  struct state {
    std::mutex mutex;
    const registration_table* table = nullptr;  // its protection domain's
    srq_attributes attr;
    std::vector<std::uint64_t> wr_ids;   // ring of max_wr
    std::vector<std::uint32_t> nsges;
    std::vector<sge> sges;               // max_sge per entry
    std::uint64_t head = 0, tail = 0;    // [head, tail) posted
    std::uint32_t limit = 0;             // armed limit; 0: none
    std::atomic<bool> limit_hit{false};
    std::atomic<std::uint32_t> users{0};  // queue pairs created with it
    // Takes the oldest receive; false when none is posted.
    bool take(taken& out) noexcept;
  };

  tcp_srq(const registration_table& table, const srq_attributes& attr);
  ~tcp_srq() override;
  std::error_code post_recv(std::span<const recv_request> wrs, std::size_t* bad) noexcept override;
  std::error_code arm_limit(std::uint32_t limit) noexcept override;
  bool limit_reached() noexcept override;
  const srq_attributes& attributes() const noexcept override { return state_->attr; }
  const std::shared_ptr<state>& shared() const noexcept { return state_; }

 private:
  std::shared_ptr<state> state_;
};

// The tcp device's capabilities (every tcp device has the same).
capabilities device_caps() noexcept;

// What a device's queue pairs share: RNR counters summed over them (any
// thread), and the faults to inject (see faults.hpp).
struct device_state {
  std::atomic<std::uint64_t> sent{0};
  std::atomic<std::uint64_t> received{0};
  std::atomic<std::uint64_t> retry_exceeded{0};
  fault_plan faults;
  std::atomic<std::uint32_t> connected{0};  // queue pairs that attached a socket, for fault_plan::qp
};

// A registration of memory the CPU cannot reach (register_copied): the
// software NIC moves its bytes through the copier, which the region holds
// until its key is gone.
class tcp_copied_mr final : public memory_region {
 public:
  tcp_copied_mr(std::shared_ptr<registration_table> table, void* addr, std::size_t length, std::uint32_t key,
                transport::access acc, std::shared_ptr<memory_copier> copier) noexcept;
  ~tcp_copied_mr() override;
  const registration_table* table() const noexcept { return table_.get(); }

 private:
  std::shared_ptr<registration_table> table_;
  std::shared_ptr<memory_copier> copier_;
};

class tcp_pd final : public protection_domain {
 public:
  explicit tcp_pd(std::shared_ptr<device_state> shared = std::make_shared<device_state>())
      : shared_(std::move(shared)) {}
  // Deterministic keys (see registration_table); for fuzzing only.
  explicit tcp_pd(std::uint32_t generation)
      : table_(std::make_shared<registration_table>(generation)), shared_(std::make_shared<device_state>()) {}
  std::unique_ptr<memory_region> register_memory(void* addr, std::size_t length, access acc) override;
  std::unique_ptr<memory_region> register_dmabuf(int fd, std::uint64_t offset, std::size_t length, std::uint64_t iova,
                                                 access acc) override;
  std::unique_ptr<memory_region> register_copied(void* addr, std::size_t length, access acc,
                                                 std::shared_ptr<memory_copier> copier) override;
  std::unique_ptr<queue_pair> create_qp(const qp_attributes& attr) override;
  std::unique_ptr<memory_window> alloc_window() override;
  std::unique_ptr<shared_receive_queue> create_srq(const srq_attributes& attr) override;

 private:
  std::shared_ptr<registration_table> table_ = std::make_shared<registration_table>();
  std::shared_ptr<device_state> shared_;
};

// What a completion queue's queue pairs need only while they move bytes: a
// receive staging buffer while bytes they read wait in it (a frame split
// across reads), a transmit batch while its frames are not all sent. A
// queue pair borrows one for a pass and gives it back at the end unless it
// still holds something, so an idle connection holds neither. The free
// list grows to the most borrowed at once and is reused: no allocation per
// pass once it has. Used only on the thread that drives the completion
// queue and its queue pairs (provider.hpp); shared with the queue pairs, so
// that one outliving its completion queue still gives back what it holds.
template <class T>
class free_stash {
 public:
  free_stash() = default;
  free_stash(const free_stash&) = delete;
  free_stash& operator=(const free_stash&) = delete;
  ~free_stash() {
    for (T* p : free_) delete p;
  }
  // nullptr when memory runs out. A new T is default-initialized: a byte
  // array stays untouched, so only the pages traffic reaches are resident.
  T* take() noexcept {
    if (!free_.empty()) {
      T* p = free_.back();
      free_.pop_back();
      return p;
    }
    // Room for every one to come back (give is noexcept), grown
    // geometrically.
    if (free_.capacity() < created_ + 1) {
      try {
        free_.reserve(std::max<std::size_t>(2 * free_.capacity(), 8));
      } catch (const std::bad_alloc&) {
        return nullptr;
      }
    }
    T* p = new (std::nothrow) T;
    if (p != nullptr) ++created_;
    return p;
  }
  // p from take(). After a burst the list shrinks again: once more than
  // twice keep = max(kKeep, 2 x those in use) wait in it, those beyond keep
  // are freed (hysteresis: a steady load frees nothing, and an oscillating
  // one frees only what it left twice over).
  void give(T* p) noexcept {
    free_.push_back(p);                        // within the capacity take() reserved
    if (free_.size() <= 2 * kKeep) return;     // (keep >= kKeep: nothing to free)
    const std::size_t in_use = created_ - free_.size();
    const std::size_t keep = std::max(kKeep, 2 * in_use);
    if (free_.size() <= 2 * keep) return;
    while (free_.size() > keep) {
      delete free_.back();
      free_.pop_back();
      --created_;
    }
  }
  static constexpr std::size_t kKeep = 16;
  std::size_t free_count() const noexcept { return free_.size(); }
  std::size_t created() const noexcept { return created_; }

 private:
  std::vector<T*> free_;  // capacity >= created_
  std::size_t created_ = 0;
};

inline constexpr std::size_t kRxStagingBytes = 64 * 1024;
// A queue pair's bounce buffers for copied memory (two each way, made on
// first use): what one copy moves at most. Large, so that a copy's fixed
// cost (a CUDA copy is started and waited for: microseconds) is spread
// over many bytes; two, so that the copy of one piece overlaps the
// network's work on the other.
inline constexpr std::size_t kCopyBounce = 512 * 1024;
using rx_staging = std::array<std::byte, kRxStagingBytes>;

// A transmit batch (tcp_qp_tx.cpp): iovecs of whole frames, what each
// points into, the headers of read-response fragments, and the keys a
// sendmsg pinned.
struct tx_batch {
  static constexpr std::size_t kMaxIov = 64;
  // Bytes one sendmsg is given at most (the rest goes with the next call,
  // in the same flush). On Linux loopback a call given more than the
  // socket's send buffer streams slower: 64 MiB of 4 MiB writes per call
  // moved 5.0-5.2 GB/s, the same in calls of at most 2 MiB 7.7-8.3 GB/s
  // (SO_SNDBUF 4 MiB; with 256 KiB and 1 MiB buffers 2 MiB did as well).
  static constexpr std::size_t kMaxSendBytes = std::size_t{2} << 20;
  // What an iovec points into.
  enum class iov_kind : std::uint8_t { plain, request_payload, read_payload, read_end };
  struct iov_ref {
    iov_kind kind = iov_kind::plain;
    bool header = false;         // the first iovec of a frame
    std::uint32_t key = 0;       // request_payload (lkey), read_payload (rkey)
    std::uint64_t resp = 0;      // read_payload, read_end: the response's ring position
    // request_payload, read_payload: the iovec's base less the registered
    // address it stands for, once pin_iov translated it (a dma-buf's
    // mapping; 0 for ordinary memory)
    std::uint64_t delta = 0;
    // The last iovec of a request: once it is all in the socket, the
    // requests before send-queue position `resp` have gone (sq_sent_).
    bool request_end = false;
  };
  std::array<iovec, kMaxIov> iov;
  std::array<iov_ref, kMaxIov> ref;
  // Every frame's header, encoded when the frame joins the batch (one per
  // header iovec, so never more than kMaxIov).
  std::array<std::array<std::byte, kHeaderSize>, kMaxIov> hdr;
  std::array<std::uint32_t, kMaxIov> pinned;  // keys pinned for the sendmsg in progress
};

// A completion queue: its ring of completions, and the progress of its
// queue pairs. Without a progress thread it is driven by one thread at a
// time (provider.hpp) and takes no lock. With one (cq_options), that
// thread waits on the queue pairs' sockets and timers (epfd_) and runs a
// progress pass whenever one is due; the queue's mutex then serializes it
// with every entry point of the queue and of its queue pairs (guard()),
// and the owner's notify fd is the eventfd alone, as a NIC's completion
// channel: it wakes for completions, the thread for input.
class tcp_cq final : public completion_queue {
 public:
  explicit tcp_cq(std::uint32_t depth, const cq_options& options = {});
  ~tcp_cq() override;

  std::size_t poll(std::span<completion> out, std::error_code& ec) noexcept override;
  std::error_code arm() noexcept override;
  int notify_fd() const noexcept override { return threaded_ ? evfd_ : epfd_; }
  // (With the thread the owner need not poll for the peers' sake.)
  bool progress_in_poll() const noexcept override { return !threaded_; }
  // (arm() signals for what is queued and for what a pass left; input that
  // arrives later, and the timer, make epfd_ readable then; the thread's
  // pass signals what it makes.)
  bool arm_reports_queued() const noexcept override { return true; }
  std::size_t ack_events() noexcept override;
  std::uint32_t depth() const noexcept override { return depth_; }
  cq_counters counters() const noexcept override {
    const auto lock = guard();
    return counters_;
  }

  // Holds the queue's mutex when it has a progress thread (empty, and no
  // cost but a test, when it has not). Every entry point of the queue and
  // of its queue pairs takes it; nothing called under it takes it again.
  std::unique_lock<std::mutex> guard() const noexcept {
    if (!threaded_) return std::unique_lock<std::mutex>();
    std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    if (lock.owns_lock()) return lock;
    // (counted while it waits: the thread lets it in between passes it
    // runs back to back)
    owner_waiting_.fetch_add(1, std::memory_order_relaxed);
    lock.lock();
    owner_waiting_.fetch_sub(1, std::memory_order_relaxed);
    return lock;
  }
  bool threaded() const noexcept { return threaded_; }
  // Progress passes the thread ran (for tests).
  std::uint64_t thread_passes() const noexcept { return thread_passes_.load(std::memory_order_relaxed); }

  // For queue pairs.
  void push(const completion& c) noexcept;
  // wrs: the work requests the queue pair can have outstanding on this CQ.
  void attach(tcp_qp* qp, std::uint32_t wrs);
  void detach(tcp_qp* qp, std::uint32_t wrs) noexcept;
  // want_read false: the queue pair does not read now (its response ring
  // is full), so its socket must not keep a sleeping consumer awake.
  void watch(int fd, tcp_qp* qp, bool want_write, bool want_read = true) noexcept;
  void unwatch(int fd) noexcept;
  void schedule(std::chrono::steady_clock::time_point when) noexcept;
  // A queue pair left work epoll cannot report, or would report to an
  // edge-triggered watcher only with its next input (has_pending_work): the
  // next pass progresses it. With many queue pairs a pass visits only these and
  // those epoll names, never all of them. `noted` is the queue pair's flag
  // for this queue (set while it is listed).
  void note_pending(tcp_qp* qp, bool& noted) noexcept;
  void progress() noexcept;
  // The consumer armed the queue and may sleep until it notifies.
  bool armed() const noexcept { return armed_; }
  // Whether a pass may hold a lone acknowledgement back for the owner's
  // next request to carry: not once the owner armed (it sleeps), and not
  // in the thread's pass unless the owner polled just before (a busy owner
  // is not about to send).
  bool holds_lone_acks() const noexcept { return !armed_ && (!in_thread_pass_ || owner_recent_); }
  // Whether a pass leaves alone a lone acknowledgement an earlier pass held
  // back: the thread's pass while the owner polls (its own next pass, or
  // its reply, sends it). Any other pass sends it first.
  bool defers_held_acks() const noexcept { return in_thread_pass_ && holds_lone_acks(); }
  // A thread's pass held a lone acknowledgement back (for tests: it does
  // not for an owner that is not polling).
  void note_thread_hold() noexcept { thread_holds_ += in_thread_pass_ ? 1 : 0; }
  std::uint64_t thread_holds() const noexcept {
    const auto lock = guard();
    return thread_holds_;
  }
  // Makes the notify fd readable (any thread): a queue pair that went live
  // after the reactor's last poll must not wait for data that already came
  // (not with a progress thread: its epoll reports that data itself).
  void signal() noexcept;
  const std::shared_ptr<free_stash<rx_staging>>& staging_pool() const noexcept { return staging_; }
  const std::shared_ptr<free_stash<tx_batch>>& batch_pool() const noexcept { return batches_; }

 private:
  std::shared_ptr<free_stash<rx_staging>> staging_ = std::make_shared<free_stash<rx_staging>>();
  std::shared_ptr<free_stash<tx_batch>> batches_ = std::make_shared<free_stash<tx_batch>>();

  // depth_ slots, not rounded up to a power of two: that would double the
  // ring (a fabric asks for max_connections * send_queue + receives) for
  // the division it saves, which the wrapped indices here save as well.
  std::uint32_t depth_;
  std::vector<completion> ring_;
  std::uint32_t ring_head_ = 0;  // slot of the oldest
  std::uint32_t ring_tail_ = 0;  // slot of the next
  std::uint32_t ring_used_ = 0;
  bool armed_ = false;
  bool overflow_ = false;
  bool epoll_full_ = false;  // the last pass's epoll_wait returned as many events as it could take
  const bool owner_rearms_;    // cq_options::owner_rearms
  bool in_owner_poll_ = false;  // the pass of an owner's poll that returns what it completes (owner_rearms_)
  // evfd_ has a count that ack_events has not read: set by signal() (from
  // any thread) after its write, so that ack_events, which the reactor
  // calls at every wake-up, reads evfd_ only when it was signalled (the
  // usual wake-up without a progress thread is a socket's, not evfd_'s).
  std::atomic<bool> signalled_{false};
  int epfd_ = -1;
  int evfd_ = -1;
  int timerfd_ = -1;
  std::chrono::steady_clock::time_point timer_at_{};
  bool timer_set_ = false;
  std::vector<tcp_qp*> qps_;
  std::vector<tcp_qp*> pending_, pending_pass_;  // noted; the pass's (capacity: qps_.size())
  std::uint64_t wrs_ = 0;  // work requests of the queue pairs on it
  cq_counters counters_;

  // The progress thread's loop: wait (epfd_, or the held-back ACKs' delay),
  // then a pass under the mutex, until stop.
  void run_progress() noexcept;
  // What the thread's next wait may last (ns; -1: until an event).
  std::int64_t next_wait_ns() const noexcept;
  // The thread's pass after a timed wait that saw no event: only the
  // queue pairs that left work (a held acknowledgement) move.
  void progress_pending() noexcept;
  void close_fds() noexcept;
  const bool threaded_;
  mutable std::mutex mutex_;
  mutable std::atomic<std::uint32_t> owner_waiting_{0};  // entry points waiting for mutex_
  std::int64_t owner_poll_ns_ = 0;  // (steady clock) the owner's last poll, with the thread
  bool in_thread_pass_ = false;     // the thread's pass runs (under mutex_)
  bool owner_recent_ = false;       // and the owner polled just before it
  std::uint64_t thread_holds_ = 0;  // lone ACKs its passes held back (note_thread_hold)
  // With the thread: an eventfd in epfd_, written to stop it or to end a
  // wait without limit (kick_thread).
  int wakefd_ = -1;
  std::atomic<bool> stopping_{false};
  bool thread_waits_ = true;  // the thread waits for an event only, as it starts (under mutex_)
  // An owner's pass left work the thread must time (next_wait_ns): a
  // thread waiting for an event only is woken to time it.
  void kick_thread() noexcept;
  std::atomic<std::uint64_t> thread_passes_{0};
  std::thread thread_;  // (last: it starts once everything above is made)
};

// A queue pair. See tcp_qp.cpp for the engine (tcp_qp_tx.cpp and
// tcp_qp_rx.cpp hold its transmitter and receiver).
class tcp_qp final : public queue_pair {
 public:
  tcp_qp(const registration_table& table, const qp_attributes& attr,
         std::shared_ptr<device_state> shared = std::make_shared<device_state>());
  ~tcp_qp() override;

  std::uint32_t qp_num() const noexcept override { return qpn_; }
  qp_state state() const noexcept override {
    const auto lock = guard();
    return state_;
  }
  std::error_code modify(qp_state next) noexcept override;
  std::error_code post_send(std::span<const work_request> wrs, std::size_t* bad) noexcept override;
  std::error_code post_recv(std::span<const recv_request> wrs, std::size_t* bad) noexcept override;
  std::error_code set_remote_access(access acc) noexcept override;
  const qp_attributes& attributes() const noexcept override { return attr_; }
  qp_counters counters() const noexcept override {
    const auto lock = guard();
    return counters_;
  }
  path_info path() const noexcept override {
    const auto lock = guard();
    return path_;
  }
  // Payload bytes that reached registered memory through the staging
  // buffer (a copy more than a read straight into it): for tests.
  std::uint64_t payload_via_staging() const noexcept {
    const auto lock = guard();
    return payload_via_staging_;
  }
  // The most bytes one sendmsg was given (at most tx_batch::kMaxSendBytes): for tests.
  std::size_t largest_send() const noexcept {
    const auto lock = guard();
    return largest_send_;
  }

  // Connection manager: adopt a connected socket; moves the QP to rts.
  std::error_code attach_socket(int fd, std::uint32_t peer_max_send_wr) noexcept;
  bool can_connect() const noexcept {
    const auto lock = guard();
    return connectable();
  }

  // Its completion queue's guard (tcp_cq::guard; a queue pair of a
  // threaded queue has it as both its queues). Taken by every entry point
  // above; the completion queue holds it while it drives those below.
  std::unique_lock<std::mutex> guard() const noexcept {
    const auto* cq = static_cast<const tcp_cq*>(attr_.send_cq);
    return cq != nullptr ? cq->guard() : std::unique_lock<std::mutex>();
  }

  // Completion queues drive these.
  void progress() noexcept;                 // read and write what the socket allows
  void flush_acks() noexcept;               // send acknowledgements held back by progress()
  void on_events(std::uint32_t events) noexcept;
  void on_timer(std::chrono::steady_clock::time_point now) noexcept;
  void on_cq_overflow() noexcept;
  void forget_cq(const tcp_cq* cq) noexcept;
  // Its flag in cq's pending list (see tcp_cq::note_pending).
  bool& noted_on(const tcp_cq* cq) noexcept { return cq == attr_.send_cq ? noted_send_ : noted_recv_; }
  // Connected and published to the completion queues (see attach_socket).
  bool wants_progress() const noexcept { return live_.load(std::memory_order_acquire); }
  // Work epoll cannot report: input already read but not yet processed (a
  // progress call handles a bounded number of frames), or an acknowledgement
  // held back by the previous pass; or can report only level-triggered:
  // input a pass stopped at its frame cap may have left in the socket.
  bool has_pending_work() const noexcept {
    return has_pending_input() || (wants_progress() && resp_queued_ < resp_tail_ && iov_pos_ == iov_count_);
  }
  // The first half of has_pending_work: input read but not processed, or
  // possibly left in the socket at the frame cap (rx_more_).
  bool has_pending_input() const noexcept {
    if (!wants_progress()) return false;
    // (Not while reading is paused for a full response ring: the ring's
    // draining, an EPOLLOUT event, resumes it; listing it would keep a
    // reactor that wants to sleep awake.)
    const bool input = phase_ == rx_phase::header ? rx_end_ - rx_begin_ >= kHeaderSize : rx_begin_ < rx_end_;
    return (input || rx_more_) && !rx_stalled_ && !rx_paused_;
  }

 private:
  using clock = std::chrono::steady_clock;
  using clock_point = clock::time_point;
  std::error_code post_send_locked(std::span<const work_request> wrs, std::size_t* bad) noexcept;
  bool connectable() const noexcept { return (state_ == qp_state::reset || state_ == qp_state::init) && fd_ < 0; }
  // What a send queue slot keeps of its work request (a bind takes effect
  // at post: its window_binding is not kept).
  struct posted_request {
    std::uint64_t wr_id = 0;
    std::span<const sge> sg_list{};  // points into the slot's sq_sges_ (empty with inline_data)
    std::uint64_t remote_addr = 0;
    std::uint64_t compare_add = 0;
    std::uint64_t swap = 0;
    std::uint32_t imm = 0;
    std::uint32_t rkey = 0;
    opcode op = opcode::send;
    bool signaled = true;
    bool inline_data = false;
    posted_request& operator=(const work_request& w) noexcept {
      wr_id = w.wr_id;
      sg_list = w.sg_list;
      remote_addr = w.remote_addr;
      compare_add = w.compare_add;
      swap = w.swap;
      imm = w.imm;
      rkey = w.rkey;
      op = w.op;
      signaled = w.signaled;
      inline_data = w.inline_data;
      return *this;
    }
  };
  struct sq_entry {
    posted_request wr;
    std::uint32_t psn = 0;
    std::uint32_t length = 0;      // total payload / read length
    wc_status local_error = wc_status::success;
  };
  struct rq_entry {
    std::uint64_t wr_id = 0;
    std::uint32_t num_sge = 0;
  };
  // A response to a peer's request. A read's data leaves in fragments of
  // at most kReadFragment bytes, then a zero-length frame flagged last: the
  // source is looked up (pinned) again for every sendmsg, and a source
  // deregistered meanwhile ends the response with a NAK instead.
  // What a response's header needs (encoded when it joins a batch).
  struct response_header {
    frame_type type{};
    std::uint32_t psn = 0;
    std::uint32_t imm = 0;           // nak: the code
    std::uint64_t compare_add = 0;   // atomic response: the value before
    response_header& operator=(const frame_header& f) noexcept {
      type = f.type;
      psn = f.psn;
      imm = f.imm;
      compare_add = f.compare_add;
      return *this;
    }
    frame_header frame() const noexcept {
      frame_header f;
      f.type = type;
      f.psn = psn;
      f.imm = imm;
      f.compare_add = compare_add;
      return f;
    }
  };
  // (48 bytes: every queue pair has a ring of 2 x the peer's send queue +
  // 8 of them, all touched, so this is much of the memory per connection.)
  struct response {
    response_header h;           // ack, nak, atomic response; reads: type and psn
    std::uint32_t key = 0;       // read: the source's rkey
    bool poisoned = false;       // read: the source went away
    std::uint64_t addr = 0;      // read: next byte to frame
    std::uint32_t left = 0;      // read: bytes not framed yet (a read is at most kMaxPayload)
    std::uint32_t offset = 0;    // read: offset of the next fragment
  };
  static_assert(sizeof(response) <= 48);
  static_assert(kMaxPayload <= UINT32_MAX);
  // Where an inbound payload goes: registered memory, looked up (pinned)
  // again for every piece that moves, so that a region deregistered while
  // its payload trickles in is never written after deregistration.
  struct segment {
    std::uint32_t key = 0;       // 0: discard
    access need = access::none;
    std::uint64_t addr = 0;
    std::uint64_t len = 0;
  };
  using iov_kind = tx_batch::iov_kind;
  using iov_ref = tx_batch::iov_ref;
  static constexpr std::size_t kMaxIov = tx_batch::kMaxIov;
  enum class rx_phase : std::uint8_t { header, payload };
  enum class after_payload : std::uint8_t {
    none, ack_only, recv_done, write_imm_done, read_fragment, read_done
  };

  // sending
  void flush() noexcept;
  // Requests may be framed now (no RNR wait, rewind, blocked head or
  // fatal NAK in the way); fill_iov and send_solo ask the same.
  bool may_send_requests() const noexcept {
    return state_ == qp_state::rts && !rnr_waiting_ && !rewind_pending_ && !tx_blocked_ && !fatal_pending_;
  }
  // The batch's cursor back to its start: a new batch, or none.
  void restart_batch() noexcept {
    iov_count_ = iov_pos_ = 0;
    tx_pins_ = false;
    held_iov_ = next_iov_ = kNoBounce;  // its iovecs are other bytes
  }
  bool fill_iov() noexcept;
  bool fill_requests(std::optional<std::uint32_t>& ack) noexcept;
  void add_ack_frame(std::uint32_t psn) noexcept;  // an ACK of its own (room checked)
  // The one request post_send just queued, sent at once when nothing else
  // waits to go (see send_solo); false: flush() must do it.
  bool send_solo() noexcept;

 public:
  // (tests) send_solo's sendmsg calls that sent part of their frame only
  std::uint32_t solo_partial_sends() const noexcept { return solo_partial_; }

 private:
  // `ack`: the header carries it (kFlagAck)
  void encode_request_header(const sq_entry& e, std::span<std::byte, kHeaderSize> out,
                             std::optional<std::uint32_t> ack = std::nullopt) const noexcept;
  std::span<std::byte, kHeaderSize> batch_header() noexcept { return tx_->hdr[hdr_used_++]; }
  void queue_response(const frame_header& h) noexcept;
  void queue_read_response(const frame_header& request) noexcept;
  void add_iov(const void* p, std::size_t n, iov_ref ref) noexcept;
  void add_header(const void* p, iov_ref ref) noexcept;
  void add_header(const void* p) noexcept;
  void mark_request_end(std::uint64_t next) noexcept;  // the last iovec added
  bool fill_read(response& r, std::uint64_t pos) noexcept;  // false: the batch is full
  bool pin_iov() noexcept;  // false: the stream must be cut
  // Copies up to kCopyBounce bytes of iovec i (copied memory at registered
  // address addr, pinned at p under key) into tx_bounce_ (or finds them
  // there, or in tx_next_) and points it there, and starts the copy of
  // the iovec's next piece into tx_next_; false when the copier fails.
  // true with `keep`: a copy was started, and the registration stays
  // pinned until it is settled (settle_tx_copy, by unpin_iov).
  bool bounce(std::size_t i, std::uint64_t addr, const std::byte* p, memory_copier& copier, bool& keep) noexcept;
  void settle_tx_copy() noexcept;
  void unbounce() noexcept;  // after the sendmsg: the bounced iovec as it was, less what went
  void unpin_iov() noexcept;
  void poison_read(std::uint64_t pos) noexcept;
  bool iov_holds_requests() const noexcept;
  // fault injection (faults_ set): applied to each new transmit batch
  void inject_tx_faults() noexcept;
  bool tx_held(clock_point now) noexcept;  // delay: not yet
  void begin_rx_stall() noexcept;
  void check_fatal() noexcept;
  void update_interest() noexcept {  // (inline: called on every flush, rarely with a change)
    if (fd_ < 0) return;
    // A batch held back by an injected delay waits for the timer, not for room.
    const bool want = iov_pos_ < iov_count_ && !(faults_ != nullptr && tx_hold_until_ != clock_point{});
    const bool read = !rx_paused_ && !rx_stalled_;
    if (want != want_write_ || read != want_read_) watch(want, read);
  }
  void watch(bool write, bool read) noexcept;
  bool only_ack_pending() const noexcept;
  // Nothing to frame or send, and nothing else flush_batch would act on:
  // a progress pass skips it (an idle poll is then a recv and little more).
  bool tx_idle() const noexcept {
    return tx_ == nullptr && resp_head_ == resp_tail_ && sq_tx_ == sq_tail_ && !rx_paused_ && !cut_pending_ &&
           !rewind_pending_ && !close_when_flushed_;
  }
  // receiving
  void receive() noexcept;
  void discard_input() noexcept;
  bool handle_header(const frame_header& h) noexcept;
  void finish_payload() noexcept;
  bool handle_request(const frame_header& h) noexcept;
  bool handle_response(const frame_header& h) noexcept;
  bool take_recv(std::uint32_t length, bool& rnr) noexcept;
  void nak(std::uint32_t psn, nak_code code, bool fatal) noexcept;
  void lose_payload() noexcept;
  bool rnr_nak(std::uint32_t psn) noexcept;
  bool read_segments(const sq_entry& head, std::uint64_t bytes) noexcept;
  void complete_head(wc_status status, std::uint32_t byte_len) noexcept;
  void check_local_error() noexcept;
  // errors
  void protocol_error(std::string_view why) noexcept;
  void peer_gone(std::string_view why) noexcept;
  void enter_error(wc_status head_status) noexcept;
  void close_socket() noexcept;
  void reset_stream() noexcept;
  void push_send(const completion& c) noexcept;
  void push_recv(const completion& c) noexcept;
  void flush_filling_receive() noexcept;  // the receive a message was filling (after_): flushed
  // Who a registration lookup is for: a peer's request (remote rights
  // needed) through this queue pair, else local use.
  std::uint64_t via(access need) const noexcept {
    return (need & remote_access_bits) != access::none ? serial_ : 0;
  }
  sge* sges_of(std::uint64_t idx) noexcept { return &sq_sges_[ring_slot(idx, attr_.max_send_wr) * sq_stride_]; }
  sge* rq_sges_of(std::uint64_t idx) noexcept { return &rq_sges_[ring_slot(idx, attr_.max_recv_wr) * attr_.max_recv_sge]; }

  const registration_table& table_;
  qp_attributes attr_;
  std::uint32_t qpn_;
  // Names this queue pair in registration lookups (memory windows bound to
  // it); unique for the process's life, never 0.
  std::uint64_t serial_;
  qp_state state_ = qp_state::reset;
  int fd_ = -1;
  // Set last by attach_socket, which may run on a connecting thread while
  // the completion queue's thread polls: the CQ side touches nothing else of
  // this queue pair until it reads true here.
  std::atomic<bool> live_{false};
  bool close_when_flushed_ = false;
  bool noted_send_ = false, noted_recv_ = false;  // listed in the completion queues' pending lists
  qp_counters counters_;
  std::shared_ptr<device_state> shared_;  // the device's
  path_info path_;                      // the socket's addresses, from attach_socket

  // send queue: [head_, ack_) acknowledged but not yet retired (unsignaled),
  // [ack_, tx_) sent, [tx_, tail_) posted; indices grow without wrapping.
  std::vector<sq_entry> sq_;
  // A send queue slot's gather list, or (like a NIC's WQE) its inline
  // bytes (then its posted_request has no gather list): sq_stride_ sges per
  // slot hold either.
  std::vector<sge> sq_sges_;
  std::size_t sq_stride_ = 0;
  std::uint64_t sq_head_ = 0, sq_ack_ = 0, sq_tx_ = 0, sq_tail_ = 0;
  // The requests before it are all in the socket (sq_ack_ <= sq_sent_ <=
  // sq_tx_: framed into the batch is not sent). A response answers only
  // these: the peer cannot have seen the others, and an ACK for one would
  // complete it while its memory is still to be read for sending.
  std::uint64_t sq_sent_ = 0;
  std::uint32_t next_psn_ = 1;
  std::uint8_t rnr_left_ = 7;
  bool rnr_waiting_ = false;
  bool rewind_pending_ = false;
  bool tx_blocked_ = false;  // a request with a local error waits at the head of the sent queue
  std::uint64_t rewind_to_ = 0;
  std::chrono::steady_clock::time_point rnr_until_{};

  // receive queue (unused with a shared receive queue: srq_ then)
  std::shared_ptr<tcp_srq::state> srq_;
  tcp_srq::taken srq_taken_;  // the shared receive this queue pair is filling
  std::vector<rq_entry> rq_;
  std::vector<sge> rq_sges_;
  std::uint64_t rq_head_ = 0, rq_tail_ = 0;

  // responder
  std::uint32_t expected_psn_ = 1;
  bool rnr_discard_ = false;  // after an RNR NAK: drop requests until expected_psn_ comes again
  std::vector<response> resp_;
  std::uint64_t resp_head_ = 0, resp_queued_ = 0, resp_tail_ = 0;  // [head, queued) in iov_
  bool fatal_pending_ = false;  // a NAK that ends a read response is queued: error once it is out
  bool rx_paused_ = false;      // the response ring is full: the socket is not read until it drains
  bool rx_more_ = false;        // the last pass stopped at its frame cap, the socket not seen empty
  std::uint32_t rd_atomic_out_ = 0;  // reads and atomics sent and not yet answered

  // transmit: the batch (borrowed from the send completion queue's pool by
  // flush, and kept only while [iov_pos_, iov_count_) is not empty), its
  // iovecs of whole frames; [iov_pos_, iov_count_) still to send
  std::shared_ptr<free_stash<tx_batch>> batches_;
  tx_batch* tx_ = nullptr;
  void flush_batch() noexcept;
  std::size_t hdr_used_ = 0;  // of tx_->hdr
  std::size_t npinned_ = 0;
  std::size_t iov_count_ = 0, iov_pos_ = 0;
  // pin_iov pinned [iov_pos_, iov_end_) for the sendmsg in progress, which
  // sends what of it fits tx_batch::kMaxSendBytes (the last iovec cut short)
  std::size_t iov_end_ = 0;
  std::size_t largest_send_ = 0;
  // Copied memory (register_copied) goes out through tx_bounce_, one piece
  // per sendmsg: the iovec bounced_ then points at bounced_base_, for
  // bounced_len_ of its bounced_full_ bytes at registered address
  // bounced_addr_, and is put back after the sendmsg (unbounce) with what
  // it did not send. The bounce holds held_len_ bytes of iovec held_iov_
  // of this batch from registered address held_addr_ until they are sent
  // (a sendmsg that sends less, or nothing, does not copy them again).
  // (the copier's bounce_buffer: page-locked for CUDA; kCopyBounce bytes)
  // tx_next_ holds (or, while next_pending_, is being filled with, by
  // next_copier_) next_len_ bytes of iovec next_iov_ from registered
  // address next_addr_: the piece after the held one, copied out while the
  // held one is sent.
  std::shared_ptr<std::byte> tx_bounce_, tx_next_;
  std::size_t next_iov_ = ~std::size_t{0};
  std::uint64_t next_addr_ = 0;
  std::size_t next_len_ = 0;
  bool next_pending_ = false;
  memory_copier* next_copier_ = nullptr;
  static constexpr std::size_t kNoBounce = ~std::size_t{0};
  std::size_t bounced_ = kNoBounce;
  std::uint64_t bounced_addr_ = 0;
  std::byte* bounced_base_ = nullptr;
  std::size_t bounced_len_ = 0, bounced_full_ = 0;
  std::size_t held_iov_ = kNoBounce;
  std::uint64_t held_addr_ = 0;
  std::size_t held_len_ = 0;
  bool want_write_ = false;
  bool want_read_ = true;
  // The batch has iovecs into registered memory (else pin_iov has nothing to do)
  bool tx_pins_ = false;
  // send_solo's sendmsg calls that sent part of a frame only (the rest
  // then went through a batch). (Members are placed so that none adds
  // padding: a queue pair's size is memory per idle connection.)
  std::uint32_t solo_partial_ = 0;

  // receive: staging buffer (kRxStagingBytes, borrowed from the send
  // completion queue's pool for a receive pass and kept only while
  // [rx_begin_, rx_end_) holds bytes) and the current frame
  struct staging {
    std::shared_ptr<free_stash<rx_staging>> pool;
    rx_staging* bytes = nullptr;
    std::byte* data() const noexcept { return bytes->data(); }
    static constexpr std::size_t size() noexcept { return kRxStagingBytes; }
  };
  bool borrow_staging() noexcept {  // false: out of memory (the queue pair fails)
    return rx_buf_.bytes != nullptr || borrow_staging_slow();
  }
  bool borrow_staging_slow() noexcept;
  void return_staging() noexcept {  // when it holds no bytes
    if (rx_buf_.bytes == nullptr || rx_begin_ != rx_end_) return;
    rx_buf_.pool->give(std::exchange(rx_buf_.bytes, nullptr));
    rx_begin_ = rx_end_ = 0;
  }
  void receive_frames() noexcept;
  staging rx_buf_;
  std::size_t rx_begin_ = 0, rx_end_ = 0;
  // The last frame's payload was large: a header read (when the read that
  // ended the payload did not bring all of the next header) asks for the
  // header alone, so that the large payload likely to follow goes straight
  // to its destination instead of through the staging buffer (one copy,
  // not two).
  bool rx_header_only_ = false;
  std::uint64_t payload_via_staging_ = 0;
  // Large pieces of payload bound for copied memory are read into
  // rx_bounce_ (the copier's bounce_buffer, kCopyBounce bytes), which
  // holds rx_bounce_fill_ bytes for [rx_bounce_addr_, + fill) of
  // registration rx_bounce_key_ (the current segment's, contiguous up to
  // its addr); they go into place in one copy when it is full, or the
  // segment or payload ends (flush_rx_bounce).
  // A full bounce whose segment goes on is copied while rx_spare_ fills:
  // rx_copy_pending_ until settle_rx_copy, its destination pinned
  // (rx_copy_key_) meanwhile; the copy that ends a segment is waited for
  // at once, so a frame's bytes are all in place before it completes.
  std::shared_ptr<std::byte> rx_bounce_, rx_spare_;
  std::size_t rx_bounce_fill_ = 0;
  std::uint32_t rx_bounce_key_ = 0;
  access rx_bounce_need_{};
  std::uint64_t rx_bounce_addr_ = 0;
  bool rx_copy_pending_ = false;
  std::uint32_t rx_copy_key_ = 0;
  memory_copier* rx_copy_copier_ = nullptr;
  bool flush_rx_bounce(bool last) noexcept;  // false: the payload is lost (lose_payload)
  bool settle_rx_copy() noexcept;            // false: the started copy failed
  rx_phase phase_ = rx_phase::header;
  frame_header cur_{};
  std::array<segment, 16> seg_{};
  std::size_t seg_count_ = 0, seg_index_ = 0;
  std::uint64_t payload_left_ = 0;
  after_payload after_ = after_payload::none;
  bool payload_lost_ = false;    // a destination went away: the rest of the payload was dropped
  std::uint64_t recv_wr_id_ = 0;
  // the read at the head of the send queue: bytes placed, and where the next go
  std::uint64_t rd_done_ = 0;
  std::size_t rd_sge_ = 0;
  std::uint64_t rd_off_ = 0;

  // fault injection: the device's plan when it applies to this queue pair
  const fault_plan* faults_ = nullptr;
  std::uint64_t post_calls_ = 0;  // post_send calls of 2+ requests since the connection (fault_plan::post_fail)
  std::uint64_t frames_sent_ = 0, frames_received_ = 0;
  bool cut_pending_ = false;     // the batch ends at the cut: close once it is out
  bool rx_stalled_ = false;      // stop_reading: the socket is not read
  bool rx_stall_done_ = false;
  clock_point tx_hold_until_{}, rx_stall_until_{};
  std::array<std::byte, kHeaderSize> corrupt_hdr_{};
};

}  // namespace anydoor::transport::tcp
