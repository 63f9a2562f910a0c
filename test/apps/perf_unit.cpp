// anydoor-perf's plan (bench/perf_plan.hpp): the client's request as the
// server decodes it, and the schedule both sides derive from it; and the
// stream its write_bw and read_bw run (apps/common/session.cpp).
#include "common/session.hpp"
#include "perf_plan.hpp"

#include <anydoor/error.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

using namespace anydoor::bench;

TEST_CASE("perf plan: what the client encodes the server decodes", "[perf]") {
  for (std::size_t t = 1; t < kNames.size(); ++t) {
    plan p;
    p.test = static_cast<test_kind>(t);
    p.all_sizes = t % 2 == 0;
    p.size = p.test == test_kind::atomic_lat ? 8 : 4096 + static_cast<std::uint32_t>(t);
    p.iters = 1234;
    p.window = 77;
    const auto wire = encode(p);
    const plan q = decode(wire);
    CHECK(q.test == p.test);
    CHECK(q.all_sizes == p.all_sizes);
    CHECK(q.size == p.size);
    CHECK(q.iters == 1234u);
    CHECK(q.window == 77u);
  }
}

TEST_CASE("perf plan: a request that is not a plan, or out of range, is refused", "[perf]") {
  plan p;
  auto wire = encode(p);
  CHECK_NOTHROW(decode(wire));
  CHECK_THROWS_AS(decode(std::span<const std::byte>(wire).first(kPlanSize - 1)), std::runtime_error);  // short
  CHECK_THROWS_AS(decode({}), std::runtime_error);  // an older client: nothing after its region
  auto bad = [&](std::size_t at, std::byte v) {
    auto w = encode(p);
    w[at] = v;
    return w;
  };
  CHECK_THROWS_AS(decode(bad(0, std::byte{'X'})), std::runtime_error);  // magic
  CHECK_THROWS_AS(decode(bad(2, std::byte{2})), std::runtime_error);    // another version
  CHECK_THROWS_AS(decode(bad(3, std::byte{0})), std::runtime_error);    // no test
  CHECK_THROWS_AS(decode(bad(3, std::byte{8})), std::runtime_error);    // an unknown test
  CHECK_THROWS_AS(decode(bad(4, std::byte{2})), std::runtime_error);    // all_sizes neither 0 nor 1
  plan q = p;
  q.size = 0;
  CHECK_THROWS_AS(decode(encode(q)), std::runtime_error);
  q.size = kMaxSize + 1;
  CHECK_THROWS_AS(decode(encode(q)), std::runtime_error);
  q = p;
  q.iters = 0;
  CHECK_THROWS_AS(decode(encode(q)), std::runtime_error);
  q.iters = kMaxIters + 1;
  CHECK_THROWS_AS(decode(encode(q)), std::runtime_error);
  q = p;
  q.window = 0;
  CHECK_THROWS_AS(decode(encode(q)), std::runtime_error);
  q.window = kMaxWindow + 1;
  CHECK_THROWS_AS(decode(encode(q)), std::runtime_error);
  q = p;
  q.test = test_kind::atomic_lat;
  q.size = 16;  // atomics are 8 bytes
  CHECK_THROWS_AS(decode(encode(q)), std::runtime_error);
  q.size = 8;
  CHECK_NOTHROW(decode(encode(q)));
}

TEST_CASE("perf plan: --all-sizes runs every power of two from 2 B to 8 MiB, fewer iterations above 8 KiB",
          "[perf]") {
  plan p;
  p.all_sizes = true;
  p.iters = 10000;
  const auto sizes = sizes_of(p);
  REQUIRE(sizes.size() == 23);
  CHECK(sizes.front() == 2u);
  CHECK(sizes.back() == 8u << 20);
  for (std::size_t i = 1; i < sizes.size(); ++i) CHECK(sizes[i] == 2 * sizes[i - 1]);
  CHECK(iters_at(p, 8192) == 10000u);
  CHECK(iters_at(p, 16384) == 5000u);
  CHECK(iters_at(p, 8u << 20) == kSweepMinIters);  // scaled to 9, held at the minimum
  p.iters = 50;                                    // fewer than the minimum asked for: that many
  CHECK(iters_at(p, 8u << 20) == 50u);
  p.all_sizes = false;
  p.size = 1u << 20;
  p.iters = 10000;
  CHECK(sizes_of(p) == std::vector<std::uint32_t>{1u << 20});
  CHECK(iters_at(p, p.size) == 10000u);  // one size: all of them
  p.test = test_kind::atomic_lat;
  p.size = 8;
  p.all_sizes = true;
  CHECK(sizes_of(p) == std::vector<std::uint32_t>{8});  // atomics have one size
  CHECK(warmup_for(5) == 10u);
  CHECK(warmup_for(2000) == 200u);
  CHECK(warmup_for(1'000'000) == 1000u);
}

namespace {

using anydoor::transport::completion;

// The passive side of a session test, on a thread: accepts one session
// and polls its completion queue (the tcp provider executes the peer's
// writes while this side polls) until stopped, then keeps its buffer.
// Stopped and joined however the test leaves the scope.
class polling_peer {
 public:
  explicit polling_peer(const anydoor::examples::session_options& opt)
      : thread_([this, opt] {
          try {
            anydoor::examples::session s = anydoor::examples::accept_one(
                "127.0.0.1", 0, opt,
                [](std::uint16_t p, void* ctx) { static_cast<std::atomic<std::uint16_t>*>(ctx)->store(p); }, &port_);
            completion c[16];
            std::error_code ec;
            while (!stop_.load() && !ec) (void)s.cq->poll(c, ec);
            served_ = s.buf;
          } catch (const std::exception& e) {
            error_ = e.what();  // written before failed_, read after it or after the join
            failed_ = true;
          }
        }) {}
  ~polling_peer() { join(); }
  polling_peer(const polling_peer&) = delete;
  polling_peer& operator=(const polling_peer&) = delete;

  // Its port once it listens (0: it failed first).
  std::uint16_t port() const {
    while (port_.load() == 0 && !failed_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return port_.load();
  }
  void join() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  const std::string& error() const noexcept { return error_; }  // after join()
  const std::vector<std::byte>& served() const noexcept { return served_; }

 private:
  std::atomic<std::uint16_t> port_{0};
  std::atomic<bool> stop_{false}, failed_{false};
  std::vector<std::byte> served_;
  std::string error_;
  std::thread thread_;  // last: started once the rest is constructed
};

}  // namespace

// The stream behind write_bw and read_bw (apps/common/session.cpp): with
// `slots`, the writes land in that many places of the peer's buffer and
// nowhere else; by default they spread over as many as half of it holds.
TEST_CASE("perf stream: writes cycle through the places --slots gives, and by default through half the buffer",
          "[perf]") {
  using namespace anydoor::examples;
  constexpr std::uint32_t kSize = 4096;
  for (const std::uint64_t slots : {std::uint64_t{2}, std::uint64_t{0}}) {
    const session_options opt{.provider = "tcp", .buffer_size = 1 << 20, .queue_depth = 64};
    polling_peer server(opt);
    const std::uint16_t port = server.port();
    REQUIRE(port != 0);
    {
      session s = connect_to("127.0.0.1", port, opt);
      std::fill(s.buf.begin(), s.buf.end(), std::byte{0x7e});
      (void)stream(s, anydoor::transport::opcode::write, kSize, 100, 8, slots);
      CHECK_THROWS_AS(stream(s, anydoor::transport::opcode::write, kSize, 1, 8, (opt.buffer_size / 2) / kSize + 1),
                      std::invalid_argument);
    }
    server.join();
    REQUIRE(server.error().empty());
    const std::vector<std::byte>& served = server.served();
    REQUIRE(served.size() == opt.buffer_size);
    // written: [0, places * kSize); untouched after it
    const std::size_t places = slots != 0 ? slots : 100;
    const auto first_zero = static_cast<std::size_t>(
        std::find(served.begin(), served.end(), std::byte{0}) - served.begin());
    INFO("slots " << slots);
    CHECK(first_zero == places * kSize);
    CHECK(std::all_of(served.begin() + static_cast<std::ptrdiff_t>(first_zero), served.end(),
                      [](std::byte b) { return b == std::byte{0}; }));
  }
}

// session::wait's limit (apps/common/session.cpp: the clock read every
// 4096 empty polls): nothing arrives, so it ends with timed_out once the
// limit has passed, not before and not long after.
TEST_CASE("perf session: a wait for a completion that never comes ends with timed_out at its limit", "[perf]") {
  using namespace anydoor::examples;
  const session_options opt{.provider = "tcp", .buffer_size = 1 << 16, .queue_depth = 16};
  polling_peer server(opt);
  const std::uint16_t port = server.port();
  REQUIRE(port != 0);
  session s = connect_to("127.0.0.1", port, opt);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    (void)s.wait(std::chrono::milliseconds(200));
    FAIL("a wait with nothing posted returned");
  } catch (const std::system_error& e) {
    CHECK(e.code() == anydoor::errc::timed_out);
  }
  const auto waited = std::chrono::steady_clock::now() - t0;
  CHECK(waited >= std::chrono::milliseconds(200));
  CHECK(waited < std::chrono::seconds(10));
}
