#include "tcp/tcp_provider.hpp"

#include <anydoor/error.hpp>

#include "contract_checks.hpp"
#include "log.hpp"
#include "tcp/tcp_device.hpp"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
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

std::uint32_t registration_table::add(std::byte* addr, std::uint64_t length, access acc) {
  std::lock_guard lock(mutex_);
  if (free_count_ == 0) return 0;
  const std::uint32_t index = free_[free_head_];
  free_head_ = (free_head_ + 1) % free_.size();
  --free_count_;
  entry& e = entries_[index];
  constexpr std::uint32_t mask = (1u << kGenerationBits) - 1;
  e.generation = (e.generation + 1) & mask;
  const std::uint32_t key = (index << kGenerationBits) | e.generation;  // never 0: index >= 1
  e.addr.store(reinterpret_cast<std::uint64_t>(addr), std::memory_order_relaxed);
  e.length.store(length, std::memory_order_relaxed);
  e.acc.store(static_cast<std::uint32_t>(acc), std::memory_order_relaxed);
  e.key.store(key, std::memory_order_release);
  return key;
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
                                      access need) const noexcept {
  const std::uint64_t base = e.addr.load(std::memory_order_relaxed);
  const std::uint64_t length = e.length.load(std::memory_order_relaxed);
  const auto acc = static_cast<access>(e.acc.load(std::memory_order_relaxed));
  // Re-check: a concurrent deregistration and reuse of the slot changes the key.
  if (e.key.load(std::memory_order_acquire) != key) return nullptr;
  if (!has(acc, need)) return nullptr;
  if (addr < base || len > length || addr - base > length - len) return nullptr;
  return reinterpret_cast<std::byte*>(addr);
}

std::byte* registration_table::check(std::uint32_t key, std::uint64_t addr, std::uint64_t len,
                                     access need) const noexcept {
  const std::uint32_t index = index_of(key);
  if (index == 0 || index >= kCapacity) return nullptr;
  const entry& e = entries_[index];
  if (e.key.load(std::memory_order_acquire) != key) return nullptr;
  return lookup(e, key, addr, len, need);
}

std::byte* registration_table::pin(std::uint32_t key, std::uint64_t addr, std::uint64_t len,
                                   access need) const noexcept {
  const std::uint32_t index = index_of(key);
  if (index == 0 || index >= kCapacity) return nullptr;
  const entry& e = entries_[index];
  e.pins.fetch_add(1, std::memory_order_seq_cst);
  std::byte* p = e.key.load(std::memory_order_seq_cst) == key ? lookup(e, key, addr, len, need) : nullptr;
  if (p == nullptr) e.pins.fetch_sub(1, std::memory_order_release);
  return p;
}

void registration_table::unpin(std::uint32_t key) const noexcept {
  entries_[index_of(key)].pins.fetch_sub(1, std::memory_order_release);
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

std::unique_ptr<queue_pair> tcp_pd::create_qp(const qp_attributes& attr) {
  return std::make_unique<tcp_qp>(*table_, attr, totals_);
}

// ---------------------------------------------------------------- completion queue

namespace {
int check_fd(int fd, const char* what) {
  if (fd < 0) throw std::system_error(errno, std::system_category(), what);
  return fd;
}
}  // namespace

tcp_cq::tcp_cq(std::uint32_t depth) : depth_(depth), ring_(depth) {
  epfd_ = check_fd(::epoll_create1(EPOLL_CLOEXEC), "epoll_create1");
  evfd_ = check_fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC), "eventfd");
  timerfd_ = check_fd(::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC), "timerfd_create");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;  // eventfd and timerfd: nullptr means "no queue pair"
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, evfd_, &ev);
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, timerfd_, &ev);
}

tcp_cq::~tcp_cq() {
  if (!qps_.empty()) {
    log().error("completion queue destroyed with {} queue pairs still on it", qps_.size());
    for (tcp_qp* qp : qps_) qp->forget_cq(this);
  }
  ::close(timerfd_);
  ::close(evfd_);
  ::close(epfd_);
}

void tcp_cq::attach(tcp_qp* qp, std::uint32_t wrs) {
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
}

void tcp_cq::push(const completion& c) noexcept {
  if (overflow_) return;
  if (ring_tail_ - ring_head_ == depth_) {
    overflow_ = true;
    log().error("completion queue overflow (depth {}): completion of wr_id {} lost; "
                "queue pairs on it move to error", depth_, c.wr_id);
    for (tcp_qp* qp : qps_) qp->on_cq_overflow();
    signal();
    return;
  }
  ring_[ring_tail_++ % depth_] = c;
  if (armed_) {
    armed_ = false;
    signal();
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
      std::uint64_t expirations;
      [[maybe_unused]] auto n = ::read(timerfd_, &expirations, sizeof expirations);
      // Each qp re-schedules what is still pending.
      for (std::size_t i = 0; i < qps_.size(); ++i) qps_[i]->on_timer(now);
    }
  }
  // With few queue pairs, trying each socket is cheaper than asking epoll.
  if (qps_.size() <= 4) {
    for (std::size_t i = 0; i < qps_.size(); ++i) {
      if (qps_[i]->wants_progress()) qps_[i]->progress();
    }
    return;
  }
  std::array<epoll_event, 64> events;
  const int n = ::epoll_wait(epfd_, events.data(), static_cast<int>(events.size()), 0);
  for (int i = 0; i < n; ++i) {
    auto* qp = static_cast<tcp_qp*>(events[static_cast<std::size_t>(i)].data.ptr);
    if (qp != nullptr) qp->on_events(events[static_cast<std::size_t>(i)].events);
  }
  for (std::size_t i = 0; i < qps_.size(); ++i) {
    if (qps_[i]->has_pending_work()) qps_[i]->progress();
  }
}

std::size_t tcp_cq::poll(std::span<completion> out, std::error_code& ec) noexcept {
  ++counters_.polls;
  if (!overflow_ && ring_head_ == ring_tail_) progress();
  if (overflow_) {
    ec = errc::cq_overflow;
    return 0;
  }
  std::size_t n = 0;
  while (n < out.size() && ring_head_ != ring_tail_) out[n++] = ring_[ring_head_++ % depth_];
  if (n == 0) ++counters_.empty_polls;
  counters_.completions += n;
  ec.clear();
  return n;
}

std::error_code tcp_cq::arm() noexcept {
  if (overflow_) return errc::cq_overflow;
  // The caller may sleep now: held-back acknowledgements must not wait for it.
  for (std::size_t i = 0; i < qps_.size(); ++i) qps_[i]->flush_acks();
  armed_ = true;
  // Stricter than verbs: completions already queued notify at once.
  if (ring_head_ != ring_tail_) {
    armed_ = false;
    signal();
  }
  return {};
}

std::size_t tcp_cq::ack_events() noexcept {
  std::uint64_t count = 0;
  if (::read(evfd_, &count, sizeof count) != static_cast<ssize_t>(sizeof count)) count = 0;
  counters_.events += count;
  return static_cast<std::size_t>(count);
}

// ---------------------------------------------------------------- connection manager

namespace {

using clock = std::chrono::steady_clock;

int remaining_ms(clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()).count();
  return left < 0 ? 0 : static_cast<int>(std::min<long long>(left, 1 << 30));
}

// Waits until fd is ready for `events`, the deadline passes (timed_out) or
// a stop is requested (operation_canceled, seen within kStopSlice).
constexpr int kStopSlice = 50;  // ms
std::error_code wait_fd(int fd, short events, clock::time_point deadline, const std::stop_token& stop) {
  for (;;) {
    if (stop.stop_requested()) return std::make_error_code(std::errc::operation_canceled);
    const int left = remaining_ms(deadline);
    if (left == 0) return errc::timed_out;
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, stop.stop_possible() ? std::min(left, kStopSlice) : left);
    if (r > 0) return {};
    if (r < 0 && errno != EINTR) return {errno, std::system_category()};
  }
}

// Blocking-with-deadline I/O for the handshake (setup path only).
std::error_code io_all(int fd, std::byte* data, std::size_t len, bool write, clock::time_point deadline,
                       const std::stop_token& stop = {}) {
  std::size_t done = 0;
  while (done < len) {
    const ssize_t n = write ? ::send(fd, data + done, len - done, MSG_NOSIGNAL | MSG_DONTWAIT)
                            : ::recv(fd, data + done, len - done, MSG_DONTWAIT);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
      continue;
    }
    if (n == 0) return errc::connection_closed;  // the peer closed during the handshake
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return {errno, std::system_category()};
    if (auto ec = wait_fd(fd, write ? POLLOUT : POLLIN, deadline, stop)) return ec;
  }
  return {};
}

void tune_socket(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  const int buf = 4 << 20;
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
}

std::error_code send_handshake(int fd, const handshake& h, std::span<const std::byte> pdata,
                               clock::time_point deadline, const std::stop_token& stop = {}) {
  std::array<std::byte, kHandshakeSize + kMaxPrivateData> msg{};
  encode(h, std::span<std::byte, kHandshakeSize>(msg.data(), kHandshakeSize));
  std::copy(pdata.begin(), pdata.end(), msg.begin() + kHandshakeSize);
  return io_all(fd, msg.data(), kHandshakeSize + pdata.size(), true, deadline, stop);
}

std::error_code recv_handshake(int fd, handshake& h, std::vector<std::byte>& pdata, clock::time_point deadline,
                               const std::stop_token& stop = {}) {
  std::array<std::byte, kHandshakeSize> head{};
  if (auto ec = io_all(fd, head.data(), head.size(), false, deadline, stop)) return ec;
  if (const auto err = decode(head, h); err != handshake_error::none) {
    log().warn("tcp handshake: {} (peer version {}, ours {})", to_string(err), h.version, kWireVersion);
    return err == handshake_error::bad_version ? errc::version_mismatch : errc::protocol_error;
  }
  pdata.resize(h.private_data_len);
  return io_all(fd, pdata.data(), pdata.size(), false, deadline, stop);
}

class tcp_request final : public connection_request {
 public:
  tcp_request(int fd, handshake hello, std::vector<std::byte> pdata, std::chrono::milliseconds timeout)
      : fd_(fd), hello_(hello), pdata_(std::move(pdata)), timeout_(timeout) {}
  ~tcp_request() override {
    if (fd_ >= 0) ::close(fd_);
  }
  std::span<const std::byte> private_data() const noexcept override { return pdata_; }

  // Sends the accept reply (a fresh socket's buffer takes it at once) and
  // adopts the socket: nothing here waits for the peer.
  std::error_code accept(queue_pair& qp, std::span<const std::byte> pdata,
                         std::stop_token stop) noexcept override {
    auto* tqp = dynamic_cast<tcp_qp*>(&qp);
    if (tqp == nullptr) return errc::invalid_argument;
    if (fd_ < 0 || !tqp->can_connect()) return errc::invalid_state;
    if (pdata.size() > kMaxPrivateData) return errc::invalid_argument;
    handshake reply{.kind = handshake_kind::accept,
                    .private_data_len = static_cast<std::uint16_t>(pdata.size()),
                    .qp_num = tqp->qp_num(),
                    .max_send_wr = tqp->attributes().max_send_wr,
                    .max_recv_wr = tqp->attributes().max_recv_wr};
    if (auto ec = send_handshake(fd_, reply, pdata, clock::now() + timeout_, stop)) return ec;
    const int fd = fd_;
    fd_ = -1;
    return tqp->attach_socket(fd, hello_.max_send_wr);
  }

  void reject(std::span<const std::byte> pdata) noexcept override {
    if (fd_ < 0) return;
    handshake reply{.kind = handshake_kind::reject,
                    .private_data_len = static_cast<std::uint16_t>(std::min(pdata.size(), kMaxPrivateData)),
                    .max_send_wr = 1, .max_recv_wr = 1};
    (void)send_handshake(fd_, reply, pdata.first(reply.private_data_len), clock::now() + timeout_);
    ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
  handshake hello_;
  std::vector<std::byte> pdata_;
  std::chrono::milliseconds timeout_;
};

// Accepts TCP connections and reads their hellos concurrently, each within
// its own deadline (listen_options::handshake_timeout): an idle or slow
// socket delays nobody, a flood of them evicts the oldest beyond
// max_pending. get_request returns the first complete hello.
class tcp_listener final : public listener {
 public:
  tcp_listener(int fd, std::uint16_t port, const listen_options& o) : fd_(fd), port_(port), opt_(o) {}
  ~tcp_listener() override {
    for (const pending& p : pending_) ::close(p.fd);
    ::close(fd_);
  }
  int fd() const noexcept override { return fd_; }
  std::uint16_t port() const noexcept override { return port_; }
  std::uint64_t refused() const noexcept override { return refused_.load(std::memory_order_relaxed); }

  std::unique_ptr<connection_request> get_request(std::chrono::milliseconds timeout,
                                                  std::error_code& ec) noexcept override {
    const auto deadline = clock::now() + timeout;
    std::vector<pollfd> fds;
    for (;;) {
      if (auto e = accept_new()) {
        ec = e;
        return nullptr;
      }
      const auto now = clock::now();
      auto earliest = deadline;
      for (std::size_t i = 0; i < pending_.size();) {
        pending& p = pending_[i];
        if (std::unique_ptr<connection_request> req = read_hello(p)) {
          pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
          ec.clear();
          return req;
        }
        if (p.fd < 0 || now >= p.deadline) {
          if (p.fd >= 0) {
            refuse(p, "no complete hello within the handshake timeout");
          }
          pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
          continue;
        }
        earliest = std::min(earliest, p.deadline);
        ++i;
      }
      if (now >= deadline) {
        ec = errc::timed_out;
        return nullptr;
      }
      fds.clear();
      // (not while accepting is paused: the listener would stay readable)
      fds.push_back({clock::now() < accept_paused_until_ ? -1 : fd_, POLLIN, 0});
      for (const pending& p : pending_) fds.push_back({p.fd, POLLIN, 0});
      auto wake = earliest;
      if (accept_paused_until_ > now) wake = std::min(wake, accept_paused_until_);
      const int r = ::poll(fds.data(), fds.size(), std::max(1, remaining_ms(wake)));
      if (r < 0 && errno != EINTR) {
        ec = {errno, std::system_category()};
        return nullptr;
      }
    }
  }

 private:
  struct pending {
    int fd = -1;
    clock::time_point deadline{};
    std::array<std::byte, kHandshakeSize + kMaxPrivateData> buf{};
    std::size_t got = 0;
  };

  // Takes the connections the kernel has queued (a bounded number per call,
  // so that a flood cannot keep get_request from its other work).
  std::error_code accept_new() {
    if (clock::now() < accept_paused_until_) return {};
    for (int taken = 0; taken < 64; ++taken) {
      const int fd = ::accept4(fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        switch (errno) {
          case EAGAIN:
#if EAGAIN != EWOULDBLOCK
          case EWOULDBLOCK:
#endif
            return {};
          // accept(2): errors of the new connection, not of the listener
          case EINTR: case ECONNABORTED: case EPROTO: case ENOPROTOOPT: case EHOSTDOWN: case ENONET:
          case EHOSTUNREACH: case EOPNOTSUPP: case ENETUNREACH: case ENETDOWN: case EPERM:
            continue;
          case EMFILE: case ENFILE: case ENOBUFS: case ENOMEM:
            // Out of descriptors or memory: stop accepting for a while (the
            // kernel keeps the rest queued) rather than spin on a listener
            // that stays readable.
            log().warn("tcp listener: cannot accept: {}; pausing 100 ms", std::strerror(errno));
            accept_paused_until_ = clock::now() + std::chrono::milliseconds(100);
            return {};
          default:
            return {errno, std::system_category()};
        }
      }
      if (pending_.size() >= opt_.max_pending) evict();
      tune_socket(fd);
      pending p;
      p.fd = fd;
      p.deadline = clock::now() + opt_.handshake_timeout;
      pending_.push_back(p);
    }
    return {};
  }

  // Room for one more: the oldest attempt that has sent nothing, else the
  // oldest (a client that already sent its whole hello is served first).
  void evict() {
    auto victim = std::find_if(pending_.begin(), pending_.end(), [](const pending& p) { return p.got == 0; });
    if (victim == pending_.end()) victim = pending_.begin();
    refuse(*victim, "too many handshakes in progress; dropped one");
    pending_.erase(victim);
  }

  // Reads what the socket has; the request once the hello is complete.
  // A hello that can never complete closes the socket (p.fd = -1).
  std::unique_ptr<connection_request> read_hello(pending& p) {
    for (;;) {
      std::size_t need = kHandshakeSize;
      handshake hello{};
      if (p.got >= kHandshakeSize) {
        const auto err = decode(std::span<const std::byte, kHandshakeSize>(p.buf.data(), kHandshakeSize), hello);
        if (err != handshake_error::none || hello.kind != handshake_kind::hello) {
          if (err == handshake_error::bad_version) {
            // Tell the peer which version we speak; its connect reports the mismatch.
            handshake reply{.kind = handshake_kind::reject, .max_send_wr = 1, .max_recv_wr = 1};
            std::array<std::byte, kHandshakeSize> b{};
            encode(reply, b);
            [[maybe_unused]] const auto n = ::send(p.fd, b.data(), b.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
          }
          refuse(p, err != handshake_error::none ? to_string(err) : "not a hello");
          return nullptr;
        }
        need = kHandshakeSize + hello.private_data_len;
        if (p.got == need) {
          std::vector<std::byte> pdata(p.buf.begin() + kHandshakeSize, p.buf.begin() + static_cast<std::ptrdiff_t>(need));
          const int fd = std::exchange(p.fd, -1);
          return std::make_unique<tcp_request>(fd, hello, std::move(pdata), opt_.handshake_timeout);
        }
      }
      const ssize_t n = ::recv(p.fd, p.buf.data() + p.got, need - p.got, MSG_DONTWAIT);
      if (n > 0) {
        p.got += static_cast<std::size_t>(n);
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return nullptr;
      refuse(p, n == 0 ? "closed during the handshake" : std::strerror(errno));
      return nullptr;
    }
  }

  void refuse(pending& p, std::string_view why) {
    log().warn("tcp listener: refused a connection attempt: {}", why);
    refused_.fetch_add(1, std::memory_order_relaxed);
    ::close(p.fd);
    p.fd = -1;
  }

  int fd_;
  std::uint16_t port_;
  listen_options opt_;
  std::vector<pending> pending_;
  std::atomic<std::uint64_t> refused_{0};
  clock::time_point accept_paused_until_{};
};

addrinfo* resolve(const std::string& host, std::uint16_t port, bool passive, std::error_code& ec) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) {
    log().warn("tcp: cannot resolve '{}:{}': {}", host, port, ::gai_strerror(rc));
    ec = errc::address_error;
    return nullptr;
  }
  return res;
}

}  // namespace

capabilities tcp_device::make_caps() noexcept {
  capabilities c;
  c.max_qp_wr = 1u << 15;
  c.max_sge = 16;
  c.max_inline = 1024;
  c.max_mr_size = 1ull << 40;
  c.max_msg_size = kMaxPayload;
  c.max_cqe = 1u << 20;
  c.max_private_data = kMaxPrivateData;
  c.atomics = true;
  c.gpu_memory = false;
  return c;
}

std::unique_ptr<protection_domain> tcp_device::alloc_pd() { return std::make_unique<tcp_pd>(totals_); }

device_counters tcp_device::counters() const {
  return {.rnr_naks_sent = totals_->sent.load(std::memory_order_relaxed),
          .rnr_naks_received = totals_->received.load(std::memory_order_relaxed),
          .rnr_retry_exceeded = totals_->retry_exceeded.load(std::memory_order_relaxed),
          .source = "tcp provider (the device's queue pairs)"};
}

std::unique_ptr<completion_queue> tcp_device::create_cq(std::uint32_t depth) {
  if (depth == 0 || depth > caps_.max_cqe) {
    throw std::system_error(errc::invalid_argument, "create_cq: depth must be in 1.." + std::to_string(caps_.max_cqe));
  }
  return std::make_unique<tcp_cq>(depth);
}

std::unique_ptr<listener> tcp_device::listen(const std::string& host, std::uint16_t port,
                                             const listen_options& options) {
  if (options.handshake_timeout.count() <= 0 || options.max_pending == 0) {
    throw std::system_error(errc::invalid_argument, "listen: handshake_timeout and max_pending must be positive");
  }
  std::error_code ec;
  addrinfo* res = resolve(host, port, true, ec);
  if (res == nullptr) throw std::system_error(ec, "listen: cannot resolve '" + host + "'");
  int fd = -1;
  int last_errno = 0;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) break;
    last_errno = errno;
    ::close(fd);
    fd = -1;
  }
  ::freeaddrinfo(res);
  if (fd < 0) {
    throw std::system_error(last_errno, std::system_category(),
                            "listen: cannot bind " + host + ":" + std::to_string(port));
  }
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const std::uint16_t bound = addr.ss_family == AF_INET6
                                  ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                  : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  log().debug("tcp: listening on {}:{}", host, bound);
  return std::make_unique<tcp_listener>(fd, bound, options);
}

connect_result tcp_device::connect(queue_pair& qp, const std::string& host, std::uint16_t port,
                                   std::span<const std::byte> pdata, std::chrono::milliseconds timeout,
                                   std::stop_token stop) noexcept {
  connect_result result;
  auto* tqp = dynamic_cast<tcp_qp*>(&qp);
  if (tqp == nullptr || pdata.size() > kMaxPrivateData) {
    result.ec = errc::invalid_argument;
    return result;
  }
  if (!tqp->can_connect()) {
    result.ec = errc::invalid_state;
    return result;
  }
  if (stop.stop_requested()) {
    result.ec = std::make_error_code(std::errc::operation_canceled);
    return result;
  }
  const auto deadline = clock::now() + timeout;
  addrinfo* res = resolve(host, port, false, result.ec);
  if (res == nullptr) return result;
  int fd = -1;
  result.ec = errc::connection_refused;
  for (addrinfo* ai = res; ai != nullptr && fd < 0 && !stop.stop_requested(); ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    int err = 0;
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS) {
        const std::error_code w = wait_fd(fd, POLLOUT, deadline, stop);
        if (w == std::errc::operation_canceled) {
          err = ECANCELED;
        } else if (w == errc::timed_out) {
          err = ETIMEDOUT;
        } else {
          socklen_t len = sizeof err;
          ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        }
      }
    }
    if (err != 0) {
      result.ec = err == ECONNREFUSED ? std::error_code(errc::connection_refused)
                  : err == ETIMEDOUT  ? std::error_code(errc::timed_out)
                  : err == ECANCELED  ? std::make_error_code(std::errc::operation_canceled)
                                      : std::error_code(err, std::system_category());
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(res);
  if (fd < 0 && stop.stop_requested()) result.ec = std::make_error_code(std::errc::operation_canceled);
  if (fd < 0) {
    log().warn("tcp: connect to {}:{} failed: {}", host, port, result.ec.message());
    return result;
  }
  tune_socket(fd);
  handshake hello{.kind = handshake_kind::hello,
                  .private_data_len = static_cast<std::uint16_t>(pdata.size()),
                  .qp_num = tqp->qp_num(),
                  .max_send_wr = tqp->attributes().max_send_wr,
                  .max_recv_wr = tqp->attributes().max_recv_wr};
  result.ec = send_handshake(fd, hello, pdata, deadline, stop);
  handshake reply{};
  if (!result.ec) result.ec = recv_handshake(fd, reply, result.private_data, deadline, stop);
  if (!result.ec && reply.kind == handshake_kind::reject) result.ec = errc::connection_rejected;
  if (!result.ec && reply.kind != handshake_kind::accept) result.ec = errc::protocol_error;
  if (result.ec) {
    log().warn("tcp: connect to {}:{} failed: {}", host, port, result.ec.message());
    ::close(fd);
    return result;
  }
  result.ec = tqp->attach_socket(fd, reply.max_send_wr);
  return result;
}

}  // namespace anydoor::transport::tcp
