// Provider conformance: type-2 memory windows (rkeys scoped to one queue
// pair). A window bound on a queue pair opens its range, with its rights,
// to that queue pair's peer only: the same key sent by another peer of the
// same protection domain, the registration's own key, a range or right
// outside the window, and the key after the window is destroyed all fail
// with remote_access_error and write nothing.
//
// Where rxe deviates, see rxe_window_range_unchecked.
//
// tcp and rxe must have windows (rxe has type 2B since Linux 5.12): there a
// missing capability fails. Another device without them (siw) skips with a
// warning naming it.
#include "../support/harness.hpp"

#include <algorithm>
#include <cstring>

using namespace anydoor::test;
using tp::access;

namespace {

bool device_has_windows(const tp::device& d) {
  if (d.caps().memory_windows) return true;
  if (d.provider() == "tcp" || d.name().rfind("rxe", 0) == 0) {
    FAIL(d.provider() << " device " << d.name() << " reports no memory windows");
  }
  WARN("skipped: " << d.provider() << " device " << d.name() << " has no type-2 memory windows");
  return false;
}

// rxe (Linux 6.1) checks an access through a window against the range of
// the window's registration, not the window's own (rxe_resp.c's
// check_rkey takes the window's MR and range-checks that); the IB spec and
// the tcp provider refuse outside the window. The runtime binds its windows
// over whole registrations, so it does not depend on the difference.
bool rxe_window_range_unchecked(const tp::device& d) {
  if (d.provider() != "verbs" || d.name().rfind("rxe", 0) != 0) return false;
  WARN("skipped on " << d.name() << ": rxe checks window accesses against the registration's range only");
  return true;
}

// b serves two peers from one protection domain: a (on b.qp) and c (on
// qp_c). The target memory is b's, registered for window binding only (no
// remote rights of its own).
struct two_peers {
  endpoint a, b, c;
  std::unique_ptr<tp::queue_pair> qp_c;  // b's queue pair towards c
  driver drv{a.cq.get(), b.cq.get(), c.cq.get()};
  static constexpr std::size_t kGuard = 64, kSize = 4096, kWinOff = 1024, kWinLen = 512;
  std::vector<std::uint8_t> mem = std::vector<std::uint8_t>(kSize + 2 * kGuard, 0xa5);
  std::unique_ptr<tp::memory_region> target;
  std::vector<std::uint8_t> src = std::vector<std::uint8_t>(64, 0x3c);
  std::unique_ptr<tp::memory_region> src_a, src_c;
  std::uint64_t result = 0;
  std::unique_ptr<tp::memory_region> result_mr;

  two_peers() {
    a.qp = a.pd->create_qp(a.attrs());
    b.qp = b.pd->create_qp(b.attrs());
    c.qp = c.pd->create_qp(c.attrs());
    qp_c = b.pd->create_qp(b.attrs());
    connect_pair(*b.dev, *b.qp, *a.dev, *a.qp);
    connect_pair(*b.dev, *qp_c, *c.dev, *c.qp);
    target = b.pd->register_memory(mem.data() + kGuard, kSize, access::local_write | access::mw_bind);
    src_a = a.pd->register_memory(src.data(), src.size(), access::local_write);
    src_c = c.pd->register_memory(src.data(), src.size(), access::local_write);
    result_mr = a.pd->register_memory(&result, 8, access::local_write);
  }
  std::uint64_t taddr(std::size_t off = 0) const { return reinterpret_cast<std::uint64_t>(mem.data() + kGuard + off); }
  // Everything outside [off, off + len) of the target still holds the fill.
  bool untouched_outside(std::size_t off, std::size_t len) const {
    for (std::size_t i = 0; i < mem.size(); ++i) {
      const bool inside = i >= kGuard + off && i < kGuard + off + len;
      if (!inside && mem[i] != 0xa5) return false;
    }
    return true;
  }
  bool untouched() const { return untouched_outside(0, 0); }

  // Binds w on b.qp (towards a) over the window range; waits for its completion.
  void bind(tp::memory_window& w, tp::access rights, std::size_t off = kWinOff, std::size_t len = kWinLen) {
    tp::work_request wr{.wr_id = 500, .op = tp::opcode::bind_window};
    wr.bind = {&w, target.get(), taddr(off), len, rights};
    REQUIRE_FALSE(b.qp->post_send({&wr, 1}));
    const tp::completion c1 = drv.wait_one(b.cq.get());
    REQUIRE(c1.status == tp::wc_status::success);
    CHECK(c1.opcode == tp::wc_opcode::bind_window);
    CHECK(c1.wr_id == 500);
  }
  tp::work_request write_wr(std::uint64_t id, std::uint32_t rkey, std::uint64_t addr, std::uint32_t len = 16) {
    sg = src_a->slice(0, len);
    return {.wr_id = id, .op = tp::opcode::write, .sg_list = {&sg, 1}, .remote_addr = addr, .rkey = rkey};
  }
  // Posts wr from a (or c) and expects it to fail with a remote access
  // error that takes both queue pairs of that connection down.
  void expect_refused(tp::queue_pair& from, tp::completion_queue* cq, tp::queue_pair& peer,
                      const tp::work_request& wr) {
    REQUIRE_FALSE(from.post_send({&wr, 1}));
    const tp::completion c1 = drv.wait_one(cq);
    CHECK(c1.status == tp::wc_status::remote_access_error);
    CHECK(c1.wr_id == wr.wr_id);
    CHECK(from.state() == tp::qp_state::error);
    drv.settle(b.cq.get(), 20ms);
    CHECK(peer.state() == tp::qp_state::error);
  }
  tp::sge sg{};
};

}  // namespace

TEST_CASE("memory windows: a bound window opens its range to its own queue pair's peer only", "[conformance]") {
  two_peers p;
  if (!device_has_windows(*p.b.dev)) return;
  auto w = p.b.pd->alloc_window();
  REQUIRE(w != nullptr);
  CHECK_FALSE(w->bound());
  const std::uint32_t unbound_key = w->rkey();
  p.bind(*w, access::remote_write | access::remote_read | access::remote_atomic);
  CHECK(w->bound());
  CHECK(w->rkey() != unbound_key);
  const std::uint32_t rkey = w->rkey();

  SECTION("its peer writes, reads and adds inside it") {
    tp::work_request wr = p.write_wr(1, rkey, p.taddr(two_peers::kWinOff));
    REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
    CHECK(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
    CHECK(std::all_of(p.mem.begin() + two_peers::kGuard + two_peers::kWinOff,
                      p.mem.begin() + two_peers::kGuard + two_peers::kWinOff + 16, [](auto b) { return b == 0x3c; }));
    // the last bytes of the window, read back
    std::memset(p.mem.data() + two_peers::kGuard + two_peers::kWinOff + two_peers::kWinLen - 8, 0x42, 8);
    tp::sge rsg = p.result_mr->slice(0, 8);
    tp::work_request rd{.wr_id = 2, .op = tp::opcode::read, .sg_list = {&rsg, 1},
                        .remote_addr = p.taddr(two_peers::kWinOff + two_peers::kWinLen - 8), .rkey = rkey};
    REQUIRE_FALSE(p.a.qp->post_send({&rd, 1}));
    CHECK(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
    CHECK(p.result == 0x4242424242424242ull);
    std::uint64_t word = 5;
    std::memcpy(p.mem.data() + two_peers::kGuard + two_peers::kWinOff + 64, &word, 8);
    tp::work_request add{.wr_id = 3, .op = tp::opcode::fetch_add, .sg_list = {&rsg, 1},
                         .remote_addr = p.taddr(two_peers::kWinOff + 64), .rkey = rkey, .compare_add = 10};
    REQUIRE_FALSE(p.a.qp->post_send({&add, 1}));
    CHECK(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
    CHECK(p.result == 5);
    std::memcpy(&word, p.mem.data() + two_peers::kGuard + two_peers::kWinOff + 64, 8);
    CHECK(word == 15);
  }
  SECTION("the key leaked to another peer of the same protection domain opens nothing") {
    p.sg = p.src_c->slice(0, 16);
    tp::work_request wr{.wr_id = 4, .op = tp::opcode::write, .sg_list = {&p.sg, 1},
                        .remote_addr = p.taddr(two_peers::kWinOff), .rkey = rkey};
    p.expect_refused(*p.c.qp, p.c.cq.get(), *p.qp_c, wr);
    CHECK(p.untouched());
    // The window's own peer is unaffected.
    tp::work_request ok = p.write_wr(5, rkey, p.taddr(two_peers::kWinOff));
    REQUIRE_FALSE(p.a.qp->post_send({&ok, 1}));
    CHECK(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
  }
  SECTION("the registration's own key opens nothing remotely") {
    p.expect_refused(*p.a.qp, p.a.cq.get(), *p.b.qp, p.write_wr(6, p.target->rkey(), p.taddr(two_peers::kWinOff)));
    CHECK(p.untouched());
  }
  SECTION("memory of the registration outside the window is refused") {
    if (rxe_window_range_unchecked(*p.b.dev)) return;
    p.expect_refused(*p.a.qp, p.a.cq.get(), *p.b.qp,
                     p.write_wr(7, rkey, p.taddr(two_peers::kWinOff + two_peers::kWinLen - 15)));
    CHECK(p.untouched());
  }
  SECTION("memory beyond the registration is refused") {
    auto wide = p.b.pd->alloc_window();
    p.bind(*wide, access::remote_write, two_peers::kSize - 256, 256);
    p.expect_refused(*p.a.qp, p.a.cq.get(), *p.b.qp, p.write_wr(9, wide->rkey(), p.taddr(two_peers::kSize - 15)));
    CHECK(p.untouched());
  }
  SECTION("a destroyed window's key is refused") {
    w.reset();
    p.expect_refused(*p.a.qp, p.a.cq.get(), *p.b.qp, p.write_wr(8, rkey, p.taddr(two_peers::kWinOff)));
    CHECK(p.untouched());
  }
}

TEST_CASE("memory windows: a window grants only the rights it was bound with", "[conformance]") {
  two_peers p;
  if (!device_has_windows(*p.b.dev)) return;
  auto w = p.b.pd->alloc_window();
  p.bind(*w, access::remote_read);
  SECTION("write") {
    p.expect_refused(*p.a.qp, p.a.cq.get(), *p.b.qp, p.write_wr(1, w->rkey(), p.taddr(two_peers::kWinOff)));
  }
  SECTION("atomic") {
    tp::sge rsg = p.result_mr->slice(0, 8);
    tp::work_request add{.wr_id = 2, .op = tp::opcode::fetch_add, .sg_list = {&rsg, 1},
                         .remote_addr = p.taddr(two_peers::kWinOff), .rkey = w->rkey(), .compare_add = 1};
    p.expect_refused(*p.a.qp, p.a.cq.get(), *p.b.qp, add);
  }
  CHECK(p.untouched());
}

TEST_CASE("memory windows: binds are checked when posted", "[conformance]") {
  two_peers p;
  if (!device_has_windows(*p.b.dev)) return;
  auto w = p.b.pd->alloc_window();
  std::vector<std::uint8_t> other(256);
  auto no_bind = p.b.pd->register_memory(other.data(), other.size(), access::local_write);
  auto read_only = p.b.pd->register_memory(other.data(), other.size(), access::mw_bind);
  auto foreign_window = p.a.pd->alloc_window();
  std::vector<std::uint8_t> a_mem(256);
  auto foreign_region = p.a.pd->register_memory(a_mem.data(), a_mem.size(), access::local_write | access::mw_bind);
  auto bind_wr = [&](tp::memory_window* win, const tp::memory_region* r, std::uint64_t addr, std::uint64_t len,
                     tp::access rights) {
    tp::work_request wr{.wr_id = 9, .op = tp::opcode::bind_window};
    wr.bind = {win, r, addr, len, rights};
    return wr;
  };
  const auto base = p.taddr();
  const auto other_base = reinterpret_cast<std::uint64_t>(other.data());
  const auto a_base = reinterpret_cast<std::uint64_t>(a_mem.data());
  std::vector<tp::work_request> bad = {
      bind_wr(nullptr, p.target.get(), base, 64, access::remote_read),                 // no window
      bind_wr(w.get(), nullptr, base, 64, access::remote_read),                        // no region
      bind_wr(w.get(), no_bind.get(), other_base, 64, access::remote_read),           // region without mw_bind
      bind_wr(w.get(), read_only.get(), other_base, 64, access::remote_write),        // write without local_write
      bind_wr(w.get(), read_only.get(), other_base, 64, access::remote_atomic),       // atomic without local_write
      bind_wr(w.get(), p.target.get(), base, 0, access::remote_read),                  // empty range
      bind_wr(w.get(), p.target.get(), base - 1, 64, access::remote_read),             // starts before the region
      bind_wr(w.get(), p.target.get(), base + two_peers::kSize - 63, 64, access::remote_read),  // ends past it
      bind_wr(w.get(), p.target.get(), base, 64, access::none),                        // no rights
      bind_wr(w.get(), p.target.get(), base, 64, access::local_write),                 // not a remote right
      bind_wr(foreign_window.get(), p.target.get(), base, 64, access::remote_read),    // another domain's window
      bind_wr(w.get(), foreign_region.get(), a_base, 64, access::remote_read),         // another domain's region
  };
  {
    tp::work_request with_sge = bind_wr(w.get(), p.target.get(), base, 64, access::remote_read);
    tp::sge s = p.target->slice(0, 8);
    with_sge.sg_list = {&s, 1};
    tp::work_request inl = bind_wr(w.get(), p.target.get(), base, 64, access::remote_read);
    inl.inline_data = true;
    for (const auto& wr : {with_sge, inl}) {
      std::size_t at = 99;
      CHECK(p.b.qp->post_send({&wr, 1}, &at) == anydoor::errc::invalid_argument);
      CHECK(at == 0);
    }
  }
  for (std::size_t i = 0; i < bad.size(); ++i) {
    CAPTURE(i);
    // Second in a batch of two: all or nothing, and the index is reported.
    const tp::work_request good = bind_wr(w.get(), p.target.get(), base, 64, access::remote_read);
    const tp::work_request batch[] = {good, bad[i]};
    std::size_t at = 99;
    CHECK(p.b.qp->post_send(batch, &at) == anydoor::errc::invalid_argument);
    CHECK(at == 1);
  }
  CHECK_FALSE(w->bound());
  CHECK(p.drv.settle(p.b.cq.get(), 20ms).empty());
  // The queue pair is unharmed: a good bind works, and a second bind of the
  // same window is refused (a window is bound once).
  p.bind(*w, access::remote_read);
  const tp::work_request again = bind_wr(w.get(), p.target.get(), base, 64, access::remote_read);
  CHECK(p.b.qp->post_send({&again, 1}) == anydoor::errc::invalid_argument);
  CHECK(p.b.qp->state() == tp::qp_state::rts);
}

TEST_CASE("memory windows: a bind completes in order with the requests around it", "[conformance]") {
  two_peers p;
  if (!device_has_windows(*p.b.dev)) return;
  // b writes into a's memory, binds (unsignaled and signaled), writes again:
  // completions come in posting order and the unsignaled bind still takes effect.
  std::vector<std::uint8_t> dst(64, 0);
  auto dmr = p.a.pd->register_memory(dst.data(), dst.size(), access::local_write | access::remote_write);
  auto bsrc = p.b.pd->register_memory(p.src.data(), p.src.size(), access::none);
  auto w1 = p.b.pd->alloc_window();
  auto w2 = p.b.pd->alloc_window();
  tp::sge s = bsrc->slice(0, 32);
  const auto daddr = reinterpret_cast<std::uint64_t>(dst.data());
  std::vector<tp::work_request> wrs(4);
  wrs[0] = {.wr_id = 1, .op = tp::opcode::write, .sg_list = {&s, 1}, .remote_addr = daddr, .rkey = dmr->rkey()};
  wrs[1] = {.wr_id = 2, .op = tp::opcode::bind_window, .signaled = false};
  wrs[1].bind = {w1.get(), p.target.get(), p.taddr(0), 64, access::remote_read};
  wrs[2] = {.wr_id = 3, .op = tp::opcode::bind_window};
  wrs[2].bind = {w2.get(), p.target.get(), p.taddr(two_peers::kWinOff), 64, access::remote_write};
  wrs[3] = {.wr_id = 4, .op = tp::opcode::write, .sg_list = {&s, 1}, .remote_addr = daddr + 32, .rkey = dmr->rkey()};
  REQUIRE_FALSE(p.b.qp->post_send(wrs));
  CHECK(w1->bound());
  CHECK(w2->bound());
  const auto done = p.drv.wait(p.b.cq.get(), 3);
  REQUIRE(done.size() == 3);
  CHECK(done[0].wr_id == 1);
  CHECK(done[0].opcode == tp::wc_opcode::write);
  CHECK(done[1].wr_id == 3);
  CHECK(done[1].opcode == tp::wc_opcode::bind_window);
  CHECK(done[2].wr_id == 4);
  for (const auto& c : done) CHECK(c.status == tp::wc_status::success);
  CHECK(std::all_of(dst.begin(), dst.end(), [](auto b) { return b == 0x3c; }));
  // Both windows work for a.
  std::memset(p.mem.data() + two_peers::kGuard, 0x61, 8);
  tp::sge rsg = p.result_mr->slice(0, 8);
  tp::work_request rd{.wr_id = 5, .op = tp::opcode::read, .sg_list = {&rsg, 1}, .remote_addr = p.taddr(0),
                      .rkey = w1->rkey()};
  REQUIRE_FALSE(p.a.qp->post_send({&rd, 1}));
  CHECK(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
  CHECK(p.result == 0x6161616161616161ull);
  tp::work_request wr = p.write_wr(6, w2->rkey(), p.taddr(two_peers::kWinOff));
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  CHECK(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
  CHECK(p.untouched_outside(0, two_peers::kWinOff + 16));
}

TEST_CASE("memory windows: a bind posted in error flushes", "[conformance]") {
  two_peers p;
  if (!device_has_windows(*p.b.dev)) return;
  auto w = p.b.pd->alloc_window();
  REQUIRE_FALSE(p.b.qp->modify(tp::qp_state::error));
  tp::work_request wr{.wr_id = 11, .op = tp::opcode::bind_window};
  wr.bind = {w.get(), p.target.get(), p.taddr(), 64, access::remote_read};
  REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
  const tp::completion c1 = p.drv.wait_one(p.b.cq.get());
  CHECK(c1.status == tp::wc_status::work_request_flushed);
  CHECK(c1.opcode == tp::wc_opcode::bind_window);
  CHECK(c1.wr_id == 11);
}

TEST_CASE("memory windows: a device without them says so", "[conformance]") {
  endpoint e;
  if (e.dev->caps().memory_windows) {
    CHECK(e.pd->alloc_window() != nullptr);
    return;
  }
  CHECK_THROWS_WITH(e.pd->alloc_window(), Catch::Contains("memory windows"));
}

TEST_CASE("memory windows: a bind behind a send the peer turned back (RNR) waits for its resend", "[conformance]") {
  // a sends to b, which has no receive posted yet: RNR NAK, then a resend
  // once b posts one. The bind queued behind the send completes after it,
  // and the send is delivered (not skipped), then later sends still flow.
  connected_pair p({.rnr_retry = 7, .min_rnr_timer_us = 1000});
  if (!device_has_windows(*p.a.dev)) return;
  // Observed on rxe (Linux 6.1): with a bind queued behind a send that is
  // being RNR-retried, neither completes within 10 s after the receive is
  // posted (the same send alone recovers). The runtime never meets this (its
  // credits keep a receive posted for every send: zero RNR), so on rxe the
  // case is skipped, with this warning, rather than passed.
  if (p.a.dev->provider() == "verbs" && p.a.dev->name().rfind("rxe", 0) == 0) {
    // (A hostile peer withholding receives could stall only its own
    // connection this way, which it can do anyway.)
    WARN("skipped on " << p.a.dev->name() << ": rxe stalls a send queue holding a bind behind an RNR-retried send");
    return;
  }
  std::vector<std::uint8_t> mem(256, 0x11);
  auto mr = p.a.pd->register_memory(mem.data(), mem.size(), access::local_write | access::mw_bind);
  std::vector<std::uint8_t> in(64, 0);
  auto imr = p.b.pd->register_memory(in.data(), in.size(), access::local_write);
  auto w = p.a.pd->alloc_window();
  tp::sge s = mr->slice(0, 16);
  std::vector<tp::work_request> wrs(2);
  wrs[0] = send_wr(60, {&s, 1});
  wrs[1] = {.wr_id = 61, .op = tp::opcode::bind_window};
  wrs[1].bind = {w.get(), mr.get(), reinterpret_cast<std::uint64_t>(mem.data()), 64, access::remote_read};
  REQUIRE_FALSE(p.a.qp->post_send(wrs));
  // Nothing completes while b has no receive (the send is retried).
  CHECK(p.drv.settle(p.a.cq.get(), 50ms).empty());
  if (testing_tcp()) CHECK(p.a.qp->counters().rnr_naks_received > 0);  // verbs counts per port only
  tp::sge rs = imr->slice(0, 32);
  tp::recv_request rr[] = {{.wr_id = 70, .sg_list = {&rs, 1}}};
  REQUIRE_FALSE(p.b.qp->post_recv(rr));
  const auto done = p.drv.wait(p.a.cq.get(), 2);
  REQUIRE(done.size() == 2);
  CHECK(done[0].wr_id == 60);
  CHECK(done[0].status == tp::wc_status::success);
  CHECK(done[1].wr_id == 61);
  CHECK(done[1].status == tp::wc_status::success);
  const tp::completion got = p.drv.wait_one(p.b.cq.get());
  CHECK(got.wr_id == 70);
  CHECK(got.status == tp::wc_status::success);
  CHECK(got.byte_len == 16);
  CHECK(in[0] == 0x11);
  // The queue pair goes on: another send arrives.
  tp::sge rs2 = imr->slice(32, 32);
  tp::recv_request rr2[] = {{.wr_id = 71, .sg_list = {&rs2, 1}}};
  REQUIRE_FALSE(p.b.qp->post_recv(rr2));
  const tp::work_request again = send_wr(62, {&s, 1});
  REQUIRE_FALSE(p.a.qp->post_send({&again, 1}));
  CHECK(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
  CHECK(p.drv.wait_one(p.b.cq.get()).wr_id == 71);
}
