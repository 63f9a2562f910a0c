// Provider conformance: the data path (two-sided, one-sided, atomics).
#include "../support/harness.hpp"

#include <atomic>
#include <cstring>
#include <numeric>
#include <set>

using namespace anydoor::test;
using tp::access;

TEST_CASE("send/recv gathers on send and scatters on receive", "[conformance]") {
  connected_pair p;
  std::vector<std::byte> src(300), dst(300);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>(i * 7 + 1);
  auto smr = p.a.pd->register_memory(src.data(), src.size(), access::none);
  auto dmr = p.b.pd->register_memory(dst.data(), dst.size(), access::local_write);

  // receive: three pieces 100 + 50 + 150, in a different order in memory
  tp::sge rsg[] = {dmr->slice(200, 100), dmr->slice(0, 50), dmr->slice(50, 150)};
  tp::recv_request rr{.wr_id = 77, .sg_list = rsg};
  REQUIRE_FALSE(p.b.qp->post_recv({&rr, 1}));
  // send: gather 120 bytes from [0,120) and 130 bytes from [150,280)
  tp::sge ssg[] = {smr->slice(0, 120), smr->slice(150, 130)};
  tp::work_request wr = send_wr(5, ssg);
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  // The request and its gather list were copied at post time (the runtime
  // reuses its staging for the next batch at once).
  ssg[0] = ssg[1] = tp::sge{reinterpret_cast<std::uint64_t>(dst.data()), 1, 0};
  wr = tp::work_request{};

  auto rc = p.drv.wait_one(p.b.cq.get());
  CHECK(rc.status == tp::wc_status::success);
  CHECK(rc.opcode == tp::wc_opcode::recv);
  CHECK(rc.wr_id == 77);
  CHECK(rc.byte_len == 250);
  CHECK_FALSE(rc.has_imm);
  CHECK(rc.qp_num == p.b.qp->qp_num());
  auto sc = p.drv.wait_one(p.a.cq.get());
  CHECK(sc.status == tp::wc_status::success);
  CHECK(sc.opcode == tp::wc_opcode::send);
  CHECK(sc.wr_id == 5);

  std::vector<std::byte> sent(250), got(250);
  std::copy_n(src.begin(), 120, sent.begin());
  std::copy_n(src.begin() + 150, 130, sent.begin() + 120);
  std::copy_n(dst.begin() + 200, 100, got.begin());       // first sge: 100 bytes
  std::copy_n(dst.begin(), 50, got.begin() + 100);        // second: 50
  std::copy_n(dst.begin() + 50, 100, got.begin() + 150);  // third: 100 of its 150
  CHECK(got == sent);
  CHECK(std::all_of(dst.begin() + 150, dst.begin() + 200, [](std::byte b) { return b == std::byte{0}; }));
}

TEST_CASE("inline send copies the payload at post time", "[conformance]") {
  connected_pair p;
  REQUIRE(p.a.dev->caps().max_inline >= 64);
  char msg[32] = "inline payload";
  std::vector<char> dst(64);
  auto dmr = p.b.pd->register_memory(dst.data(), dst.size(), access::local_write);
  tp::sge rsg = dmr->slice(0, 64);
  tp::recv_request rr{.wr_id = 1, .sg_list = {&rsg, 1}};
  REQUIRE_FALSE(p.b.qp->post_recv({&rr, 1}));
  // no registration: inline data needs no lkey
  tp::sge ssg{reinterpret_cast<std::uint64_t>(msg), 15, 0};
  tp::work_request wr = send_wr(9, {&ssg, 1});
  wr.inline_data = true;
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  std::memset(msg, 'X', sizeof msg);  // the provider must not read it again
  ssg = tp::sge{0, 3, 0};              // nor its gather list
  auto rc = p.drv.wait_one(p.b.cq.get());
  REQUIRE(rc.status == tp::wc_status::success);
  CHECK(rc.byte_len == 15);
  CHECK(std::string(dst.data()) == "inline payload");
  CHECK(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);

  SECTION("inline above max_inline_data is refused") {
    std::vector<char> big(p.a.qp->attributes().max_inline_data + 1);
    tp::sge bsg{reinterpret_cast<std::uint64_t>(big.data()), static_cast<std::uint32_t>(big.size()), 0};
    tp::work_request bw = send_wr(10, {&bsg, 1});
    bw.inline_data = true;
    std::size_t bad = 99;
    CHECK(p.a.qp->post_send({&bw, 1}, &bad) == anydoor::errc::invalid_argument);
    CHECK(bad == 0);
  }
}

TEST_CASE("a full send queue of inline sends of max_inline_data bytes, mixed with gather sends, arrives intact",
          "[conformance]") {
  // Each send queue slot holds either its gather list or its inline bytes
  // (a NIC's WQE): neither may spill into the next slot, whichever is larger.
  const auto caps = open_test_device()->caps();
  const std::uint32_t max_sge = std::min<std::uint32_t>(caps.max_sge, 4);
  const std::uint32_t max_inline = std::min<std::uint32_t>(caps.max_inline, 200);
  if (max_inline < 16) {
    WARN("skipped: the device's max_inline (" << max_inline << ") is below 16 bytes");
    return;
  }
  struct shape {
    std::uint32_t sge, inl;
  };
  for (const shape sh : {shape{1, max_inline}, shape{max_sge, 16}, shape{max_sge, max_inline}}) {
    CAPTURE(sh.sge, sh.inl);
    constexpr std::uint32_t kWrs = 8;
    connected_pair p({.max_send_wr = kWrs, .max_recv_wr = kWrs, .max_send_sge = sh.sge, .max_inline_data = sh.inl});
    const std::uint32_t inl = p.a.qp->attributes().max_inline_data;
    REQUIRE(inl >= sh.inl);
    const std::size_t slot = std::max<std::size_t>(inl, 64);
    std::vector<std::byte> src(kWrs * slot), dst(kWrs * slot);
    for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>(i * 7 + i / slot);
    auto smr = p.a.pd->register_memory(src.data(), src.size(), access::none);
    auto dmr = p.b.pd->register_memory(dst.data(), dst.size(), access::local_write);
    std::vector<tp::sge> rsg(kWrs);
    std::vector<tp::recv_request> rr(kWrs);
    for (std::uint32_t i = 0; i < kWrs; ++i) {
      rsg[i] = dmr->slice(i * slot, static_cast<std::uint32_t>(slot));
      rr[i] = {.wr_id = i, .sg_list = {&rsg[i], 1}};
    }
    REQUIRE_FALSE(p.b.qp->post_recv(rr));
    // Even slots: inline, max_inline_data bytes from a buffer reused
    // afterwards. Odd slots: a gather list of max_send_sge entries.
    std::vector<std::byte> staging(src.begin(), src.end());
    std::vector<tp::sge> ssg(kWrs * sh.sge);
    std::vector<tp::work_request> wr(kWrs);
    std::vector<std::size_t> len(kWrs);
    for (std::uint32_t i = 0; i < kWrs; ++i) {
      if (i % 2 == 0) {
        ssg[i * sh.sge] = {reinterpret_cast<std::uint64_t>(staging.data() + i * slot), inl, 0};
        wr[i] = send_wr(i, {&ssg[i * sh.sge], 1});
        wr[i].inline_data = true;
        len[i] = inl;
      } else {
        const std::uint32_t piece = 8;
        for (std::uint32_t k = 0; k < sh.sge; ++k) ssg[i * sh.sge + k] = smr->slice(i * slot + k * piece, piece);
        wr[i] = send_wr(i, {&ssg[i * sh.sge], sh.sge});
        len[i] = std::size_t{piece} * sh.sge;
      }
    }
    REQUIRE_FALSE(p.a.qp->post_send(wr));
    std::fill(staging.begin(), staging.end(), std::byte{0});  // inline bytes were copied at post time
    auto rc = p.drv.wait(p.b.cq.get(), kWrs);
    REQUIRE(rc.size() == kWrs);
    for (const auto& c : rc) {
      CAPTURE(c.wr_id);
      REQUIRE(c.status == tp::wc_status::success);
      CHECK(c.byte_len == len[c.wr_id]);
      CHECK(std::memcmp(dst.data() + c.wr_id * slot, src.data() + c.wr_id * slot, len[c.wr_id]) == 0);
    }
    CHECK(p.drv.wait(p.a.cq.get(), kWrs).size() == kWrs);
  }
}

TEST_CASE("send_with_imm delivers the immediate", "[conformance]") {
  connected_pair p;
  std::uint64_t src = 42, dst = 0;
  auto smr = p.a.pd->register_memory(&src, 8, access::none);
  auto dmr = p.b.pd->register_memory(&dst, 8, access::local_write);
  tp::sge rsg = dmr->slice(0, 8);
  tp::recv_request rr{.wr_id = 3, .sg_list = {&rsg, 1}};
  REQUIRE_FALSE(p.b.qp->post_recv({&rr, 1}));
  tp::sge ssg = smr->slice(0, 8);
  tp::work_request wr{.wr_id = 4, .op = tp::opcode::send_with_imm, .sg_list = {&ssg, 1}, .imm = 0xdeadbeef};
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  auto rc = p.drv.wait_one(p.b.cq.get());
  REQUIRE(rc.status == tp::wc_status::success);
  CHECK(rc.opcode == tp::wc_opcode::recv);
  CHECK(rc.has_imm);
  CHECK(rc.imm == 0xdeadbeef);
  CHECK(rc.byte_len == 8);
  CHECK(dst == 42);
}

TEST_CASE("write places data remotely and consumes no receive", "[conformance]") {
  connected_pair p;
  std::vector<std::uint8_t> src(4096), dst(4096 + 64, 0xcc);
  std::iota(src.begin(), src.end(), std::uint8_t{0});
  auto smr = p.a.pd->register_memory(src.data(), src.size(), access::none);
  auto dmr = p.b.pd->register_memory(dst.data(), dst.size(), access::local_write | access::remote_write);
  tp::sge ssg = smr->slice(0, 4096);
  tp::work_request wr{.wr_id = 11, .op = tp::opcode::write, .sg_list = {&ssg, 1},
                      .remote_addr = reinterpret_cast<std::uint64_t>(dst.data() + 32), .rkey = dmr->rkey()};
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  auto c = p.drv.wait_one(p.a.cq.get());
  CHECK(c.status == tp::wc_status::success);
  CHECK(c.opcode == tp::wc_opcode::write);
  CHECK(wait_placed([&] { return std::equal(src.begin(), src.end(), dst.begin() + 32); }));
  CHECK(std::all_of(dst.begin(), dst.begin() + 32, [](auto b) { return b == 0xcc; }));
  CHECK(std::all_of(dst.begin() + 32 + 4096, dst.end(), [](auto b) { return b == 0xcc; }));
  CHECK(p.drv.settle(p.b.cq.get(), 20ms).empty());  // the target sees no completion
}

TEST_CASE("write_with_imm consumes a receive and reports imm and length", "[conformance]") {
  connected_pair p;
  std::vector<char> src(1000, 'w'), dst(1000);
  auto smr = p.a.pd->register_memory(src.data(), src.size(), access::none);
  auto dmr = p.b.pd->register_memory(dst.data(), dst.size(), access::local_write | access::remote_write);
  tp::recv_request rr{.wr_id = 21};  // no scatter list needed
  REQUIRE_FALSE(p.b.qp->post_recv({&rr, 1}));
  tp::sge ssg = smr->slice(0, 1000);
  tp::work_request wr{.wr_id = 22, .op = tp::opcode::write_with_imm, .sg_list = {&ssg, 1}, .imm = 1234,
                      .remote_addr = reinterpret_cast<std::uint64_t>(dst.data()), .rkey = dmr->rkey()};
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  auto rc = p.drv.wait_one(p.b.cq.get());
  REQUIRE(rc.status == tp::wc_status::success);
  CHECK(rc.opcode == tp::wc_opcode::recv_rdma_with_imm);
  CHECK(rc.wr_id == 21);
  CHECK(rc.has_imm);
  CHECK(rc.imm == 1234);
  CHECK(rc.byte_len == 1000);
  CHECK(dst == src);
  CHECK(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
}

TEST_CASE("read fetches remote data into a local scatter list", "[conformance]") {
  connected_pair p;
  std::vector<std::uint8_t> remote(8192), l1(5000, 0), l2(3192, 0);
  for (std::size_t i = 0; i < remote.size(); ++i) remote[i] = static_cast<std::uint8_t>(i % 251);
  auto rmr = p.b.pd->register_memory(remote.data(), remote.size(), access::remote_read);
  auto m1 = p.a.pd->register_memory(l1.data(), l1.size(), access::local_write);
  auto m2 = p.a.pd->register_memory(l2.data(), l2.size(), access::local_write);
  tp::sge sg[] = {m1->slice(0, 5000), m2->slice(0, 3192)};
  tp::work_request wr{.wr_id = 31, .op = tp::opcode::read, .sg_list = sg,
                      .remote_addr = reinterpret_cast<std::uint64_t>(remote.data()), .rkey = rmr->rkey()};
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  sg[0] = sg[1] = m2->slice(0, 1);  // the scatter list was copied at post time
  auto c = p.drv.wait_one(p.a.cq.get());
  REQUIRE(c.status == tp::wc_status::success);
  CHECK(c.opcode == tp::wc_opcode::read);
  CHECK(std::equal(l1.begin(), l1.end(), remote.begin()));
  CHECK(std::equal(l2.begin(), l2.end(), remote.begin() + 5000));
}

namespace {
tp::completion atomic_op(connected_pair& p, tp::opcode op, std::uint64_t* target, std::uint32_t rkey,
                         std::uint64_t* result, tp::memory_region& rmr, std::uint64_t a, std::uint64_t b = 0) {
  tp::sge sg{reinterpret_cast<std::uint64_t>(result), 8, rmr.lkey()};
  tp::work_request wr{.wr_id = 41, .op = op, .sg_list = {&sg, 1},
                      .remote_addr = reinterpret_cast<std::uint64_t>(target), .rkey = rkey,
                      .compare_add = a, .swap = b};
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  return p.drv.wait_one(p.a.cq.get());
}
}  // namespace

TEST_CASE("fetch_add and compare_swap return the original value", "[conformance]") {
  connected_pair p;
  REQUIRE(p.a.dev->caps().atomics);
  alignas(8) std::uint64_t words[3] = {0xcafe, 100, 0xcafe};
  std::uint64_t result = 0;
  auto tmr = p.b.pd->register_memory(words, sizeof words, access::local_write | access::remote_atomic);
  auto lmr = p.a.pd->register_memory(&result, 8, access::local_write);

  auto c = atomic_op(p, tp::opcode::fetch_add, &words[1], tmr->rkey(), &result, *lmr, 5);
  CHECK(c.status == tp::wc_status::success);
  CHECK(c.opcode == tp::wc_opcode::fetch_add);
  CHECK(result == 100);
  CHECK(words[1] == 105);

  c = atomic_op(p, tp::opcode::compare_swap, &words[1], tmr->rkey(), &result, *lmr, 105, 7);
  CHECK(c.status == tp::wc_status::success);
  CHECK(c.opcode == tp::wc_opcode::compare_swap);
  CHECK(result == 105);
  CHECK(words[1] == 7);

  // a failed compare leaves memory alone and still returns the original
  c = atomic_op(p, tp::opcode::compare_swap, &words[1], tmr->rkey(), &result, *lmr, 999, 1);
  CHECK(c.status == tp::wc_status::success);
  CHECK(result == 7);
  CHECK(words[1] == 7);
  CHECK(words[0] == 0xcafe);
  CHECK(words[2] == 0xcafe);
}

TEST_CASE("an atomic on a remote address that is not 8-byte aligned is refused at post time", "[conformance]") {
  connected_pair p;
  std::uint64_t result = 0;
  auto lmr = p.a.pd->register_memory(&result, 8, access::local_write);
  tp::sge sg = lmr->slice(0, 8);
  tp::work_request wr{.wr_id = 41, .op = tp::opcode::fetch_add, .sg_list = {&sg, 1}, .remote_addr = 0x1004,
                      .rkey = 1, .compare_add = 1};
  std::size_t bad = 99;
  CHECK(p.a.qp->post_send({&wr, 1}, &bad) == anydoor::errc::invalid_argument);
  CHECK(bad == 0);
  CHECK(p.a.qp->state() == tp::qp_state::rts);  // nothing was posted
}

TEST_CASE("atomics stay atomic against concurrent atomics from several queue pairs", "[conformance]") {
  constexpr int kQps = 4;
  constexpr int kOps = 400;
  alignas(8) std::uint64_t counter = 0;
  auto target_dev = open_test_device();
  auto target_pd = target_dev->alloc_pd();
  auto tmr = target_pd->register_memory(&counter, 8, access::local_write | access::remote_atomic);

  struct initiator {
    endpoint ep;
    std::unique_ptr<tp::completion_queue> tcq;  // the target side's CQ for this QP
    std::unique_ptr<tp::queue_pair> tqp;
    std::vector<std::uint64_t> seen;
  };
  std::vector<std::unique_ptr<initiator>> ins;
  for (int i = 0; i < kQps; ++i) {
    auto in = std::make_unique<initiator>();
    in->ep.qp = in->ep.pd->create_qp(in->ep.attrs());
    in->tcq = target_dev->create_cq(256);
    in->tqp = target_pd->create_qp({.send_cq = in->tcq.get(), .recv_cq = in->tcq.get()});
    connect_pair(*target_dev, *in->tqp, *in->ep.dev, *in->ep.qp);
    ins.push_back(std::move(in));
  }
  // Each initiator and its target-side queue are driven by their own thread,
  // so the target executes atomics from several threads at once.
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (auto& inp : ins) {
    threads.emplace_back([&, in = inp.get()] {
      std::uint64_t result = 0;
      auto lmr = in->ep.pd->register_memory(&result, 8, access::local_write);
      tp::sge sg{reinterpret_cast<std::uint64_t>(&result), 8, lmr->lkey()};
      driver d{in->ep.cq.get(), in->tcq.get()};
      for (int k = 0; k < kOps; ++k) {
        tp::work_request wr{.wr_id = static_cast<std::uint64_t>(k), .op = tp::opcode::fetch_add,
                            .sg_list = {&sg, 1}, .remote_addr = reinterpret_cast<std::uint64_t>(&counter),
                            .rkey = tmr->rkey(), .compare_add = 1};
        if (in->ep.qp->post_send({&wr, 1})) { ++failures; return; }
        auto c = d.wait(in->ep.cq.get(), 1);
        if (c.size() != 1 || c[0].status != tp::wc_status::success) { ++failures; return; }
        in->seen.push_back(result);
      }
    });
  }
  // ... and, on tcp, the target's own CPU increments the same word
  // meanwhile: its atomics are the target process's CPU atomics. A verbs
  // device promises atomicity among its own atomics only unless it
  // reports IBV_ATOMIC_GLOB (rxe reports IBV_ATOMIC_HCA and lost one of
  // the CPU's 400 increments in a CI run), so there the queue pairs alone race.
  const bool cpu_too = target_dev->provider() == "tcp";
  if (!cpu_too) WARN("the target CPU's concurrent increments not run on " << target_dev->provider()
                     << ": verbs promises atomicity among the device's own atomics (IBV_ATOMIC_HCA)");
  if (cpu_too) {
    for (int k = 0; k < kOps; ++k) std::atomic_ref<std::uint64_t>(counter).fetch_add(1);
  }
  for (auto& t : threads) t.join();
  REQUIRE(failures == 0);
  CHECK(std::atomic_ref<std::uint64_t>(counter).load() == (std::uint64_t{kQps} + (cpu_too ? 1u : 0u)) * kOps);
  std::set<std::uint64_t> all;
  for (auto& in : ins) all.insert(in->seen.begin(), in->seen.end());
  CHECK(all.size() == std::size_t{kQps} * kOps);  // every fetch_add saw a distinct value
}
