// Provider conformance: a completion queue made with a progress thread
// (cq_options::progress_thread). Its owner here never polls it while the
// peer works on its memory: the peer's operations must complete all the
// same, as they do on a NIC (verbs needs no thread for that; tcp does).
#include "../support/harness.hpp"

#include <poll.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>

using namespace anydoor::test;
using tp::access;

namespace {

// b's queue has the thread; only a's is driven.
struct threaded_pair : connected_pair {
  threaded_pair() : connected_pair({}, 4096, 4096, {.progress_thread = true}) {}
  driver a_only{a.cq.get()};
};

// A message's bytes at a and the receive buffer at b, registered.
struct message_buffers {
  std::vector<char> msg, dst;
  std::unique_ptr<tp::memory_region> smr, dmr;
  message_buffers(threaded_pair& p, std::size_t msg_size, std::size_t dst_size, char fill)
      : msg(msg_size, fill), dst(dst_size, 0),
        smr(p.a.pd->register_memory(msg.data(), msg.size(), access::none)),
        dmr(p.b.pd->register_memory(dst.data(), dst.size(), access::local_write)) {}
};

// What the target's provider wrote on its thread is seen here once its
// queue's entry points were passed (tcp: they take the queue's mutex, which
// the thread holds while it works; the bytes come from the kernel on a NIC).
void sync_with(tp::completion_queue& cq) { (void)cq.counters(); }

// The owner drains its queue, arms it, drains again (the arm-then-drain
// rule) and would sleep on its notify fd; stale notifications consumed.
void arm_to_sleep(tp::completion_queue& cq) {
  tp::completion none[4];
  std::error_code ec;
  REQUIRE(cq.poll(none, ec) == 0);
  REQUIRE_FALSE(cq.arm());
  REQUIRE(cq.poll(none, ec) == 0);
  cq.ack_events();
}

bool readable_within(int fd, std::chrono::milliseconds limit) {
  pollfd p{.fd = fd, .events = POLLIN, .revents = 0};
  return ::poll(&p, 1, static_cast<int>(limit.count())) == 1;
}

}  // namespace

TEST_CASE("progress thread: the target's memory serves writes - reads and atomics while its owner never polls",
          "[conformance]") {
  threaded_pair p;
  std::vector<std::uint8_t> src(100000), window(100000 + 64, 0xcc), back(100000, 0);
  std::iota(src.begin(), src.end(), std::uint8_t{7});
  alignas(8) std::uint64_t word = 40;
  std::uint64_t result = 0;
  auto smr = p.a.pd->register_memory(src.data(), src.size(), access::none);
  auto bmr = p.a.pd->register_memory(back.data(), back.size(), access::local_write);
  auto rmr = p.a.pd->register_memory(&result, 8, access::local_write);
  auto wmr = p.b.pd->register_memory(window.data(), window.size(),
                                     access::local_write | access::remote_write | access::remote_read);
  auto amr = p.b.pd->register_memory(&word, 8, access::local_write | access::remote_atomic);
  // The owner arms and sleeps: the peer's one-sided work gives it nothing
  // to wake for (as on a NIC).
  arm_to_sleep(*p.b.cq);

  // A large write (several socket reads on tcp), then a read of it back.
  tp::sge ssg = smr->slice(0, static_cast<std::uint32_t>(src.size()));
  tp::work_request w{.wr_id = 1, .op = tp::opcode::write, .sg_list = {&ssg, 1},
                     .remote_addr = reinterpret_cast<std::uint64_t>(window.data() + 32), .rkey = wmr->rkey()};
  REQUIRE_FALSE(p.a.qp->post_send({&w, 1}));
  auto c = p.a_only.wait_one(p.a.cq.get());
  CHECK(c.status == tp::wc_status::success);
  tp::sge bsg = bmr->slice(0, static_cast<std::uint32_t>(back.size()));
  tp::work_request r{.wr_id = 2, .op = tp::opcode::read, .sg_list = {&bsg, 1},
                     .remote_addr = reinterpret_cast<std::uint64_t>(window.data() + 32), .rkey = wmr->rkey()};
  REQUIRE_FALSE(p.a.qp->post_send({&r, 1}));
  c = p.a_only.wait_one(p.a.cq.get());
  REQUIRE(c.status == tp::wc_status::success);
  CHECK(c.opcode == tp::wc_opcode::read);
  CHECK(back == src);
  sync_with(*p.b.cq);
  CHECK(wait_placed([&] { return std::equal(src.begin(), src.end(), window.begin() + 32); }));
  CHECK(window[31] == 0xcc);
  CHECK(window[32 + src.size()] == 0xcc);

  if (p.a.dev->caps().atomics) {
    tp::sge asg{reinterpret_cast<std::uint64_t>(&result), 8, rmr->lkey()};
    tp::work_request fa{.wr_id = 3, .op = tp::opcode::fetch_add, .sg_list = {&asg, 1},
                        .remote_addr = reinterpret_cast<std::uint64_t>(&word), .rkey = amr->rkey(), .compare_add = 2};
    REQUIRE_FALSE(p.a.qp->post_send({&fa, 1}));
    REQUIRE(p.a_only.wait_one(p.a.cq.get()).status == tp::wc_status::success);
    CHECK(result == 40);
    tp::work_request cs{.wr_id = 4, .op = tp::opcode::compare_swap, .sg_list = {&asg, 1},
                        .remote_addr = reinterpret_cast<std::uint64_t>(&word), .rkey = amr->rkey(),
                        .compare_add = 42, .swap = 9};
    REQUIRE_FALSE(p.a.qp->post_send({&cs, 1}));
    REQUIRE(p.a_only.wait_one(p.a.cq.get()).status == tp::wc_status::success);
    CHECK(result == 42);
    sync_with(*p.b.cq);
    CHECK(word == 9);
  }
  // The target's queue got nothing of all this, and its owner was never
  // woken (the notifications would still be there to consume).
  CHECK(p.b.cq->ack_events() == 0);
  tp::completion none[4];
  std::error_code ec;
  CHECK(p.b.cq->poll(none, ec) == 0);
  CHECK_FALSE(ec);
}

TEST_CASE("progress thread: a message lands in a posted receive while the owner sleeps - its notify fd wakes it",
          "[conformance]") {
  threaded_pair p;
  message_buffers m(p, 3000, 4096, 'm');
  auto& [msg, dst, smr, dmr] = m;
  tp::sge rsg = dmr->slice(0, static_cast<std::uint32_t>(dst.size()));
  tp::recv_request rr{.wr_id = 77, .sg_list = {&rsg, 1}};
  REQUIRE_FALSE(p.b.qp->post_recv({&rr, 1}));
  arm_to_sleep(*p.b.cq);

  tp::sge ssg = smr->slice(0, static_cast<std::uint32_t>(msg.size()));
  tp::work_request s = send_wr(5, {&ssg, 1});
  REQUIRE_FALSE(p.a.qp->post_send({&s, 1}));
  // The sender's completion needs the target's acknowledgement: it comes
  // though the target's owner does not poll.
  CHECK(p.a_only.wait_one(p.a.cq.get()).status == tp::wc_status::success);
  REQUIRE(readable_within(p.b.cq->notify_fd(), 5000ms));
  p.b.cq->ack_events();
  tp::completion got[4];
  std::error_code ec;
  std::size_t n = 0;
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (n == 0 && std::chrono::steady_clock::now() < until) n = p.b.cq->poll(got, ec);
  REQUIRE(n == 1);
  CHECK(got[0].status == tp::wc_status::success);
  CHECK(got[0].wr_id == 77);
  CHECK(got[0].byte_len == 3000);
  CHECK(std::memcmp(dst.data(), msg.data(), msg.size()) == 0);
}

TEST_CASE("progress thread: with the owner polling too - every message of a stream arrives once and in order",
          "[conformance]") {
  threaded_pair p;
  // The owner polls b's queue and reposts receives while its thread runs:
  // both drive the queue pairs (on tcp, under the queue's mutex).
  constexpr int kMessages = 3000;
  constexpr std::uint32_t kRecvs = 64;
  std::vector<std::uint32_t> src(kMessages);
  std::iota(src.begin(), src.end(), 1u);
  std::vector<std::uint32_t> slots(kRecvs, 0);
  auto smr = p.a.pd->register_memory(src.data(), src.size() * 4, access::none);
  auto dmr = p.b.pd->register_memory(slots.data(), slots.size() * 4, access::local_write);
  auto post = [&](std::uint32_t i) {
    tp::sge sg = dmr->slice(i * 4, 4);
    tp::recv_request rr{.wr_id = i, .sg_list = {&sg, 1}};
    return p.b.qp->post_recv({&rr, 1});
  };
  for (std::uint32_t i = 0; i < kRecvs; ++i) REQUIRE_FALSE(post(i));
  std::atomic<bool> failed{false};
  std::uint32_t next_expected = 1;
  std::thread owner;
  struct stop_owner {  // (a failed REQUIRE below must not leave it joinable)
    std::thread& t;
    std::atomic<bool>& failed;
    ~stop_owner() {
      if (!t.joinable()) return;
      failed = true;
      t.join();
    }
  } stop{owner, failed};
  owner = std::thread([&] {
    const auto until = std::chrono::steady_clock::now() + 30s;
    while (next_expected <= kMessages && std::chrono::steady_clock::now() < until && !failed) {
      tp::completion got[16];
      std::error_code ec;
      const std::size_t n = p.b.cq->poll(got, ec);
      if (ec) failed = true;
      for (std::size_t i = 0; i < n; ++i) {
        const auto slot = static_cast<std::uint32_t>(got[i].wr_id);
        if (got[i].status != tp::wc_status::success || slots[slot] != next_expected) failed = true;
        ++next_expected;
        if (post(slot)) failed = true;
      }
    }
  });
  // Sends at most the receives posted ahead, in order (no RNR wait).
  std::size_t done = 0, sent = 0;
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (done < kMessages && std::chrono::steady_clock::now() < until && !failed) {
    while (sent < kMessages && sent - done < kRecvs / 2) {
      tp::sge sg = smr->slice(static_cast<std::uint32_t>(sent * 4), 4);
      tp::work_request s = send_wr(sent, {&sg, 1});
      REQUIRE_FALSE(p.a.qp->post_send({&s, 1}));
      ++sent;
    }
    for (const auto& c : p.a_only.wait(p.a.cq.get(), 1, 100ms)) {
      if (c.status != tp::wc_status::success) failed = true;
      ++done;
    }
  }
  owner.join();
  CHECK_FALSE(failed);
  CHECK(done == kMessages);
  CHECK(next_expected == kMessages + 1);
}

TEST_CASE("progress thread: what the owner's last poll left undone is done - the sender hears of its message",
          "[conformance]") {
  // The owner polls until its receive completes, then stops. Where its own
  // poll took the message (it busy-polls: it usually does), the provider
  // may have held the acknowledgement back for the owner's next request to
  // carry; with no next request the thread must send it.
  threaded_pair p;
  message_buffers m(p, 64, 64, 'h');
  auto& [msg, dst, smr, dmr] = m;
  tp::sge ssg = smr->slice(0, 64);
  tp::sge rsg = dmr->slice(0, 64);
  for (std::uint64_t round = 0; round < 20; ++round) {
    // (idle first: on tcp the thread then no longer wakes on its own to
    // look for such work, and must be told)
    std::this_thread::sleep_for(15ms);
    tp::recv_request rr{.wr_id = round, .sg_list = {&rsg, 1}};
    REQUIRE_FALSE(p.b.qp->post_recv({&rr, 1}));
    tp::work_request s = send_wr(round, {&ssg, 1});
    REQUIRE_FALSE(p.a.qp->post_send({&s, 1}));
    tp::completion got[1];
    std::error_code ec;
    std::size_t n = 0;
    const auto until = std::chrono::steady_clock::now() + 5s;
    while (n == 0 && !ec && std::chrono::steady_clock::now() < until) n = p.b.cq->poll(got, ec);
    REQUIRE(n == 1);
    REQUIRE(got[0].wr_id == round);
    const auto sent = p.a_only.wait(p.a.cq.get(), 1, 2s);
    INFO("round " << round);
    REQUIRE(sent.size() == 1);
    CHECK(sent[0].status == tp::wc_status::success);
  }
}

TEST_CASE("progress thread: destroyed with the peer's work in flight - the peer sees its operations end",
          "[conformance]") {
  for (int round = 0; round < 3; ++round) {
    threaded_pair p;
    std::vector<std::uint8_t> src(1 << 20, 1), dst(1 << 20);
    auto smr = p.a.pd->register_memory(src.data(), src.size(), access::none);
    auto dmr = p.b.pd->register_memory(dst.data(), dst.size(), access::local_write | access::remote_write);
    std::vector<tp::sge> sg(16, smr->slice(0, static_cast<std::uint32_t>(src.size())));
    std::vector<tp::work_request> wrs;
    for (std::uint64_t i = 0; i < 16; ++i) {
      wrs.push_back({.wr_id = i, .op = tp::opcode::write, .sg_list = {&sg[i], 1},
                     .remote_addr = reinterpret_cast<std::uint64_t>(dst.data()), .rkey = dmr->rkey()});
    }
    REQUIRE_FALSE(p.a.qp->post_send(wrs));
    // (some arrive, some do not)
    const std::size_t before = p.a_only.settle(p.a.cq.get(), std::chrono::milliseconds(round)).size();
    p.b.qp.reset();   // the thread may be inside a pass over it
    p.b.cq.reset();   // and is joined here
    dmr.reset();
    // Every write completes at a: done before the destroy, or failed.
    const auto got = p.a_only.wait(p.a.cq.get(), 16 - before, 20s);
    CHECK(before + got.size() == 16);
  }
}

TEST_CASE("progress thread: its queue pairs must have it as both completion queues - its owner need not poll",
          "[conformance]") {
  if (!testing_tcp()) {
    WARN("skipped on " << provider_under_test() << ": progress_thread has no effect where the NIC serves the peers");
    return;
  }
  endpoint t(512, {.progress_thread = true});
  auto other = t.dev->create_cq(512);
  // The owner of a threaded queue need not poll for the peers' sake; its
  // notify fd is not the unthreaded queue's.
  CHECK_FALSE(t.cq->progress_in_poll());
  CHECK(other->progress_in_poll());
  CHECK(thrown([&] { t.pd->create_qp({.send_cq = t.cq.get(), .recv_cq = other.get()}); }) ==
        anydoor::errc::invalid_argument);
  CHECK(thrown([&] { t.pd->create_qp({.send_cq = other.get(), .recv_cq = t.cq.get()}); }) ==
        anydoor::errc::invalid_argument);
  CHECK_FALSE(thrown([&] { t.pd->create_qp(t.attrs()); }));
}
