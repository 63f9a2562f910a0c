// The tcp provider's connection manager: the handshake over a fresh TCP
// connection, the listener, and tcp_device::listen/connect.
#include "tcp/tcp_provider.hpp"

#include <anydoor/error.hpp>

#include "contract_checks.hpp"
#include "log.hpp"
#include "tcp/tcp_device.hpp"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <system_error>
#include <utility>

namespace anydoor::transport::tcp {

// ---------------------------------------------------------------- connection manager

namespace {

using clock = std::chrono::steady_clock;

// Names the limit a process runs into when it is out of descriptors.
std::string fd_limit_note() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return " (the process's descriptor limit, RLIMIT_NOFILE)";
  return " (the process's descriptor limit, RLIMIT_NOFILE: soft " + std::to_string(rl.rlim_cur) + ", hard " +
         std::to_string(rl.rlim_max) + "; raise it with ulimit -n or setrlimit)";
}

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
// A warning a peer (or the system) can repeat as fast as it likes, told
// at most every 10 s: note() counts each occurrence and returns how many
// there were since the last report, this one included, when this one is
// to be told (the first, or 10 s after the last report), else 0.
class warning_limit {
 public:
  std::uint64_t note(clock::time_point now) noexcept {
    ++since_;
    if (last_ != clock::time_point{} && now - last_ < std::chrono::seconds(10)) return 0;
    last_ = now;
    return std::exchange(since_, 0);
  }

 private:
  clock::time_point last_{};
  std::uint64_t since_ = 0;
};

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
    bool polled = false;  // (at least once per call, even with no time left: accept_new waits for it)
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
      if (now >= deadline && polled) {
        ec = errc::timed_out;
        return nullptr;
      }
      fds.clear();
      // (not while accepting is paused: the listener would stay readable)
      fds.push_back({clock::now() < accept_paused_until_ ? -1 : fd_, POLLIN, 0});
      for (const pending& p : pending_) fds.push_back({p.fd, POLLIN, 0});
      auto wake = earliest;
      if (accept_paused_until_ > now) wake = std::min(wake, accept_paused_until_);
      const int r = ::poll(fds.data(), fds.size(), now >= deadline ? 0 : std::max(1, remaining_ms(wake)));
      polled = true;
      if (r < 0 && errno != EINTR) {
        ec = {errno, std::system_category()};
        return nullptr;
      }
      listener_readable_ = r > 0 && fds[0].fd >= 0 && fds[0].revents != 0;
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
    // Only when poll says a connection waits: with no descriptor free,
    // accept(2) fails with EMFILE even when none does.
    if (!listener_readable_ || clock::now() < accept_paused_until_) return {};
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
          case EMFILE: case ENFILE: case ENOBUFS: case ENOMEM: {
            // Out of descriptors or memory: stop accepting for a while (the
            // kernel keeps the rest queued) rather than spin on a listener
            // that stays readable. Told at most every 10 s, with how often
            // since.
            const int err = errno;
            if (const std::uint64_t n = accept_warning_.note(clock::now())) {
              log().warn("tcp listener: cannot accept: {}{}; pausing 100 ms ({} times since the last report)",
                         std::strerror(err), err == EMFILE ? fd_limit_note() : std::string(), n);
            }
            accept_paused_until_ = clock::now() + std::chrono::milliseconds(100);
            listener_readable_ = false;
            return {};
          }
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

  // Told at most every 10 s (anyone who can connect can make refusals as
  // fast as it connects), with how many since the last report;
  // refused() counts them all.
  void refuse(pending& p, std::string_view why) {
    if (const std::uint64_t n = refusal_warning_.note(clock::now())) {
      log().warn("tcp listener: refused a connection attempt: {}{}", why,
                 n > 1 ? " (and " + std::to_string(n - 1) + " more since the last report)" : std::string());
    }
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
  bool listener_readable_ = true;  // the last poll said so (or none yet): accept_new tries
  warning_limit accept_warning_;   // out of descriptors or memory
  warning_limit refusal_warning_;  // refused connection attempts
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

std::unique_ptr<listener> tcp_device::listen(const std::string& host, std::uint16_t port,
                                             const listen_options& options) {
  check_listen(options);
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
  auto* tqp = check_connect<tcp_qp>(qp, pdata, kMaxPrivateData, stop, result.ec);
  if (tqp == nullptr) return result;
  const auto deadline = clock::now() + timeout;
  addrinfo* res = resolve(host, port, false, result.ec);
  if (res == nullptr) return result;
  int fd = -1;
  result.ec = errc::connection_refused;
  for (addrinfo* ai = res; ai != nullptr && fd < 0 && !stop.stop_requested(); ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      // Out of descriptors or memory is not "refused": say so (with the
      // limit). Other failures (an address family the host lacks) leave
      // what an earlier address said.
      const int err = errno;
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
        result.ec = {err, std::system_category()};
        log().warn("tcp: connect to {}:{}: cannot make a socket: {}{}", host, port, std::strerror(err),
                   err == EMFILE ? fd_limit_note() : std::string());
      }
      continue;
    }
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
