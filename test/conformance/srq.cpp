// Provider conformance: shared receive queues (ibv_srq semantics), and the
// receive a message was filling when its connection failed.
#include "../support/harness.hpp"

#include <poll.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>

using namespace anydoor::test;
using tp::access;

namespace {

// b (the server) receives from one shared queue on two queue pairs, each
// connected to its own client endpoint.
struct srq_setup {
  endpoint b;
  std::unique_ptr<tp::shared_receive_queue> srq;
  endpoint a1, a2;
  std::unique_ptr<tp::queue_pair> b1, b2;
  driver drv{b.cq.get(), a1.cq.get(), a2.cq.get()};

  explicit srq_setup(tp::srq_attributes sa = {.max_wr = 64, .max_sge = 2}, tp::qp_attributes qa = {}) {
    REQUIRE(b.dev->caps().max_srq > 0);
    srq = b.pd->create_srq(sa);
    tp::qp_attributes with = qa;
    with.srq = srq.get();
    b1 = b.pd->create_qp(b.attrs(with));
    b2 = b.pd->create_qp(b.attrs(with));
    a1.qp = a1.pd->create_qp(a1.attrs(qa));
    a2.qp = a2.pd->create_qp(a2.attrs(qa));
    connect_pair(*b.dev, *b1, *a1.dev, *a1.qp);
    connect_pair(*b.dev, *b2, *a2.dev, *a2.qp);
  }
};

}  // namespace

TEST_CASE("shared receive queue: queue pairs take the oldest receive from one queue and completions name the queue pair",
          "[conformance]") {
  srq_setup s;
  std::vector<std::byte> dst(4 * 64);
  auto dmr = s.b.pd->register_memory(dst.data(), dst.size(), access::local_write);
  // Receive i: 64 bytes at i * 64, in two pieces (32 + 32).
  std::vector<tp::sge> rsg;
  for (std::size_t i = 0; i < 4; ++i) {
    rsg.push_back(dmr->slice(i * 64, 32));
    rsg.push_back(dmr->slice(i * 64 + 32, 32));
  }
  std::vector<tp::recv_request> rr;
  for (std::size_t i = 0; i < 4; ++i) rr.push_back({.wr_id = 100 + i, .sg_list = {&rsg[i * 2], 2}});
  REQUIRE_FALSE(s.srq->post_recv(rr));

  char m1[40], m2[40];
  std::memset(m1, '1', sizeof m1);
  std::memset(m2, '2', sizeof m2);
  auto mr1 = s.a1.pd->register_memory(m1, sizeof m1, access::none);
  auto mr2 = s.a2.pd->register_memory(m2, sizeof m2, access::none);
  tp::sge sg1 = mr1->slice(0, 40), sg2 = mr2->slice(0, 40);
  // a1 first (its message takes receive 100), then a2 (101), then a1 again (102).
  tp::work_request w1 = send_wr(1, {&sg1, 1});
  REQUIRE_FALSE(s.a1.qp->post_send({&w1, 1}));
  auto c1 = s.drv.wait_one(s.b.cq.get());
  tp::work_request w2 = send_wr(2, {&sg2, 1});
  REQUIRE_FALSE(s.a2.qp->post_send({&w2, 1}));
  auto c2 = s.drv.wait_one(s.b.cq.get());
  REQUIRE_FALSE(s.a1.qp->post_send({&w1, 1}));
  auto c3 = s.drv.wait_one(s.b.cq.get());

  for (const auto& c : {c1, c2, c3}) {
    CHECK(c.status == tp::wc_status::success);
    CHECK(c.opcode == tp::wc_opcode::recv);
    CHECK(c.byte_len == 40);
  }
  CHECK(c1.wr_id == 100);
  CHECK(c1.qp_num == s.b1->qp_num());
  CHECK(c2.wr_id == 101);
  CHECK(c2.qp_num == s.b2->qp_num());
  CHECK(c3.wr_id == 102);
  CHECK(c3.qp_num == s.b1->qp_num());
  // Each message scattered over its receive's two pieces; receive 103 untouched.
  CHECK(std::all_of(dst.begin(), dst.begin() + 40, [](std::byte x) { return x == std::byte{'1'}; }));
  CHECK(std::all_of(dst.begin() + 64, dst.begin() + 104, [](std::byte x) { return x == std::byte{'2'}; }));
  CHECK(std::all_of(dst.begin() + 128, dst.begin() + 168, [](std::byte x) { return x == std::byte{'1'}; }));
  CHECK(std::all_of(dst.begin() + 192, dst.end(), [](std::byte x) { return x == std::byte{0}; }));
  CHECK(s.drv.wait(s.a1.cq.get(), 2).size() == 2);
  CHECK(s.drv.wait(s.a2.cq.get(), 1).size() == 1);
}

TEST_CASE("shared receive queue: creation and posting are checked and its queue pairs refuse their own receives",
          "[conformance]") {
  endpoint b;
  const auto& caps = b.dev->caps();
  REQUIRE(caps.max_srq > 0);
  REQUIRE(caps.max_srq_wr > 0);
  auto err = [&](tp::srq_attributes a) {
    try {
      b.pd->create_srq(a);
    } catch (const std::system_error& e) {
      return e.code();
    }
    return std::error_code{};
  };
  CHECK(err({.max_wr = 0, .max_sge = 1}) == anydoor::errc::invalid_argument);
  CHECK(err({.max_wr = 4, .max_sge = 0}) == anydoor::errc::invalid_argument);
  CHECK(err({.max_wr = 4, .max_sge = caps.max_sge + 1}) == anydoor::errc::invalid_argument);
  if (caps.max_srq_wr < ~std::uint32_t{0}) {
    CHECK(err({.max_wr = caps.max_srq_wr + 1, .max_sge = 1}) == anydoor::errc::invalid_argument);
  }

  auto srq = b.pd->create_srq({.max_wr = 8, .max_sge = 1});
  const std::uint32_t depth = srq->attributes().max_wr;
  CHECK(depth >= 8);
  CHECK(srq->attributes().max_sge >= 1);
  std::vector<char> buf(64);
  auto mr = b.pd->register_memory(buf.data(), buf.size(), access::local_write);
  tp::sge sg[2] = {mr->slice(0, 8), mr->slice(8, 8)};
  // Too many sges: refused, nothing posted (*bad names it).
  tp::recv_request two[] = {{.wr_id = 1, .sg_list = {sg, 1}}, {.wr_id = 2, .sg_list = {sg, 2}}};
  std::size_t bad = 99;
  CHECK(srq->post_recv(two, &bad) == anydoor::errc::invalid_argument);
  CHECK(bad == 1);
  // Filled to its size, then one more: queue_full.
  std::vector<tp::recv_request> fill(depth, {.wr_id = 3, .sg_list = {sg, 1}});
  REQUIRE_FALSE(srq->post_recv(fill));
  tp::recv_request one{.wr_id = 4, .sg_list = {sg, 1}};
  CHECK(srq->post_recv({&one, 1}, &bad) == anydoor::errc::queue_full);
  CHECK(bad == 0);
  CHECK(srq->arm_limit(depth + 1) == anydoor::errc::invalid_argument);

  // A queue pair on it: its own post_recv is refused.
  auto qp = b.pd->create_qp(b.attrs({.srq = srq.get()}));
  REQUIRE_FALSE(qp->modify(tp::qp_state::init));
  CHECK(qp->post_recv({&one, 1}) == anydoor::errc::invalid_argument);

  // A shared queue of another protection domain is refused at creation.
  auto other_pd = b.dev->alloc_pd();
  auto other = other_pd->create_srq({.max_wr = 4, .max_sge = 1});
  try {
    b.pd->create_qp(b.attrs({.srq = other.get()}));
    FAIL("a queue pair was created on another domain's shared receive queue");
  } catch (const std::system_error& e) {
    CHECK(e.code() == anydoor::errc::invalid_argument);
  }
  qp.reset();
}

TEST_CASE("shared receive queue: an empty queue turns a send back (RNR) until a receive is posted", "[conformance]") {
  srq_setup s({.max_wr = 16, .max_sge = 1}, {.rnr_retry = 7, .min_rnr_timer_us = 1000});
  std::vector<char> src(16, 's'), dst(16);
  auto smr = s.a1.pd->register_memory(src.data(), src.size(), access::none);
  auto dmr = s.b.pd->register_memory(dst.data(), dst.size(), access::local_write);
  tp::sge ssg = smr->slice(0, 16);
  tp::work_request w = send_wr(7, {&ssg, 1});
  REQUIRE_FALSE(s.a1.qp->post_send({&w, 1}));
  CHECK(s.drv.settle(s.a1.cq.get(), 100ms).empty());  // turned back, retried, not failed
  CHECK(s.drv.settle(s.b.cq.get(), 1ms).empty());
  tp::sge rsg = dmr->slice(0, 16);
  tp::recv_request rr{.wr_id = 9, .sg_list = {&rsg, 1}};
  REQUIRE_FALSE(s.srq->post_recv({&rr, 1}));
  auto rc = s.drv.wait_one(s.b.cq.get());
  CHECK(rc.status == tp::wc_status::success);
  CHECK(rc.wr_id == 9);
  CHECK(rc.qp_num == s.b1->qp_num());
  auto sc = s.drv.wait_one(s.a1.cq.get());
  CHECK(sc.status == tp::wc_status::success);
  CHECK(std::string(dst.begin(), dst.end()) == std::string(16, 's'));
}

TEST_CASE("shared receive queue: the limit reports once when fewer than the limit remain posted", "[conformance]") {
  srq_setup s({.max_wr = 16, .max_sge = 1});
  std::vector<char> src(8, 'l'), dst(8 * 4);
  auto smr = s.a1.pd->register_memory(src.data(), src.size(), access::none);
  auto dmr = s.b.pd->register_memory(dst.data(), dst.size(), access::local_write);
  std::vector<tp::sge> rsg;
  for (std::size_t i = 0; i < 4; ++i) rsg.push_back(dmr->slice(i * 8, 8));
  std::vector<tp::recv_request> rr;
  for (std::size_t i = 0; i < 4; ++i) rr.push_back({.wr_id = i, .sg_list = {&rsg[i], 1}});
  REQUIRE_FALSE(s.srq->post_recv(rr));
  REQUIRE_FALSE(s.srq->arm_limit(3));
  CHECK_FALSE(s.srq->limit_reached());
  tp::sge ssg = smr->slice(0, 8);
  tp::work_request w = send_wr(1, {&ssg, 1});
  auto one_message = [&] {
    REQUIRE_FALSE(s.a1.qp->post_send({&w, 1}));
    CHECK(s.drv.wait_one(s.b.cq.get()).status == tp::wc_status::success);
    CHECK(s.drv.wait_one(s.a1.cq.get()).status == tp::wc_status::success);
  };
  // The device reports the event asynchronously (verbs): give it time
  // before concluding that nothing was reported.
  auto reached_within = [&](std::chrono::milliseconds d) {
    const auto until = std::chrono::steady_clock::now() + d;
    do {
      if (s.srq->limit_reached()) return true;
      s.drv.step();
    } while (std::chrono::steady_clock::now() < until);
    return false;
  };
  one_message();  // 3 left: not below 3
  CHECK_FALSE(reached_within(200ms));
  const tp::device_counters before = s.b.dev->counters();
  const tp::device_counters before_a1 = s.a1.dev->counters();
  const tp::device_counters before_a2 = s.a2.dev->counters();
  one_message();  // 2 left: below
  CHECK(reached_within(5s));
  CHECK_FALSE(s.srq->limit_reached());  // once
  // verbs delivers it as an asynchronous event, which the device counts
  // (and not as an error); tcp has no event channel and keeps no count.
  // Every device open on one context reads its events (they share the
  // async fd): the one of the sending side, polled here too, may be the
  // one that took it.
  const tp::device_counters after = s.b.dev->counters();
  if (s.b.dev->provider() == "verbs") {
    REQUIRE(before.async_events.has_value());
    REQUIRE(after.async_events.has_value());
    REQUIRE(before_a1.async_events.has_value());
    REQUIRE(before_a2.async_events.has_value());
    const tp::device_counters after_a1 = s.a1.dev->counters();
    const tp::device_counters after_a2 = s.a2.dev->counters();
    REQUIRE(after_a1.async_events.has_value());
    REQUIRE(after_a2.async_events.has_value());
    CHECK(*after.async_events + *after_a1.async_events + *after_a2.async_events >
          *before.async_events + *before_a1.async_events + *before_a2.async_events);
    CHECK(after.async_errors == before.async_errors);
  } else {
    CHECK_FALSE(after.async_events.has_value());
  }
  one_message();  // 1 left: disarmed, no second report
  CHECK_FALSE(reached_within(200ms));
  REQUIRE_FALSE(s.srq->arm_limit(0));
}

TEST_CASE("shared receive queue: a queue pair that fails takes no posted receive with it", "[conformance]") {
  srq_setup s({.max_wr = 16, .max_sge = 1});
  std::vector<char> src(8, 'k'), dst(8 * 2);
  auto smr = s.a2.pd->register_memory(src.data(), src.size(), access::none);
  auto dmr = s.b.pd->register_memory(dst.data(), dst.size(), access::local_write);
  tp::sge rsg[] = {dmr->slice(0, 8), dmr->slice(8, 8)};
  tp::recv_request rr[] = {{.wr_id = 1, .sg_list = {&rsg[0], 1}}, {.wr_id = 2, .sg_list = {&rsg[1], 1}}};
  REQUIRE_FALSE(s.srq->post_recv(rr));
  // b1 fails (its peer goes away, and it is moved to error): no completion
  // on b's queue, the shared receives stay posted.
  s.a1.qp.reset();
  REQUIRE_FALSE(s.b1->modify(tp::qp_state::error));
  CHECK(s.drv.settle(s.b.cq.get(), 300ms).empty());
  // b2 still receives both, in order.
  tp::sge ssg = smr->slice(0, 8);
  tp::work_request w[] = {send_wr(1, {&ssg, 1}), send_wr(2, {&ssg, 1})};
  REQUIRE_FALSE(s.a2.qp->post_send(w));
  auto c = s.drv.wait(s.b.cq.get(), 2);
  REQUIRE(c.size() == 2);
  CHECK(c[0].wr_id == 1);
  CHECK(c[1].wr_id == 2);
  for (const auto& x : c) {
    CHECK(x.status == tp::wc_status::success);
    CHECK(x.qp_num == s.b2->qp_num());
  }
}

TEST_CASE("a receive being filled when the sender goes away completes flushed (own or shared queue)", "[conformance]") {
  const bool shared = GENERATE(false, true);
  INFO((shared ? "shared receive queue" : "the queue pair's own receive queue"));
  endpoint a, b;
  // A message far larger than the sockets' buffers (tcp): the sender's side
  // is destroyed while the receiver has only part of it.
  const std::size_t kSize = std::min<std::size_t>(64u << 20, a.dev->caps().max_msg_size);
  std::unique_ptr<tp::shared_receive_queue> srq;
  if (shared) srq = b.pd->create_srq({.max_wr = 4, .max_sge = 1});
  a.qp = a.pd->create_qp(a.attrs());
  auto bqp = b.pd->create_qp(b.attrs({.srq = srq.get()}));  // destroyed before its queue
  connect_pair(*b.dev, *bqp, *a.dev, *a.qp);
  std::vector<char> src(kSize, 'p'), dst(kSize);
  auto smr = a.pd->register_memory(src.data(), src.size(), access::none);
  auto dmr = b.pd->register_memory(dst.data(), dst.size(), access::local_write);
  tp::sge rsg = dmr->slice(0, static_cast<std::uint32_t>(kSize));
  tp::recv_request rr{.wr_id = 55, .sg_list = {&rsg, 1}};
  const std::error_code posted = shared ? srq->post_recv({&rr, 1}) : bqp->post_recv({&rr, 1});
  REQUIRE_FALSE(posted);
  tp::sge ssg = smr->slice(0, static_cast<std::uint32_t>(kSize));
  tp::work_request w = send_wr(1, {&ssg, 1});
  REQUIRE_FALSE(a.qp->post_send({&w, 1}));
  driver d{b.cq.get()};
  auto early = d.settle(b.cq.get(), 50ms);  // b takes in what has arrived
  a.qp.reset();
  auto late = d.wait(b.cq.get(), 1, 10s);
  early.insert(early.end(), late.begin(), late.end());
  REQUIRE(early.size() == 1);
  CHECK(early[0].wr_id == 55);
  CHECK(early[0].qp_num == bqp->qp_num());
  if (testing_tcp()) {
    // Deterministic on tcp: the sender's socket took only a few MiB.
    CHECK(early[0].status == tp::wc_status::work_request_flushed);
  } else {
    // A NIC may have received the whole message before the sender went away.
    CHECK((early[0].status == tp::wc_status::work_request_flushed || early[0].status == tp::wc_status::success));
  }
}

namespace {
// Whether the RDMA device lists queue pair qpn (iproute2's rdma tool; false
// where it is missing).
bool device_lists_qp(std::uint32_t qpn) {
  const std::string cmd = "rdma resource show qp lqpn " + std::to_string(qpn) + " 2>/dev/null";
  std::string out;
  if (FILE* f = ::popen(cmd.c_str(), "r")) {
    char line[512];
    while (std::fgets(line, sizeof line, f) != nullptr) out += line;
    ::pclose(f);
  }
  return out.find("lqpn " + std::to_string(qpn) + " ") != std::string::npos;
}
}  // namespace

TEST_CASE("shared receive queue: a queue pair destroyed while filling a shared receive gives it back flushed",
          "[conformance]") {
  endpoint a, b;
  // A message far larger than the sockets' buffers (tcp) or a few ms of
  // rxe's time: b's queue pair is destroyed with only part of it in.
  const std::size_t kSize = std::min<std::size_t>(64u << 20, a.dev->caps().max_msg_size);
  std::unique_ptr<tp::shared_receive_queue> srq = b.pd->create_srq({.max_wr = 4, .max_sge = 1});
  a.qp = a.pd->create_qp(a.attrs());
  auto bqp = b.pd->create_qp(b.attrs({.srq = srq.get()}));
  connect_pair(*b.dev, *bqp, *a.dev, *a.qp);
  std::vector<char> src(kSize, 'p'), dst(kSize);
  auto smr = a.pd->register_memory(src.data(), src.size(), access::none);
  auto dmr = b.pd->register_memory(dst.data(), dst.size(), access::local_write);
  tp::sge rsg = dmr->slice(0, static_cast<std::uint32_t>(kSize));
  tp::recv_request rr{.wr_id = 55, .sg_list = {&rsg, 1}};
  REQUIRE_FALSE(srq->post_recv({&rr, 1}));
  tp::sge ssg = smr->slice(0, static_cast<std::uint32_t>(kSize));
  tp::work_request w = send_wr(1, {&ssg, 1});
  REQUIRE_FALSE(a.qp->post_send({&w, 1}));
  driver d{b.cq.get()};  // (a's is not polled: on tcp its sends then go no further than its socket's buffer)
  auto got = d.settle(b.cq.get(), testing_tcp() ? 50ms : 5ms);  // b takes in what has arrived
  const std::uint32_t qpn = bqp->qp_num();
  const bool listed_before = !testing_tcp() && device_lists_qp(qpn);
  bqp.reset();  // no move to error first: the destroy alone must give the receive back
  auto late = d.wait(b.cq.get(), 1, 5s);
  got.insert(got.end(), late.begin(), late.end());
  REQUIRE(got.size() == 1);
  CHECK(got[0].wr_id == 55);
  CHECK(got[0].qp_num == qpn);
  if (testing_tcp()) {
    CHECK(got[0].status == tp::wc_status::work_request_flushed);  // deterministic: the socket held a few MiB
  } else {
    // A NIC may have taken the whole message in before the destroy.
    CHECK((got[0].status == tp::wc_status::work_request_flushed || got[0].status == tp::wc_status::success));
    if (got[0].status == tp::wc_status::success) WARN("the whole message arrived before the destroy");
  }
  // A reactor asleep on b's queue: woken for what is left of the queue
  // pair's teardown (verbs: the wait for its last receive ends on a timer),
  // and otherwise left asleep (no storm of wake-ups); nothing else comes.
  std::size_t stray = 0;
  int wakes = 0;
  const auto asleep_until = std::chrono::steady_clock::now() + 600ms;
  for (;;) {
    tp::completion buf[8];
    std::error_code ec;
    stray += b.cq->poll(buf, ec);
    REQUIRE_FALSE(b.cq->arm());
    stray += b.cq->poll(buf, ec);  // (what came between the poll and the arm)
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(asleep_until - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{b.cq->notify_fd(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) > 0) {
      ++wakes;
      (void)b.cq->ack_events();
    }
  }
  CHECK(stray == 0);
  CHECK(wakes < 20);
  if (listed_before) {
    // The device no longer has the queue pair (it was listed before).
    CHECK_FALSE(device_lists_qp(qpn));
  } else if (!testing_tcp()) {
    WARN("rdma (iproute2) is missing or lists no queue pairs: whether the device destroyed queue pair "
         << qpn << " is not checked");
  }
  // The queue has every slot back: a full queue's worth of receives posts.
  std::vector<tp::recv_request> refill(srq->attributes().max_wr, tp::recv_request{.wr_id = 56, .sg_list = {&rsg, 1}});
  CHECK_FALSE(srq->post_recv(refill));
}
