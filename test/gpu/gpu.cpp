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
  // Device memory on the tcp provider: refused with the reason (its CUDA
  // copy path is not built yet); managed memory: refused everywhere.
  try {
    (void)fab.register_memory({static_cast<std::byte*>(dev.p), 1 << 20}, anydoor::access::local_write);
    FAIL("device memory registered on tcp");
  } catch (const std::system_error& e) {
    CHECK(e.code() == anydoor::errc::not_supported);
    CHECK(std::string(e.what()).find("tcp provider does not reach GPU memory") != std::string::npos);
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

TEST_CASE("gpu: messages and plain buffers of device memory are refused with not_supported, never copied", "[gpu]") {
  namespace asio = boost::asio;
  using anydoor::test::addr;
  using anydoor::test::test_host;
  using anydoor::test::test_options;
  device_buffer dev(1 << 20);
  asio::io_context io;
  anydoor::fabric server(io, test_options());
  anydoor::fabric client(io, test_options());
  anydoor::acceptor acc = server.listen(test_host(), 0);
  anydoor::test::failure f;
  std::vector<std::byte> host(4096);
  anydoor::memory_region target = server.register_memory(std::span(host), anydoor::access::local_write |
                                                                             anydoor::access::remote_write);
  const anydoor::remote_region remote = target.remote();
  bool done = false;
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    anydoor::connection s = co_await acc.async_accept(asio::use_awaitable);
    auto [ec, m] = co_await s.async_receive(asio::as_tuple(asio::use_awaitable));  // the client's goodbye
    (void)m;
    CHECK(ec == anydoor::errc::connection_closed);
  }, f.handler());
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    anydoor::connection c = co_await client.async_connect(addr(acc), asio::use_awaitable);
    const asio::mutable_buffer d(dev.p, 4096);
    auto [e1, n1] = co_await c.async_send(asio::const_buffer(d), asio::as_tuple(asio::use_awaitable));
    CHECK(e1 == anydoor::errc::not_supported);
    auto [e2, n2] = co_await c.async_receive(d, asio::as_tuple(asio::use_awaitable));
    CHECK(e2 == anydoor::errc::not_supported);
    auto [e3, n3] = co_await c.async_put(asio::const_buffer(d), remote, asio::as_tuple(asio::use_awaitable));
    CHECK(e3 == anydoor::errc::not_supported);
    (void)n1;
    (void)n2;
    (void)n3;
    co_await c.async_close(asio::use_awaitable);
    done = true;
  }, f.handler());
  anydoor::test::run_to_completion(io);
  f.check();
  CHECK(done);
}
