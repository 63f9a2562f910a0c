// Test support: two endpoints of one provider connected in one process, and a
// driver that polls every completion queue (the tcp provider progresses in
// poll, so the target's queue must be polled for one-sided work to happen).
#pragma once

#include <anydoor/error.hpp>
#include <anydoor/transport/provider.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace anydoor::test {

namespace tp = anydoor::transport;
using namespace std::chrono_literals;

// ANYDOOR_TEST_PROVIDER selects the provider under test (default tcp);
// ANYDOOR_TEST_HOST the address to listen on and connect to.
inline std::string provider_under_test() {
  const char* p = std::getenv("ANYDOOR_TEST_PROVIDER");
  return p != nullptr && *p != '\0' ? p : "tcp";
}
inline std::string test_host() {
  const char* h = std::getenv("ANYDOOR_TEST_HOST");
  return h != nullptr && *h != '\0' ? h : "127.0.0.1";
}
// Where providers legitimately differ, tests check this and say why.
inline bool testing_tcp() { return provider_under_test() == "tcp"; }

// iWARP (siw) completes a WRITE at the requester once the transport has
// taken its data, not once it is placed (RC's ACK implies placement, as on
// tcp and rxe): waits, bounded, until `placed()` holds, and returns it.
template <class Pred>
bool wait_placed(Pred placed, std::chrono::milliseconds limit = 2000ms) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!placed() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(1ms);
  return placed();
}

inline std::unique_ptr<tp::device> open_test_device() {
  return tp::open_device({.provider = provider_under_test()});
}

struct endpoint {
  std::unique_ptr<tp::device> dev = open_test_device();
  std::unique_ptr<tp::protection_domain> pd = dev->alloc_pd();
  std::unique_ptr<tp::completion_queue> cq;
  std::unique_ptr<tp::queue_pair> qp;

  explicit endpoint(std::uint32_t cq_depth = 4096, const tp::cq_options& cq_opts = {})
      : cq(dev->create_cq(cq_depth, cq_opts)) {}
  tp::qp_attributes attrs(tp::qp_attributes a = {}) {
    a.send_cq = cq.get();
    a.recv_cq = cq.get();
    return a;
  }
};

// A device with a domain, a completion queue and one fresh queue pair.
struct one_qp {
  std::unique_ptr<tp::device> dev = open_test_device();
  std::unique_ptr<tp::protection_domain> pd = dev->alloc_pd();
  std::unique_ptr<tp::completion_queue> cq = dev->create_cq(512);
  std::unique_ptr<tp::queue_pair> qp = pd->create_qp({.send_cq = cq.get(), .recv_cq = cq.get()});
};

// Connects `client` (active side) to `server` (passive side), both fresh
// queue pairs from create_qp. Returns the server's queue pair.
inline void connect_pair(tp::device& server_dev, tp::queue_pair& server_qp, tp::device& client_dev,
                         tp::queue_pair& client_qp) {
  auto lis = server_dev.listen(test_host(), 0);
  std::error_code accept_ec;
  std::thread acceptor([&] {
    std::error_code ec;
    auto req = lis->get_request(10s, ec);
    if (!req) {
      accept_ec = ec;
      return;
    }
    accept_ec = req->accept(server_qp, {});
  });
  auto r = client_dev.connect(client_qp, test_host(), lis->port(), {}, 10s);
  acceptor.join();
  REQUIRE_FALSE(r.ec);
  REQUIRE_FALSE(accept_ec);
}

// Whether the device keeps an RNR counter (device::counters()). tcp and
// rxe keep all three and must (CI runs both: there a missing counter fails
// the test); another NIC may lack one (mlx5 counts no RNR NAK received):
// its check is skipped with a warning naming the counter, never passed.
inline bool device_keeps(const tp::device& d, const std::optional<std::uint64_t>& counter, const char* name) {
  if (counter.has_value()) return true;
  const std::string where = std::string(d.provider()) + " device " + std::string(d.name()) + ": " +
                            d.counters().source;
  if (d.provider() == "tcp" || d.name().rfind("rxe", 0) == 0) {
    FAIL("the device keeps no " << name << " counter (" << where << ")");
  }
  WARN("skipped: the device keeps no " << name << " counter (" << where << ")");
  return false;
}

// The error code f() throws (std::system_error), or none.
template <class F>
std::error_code thrown(F f) {
  try {
    f();
  } catch (const std::system_error& e) {
    return e.code();
  }
  return {};
}

// Polls a set of completion queues, keeping what each produced.
class driver {
 public:
  explicit driver(std::initializer_list<tp::completion_queue*> cqs) : cqs_(cqs) {}
  void add(tp::completion_queue* cq) { cqs_.push_back(cq); }

  // One poll of every queue; returns the first error seen.
  std::error_code step() {
    std::error_code first;
    for (auto* cq : cqs_) {
      tp::completion buf[32];
      std::error_code ec;
      const std::size_t n = cq->poll(buf, ec);
      if (ec && !first) first = ec;
      for (std::size_t i = 0; i < n; ++i) got_[cq].push_back(buf[i]);
    }
    return first;
  }

  // Drives until cq produced n completions (returns them) or the timeout.
  std::vector<tp::completion> wait(tp::completion_queue* cq, std::size_t n,
                                   std::chrono::milliseconds timeout = 10s) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (got_[cq].size() < n && std::chrono::steady_clock::now() < deadline) step();
    std::vector<tp::completion> out;
    auto& q = got_[cq];
    while (!q.empty() && out.size() < n) {
      out.push_back(q.front());
      q.pop_front();
    }
    return out;
  }
  tp::completion wait_one(tp::completion_queue* cq, std::chrono::milliseconds timeout = 10s) {
    auto v = wait(cq, 1, timeout);
    REQUIRE(v.size() == 1);
    return v[0];
  }
  // Drives for a while and returns everything cq produced meanwhile.
  std::vector<tp::completion> settle(tp::completion_queue* cq, std::chrono::milliseconds d) {
    const auto deadline = std::chrono::steady_clock::now() + d;
    while (std::chrono::steady_clock::now() < deadline) step();
    std::vector<tp::completion> out(got_[cq].begin(), got_[cq].end());
    got_[cq].clear();
    return out;
  }

 private:
  std::vector<tp::completion_queue*> cqs_;
  std::map<tp::completion_queue*, std::deque<tp::completion>> got_;
};

// Two connected endpoints: a (client) and b (server).
struct connected_pair {
  endpoint a, b;
  driver drv{a.cq.get(), b.cq.get()};
  explicit connected_pair(tp::qp_attributes attr = {}, std::uint32_t cq_depth_a = 4096,
                          std::uint32_t cq_depth_b = 4096, const tp::cq_options& cq_opts_b = {})
      : a(cq_depth_a), b(cq_depth_b, cq_opts_b) {
    a.qp = a.pd->create_qp(a.attrs(attr));
    b.qp = b.pd->create_qp(b.attrs(attr));
    connect_pair(*b.dev, *b.qp, *a.dev, *a.qp);
  }
};

inline tp::work_request send_wr(std::uint64_t id, std::span<const tp::sge> sg, bool signaled = true) {
  return {.wr_id = id, .op = tp::opcode::send, .sg_list = sg, .signaled = signaled};
}

// A connected pair set up to overflow the receiver's completion queue: b's
// queue holds 4 completions and b has 8 receives posted. overflow() sends 8
// messages from a and polls b's queue one completion at a time until it
// reports an error, which it returns (cq_overflow when the queue overflowed).
struct overflow_pair : connected_pair {
  std::vector<char> src = std::vector<char>(8, 'o');
  std::vector<char> dst = std::vector<char>(8 * 8);
  std::unique_ptr<tp::memory_region> smr = a.pd->register_memory(src.data(), src.size(), tp::access::none);
  std::unique_ptr<tp::memory_region> dmr = b.pd->register_memory(dst.data(), dst.size(), tp::access::local_write);

  overflow_pair() : connected_pair({}, 4096, 4) {
    std::vector<tp::sge> rsg;
    for (std::size_t i = 0; i < 8; ++i) rsg.push_back(dmr->slice(i * 8, 8));
    std::vector<tp::recv_request> rr;
    for (std::size_t i = 0; i < 8; ++i) rr.push_back({.wr_id = i, .sg_list = {&rsg[i], 1}});
    REQUIRE_FALSE(b.qp->post_recv(rr));
  }

  std::error_code overflow() {
    tp::sge ssg = smr->slice(0, 8);
    std::vector<tp::work_request> wrs;
    for (std::uint64_t i = 0; i < 8; ++i) wrs.push_back(send_wr(i, {&ssg, 1}));
    REQUIRE_FALSE(a.qp->post_send(wrs));
    std::this_thread::sleep_for(50ms);  // every message reaches b before it polls
    std::error_code ec;
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (!ec && std::chrono::steady_clock::now() < deadline) {
      tp::completion one[1];
      b.cq->poll(one, ec);
    }
    return ec;
  }
};

}  // namespace anydoor::test
