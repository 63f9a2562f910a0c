// anydoor-tcp-floor: the floor under any TCP-based transport on this host.
// Plain non-blocking TCP sockets, busy-polled, no framing, no completion
// queue, nothing but recv/send. bench/compare-peers.sh runs it beside
// anydoor-perf, fi_pingpong and UCX.
//
//   anydoor-tcp-floor --server [--port P] [--test lat|stream] [-s SIZE] [-n ITERS] [--slots N]
//     (prints "anydoor-tcp-floor: listening on 0.0.0.0:PORT"; --port 0: any free port)
//   anydoor-tcp-floor --connect HOST [--port P] [--test lat|stream] [-s SIZE] [-n ITERS] [--slots N]
//
//   lat     ping-pong of SIZE-byte messages (default 64); the client prints
//           RESULT test=lat size=.. iters=.. median_us=.. p99_us=.. mean_us=..
//           (one-way: half the round trip, as anydoor-perf prints it)
//   stream  the client streams ITERS messages of SIZE bytes (default 65536)
//           and the server answers one byte when all have arrived; the client prints
//           RESULT test=stream size=.. iters=.. MBps=..
//           --slots N: each side cycles through N consecutive places of SIZE
//           bytes (default 1: one buffer, reused); anydoor-perf's write_bw
//           and read_bw take the same option, so the two can stream
//           through the same memory (at most 1 GiB in all, else exit 2)
// Both sides use TCP_NODELAY and 4 MiB socket buffers, like the tcp provider.
// The server serves one client and exits; the same --test, -s and -n must be
// given to both.
#include "cli.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

[[noreturn]] void die(const std::string& what) { throw std::system_error(errno, std::generic_category(), what); }

void tune(int fd) {
  const int one = 1, buf = 4 << 20;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0) die("TCP_NODELAY");
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);  // best effort: capped by the system
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
}

int accept_one(std::uint16_t port) {
  const int ls = ::socket(AF_INET, SOCK_STREAM, 0);
  if (ls < 0) die("socket");
  const int one = 1;
  ::setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  if (::bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) die("bind port " + std::to_string(port));
  if (::listen(ls, 1) != 0) die("listen");
  socklen_t len = sizeof a;
  if (::getsockname(ls, reinterpret_cast<sockaddr*>(&a), &len) != 0) die("getsockname");
  std::printf("anydoor-tcp-floor: listening on 0.0.0.0:%u\n", static_cast<unsigned>(ntohs(a.sin_port)));  // (--port 0: the one picked)
  std::fflush(stdout);
  const int fd = ::accept4(ls, nullptr, nullptr, SOCK_NONBLOCK);
  if (fd < 0) die("accept");
  ::close(ls);
  tune(fd);
  return fd;
}

int connect_to(const std::string& host, std::uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res); rc != 0)
    throw std::runtime_error("resolve " + host + ": " + ::gai_strerror(rc));
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) die("socket");
  tune(fd);
  // The server may still be starting: retry for up to 5 s.
  const auto give_up = clock_type::now() + std::chrono::seconds(5);
  while (::connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
    if (errno != ECONNREFUSED || clock_type::now() > give_up) {
      ::freeaddrinfo(res);
      die("connect " + host + ":" + std::to_string(port));
    }
    ::usleep(20000);
  }
  ::freeaddrinfo(res);
  const int flags = 1;
  if (::ioctl(fd, FIONBIO, &flags) != 0) die("FIONBIO");
  return fd;
}

// Busy-polls until n bytes have moved; a peer that closes early is an error.
void recv_all(int fd, std::byte* p, std::size_t n) {
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= static_cast<std::size_t>(r);
    } else if (r == 0) {
      throw std::runtime_error("peer closed the connection");
    } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      die("recv");
    }
  }
}

void send_all(int fd, const std::byte* p, std::size_t n) {
  while (n > 0) {
    const ssize_t r = ::send(fd, p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r > 0) {
      p += r;
      n -= static_cast<std::size_t>(r);
    } else if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      die("send");
    }
  }
}

double percentile(std::vector<double>& v, double q) {
  const auto k = static_cast<std::size_t>(q * static_cast<double>(v.size() - 1));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

int run(const anydoor::bench::cli_options& o) {
  const int fd = o.server ? accept_one(o.port) : connect_to(o.host, o.port);
  const std::uint32_t slots = o.test == "stream" ? std::max<std::uint32_t>(o.slots, 1) : 1;
  std::vector<std::byte> buf(std::size_t{o.size} * slots);
  if (o.test == "lat") {
    constexpr std::uint32_t kWarmup = 1000;
    std::vector<double> rtt;
    rtt.reserve(o.iters);
    for (std::uint32_t i = 0; i < o.iters + kWarmup; ++i) {
      if (o.server) {
        recv_all(fd, buf.data(), buf.size());
        send_all(fd, buf.data(), buf.size());
        continue;
      }
      const auto t0 = clock_type::now();
      send_all(fd, buf.data(), buf.size());
      recv_all(fd, buf.data(), buf.size());
      if (i >= kWarmup) rtt.push_back(std::chrono::duration<double, std::nano>(clock_type::now() - t0).count());
    }
    if (!o.server) {
      double sum = 0;
      for (double x : rtt) sum += x;
      const double mean = sum / static_cast<double>(rtt.size());
      const double p99 = percentile(rtt, 0.99), median = percentile(rtt, 0.5);
      std::printf("RESULT test=lat size=%u iters=%u median_us=%.3f p99_us=%.3f mean_us=%.3f\n", o.size, o.iters,
                  median / 2000, p99 / 2000, mean / 2000);
    }
  } else {
    std::byte done{1};
    if (o.server) {
      for (std::uint32_t i = 0; i < o.iters; ++i) recv_all(fd, buf.data() + std::size_t{i % slots} * o.size, o.size);
      send_all(fd, &done, 1);
    } else {
      const auto t0 = clock_type::now();
      for (std::uint32_t i = 0; i < o.iters; ++i) send_all(fd, buf.data() + std::size_t{i % slots} * o.size, o.size);
      recv_all(fd, &done, 1);
      const double secs = std::chrono::duration<double>(clock_type::now() - t0).count();
      std::printf("RESULT test=stream size=%u iters=%u MBps=%.1f\n", o.size, o.iters,
                  static_cast<double>(o.size) * o.iters / secs / 1e6);
    }
  }
  ::close(fd);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  anydoor::bench::cli_options o = anydoor::bench::parse_cli(
      argc, argv,
      "anydoor-tcp-floor (--server | --connect HOST) [--port P] [--test lat|stream] [-s SIZE] [-n ITERS] [--slots N]",
      {.port = 18516, .test = "lat"}, {"lat", "stream"});
  auto usage_error = [&](const char* why) {
    std::fprintf(stderr, "anydoor-tcp-floor: %s\n", why);
    return 2;
  };
  if (o.slots != 0 && o.test != "stream") return usage_error("--slots applies to --test stream");
  if (o.size == 0) o.size = o.test == "lat" ? 64 : 65536;
  if (o.iters == 0) o.iters = 10000;
  if (std::uint64_t{o.size} * std::max<std::uint32_t>(o.slots, 1) > (std::uint64_t{1} << 30)) {
    return usage_error("-s (times --slots) must be at most 1 GiB");
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "anydoor-tcp-floor: %s\n", e.what());
    return 1;
  }
}
