// GPU device memory through the runtime, on machines without a GPU: host
// memory the CPU must not touch stands in for it (support/
// fake_device_memory.hpp: its addresses are mapped PROT_NONE, so a path
// that loads or stores them directly crashes the test), installed as the
// runtime's test backend in place of the CUDA driver. Sends and receives
// (eager and rendezvous) and puts and gets (plain buffers and registered
// regions) on it, in every direction, with byte checks, and the errors:
// managed memory refused, atomics on it refused, a failed copy reported.
// test/gpu/gpu.cpp runs the same paths on a real GPU where one exists.
#include "../support/fake_device_memory.hpp"
#include "../support/runtime.hpp"

#include "cuda/driver.hpp"

#include <anydoor/anydoor.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

namespace {

namespace asio = boost::asio;
namespace ad = anydoor;
using anydoor::memory_kind;
using anydoor::test::fake_copier;
using anydoor::test::fake_device_memory;

// The runtime's view: fake device memory is cuda_device, `managed` (host
// memory) is cuda_managed, the rest is host memory.
class fake_backend final : public ad::cuda::detail::test_backend {
 public:
  fake_backend(fake_device_memory& m, std::span<std::byte> managed)
      : m_(m), managed_(managed), copier_(std::make_shared<fake_copier>(m)) {
    ad::cuda::detail::use_test_backend(this);
  }
  ~fake_backend() override { ad::cuda::detail::use_test_backend(nullptr); }
  fake_backend(const fake_backend&) = delete;
  fake_backend& operator=(const fake_backend&) = delete;

  memory_kind kind(const void* p) noexcept override {
    if (m_.contains(p, 1)) return memory_kind::cuda_device;
    const auto* b = static_cast<const std::byte*>(p);
    if (b >= managed_.data() && b < managed_.data() + managed_.size()) return memory_kind::cuda_managed;
    return memory_kind::host;
  }
  std::error_code to_host(void* dst, const void* src, std::size_t n) noexcept override {
    return copier_->to_host(dst, src, n);
  }
  std::error_code to_device(void* dst, const void* src, std::size_t n) noexcept override {
    return copier_->to_device(dst, src, n);
  }
  std::shared_ptr<ad::transport::memory_copier> copier(const void*, std::size_t) override {
    ++registrations;  // GPU memory registered with the device (its copies reach it directly)
    return copier_;
  }
  int registrations = 0;
  fake_copier& the_copier() noexcept { return *copier_; }

 private:
  fake_device_memory& m_;
  std::span<std::byte> managed_;
  std::shared_ptr<fake_copier> copier_;
};

void fill(std::byte* p, std::size_t n, unsigned seed) {
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>((i * 151 + seed) >> 2);
}

// The server of a test whose client only puts: it accepts, then waits
// for the client's close.
asio::awaitable<void> accept_until_closed(ad::acceptor& acc) {
  ad::connection s = co_await acc.async_accept(asio::use_awaitable);
  auto [e, m] = co_await s.async_receive(asio::as_tuple(asio::use_awaitable));
  (void)m;
  CHECK(e == ad::errc::connection_closed);
}

// The fake is reachable by copies only: the tcp provider's way. A verbs
// device (rxe, siw) has no way into GPU memory at all.
bool skipped_off_tcp() {
  if (anydoor::test::provider_under_test() == "tcp") return false;
  WARN("skipped: GPU memory stand-in needs the tcp provider's copies; " << anydoor::test::provider_under_test()
                                                                          << " devices here have no GPUDirect");
  return true;
}

// A server with a host region (remote) and a client whose fabric stages
// every GPU transfer in chunks of `chunk` bytes through two buffers; the
// server accepts one connection and holds it until the client closes.
struct staged_pair {
  asio::io_context io;
  ad::fabric server;
  ad::fabric client;
  std::vector<std::byte> host;
  ad::memory_region region;
  ad::remote_region remote;
  ad::acceptor acc;
  anydoor::test::failure f;
  bool clean_end = true;  // false: the client aborts (the server's receive ends with a flush)

  static ad::fabric_options staging_options(std::size_t chunk) {
    ad::fabric_options o = anydoor::test::test_options();
    o.gpu_staging = true;
    o.gpu_staging_chunk = chunk;
    o.gpu_staging_buffers = 2;
    return o;
  }
  staged_pair(std::size_t chunk, std::size_t size)
      : server(io, anydoor::test::test_options()),
        client(io, staging_options(chunk)),
        host(size),
        region(server.register_memory(std::span(host), ad::access::local_write | ad::access::remote_write |
                                                           ad::access::remote_read)),
        remote(region.remote()),
        acc(server.listen(anydoor::test::test_host(), 0)) {
    asio::co_spawn(io, [this]() -> asio::awaitable<void> {
      ad::connection s = co_await acc.async_accept(asio::use_awaitable);
      auto [e, m] = co_await s.async_receive(asio::as_tuple(asio::use_awaitable));  // the client's goodbye
      (void)m;
      if (clean_end) CHECK(e == ad::errc::connection_closed);
      CHECK(e);
    }, f.handler());
  }
};

// Two connections of one client fabric (two staging buffers, chunks of
// `chunk` bytes: one transfer holds both) to a server with two host
// regions of `size` bytes; the server reads each connection to its end.
struct two_staged_connections {
  asio::io_context io;
  ad::fabric server;
  ad::fabric client;
  std::vector<std::byte> first, second;
  ad::memory_region r1, r2;
  ad::acceptor acc;
  anydoor::test::failure f;
  bool clean_end = true;  // the server's reads end with connection_closed

  two_staged_connections(std::size_t chunk, std::size_t size)
      : server(io, anydoor::test::test_options()),
        client(io, staged_pair::staging_options(chunk)),
        first(size),
        second(size),
        r1(server.register_memory(std::span(first), ad::access::local_write | ad::access::remote_write)),
        r2(server.register_memory(std::span(second), ad::access::local_write | ad::access::remote_write)),
        acc(server.listen(anydoor::test::test_host(), 0)) {
    asio::co_spawn(io, [this]() -> asio::awaitable<void> {
      std::vector<ad::connection> held;
      for (int i = 0; i < 2; ++i) held.push_back(co_await acc.async_accept(asio::use_awaitable));
      for (auto& s : held) {
        for (;;) {  // (messages, then the end)
          auto [e, m] = co_await s.async_receive(asio::as_tuple(asio::use_awaitable));
          (void)m;
          if (!e) continue;
          if (clean_end) CHECK(e == ad::errc::connection_closed);
          break;
        }
      }
    }, f.handler());
  }
};

}  // namespace

TEST_CASE("device memory: sends receives puts and gets move GPU bytes in every direction", "[device_memory]") {
  // 1 B and 4 KiB go eagerly (copied through pool buffers), 20000 B from
  // host memory split (copied into device memory piece by piece; from
  // device memory by rendezvous), 100000 B and up by rendezvous (the
  // receiver reads registered device memory), 16 MiB through the
  // provider's bounce in many pieces.
  const std::size_t size = GENERATE(std::size_t{1}, std::size_t{4096}, std::size_t{20000}, std::size_t{100000},
                                    std::size_t{(1 << 20) + 3}, std::size_t{16 << 20});
  // Direct (the provider's copies), or staging forced: messages through
  // host copies, plain-buffer puts and gets through the pipeline.
  const bool staging = GENERATE(false, true);
  INFO(size << " bytes" << (staging ? ", staging forced" : ""));
  if (skipped_off_tcp()) return;
  // Both sides' GPU memory: the client's first half, the server's second.
  const std::size_t half = 2 * size + 8192;
  fake_device_memory dev(2 * half);
  std::vector<std::byte> managed(4096);
  fake_backend backend(dev, managed);
  std::byte* cdev = dev.dev();         // client: [0, size) source, [size + 4096, ...) destination
  std::byte* sdev = dev.dev() + half;  // server: likewise
  std::vector<std::byte> host(2 * size + 64);

  asio::io_context io;
  ad::fabric_options opt = anydoor::test::test_options();
  opt.gpu_staging = staging;
  ad::fabric server(io, opt);
  ad::fabric client(io, opt);
  ad::acceptor acc = server.listen(anydoor::test::test_host(), 0);
  anydoor::test::failure f;
  // The server's GPU memory as a region the client puts to and gets from.
  ad::memory_region sregion = server.register_memory({sdev + size + 4096, size}, ad::access::local_write |
                                                                                  ad::access::remote_write |
                                                                                  ad::access::remote_read);
  CHECK(sregion.kind() == memory_kind::cuda_device);
  const ad::remote_region sremote = sregion.remote();
  bool done = false;
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    ad::connection s = co_await acc.async_accept(asio::use_awaitable);
    // 1: client device -> server device
    auto [e1, n1] = co_await s.async_receive(asio::mutable_buffer(sdev + size + 4096, size),
                                             asio::as_tuple(asio::use_awaitable));
    CHECK(!e1);
    CHECK(n1 == size);
    const bool got1 = std::memcmp(dev.view() + half + size + 4096, dev.view(), size) == 0;
    CHECK(got1);
    // 2: client host -> server device (at another offset)
    auto [e2, n2] = co_await s.async_receive(asio::mutable_buffer(sdev + 7, size), asio::as_tuple(asio::use_awaitable));
    CHECK(!e2);
    CHECK(n2 == size);
    // 3: server device -> client host
    auto [e3, n3] = co_await s.async_send(asio::const_buffer(sdev + 7, size), asio::as_tuple(asio::use_awaitable));
    CHECK(!e3);
    (void)n3;
    auto [e4, m] = co_await s.async_receive(asio::as_tuple(asio::use_awaitable));  // the client's goodbye
    (void)m;
    CHECK(e4 == ad::errc::connection_closed);
  }, f.handler());
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    ad::connection c = co_await client.async_connect(anydoor::test::addr(acc), asio::use_awaitable);
    fill(dev.view(), size, 1);  // the client's source
    auto [e1, n1] = co_await c.async_send(asio::const_buffer(cdev, size), asio::as_tuple(asio::use_awaitable));
    CHECK(!e1);
    (void)n1;
    fill(host.data(), size, 2);
    auto [e2, n2] = co_await c.async_send(asio::const_buffer(host.data(), size), asio::as_tuple(asio::use_awaitable));
    CHECK(!e2);
    (void)n2;
    auto [e3, n3] = co_await c.async_receive(asio::mutable_buffer(host.data() + size, size),
                                             asio::as_tuple(asio::use_awaitable));
    CHECK(!e3);
    CHECK(n3 == size);
    const bool got3 = std::memcmp(host.data() + size, host.data(), size) == 0;  // 2's bytes, back from device memory
    CHECK(got3);
    // One-sided, plain buffers through the registration cache: put from
    // client device memory into the server's device region, get it back
    // into client device memory, and put and get host memory to it.
    fill(dev.view(), size, 3);
    auto [e5, x5] = co_await c.async_put(asio::const_buffer(cdev, size), sremote, asio::as_tuple(asio::use_awaitable));
    CHECK(!e5);
    (void)x5;
    const bool put_ok = std::memcmp(dev.view() + half + size + 4096, dev.view(), size) == 0;
    CHECK(put_ok);
    auto [e6, x6] = co_await c.async_get(asio::mutable_buffer(cdev + size + 4096, size), sremote,
                                     asio::as_tuple(asio::use_awaitable));
    CHECK(!e6);
    (void)x6;
    const bool get_ok = std::memcmp(dev.view() + size + 4096, dev.view(), size) == 0;
    CHECK(get_ok);
    fill(host.data(), size, 4);
    auto [e7, x7] = co_await c.async_put(asio::const_buffer(host.data(), size), sremote, asio::as_tuple(asio::use_awaitable));
    CHECK(!e7);
    (void)x7;
    auto [e8, x8] = co_await c.async_get(asio::mutable_buffer(host.data() + size, size), sremote,
                                     asio::as_tuple(asio::use_awaitable));
    CHECK(!e8);
    (void)x8;
    co_await c.async_close(asio::use_awaitable);
    done = true;
  }, f.handler());
  anydoor::test::run_to_completion(io);
  f.check();
  REQUIRE(done);
  std::vector<std::byte> want(size);
  fill(want.data(), size, 2);
  CHECK(std::memcmp(dev.view() + half + 7, want.data(), size) == 0);  // 2 arrived in server device memory
  CHECK(std::memcmp(host.data() + size, dev.view() + half + size + 4096, size) == 0);  // the last get
  CHECK_FALSE(backend.the_copier().bad_range);
  // Staging forced: no GPU memory but the server's region was registered
  // with the device (everything else went through host memory).
  if (staging) CHECK(backend.registrations == 1);
  if (!staging && size > 8192) CHECK(backend.registrations > 1);
  CHECK(backend.the_copier().to_host_bytes >= 3 * size);
  CHECK(backend.the_copier().to_device_bytes >= 3 * size);
}

TEST_CASE("device memory: managed memory and atomics are refused, a failed copy fails only its operation",
          "[device_memory]") {
  if (skipped_off_tcp()) return;
  fake_device_memory dev(1 << 20);
  std::vector<std::byte> managed(4096);
  fake_backend backend(dev, managed);
  fake_copier& copier = backend.the_copier();
  std::vector<std::byte> host(4096);

  asio::io_context io;
  ad::fabric server(io, anydoor::test::test_options());
  ad::fabric client(io, anydoor::test::test_options());
  // Atomics need direct access; the tcp provider reaches GPU memory by copies.
  try {
    (void)server.register_memory({dev.dev(), 4096}, ad::access::local_write | ad::access::remote_atomic);
    FAIL("GPU memory registered for atomics on tcp");
  } catch (const std::system_error& e) {
    CHECK(e.code() == ad::errc::not_supported);
  }
  try {
    (void)server.register_memory(std::span(managed), ad::access::local_write);
    FAIL("managed memory registered");
  } catch (const std::system_error& e) {
    CHECK(e.code() == ad::errc::not_supported);
  }
  ad::memory_region target = server.register_memory(std::span(host), ad::access::local_write | ad::access::remote_write);
  const ad::remote_region remote = target.remote();
  ad::acceptor acc = server.listen(anydoor::test::test_host(), 0);
  anydoor::test::failure f;
  bool done = false;
  std::byte* sdev = dev.dev() + (512 << 10);
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    ad::connection s = co_await acc.async_accept(asio::use_awaitable);
    // The first message: its copy into device memory fails.
    copier.fail_after = 0;
    auto [e1, n1] = co_await s.async_receive(asio::mutable_buffer(sdev, 4096), asio::as_tuple(asio::use_awaitable));
    CHECK(e1 == ad::errc::device_copy_failed);
    (void)n1;
    copier.fail_after = -1;
    // The next one arrives as sent.
    auto [e2, n2] = co_await s.async_receive(asio::mutable_buffer(sdev, 4096), asio::as_tuple(asio::use_awaitable));
    CHECK(!e2);
    CHECK(n2 == 200);
    const bool second = std::all_of(dev.view() + (512 << 10), dev.view() + (512 << 10) + 200,
                                    [](std::byte b) { return b == std::byte{0x22}; });
    CHECK(second);
    auto [e3, m3] = co_await s.async_receive(asio::as_tuple(asio::use_awaitable));  // the third message
    CHECK(!e3);
    CHECK(m3.size() == 300);
    const bool third = std::all_of(m3.data(), m3.data() + m3.size(), [](std::byte x) { return x == std::byte{0x33}; });
    CHECK(third);
    auto [e4, m4] = co_await s.async_receive(asio::as_tuple(asio::use_awaitable));  // the client's goodbye
    (void)m4;
    CHECK(e4 == ad::errc::connection_closed);
  }, f.handler());
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    ad::connection c = co_await client.async_connect(anydoor::test::addr(acc), asio::use_awaitable);
    std::vector<std::byte> first(100, std::byte{0x11});
    auto [e1, n1] = co_await c.async_send(asio::buffer(first), asio::as_tuple(asio::use_awaitable));
    CHECK(!e1);
    (void)n1;
    std::vector<std::byte> second(200, std::byte{0x22});
    auto [e2, n2] = co_await c.async_send(asio::buffer(second), asio::as_tuple(asio::use_awaitable));
    CHECK(!e2);
    (void)n2;
    // Managed memory: refused for sends, receives and one-sided operations.
    auto [e5, n5] = co_await c.async_send(asio::buffer(managed.data(), 64), asio::as_tuple(asio::use_awaitable));
    CHECK(e5 == ad::errc::not_supported);
    (void)n5;
    auto [e6, x6] = co_await c.async_put(asio::const_buffer(managed.data(), 64), remote, asio::as_tuple(asio::use_awaitable));
    CHECK(e6 == ad::errc::not_supported);
    (void)x6;
    // A send whose copy out of device memory fails ends with the error and
    // sends nothing; the connection goes on.
    std::memset(dev.view(), 0x33, 300);
    copier.fail_after = 0;
    auto [e7, n7] = co_await c.async_send(asio::const_buffer(dev.dev(), 300), asio::as_tuple(asio::use_awaitable));
    CHECK(e7 == ad::errc::device_copy_failed);
    (void)n7;
    copier.fail_after = -1;
    auto [e8, n8] = co_await c.async_send(asio::const_buffer(dev.dev(), 300), asio::as_tuple(asio::use_awaitable));
    CHECK(!e8);
    (void)n8;
    co_await c.async_close(asio::use_awaitable);
    done = true;
  }, f.handler());
  anydoor::test::run_to_completion(io);
  f.check();
  CHECK(done);
  CHECK_FALSE(copier.bad_range);
}

TEST_CASE("device memory: the staging pipeline moves puts and gets in order in chunks through two buffers",
          "[device_memory]") {
  // (Any provider: only host memory meets the device.)
  constexpr std::size_t kChunk = 4096;
  constexpr std::size_t kSize = 25 * kChunk + 123;  // 26 chunks, the last one short
  fake_device_memory dev(4 * kSize);
  std::vector<std::byte> managed(4096);
  fake_backend backend(dev, managed);
  fake_copier& copier = backend.the_copier();
  std::byte* src = dev.dev() + 3;  // odd offsets
  std::byte* dst = dev.dev() + kSize + 8192 + 5;
  fill(dev.view() + 3, kSize, 9);
  // Staging forced with a small chunk: the device (tcp) could reach the
  // memory itself, so this also shows the option's effect: no copy of the
  // provider's (those are whole-transfer sized or 64 KiB pieces) appears.
  staged_pair sp(kChunk, kSize);
  std::vector<std::byte>& host = sp.host;
  ad::fabric& server = sp.server;
  ad::fabric& client = sp.client;
  const ad::remote_region remote = sp.remote;
  bool done = false;
  std::vector<fake_copier::copy_record> put_log, get_log;
  asio::co_spawn(sp.io, [&]() -> asio::awaitable<void> {
    ad::connection c = co_await client.async_connect(anydoor::test::addr(sp.acc), asio::use_awaitable);
    copier.clear_log();
    auto [e1, n1] = co_await c.async_put(asio::const_buffer(src, kSize), remote, asio::as_tuple(asio::use_awaitable));
    CHECK(!e1);
    CHECK(n1 == kSize);
    put_log = copier.log();
    const bool put_ok = std::memcmp(host.data(), dev.view() + 3, kSize) == 0;
    CHECK(put_ok);
    // Back into other GPU memory.
    copier.clear_log();
    auto [e2, n2] = co_await c.async_get(asio::mutable_buffer(dst, kSize), remote, asio::as_tuple(asio::use_awaitable));
    CHECK(!e2);
    CHECK(n2 == kSize);
    get_log = copier.log();
    const bool get_ok = std::memcmp(dev.view() + kSize + 8192 + 5, dev.view() + 3, kSize) == 0;
    CHECK(get_ok);
    // Two at once: the second waits behind the first (held; see below), then runs.
    fill(dev.view() + 3, kSize, 10);
    std::vector<std::byte> host2(kSize);
    ad::memory_region r2 = server.register_memory(std::span(host2), ad::access::local_write | ad::access::remote_write);
    int ended = 0;
    boost::system::error_code ea, eb;
    c.async_put(asio::const_buffer(src, kSize), remote, [&](boost::system::error_code ec, std::size_t) {
      ea = ec;
      ++ended;
    });
    c.async_put(asio::const_buffer(src, kSize), r2.remote(), [&](boost::system::error_code ec, std::size_t) {
      eb = ec;
      ++ended;
    });
    while (ended < 2) co_await asio::post(sp.io, asio::use_awaitable);
    CHECK(!ea);
    CHECK(!eb);
    const bool both = std::memcmp(host.data(), dev.view() + 3, kSize) == 0 && host2 == host;
    CHECK(both);
    co_await c.async_close(asio::use_awaitable);
    done = true;
  }, sp.f.handler());
  anydoor::test::run_to_completion(sp.io);
  sp.f.check();
  REQUIRE(done);
  // The chunks, each copied once, in order: out of the GPU for the put,
  // into it for the get.
  auto in_order = [&](const std::vector<fake_copier::copy_record>& log, std::size_t base, bool to_host) {
    std::size_t off = 0;
    for (const auto& r : log) {
      if (r.offset != base + off || r.length != std::min(kChunk, kSize - off) || r.to_host != to_host) return false;
      off += r.length;
    }
    return off == kSize;
  };
  CHECK(put_log.size() == 26);
  CHECK(in_order(put_log, 3, true));
  CHECK(get_log.size() == 26);
  CHECK(in_order(get_log, kSize + 8192 + 5, false));
  CHECK(client.stats().cache.registrations == 0);  // the staging buffers are one registration, made once
}

TEST_CASE("device memory: a staged transfer that fails ends with the error, frees its buffers, and the next one works",
          "[device_memory]") {
  // (Any provider: only host memory meets the device.)
  constexpr std::size_t kChunk = 4096;
  constexpr std::size_t kSize = 10 * kChunk;
  fake_device_memory dev(2 * kSize);
  std::vector<std::byte> managed(4096);
  fake_backend backend(dev, managed);
  fake_copier& copier = backend.the_copier();
  staged_pair sp(kChunk, kSize);
  std::vector<std::byte>& host = sp.host;
  ad::fabric& client = sp.client;
  const ad::remote_region remote = sp.remote;
  bool done = false;
  asio::co_spawn(sp.io, [&]() -> asio::awaitable<void> {
    ad::connection c = co_await client.async_connect(anydoor::test::addr(sp.acc), asio::use_awaitable);
    // A copy out of the GPU fails at the fourth chunk.
    copier.fail_after = 3;
    auto [e1, n1] = co_await c.async_put(asio::const_buffer(dev.dev(), kSize), remote, asio::as_tuple(asio::use_awaitable));
    CHECK(e1 == ad::errc::device_copy_failed);
    CHECK(n1 == 0);
    // A copy into the GPU fails at once.
    copier.fail_after = 0;
    auto [e2, n2] = co_await c.async_get(asio::mutable_buffer(dev.dev(), kSize), remote, asio::as_tuple(asio::use_awaitable));
    CHECK(e2 == ad::errc::device_copy_failed);
    (void)n2;
    copier.fail_after = -1;
    // Beyond the remote region: refused before anything moves.
    auto [e3, n3] = co_await c.async_put(asio::const_buffer(dev.dev(), kSize), remote.at(kChunk, kSize - kChunk),
                                         asio::as_tuple(asio::use_awaitable));
    CHECK(e3 == ad::errc::out_of_range);
    (void)n3;
    // A get into read-only memory: refused.
    auto [e4, n4] = co_await c.async_get(ad::local_range(asio::const_buffer(dev.dev(), kSize)), remote,
                                         asio::as_tuple(asio::use_awaitable));
    CHECK(e4 == ad::errc::invalid_argument);
    (void)n4;
    // The buffers came back: a whole transfer goes through.
    fill(dev.view(), kSize, 12);
    auto [e5, n5] = co_await c.async_put(asio::const_buffer(dev.dev(), kSize), remote, asio::as_tuple(asio::use_awaitable));
    CHECK(!e5);
    CHECK(n5 == kSize);
    const bool ok = std::memcmp(host.data(), dev.view(), kSize) == 0;
    CHECK(ok);
    co_await c.async_close(asio::use_awaitable);
    done = true;
  }, sp.f.handler());
  anydoor::test::run_to_completion(sp.io);
  sp.f.check();
  CHECK(done);
}

TEST_CASE("device memory: a staged rendezvous message whose copy fails ends with device_copy_failed on its side only",
          "[device_memory]") {
  // (Any provider: only host memory meets the device.)
  constexpr std::size_t kSize = 100000;  // rendezvous (above the eager limit)
  fake_device_memory dev(4 * kSize);
  std::vector<std::byte> managed(4096);
  fake_backend backend(dev, managed);
  fake_copier& copier = backend.the_copier();
  std::byte* cdev = dev.dev();
  std::byte* sdev = dev.dev() + 2 * kSize;
  asio::io_context io;
  ad::fabric_options opt = anydoor::test::test_options();
  opt.gpu_staging = true;  // both sides: host copies of the whole message
  ad::fabric server(io, opt);
  ad::fabric client(io, opt);
  ad::acceptor acc = server.listen(anydoor::test::test_host(), 0);
  anydoor::test::failure f;
  bool done = false;
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    ad::connection s = co_await acc.async_accept(asio::use_awaitable);
    // B arrives (A never left); its copy into GPU memory fails.
    auto [e1, n1] = co_await s.async_receive(asio::mutable_buffer(sdev, kSize), asio::as_tuple(asio::use_awaitable));
    CHECK(e1 == ad::errc::device_copy_failed);
    CHECK(n1 == 0);
    // C arrives whole.
    auto [e2, n2] = co_await s.async_receive(asio::mutable_buffer(sdev, kSize), asio::as_tuple(asio::use_awaitable));
    CHECK(!e2);
    CHECK(n2 == kSize);
    const bool c_ok = std::all_of(dev.view() + 2 * kSize, dev.view() + 3 * kSize,
                                  [](std::byte b) { return b == std::byte{0x55}; });
    CHECK(c_ok);
    auto [e3, m] = co_await s.async_receive(asio::as_tuple(asio::use_awaitable));
    (void)m;
    CHECK(e3 == ad::errc::connection_closed);
  }, f.handler());
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    ad::connection c = co_await client.async_connect(anydoor::test::addr(acc), asio::use_awaitable);
    // A: its copy out of GPU memory fails; nothing is sent.
    std::memset(dev.view(), 0x33, kSize);
    copier.only_to_host = true;
    copier.fail_once = true;
    copier.fail_after = 0;
    auto [e1, n1] = co_await c.async_send(asio::const_buffer(cdev, kSize), asio::as_tuple(asio::use_awaitable));
    CHECK(e1 == ad::errc::device_copy_failed);
    (void)n1;
    // B: sent whole; the receiver's copy into its GPU memory fails (its
    // side reports it; the send completes: the bytes were read).
    copier.only_to_host = false;
    copier.only_to_device = true;
    copier.fail_after = 0;
    std::memset(dev.view(), 0x44, kSize);
    auto [e2, n2] = co_await c.async_send(asio::const_buffer(cdev, kSize), asio::as_tuple(asio::use_awaitable));
    CHECK(!e2);
    (void)n2;
    std::memset(dev.view(), 0x55, kSize);
    auto [e3, n3] = co_await c.async_send(asio::const_buffer(cdev, kSize), asio::as_tuple(asio::use_awaitable));
    CHECK(!e3);
    (void)n3;
    co_await c.async_close(asio::use_awaitable);
    done = true;
  }, f.handler());
  anydoor::test::run_to_completion(io);
  f.check();
  CHECK(done);
}

TEST_CASE("device memory: the staging options are checked, the bounce threshold stages small transfers only, and a "
          "close waits for a staged put",
          "[device_memory]") {
  auto refused = [](auto change) {
    asio::io_context io;
    ad::fabric_options o = anydoor::test::test_options();
    change(o);
    try {
      ad::fabric f(io, o);
    } catch (const std::system_error& e) {
      return e.code() == ad::errc::invalid_argument;
    }
    return false;
  };
  CHECK(refused([](ad::fabric_options& o) { o.gpu_staging_chunk = 4095; }));
  CHECK(refused([](ad::fabric_options& o) { o.gpu_staging_chunk = (std::size_t{1} << 30) + 1; }));
  CHECK(refused([](ad::fabric_options& o) { o.gpu_staging_buffers = 1; }));
  CHECK(refused([](ad::fabric_options& o) { o.gpu_staging_buffers = 1025; }));
  CHECK(refused([](ad::fabric_options& o) { o.gpu_bounce_threshold = (std::size_t{1} << 30) + 1; }));
  CHECK(refused([](ad::fabric_options& o) {
    o.gpu_staging_chunk = std::size_t{1} << 30;
    o.gpu_staging_buffers = 17;
  }));
  if (skipped_off_tcp()) return;  // (the rest needs GPU memory registered directly: tcp's copies)

  constexpr std::size_t kSize = 1 << 20;
  fake_device_memory dev(2 * kSize);
  std::vector<std::byte> managed(4096);
  fake_backend backend(dev, managed);
  std::vector<std::byte> host(kSize);
  asio::io_context io;
  ad::fabric_options opt = anydoor::test::test_options();
  opt.gpu_bounce_threshold = 4096;
  ad::fabric server(io, anydoor::test::test_options());
  ad::fabric client(io, opt);
  ad::memory_region region = server.register_memory(std::span(host), ad::access::local_write | ad::access::remote_write);
  const ad::remote_region remote = region.remote();
  ad::acceptor acc = server.listen(anydoor::test::test_host(), 0);
  anydoor::test::failure f;
  bool done = false;
  int small_registrations = -1, large_registrations = -1;
  boost::system::error_code last_put;
  asio::co_spawn(io, accept_until_closed(acc), f.handler());
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    ad::connection c = co_await client.async_connect(anydoor::test::addr(acc), asio::use_awaitable);
    fill(dev.view(), kSize, 21);
    // 4096 bytes: through the staging buffers (no registration of GPU memory).
    auto [e1, n1] = co_await c.async_put(asio::const_buffer(dev.dev(), 4096), remote, asio::as_tuple(asio::use_awaitable));
    CHECK(!e1);
    (void)n1;
    small_registrations = backend.registrations;
    // 4097 bytes: GPU memory registered (the provider's copies).
    auto [e2, n2] = co_await c.async_put(asio::const_buffer(dev.dev(), 4097), remote, asio::as_tuple(asio::use_awaitable));
    CHECK(!e2);
    (void)n2;
    large_registrations = backend.registrations;
    // A staged put not waited for, then the close: the close waits for it.
    fill(dev.view(), kSize, 22);
    c.async_put(asio::const_buffer(dev.dev(), 4096), remote,
                [&](boost::system::error_code ec, std::size_t) { last_put = ec; });
    co_await c.async_close(asio::use_awaitable);
    done = true;
  }, f.handler());
  anydoor::test::run_to_completion(io);
  f.check();
  CHECK(done);
  CHECK(small_registrations == 0);
  CHECK(large_registrations == 1);
  CHECK(!last_put);
  CHECK(std::memcmp(host.data(), dev.view(), 4096) == 0);
}

TEST_CASE("device memory: a small put from GPU memory is never posted inline - the CPU does not read it",
          "[device_memory]") {
  if (skipped_off_tcp()) return;
  fake_device_memory dev(8192);  // (PROT_NONE: a CPU copy of it for an inline put would crash)
  std::vector<std::byte> managed(4096);
  fake_backend backend(dev, managed);
  std::vector<std::byte> host(4096), source(64);
  asio::io_context io;
  ad::fabric_options opt = anydoor::test::test_options();
  opt.gpu_bounce_threshold = 0;  // small transfers of plain GPU buffers go direct too, not staged
  ad::fabric server(io, anydoor::test::test_options());
  ad::fabric client(io, opt);
  ad::memory_region target = server.register_memory(std::span(host), ad::access::local_write | ad::access::remote_write);
  ad::memory_region gpu = client.register_memory({dev.dev(), 4096}, ad::access::local_write);
  REQUIRE(gpu.kind() == memory_kind::cuda_device);
  REQUIRE(client.device().caps().max_inline >= 64);
  ad::acceptor acc = server.listen(anydoor::test::test_host(), 0);
  anydoor::test::failure f;
  std::uint64_t gpu_inline = 99, host_inline = 99;
  bool done = false;
  asio::co_spawn(io, accept_until_closed(acc), f.handler());
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    ad::connection c = co_await client.async_connect(anydoor::test::addr(acc), asio::use_awaitable);
    fill(dev.view(), 4096, 31);
    const std::size_t n1 = co_await c.async_put(gpu.at(0, 40), target.remote().at(0, 40), asio::use_awaitable);
    CHECK(n1 == 40);
    const std::size_t n2 =
        co_await c.async_put(asio::const_buffer(dev.dev() + 100, 24), target.remote().at(100, 24), asio::use_awaitable);
    CHECK(n2 == 24);
    gpu_inline = c.stats().inline_puts;
    fill(source.data(), source.size(), 32);
    const std::size_t n3 = co_await c.async_put(asio::buffer(source), target.remote().at(200, 64), asio::use_awaitable);
    CHECK(n3 == 64);
    host_inline = c.stats().inline_puts;
    co_await c.async_close(asio::use_awaitable);
    done = true;
  }, f.handler());
  anydoor::test::run_to_completion(io);
  f.check();
  REQUIRE(done);
  CHECK(gpu_inline == 0);
  CHECK(host_inline == 1);  // (the counter counts: host memory of the same size goes inline)
  CHECK(std::memcmp(host.data(), dev.view(), 40) == 0);
  CHECK(std::memcmp(host.data() + 100, dev.view() + 100, 24) == 0);
  CHECK(std::memcmp(host.data() + 200, source.data(), 64) == 0);
  CHECK_FALSE(backend.the_copier().bad_range);
}

TEST_CASE("device memory: a small put from a GPU region reset while it waits in the queue is never copied by the CPU",
          "[device_memory]") {
  if (skipped_off_tcp()) return;
  fake_device_memory dev(8192);  // (PROT_NONE: a CPU copy of it would crash the test)
  std::vector<std::byte> managed(4096);
  fake_backend backend(dev, managed);
  std::vector<std::byte> host(4096);
  asio::io_context io;
  ad::fabric server(io, anydoor::test::test_options());
  ad::fabric client(io, anydoor::test::test_options());  // (a region's put never stages: it goes direct)
  ad::memory_region target = server.register_memory(std::span(host), ad::access::local_write | ad::access::remote_write);
  ad::memory_region gpu = client.register_memory({dev.dev(), 4096}, ad::access::local_write);
  REQUIRE(gpu.kind() == memory_kind::cuda_device);
  ad::acceptor acc = server.listen(anydoor::test::test_host(), 0);
  anydoor::test::failure f;
  constexpr int kSends = 300;  // beyond the server's credits: the put waits behind them
  int received = 0;
  bool put_ended = false;
  std::uint64_t inline_puts = 99;
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    ad::connection s = co_await acc.async_accept(asio::use_awaitable);
    for (;;) {  // the sends, then the end (the reset region's put may fail the connection)
      auto [e, m] = co_await s.async_receive(asio::as_tuple(asio::use_awaitable));
      (void)m;
      if (e) break;
      ++received;
    }
  }, f.handler());
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    ad::connection c = co_await client.async_connect(anydoor::test::addr(acc), asio::use_awaitable);
    fill(dev.view(), 4096, 41);
    const std::array<std::byte, 8> msg{};
    for (int i = 0; i < kSends; ++i) c.async_send(asio::buffer(msg), [](boost::system::error_code, std::size_t) {});
    c.async_put(gpu.at(0, 40), target.remote().at(0, 40), [&](boost::system::error_code, std::size_t) {
      put_ended = true;
    });
    gpu = ad::memory_region{};  // reset while the put waits: its kind reads as host memory now
    const bool ended = co_await anydoor::test::until([&] { return put_ended; });
    CHECK(ended);  // (with or without an error: its registration is gone; what matters is no CPU read)
    inline_puts = c.stats().inline_puts;
    if (c.is_open()) c.abort();
  }, f.handler());
  anydoor::test::run_to_completion(io);
  f.check();
  CHECK(put_ended);
  CHECK(inline_puts == 0);
  CHECK(received > 0);  // the sends before it went
  CHECK_FALSE(backend.the_copier().bad_range);
}

TEST_CASE("device memory: what follows a staged put waits for it: a later put, a flush and a message see its bytes "
          "in place, and a held operation can be cancelled",
          "[device_memory]") {
  constexpr std::size_t kChunk = 4096;
  constexpr std::size_t kSize = 64 * kChunk;  // 64 chunks through two buffers: many copy round trips
  fake_device_memory dev(kSize);
  std::vector<std::byte> managed(4096);
  fake_backend backend(dev, managed);
  fill(dev.view(), kSize, 21);
  asio::io_context io;
  ad::fabric server(io, anydoor::test::test_options());
  ad::fabric client(io, staged_pair::staging_options(kChunk));
  std::vector<std::byte> host(kSize), spare(kChunk);
  ad::memory_region region = server.register_memory(std::span(host), ad::access::local_write | ad::access::remote_write);
  ad::memory_region spare_region = server.register_memory(std::span(spare), ad::access::local_write | ad::access::remote_write);
  ad::acceptor acc = server.listen(anydoor::test::test_host(), 0);
  anydoor::test::failure f;
  std::vector<std::byte> later(kChunk);
  fill(later.data(), kChunk, 77);
  // What the server saw when the message came: the staged bytes past the
  // first chunk, and the later put's bytes over the first.
  bool staged_in_place = false, later_in_place = false, message_came = false;
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    ad::connection s = co_await acc.async_accept(asio::use_awaitable);
    ad::message m = co_await s.async_receive(asio::use_awaitable);
    message_came = m.size() == 4;
    staged_in_place = std::memcmp(host.data() + kChunk, dev.view() + kChunk, kSize - kChunk) == 0;
    later_in_place = std::memcmp(host.data(), later.data(), kChunk) == 0;
    auto [e, m2] = co_await s.async_receive(asio::as_tuple(asio::use_awaitable));  // the client's goodbye
    (void)m2;
    CHECK(e == ad::errc::connection_closed);
  }, f.handler());
  std::vector<int> order;  // handlers run: 1 staged put, 2 later put, 3 cancelled put, 4 flush, 5 message
  boost::system::error_code e1, e2, e3, e4, e5;
  bool flush_saw_all = false;
  ad::connection_stats stats{};
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    ad::connection c = co_await client.async_connect(anydoor::test::addr(acc), asio::use_awaitable);
    auto note = [&](int which, boost::system::error_code& out) {
      return [&, which](boost::system::error_code ec, std::size_t) {
        out = ec;
        order.push_back(which);
      };
    };
    asio::cancellation_signal sig;
    c.async_put(asio::const_buffer(dev.dev(), kSize), region.remote(), note(1, e1));
    c.async_put(asio::buffer(later), region.remote().at(0, kChunk), note(2, e2));
    c.async_put(asio::buffer(later), spare_region.remote(), asio::bind_cancellation_slot(sig.slot(), note(3, e3)));
    c.async_flush([&](boost::system::error_code ec) {
      e4 = ec;
      // Everything issued before the flush is in place when it completes.
      flush_saw_all = std::memcmp(host.data(), later.data(), kChunk) == 0 &&
                      std::memcmp(host.data() + kChunk, dev.view() + kChunk, kSize - kChunk) == 0;
      order.push_back(4);
    });
    c.async_send(asio::buffer("done", 4), note(5, e5));
    sig.emit(asio::cancellation_type::terminal);  // the third waits behind the staged put: it never starts
    while (order.size() < 5) co_await asio::post(io, asio::use_awaitable);
    stats = c.stats();
    co_await c.async_close(asio::use_awaitable);
  }, f.handler());
  anydoor::test::run_to_completion(io);
  f.check();
  CHECK(!e1);
  CHECK(!e2);
  CHECK(e3 == std::errc::operation_canceled);
  CHECK(!e4);
  CHECK(!e5);
  REQUIRE(order.size() == 5);
  CHECK(order[0] == 3);  // cancelled at once (the others' order on the wire is checked below, by the bytes)
  CHECK(message_came);
  CHECK(flush_saw_all);
  CHECK(staged_in_place);
  CHECK(later_in_place);
  // In the end too: the later put's bytes over the first chunk, the staged
  // bytes after it, and nothing of the cancelled put.
  CHECK(std::memcmp(host.data(), later.data(), kChunk) == 0);
  CHECK(std::memcmp(host.data() + kChunk, dev.view() + kChunk, kSize - kChunk) == 0);
  CHECK(std::all_of(spare.begin(), spare.end(), [](std::byte b) { return b == std::byte{0}; }));
  // Statistics count operations, not a staged transfer's chunks.
  CHECK(stats.puts == 2);
  CHECK(stats.bytes_put == kSize + kChunk);
}

TEST_CASE("device memory: operations held behind a staged put end with the connection's error when it fails",
          "[device_memory]") {
  constexpr std::size_t kChunk = 4096;
  constexpr std::size_t kSize = 64 * kChunk;
  fake_device_memory dev(kSize);
  std::vector<std::byte> managed(4096);
  fake_backend backend(dev, managed);
  fake_copier& copier = backend.the_copier();
  staged_pair sp(kChunk, kSize);
  sp.clean_end = false;
  int ended = 0;
  bool held_ended_first = false;  // the held send ended while the staged put's copy was still held
  boost::system::error_code e_staged, e_held, e_after;
  asio::co_spawn(sp.io, [&]() -> asio::awaitable<void> {
    ad::connection c = co_await sp.client.async_connect(anydoor::test::addr(sp.acc), asio::use_awaitable);
    copier.hold = true;  // the staged put stays under way (its first copy waits)
    c.async_put(asio::const_buffer(dev.dev(), kSize), sp.remote, [&](boost::system::error_code ec, std::size_t) {
      e_staged = ec;
      ++ended;
    });
    c.async_send(asio::buffer("held", 4), [&](boost::system::error_code ec, std::size_t) {
      e_held = ec;
      held_ended_first = copier.hold.load();
      ++ended;
    });
    const bool copying = co_await anydoor::test::until([&] { return copier.holding.load() > 0; });
    CHECK(copying);
    c.abort();
    c.async_send(asio::buffer("late", 4), [&](boost::system::error_code ec, std::size_t) {
      e_after = ec;
      ++ended;
    });
    const bool two = co_await anydoor::test::until([&] { return ended == 2; }, std::chrono::seconds(2));
    CHECK(two);  // the held and the late send, at once
    copier.hold = false;
    while (ended < 3) co_await asio::post(sp.io, asio::use_awaitable);
  }, sp.f.handler());
  anydoor::test::run_to_completion(sp.io);
  copier.hold = false;
  sp.f.check();
  CHECK(ended == 3);
  CHECK(held_ended_first);  // by the failure itself, not after the staged put ended
  CHECK(e_held == ad::errc::connection_closed);
  CHECK(e_after == ad::errc::connection_closed);
  CHECK(e_staged);  // its chunks could not all go
}

TEST_CASE("device memory: a put held behind a staged put is checked and copied when issued - its region reset or "
          "destroyed while it waits does not matter and a bad one fails at once",
          "[device_memory]") {
  if (skipped_off_tcp()) return;
  constexpr std::size_t kChunk = 4096;
  constexpr std::size_t kSize = 16 * kChunk;
  constexpr std::size_t kSmall = 32;  // inline: copied when issued
  fake_device_memory dev(kSize);
  std::vector<std::byte> managed(4096);
  fake_backend backend(dev, managed);
  fill(dev.view(), kSize, 5);
  fake_copier& copier = backend.the_copier();
  staged_pair sp(kChunk, kSize);
  std::vector<std::byte> a(kSmall), b(kSmall), c(kSmall), a0(kSmall), b0(kSmall);
  fill(a.data(), kSmall, 90);
  fill(b.data(), kSmall, 91);
  a0 = a;
  b0 = b;
  ad::memory_region ra = sp.client.register_memory(std::span(a), ad::access::local_write);
  auto rb = std::make_unique<ad::memory_region>(sp.client.register_memory(std::span(b), ad::access::local_write));
  ad::memory_region rc = sp.client.register_memory(std::span(c), ad::access::local_write);
  const ad::local_range bad = rc;
  rc = ad::memory_region{};  // reset before its put is issued
  boost::system::error_code e_staged, ea, eb, ec_bad;
  int ended = 0;
  bool bad_while_held = false;  // the bad put ended while the staged put was still under way
  ad::connection_stats stats{};
  asio::co_spawn(sp.io, [&]() -> asio::awaitable<void> {
    ad::connection conn = co_await sp.client.async_connect(anydoor::test::addr(sp.acc), asio::use_awaitable);
    copier.hold = true;  // the staged put stays under way: what follows is held
    conn.async_put(asio::const_buffer(dev.dev(), kSize), sp.remote, [&](boost::system::error_code e, std::size_t) {
      e_staged = e;
      ++ended;
    });
    conn.async_put(ra, sp.remote.at(0, kSmall), [&](boost::system::error_code e, std::size_t) {
      ea = e;
      ++ended;
    });
    conn.async_put(*rb, sp.remote.at(kSmall, kSmall), [&](boost::system::error_code e, std::size_t) {
      eb = e;
      ++ended;
    });
    conn.async_put(bad, sp.remote.at(2 * kSmall, kSmall), [&](boost::system::error_code e, std::size_t) {
      ec_bad = e;
      bad_while_held = copier.hold.load();
      ++ended;
    });
    const bool copying = co_await anydoor::test::until([&] { return copier.holding.load() > 0; });
    CHECK(copying);
    // While they wait: one region reset, the other destroyed, their memory
    // overwritten. They were copied when issued.
    ra = ad::memory_region{};
    rb.reset();
    std::fill(a.begin(), a.end(), std::byte{0xee});
    std::fill(b.begin(), b.end(), std::byte{0xee});
    const bool bad_ended = co_await anydoor::test::until([&] { return ended == 1; }, std::chrono::seconds(2));
    CHECK(bad_ended);
    copier.hold = false;
    while (ended < 4) co_await asio::post(sp.io, asio::use_awaitable);
    stats = conn.stats();
    co_await conn.async_close(asio::use_awaitable);
  }, sp.f.handler());
  anydoor::test::run_to_completion(sp.io);
  copier.hold = false;
  sp.f.check();
  CHECK(ended == 4);
  CHECK(!e_staged);
  CHECK(!ea);
  CHECK(!eb);
  CHECK(ec_bad == ad::errc::invalid_argument);
  CHECK(bad_while_held);  // refused when issued, not when released
  CHECK(stats.inline_puts == 2);
  // In order: the staged bytes, then the two small puts' bytes as issued
  // over the first 64; nothing of the bad one.
  CHECK(std::memcmp(sp.host.data(), a0.data(), kSmall) == 0);
  CHECK(std::memcmp(sp.host.data() + kSmall, b0.data(), kSmall) == 0);
  CHECK(std::memcmp(sp.host.data() + 2 * kSmall, dev.view() + 2 * kSmall, kSize - 2 * kSmall) == 0);
}

TEST_CASE("device memory: a staged put waiting for a staging buffer can be cancelled, and one under way cannot",
          "[device_memory]") {
  constexpr std::size_t kChunk = 4096;
  constexpr std::size_t kSize = 64 * kChunk;
  fake_device_memory dev(kSize);
  std::vector<std::byte> managed(4096);
  fake_backend backend(dev, managed);
  fill(dev.view(), kSize, 5);
  two_staged_connections t(kChunk, kSize);  // one transfer holds both staging buffers
  asio::io_context& io = t.io;
  ad::fabric& client = t.client;
  std::vector<std::byte>& first = t.first;
  std::vector<std::byte>& second = t.second;
  const ad::remote_region r1 = t.r1.remote(), r2 = t.r2.remote();
  ad::acceptor& acc = t.acc;
  anydoor::test::failure& f = t.f;
  boost::system::error_code e1, e2, e3, e4;
  bool second_ended_first = false;
  int ended = 0;
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    ad::connection a = co_await client.async_connect(anydoor::test::addr(acc), asio::use_awaitable);
    ad::connection b = co_await client.async_connect(anydoor::test::addr(acc), asio::use_awaitable);
    asio::cancellation_signal sig1, sig2;
    // a's transfer takes both buffers; b's waits for one.
    a.async_put(asio::const_buffer(dev.dev(), kSize), r1,
                asio::bind_cancellation_slot(sig1.slot(), [&](boost::system::error_code ec, std::size_t) {
                  e1 = ec;
                  ++ended;
                }));
    b.async_put(asio::const_buffer(dev.dev(), kSize), r2,
                asio::bind_cancellation_slot(sig2.slot(), [&](boost::system::error_code ec, std::size_t) {
                  e2 = ec;
                  second_ended_first = ended == 0;
                  ++ended;
                }));
    sig1.emit(asio::cancellation_type::terminal);  // under way: no effect
    sig2.emit(asio::cancellation_type::terminal);
    while (ended < 2) co_await asio::post(io, asio::use_awaitable);
    // b works on: a staged put after the cancelled one, and a message.
    auto [ec3, n3] = co_await b.async_put(asio::const_buffer(dev.dev(), kChunk), r2,
                                          asio::as_tuple(asio::use_awaitable));
    e3 = ec3;
    CHECK(n3 == kChunk);
    auto [ec4, n4] = co_await b.async_send(asio::buffer("ok", 2), asio::as_tuple(asio::use_awaitable));
    e4 = ec4;
    (void)n4;
    co_await a.async_close(asio::use_awaitable);
    co_await b.async_close(asio::use_awaitable);
  }, f.handler());
  anydoor::test::run_to_completion(io);
  f.check();
  CHECK(!e1);
  CHECK(e2 == std::errc::operation_canceled);
  CHECK(second_ended_first);  // at once, not after the first transfer gave its buffers back
  CHECK(!e3);
  CHECK(!e4);
  CHECK(std::memcmp(first.data(), dev.view(), kSize) == 0);
  // Only the later put's chunk landed in the second region.
  CHECK(std::memcmp(second.data(), dev.view(), kChunk) == 0);
  CHECK(std::all_of(second.begin() + kChunk, second.end(), [](std::byte x) { return x == std::byte{0}; }));
}

TEST_CASE("device memory: a staged put whose peer closes while a copy runs ends, and so does what is held behind it",
          "[device_memory]") {
  constexpr std::size_t kChunk = 4096;
  constexpr std::size_t kSize = 8 * kChunk;
  fake_device_memory dev(kSize);
  std::vector<std::byte> managed(4096);
  fake_backend backend(dev, managed);
  fake_copier& copier = backend.the_copier();
  asio::io_context io;
  ad::fabric server(io, anydoor::test::test_options());
  ad::fabric client(io, staged_pair::staging_options(kChunk));
  std::vector<std::byte> host(kSize);
  ad::memory_region region = server.register_memory(std::span(host), ad::access::local_write | ad::access::remote_write);
  ad::acceptor acc = server.listen(anydoor::test::test_host(), 0);
  anydoor::test::failure f;
  bool server_gone = false;
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    ad::connection s = co_await acc.async_accept(asio::use_awaitable);
    const bool copying = co_await anydoor::test::until([&] { return copier.holding.load() > 0; });
    CHECK(copying);
    // The peer closes while the first chunk's copy runs, then goes.
    s.async_close([](boost::system::error_code) {});
    asio::steady_timer t(io, std::chrono::milliseconds(300));
    co_await t.async_wait(asio::use_awaitable);
    s = ad::connection{};
    t.expires_after(std::chrono::milliseconds(300));
    co_await t.async_wait(asio::use_awaitable);
    server_gone = true;
  }, f.handler());
  boost::system::error_code e_put, e_held;
  int ended = 0;
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    ad::connection c = co_await client.async_connect(anydoor::test::addr(acc), asio::use_awaitable);
    copier.hold = true;
    c.async_put(asio::const_buffer(dev.dev(), kSize), region.remote(), [&](boost::system::error_code ec, std::size_t) {
      e_put = ec;
      ++ended;
    });
    c.async_send(asio::buffer("held", 4), [&](boost::system::error_code ec, std::size_t) {
      e_held = ec;
      ++ended;
    });
    const bool gone = co_await anydoor::test::until([&] { return server_gone; });
    CHECK(gone);
    copier.hold = false;  // the copy finishes after the connection ended: its chunk must not wait for good
    const bool both = co_await anydoor::test::until([&] { return ended == 2; });
    CHECK(both);
  }, f.handler());
  anydoor::test::run_to_completion(io, std::chrono::seconds(30));
  copier.hold = false;
  f.check();
  CHECK(ended == 2);
  CHECK(e_put);
  CHECK(e_held);
}

TEST_CASE("device memory: a staged put waiting for a staging buffer ends at once when its connection fails",
          "[device_memory]") {
  constexpr std::size_t kChunk = 4096;
  constexpr std::size_t kSize = 8 * kChunk;
  fake_device_memory dev(kSize);
  std::vector<std::byte> managed(4096);
  fake_backend backend(dev, managed);
  fake_copier& copier = backend.the_copier();
  fill(dev.view(), kSize, 3);
  two_staged_connections t(kChunk, kSize);  // a's transfer holds both staging buffers
  t.clean_end = false;                      // (b is aborted)
  asio::io_context& io = t.io;
  ad::fabric& client = t.client;
  std::vector<std::byte>& first = t.first;
  std::vector<std::byte>& second = t.second;
  const ad::remote_region r1 = t.r1.remote(), r2 = t.r2.remote();
  ad::acceptor& acc = t.acc;
  anydoor::test::failure& f = t.f;
  boost::system::error_code e1, e2;
  bool second_while_first_held = false;
  int ended = 0;
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    ad::connection a = co_await client.async_connect(anydoor::test::addr(acc), asio::use_awaitable);
    ad::connection b = co_await client.async_connect(anydoor::test::addr(acc), asio::use_awaitable);
    copier.hold = true;  // a's copies wait: it keeps both buffers
    a.async_put(asio::const_buffer(dev.dev(), kSize), r1, [&](boost::system::error_code ec, std::size_t) {
      e1 = ec;
      ++ended;
    });
    b.async_put(asio::const_buffer(dev.dev(), kSize), r2, [&](boost::system::error_code ec, std::size_t) {
      e2 = ec;
      second_while_first_held = copier.hold.load();
      ++ended;
    });
    const bool copying = co_await anydoor::test::until([&] { return copier.holding.load() > 0; });
    CHECK(copying);
    b.abort();
    const bool b_ended = co_await anydoor::test::until([&] { return ended == 1; }, std::chrono::seconds(2));
    CHECK(b_ended);
    copier.hold = false;
    const bool both = co_await anydoor::test::until([&] { return ended == 2; });
    CHECK(both);
    co_await a.async_close(asio::use_awaitable);
  }, f.handler());
  anydoor::test::run_to_completion(io, std::chrono::seconds(30));
  copier.hold = false;
  f.check();
  CHECK(!e1);
  CHECK(e2 == ad::errc::connection_closed);
  CHECK(second_while_first_held);  // not only once a's transfer let its buffers go
  CHECK(std::memcmp(first.data(), dev.view(), kSize) == 0);
  CHECK(std::all_of(second.begin(), second.end(), [](std::byte x) { return x == std::byte{0}; }));
}
