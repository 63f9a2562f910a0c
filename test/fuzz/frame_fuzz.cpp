// libFuzzer target: the tcp provider's responder and requester fed arbitrary
// bytes by a peer. The input is split in two: bytes the peer sends before
// and after the queue pair posts a few requests of its own (so responses
// have something to match). A registered region sits at a fixed address
// between inaccessible guard pages: any access outside a registration
// crashes (and AddressSanitizer checks the rest).
#include "tcp/tcp_provider.hpp"
#include "tcp/wire.hpp"

#include <anydoor/transport/provider.hpp>

#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace tp = anydoor::transport;

namespace {

constexpr std::uintptr_t kRegionAddr = 0x500000000000;  // fixed (above ASan's shadow), so the fuzzer can learn it
constexpr std::size_t kPage = 4096;
constexpr std::size_t kRegion = 4 * kPage;

struct world {
  std::unique_ptr<tp::device> dev = tp::open_device({.provider = "tcp"});
  // Deterministic keys: the seeds aim at the first registration's rkey.
  std::unique_ptr<tp::protection_domain> pd = std::make_unique<anydoor::transport::tcp::tcp_pd>(0u);
  std::unique_ptr<tp::completion_queue> cq = dev->create_cq(4096);
  std::byte* region = nullptr;
  std::unique_ptr<tp::memory_region> mr;      // remote read/write/atomic
  std::unique_ptr<tp::memory_region> local;   // for the queue pair's own requests

  world() {
    void* p = ::mmap(reinterpret_cast<void*>(kRegionAddr - kPage), kRegion + 2 * kPage, PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (p == MAP_FAILED) {
      std::perror("mmap");
      std::abort();
    }
    region = static_cast<std::byte*>(p) + kPage;
    ::mprotect(region, kRegion, PROT_READ | PROT_WRITE);
    // key (1 << 18) | 1 = 262145: the first registration of a domain whose generations start at 0
    mr = pd->register_memory(region, kRegion / 2,
                             tp::access::local_write | tp::access::remote_write | tp::access::remote_read |
                                 tp::access::remote_atomic);
    local = pd->register_memory(region + kRegion / 2, kRegion / 2, tp::access::local_write);
  }
};

void drive(world& w, tp::queue_pair& qp) {
  tp::completion c[64];
  std::error_code ec;
  for (int i = 0; i < 64 && qp.state() != tp::qp_state::error; ++i) w.cq->poll(c, ec);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static world w;
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv) != 0) return 0;
  // Odd-sized inputs: the queue pair receives from a shared receive queue
  // (which keeps what one input left posted for the next).
  static auto srq = w.pd->create_srq({.max_wr = 64, .max_sge = 1});
  const bool shared = size % 2 == 1;
  auto qp = w.pd->create_qp({.send_cq = w.cq.get(), .recv_cq = w.cq.get(), .srq = shared ? srq.get() : nullptr,
                             .max_send_wr = 16, .max_recv_wr = 16, .rnr_retry = 1, .min_rnr_timer_us = 1});
  auto* tqp = dynamic_cast<anydoor::transport::tcp::tcp_qp*>(qp.get());
  if (tqp->attach_socket(sv[0], 16)) {
    ::close(sv[1]);
    return 0;
  }
  // Receives for incoming sends, then the peer's first bytes.
  std::byte* lbuf = w.region + kRegion / 2;
  tp::sge rsg{reinterpret_cast<std::uint64_t>(lbuf), 256, w.local->lkey()};
  tp::recv_request rr[4] = {{1, {&rsg, 1}}, {2, {&rsg, 1}}, {3, {&rsg, 1}}, {4, {&rsg, 1}}};
  if (shared) {
    srq->post_recv(rr);  // queue_full once 64 are left over: fine
  } else {
    qp->post_recv(rr);
  }
  const std::size_t split = size / 2;
  [[maybe_unused]] auto n1 = ::send(sv[1], data, split, MSG_NOSIGNAL);
  drive(w, *qp);
  // Requests of our own, so that responses in the second half can match.
  tp::sge ssg{reinterpret_cast<std::uint64_t>(lbuf + 512), 64, w.local->lkey()};
  tp::sge asg{reinterpret_cast<std::uint64_t>(lbuf + 1024), 8, w.local->lkey()};
  tp::work_request wrs[3] = {
      {.wr_id = 10, .op = tp::opcode::read, .sg_list = {&ssg, 1}, .remote_addr = 0x1000, .rkey = 1},
      {.wr_id = 11, .op = tp::opcode::send, .sg_list = {&ssg, 1}},
      {.wr_id = 12, .op = tp::opcode::fetch_add, .sg_list = {&asg, 1}, .remote_addr = 0x1000, .rkey = 1}};
  qp->post_send(wrs);
  [[maybe_unused]] auto n2 = ::send(sv[1], data + split, size - split, MSG_NOSIGNAL);
  drive(w, *qp);
  ::shutdown(sv[1], SHUT_WR);
  drive(w, *qp);
  qp.reset();
  ::close(sv[1]);
  // Drain what the destroyed queue pair left in the shared completion queue.
  tp::completion c[64];
  std::error_code ec;
  while (w.cq->poll(c, ec) > 0) {
  }
  if (ec) std::abort();  // an overflow here would be a provider bug
  return 0;
}
