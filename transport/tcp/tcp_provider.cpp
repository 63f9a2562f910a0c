// The tcp provider's registrations, completion queue and device; its
// connection manager is in tcp_cm.cpp, its queue pair in tcp_qp*.cpp.
#include "tcp/tcp_provider.hpp"

#include <anydoor/error.hpp>

#include "contract_checks.hpp"
#include "log.hpp"
#include "tcp/tcp_device.hpp"

#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/eventfd.h>
#include <poll.h>
#include <pthread.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <system_error>
#include <thread>

namespace anydoor::transport::tcp {

// ---------------------------------------------------------------- registrations

registration_table::registration_table() : registration_table(0) {
  std::random_device rd;
  std::mt19937 rng(rd());
  constexpr std::uint32_t mask = (1u << kGenerationBits) - 1;
  for (std::uint32_t i = 1; i < kCapacity; ++i) entries_[i].generation = static_cast<std::uint32_t>(rng()) & mask;
}

registration_table::registration_table(std::uint32_t generation)
    : entries_(new entry[kCapacity]), free_(kCapacity - 1) {
  for (std::uint32_t i = 1; i < kCapacity; ++i) {
    entries_[i].generation = generation & ((1u << kGenerationBits) - 1);
    free_[i - 1] = i;
  }
  free_count_ = kCapacity - 1;
}

std::uint32_t registration_table::take_slot(std::uint64_t addr, std::uint64_t length, access acc, std::uint64_t owner,
                                            std::uint64_t delta, memory_copier* copier) {
  std::lock_guard lock(mutex_);
  if (free_count_ == 0) return 0;
  const std::uint32_t index = free_[free_head_];
  free_head_ = (free_head_ + 1) % free_.size();
  --free_count_;
  entry& e = entries_[index];
  constexpr std::uint32_t mask = (1u << kGenerationBits) - 1;
  e.generation = (e.generation + 1) & mask;
  const std::uint32_t key = (index << kGenerationBits) | e.generation;  // never 0: index >= 1
  // Release stores after remove()'s key 0: see bind().
  e.addr.store(addr, std::memory_order_release);
  e.length.store(length, std::memory_order_release);
  e.acc.store(static_cast<std::uint32_t>(acc), std::memory_order_release);
  e.owner.store(owner, std::memory_order_release);
  e.parent.store(0, std::memory_order_release);
  e.delta.store(delta, std::memory_order_release);
  e.copier.store(copier, std::memory_order_release);
  e.key.store(key, std::memory_order_release);
  return key;
}

std::uint32_t registration_table::add(std::byte* addr, std::uint64_t length, access acc) {
  return take_slot(reinterpret_cast<std::uint64_t>(addr), length, acc, 0, 0, nullptr);
}

std::uint32_t registration_table::add_copied(std::byte* addr, std::uint64_t length, access acc, memory_copier* copier) {
  return take_slot(reinterpret_cast<std::uint64_t>(addr), length, acc, 0, 0, copier);
}

std::uint32_t registration_table::add_mapped(std::uint64_t iova, std::uint64_t length, access acc, std::byte* mapped) {
  return take_slot(iova, length, acc, 0, reinterpret_cast<std::uint64_t>(mapped) - iova, nullptr);
}

std::uint32_t registration_table::add_window() { return take_slot(0, 0, access::none, kUnbound, 0, nullptr); }

std::uint32_t registration_table::bind(std::uint32_t key, std::uint32_t parent, std::uint64_t addr,
                                       std::uint64_t length, access rights, std::uint64_t owner) noexcept {
  std::lock_guard lock(mutex_);
  const std::uint32_t index = index_of(key);
  const std::uint32_t pindex = index_of(parent);
  if (index == 0 || index >= kCapacity || pindex == 0 || pindex >= kCapacity || owner == 0 || owner == kUnbound) {
    return 0;
  }
  entry& e = entries_[index];
  const entry& p = entries_[pindex];
  if (e.key.load(std::memory_order_relaxed) != key || e.owner.load(std::memory_order_relaxed) != kUnbound) return 0;
  if (p.key.load(std::memory_order_relaxed) != parent || p.owner.load(std::memory_order_relaxed) != 0) return 0;
  // Nothing can use the unbound key (its owner matches no lookup), so the
  // fields may change before the new key is published.
  constexpr std::uint32_t mask = (1u << kGenerationBits) - 1;
  e.generation = (e.generation + 1) & mask;
  const std::uint32_t bound = (index << kGenerationBits) | e.generation;
  e.key.store(0, std::memory_order_seq_cst);
  // Release stores: a lookup that reads any of them (acquire) sees key 0 or
  // the new key on its re-check, never the unbound one (as in a seqlock).
  e.addr.store(addr, std::memory_order_release);
  e.length.store(length, std::memory_order_release);
  e.acc.store(static_cast<std::uint32_t>(rights & remote_access_bits), std::memory_order_release);
  e.parent.store(parent, std::memory_order_release);
  e.delta.store(p.delta.load(std::memory_order_relaxed), std::memory_order_release);  // the parent's bytes
  e.copier.store(p.copier.load(std::memory_order_relaxed), std::memory_order_release);
  e.owner.store(owner, std::memory_order_release);
  e.key.store(bound, std::memory_order_release);
  return bound;
}

void registration_table::remove(std::uint32_t key) noexcept {
  std::lock_guard lock(mutex_);
  const std::uint32_t index = index_of(key);
  if (index == 0 || index >= kCapacity) return;
  entry& e = entries_[index];
  if (e.key.load(std::memory_order_relaxed) != key) return;
  // Invalidate first, then wait for the accesses that pinned the slot
  // before (each is one memcpy, recv or sendmsg). seq_cst on both sides:
  // either pin() sees the cleared key or this sees its pin.
  e.key.store(0, std::memory_order_seq_cst);
  for (unsigned spins = 0; e.pins.load(std::memory_order_seq_cst) != 0; ++spins) {
    if (spins > 64) std::this_thread::yield();
  }
  free_[(free_head_ + free_count_) % free_.size()] = index;
  ++free_count_;
}

std::byte* registration_table::lookup(const entry& e, std::uint32_t key, std::uint64_t addr, std::uint64_t len,
                                      access need, std::uint64_t via, std::uint32_t& parent,
                                      memory_copier*& copier) const noexcept {
  // Acquire loads (plain loads on x86), so that the re-check below comes
  // after them: fields of a later registration or bind of the slot go with
  // a changed key (the stores are release, after the key is cleared).
  const std::uint64_t base = e.addr.load(std::memory_order_acquire);
  const std::uint64_t length = e.length.load(std::memory_order_acquire);
  const auto acc = static_cast<access>(e.acc.load(std::memory_order_acquire));
  const std::uint64_t owner = e.owner.load(std::memory_order_acquire);
  parent = e.parent.load(std::memory_order_acquire);
  const std::uint64_t delta = e.delta.load(std::memory_order_acquire);
  copier = e.copier.load(std::memory_order_acquire);
  if (e.key.load(std::memory_order_acquire) != key) return nullptr;
  if (owner != 0 && (via == 0 || owner != via)) return nullptr;  // a window: its queue pair only
  if (!has(acc, need)) return nullptr;
  if (addr < base || len > length || addr - base > length - len) return nullptr;
  return reinterpret_cast<std::byte*>(addr + delta);
}

std::byte* registration_table::check(std::uint32_t key, std::uint64_t addr, std::uint64_t len, access need,
                                     std::uint64_t via) const noexcept {
  const std::uint32_t index = index_of(key);
  if (index == 0 || index >= kCapacity) return nullptr;
  const entry& e = entries_[index];
  if (e.key.load(std::memory_order_acquire) != key) return nullptr;
  std::uint32_t parent = 0;
  memory_copier* copier = nullptr;
  std::byte* p = lookup(e, key, addr, len, need, via, parent, copier);
  if (p == nullptr || parent == 0) return p;
  return check(parent, addr, len, access::none, 0);
}

std::byte* registration_table::pin_one(std::uint32_t key, std::uint64_t addr, std::uint64_t len, access need,
                                       std::uint64_t via, std::uint32_t& parent,
                                       memory_copier*& copier) const noexcept {
  const std::uint32_t index = index_of(key);
  if (index == 0 || index >= kCapacity) return nullptr;
  const entry& e = entries_[index];
  e.pins.fetch_add(1, std::memory_order_seq_cst);
  std::byte* p =
      e.key.load(std::memory_order_seq_cst) == key ? lookup(e, key, addr, len, need, via, parent, copier) : nullptr;
  if (p == nullptr) e.pins.fetch_sub(1, std::memory_order_release);
  return p;
}

std::byte* registration_table::pin(std::uint32_t key, std::uint64_t addr, std::uint64_t len, access need,
                                   std::uint64_t via, memory_copier*& copier) const noexcept {
  std::uint32_t parent = 0;
  copier = nullptr;
  std::byte* p = pin_one(key, addr, len, need, via, parent, copier);
  if (p == nullptr || parent == 0) return p;
  // A window: its registration is pinned too (a registration has no
  // parent), and says how its bytes move.
  std::uint32_t none = 0;
  if (pin_one(parent, addr, len, access::none, 0, none, copier) == nullptr) {
    entries_[index_of(key)].pins.fetch_sub(1, std::memory_order_release);
    return nullptr;
  }
  return p;
}

void registration_table::unpin(std::uint32_t key) const noexcept {
  const entry& e = entries_[index_of(key)];
  // Still pinned, so the slot (and its parent) cannot change under us.
  const std::uint32_t parent = e.parent.load(std::memory_order_relaxed);
  if (parent != 0) entries_[index_of(parent)].pins.fetch_sub(1, std::memory_order_release);
  e.pins.fetch_sub(1, std::memory_order_release);
}

tcp_window::~tcp_window() { table_->remove(rkey()); }

bool tcp_window::bind(const window_binding& b, std::uint64_t owner) noexcept {
  const std::uint32_t key = table_->bind(rkey(), b.region->lkey(), b.addr, b.length, b.rights, owner);
  if (key == 0) return false;
  set_bound(key);
  return true;
}

tcp_mr::tcp_mr(std::shared_ptr<registration_table> table, void* addr, std::size_t length,
               std::uint32_t key, transport::access acc) noexcept
    : memory_region(addr, length, key, key, acc), table_(std::move(table)) {}

tcp_mr::~tcp_mr() { table_->remove(lkey()); }

std::unique_ptr<memory_region> tcp_pd::register_memory(void* addr, std::size_t length, access acc) {
  check_registration(addr, length, acc);
  const std::uint32_t key = table_->add(static_cast<std::byte*>(addr), length, acc);
  if (key == 0) {
    throw std::system_error(errc::registration_failed, "register_memory: registration table full");
  }
  return std::make_unique<tcp_mr>(table_, addr, length, key, acc);
}

tcp_dmabuf_mr::tcp_dmabuf_mr(std::shared_ptr<registration_table> table, std::uint64_t iova, std::size_t length,
                             std::uint32_t key, transport::access acc, void* map, std::size_t map_length) noexcept
    : memory_region(reinterpret_cast<void*>(iova), length, key, key, acc),
      table_(std::move(table)),
      map_(map),
      map_length_(map_length) {}

tcp_dmabuf_mr::~tcp_dmabuf_mr() {
  table_->remove(lkey());  // waits for the accesses that pinned it
  ::munmap(map_, map_length_);
}

// The software NIC reaches a dma-buf the way the CPU can: through a shared
// mapping of the fd (a udmabuf, a memfd, any mappable buffer; a GPU's
// dma-buf is not mappable this way, and the tcp provider reaches device
// memory with CUDA copies instead).
std::unique_ptr<memory_region> tcp_pd::register_dmabuf(int fd, std::uint64_t offset, std::size_t length,
                                                       std::uint64_t iova, access acc) {
  check_dmabuf_registration(fd, offset, length, iova, acc);
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    throw std::system_error(errc::registration_failed,
                            "register_dmabuf: fd " + std::to_string(fd) + ": " + std::strerror(errno));
  }
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (offset > size || length > size - offset) {
    throw std::system_error(errc::invalid_argument, "register_dmabuf: [" + std::to_string(offset) + ", +" +
                                                        std::to_string(length) + ") ends past the buffer's " +
                                                        std::to_string(size) + " bytes");
  }
  const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  const std::uint64_t start = offset & ~(page - 1);
  const std::size_t lead = static_cast<std::size_t>(offset - start);
  const std::size_t map_length = lead + length;
  // The mapping is as writable as the registration: a read-only buffer
  // registered for writing is refused here, as a device would.
  const int prot = has(acc, access::local_write) ? PROT_READ | PROT_WRITE : PROT_READ;
  void* map = ::mmap(nullptr, map_length, prot, MAP_SHARED, fd, static_cast<off_t>(start));
  if (map == MAP_FAILED) {
    throw std::system_error(errc::registration_failed,
                            std::string("register_dmabuf: the buffer cannot be mapped: ") + std::strerror(errno));
  }
  const std::uint32_t key = table_->add_mapped(iova, length, acc, static_cast<std::byte*>(map) + lead);
  if (key == 0) {
    ::munmap(map, map_length);
    throw std::system_error(errc::registration_failed, "register_dmabuf: registration table full");
  }
  return std::make_unique<tcp_dmabuf_mr>(table_, iova, length, key, acc, map, map_length);
}

tcp_copied_mr::tcp_copied_mr(std::shared_ptr<registration_table> table, void* addr, std::size_t length,
                             std::uint32_t key, transport::access acc, std::shared_ptr<memory_copier> copier) noexcept
    : memory_region(addr, length, key, key, acc), table_(std::move(table)), copier_(std::move(copier)) {}

tcp_copied_mr::~tcp_copied_mr() { table_->remove(lkey()); }  // waits for the copies in flight; then the copier may go

// Memory the CPU cannot reach (GPU device memory): the software NIC sends
// from it and receives into it through the copier, a piece at a time
// through its own host buffers (tcp_qp's tx bounce and rx staging).
std::unique_ptr<memory_region> tcp_pd::register_copied(void* addr, std::size_t length, access acc,
                                                       std::shared_ptr<memory_copier> copier) {
  check_copied_registration(addr, length, acc, copier.get());
  const std::uint32_t key = table_->add_copied(static_cast<std::byte*>(addr), length, acc, copier.get());
  if (key == 0) throw std::system_error(errc::registration_failed, "register_copied: registration table full");
  return std::make_unique<tcp_copied_mr>(table_, addr, length, key, acc, std::move(copier));
}

std::unique_ptr<queue_pair> tcp_pd::create_qp(const qp_attributes& attr) {
  return std::make_unique<tcp_qp>(*table_, attr, shared_);
}

std::unique_ptr<shared_receive_queue> tcp_pd::create_srq(const srq_attributes& attr) {
  check_srq(attr, device_caps());
  return std::make_unique<tcp_srq>(*table_, attr);
}

std::unique_ptr<memory_window> tcp_pd::alloc_window() {
  const std::uint32_t key = table_->add_window();
  if (key == 0) throw std::system_error(errc::registration_failed, "alloc_window: registration table full");
  return std::make_unique<tcp_window>(table_, key);
}

// ---------------------------------------------------------------- completion queue

namespace {
int check_fd(int fd, const char* what) {
  if (fd < 0) throw std::system_error(errno, std::system_category(), what);
  return fd;
}
}  // namespace

// depth_, which create_cq caps at max_cqe (2^20), is where it overflows.
tcp_cq::tcp_cq(std::uint32_t depth, const cq_options& options)
    : depth_(depth), ring_(depth), owner_rearms_(options.owner_rearms), threaded_(options.progress_thread) {
  try {
    epfd_ = check_fd(::epoll_create1(EPOLL_CLOEXEC), "epoll_create1");
    evfd_ = check_fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC), "eventfd");
    timerfd_ = check_fd(::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC), "timerfd_create");
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = nullptr;  // eventfd, timerfd: nullptr means "no queue pair"
    if (::epoll_ctl(epfd_, EPOLL_CTL_ADD, timerfd_, &ev) != 0 ||
        (!threaded_ && ::epoll_ctl(epfd_, EPOLL_CTL_ADD, evfd_, &ev) != 0)) {
      throw std::system_error(errno, std::system_category(), "epoll_ctl");
    }
    if (!threaded_) return;
    // The thread waits on epfd_ (sockets, timer, wakefd_); the owner on
    // the eventfd that says completions are there (notify_fd).
    wakefd_ = check_fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC), "eventfd");
    epoll_event wake{};
    wake.events = EPOLLIN;
    wake.data.ptr = &wakefd_;  // (told apart from queue pairs: progress() skips it)
    if (::epoll_ctl(epfd_, EPOLL_CTL_ADD, wakefd_, &wake) != 0) {
      throw std::system_error(errno, std::system_category(), "epoll_ctl");  // (the stop could not wake the thread)
    }
    thread_ = std::thread([this] { run_progress(); });
  } catch (...) {
    close_fds();
    throw;
  }
}

tcp_cq::~tcp_cq() {
  if (thread_.joinable()) {
    stopping_.store(true, std::memory_order_release);
    const std::uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(wakefd_, &one, sizeof one);
    thread_.join();
  }
  if (!qps_.empty()) {
    log().error("completion queue destroyed with {} queue pairs still on it", qps_.size());
    for (tcp_qp* qp : qps_) qp->forget_cq(this);
  }
  close_fds();
}

void tcp_cq::close_fds() noexcept {
  for (int fd : {wakefd_, timerfd_, evfd_, epfd_}) {
    if (fd >= 0) ::close(fd);
  }
}

namespace {
// How long the progress thread lets an acknowledgement held back wait for
// a request of the owner's to carry it (see tcp_qp::progress).
constexpr std::int64_t kHeldAckDelayNs = 200'000;
// An owner that polled this recently counts as about to send (its pass may
// hold a lone acknowledgement back).
constexpr std::int64_t kOwnerRecentNs = 200'000;
// An owner that polled this recently is active: the thread's waits are
// bounded by kActiveWaitNs, so that what the owner's passes hold back
// goes out without the owner waking the thread (kick_thread) per message.
constexpr std::int64_t kOwnerActiveNs = 10'000'000;
constexpr std::int64_t kActiveWaitNs = 1'000'000;

std::int64_t now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct wake_reasons {
  bool kicked = false;  // an event with data.ptr `mark`
  bool other = false;   // any other
};

// Waits for events of epfd, at most wait_ns (-1: no limit; a signal may
// end it early: the caller's loop waits again).
wake_reasons wait_event(int epfd, std::int64_t wait_ns, const void* mark) noexcept {
  std::array<epoll_event, 8> ev;
  int n = 0;
  if (wait_ns < 0) {
    n = ::epoll_wait(epfd, ev.data(), static_cast<int>(ev.size()), -1);
  } else {
    const timespec ts{.tv_sec = static_cast<time_t>(wait_ns / 1'000'000'000),
                      .tv_nsec = static_cast<long>(wait_ns % 1'000'000'000)};
    // (epoll_pwait2 refused once, by a kernel before 5.11 or a seccomp
    // filter that predates it: millisecond waits from then on)
    static std::atomic<bool> no_pwait2{false};
    n = no_pwait2.load(std::memory_order_relaxed) ? -1 : ::epoll_pwait2(epfd, ev.data(), static_cast<int>(ev.size()), &ts, nullptr);
    if (n < 0 && (no_pwait2.load(std::memory_order_relaxed) || errno != EINTR)) {
      no_pwait2.store(true, std::memory_order_relaxed);
      n = ::epoll_wait(epfd, ev.data(), static_cast<int>(ev.size()), static_cast<int>((wait_ns + 999'999) / 1'000'000));
    }
  }
  wake_reasons w;
  for (int i = 0; i < n; ++i) (ev[static_cast<std::size_t>(i)].data.ptr == mark ? w.kicked : w.other) = true;
  return w;
}
}  // namespace

void tcp_cq::run_progress() noexcept {
  ::pthread_setname_np(::pthread_self(), "anydoor-tcp-pg");
  std::int64_t wait_ns = -1;
  while (!stopping_.load(std::memory_order_acquire)) {
    bool events = true;
    if (wait_ns != 0) {
      const wake_reasons w = wait_event(epfd_, wait_ns, &wakefd_);
      if (w.kicked) {
        std::uint64_t kicks;
        [[maybe_unused]] auto n = ::read(wakefd_, &kicks, sizeof kicks);  // (else it keeps epfd_ readable)
        if (!w.other) {
          // The owner's pass left work to time (kick_thread): input beyond
          // a pass at once; an acknowledgement held back after the time
          // the owner's next request has to carry it.
          const std::lock_guard lock(mutex_);
          wait_ns = next_wait_ns() == 0 ? 0 : kHeldAckDelayNs;
          continue;
        }
      }
      events = w.other;
    } else {
      // Passes back to back (input beyond one pass): an owner waiting for
      // the mutex goes first.
      for (int i = 0; i < 64 && owner_waiting_.load(std::memory_order_relaxed) != 0; ++i) std::this_thread::yield();
    }
    const std::lock_guard lock(mutex_);
    if (stopping_.load(std::memory_order_acquire)) return;
    if (overflow_) break;  // (its queue pairs are in error; the owner tears it down)
    const std::int64_t now = now_ns();
    owner_recent_ = now - owner_poll_ns_ < kOwnerRecentNs;
    in_thread_pass_ = true;
    if (events || wait_ns == 0) {
      progress();
    } else {
      progress_pending();  // (a timed wait that saw nothing: held acknowledgements only)
    }
    in_thread_pass_ = false;
    thread_passes_.fetch_add(1, std::memory_order_relaxed);
    wait_ns = next_wait_ns();
    if (wait_ns < 0 && now - owner_poll_ns_ < kOwnerActiveNs) wait_ns = kActiveWaitNs;
    thread_waits_ = wait_ns < 0;
  }
  // Overflowed: nothing more to do but wait for the stop (epfd_ may stay
  // readable for a socket no pass reads now).
  pollfd p{.fd = wakefd_, .events = POLLIN, .revents = 0};
  while (!stopping_.load(std::memory_order_acquire)) {
    (void)::poll(&p, 1, -1);
    std::uint64_t kicks;
    [[maybe_unused]] auto n = ::read(wakefd_, &kicks, sizeof kicks);
  }
}

void tcp_cq::kick_thread() noexcept {
  thread_waits_ = false;
  const std::uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wakefd_, &one, sizeof one);
}

void tcp_cq::progress_pending() noexcept {
  // (pending_ has room for every queue pair and lists each once: a pass
  // noting one again appends nothing while it is listed)
  for (std::size_t i = 0; i < pending_.size(); ++i) {
    if (pending_[i]->has_pending_work()) pending_[i]->progress();
  }
}

std::int64_t tcp_cq::next_wait_ns() const noexcept {
  // Input left unprocessed (a pass takes a bounded number of frames): at
  // once. Only held-back acknowledgements: after a while, unless an event
  // comes first (the owner's next request may carry them; the next pass
  // sends what is still held). Else: until epfd_ reports something.
  std::int64_t wait = -1;
  for (const tcp_qp* qp : pending_) {
    if (qp->has_pending_input()) return 0;
    if (qp->has_pending_work()) wait = kHeldAckDelayNs;
  }
  return wait;
}

void tcp_cq::attach(tcp_qp* qp, std::uint32_t wrs) {
  // Each queue pair is listed at most once: note_pending never allocates.
  // (Reserved first: a failure leaves no pointer behind in qps_.)
  pending_.reserve(qps_.size() + 1);
  pending_pass_.reserve(qps_.size() + 1);
  qps_.push_back(qp);
  wrs_ += wrs;
  if (wrs_ > depth_) {
    log().warn("completion queue depth {} is below the {} work requests of its queue pairs: it can overflow",
               depth_, wrs_);
  }
}

void tcp_cq::detach(tcp_qp* qp, std::uint32_t wrs) noexcept {
  const auto it = std::find(qps_.begin(), qps_.end(), qp);
  if (it == qps_.end()) return;
  qps_.erase(it);
  wrs_ -= wrs;
  pending_.erase(std::remove(pending_.begin(), pending_.end(), qp), pending_.end());
}

void tcp_cq::note_pending(tcp_qp* qp, bool& noted) noexcept {
  if (noted) return;
  noted = true;
  pending_.push_back(qp);
}

void tcp_cq::watch(int fd, tcp_qp* qp, bool want_write, bool want_read) noexcept {
  epoll_event ev{};
  ev.events = (want_read ? EPOLLIN | EPOLLRDHUP : 0u) | (want_write ? EPOLLOUT : 0u);
  ev.data.ptr = qp;
  if (::epoll_ctl(epfd_, EPOLL_CTL_MOD, fd, &ev) != 0) ::epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev);
}

void tcp_cq::unwatch(int fd) noexcept { ::epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr); }

void tcp_cq::signal() noexcept {
  const std::uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(evfd_, &one, sizeof one);
  // (After the write: set first, a read between the two would clear it
  // with the count not there yet, and the count would then stay unread,
  // evfd_ readable for good.)
  signalled_.store(true, std::memory_order_release);
}

void tcp_cq::push(const completion& c) noexcept {
  if (overflow_) return;
  if (ring_used_ == depth_) {
    overflow_ = true;
    log().error("completion queue overflow (depth {}): completion of wr_id {} lost; "
                "queue pairs on it move to error", depth_, c.wr_id);
    for (tcp_qp* qp : qps_) qp->on_cq_overflow();
    signal();
    return;
  }
  ring_[ring_tail_] = c;
  ring_tail_ = ring_tail_ + 1 == depth_ ? 0 : ring_tail_ + 1;
  ++ring_used_;
  if (armed_) {
    armed_ = false;
    // (Inside the owner's poll, which returns it, an owner that arms again
    // before it sleeps needs no wake-up: cq_options::owner_rearms.)
    if (!in_owner_poll_) signal();
  }
}

void tcp_cq::schedule(std::chrono::steady_clock::time_point when) noexcept {
  if (timer_set_ && timer_at_ <= when) return;
  timer_set_ = true;
  timer_at_ = when;
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::max(when - std::chrono::steady_clock::now(), std::chrono::steady_clock::duration(1000)))
                      .count();
  itimerspec spec{};
  spec.it_value.tv_sec = static_cast<time_t>(ns / 1'000'000'000);
  spec.it_value.tv_nsec = static_cast<long>(ns % 1'000'000'000);
  ::timerfd_settime(timerfd_, 0, &spec, nullptr);
}

void tcp_cq::progress() noexcept {
  if (timer_set_) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= timer_at_) {
      timer_set_ = false;
      // Disarmed, which also clears an expiration not read: the timer may
      // fire a little after timer_at_, when this read would have found
      // nothing, and then keep epfd_ readable with nobody to read it.
      const itimerspec off{};
      ::timerfd_settime(timerfd_, 0, &off, nullptr);
      // Each qp re-schedules what is still pending.
      for (std::size_t i = 0; i < qps_.size(); ++i) qps_[i]->on_timer(now);
    }
  }
  // With few queue pairs, trying each socket is cheaper than asking epoll.
  if (qps_.size() <= 4) {
    epoll_full_ = false;
    for (std::size_t i = 0; i < qps_.size(); ++i) {
      if (qps_[i]->wants_progress()) qps_[i]->progress();
    }
    return;
  }
  std::array<epoll_event, 64> events;
  const int n = ::epoll_wait(epfd_, events.data(), static_cast<int>(events.size()), 0);
  // (More may be ready: those wait for the next pass, and an arm() wakes
  // the consumer for them.)
  epoll_full_ = n == static_cast<int>(events.size());
  for (int i = 0; i < n; ++i) {
    void* const who = events[static_cast<std::size_t>(i)].data.ptr;
    if (who != nullptr && who != &wakefd_) static_cast<tcp_qp*>(who)->on_events(events[static_cast<std::size_t>(i)].events);
  }
  // Those that left work behind (they note themselves again if they still do).
  pending_pass_.swap(pending_);
  for (tcp_qp* qp : pending_pass_) {
    qp->noted_on(this) = false;
    if (qp->has_pending_work()) qp->progress();
  }
  pending_pass_.clear();
}

std::size_t tcp_cq::poll(std::span<completion> out, std::error_code& ec) noexcept {
  const auto lock = guard();
  ++counters_.polls;
  if (threaded_) owner_poll_ns_ = now_ns();
  if (!overflow_ && ring_used_ == 0) {
    // (What this pass completes, this call returns: at least one.)
    in_owner_poll_ = owner_rearms_ && !out.empty();
    progress();
    in_owner_poll_ = false;
    // Work this pass left (an acknowledgement held back, input beyond a
    // pass) waits for the owner's next poll, which may not come soon: a
    // thread waiting without limit (the owner was idle) is told to time it.
    if (threaded_ && thread_waits_ && next_wait_ns() >= 0) kick_thread();
  }
  if (overflow_) {
    ec = errc::cq_overflow;
    return 0;
  }
  // At most two runs: to the ring's end, then from its start.
  const std::uint32_t n = static_cast<std::uint32_t>(std::min<std::size_t>(out.size(), ring_used_));
  const std::uint32_t first = std::min(n, depth_ - ring_head_);
  std::copy_n(ring_.begin() + ring_head_, first, out.begin());
  std::copy_n(ring_.begin(), n - first, out.begin() + first);
  ring_head_ = n - first != 0 ? n - first : ring_head_ + first;
  if (ring_head_ == depth_) ring_head_ = 0;
  ring_used_ -= n;
  if (n == 0) ++counters_.empty_polls;
  counters_.completions += n;
  ec.clear();
  return n;
}

std::error_code tcp_cq::arm() noexcept {
  const auto lock = guard();
  if (overflow_) return errc::cq_overflow;
  // The caller may sleep now: held-back acknowledgements must not wait for
  // it. Every queue pair holding one is listed (progress() notes it).
  for (tcp_qp* qp : pending_) qp->flush_acks();
  armed_ = true;
  // Stricter than verbs: completions already queued notify at once, and so
  // does input a pass left (read but not processed, a pass taking at most
  // 256 frames; or still in a socket after the cap, or beyond the events
  // one epoll_wait returns): a watcher of the notify fd woken by an edge,
  // which does not re-arm, has had it for those bytes, and for input read
  // the socket may be empty - without a progress thread, whose work that
  // input is (arm_reports_queued).
  bool wake = ring_used_ != 0 || (epoll_full_ && !threaded_);
  for (std::size_t i = 0; i < pending_.size() && !wake && !threaded_; ++i) wake = pending_[i]->has_pending_work();
  if (wake) {
    armed_ = false;
    signal();
  }
  return {};
}

std::size_t tcp_cq::ack_events() noexcept {
  const auto lock = guard();
  std::uint64_t count = 0;
  if (!signalled_.exchange(false, std::memory_order_acq_rel)) return 0;
  if (::read(evfd_, &count, sizeof count) != static_cast<ssize_t>(sizeof count)) count = 0;
  counters_.events += count;
  return static_cast<std::size_t>(count);
}

// ---------------------------------------------------------------- device

tcp_device::tcp_device(std::string name, fault_plan faults) : name_(std::move(name)), caps_(make_caps()) {
  shared_->faults = faults;
  caps_.late_duplicates = faults.late_duplicates;
  if (faults.any()) {
    log().warn("tcp provider: fault injection is on ({}={})", kFaultsVariable, to_string(faults));
  }
}

capabilities tcp_device::make_caps() noexcept { return device_caps(); }

capabilities device_caps() noexcept {
  capabilities c;
  c.max_qp_wr = 1u << 15;
  c.max_sge = 16;
  c.max_inline = 1024;
  c.max_mr_size = 1ull << 40;
  c.max_msg_size = kMaxPayload;
  c.max_cqe = 1u << 20;
  c.max_private_data = kMaxPrivateData;
  c.atomics = true;
  c.memory_windows = true;
  c.max_srq = 1u << 16;
  c.max_srq_wr = 1u << 20;
  c.dmabuf = true;        // a buffer fd it can map (register_dmabuf)
  c.peer_memory = false;  // GPU memory: through CUDA copies, never a device pointer as such
  c.copied_memory = true;  // (register_copied: the runtime's CUDA copier)
  return c;
}

std::unique_ptr<protection_domain> tcp_device::alloc_pd() { return std::make_unique<tcp_pd>(shared_); }

device_counters tcp_device::counters() const {
  return {.rnr_naks_sent = shared_->sent.load(std::memory_order_relaxed),
          .rnr_naks_received = shared_->received.load(std::memory_order_relaxed),
          .rnr_retry_exceeded = shared_->retry_exceeded.load(std::memory_order_relaxed),
          .source = "tcp provider (the device's queue pairs)"};
}

std::unique_ptr<completion_queue> tcp_device::create_cq(std::uint32_t depth, const cq_options& options) {
  if (depth == 0 || depth > caps_.max_cqe) {
    throw std::system_error(errc::invalid_argument, "create_cq: depth must be in 1.." + std::to_string(caps_.max_cqe));
  }
  const std::uint32_t cap = shared_->faults.cq_depth;
  if (cap != 0 && cap < depth) {
    log().warn("tcp provider: a completion queue of depth {} holds {} (fault injection: cq_depth)", depth, cap);
    depth = cap;
  }
  return std::make_unique<tcp_cq>(depth, options);
}

}  // namespace anydoor::transport::tcp
