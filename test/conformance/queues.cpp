// Provider conformance: ordering, selective signaling, batching, many queue
// pairs on one completion queue, and completion notification.
#include "../support/harness.hpp"

#include <poll.h>

#include <cstring>
#include <set>

using namespace anydoor::test;
using tp::access;

TEST_CASE("requests execute and complete in order on a queue pair", "[conformance]") {
  connected_pair p({.max_send_wr = 64, .max_recv_wr = 256});
  constexpr std::uint64_t kN = 200;
  alignas(8) std::uint64_t cell = 0;
  std::vector<std::uint64_t> values(kN);
  std::vector<char> msgs(kN * 8), rbuf(kN * 8);
  auto vmr = p.a.pd->register_memory(values.data(), kN * 8, access::none);
  auto smr = p.a.pd->register_memory(msgs.data(), msgs.size(), access::none);
  auto cmr = p.b.pd->register_memory(&cell, 8, access::local_write | access::remote_write);
  auto rmr = p.b.pd->register_memory(rbuf.data(), rbuf.size(), access::local_write);
  std::vector<tp::sge> rsg(kN), vsg(kN), ssg(kN);
  std::vector<tp::recv_request> rr(kN);
  for (std::uint64_t i = 0; i < kN; ++i) {
    rsg[i] = rmr->slice(i * 8, 8);
    rr[i] = {.wr_id = i, .sg_list = {&rsg[i], 1}};
  }
  REQUIRE_FALSE(p.b.qp->post_recv(rr));
  // interleave writes of increasing values to one cell with sends; each send
  // carries the value written just before it
  std::vector<tp::work_request> wrs;
  for (std::uint64_t i = 0; i < kN; ++i) {
    values[i] = i + 1;
    std::memcpy(&msgs[i * 8], &values[i], 8);
    vsg[i] = vmr->slice(i * 8, 8);
    ssg[i] = smr->slice(i * 8, 8);
    wrs.push_back({.wr_id = 2 * i, .op = tp::opcode::write, .sg_list = {&vsg[i], 1},
                   .remote_addr = reinterpret_cast<std::uint64_t>(&cell), .rkey = cmr->rkey()});
    wrs.push_back(send_wr(2 * i + 1, {&ssg[i], 1}));
  }
  for (std::size_t off = 0; off < wrs.size(); off += 50) {  // 50 per doorbell, below max_send_wr
    REQUIRE_FALSE(p.a.qp->post_send(std::span(wrs).subspan(off, 50)));
    auto c = p.drv.wait(p.a.cq.get(), 50);
    REQUIRE(c.size() == 50);
    for (std::size_t k = 0; k < 50; ++k) {
      CHECK(c[k].wr_id == off + k);
      CHECK(c[k].status == tp::wc_status::success);
    }
  }
  auto rc = p.drv.wait(p.b.cq.get(), kN);
  REQUIRE(rc.size() == kN);
  for (std::uint64_t i = 0; i < kN; ++i) {
    CHECK(rc[i].wr_id == i);
    std::uint64_t v;
    std::memcpy(&v, &rbuf[i * 8], 8);
    CHECK(v == i + 1);
  }
  CHECK(cell == kN);
}

TEST_CASE("unsignaled requests are retired by a later signaled one", "[conformance]") {
  connected_pair p({.max_send_wr = 8});
  std::uint64_t v = 1;
  alignas(8) std::uint64_t cell = 0;
  auto mr = p.a.pd->register_memory(&v, 8, access::none);
  auto cmr = p.b.pd->register_memory(&cell, 8, access::local_write | access::remote_write);
  tp::sge sg = mr->slice(0, 8);
  auto write = [&](std::uint64_t id, bool signaled) {
    return tp::work_request{.wr_id = id, .op = tp::opcode::write, .sg_list = {&sg, 1}, .signaled = signaled,
                            .remote_addr = reinterpret_cast<std::uint64_t>(&cell), .rkey = cmr->rkey()};
  };
  std::vector<tp::work_request> wrs;
  for (std::uint64_t i = 0; i < 7; ++i) wrs.push_back(write(i, false));
  wrs.push_back(write(7, true));
  REQUIRE_FALSE(p.a.qp->post_send(wrs));
  auto c = p.drv.wait(p.a.cq.get(), 1);
  REQUIRE(c.size() == 1);
  CHECK(c[0].wr_id == 7);
  CHECK(p.drv.settle(p.a.cq.get(), 20ms).empty());  // no completions for the unsignaled ones
  // all 8 slots were retired: 8 more fit
  REQUIRE_FALSE(p.a.qp->post_send(wrs));
  CHECK(p.drv.wait(p.a.cq.get(), 1).size() == 1);

  SECTION("without a signaled request the send queue stays full") {
    std::vector<tp::work_request> un;
    for (std::uint64_t i = 0; i < 8; ++i) un.push_back(write(20 + i, false));
    REQUIRE_FALSE(p.a.qp->post_send(un));
    p.drv.settle(p.a.cq.get(), 30ms);  // acknowledged by now, yet not retired
    tp::work_request one = write(30, true);
    std::size_t bad = 9;
    CHECK(p.a.qp->post_send({&one, 1}, &bad) == anydoor::errc::queue_full);
    CHECK(bad == 0);
  }
}

// The runtime's marker behind an unsignaled tail (connection_impl::
// queue_tail_marker): a zero-length RDMA WRITE names no memory, so the
// responder checks neither key nor address (IBTA C9-88), and its
// completion retires the unsignaled requests before it.
TEST_CASE("a zero-length write with no key or address succeeds and retires the unsignaled requests before it",
          "[conformance]") {
  connected_pair p({.max_send_wr = 8});
  char msg[16] = "tail";
  std::vector<char> dst(3 * 16);
  auto dmr = p.b.pd->register_memory(dst.data(), dst.size(), access::local_write);
  std::vector<tp::recv_request> recvs;
  std::vector<tp::sge> rsg;
  for (std::size_t i = 0; i < 3; ++i) rsg.push_back(dmr->slice(i * 16, 16));
  for (std::uint64_t i = 0; i < 3; ++i) recvs.push_back({.wr_id = 40 + i, .sg_list = {&rsg[i], 1}});
  REQUIRE_FALSE(p.b.qp->post_recv(recvs));
  const tp::sge isg{reinterpret_cast<std::uint64_t>(msg), sizeof msg, 0};
  for (std::uint64_t i = 0; i < 3; ++i) {  // three doorbells, unsignaled, inline
    tp::work_request w{.wr_id = 30 + i, .op = tp::opcode::send, .sg_list = {&isg, 1}, .signaled = false,
                       .inline_data = true};
    REQUIRE_FALSE(p.a.qp->post_send({&w, 1}));
  }
  CHECK(p.drv.wait(p.b.cq.get(), 3).size() == 3);
  tp::work_request marker{.wr_id = 33, .op = tp::opcode::write, .signaled = true, .remote_addr = 0, .rkey = 0};
  REQUIRE_FALSE(p.a.qp->post_send({&marker, 1}));
  auto c = p.drv.wait_one(p.a.cq.get());
  CHECK(c.wr_id == 33);
  CHECK(c.status == tp::wc_status::success);
  CHECK(c.opcode == tp::wc_opcode::write);
  CHECK(p.drv.settle(p.a.cq.get(), 20ms).empty());  // nothing for the three
  CHECK(p.drv.settle(p.b.cq.get(), 20ms).empty());  // the target sees nothing of it
  // All four slots were retired: a full queue's worth fits again.
  std::vector<tp::work_request> eight(8, marker);
  for (std::uint64_t i = 0; i < 8; ++i) eight[i].wr_id = 50 + i;
  REQUIRE_FALSE(p.a.qp->post_send(eight));
  const auto done = p.drv.wait(p.a.cq.get(), 8);
  CHECK(done.size() == 8);
  for (const tp::completion& x : done) CHECK(x.status == tp::wc_status::success);
  // Both queue pairs carry on: a message still arrives.
  tp::recv_request again{.wr_id = 43, .sg_list = {&rsg[0], 1}};
  REQUIRE_FALSE(p.b.qp->post_recv({&again, 1}));
  tp::work_request w{.wr_id = 34, .op = tp::opcode::send, .sg_list = {&isg, 1}, .inline_data = true};
  REQUIRE_FALSE(p.a.qp->post_send({&w, 1}));
  CHECK(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::success);
  CHECK(p.drv.wait_one(p.a.cq.get()).wr_id == 34);
}

// What the runtime's cover_tail relies on: a request executed unsignaled
// may never complete, even once the queue pair is in error, but a
// signaled one posted after the move to error completes (flushed), after
// whatever of the earlier ones completes at all.
TEST_CASE("after the move to error a signaled request completes flushed behind the unsignaled ones", "[conformance]") {
  connected_pair p({.max_send_wr = 8});
  char msg[16] = "tail";
  std::vector<char> dst(4 * 16);
  auto dmr = p.b.pd->register_memory(dst.data(), dst.size(), access::local_write);
  std::vector<tp::sge> rsg;
  for (std::size_t i = 0; i < 4; ++i) rsg.push_back(dmr->slice(i * 16, 16));
  std::vector<tp::recv_request> recvs;
  for (std::uint64_t i = 0; i < 4; ++i) recvs.push_back({.wr_id = 60 + i, .sg_list = {&rsg[i], 1}});
  REQUIRE_FALSE(p.b.qp->post_recv(recvs));
  const tp::sge isg{reinterpret_cast<std::uint64_t>(msg), sizeof msg, 0};
  for (std::uint64_t i = 0; i < 3; ++i) {
    tp::work_request w{.wr_id = 70 + i, .op = tp::opcode::send, .sg_list = {&isg, 1}, .signaled = false,
                       .inline_data = true};
    REQUIRE_FALSE(p.a.qp->post_send({&w, 1}));
  }
  CHECK(p.drv.wait(p.b.cq.get(), 3).size() == 3);
  p.drv.settle(p.a.cq.get(), 20ms);  // (acknowledged by now)
  REQUIRE_FALSE(p.a.qp->modify(tp::qp_state::error));
  tp::work_request marker{.wr_id = 73, .op = tp::opcode::write, .signaled = true, .remote_addr = 0, .rkey = 0};
  REQUIRE_FALSE(p.a.qp->post_send({&marker, 1}));
  // a's completions (it posted no receives): any of the three, flushed,
  // then the marker's, flushed, last.
  std::vector<tp::completion> got;
  for (int i = 0; i < 5 && (got.empty() || got.back().wr_id != 73); ++i) {
    auto one = p.drv.wait(p.a.cq.get(), 1);
    if (one.empty()) break;
    got.push_back(one[0]);
  }
  REQUIRE_FALSE(got.empty());
  CHECK(got.back().wr_id == 73);
  CHECK(got.back().status == tp::wc_status::work_request_flushed);
  for (std::size_t i = 0; i + 1 < got.size(); ++i) {
    CHECK(got[i].wr_id >= 70);
    CHECK(got[i].wr_id < 73);
    CHECK(got[i].status == tp::wc_status::work_request_flushed);
  }
  CHECK(p.drv.settle(p.a.cq.get(), 20ms).empty());  // nothing after it
}

TEST_CASE("a batch of requests in one post_send rings one doorbell", "[conformance]") {
  connected_pair p;
  std::vector<char> buf(16 * 64, 'b');
  auto mr = p.a.pd->register_memory(buf.data(), buf.size(), access::none);
  std::vector<char> dst(16 * 64);
  auto dmr = p.b.pd->register_memory(dst.data(), dst.size(), access::local_write | access::remote_write);
  std::vector<tp::sge> sg(16);
  std::vector<tp::work_request> wrs;
  for (std::size_t i = 0; i < 16; ++i) {
    sg[i] = mr->slice(i * 64, 64);
    wrs.push_back({.wr_id = i, .op = tp::opcode::write, .sg_list = {&sg[i], 1}, .signaled = i == 15,
                   .remote_addr = reinterpret_cast<std::uint64_t>(dst.data() + i * 64), .rkey = dmr->rkey()});
  }
  const auto before = p.a.qp->counters();
  REQUIRE_FALSE(p.a.qp->post_send(wrs));
  const auto after = p.a.qp->counters();
  CHECK(after.doorbells - before.doorbells == 1);
  CHECK(after.send_wrs - before.send_wrs == 16);
  if (p.a.dev->provider() == "tcp") {
    CHECK(after.tx_syscalls - before.tx_syscalls == 1);  // the whole batch in one sendmsg
  }
  CHECK(p.drv.wait_one(p.a.cq.get()).wr_id == 15);
  CHECK(wait_placed([&] { return dst == buf; }));
}

TEST_CASE("64 queue pairs share one completion queue, demultiplexed by wr_id", "[conformance]") {
  constexpr std::uint32_t kQps = 64;
  endpoint a(1024), b(1024);
  std::vector<std::unique_ptr<tp::queue_pair>> aq, bq;
  for (std::uint32_t i = 0; i < kQps; ++i) {
    aq.push_back(a.pd->create_qp(a.attrs({.max_send_wr = 8, .max_recv_wr = 8})));
    bq.push_back(b.pd->create_qp(b.attrs({.max_send_wr = 8, .max_recv_wr = 8})));
    connect_pair(*b.dev, *bq.back(), *a.dev, *aq.back());
  }
  std::vector<std::uint32_t> src(kQps), dst(kQps, 0);
  auto smr = a.pd->register_memory(src.data(), src.size() * 4, access::none);
  auto dmr = b.pd->register_memory(dst.data(), dst.size() * 4, access::local_write);
  std::map<std::uint32_t, std::uint32_t> qpn_to_index;
  for (std::uint32_t i = 0; i < kQps; ++i) {
    src[i] = i * 1000 + 7;
    qpn_to_index[bq[i]->qp_num()] = i;
    tp::sge rsg = dmr->slice(i * 4, 4);
    tp::recv_request rr{.wr_id = 5000 + i, .sg_list = {&rsg, 1}};
    REQUIRE_FALSE(bq[i]->post_recv({&rr, 1}));
  }
  for (std::uint32_t i = 0; i < kQps; ++i) {
    tp::sge ssg = smr->slice(i * 4, 4);
    tp::work_request wr = send_wr(i, {&ssg, 1});
    REQUIRE_FALSE(aq[i]->post_send({&wr, 1}));
  }
  driver d{a.cq.get(), b.cq.get()};
  auto sc = d.wait(a.cq.get(), kQps);
  auto rc = d.wait(b.cq.get(), kQps);
  REQUIRE(sc.size() == kQps);
  REQUIRE(rc.size() == kQps);
  std::set<std::uint64_t> sent;
  for (auto& c : sc) {
    CHECK(c.status == tp::wc_status::success);
    CHECK(c.qp_num == aq[c.wr_id]->qp_num());
    sent.insert(c.wr_id);
  }
  CHECK(sent.size() == kQps);
  std::set<std::uint32_t> got;
  for (auto& c : rc) {
    REQUIRE(c.status == tp::wc_status::success);
    const std::uint32_t i = qpn_to_index.at(c.qp_num);
    CHECK(c.wr_id == 5000 + i);
    CHECK(dst[i] == i * 1000 + 7);
    got.insert(i);
  }
  CHECK(got.size() == kQps);
}

namespace {
bool readable_within(int fd, int ms) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, ms) == 1;
}

// A connected pair with one 16-byte receive posted at b, and a send ready at a.
struct one_message {
  connected_pair p;
  std::vector<char> src = std::vector<char>(16, 'n'), dst = std::vector<char>(16);
  std::unique_ptr<tp::memory_region> smr = p.a.pd->register_memory(src.data(), src.size(), access::none);
  std::unique_ptr<tp::memory_region> dmr = p.b.pd->register_memory(dst.data(), dst.size(), access::local_write);
  tp::sge rsg = dmr->slice(0, 16), ssg = smr->slice(0, 16);

  explicit one_message(const tp::cq_options& cq_opts_b = {}) : p({}, 4096, 4096, cq_opts_b) {
    tp::recv_request rr{.wr_id = 1, .sg_list = {&rsg, 1}};
    REQUIRE_FALSE(p.b.qp->post_recv({&rr, 1}));
  }
  void send() {
    tp::work_request wr = send_wr(2, {&ssg, 1});
    REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  }
};
}  // namespace

TEST_CASE("notify fd: a completion after arm makes the fd readable", "[conformance]") {
  one_message m;
  auto& p = m.p;

  tp::completion buf[4];
  std::error_code ec;
  REQUIRE(p.b.cq->poll(buf, ec) == 0);
  p.b.cq->ack_events();
  REQUIRE_FALSE(p.b.cq->arm());
  CHECK_FALSE(readable_within(p.b.cq->notify_fd(), 20));  // nothing happened yet

  m.send();
  // The receiver sleeps on its fd; only the sender's side is driven meanwhile.
  REQUIRE(readable_within(p.b.cq->notify_fd(), 5000));
  p.b.cq->ack_events();
  std::size_t n = 0;
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (n == 0 && std::chrono::steady_clock::now() < deadline) {
    n = p.b.cq->poll(buf, ec);
    if (n == 0) {
      REQUIRE_FALSE(p.b.cq->arm());
      n = p.b.cq->poll(buf, ec);  // arm-then-drain
      if (n == 0) readable_within(p.b.cq->notify_fd(), 100);
    }
  }
  REQUIRE(n == 1);
  CHECK(buf[0].wr_id == 1);
  CHECK(buf[0].status == tp::wc_status::success);
}

TEST_CASE("notify fd: a completion arriving between the last poll and arm is not lost", "[conformance]") {
  one_message m;
  auto& p = m.p;
  tp::completion buf[4];
  std::error_code ec;
  REQUIRE(p.b.cq->poll(buf, ec) == 0);  // the reactor drained: empty
  m.send();  // ... the completion arrives now ...
  std::this_thread::sleep_for(20ms);
  REQUIRE_FALSE(p.b.cq->arm());  // ... and the reactor arms only afterwards
  // The arm-then-drain rule: either the drain after arm finds it, or the fd
  // reports it. Never neither (that would be a lost wake-up).
  bool found = p.b.cq->poll(buf, ec) == 1;
  for (int i = 0; !found && i < 50 && readable_within(p.b.cq->notify_fd(), 100); ++i) {
    p.b.cq->ack_events();
    found = p.b.cq->poll(buf, ec) == 1;
  }
  REQUIRE(found);
  CHECK(buf[0].wr_id == 1);
}

TEST_CASE("notify fd: where arm() reports what is queued, a completion made before the arm wakes with no poll after it",
          "[conformance]") {
  // completion_queue::arm_reports_queued (the reactor then skips the drain
  // after arming). The receiving side completes the message while its
  // consumer does not poll (a NIC; tcp: the queue's progress thread), then
  // the consumer arms: the fd must say the completion is there.
  one_message m({.progress_thread = true});
  auto& p = m.p;
  if (!p.b.cq->arm_reports_queued()) {
    WARN("not run on " << provider_under_test() << ": its arm() notifies only what comes after it");
    return;
  }
  std::this_thread::sleep_for(20ms);  // (the receiving owner's polls while connecting are not recent)
  m.send();
  driver d{p.a.cq.get()};  // the sender only: its send completes once the message is in
  const auto sent = d.wait(p.a.cq.get(), 1, 5s);
  REQUIRE(sent.size() == 1);
  REQUIRE(sent[0].status == tp::wc_status::success);
  p.b.cq->ack_events();  // (the queue pair's wake-up when it went live)
  CHECK_FALSE(readable_within(p.b.cq->notify_fd(), 20));  // not armed: nothing said
  REQUIRE_FALSE(p.b.cq->arm());
  CHECK(readable_within(p.b.cq->notify_fd(), 0));
  CHECK(p.b.cq->ack_events() >= 1);
  tp::completion buf[4];
  std::error_code ec;
  REQUIRE(p.b.cq->poll(buf, ec) == 1);
  CHECK(buf[0].wr_id == 1);
  CHECK(buf[0].status == tp::wc_status::success);
  CHECK(m.dst == m.src);
}

TEST_CASE("a burst larger than one progress pass completes on a queue shared by many queue pairs",
          "[conformance]") {
  constexpr std::uint32_t kQps = 8;
  constexpr std::uint32_t kMsgs = 1000;
  endpoint a(4096), b(4096);
  std::vector<std::unique_ptr<tp::queue_pair>> aq, bq;
  for (std::uint32_t i = 0; i < kQps; ++i) {
    aq.push_back(a.pd->create_qp(a.attrs({.max_send_wr = kMsgs, .max_recv_wr = kMsgs})));
    bq.push_back(b.pd->create_qp(b.attrs({.max_send_wr = kMsgs, .max_recv_wr = kMsgs})));
    connect_pair(*b.dev, *bq.back(), *a.dev, *aq.back());
  }
  std::vector<std::uint32_t> src(kMsgs), dst(kMsgs, 0);
  auto smr = a.pd->register_memory(src.data(), src.size() * 4, access::none);
  auto dmr = b.pd->register_memory(dst.data(), dst.size() * 4, access::local_write);
  std::vector<tp::sge> rsg(kMsgs), ssg(kMsgs);
  std::vector<tp::recv_request> rr(kMsgs);
  std::vector<tp::work_request> wrs(kMsgs);
  for (std::uint32_t i = 0; i < kMsgs; ++i) {
    src[i] = i;
    rsg[i] = dmr->slice(i * 4, 4);
    ssg[i] = smr->slice(i * 4, 4);
    rr[i] = {.wr_id = i, .sg_list = {&rsg[i], 1}};
    wrs[i] = send_wr(i, {&ssg[i], 1}, i + 1 == kMsgs);
  }
  REQUIRE_FALSE(bq[3]->post_recv(rr));
  REQUIRE_FALSE(aq[3]->post_send(wrs));
  // Let the whole burst reach the receiver before it polls at all.
  driver sender{a.cq.get()};
  sender.settle(a.cq.get(), 50ms);
  driver receiver{b.cq.get(), a.cq.get()};
  auto rc = receiver.wait(b.cq.get(), kMsgs, 10s);
  REQUIRE(rc.size() == kMsgs);
  for (std::uint32_t i = 0; i < kMsgs; ++i) CHECK(dst[i] == i);
}

TEST_CASE("a target that armed its queue before a write landed acknowledges it, though no completion wakes it",
          "[conformance]") {
  connected_pair p;
  std::vector<char> src(4096, 'w'), dst(4096, 0);
  auto smr = p.a.pd->register_memory(src.data(), src.size(), access::none);
  auto dmr = p.b.pd->register_memory(dst.data(), dst.size(), access::local_write | access::remote_write);
  tp::completion buf[4];
  std::error_code ec;
  REQUIRE(p.b.cq->poll(buf, ec) == 0);
  REQUIRE_FALSE(p.b.cq->arm());  // the target's consumer arms, then drains (arm-then-drain) ...
  const tp::sge sg = smr->slice(0, 4096);
  tp::work_request wr{.wr_id = 7, .op = tp::opcode::write, .sg_list = {&sg, 1},
                      .remote_addr = reinterpret_cast<std::uint64_t>(dst.data()), .rkey = dmr->rkey()};
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  // ... and its draining polls place the write, which yields no completion there.
  const auto deadline = std::chrono::steady_clock::now() + 3s;
  while (dst != src && std::chrono::steady_clock::now() < deadline) {
    CHECK(p.b.cq->poll(buf, ec) == 0);
  }
  REQUIRE(dst == src);
  // The target sleeps now: only the initiator is driven. Its write completes.
  driver tx{p.a.cq.get()};
  auto c = tx.wait(p.a.cq.get(), 1, 3s);
  REQUIRE(c.size() == 1);
  CHECK(c[0].wr_id == 7);
  CHECK(c[0].status == tp::wc_status::success);
}

TEST_CASE("a receiver that arms its queue and sleeps still acknowledges what it received", "[conformance]") {
  one_message m;
  auto& p = m.p;
  m.send();
  // The receiver polls until its receive completes, arms, and from then on
  // only the sender is driven.
  driver rx{p.b.cq.get()};
  CHECK(rx.wait_one(p.b.cq.get()).status == tp::wc_status::success);
  REQUIRE_FALSE(p.b.cq->arm());
  driver tx{p.a.cq.get()};
  auto c = tx.wait(p.a.cq.get(), 1, 3s);
  REQUIRE(c.size() == 1);
  CHECK(c[0].wr_id == 2);
  CHECK(c[0].status == tp::wc_status::success);
}
