// Provider conformance: protection, length and RNR errors, the state machine,
// completion-queue overflow and peer death.
//
// Differences between providers, each checked only where it applies:
// - RNR NAK and retransmission counts: the tcp provider counts them per queue
//   pair; verbs exposes no per-QP RNR counters, so verbs skips those checks.
// - A queue pair moved to error by its owner: the tcp provider closes the
//   connection, so the peer's queue pair fails at once; on RDMA hardware the
//   peer notices only when it next sends (transport retries run out:
//   retry_exceeded), so the at-once check is tcp-only.
// - Peer death: the tcp provider sees the connection close and fails the
//   oldest request with retry_exceeded; the verbs provider acts on rdma_cm's
//   DISCONNECTED event and flushes everything. (rxe on Linux 6.1 never times
//   out a request that is in infinite RNR retry towards a destroyed queue
//   pair, so without the event it would hang.)
// - rxe (Linux 6.1) reports a receive buffer that is too small, and a
//   receive whose local key lacks local_write, as local_qp_operation_error
//   at the receiver and remote_operation_error at the sender; the IB spec
//   (and mlx5) say local_length_error / remote_invalid_request and
//   local_protection_error / remote_operation_error. Both are accepted on
//   verbs; the invariants (both ends fail, no byte lands) hold everywhere.
#include "../support/harness.hpp"

#include <csignal>
#include <cstring>
#include <set>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

using namespace anydoor::test;
using tp::access;

namespace {

// A target buffer with canaries on both sides of the registered window.
struct guarded {
  static constexpr std::size_t kGuard = 64;
  std::vector<std::uint8_t> mem;
  explicit guarded(std::size_t n) : mem(n + 2 * kGuard, 0xa5) {}
  std::uint8_t* data() { return mem.data() + kGuard; }
  std::size_t size() const { return mem.size() - 2 * kGuard; }
  bool untouched() const {
    return std::all_of(mem.begin(), mem.end(), [](std::uint8_t b) { return b == 0xa5; });
  }
};

void expect_remote_access_error(connected_pair& p, const tp::work_request& wr, guarded& target,
                                tp::wc_status status = tp::wc_status::remote_access_error) {
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  auto c = p.drv.wait_one(p.a.cq.get());
  CHECK(c.status == status);
  CHECK(c.wr_id == wr.wr_id);
  CHECK(p.a.qp->state() == tp::qp_state::error);
  p.drv.settle(p.b.cq.get(), 20ms);
  CHECK(p.b.qp->state() == tp::qp_state::error);
  CHECK(target.untouched());
}

}  // namespace

TEST_CASE("remote access is checked against the target's registrations", "[conformance]") {
  connected_pair p;
  guarded target(256);
  std::vector<std::uint8_t> local(512, 0x11);
  auto lmr = p.a.pd->register_memory(local.data(), local.size(), access::local_write);
  const auto taddr = reinterpret_cast<std::uint64_t>(target.data());

  SECTION("unknown rkey") {
    auto tmr = p.b.pd->register_memory(target.data(), target.size(), access::local_write | access::remote_write);
    tp::sge sg = lmr->slice(0, 16);
    tp::work_request wr{.wr_id = 1, .op = tp::opcode::write, .sg_list = {&sg, 1}, .remote_addr = taddr,
                        .rkey = tmr->rkey() ^ 0x5a5a00u};
    expect_remote_access_error(p, wr, target);
  }
  SECTION("deregistered rkey") {
    auto tmr = p.b.pd->register_memory(target.data(), target.size(), access::local_write | access::remote_write);
    const std::uint32_t rkey = tmr->rkey();
    tmr.reset();
    tp::sge sg = lmr->slice(0, 16);
    tp::work_request wr{.wr_id = 2, .op = tp::opcode::write, .sg_list = {&sg, 1}, .remote_addr = taddr, .rkey = rkey};
    expect_remote_access_error(p, wr, target);
  }
  SECTION("write out of bounds by one byte") {
    auto tmr = p.b.pd->register_memory(target.data(), target.size(), access::local_write | access::remote_write);
    tp::sge sg = lmr->slice(0, 16);
    tp::work_request wr{.wr_id = 3, .op = tp::opcode::write, .sg_list = {&sg, 1},
                        .remote_addr = taddr + target.size() - 15, .rkey = tmr->rkey()};
    expect_remote_access_error(p, wr, target);
  }
  SECTION("read out of bounds by one byte") {
    auto tmr = p.b.pd->register_memory(target.data(), target.size(), access::remote_read);
    tp::sge sg = lmr->slice(0, 257);
    tp::work_request wr{.wr_id = 4, .op = tp::opcode::read, .sg_list = {&sg, 1}, .remote_addr = taddr,
                        .rkey = tmr->rkey()};
    expect_remote_access_error(p, wr, target);
    CHECK(std::all_of(local.begin(), local.end(), [](auto b) { return b == 0x11; }));
  }
  SECTION("write into a read-only region") {
    auto tmr = p.b.pd->register_memory(target.data(), target.size(), access::remote_read);
    tp::sge sg = lmr->slice(0, 16);
    tp::work_request wr{.wr_id = 5, .op = tp::opcode::write, .sg_list = {&sg, 1}, .remote_addr = taddr,
                        .rkey = tmr->rkey()};
    expect_remote_access_error(p, wr, target);
  }
  SECTION("read from a region without remote_read") {
    auto tmr = p.b.pd->register_memory(target.data(), target.size(), access::local_write | access::remote_write);
    tp::sge sg = lmr->slice(0, 16);
    tp::work_request wr{.wr_id = 6, .op = tp::opcode::read, .sg_list = {&sg, 1}, .remote_addr = taddr,
                        .rkey = tmr->rkey()};
    expect_remote_access_error(p, wr, target);
  }
  SECTION("atomic on a region without remote_atomic") {
    auto tmr = p.b.pd->register_memory(target.data(), target.size(), access::local_write | access::remote_write);
    tp::sge sg = lmr->slice(0, 8);
    tp::work_request wr{.wr_id = 7, .op = tp::opcode::fetch_add, .sg_list = {&sg, 1}, .remote_addr = taddr,
                        .rkey = tmr->rkey(), .compare_add = 1};
    expect_remote_access_error(p, wr, target);
  }
  SECTION("write_with_imm out of bounds consumes no receive data") {
    auto tmr = p.b.pd->register_memory(target.data(), target.size(), access::local_write | access::remote_write);
    tp::recv_request rr{.wr_id = 70};
    REQUIRE_FALSE(p.b.qp->post_recv({&rr, 1}));
    tp::sge sg = lmr->slice(0, 16);
    tp::work_request wr{.wr_id = 8, .op = tp::opcode::write_with_imm, .sg_list = {&sg, 1}, .imm = 1,
                        .remote_addr = taddr + 250, .rkey = tmr->rkey()};
    expect_remote_access_error(p, wr, target);
  }
}

TEST_CASE("a deregistered region can no longer be written remotely", "[conformance]") {
  connected_pair p;
  guarded target(64);
  std::uint64_t v = 0x77;
  auto lmr = p.a.pd->register_memory(&v, 8, access::none);
  auto tmr = p.b.pd->register_memory(target.data(), target.size(), access::local_write | access::remote_write);
  tp::sge sg = lmr->slice(0, 8);
  tp::work_request wr{.wr_id = 1, .op = tp::opcode::write, .sg_list = {&sg, 1},
                      .remote_addr = reinterpret_cast<std::uint64_t>(target.data()), .rkey = tmr->rkey()};
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
  CHECK(target.data()[0] == 0x77);
  std::memset(target.data(), 0xa5, 8);
  tmr.reset();
  wr.wr_id = 2;
  expect_remote_access_error(p, wr, target);
}

TEST_CASE("a local key that does not cover the buffer is a local protection error", "[conformance]") {
  connected_pair p;
  std::vector<char> buf(64);
  auto mr = p.a.pd->register_memory(buf.data(), 32, access::none);
  tp::sge sg{reinterpret_cast<std::uint64_t>(buf.data()), 64, mr->lkey()};
  tp::work_request wr = send_wr(12, {&sg, 1});
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  auto c = p.drv.wait_one(p.a.cq.get());
  CHECK(c.status == tp::wc_status::local_protection_error);
  CHECK(c.wr_id == 12);
  CHECK(p.a.qp->state() == tp::qp_state::error);
}

TEST_CASE("a message larger than the receive buffer is a local length error, not an overflow", "[conformance]") {
  connected_pair p;
  std::vector<char> src(100, 's');
  guarded dst(64);
  auto smr = p.a.pd->register_memory(src.data(), src.size(), access::none);
  auto dmr = p.b.pd->register_memory(dst.data(), dst.size(), access::local_write);
  tp::sge rsg = dmr->slice(0, 64);
  tp::recv_request rr{.wr_id = 50, .sg_list = {&rsg, 1}};
  REQUIRE_FALSE(p.b.qp->post_recv({&rr, 1}));
  tp::sge ssg = smr->slice(0, 100);
  tp::work_request wr = send_wr(51, {&ssg, 1});
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  auto rc = p.drv.wait_one(p.b.cq.get());
  CHECK(rc.wr_id == 50);
  auto sc = p.drv.wait_one(p.a.cq.get());
  CHECK(sc.wr_id == 51);
  if (testing_tcp()) {
    CHECK(rc.status == tp::wc_status::local_length_error);
    CHECK(sc.status == tp::wc_status::remote_invalid_request);
  } else {  // see the top of this file (rxe)
    CHECK((rc.status == tp::wc_status::local_length_error || rc.status == tp::wc_status::local_qp_operation_error));
    CHECK((sc.status == tp::wc_status::remote_invalid_request || sc.status == tp::wc_status::remote_operation_error));
  }
  CHECK(dst.untouched());
  CHECK(p.b.qp->state() == tp::qp_state::error);
  CHECK(p.a.qp->state() == tp::qp_state::error);
}

TEST_CASE("RNR: a send with no posted receive is retried", "[conformance]") {
  std::vector<char> src(32, 'r'), dst(32);

  SECTION("rnr_retry 7 retries until a receive is posted") {
    connected_pair p({.rnr_retry = 7, .min_rnr_timer_us = 1000});
    auto smr = p.a.pd->register_memory(src.data(), src.size(), access::none);
    auto dmr = p.b.pd->register_memory(dst.data(), dst.size(), access::local_write);
    tp::sge ssg = smr->slice(0, 32);
    tp::work_request wr = send_wr(60, {&ssg, 1});
    // The devices' own counters see the NAKs (verbs: the NIC's port counters,
    // shared by both ends in one machine; tcp: each device its own side).
    const tp::device_counters a0 = p.a.dev->counters(), b0 = p.b.dev->counters();
    const bool a_counts = device_keeps(*p.a.dev, a0.rnr_naks_received, "rnr_naks_received");
    const bool b_counts = device_keeps(*p.b.dev, b0.rnr_naks_sent, "rnr_naks_sent");
    REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
    CHECK(p.drv.settle(p.a.cq.get(), 100ms).empty());
    if (testing_tcp()) CHECK(p.a.qp->counters().rnr_naks_received >= 2);  // verbs: no per-QP RNR counter
    if (a_counts) CHECK(*p.a.dev->counters().rnr_naks_received - *a0.rnr_naks_received >= 2);
    if (b_counts) CHECK(*p.b.dev->counters().rnr_naks_sent - *b0.rnr_naks_sent >= 2);
    CHECK(p.a.qp->state() == tp::qp_state::rts);
    tp::sge rsg = dmr->slice(0, 32);
    tp::recv_request rr{.wr_id = 61, .sg_list = {&rsg, 1}};
    REQUIRE_FALSE(p.b.qp->post_recv({&rr, 1}));
    CHECK(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
    CHECK(p.drv.wait_one(p.b.cq.get()).byte_len == 32);
    CHECK(dst == src);
  }
  SECTION("rnr_retry 2 gives up with RNR retry exceeded after min_rnr_timer_us each") {
    connected_pair p({.rnr_retry = 2, .min_rnr_timer_us = 20000});
    auto smr = p.a.pd->register_memory(src.data(), src.size(), access::none);
    tp::sge ssg = smr->slice(0, 32);
    tp::work_request wrs[] = {send_wr(62, {&ssg, 1}), send_wr(63, {&ssg, 1}, false)};
    const tp::device_counters a0 = p.a.dev->counters();
    const bool a_counts = device_keeps(*p.a.dev, a0.rnr_retry_exceeded, "rnr_retry_exceeded");
    const auto t0 = std::chrono::steady_clock::now();
    REQUIRE_FALSE(p.a.qp->post_send(wrs));
    auto c = p.drv.wait(p.a.cq.get(), 2);
    CHECK(std::chrono::steady_clock::now() - t0 >= 40ms);  // two waits of min_rnr_timer_us
    REQUIRE(c.size() == 2);
    CHECK(c[0].wr_id == 62);
    CHECK(c[0].status == tp::wc_status::rnr_retry_exceeded);
    CHECK(c[1].wr_id == 63);
    CHECK(c[1].status == tp::wc_status::work_request_flushed);
    if (testing_tcp()) CHECK(p.a.qp->counters().rnr_naks_received == 3);  // verbs: no per-QP RNR counter
    if (a_counts) CHECK(*p.a.dev->counters().rnr_retry_exceeded - *a0.rnr_retry_exceeded == 1);
    CHECK(p.a.qp->state() == tp::qp_state::error);
  }
  SECTION("requests behind an RNR-NAKed send stay in order") {
    connected_pair p({.rnr_retry = 7, .min_rnr_timer_us = 200});
    alignas(8) std::uint64_t cell = 0;
    std::uint64_t one = 1;
    auto smr = p.a.pd->register_memory(src.data(), src.size(), access::none);
    auto omr = p.a.pd->register_memory(&one, 8, access::none);
    auto dmr = p.b.pd->register_memory(dst.data(), dst.size(), access::local_write);
    auto cmr = p.b.pd->register_memory(&cell, 8, access::local_write | access::remote_write);
    tp::sge ssg = smr->slice(0, 32), osg = omr->slice(0, 8);
    tp::work_request wrs[] = {send_wr(64, {&ssg, 1}),
                              {.wr_id = 65, .op = tp::opcode::write, .sg_list = {&osg, 1},
                               .remote_addr = reinterpret_cast<std::uint64_t>(&cell), .rkey = cmr->rkey()}};
    REQUIRE_FALSE(p.a.qp->post_send(wrs));
    p.drv.settle(p.a.cq.get(), 30ms);
    CHECK(cell == 0);  // the write waits behind the send
    tp::sge rsg = dmr->slice(0, 32);
    tp::recv_request rr{.wr_id = 66, .sg_list = {&rsg, 1}};
    REQUIRE_FALSE(p.b.qp->post_recv({&rr, 1}));
    auto c = p.drv.wait(p.a.cq.get(), 2);
    REQUIRE(c.size() == 2);
    CHECK(c[0].wr_id == 64);
    CHECK(c[1].wr_id == 65);
    CHECK(cell == 1);
    if (testing_tcp()) CHECK(p.a.qp->counters().retransmits >= 1);  // verbs: no retransmission counter
  }
}

TEST_CASE("the queue pair state machine", "[conformance]") {
  endpoint e;
  auto qp = e.pd->create_qp(e.attrs());
  std::uint64_t v = 0;
  auto mr = e.pd->register_memory(&v, 8, access::local_write);
  tp::sge sg = mr->slice(0, 8);
  tp::work_request wr = send_wr(1, {&sg, 1});
  tp::recv_request rr{.wr_id = 2, .sg_list = {&sg, 1}};

  CHECK(qp->state() == tp::qp_state::reset);
  CHECK(qp->post_send({&wr, 1}) == anydoor::errc::invalid_state);
  CHECK(qp->post_recv({&rr, 1}) == anydoor::errc::invalid_state);
  CHECK(qp->modify(tp::qp_state::rts) == anydoor::errc::invalid_state);
  CHECK(qp->modify(tp::qp_state::rtr) == anydoor::errc::invalid_state);
  REQUIRE_FALSE(qp->modify(tp::qp_state::init));
  CHECK(qp->state() == tp::qp_state::init);
  CHECK(qp->modify(tp::qp_state::init) == anydoor::errc::invalid_state);
  CHECK(qp->modify(tp::qp_state::rts) == anydoor::errc::invalid_state);
  CHECK(qp->modify(tp::qp_state::rtr) == anydoor::errc::not_connected);
  CHECK(qp->post_send({&wr, 1}) == anydoor::errc::invalid_state);
  CHECK_FALSE(qp->post_recv({&rr, 1}));  // receives may be posted from init on
  REQUIRE_FALSE(qp->modify(tp::qp_state::error));
  CHECK(qp->state() == tp::qp_state::error);
  driver d{e.cq.get()};
  auto c = d.wait_one(e.cq.get());
  CHECK(c.wr_id == 2);
  CHECK(c.status == tp::wc_status::work_request_flushed);
  CHECK(qp->modify(tp::qp_state::rtr) == anydoor::errc::invalid_state);
  REQUIRE_FALSE(qp->modify(tp::qp_state::reset));
  CHECK(qp->state() == tp::qp_state::reset);
  CHECK(d.settle(e.cq.get(), 10ms).empty());
}

TEST_CASE("entering error flushes every outstanding request exactly once", "[conformance]") {
  connected_pair p({.max_send_wr = 16, .max_recv_wr = 16, .rnr_retry = 7, .min_rnr_timer_us = 1000});
  std::vector<char> buf(64);
  auto mr = p.a.pd->register_memory(buf.data(), buf.size(), access::local_write);
  tp::sge sg = mr->slice(0, 8);
  // The peer posts no receives: the sends stay outstanding (RNR forever).
  std::vector<tp::work_request> sends;
  for (std::uint64_t i = 0; i < 10; ++i) sends.push_back(send_wr(100 + i, {&sg, 1}, i % 3 == 0));
  REQUIRE_FALSE(p.a.qp->post_send(sends));
  std::vector<tp::recv_request> recvs;
  for (std::uint64_t i = 0; i < 5; ++i) recvs.push_back({.wr_id = 200 + i, .sg_list = {&sg, 1}});
  REQUIRE_FALSE(p.a.qp->post_recv(recvs));
  p.drv.settle(p.a.cq.get(), 20ms);
  REQUIRE_FALSE(p.a.qp->modify(tp::qp_state::error));
  auto c = p.drv.wait(p.a.cq.get(), 15);
  REQUIRE(c.size() == 15);
  std::set<std::uint64_t> ids;
  for (auto& x : c) {
    CHECK(x.status == tp::wc_status::work_request_flushed);
    ids.insert(x.wr_id);
  }
  CHECK(ids.size() == 15);
  CHECK(p.drv.settle(p.a.cq.get(), 20ms).empty());  // nothing completes twice
  // posting to a queue pair in error flushes at once
  tp::work_request late = send_wr(300, {&sg, 1}, false);
  REQUIRE_FALSE(p.a.qp->post_send({&late, 1}));
  auto lc = p.drv.wait_one(p.a.cq.get());
  CHECK(lc.wr_id == 300);
  CHECK(lc.status == tp::wc_status::work_request_flushed);
  // a receive too, at once after the move to error and later (the runtime
  // counts on every posted receive coming back before it releases a connection)
  tp::recv_request late_recv{.wr_id = 301, .sg_list = {&sg, 1}};
  REQUIRE_FALSE(p.a.qp->post_recv({&late_recv, 1}));
  auto lr = p.drv.wait_one(p.a.cq.get());
  CHECK(lr.wr_id == 301);
  CHECK(lr.status == tp::wc_status::work_request_flushed);
  CHECK(p.drv.settle(p.a.cq.get(), 20ms).empty());
  // tcp: the peer sees its side fail too, with no hang (verbs: only when it next sends)
  if (testing_tcp()) {
    p.drv.settle(p.b.cq.get(), 50ms);
    CHECK(p.b.qp->state() == tp::qp_state::error);
  }
}

TEST_CASE("a request towards a peer whose queue pair went to error fails in bounded time and never hangs",
          "[conformance]") {
  // The peer's queue pair goes to error with no disconnect (its owner moved
  // it; no rdma_cm event reaches us). The tcp provider closes the stream,
  // so ours is in error already and the request is flushed; an RDMA NIC
  // gets no answer and must give up after its transport retries
  // (retry_exceeded). rxe reads the provider's retry count of 7 as "for
  // ever" (transport/verbs/verbs_util.hpp says why it stays 7): there the
  // write never ends, so the case does not apply.
  connected_pair p;
  if (p.a.dev->name().starts_with("rxe")) {
    WARN("not run on " << p.a.dev->name() << ": rxe retries for ever with a retry count of 7 (verbs_util.hpp)");
    return;
  }
  std::vector<char> src(64, 's'), dst(64);
  auto smr = p.a.pd->register_memory(src.data(), src.size(), access::local_write);
  auto dmr = p.b.pd->register_memory(dst.data(), dst.size(), access::local_write | access::remote_write);
  tp::sge sg = smr->slice(0, 16);
  tp::work_request ok{.wr_id = 1, .op = tp::opcode::write, .sg_list = {&sg, 1},
                      .remote_addr = reinterpret_cast<std::uint64_t>(dst.data()), .rkey = dmr->rkey()};
  REQUIRE_FALSE(p.a.qp->post_send({&ok, 1}));
  REQUIRE(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);  // (the path works)
  REQUIRE_FALSE(p.b.qp->modify(tp::qp_state::error));
  p.drv.settle(p.a.cq.get(), 20ms);
  tp::work_request late = ok;
  late.wr_id = 2;
  late.remote_addr += 32;  // (must not land: dst[16..] stays zero)
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE_FALSE(p.a.qp->post_send({&late, 1}));
  const tp::completion c = p.drv.wait_one(p.a.cq.get(), 20s);
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  INFO("status " << tp::to_string(c.status) << " after " << took.count() << " ms on " << p.a.dev->name());
  CHECK(c.wr_id == 2);
  CHECK(c.status != tp::wc_status::success);
  if (!testing_tcp()) CHECK(took < 10s);  // 7 tries 67 ms apart; an emulated CPU stretches them
  if (!testing_tcp()) CHECK(c.status == tp::wc_status::retry_exceeded);
  CHECK(p.a.qp->state() == tp::qp_state::error);
  CHECK(std::all_of(dst.begin() + 16, dst.end(), [](char b) { return b == 0; }));
}

TEST_CASE("receives posted right after the move to error complete flushed with those before", "[conformance]") {
  // The runtime posts what it re-queued in the same pass as a close: nothing
  // may stay outstanding for good, or the connection is never released.
  connected_pair p({.max_send_wr = 16, .max_recv_wr = 16});
  std::vector<char> buf(64);
  auto mr = p.a.pd->register_memory(buf.data(), buf.size(), access::local_write);
  tp::sge sg = mr->slice(0, 8);
  std::vector<tp::recv_request> recvs;
  for (std::uint64_t i = 0; i < 4; ++i) recvs.push_back({.wr_id = 400 + i, .sg_list = {&sg, 1}});
  REQUIRE_FALSE(p.a.qp->post_recv(recvs));
  REQUIRE_FALSE(p.a.qp->modify(tp::qp_state::error));
  std::vector<tp::recv_request> late;
  for (std::uint64_t i = 0; i < 3; ++i) late.push_back({.wr_id = 500 + i, .sg_list = {&sg, 1}});
  REQUIRE_FALSE(p.a.qp->post_recv(late));  // before anything was polled
  auto c = p.drv.wait(p.a.cq.get(), 7);
  REQUIRE(c.size() == 7);
  std::vector<std::uint64_t> ids;  // in the order posted: a receive queue completes in order
  for (auto& x : c) {
    CHECK(x.status == tp::wc_status::work_request_flushed);
    CHECK(x.opcode == tp::wc_opcode::recv);
    ids.push_back(x.wr_id);
  }
  CHECK(ids == std::vector<std::uint64_t>{400, 401, 402, 403, 500, 501, 502});
  CHECK(p.drv.settle(p.a.cq.get(), 20ms).empty());
}

TEST_CASE("completion queue overflow is reported, never silent", "[conformance]") {
  overflow_pair p;  // the receiver's CQ holds 4
  std::error_code ec = p.overflow();
  CHECK(ec == anydoor::errc::cq_overflow);
  CHECK(p.b.cq->arm() == anydoor::errc::cq_overflow);
  tp::completion more[8];
  CHECK(p.b.cq->poll(more, ec) == 0);
  CHECK(ec == anydoor::errc::cq_overflow);
  CHECK(p.b.qp->state() == tp::qp_state::error);
}

TEST_CASE("a queue's overflow read by another device's thread wakes the queue's own consumer", "[conformance]") {
  // verbs: every device of the process on one RDMA device shares its
  // asynchronous events; whichever reads IBV_EVENT_CQ_ERR, the overflowed
  // queue's notify fd must wake its consumer, whose own poll then reports
  // the overflow (the queue's state is touched by its own thread only).
  overflow_pair p;  // the receiver's CQ holds 4
  if (testing_tcp()) {
    WARN("tcp: a completion queue's overflow is its own; no events are shared between devices");
    return;
  }
  // b is quiet first: nothing read and not processed, nothing to wake it
  // (its idle polls look at connection events; the devices' counters read
  // whatever asynchronous events of the setup are left).
  std::error_code ec;
  tp::completion none[4];
  for (const auto until_quiet = std::chrono::steady_clock::now() + 20ms; std::chrono::steady_clock::now() < until_quiet;) {
    (void)p.b.cq->poll(none, ec);
  }
  REQUIRE_FALSE(ec);
  (void)p.a.dev->counters();
  (void)p.b.dev->counters();
  p.b.cq->ack_events();
  pollfd pf{p.b.cq->notify_fd(), POLLIN, 0};
  REQUIRE(::poll(&pf, 1, 0) == 0);
  const std::uint64_t before = p.a.dev->counters().async_events.value_or(0);
  tp::sge ssg = p.smr->slice(0, 8);
  std::vector<tp::work_request> wrs;
  for (std::uint64_t i = 0; i < 8; ++i) wrs.push_back(send_wr(i, {&ssg, 1}));
  REQUIRE_FALSE(p.a.qp->post_send(wrs));
  // a's device reads the events (its counters drain them), b's poll is not called.
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (p.a.dev->counters().async_events.value_or(0) == before && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(5ms);
  }
  REQUIRE(p.a.dev->counters().async_events.value_or(0) > before);
  // (and whatever follows it: the queue pair's own error event)
  for (int i = 0; i < 20; ++i) {
    (void)p.a.dev->counters();
    std::this_thread::sleep_for(5ms);
  }
  pf.revents = 0;
  CHECK(::poll(&pf, 1, 1000) == 1);  // b's consumer is woken
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (!ec && std::chrono::steady_clock::now() < until) (void)p.b.cq->poll(none, ec);
  CHECK(ec == anydoor::errc::cq_overflow);
  CHECK(p.b.cq->arm() == anydoor::errc::cq_overflow);
}

TEST_CASE("peer death completes outstanding requests with an error", "[conformance]") {
  std::vector<char> buf(64, 'd');

  SECTION("the peer's queue pair is destroyed") {
    connected_pair p({.rnr_retry = 7, .min_rnr_timer_us = 1000});
    auto mr = p.a.pd->register_memory(buf.data(), buf.size(), access::local_write);
    tp::sge sg = mr->slice(0, 8);
    tp::work_request wrs[] = {send_wr(1, {&sg, 1}), send_wr(2, {&sg, 1})};
    tp::recv_request rr{.wr_id = 3, .sg_list = {&sg, 1}};
    REQUIRE_FALSE(p.a.qp->post_recv({&rr, 1}));
    REQUIRE_FALSE(p.a.qp->post_send(wrs));
    p.drv.settle(p.a.cq.get(), 10ms);
    p.b.qp.reset();
    auto c = p.drv.wait(p.a.cq.get(), 3, 10s);
    REQUIRE(c.size() == 3);
    for (auto& x : c) CHECK(x.status != tp::wc_status::success);
    CHECK(p.a.qp->state() == tp::qp_state::error);
  }
  SECTION("the peer process is killed") {
    int port_pipe[2];
    REQUIRE(::pipe(port_pipe) == 0);
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      // The peer: its own device, accepts one connection, then never polls again.
      auto dev = open_test_device();
      auto lis = dev->listen(test_host(), 0);
      const std::uint16_t port = lis->port();
      if (::write(port_pipe[1], &port, sizeof port) != sizeof port) ::_exit(1);
      std::error_code ec;
      auto req = lis->get_request(10s, ec);
      auto pd = dev->alloc_pd();
      auto cq = dev->create_cq(64);
      auto qp = pd->create_qp({.send_cq = cq.get(), .recv_cq = cq.get()});
      if (!req || req->accept(*qp, {})) ::_exit(1);
      ::pause();
      ::_exit(0);
    }
    std::uint16_t port = 0;
    REQUIRE(::read(port_pipe[0], &port, sizeof port) == sizeof port);
    endpoint a;
    a.qp = a.pd->create_qp(a.attrs({.rnr_retry = 7}));
    auto r = a.dev->connect(*a.qp, test_host(), port, {}, 10s);
    REQUIRE_FALSE(r.ec);
    auto mr = a.pd->register_memory(buf.data(), buf.size(), access::local_write);
    tp::sge sg = mr->slice(0, 8);
    tp::work_request wrs[] = {send_wr(1, {&sg, 1}), send_wr(2, {&sg, 1}, false), send_wr(3, {&sg, 1})};
    REQUIRE_FALSE(a.qp->post_send(wrs));
    driver d{a.cq.get()};
    CHECK(d.settle(a.cq.get(), 20ms).empty());
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    auto c = d.wait(a.cq.get(), 3, 10s);
    REQUIRE(c.size() == 3);
    // tcp: the oldest request fails as a NIC's transport timeout would;
    // verbs: rdma_cm's DISCONNECTED event moves the queue pair to error, so
    // everything is flushed
    CHECK(c[0].status == (testing_tcp() ? tp::wc_status::retry_exceeded : tp::wc_status::work_request_flushed));
    CHECK(c[1].status == tp::wc_status::work_request_flushed);
    CHECK(c[2].status == tp::wc_status::work_request_flushed);
    CHECK(a.qp->state() == tp::qp_state::error);
  }
}

TEST_CASE("a receive with a bad local key fails at both ends", "[conformance]") {
  connected_pair p;
  std::vector<char> src(16, 'k'), dst(16);
  auto smr = p.a.pd->register_memory(src.data(), src.size(), access::none);
  auto dmr = p.b.pd->register_memory(dst.data(), dst.size(), access::none);  // no local_write
  tp::sge rsg = dmr->slice(0, 16), ssg = smr->slice(0, 16);
  tp::recv_request rr{.wr_id = 1, .sg_list = {&rsg, 1}};
  REQUIRE_FALSE(p.b.qp->post_recv({&rr, 1}));
  tp::work_request wr = send_wr(2, {&ssg, 1});
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  auto rc = p.drv.wait_one(p.b.cq.get());
  CHECK(rc.wr_id == 1);
  if (testing_tcp()) {
    CHECK(rc.status == tp::wc_status::local_protection_error);
  } else {  // see the top of this file (rxe)
    CHECK((rc.status == tp::wc_status::local_protection_error || rc.status == tp::wc_status::local_qp_operation_error));
  }
  auto sc = p.drv.wait_one(p.a.cq.get());
  CHECK(sc.wr_id == 2);
  CHECK(sc.status == tp::wc_status::remote_operation_error);
  CHECK(std::all_of(dst.begin(), dst.end(), [](char x) { return x == 0; }));
}

TEST_CASE("a queue pair executes only the remote operations its remote_access admits, and set_remote_access "
          "changes them",
          "[conformance]") {
  guarded target(64);
  alignas(8) std::uint64_t word = 0;
  std::vector<std::uint8_t> local(64, 0x42);
  const auto taddr = reinterpret_cast<std::uint64_t>(target.data());
  const auto waddr = reinterpret_cast<std::uint64_t>(&word);
  // The target queue pair (b) admits nothing remote at first; its regions
  // grant everything, so only the queue pair's rights can refuse.
  tp::qp_attributes shut;
  shut.remote_access = access::none;
  const auto all = access::remote_write | access::remote_read | access::remote_atomic;

  SECTION("refused: write, read, atomic (remote_invalid_request; each fails the connection)") {
    for (int op = 0; op < 3; ++op) {
      connected_pair p(shut);
      CHECK(p.b.qp->attributes().remote_access == access::none);
      auto lmr = p.a.pd->register_memory(local.data(), local.size(), access::local_write);
      auto tmr = p.b.pd->register_memory(target.data(), target.size(), access::local_write | all);
      auto wmr = p.b.pd->register_memory(&word, 8, access::local_write | all);
      tp::sge sg = lmr->slice(0, op == 2 ? 8 : 16);
      tp::work_request wr{.wr_id = 10u + static_cast<unsigned>(op), .sg_list = {&sg, 1}};
      if (op == 0) wr = {.wr_id = 10, .op = tp::opcode::write, .sg_list = {&sg, 1}, .remote_addr = taddr,
                         .rkey = tmr->rkey()};
      if (op == 1) wr = {.wr_id = 11, .op = tp::opcode::read, .sg_list = {&sg, 1}, .remote_addr = taddr,
                         .rkey = tmr->rkey()};
      if (op == 2) wr = {.wr_id = 12, .op = tp::opcode::fetch_add, .sg_list = {&sg, 1}, .remote_addr = waddr,
                         .rkey = wmr->rkey(), .compare_add = 5};
      INFO("operation " << op);
      expect_remote_access_error(p, wr, target, tp::wc_status::remote_invalid_request);
      CHECK(word == 0);
      if (op == 1) CHECK(std::all_of(local.begin(), local.end(), [](auto b) { return b == 0x42; }));
    }
  }
  SECTION("opened on a connected queue pair: the same operations succeed; narrowed again: refused") {
    connected_pair p(shut);
    auto lmr = p.a.pd->register_memory(local.data(), local.size(), access::local_write);
    auto tmr = p.b.pd->register_memory(target.data(), target.size(), access::local_write | all);
    auto wmr = p.b.pd->register_memory(&word, 8, access::local_write | all);
    REQUIRE_FALSE(p.b.qp->set_remote_access(all));
    CHECK(p.b.qp->attributes().remote_access == all);
    tp::sge sg = lmr->slice(0, 16);
    tp::work_request w{.wr_id = 1, .op = tp::opcode::write, .sg_list = {&sg, 1}, .remote_addr = taddr,
                       .rkey = tmr->rkey()};
    REQUIRE_FALSE(p.a.qp->post_send({&w, 1}));
    CHECK(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
    CHECK(target.data()[0] == 0x42);
    tp::sge sg8 = lmr->slice(16, 8);
    tp::work_request f{.wr_id = 2, .op = tp::opcode::fetch_add, .sg_list = {&sg8, 1}, .remote_addr = waddr,
                       .rkey = wmr->rkey(), .compare_add = 5};
    REQUIRE_FALSE(p.a.qp->post_send({&f, 1}));
    CHECK(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
    CHECK(word == 5);
    // Reads only: a write is refused again.
    REQUIRE_FALSE(p.b.qp->set_remote_access(access::remote_read | access::local_write));
    CHECK(p.b.qp->attributes().remote_access == access::remote_read);  // only remote_* bits count
    tp::work_request r{.wr_id = 3, .op = tp::opcode::read, .sg_list = {&sg, 1}, .remote_addr = taddr,
                       .rkey = tmr->rkey()};
    REQUIRE_FALSE(p.a.qp->post_send({&r, 1}));
    CHECK(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
    std::memset(target.data(), 0xa5, 16);
    w.wr_id = 4;
    expect_remote_access_error(p, w, target, tp::wc_status::remote_invalid_request);
    CHECK(p.b.qp->set_remote_access(all) == anydoor::errc::invalid_state);  // in error
  }
}
