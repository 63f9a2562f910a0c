// anydoor-demo: the main job's demo. Starts a server process and a client on
// loopback with the default provider, then shows a two-sided ping-pong, a
// one-sided transfer (RDMA WRITE, then READ back and verify) and atomics.
#include "common/session.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <exception>

using namespace anydoor::examples;

namespace {

void tell_port(std::uint16_t port, void* ctx) {
  const int fd = *static_cast<int*>(ctx);
  [[maybe_unused]] auto n = ::write(fd, &port, sizeof port);
}

int server(int port_fd, const session_options& opt) {
  try {
    session s = accept_one("127.0.0.1", 0, opt, tell_port, &port_fd);
    pingpong(s, 64, 10000, false);
    serve_until_disconnect(s);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "demo server: %s\n", e.what());
    return 1;
  }
}

int client(std::uint16_t port, const session_options& opt) {
  session s = connect_to("127.0.0.1", port, opt);
  std::printf("anydoor demo: provider %.*s, device %.*s, two processes on loopback\n",
              static_cast<int>(s.dev->provider().size()), s.dev->provider().data(),
              static_cast<int>(s.dev->name().size()), s.dev->name().data());

  const summary lat = summarize(pingpong(s, 64, 10000, true));
  std::printf("ping-pong    64 B send/recv, 10000 round trips: one-way latency median %.2f us, p99 %.2f us\n",
              lat.median / 2000, lat.p99 / 2000);

  constexpr std::uint32_t kChunk = 64 * 1024;
  constexpr std::uint64_t kCount = 256;  // 16 MiB
  const std::size_t half = s.buf.size() / 2;
  for (std::size_t i = 0; i < half; ++i) s.buf[i] = static_cast<std::byte>((i * 131 + 7) & 0xff);
  const double wt = stream(s, anydoor::transport::opcode::write, kChunk, kCount, 16);
  std::printf("one-sided    RDMA WRITE %llu x 64 KiB: %.2f GB/s\n", static_cast<unsigned long long>(kCount),
              static_cast<double>(kCount * kChunk) / wt / 1e9);
  const std::vector<std::byte> expect(s.buf.begin(), s.buf.begin() + static_cast<std::ptrdiff_t>(half));
  std::memset(s.buf.data(), 0, half);
  const double rt = stream(s, anydoor::transport::opcode::read, kChunk, kCount, 16);
  const bool same = std::memcmp(expect.data(), s.buf.data(), half) == 0;
  std::printf("one-sided    RDMA READ  %llu x 64 KiB: %.2f GB/s, read-back %s\n",
              static_cast<unsigned long long>(kCount), static_cast<double>(kCount * kChunk) / rt / 1e9,
              same ? "matches what was written" : "DIFFERS");

  // fetch_add on the first word of the peer's buffer (zero it first)
  std::memset(s.buf.data(), 0, 8);
  const anydoor::transport::sge zero = s.mr->slice(0, 8);
  s.post({.wr_id = 1, .op = anydoor::transport::opcode::write, .sg_list = {&zero, 1}, .remote_addr = s.peer.addr,
          .rkey = s.peer.rkey});
  s.wait();
  const anydoor::transport::sge result = s.mr->slice(8, 8);
  std::uint64_t last = 0;
  for (int i = 0; i < 1000; ++i) {
    s.post({.wr_id = 2, .op = anydoor::transport::opcode::fetch_add, .sg_list = {&result, 1},
            .remote_addr = s.peer.addr, .rkey = s.peer.rkey, .compare_add = 1});
    s.wait();
    std::memcpy(&last, s.buf.data() + 8, 8);
  }
  std::printf("atomics      1000 remote fetch_add: last value returned %llu (expected 999)\n",
              static_cast<unsigned long long>(last));
  return same && last == 999 ? 0 : 1;
}

}  // namespace

int main() {
  const session_options opt{.buffer_size = 32 << 20};
  int fds[2];
  if (::pipe(fds) != 0) return 1;
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(fds[0]);
    ::_exit(server(fds[1], opt));
  }
  ::close(fds[1]);
  std::uint16_t port = 0;
  if (::read(fds[0], &port, sizeof port) != sizeof port) {
    std::fprintf(stderr, "demo: the server process did not start\n");
    return 1;
  }
  int rc = 1;
  std::fflush(stdout);
  try {
    rc = client(port, opt);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "demo client: %s\n", e.what());
  }
  int status = 0;
  ::waitpid(child, &status, 0);  // the client's session closed: the server returns
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
  std::printf("demo %s\n", rc == 0 ? "passed" : "FAILED");
  std::fflush(stdout);
  return rc;
}
