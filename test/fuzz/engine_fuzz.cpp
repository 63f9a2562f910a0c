// libFuzzer targets that feed a live runtime a hostile peer's messages:
//   anydoor-fuzz-messages  the connection engine (runtime/protocol.hpp's
//                          headers: eager, split, rts, fin, credit, close,
//                          notify, auth) behind a server that receives, takes
//                          notifications and sends a rendezvous message;
//   anydoor-fuzz-rpc       the RPC server's request framing
//                          (runtime/rpc/wire.hpp) behind an rpc::server
//                          with an echo, a bulk and a large-reply method
//                          (built with ANYDOOR_FUZZ_RPC).
// A provider-level peer (tcp provider, in this process) connects to the
// runtime's acceptor with a proper hello, then sends the input as messages:
// a sequence of [u8 length][length bytes] (for rpc each is wrapped in an
// eager header, so the bytes are RPC frames). Its own memory sits at a fixed
// address with deterministic keys (rkey 262145), between guard pages, so
// that the fuzzer can aim rendezvous requests and bulk regions at it. After
// the input the peer disconnects, and the runtime must let the connection
// go within a second: an operation that never completes, or a connection
// never released, aborts like a crash.
#include "tcp/tcp_provider.hpp"

#include <anydoor/anydoor.hpp>
#ifdef ANYDOOR_FUZZ_RPC
#include <anydoor/rpc.hpp>
#endif

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace asio = boost::asio;
namespace ad = anydoor;
namespace tp = anydoor::transport;

namespace {

constexpr std::uintptr_t kPeerAddr = 0x510000000000;  // fixed (above ASan's shadow), so the fuzzer can learn it
constexpr std::size_t kPage = 4096;
constexpr std::size_t kPeerBytes = 16 * kPage;  // first half: remote read/write; second half: receives and sends
constexpr std::uint32_t kRecv = 264;            // the runtime's receive buffer: 8 + eager_limit 256
constexpr std::uint16_t kPeerCredits = 8;

[[noreturn]] void die(const char* why) {
  std::fprintf(stderr, "engine_fuzz: %s\n", why);
  std::abort();
}

ad::fabric_options server_options() {
  ad::fabric_options o;
  o.device.provider = "tcp";
  o.max_connections = 4;
  o.buffers_per_slab = 64;
  o.pool_max_bytes = std::size_t{4} << 20;
  o.connection.credits = 8;
  o.connection.eager_limit = 256;
  o.connection.max_message = 1 << 20;
  o.connection.rendezvous_memory = 64 * 1024;
  o.connection.handshake_timeout = std::chrono::milliseconds(1000);
  o.connection.buffer_wait = std::chrono::milliseconds(100);
  o.reactor.mode = ad::poll_mode::busy;
  o.reactor.spin_polls = 1;  // one provider poll per handler: drive() decides how long it runs
  return o;
}

#ifdef ANYDOOR_FUZZ_RPC
asio::awaitable<ad::rpc::status> bulk(ad::rpc::server_call& call) {
  std::vector<std::byte> buf(4096);
  const std::size_t n = std::min<std::size_t>(buf.size(), call.bulk().length);
  if (n == 0) co_return ad::rpc::status{};
  auto [ec, got] = co_await call.async_bulk_get(asio::buffer(buf.data(), n), asio::as_tuple(asio::use_awaitable));
  if (ec) co_return ad::rpc::status(ad::rpc::errc::internal, ec.message());
  call.reply(std::span(buf).first(got));
  co_return ad::rpc::status{};
}
#else
// A session: receive everything, take notifications, and send one message
// large enough for rendezvous (cookie 1: the fuzzer's fin can answer it).
void serve(ad::connection c) {
  auto conn = std::make_shared<ad::connection>(std::move(c));
  asio::co_spawn(conn->get_executor(), [conn]() -> asio::awaitable<void> {
    for (;;) {
      auto [ec, m] = co_await conn->async_receive(asio::as_tuple(asio::use_awaitable));
      if (ec) co_return;
    }
  }, asio::detached);
  asio::co_spawn(conn->get_executor(), [conn]() -> asio::awaitable<void> {
    for (;;) {
      auto [ec, n] = co_await conn->async_receive_notification(asio::as_tuple(asio::use_awaitable));
      if (ec) co_return;
    }
  }, asio::detached);
  asio::co_spawn(conn->get_executor(), [conn]() -> asio::awaitable<void> {
    static const std::vector<std::byte> big(600, std::byte{0x5a});
    (void)co_await conn->async_send(asio::buffer(big), asio::as_tuple(asio::use_awaitable));
  }, asio::detached);
}
#endif

struct world {
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> guard = asio::make_work_guard(io);
  ad::fabric server{io, server_options()};
  ad::acceptor acc = server.listen("127.0.0.1", 0);
  const std::uint16_t port = acc.port();
#ifdef ANYDOOR_FUZZ_RPC
  ad::rpc::server rpc{{.max_concurrent_calls = 8}};
#endif
  // the peer
  std::unique_ptr<tp::device> dev = tp::open_device({.provider = "tcp"});
  std::unique_ptr<tp::protection_domain> pd = std::make_unique<tp::tcp::tcp_pd>(0u);
  std::unique_ptr<tp::completion_queue> cq = dev->create_cq(256);
  std::byte* mem = nullptr;
  std::unique_ptr<tp::memory_region> exposed;  // rkey 262145: the first key of a deterministic domain
  std::unique_ptr<tp::memory_region> local;

  world() {
    void* p = ::mmap(reinterpret_cast<void*>(kPeerAddr - kPage), kPeerBytes + 2 * kPage, PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (p == MAP_FAILED) die("mmap");
    mem = static_cast<std::byte*>(p) + kPage;
    ::mprotect(mem, kPeerBytes, PROT_READ | PROT_WRITE);
    exposed = pd->register_memory(mem, kPeerBytes / 2,
                                  tp::access::local_write | tp::access::remote_read | tp::access::remote_write |
                                      tp::access::remote_atomic);
    local = pd->register_memory(mem + kPeerBytes / 2, kPeerBytes / 2, tp::access::local_write);
#ifdef ANYDOOR_FUZZ_RPC
    rpc.add(1, [](ad::rpc::server_call& call) -> ad::rpc::status {
      call.reply(call.request());
      return {};
    });
    rpc.add(2, [](ad::rpc::server_call& call) { return bulk(call); });
    rpc.add(3, [](ad::rpc::server_call& call) -> ad::rpc::status {  // a reply too large to go eagerly
      static const std::vector<std::byte> big(1000, std::byte{0x33});
      call.reply(big);
      return {};
    });
    rpc.async_serve(std::move(acc), asio::detached);
#else
    accept_next();
#endif
  }
#ifndef ANYDOOR_FUZZ_RPC
  void accept_next() {
    acc.async_accept([this](ad::error_code ec, ad::connection c) {
      if (ec) return;
      serve(std::move(c));
      accept_next();
    });
  }
#endif

  void drive(int rounds) {
    std::array<tp::completion, 32> wc;
    std::error_code ec;
    for (int i = 0; i < rounds; ++i) {
      // poll_one: the busy reactor re-posts itself, so poll() would never return.
      for (int k = 0; k < 8 && io.poll_one() != 0; ++k) {
      }
      (void)cq->poll(wc, ec);
    }
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static world w;
  auto qp = w.pd->create_qp({.send_cq = w.cq.get(), .recv_cq = w.cq.get(), .max_send_wr = 64, .max_recv_wr = 16,
                             .max_send_sge = 1, .max_recv_sge = 1, .max_inline_data = 0});
  if (qp->modify(tp::qp_state::init)) die("init");
  std::byte* const area = w.mem + kPeerBytes / 2;
  std::array<tp::sge, kPeerCredits> rsg{};
  std::array<tp::recv_request, kPeerCredits> rr{};
  for (std::uint32_t i = 0; i < kPeerCredits; ++i) {
    rsg[i] = w.local->slice(i * kRecv, kRecv);
    rr[i] = {.wr_id = 100 + i, .sg_list = {&rsg[i], 1}};
  }
  if (qp->post_recv(rr)) die("post_recv");
  // The runtime's hello (protocol.hpp, version 8, no authentication).
  std::array<std::byte, 50> hello{};  // keepalive 0: no heartbeats asked
  const std::uint32_t magic = 0x31524441, recv_buffer = kRecv, eager = kRecv - 8;
  const std::uint16_t version = 8, credits = kPeerCredits;
  const std::uint64_t max_message = 1 << 20;
  std::memcpy(hello.data(), &magic, 4);
  std::memcpy(hello.data() + 4, &version, 2);
  hello[6] = std::byte{1};
  std::memcpy(hello.data() + 8, &credits, 2);
  std::memcpy(hello.data() + 12, &recv_buffer, 4);
  std::memcpy(hello.data() + 16, &eager, 4);
  std::memcpy(hello.data() + 20, &max_message, 8);
  std::memcpy(hello.data() + 48, &credits, 2);  // max credits: the window is what it grants
  tp::connect_result res;
  std::atomic<bool> connected{false};
  std::thread t([&] {
    res = w.dev->connect(*qp, "127.0.0.1", w.port, hello, std::chrono::seconds(5));
    connected = true;
  });
  while (!connected) w.drive(1);
  t.join();
  if (res.ec) die("the peer could not connect");

  // The input, message by message.
  std::byte* const out = area + kPeerCredits * kRecv;
  std::size_t at = 0;
  std::uint64_t n = 0;
  tp::sge ssg{};
  while (at < size) {
    const std::size_t len = std::min<std::size_t>(data[at], size - at - 1);
    const std::uint8_t* body = data + at + 1;
    at += 1 + len;
    std::byte* slot = out + (n % 32) * 512;
    std::size_t wire = len;
#ifdef ANYDOOR_FUZZ_RPC
    // An eager message (type 1; the hello granted every credit already).
    const std::array<std::uint8_t, 8> eager_header{1, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(slot, eager_header.data(), 8);
    std::memcpy(slot + 8, body, len);
    wire += 8;
#else
    std::memcpy(slot, body, len);
#endif
    ssg = {reinterpret_cast<std::uint64_t>(slot), static_cast<std::uint32_t>(wire), w.local->lkey()};
    const tp::work_request wr{.wr_id = n++, .op = tp::opcode::send, .sg_list = {&ssg, 1}};
    if (qp->post_send({&wr, 1})) break;  // the queue pair failed (the runtime dropped it): nothing more goes
    w.drive(2);
  }
  w.drive(30);
  qp.reset();  // the peer disconnects
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (w.server.stats().connections != 0) {
    if (std::chrono::steady_clock::now() > deadline) die("the runtime did not release a connection whose peer left");
    w.drive(8);
  }
  return 0;
}
