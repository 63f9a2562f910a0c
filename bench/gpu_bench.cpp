// anydoor-gpu-bench: GPU device memory against host memory over the tcp
// provider on loopback, side by side in one process and one run (the
// kinds alternate rep by rep, so machine noise hits both alike).
//
//   anydoor-gpu-bench [-s BYTES] [-n REPS] [--latency-iters N]
//
// put bandwidth: one async_put of BYTES (default 64 MiB) from the client's
// buffer into the server's registered region, host->host and
// device->device (and host->device, device->host: the provider's CUDA
// copies), and device->device through the staging pipeline (a second
// client fabric with gpu_staging, a plain GPU buffer: d2d_staged), REPS
// times each (default 9); the median of each, in GB/s, and device->device
// over host->host, direct and staged. Message latency: 64-byte ping-pong between host buffers and
// between device buffers (both sides), half the round trip, median of N
// (default 2000), and the device over host ratio. The output is
// `key=value` lines: put_gbps_<kind>, put_ratio_d2d_over_h2h,
// put_ratio_d2d_staged_over_h2h, msg64_us_host,
// msg64_us_device, msg64_ratio_device_over_host.
//
// Exits 77 (skipped) with the driver's reason where no GPU is usable, 2 on
// a bad command line, 1 when a transfer fails or its bytes are wrong.
#include <anydoor/anydoor.hpp>
#include <anydoor/cuda.hpp>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace {

namespace asio = boost::asio;
using clock_type = std::chrono::steady_clock;

[[noreturn]] void usage(const char* argv0, const std::string& why) {
  std::fprintf(stderr, "%s: %s\nusage: %s [-s BYTES] [-n REPS] [--latency-iters N]\n", argv0, why.c_str(), argv0);
  std::exit(2);
}

std::size_t number(const char* argv0, const char* s) {
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s, &end, 10);
  if (end == s || *end != '\0' || v == 0) usage(argv0, std::string("expected a positive number: ") + s);
  return static_cast<std::size_t>(v);
}

struct gpu_buffer {
  void* p = nullptr;
  explicit gpu_buffer(std::size_t n) {
    if (cudaMalloc(&p, n) != cudaSuccess) throw std::runtime_error("cudaMalloc of " + std::to_string(n) + " bytes");
  }
  ~gpu_buffer() { cudaFree(p); }
  gpu_buffer(const gpu_buffer&) = delete;
  gpu_buffer& operator=(const gpu_buffer&) = delete;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t size = std::size_t{64} << 20;
  std::size_t reps = 9;
  std::size_t lat_iters = 2000;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) usage(argv[0], "missing value after " + a);
      return argv[++i];
    };
    if (a == "-s") size = number(argv[0], next());
    else if (a == "-n") reps = number(argv[0], next());
    else if (a == "--latency-iters") lat_iters = number(argv[0], next());
    else usage(argv[0], "unknown option " + a);
  }
  const anydoor::cuda::driver_status& drv = anydoor::cuda::driver();
  if (!drv.usable) {
    std::printf("skipped: no usable GPU: %s\n", drv.why.c_str());
    return 77;
  }
  try {
    // Sources and destinations of both kinds; the server's two regions.
    std::vector<std::byte> hsrc(size), hdst(size);
    for (std::size_t i = 0; i < size; ++i) hsrc[i] = static_cast<std::byte>(i * 7 + 1);
    gpu_buffer dsrc(size), ddst(size);
    if (cudaMemcpy(dsrc.p, hsrc.data(), size, cudaMemcpyHostToDevice) != cudaSuccess) throw std::runtime_error("cudaMemcpy");

    asio::io_context io;
    anydoor::fabric server(io, {.device = {.provider = "tcp"}});
    anydoor::fabric client(io, {.device = {.provider = "tcp"}});
    anydoor::fabric staged_client(io, {.device = {.provider = "tcp"}, .gpu_staging = true});
    constexpr auto rights = anydoor::access::local_write | anydoor::access::remote_write;
    anydoor::memory_region hregion = server.register_memory(std::span(hdst), rights);
    anydoor::memory_region dregion = server.register_memory({static_cast<std::byte*>(ddst.p), size}, rights);
    // The client's sources as regions too: the bench measures transfers,
    // not the registration cache's first miss.
    anydoor::memory_region hsrc_r = client.register_memory(std::span(hsrc), anydoor::access::local_write);
    anydoor::memory_region dsrc_r = client.register_memory({static_cast<std::byte*>(dsrc.p), size},
                                                           anydoor::access::local_write);
    anydoor::acceptor acc = server.listen("127.0.0.1", 0);

    struct kind {
      const char* name;
      const anydoor::memory_region* src;  // null: the plain GPU buffer, on the staging fabric's connection
      const anydoor::memory_region* dst;
      std::vector<double> gbps;
    };
    std::vector<kind> kinds = {{"h2h", &hsrc_r, &hregion, {}},
                               {"d2d", &dsrc_r, &dregion, {}},
                               {"h2d", &hsrc_r, &dregion, {}},
                               {"d2h", &dsrc_r, &hregion, {}},
                               {"d2d_staged", nullptr, &dregion, {}}};
    std::vector<double> lat_host, lat_device;
    std::exception_ptr failed;
    bool done = false;
    gpu_buffer dping(64), dpong(64);
    std::vector<std::byte> hping(64, std::byte{1}), hpong(64);

    asio::co_spawn(io, [&]() -> asio::awaitable<void> {
      // The staging fabric's connection first (the client connects it
      // first), then the other.
      anydoor::connection s2 = co_await acc.async_accept(asio::use_awaitable);
      anydoor::connection s = co_await acc.async_accept(asio::use_awaitable);
      // Echo: host messages into host memory, device ones into device memory.
      for (std::size_t i = 0; i < 2 * lat_iters; ++i) {
        const bool dev = i >= lat_iters;
        const asio::mutable_buffer b = dev ? asio::mutable_buffer(dpong.p, 64) : asio::buffer(hpong);
        const std::size_t n = co_await s.async_receive(b, asio::use_awaitable);
        co_await s.async_send(asio::const_buffer(b.data(), n), asio::use_awaitable);
      }
      for (anydoor::connection* x : {&s, &s2}) {
        try {
          (void)co_await x->async_receive(asio::use_awaitable);  // the clients' closes
        } catch (const std::exception&) {
        }
      }
    }, [&](std::exception_ptr e) { if (e && !failed) failed = e; });

    asio::co_spawn(io, [&]() -> asio::awaitable<void> {
      const std::string where = "127.0.0.1:" + std::to_string(acc.port());
      anydoor::connection cs = co_await staged_client.async_connect(where, asio::use_awaitable);
      anydoor::connection c = co_await client.async_connect(where, asio::use_awaitable);
      for (std::size_t r = 0; r < reps; ++r) {
        for (kind& k : kinds) {
          const auto t0 = clock_type::now();
          if (k.src != nullptr) {
            co_await c.async_put(*k.src, k.dst->remote(), asio::use_awaitable);
          } else {
            co_await cs.async_put(asio::const_buffer(dsrc.p, size), k.dst->remote(), asio::use_awaitable);
          }
          const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
          k.gbps.push_back(static_cast<double>(size) / s / 1e9);
        }
        std::fprintf(stderr, "gpu-bench: put rep %zu/%zu\n", r + 1, reps);
      }
      for (std::size_t i = 0; i < 2 * lat_iters; ++i) {
        const bool dev = i >= lat_iters;
        const asio::const_buffer out = dev ? asio::const_buffer(dping.p, 64) : asio::const_buffer(hping.data(), 64);
        const asio::mutable_buffer in = dev ? asio::mutable_buffer(dping.p, 64) : asio::buffer(hping);
        const auto t0 = clock_type::now();
        co_await c.async_send(out, asio::use_awaitable);
        (void)co_await c.async_receive(in, asio::use_awaitable);
        const double us = std::chrono::duration<double, std::micro>(clock_type::now() - t0).count() / 2;
        (dev ? lat_device : lat_host).push_back(us);
      }
      co_await c.async_close(asio::use_awaitable);
      co_await cs.async_close(asio::use_awaitable);
      done = true;
    }, [&](std::exception_ptr e) { if (e && !failed) failed = e; });
    io.run();
    if (failed) std::rethrow_exception(failed);
    if (!done) throw std::runtime_error("the run ended early");
    // The last puts' bytes: every destination holds the source's.
    std::vector<std::byte> check(size);
    if (cudaMemcpy(check.data(), ddst.p, size, cudaMemcpyDeviceToHost) != cudaSuccess) throw std::runtime_error("cudaMemcpy");
    if (check != hsrc || hdst != hsrc) throw std::runtime_error("a destination's bytes differ from the source's");

    for (const kind& k : kinds) std::printf("put_gbps_%s=%.3f\n", k.name, median(k.gbps));
    std::printf("put_ratio_d2d_over_h2h=%.3f\n", median(kinds[1].gbps) / median(kinds[0].gbps));
    std::printf("put_ratio_d2d_staged_over_h2h=%.3f\n", median(kinds[4].gbps) / median(kinds[0].gbps));
    std::printf("msg64_us_host=%.2f\nmsg64_us_device=%.2f\n", median(lat_host), median(lat_device));
    std::printf("msg64_ratio_device_over_host=%.3f\n", median(lat_device) / median(lat_host));
    std::printf("size=%zu reps=%zu latency_iters=%zu\n", size, reps, lat_iters);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu-bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
