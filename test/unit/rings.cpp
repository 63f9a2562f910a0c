// Ring indexing without a division (ring_slot) and the rings that use it:
// queues of any size wrap in order; the tcp provider's completion ring has
// exactly its depth of slots (wrapped indices, not rounded up), overflows
// at that depth and hands out a run across its end in order.
#include "../support/harness.hpp"
#include "ring_slot.hpp"

#include <catch2/catch.hpp>

#include <cstring>
#include <limits>
#include <thread>
#include <vector>

using namespace anydoor::test;

TEST_CASE("ring_slot is i % n for every ring size, powers of two or not", "[unit]") {
  constexpr std::uint64_t kTop = std::numeric_limits<std::uint64_t>::max();
  std::uint64_t checked = 0, wrong = 0;
  auto check = [&](std::uint64_t i, std::uint64_t n) {
    ++checked;
    if (anydoor::ring_slot(i, n) != i % n) {
      if (++wrong <= 5) FAIL_CHECK("ring_slot(" << i << ", " << n << ") = " << anydoor::ring_slot(i, n));
    }
  };
  for (std::uint64_t n = 1; n <= 300; ++n) {
    for (std::uint64_t i = 0; i < 3 * n + 5; ++i) check(i, n);
    for (std::uint64_t i = kTop - 2 * n; i != 0; ++i) check(i, n);  // up to the top of the counter
  }
  for (const std::uint64_t n : {std::uint64_t{1} << 15, (std::uint64_t{1} << 15) - 1, std::uint64_t{1} << 20,
                                (std::uint64_t{1} << 20) + 1}) {
    for (std::uint64_t i = 0; i < 4 * n; i += 7) check(i, n);
  }
  CHECK(wrong == 0);
  CHECK(checked > 1000000);
}

TEST_CASE("queues of sizes that are not powers of two wrap in order", "[unit][tcp]") {
  // 5 sends and 3 receives outstanding: the send and receive rings wrap
  // many times over 300 messages, through the division path; completion
  // queues of 7 (rings of 7 slots) wrap too.
  connected_pair p({.max_send_wr = 5, .max_recv_wr = 3}, 7, 7);
  constexpr std::uint32_t kCount = 300;
  std::vector<std::uint32_t> src(kCount), dst(3);
  for (std::uint32_t i = 0; i < kCount; ++i) src[i] = i * 2654435761u;
  auto smr = p.a.pd->register_memory(src.data(), src.size() * 4, tp::access::none);
  auto dmr = p.b.pd->register_memory(dst.data(), dst.size() * 4, tp::access::local_write);
  auto post_recv = [&](std::uint64_t id) {
    const tp::sge sg = dmr->slice((id % 3) * 4, 4);
    const tp::recv_request rr{.wr_id = id, .sg_list = {&sg, 1}};
    REQUIRE_FALSE(p.b.qp->post_recv({&rr, 1}));
  };
  for (std::uint64_t id = 0; id < 3; ++id) post_recv(id);
  std::uint32_t sent = 0, acked = 0, received = 0;
  while (received < kCount) {
    // At most three in flight: one per receive posted, never an RNR.
    while (sent < kCount && sent - received < 3 && sent - acked < 5) {
      const tp::sge sg = smr->slice(sent * 4, 4);
      const tp::work_request wr = send_wr(sent, {&sg, 1});
      REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
      ++sent;
    }
    const tp::completion c = p.drv.wait_one(p.b.cq.get());
    REQUIRE(c.status == tp::wc_status::success);
    REQUIRE(c.wr_id == received);
    REQUIRE(c.byte_len == 4);
    std::uint32_t v = 0;
    std::memcpy(&v, reinterpret_cast<const std::byte*>(dst.data()) + (received % 3) * 4, 4);
    REQUIRE(v == src[received]);
    ++received;
    if (received + 2 < kCount) post_recv(received + 2);
    while (acked < received) {
      const tp::completion s = p.drv.wait_one(p.a.cq.get());
      REQUIRE(s.status == tp::wc_status::success);
      REQUIRE(s.wr_id == acked);
      ++acked;
    }
  }
  CHECK(p.a.qp->state() == tp::qp_state::rts);
  CHECK(p.b.qp->state() == tp::qp_state::rts);
}

namespace {

// b's completion queue holds `depth`; 8 messages arrive before b polls.
std::error_code eight_into(std::uint32_t depth, std::size_t& taken) {
  connected_pair p({}, 4096, depth);
  std::vector<char> src(8, 'r'), dst(64);
  auto smr = p.a.pd->register_memory(src.data(), src.size(), tp::access::none);
  auto dmr = p.b.pd->register_memory(dst.data(), dst.size(), tp::access::local_write);
  std::vector<tp::sge> rsg;
  for (std::size_t i = 0; i < 8; ++i) rsg.push_back(dmr->slice(i * 8, 8));
  std::vector<tp::recv_request> rr;
  for (std::size_t i = 0; i < 8; ++i) rr.push_back({.wr_id = i, .sg_list = {&rsg[i], 1}});
  REQUIRE_FALSE(p.b.qp->post_recv(rr));
  const tp::sge ssg = smr->slice(0, 8);
  std::vector<tp::work_request> wrs;
  for (std::uint64_t i = 0; i < 8; ++i) wrs.push_back(send_wr(i, {&ssg, 1}));
  REQUIRE_FALSE(p.a.qp->post_send(wrs));
  // The eight leave in one sendmsg (one doorbell) and are in b's socket
  // before post_send returns on loopback; the pause is a margin. b's first
  // pass then reads them all at once.
  std::this_thread::sleep_for(100ms);
  std::error_code ec;
  tp::completion c[8];
  taken = p.b.cq->poll(c, ec);
  return ec;
}

}  // namespace

TEST_CASE("tcp provider: a completion queue overflows at its depth, neither before nor after", "[unit][tcp]") {
  if (!testing_tcp()) {
    // A verbs device may round a completion queue's depth up (ibv_create_cq).
    WARN("not run on " << provider_under_test() << ": checks the tcp provider's completion ring");
    return;
  }
  std::size_t taken = 0;
  // Eight into five: the sixth completion overflows it.
  CHECK(eight_into(5, taken) == anydoor::errc::cq_overflow);
  CHECK(taken == 0);
  // The control: a depth of 8 takes all eight.
  CHECK_FALSE(eight_into(8, taken));
  CHECK(taken == 8);
}

TEST_CASE("tcp provider: one poll takes completions that run across the ring's end - in order", "[unit][tcp]") {
  if (!testing_tcp()) {
    WARN("not run on " << provider_under_test() << ": checks the tcp provider's completion ring");
    return;
  }
  // b's completion queue holds 7 and takes only receive completions: the
  // k-th lands in slot k % 7. Rounds of 5 messages, each sent with one
  // doorbell and polled with room for 8, start at slots 0, 5, 3, 1, 6, 4, 2:
  // most rounds' completions continue from the ring's end at its start.
  connected_pair p({.max_send_wr = 8, .max_recv_wr = 8}, 4096, 7);
  std::vector<char> src(8, 'w'), dst(5 * 8);
  auto smr = p.a.pd->register_memory(src.data(), src.size(), tp::access::none);
  auto dmr = p.b.pd->register_memory(dst.data(), dst.size(), tp::access::local_write);
  const tp::sge ssg = smr->slice(0, 8);
  std::uint64_t next = 0;   // the next receive's wr_id, in the order b must hand them out
  std::size_t spanning = 0;  // polls that took a run across the ring's end
  for (int round = 0; round < 14; ++round) {
    std::vector<tp::sge> rsg;
    std::vector<tp::recv_request> rr;
    std::vector<tp::work_request> wrs;
    for (std::size_t i = 0; i < 5; ++i) rsg.push_back(dmr->slice(i * 8, 8));
    for (std::size_t i = 0; i < 5; ++i) rr.push_back({.wr_id = next + i, .sg_list = {&rsg[i], 1}});
    for (std::uint64_t i = 0; i < 5; ++i) wrs.push_back(send_wr(next + i, {&ssg, 1}));
    REQUIRE_FALSE(p.b.qp->post_recv(rr));
    REQUIRE_FALSE(p.a.qp->post_send(wrs));
    std::this_thread::sleep_for(20ms);  // (the five in b's socket: its next pass takes them at once)
    const std::uint64_t end = next + 5;
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (next < end && std::chrono::steady_clock::now() < deadline) {
      tp::completion c[8];
      std::error_code ec;
      const std::size_t n = p.b.cq->poll(c, ec);
      REQUIRE_FALSE(ec);
      if (n >= 2 && next % 7 + n > 7) ++spanning;
      for (std::size_t k = 0; k < n; ++k) {
        INFO("round " << round << ", completion " << k << " of " << n);
        REQUIRE(c[k].status == tp::wc_status::success);
        REQUIRE(c[k].wr_id == next);
        ++next;
      }
    }
    REQUIRE(next == end);
    for (int i = 0; i < 5; ++i) CHECK(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
  }
  CHECK(spanning > 0);
}
