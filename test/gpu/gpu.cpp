// GPU memory on a real GPU (label gpu). gpu/main.cpp exits 77 (CTest:
// skipped) with the reason where no GPU is usable. Allocations come
// from the CUDA runtime (linked statically); anydoor itself only opens the
// driver at run time.
#include "../support/runtime.hpp"

#include <anydoor/anydoor.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>
#include <vector>

namespace {
struct device_buffer {
  void* p = nullptr;
  explicit device_buffer(std::size_t n) { REQUIRE(cudaMalloc(&p, n) == cudaSuccess); }
  ~device_buffer() { cudaFree(p); }
};
}  // namespace

TEST_CASE("gpu: memory kinds are detected per pointer", "[gpu]") {
  using anydoor::memory_kind;
  device_buffer dev(1 << 20);
  CHECK(anydoor::cuda::kind_of(dev.p) == memory_kind::cuda_device);
  CHECK(anydoor::cuda::kind_of(static_cast<char*>(dev.p) + 4096) == memory_kind::cuda_device);
  void* managed = nullptr;
  REQUIRE(cudaMallocManaged(&managed, 1 << 20) == cudaSuccess);
  CHECK(anydoor::cuda::kind_of(managed) == memory_kind::cuda_managed);
  void* pinned = nullptr;
  REQUIRE(cudaMallocHost(&pinned, 1 << 20) == cudaSuccess);
  CHECK(anydoor::cuda::kind_of(pinned) == memory_kind::cuda_host);
  std::string host(100, 'x');
  CHECK(anydoor::cuda::kind_of(host.data()) == memory_kind::host);

  boost::asio::io_context io;
  anydoor::fabric fab(io, {.device = {.provider = "tcp"}});
  // Pinned host memory registers as host memory does, and says what it is.
  auto r = fab.register_memory({static_cast<std::byte*>(pinned), 1 << 20}, anydoor::access::local_write);
  CHECK(r.kind() == memory_kind::cuda_host);
  r.reset();
  // Device memory on the tcp provider: registered, reached by CUDA copies;
  // not for atomics (they need the memory itself); managed memory: refused.
  auto d = fab.register_memory({static_cast<std::byte*>(dev.p), 1 << 20},
                               anydoor::access::local_write | anydoor::access::remote_write);
  CHECK(d.kind() == memory_kind::cuda_device);
  d.reset();
  try {
    (void)fab.register_memory({static_cast<std::byte*>(dev.p), 1 << 20},
                              anydoor::access::local_write | anydoor::access::remote_atomic);
    FAIL("device memory registered for atomics on tcp");
  } catch (const std::system_error& e) {
    CHECK(e.code() == anydoor::errc::not_supported);
  }
  try {
    (void)fab.register_memory({static_cast<std::byte*>(managed), 1 << 20}, anydoor::access::local_write);
    FAIL("managed memory registered");
  } catch (const std::system_error& e) {
    CHECK(e.code() == anydoor::errc::not_supported);
  }
  cudaFree(managed);
  cudaFreeHost(pinned);
}

namespace {
std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 151 + seed) >> 2);
  return v;
}
std::vector<std::byte> read_device(const void* p, std::size_t n) {
  std::vector<std::byte> v(n);
  REQUIRE(cudaMemcpy(v.data(), p, n, cudaMemcpyDeviceToHost) == cudaSuccess);
  return v;
}
}  // namespace

TEST_CASE("gpu: device-to-device host-to-device and device-to-host sends and puts and gets over tcp", "[gpu]") {
  namespace asio = boost::asio;
  const std::size_t size = GENERATE(std::size_t{1}, std::size_t{4096}, std::size_t{1} << 20, std::size_t{64} << 20);
  // The provider's CUDA copies, or staging forced (messages through host
  // copies, plain-buffer puts and gets through the pipeline).
  const bool staging = GENERATE(false, true);
  INFO(size << " bytes" << (staging ? ", staging forced" : ""));
  device_buffer csrc(size), cdst(size), sdst(size), sregion_mem(size);
  const auto p1 = pattern(size, 1), p2 = pattern(size, 2), p3 = pattern(size, 3);
  REQUIRE(cudaMemcpy(csrc.p, p1.data(), size, cudaMemcpyHostToDevice) == cudaSuccess);
  std::vector<std::byte> host(size);
  asio::io_context io;
  anydoor::fabric_options opt = anydoor::test::test_options();
  opt.gpu_staging = staging;
  anydoor::fabric server(io, opt);
  anydoor::fabric client(io, opt);
  anydoor::memory_region sregion = server.register_memory(
      {static_cast<std::byte*>(sregion_mem.p), size},
      anydoor::access::local_write | anydoor::access::remote_write | anydoor::access::remote_read);
  const anydoor::remote_region sremote = sregion.remote();
  anydoor::acceptor acc = server.listen(anydoor::test::test_host(), 0);
  anydoor::test::failure f;
  bool done = false;
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    anydoor::connection s = co_await acc.async_accept(asio::use_awaitable);
    auto [e1, n1] = co_await s.async_receive(asio::mutable_buffer(sdst.p, size), asio::as_tuple(asio::use_awaitable));
    CHECK(!e1);
    CHECK(n1 == size);
    const bool d2d = read_device(sdst.p, size) == p1;
    CHECK(d2d);
    auto [e2, n2] = co_await s.async_receive(asio::mutable_buffer(sdst.p, size), asio::as_tuple(asio::use_awaitable));
    CHECK(!e2);
    const bool h2d = read_device(sdst.p, size) == p2;
    CHECK(h2d);
    (void)n2;
    auto [e3, n3] = co_await s.async_send(asio::const_buffer(sdst.p, size), asio::as_tuple(asio::use_awaitable));
    CHECK(!e3);
    (void)n3;
    auto [e4, m] = co_await s.async_receive(asio::as_tuple(asio::use_awaitable));
    (void)m;
    CHECK(e4 == anydoor::errc::connection_closed);
  }, f.handler());
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    anydoor::connection c = co_await client.async_connect(anydoor::test::addr(acc), asio::use_awaitable);
    auto [e1, n1] = co_await c.async_send(asio::const_buffer(csrc.p, size), asio::as_tuple(asio::use_awaitable));
    CHECK(!e1);
    (void)n1;
    auto [e2, n2] = co_await c.async_send(asio::buffer(p2), asio::as_tuple(asio::use_awaitable));
    CHECK(!e2);
    (void)n2;
    auto [e3, n3] = co_await c.async_receive(asio::buffer(host), asio::as_tuple(asio::use_awaitable));
    CHECK(!e3);
    CHECK(n3 == size);
    const bool d2h = host == p2;
    CHECK(d2h);
    // One-sided: device -> remote device region, back into device memory,
    // and host memory to and from it.
    auto [e5, x5] = co_await c.async_put(asio::const_buffer(csrc.p, size), sremote, asio::as_tuple(asio::use_awaitable));
    CHECK(!e5);
    (void)x5;
    const bool put_d2d = read_device(sregion_mem.p, size) == p1;
    CHECK(put_d2d);
    auto [e6, x6] = co_await c.async_get(asio::mutable_buffer(cdst.p, size), sremote, asio::as_tuple(asio::use_awaitable));
    CHECK(!e6);
    (void)x6;
    const bool get_d2d = read_device(cdst.p, size) == p1;
    CHECK(get_d2d);
    auto [e7, x7] = co_await c.async_put(asio::buffer(p3), sremote, asio::as_tuple(asio::use_awaitable));
    CHECK(!e7);
    (void)x7;
    const bool put_h2d = read_device(sregion_mem.p, size) == p3;
    CHECK(put_h2d);
    auto [e8, x8] = co_await c.async_get(asio::buffer(host), sremote, asio::as_tuple(asio::use_awaitable));
    CHECK(!e8);
    (void)x8;
    const bool get_d2h = host == p3;
    CHECK(get_d2h);
    co_await c.async_close(asio::use_awaitable);
    done = true;
  }, f.handler());
  anydoor::test::run_to_completion(io, std::chrono::seconds(120));
  f.check();
  CHECK(done);
}
