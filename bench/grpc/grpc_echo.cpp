// anydoor-grpc-echo: gRPC C++ (callback API) unary echo with a bytes
// payload, the gRPC side of bench/compare-rpc.sh (built only when
// libgrpc++-dev and protobuf-compiler-grpc are installed).
//
//   anydoor-grpc-echo --server [--port P]
//   anydoor-grpc-echo --connect HOST [--port P] --test lat|rate [-s SIZE] [-n ITERS] [--window W]
//     lat:  one call in flight (the blocking stub), round trip
//     rate: --window calls in flight (default 32, the async callback API)
// The server exits after the client's Stop call. Prints one line, as
// anydoor-rpc-perf does:
//   RESULT test=lat size=64 iters=.. median_us=.. p99_us=.. mean_us=.. (the round trip)
//   RESULT test=rate size=64 iters=.. window=32 Mcalls=..
#include "../cli.hpp"
#include "echo.grpc.pb.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

using clk = std::chrono::steady_clock;
using anydoor::bench::Blob;
using anydoor::bench::Echo;

class echo_service final : public Echo::CallbackService {
 public:
  grpc::ServerUnaryReactor* Call(grpc::CallbackServerContext* ctx, const Blob* req, Blob* rep) override {
    rep->set_data(req->data());
    auto* r = ctx->DefaultReactor();
    r->Finish(grpc::Status::OK);
    return r;
  }
  grpc::ServerUnaryReactor* Stop(grpc::CallbackServerContext* ctx, const Blob*, Blob*) override {
    {
      std::lock_guard lock(m_);
      stopped_ = true;
    }
    cv_.notify_one();
    auto* r = ctx->DefaultReactor();
    r->Finish(grpc::Status::OK);
    return r;
  }
  void wait() {
    std::unique_lock lock(m_);
    cv_.wait(lock, [this] { return stopped_; });
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool stopped_ = false;
};

int serve(const anydoor::bench::cli_options& o) {
  echo_service svc;
  grpc::ServerBuilder b;
  b.AddListeningPort("0.0.0.0:" + std::to_string(o.port), grpc::InsecureServerCredentials());
  b.RegisterService(&svc);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  if (!server) {
    std::fprintf(stderr, "anydoor-grpc-echo: cannot listen on port %u\n", static_cast<unsigned>(o.port));
    return 1;
  }
  svc.wait();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  return 0;
}

double percentile(std::vector<double>& v, double p) {
  const auto k = static_cast<std::size_t>(p * static_cast<double>(v.size() - 1));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

int run_client(const anydoor::bench::cli_options& o) {
  auto channel = grpc::CreateChannel(o.host + ":" + std::to_string(o.port), grpc::InsecureChannelCredentials());
  std::unique_ptr<Echo::Stub> stub = Echo::NewStub(channel);
  Blob req;
  req.set_data(std::string(o.size, 'Z'));
  const std::uint32_t warm = std::min<std::uint32_t>(2000, o.iters);
  if (o.test == "lat") {
    std::vector<double> ns;
    ns.reserve(o.iters);
    for (std::uint32_t i = 0; i < warm + o.iters; ++i) {
      grpc::ClientContext ctx;
      Blob rep;
      const auto t0 = clk::now();
      const grpc::Status st = stub->Call(&ctx, req, &rep);
      const auto t1 = clk::now();
      if (!st.ok() || rep.data().size() != o.size) {
        std::fprintf(stderr, "anydoor-grpc-echo: a call failed: %s\n", st.error_message().c_str());
        return 1;
      }
      if (i >= warm) ns.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count());
    }
    double sum = 0;
    for (double v : ns) sum += v;
    const double mean = sum / static_cast<double>(ns.size());
    const double p99 = percentile(ns, 0.99);
    const double median = percentile(ns, 0.5);
    std::printf("RESULT test=lat size=%u iters=%u median_us=%.3f p99_us=%.3f mean_us=%.3f\n", o.size, o.iters,
                median / 1000, p99 / 1000, mean / 1000);
  } else {
    // --window calls in flight; each completion (on a gRPC thread) starts the next.
    struct slot {
      grpc::ClientContext ctx;
      Blob rep;
    };
    std::mutex m;
    std::condition_variable cv;
    std::uint64_t done = 0, started = 0, target = 0, failed = 0;
    std::function<void()> start_one = [&] {  // called with m held
      ++started;
      auto* s = new slot;  // gRPC needs a fresh context per call
      stub->async()->Call(&s->ctx, &req, &s->rep, [&, s](grpc::Status st) {
        const bool ok = st.ok() && s->rep.data().size() == o.size;
        delete s;
        std::lock_guard lock(m);
        if (!ok) ++failed;
        ++done;
        if (started < target) start_one();
        if (done == target) cv.notify_one();
      });
    };
    auto run = [&](std::uint64_t count) {
      std::unique_lock lock(m);
      target = started + count;
      for (std::uint32_t i = 0; i < o.window && started < target; ++i) start_one();
      cv.wait(lock, [&] { return done == target; });
    };
    run(warm);
    const auto t0 = clk::now();
    run(o.iters);
    const double secs = std::chrono::duration<double>(clk::now() - t0).count();
    if (failed != 0) {
      std::fprintf(stderr, "anydoor-grpc-echo: %llu calls failed\n", static_cast<unsigned long long>(failed));
      return 1;
    }
    std::printf("RESULT test=rate size=%u iters=%u window=%u Mcalls=%.4f\n", o.size, o.iters, o.window,
                o.iters / secs / 1e6);
  }
  grpc::ClientContext ctx;
  Blob rep;
  stub->Stop(&ctx, Blob(), &rep);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  auto o = anydoor::bench::parse_cli(argc, argv,
                                     "anydoor-grpc-echo (--server | --connect HOST) [--port P] [--test lat|rate]\n"
                                     "                         [-s SIZE] [-n ITERS] [--window W]",
                                     {.port = 7481, .test = "lat", .window = 0}, {"lat", "rate"});
  if (o.size == 0) o.size = 64;
  if (o.window == 0) o.window = 32;
  if (o.iters == 0) o.iters = o.test == "rate" ? 50000 : 20000;
  return o.server ? serve(o) : run_client(o);
}
