// Provider conformance: copied memory (protection_domain::register_copied),
// how a software NIC reaches GPU device memory: every byte of it moves
// through the caller's copier. Here host memory stands in for the GPU
// (support/fake_device_memory.hpp): the registered address is mapped
// PROT_NONE, so a provider that loads or stores it directly crashes the
// test. A device without copied memory (verbs: a NIC reaches GPU memory
// directly or not at all) says so (caps().copied_memory) and refuses it
// with not_supported.
#include "../support/fake_device_memory.hpp"
#include "../support/harness.hpp"

#include <algorithm>
#include <cstring>
#include <memory>

using namespace anydoor::test;
using tp::access;

namespace {

constexpr std::size_t kDeviceSize = 4 << 20;

bool device_has_copied(const tp::device& d) {
  if (d.caps().copied_memory) return true;
  if (d.provider() == "tcp") FAIL("the tcp device reports no copied memory");
  WARN("skipped: " << d.provider() << " device " << d.name()
                   << " has no copied memory (its refusal is checked in the case before)");
  return false;
}

void fill(std::byte* p, std::size_t n, unsigned seed) {
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>((i * 131 + seed) >> 3);
}

}  // namespace

TEST_CASE("copied memory: bad arguments are refused, atomics need direct access, and a device without it says "
          "not_supported",
          "[conformance]") {
  one_qp e;
  fake_device_memory m(1 << 20);
  auto copier = std::make_shared<fake_copier>(m);
  constexpr auto rw = access::local_write | access::remote_read | access::remote_write;
  if (!e.dev->caps().copied_memory) {
    if (e.dev->provider() == "tcp") FAIL("the tcp device reports no copied memory");
    CHECK(thrown([&] { e.pd->register_copied(m.dev(), 4096, rw, copier); }) == anydoor::errc::not_supported);
    WARN(e.dev->provider() << " device " << e.dev->name() << " has no copied memory: refused with not_supported");
    return;
  }
  CHECK(thrown([&] { e.pd->register_copied(nullptr, 4096, rw, copier); }) == anydoor::errc::invalid_argument);
  CHECK(thrown([&] { e.pd->register_copied(m.dev(), 0, rw, copier); }) == anydoor::errc::invalid_argument);
  CHECK(thrown([&] { e.pd->register_copied(m.dev(), 4096, rw, nullptr); }) == anydoor::errc::invalid_argument);
  CHECK(thrown([&] { e.pd->register_copied(m.dev(), 4096, access::remote_write, copier); }) ==
        anydoor::errc::invalid_argument);  // remote write needs local write
  CHECK(thrown([&] { e.pd->register_copied(reinterpret_cast<void*>(~std::uintptr_t{0} - 100), 4096, rw, copier); }) ==
        anydoor::errc::invalid_argument);
  CHECK(thrown([&] { e.pd->register_copied(m.dev(), 4096, rw | access::remote_atomic, copier); }) ==
        anydoor::errc::not_supported);
  auto mr = e.pd->register_copied(m.dev(), 4096, rw, copier);
  CHECK(mr->addr() == m.dev());
  CHECK(mr->length() == 4096);
  CHECK(mr->access() == rw);
  mr.reset();
  CHECK(copier.use_count() == 1);  // the region let go of its copier
}

TEST_CASE("copied memory: sends, receives, writes and reads move its bytes only through the copier", "[conformance]") {
  fake_device_memory m(kDeviceSize);
  auto copier = std::make_shared<fake_copier>(m);
  connected_pair p;  // a holds the copied registration; b is its peer with host memory
  if (!device_has_copied(*p.a.dev)) return;
  constexpr auto rights = access::local_write | access::remote_read | access::remote_write;
  auto mr = p.a.pd->register_copied(m.dev(), kDeviceSize, rights, copier);
  std::vector<std::byte> host(kDeviceSize);
  auto hmr = p.b.pd->register_memory(host.data(), host.size(), rights);
  std::vector<std::byte> a_host(kDeviceSize);  // a's own host memory, for its reads into b
  auto amr = p.a.pd->register_memory(a_host.data(), a_host.size(), rights);

  // 1 B, 4 KiB, and 1 MiB + 3 (several bounce pieces, odd offsets).
  const std::size_t size = GENERATE(std::size_t{1}, std::size_t{4096}, std::size_t{(1 << 20) + 3});
  INFO(size << " bytes");
  constexpr std::size_t kOff = 5;  // within the device memory
  const auto dev = reinterpret_cast<std::uint64_t>(m.dev());
  auto n32 = static_cast<std::uint32_t>(size);

  // b writes host -> a's copied memory.
  fill(host.data(), size, 1);
  tp::sge sg = hmr->slice(0, n32);
  tp::work_request wr{.wr_id = 1, .op = tp::opcode::write, .sg_list = {&sg, 1}, .remote_addr = dev + kOff,
                      .rkey = mr->rkey()};
  REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::success);
  CHECK(std::memcmp(m.view() + kOff, host.data(), size) == 0);

  // b reads a's copied memory -> host.
  fill(m.view() + 2 * kOff, size, 2);
  sg = hmr->slice(1, n32);
  wr = {.wr_id = 2, .op = tp::opcode::read, .sg_list = {&sg, 1}, .remote_addr = dev + 2 * kOff, .rkey = mr->rkey()};
  REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::success);
  CHECK(std::memcmp(host.data() + 1, m.view() + 2 * kOff, size) == 0);

  // a sends from copied memory; b receives into host memory.
  fill(m.view() + 3 * kOff, size, 3);
  tp::sge rsg = hmr->slice(7, n32);
  tp::recv_request rr{.wr_id = 3, .sg_list = {&rsg, 1}};
  REQUIRE_FALSE(p.b.qp->post_recv({&rr, 1}));
  tp::sge ssg = mr->slice(3 * kOff, n32);
  wr = send_wr(4, {&ssg, 1});
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
  auto rc = p.drv.wait_one(p.b.cq.get());
  REQUIRE(rc.status == tp::wc_status::success);
  CHECK(rc.byte_len == size);
  CHECK(std::memcmp(host.data() + 7, m.view() + 3 * kOff, size) == 0);

  // b sends host memory; a receives into copied memory.
  fill(host.data(), size, 4);
  tp::sge asg = mr->slice(4 * kOff, n32);
  rr = {.wr_id = 5, .sg_list = {&asg, 1}};
  REQUIRE_FALSE(p.a.qp->post_recv({&rr, 1}));
  sg = hmr->slice(0, n32);
  wr = send_wr(6, {&sg, 1});
  REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::success);
  rc = p.drv.wait_one(p.a.cq.get());
  REQUIRE(rc.status == tp::wc_status::success);
  CHECK(rc.byte_len == size);
  CHECK(std::memcmp(m.view() + 4 * kOff, host.data(), size) == 0);

  // a writes from copied memory into b, with a host piece in the same
  // gather list, and reads b's memory into copied memory.
  fill(m.view() + 5 * kOff, size, 5);
  fill(a_host.data(), 100, 6);
  tp::sge gather[2] = {mr->slice(5 * kOff, n32), amr->slice(0, 100)};
  wr = {.wr_id = 7, .op = tp::opcode::write, .sg_list = {gather, 2}, .remote_addr = reinterpret_cast<std::uint64_t>(host.data()) + 11,
        .rkey = hmr->rkey()};
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
  CHECK(std::memcmp(host.data() + 11, m.view() + 5 * kOff, size) == 0);
  CHECK(std::memcmp(host.data() + 11 + size, a_host.data(), 100) == 0);
  fill(host.data(), size, 7);
  tp::sge dsg = mr->slice(6 * kOff, n32);
  wr = {.wr_id = 8, .op = tp::opcode::read, .sg_list = {&dsg, 1}, .remote_addr = reinterpret_cast<std::uint64_t>(host.data()),
        .rkey = hmr->rkey()};
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
  CHECK(std::memcmp(m.view() + 6 * kOff, host.data(), size) == 0);

  CHECK_FALSE(copier->bad_range);
  // Every byte crossed once: b's write, b's send and a's read into it; b's
  // read, a's send and a's write out of it (a sendmsg that sends part of a
  // piece, or none of it, does not copy it again).
  CHECK(copier->to_device_bytes == 3 * size);
  CHECK(copier->to_host_bytes == 3 * size);
}

TEST_CASE("copied memory: large transfers move in few large copies, each byte once, through the copier's bounce "
          "buffers", "[conformance]") {
  fake_device_memory m(kDeviceSize);
  auto copier = std::make_shared<fake_copier>(m);
  // Started copies happen only when waited for (junk until then): bytes
  // used before their copy is waited for show.
  copier->defer_copies = true;
  connected_pair p;
  if (!device_has_copied(*p.a.dev)) return;
  constexpr auto rights = access::local_write | access::remote_read | access::remote_write;
  auto mr = p.a.pd->register_copied(m.dev(), kDeviceSize, rights, copier);
  std::vector<std::byte> host(kDeviceSize);
  auto hmr = p.b.pd->register_memory(host.data(), host.size(), rights);
  const auto dev = reinterpret_cast<std::uint64_t>(m.dev());
  // (a copy per 64 KiB, the staging buffer's size, would be 48 and more)
  constexpr std::size_t kBig = (3 << 20) + 5, kMaxCopies = 12;
  auto copies = [&](bool to_host, std::size_t most) {
    std::size_t n = 0, bytes = 0;
    for (const auto& c : copier->log()) {
      if (c.to_host != to_host) continue;
      ++n;
      bytes += c.length;
    }
    INFO((to_host ? "out of" : "into") << " copied memory: " << n << " copies, " << bytes << " bytes");
    CHECK(n <= most);
    return bytes;
  };

  // b writes host memory into a's copied memory, at an odd offset.
  fill(host.data(), kBig, 21);
  tp::sge sg = hmr->slice(0, static_cast<std::uint32_t>(kBig));
  tp::work_request wr{.wr_id = 1, .op = tp::opcode::write, .sg_list = {&sg, 1}, .remote_addr = dev + 3,
                      .rkey = mr->rkey()};
  REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::success);
  CHECK(std::memcmp(m.view() + 3, host.data(), kBig) == 0);
  CHECK(copies(false, kMaxCopies) == kBig);
  copier->clear_log();

  // a receives a message into two pieces of copied memory (two segments,
  // each contiguous): the bytes of each land in place.
  fill(host.data(), kBig, 22);
  constexpr std::size_t kFirst = (2 << 20) + 7;
  tp::sge rsg[2] = {mr->slice(11, static_cast<std::uint32_t>(kFirst)),
                    mr->slice(kFirst + 100, static_cast<std::uint32_t>(kBig - kFirst))};
  tp::recv_request rr{.wr_id = 2, .sg_list = {rsg, 2}};
  REQUIRE_FALSE(p.a.qp->post_recv({&rr, 1}));
  wr = send_wr(3, {&sg, 1});
  REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::success);
  auto rc = p.drv.wait_one(p.a.cq.get());
  REQUIRE(rc.status == tp::wc_status::success);
  CHECK(rc.byte_len == kBig);
  CHECK(std::memcmp(m.view() + 11, host.data(), kFirst) == 0);
  CHECK(std::memcmp(m.view() + kFirst + 100, host.data() + kFirst, kBig - kFirst) == 0);
  // Between the two pieces: still the first write's bytes (from host
  // byte kFirst + 8 on, at offset 3).
  {
    std::vector<std::byte> first(kBig);
    fill(first.data(), kBig, 21);
    CHECK(std::memcmp(m.view() + 11 + kFirst, first.data() + 8 + kFirst, 89) == 0);
  }
  CHECK(copies(false, kMaxCopies) == kBig);
  copier->clear_log();

  // A message scattered over copied, host and copied memory, and a write
  // of exactly 1 MiB.
  fill(host.data(), kBig, 24);
  std::vector<std::byte> mid(200 << 10);
  auto midmr = p.a.pd->register_memory(mid.data(), mid.size(), access::local_write);
  constexpr std::size_t kA = 300 << 10, kB = 200 << 10, kC = kBig - kA - kB;
  tp::sge msg[3] = {mr->slice(0, kA), midmr->slice(0, kB), mr->slice(kA + 64, static_cast<std::uint32_t>(kC))};
  rr = {.wr_id = 5, .sg_list = {msg, 3}};
  REQUIRE_FALSE(p.a.qp->post_recv({&rr, 1}));
  wr = send_wr(6, {&sg, 1});
  REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::success);
  rc = p.drv.wait_one(p.a.cq.get());
  REQUIRE(rc.status == tp::wc_status::success);
  CHECK(std::memcmp(m.view(), host.data(), kA) == 0);
  CHECK(std::memcmp(mid.data(), host.data() + kA, kB) == 0);
  CHECK(std::memcmp(m.view() + kA + 64, host.data() + kA + kB, kC) == 0);
  CHECK(copies(false, kMaxCopies) == kA + kC);
  copier->clear_log();
  fill(host.data(), 1 << 20, 25);
  tp::sge one = hmr->slice(0, 1 << 20);
  wr = {.wr_id = 7, .op = tp::opcode::write, .sg_list = {&one, 1}, .remote_addr = dev + 4096, .rkey = mr->rkey()};
  REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::success);
  CHECK(std::memcmp(m.view() + 4096, host.data(), 1 << 20) == 0);
  CHECK(copies(false, kMaxCopies) == 1 << 20);
  copier->clear_log();

  // a reads b's memory into copied memory (tcp: the response comes in
  // 256 KiB frames, each copied into place as it ends; 64 KiB copies
  // would be 48 and more).
  fill(host.data(), kBig, 26);
  tp::sge rd = mr->slice(7, static_cast<std::uint32_t>(kBig));
  wr = {.wr_id = 8, .op = tp::opcode::read, .sg_list = {&rd, 1},
        .remote_addr = reinterpret_cast<std::uint64_t>(host.data()), .rkey = hmr->rkey()};
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
  CHECK(std::memcmp(m.view() + 7, host.data(), kBig) == 0);
  CHECK(copies(false, 2 * kMaxCopies) == kBig);
  copier->clear_log();

  // a writes from copied memory into b.
  fill(m.view() + 1, kBig, 23);
  tp::sge asg = mr->slice(1, static_cast<std::uint32_t>(kBig));
  wr = {.wr_id = 9, .op = tp::opcode::write, .sg_list = {&asg, 1},
        .remote_addr = reinterpret_cast<std::uint64_t>(host.data()), .rkey = hmr->rkey()};
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
  CHECK(std::memcmp(host.data(), m.view() + 1, kBig) == 0);
  CHECK(copies(true, kMaxCopies) == kBig);
  // tcp: two bounce buffers each way for a's queue pair, kept between
  // transfers (b's host memory needs none); copies were started ahead
  // (overlapping the network), and every one was waited for.
  if (p.a.dev->provider() == "tcp") {
    CHECK(copier->bounce_buffers == 4);
    CHECK(copier->started_to_host > 2);
    CHECK(copier->started_to_device > 2);
  }
  CHECK(copier->finishes >= copier->started);
  CHECK_FALSE(copier->bad_range);
}

TEST_CASE("copied memory: a copy that fails fails the operation, never sends or leaves wrong bytes as success",
          "[conformance]") {
  fake_device_memory m(2 << 20);
  auto copier = std::make_shared<fake_copier>(m);
  connected_pair p;
  if (!device_has_copied(*p.a.dev)) return;
  constexpr auto rights = access::local_write | access::remote_read | access::remote_write;
  auto mr = p.a.pd->register_copied(m.dev(), m.size(), rights, copier);
  std::vector<std::byte> host(2 << 20);
  auto hmr = p.b.pd->register_memory(host.data(), host.size(), rights);
  const auto dev = reinterpret_cast<std::uint64_t>(m.dev());
  copier->fail_after = 0;

  SECTION("a write from copied memory: the requester's completion is an error") {
    tp::sge sg = mr->slice(0, 65536);
    tp::work_request wr{.wr_id = 1, .op = tp::opcode::write, .sg_list = {&sg, 1},
                        .remote_addr = reinterpret_cast<std::uint64_t>(host.data()), .rkey = hmr->rkey()};
    REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
    CHECK(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::local_protection_error);
  }
  SECTION("a peer's read of copied memory: the peer's read fails with a remote access error") {
    tp::sge sg = hmr->slice(0, 65536);
    tp::work_request wr{.wr_id = 2, .op = tp::opcode::read, .sg_list = {&sg, 1}, .remote_addr = dev, .rkey = mr->rkey()};
    REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
    CHECK(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::remote_access_error);
  }
  SECTION("a peer's write into copied memory: the write fails, not acknowledged as done") {
    // The larger goes through the bounce buffer, and its second copy,
    // which fails, is one of the bounce's (the first may be of bytes that
    // came with the header, or the bounce's first MiB).
    const std::uint32_t len = GENERATE(65536u, 2u << 20);
    if (len > 65536) copier->fail_after = 1;
    tp::sge sg = hmr->slice(0, len);
    tp::work_request wr{.wr_id = 3, .op = tp::opcode::write, .sg_list = {&sg, 1}, .remote_addr = dev, .rkey = mr->rkey()};
    REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
    CHECK(p.drv.wait_one(p.b.cq.get()).status != tp::wc_status::success);
    const auto log = copier->log();
    if (len > 65536 && p.a.dev->provider() == "tcp") {
      REQUIRE(log.size() >= 2);
      CHECK(log[1].length > 65536);  // the bounce's, not a staging buffer's
    }
  }
  SECTION("a peer's write into copied memory whose copy fails where it is waited for: the write fails") {
    copier->fail_after = 1;
    copier->fail_once = true;  // (only the started copy fails: its report alone fails the write)
    copier->defer_failures = true;
    tp::sge sg = hmr->slice(0, 2u << 20);
    tp::work_request wr{.wr_id = 4, .op = tp::opcode::write, .sg_list = {&sg, 1}, .remote_addr = dev, .rkey = mr->rkey()};
    REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
    CHECK(p.drv.wait_one(p.b.cq.get()).status != tp::wc_status::success);
    if (p.a.dev->provider() == "tcp") CHECK(copier->started > 0);
    CHECK_FALSE(copier->pending_failure);  // (finish() reported it)
  }
  SECTION("a write from copied memory whose copy ahead fails once: copied again, the bytes arrive right") {
    copier->fail_after = 1;
    copier->fail_once = true;
    copier->defer_failures = true;
    fill(m.view(), 2 << 20, 9);
    tp::sge sg = mr->slice(0, 2u << 20);
    tp::work_request wr{.wr_id = 5, .op = tp::opcode::write, .sg_list = {&sg, 1},
                        .remote_addr = reinterpret_cast<std::uint64_t>(host.data()), .rkey = hmr->rkey()};
    REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
    CHECK(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
    CHECK(std::memcmp(host.data(), m.view(), 2 << 20) == 0);
    if (p.a.dev->provider() == "tcp") CHECK(copier->started > 0);
    CHECK_FALSE(copier->pending_failure);
  }
  CHECK(copier->copies > 0);
}

TEST_CASE("copied memory: atomics on it are refused, an atomic's result lands in it, a window on it reads it", "[conformance]") {
  fake_device_memory m(1 << 16);
  auto copier = std::make_shared<fake_copier>(m);
  connected_pair p;
  if (!device_has_copied(*p.a.dev)) return;
  if (!p.a.dev->caps().atomics) {
    WARN("skipped: " << p.a.dev->name() << " has no atomics");
    return;
  }
  // a's atomic on b's host word returns into a's copied memory.
  auto mr = p.a.pd->register_copied(m.dev(), m.size(), access::local_write | access::mw_bind, copier);
  std::uint64_t word = 40;
  auto wmr = p.b.pd->register_memory(&word, 8, access::local_write | access::remote_atomic);
  tp::sge sg = mr->slice(64, 8);
  tp::work_request wr{.wr_id = 1, .op = tp::opcode::fetch_add, .sg_list = {&sg, 1},
                      .remote_addr = reinterpret_cast<std::uint64_t>(&word), .rkey = wmr->rkey(), .compare_add = 2};
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
  std::uint64_t old = 0;
  std::memcpy(&old, m.view() + 64, 8);
  CHECK(old == 40);
  CHECK(word == 42);
  // A window that grants atomics on copied memory: the peer's atomic
  // through it fails with a remote access error.
  if (!p.a.dev->caps().memory_windows) return;
  auto w = p.a.pd->alloc_window();
  tp::work_request bw{.wr_id = 2, .op = tp::opcode::bind_window};
  bw.bind = {w.get(), mr.get(), reinterpret_cast<std::uint64_t>(m.dev()), 4096,
             access::remote_atomic | access::remote_read};
  REQUIRE_FALSE(p.a.qp->post_send({&bw, 1}));
  REQUIRE(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
  // A read through the window reaches the copied bytes (through the copier).
  std::memset(m.view() + 512, 0x6b, 256);
  std::vector<std::byte> got(256);
  auto gmr = p.b.pd->register_memory(got.data(), got.size(), access::local_write);
  tp::sge gsg = gmr->slice(0, 256);
  tp::work_request rd{.wr_id = 4, .op = tp::opcode::read, .sg_list = {&gsg, 1},
                      .remote_addr = reinterpret_cast<std::uint64_t>(m.dev()) + 512, .rkey = w->rkey()};
  REQUIRE_FALSE(p.b.qp->post_send({&rd, 1}));
  REQUIRE(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::success);
  CHECK(std::all_of(got.begin(), got.end(), [](std::byte x) { return x == std::byte{0x6b}; }));
  std::uint64_t res = 0;
  auto rmr = p.b.pd->register_memory(&res, 8, access::local_write);
  sg = rmr->slice(0, 8);
  wr = {.wr_id = 3, .op = tp::opcode::fetch_add, .sg_list = {&sg, 1},
        .remote_addr = reinterpret_cast<std::uint64_t>(m.dev()) + 128, .rkey = w->rkey(), .compare_add = 1};
  REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
  CHECK(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::remote_access_error);
  w.reset();
}

TEST_CASE("copied memory: a send the peer does not take yet copies each byte once, however often it is retried",
          "[conformance]") {
  // More than loopback's socket buffers take (several MiB each way).
  constexpr std::size_t kSize = 64 << 20;
  fake_device_memory m(kSize);
  auto copier = std::make_shared<fake_copier>(m);
  connected_pair p;
  if (!device_has_copied(*p.a.dev)) return;
  auto mr = p.a.pd->register_copied(m.dev(), kSize, access::local_write, copier);
  std::vector<std::byte> host(kSize);
  auto hmr = p.b.pd->register_memory(host.data(), host.size(), access::local_write | access::remote_write);
  fill(m.view(), kSize, 11);
  tp::sge sg = mr->slice(0, static_cast<std::uint32_t>(kSize));
  tp::work_request wr{.wr_id = 1, .op = tp::opcode::write, .sg_list = {&sg, 1},
                      .remote_addr = reinterpret_cast<std::uint64_t>(host.data()), .rkey = hmr->rkey()};
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  // Only a progresses (b's side is not polled: its socket fills, a's
  // sendmsg finds no room): every poll retries the piece in the bounce.
  const auto until = std::chrono::steady_clock::now() + 300ms;
  while (std::chrono::steady_clock::now() < until) {
    tp::completion c[4];
    std::error_code ec;
    (void)p.a.cq->poll(c, ec);
  }
  INFO("copied out while stalled: " << copier->to_host_bytes.load());
  CHECK(copier->to_host_bytes < kSize);  // (re-copying each retry would pass this in a few ms)
  REQUIRE(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
  CHECK(std::memcmp(host.data(), m.view(), kSize) == 0);
  CHECK(copier->to_host_bytes == kSize);
}
