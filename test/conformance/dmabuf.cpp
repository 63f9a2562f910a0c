// Provider conformance: dma-buf registration (protection_domain::
// register_dmabuf, ibv_reg_dmabuf_mr). A registration of [offset, offset +
// length) of a buffer fd is addressed as [iova, iova + length): writes,
// reads, atomics, sends and receives through it reach the buffer's bytes
// at offset + (address - iova), nothing outside the range is reachable,
// and nothing is after deregistration. A device without dma-buf
// registration says so (caps().dmabuf) and refuses it with not_supported.
//
// The buffer: a udmabuf (a real dma-buf made from a memfd) where
// /dev/udmabuf exists, else the memfd itself, which the tcp provider maps
// the same way; a verbs device needs a real dma-buf, so without
// /dev/udmabuf its data-path case is skipped with a message. (The rxe
// guest's Debian 6.1 kernel has no CONFIG_UDMABUF, and rxe has no dma-buf
// registration: there the refusal is what is checked.)
#include "../support/harness.hpp"

#include <fcntl.h>
#include <linux/udmabuf.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>

using namespace anydoor::test;
using tp::access;

namespace {

constexpr std::size_t kBufferSize = 64 << 10;

// A memfd of kBufferSize bytes mapped for the test's own view, and the fd
// to register: a udmabuf of it when the host can make one.
struct test_buffer {
  int memfd = -1;
  int fd = -1;  // what register_dmabuf gets
  bool real_dmabuf = false;
  std::byte* view = nullptr;
  std::string kind;

  test_buffer() {
    memfd = ::memfd_create("anydoor-dmabuf-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    REQUIRE(memfd >= 0);
    REQUIRE(::ftruncate(memfd, kBufferSize) == 0);
    void* m = ::mmap(nullptr, kBufferSize, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    REQUIRE(m != MAP_FAILED);
    view = static_cast<std::byte*>(m);
    std::memset(view, 0xa5, kBufferSize);
    fd = memfd;
    kind = "a memfd (no /dev/udmabuf here)";
    const int dev = ::open("/dev/udmabuf", O_RDWR | O_CLOEXEC);
    if (dev >= 0) {
      // udmabuf wants a memfd that cannot shrink under it
      REQUIRE(::fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
      udmabuf_create c{};
      c.memfd = static_cast<__u32>(memfd);
      c.flags = UDMABUF_FLAGS_CLOEXEC;
      c.offset = 0;
      c.size = kBufferSize;
      const int d = ::ioctl(dev, UDMABUF_CREATE, &c);
      ::close(dev);
      REQUIRE(d >= 0);
      fd = d;
      real_dmabuf = true;
      kind = "a udmabuf";
    }
  }
  ~test_buffer() {
    if (fd >= 0 && fd != memfd) ::close(fd);
    if (memfd >= 0) ::close(memfd);
    if (view != nullptr) ::munmap(view, kBufferSize);
  }
  test_buffer(const test_buffer&) = delete;
  test_buffer& operator=(const test_buffer&) = delete;
  // Closes the registered fd (a registration keeps its own reference).
  void close_fd() {
    if (fd != memfd) ::close(fd);
    fd = -1;
  }
  bool filled_except(std::size_t off, std::size_t len) const {
    for (std::size_t i = 0; i < kBufferSize; ++i) {
      if ((i < off || i >= off + len) && view[i] != std::byte{0xa5}) return false;
    }
    return true;
  }
};

bool device_has_dmabuf(const tp::device& d) {
  if (d.caps().dmabuf) return true;
  if (d.provider() == "tcp") FAIL("the tcp device reports no dma-buf registration");
  WARN("skipped: " << d.provider() << " device " << d.name()
                   << " has no dma-buf registration (its refusal is checked in the case before)");
  return false;
}

}  // namespace

TEST_CASE("dma-buf registration: bad arguments are refused, and a device without it says not_supported",
          "[conformance]") {
  one_qp e;
  test_buffer buf;
  constexpr auto rw = access::local_write | access::remote_read | access::remote_write;
  // Argument checks come first, on every device.
  CHECK(thrown([&] { e.pd->register_dmabuf(-1, 0, 4096, 0, rw); }) == anydoor::errc::invalid_argument);
  CHECK(thrown([&] { e.pd->register_dmabuf(buf.fd, 0, 0, 0, rw); }) == anydoor::errc::invalid_argument);
  CHECK(thrown([&] { e.pd->register_dmabuf(buf.fd, ~std::uint64_t{0} - 100, 4096, 0, rw); }) ==
        anydoor::errc::invalid_argument);
  CHECK(thrown([&] { e.pd->register_dmabuf(buf.fd, 0, 4096, ~std::uint64_t{0} - 100, rw); }) ==
        anydoor::errc::invalid_argument);
  CHECK(thrown([&] { e.pd->register_dmabuf(buf.fd, 0, 4096, 0, access::remote_write); }) ==
        anydoor::errc::invalid_argument);  // remote write needs local write
  CHECK(thrown([&] { e.pd->register_dmabuf(buf.fd, 0, 4096, 0, static_cast<tp::access>(1u << 20)); }) ==
        anydoor::errc::invalid_argument);
  // iova and offset at different places in their pages (an aligned iova
  // would be a misaligned byte).
  CHECK(thrown([&] { e.pd->register_dmabuf(buf.fd, 4096 + 4, 4096, 0x10000, rw); }) ==
        anydoor::errc::invalid_argument);
  if (!e.dev->caps().dmabuf) {
    if (e.dev->provider() == "tcp") FAIL("the tcp device reports no dma-buf registration");
    CHECK(thrown([&] { e.pd->register_dmabuf(buf.fd, 0, 4096, 0, rw); }) == anydoor::errc::not_supported);
    WARN(e.dev->provider() << " device " << e.dev->name() << " has no dma-buf registration: refused with "
                           << "not_supported, as it says");
    return;
  }
  // Past the buffer's end.
  CHECK(thrown([&] { e.pd->register_dmabuf(buf.fd, kBufferSize - 4096, 8192, 0, rw); }) ==
        anydoor::errc::invalid_argument);
  CHECK(thrown([&] { e.pd->register_dmabuf(buf.fd, kBufferSize + 4096, 4096, 0, rw); }) ==
        anydoor::errc::invalid_argument);
  // A file that is no dma-buf, opened read-only and registered for writing:
  // no device takes it.
  char path[] = "/tmp/anydoor-dmabuf-XXXXXX";
  const int tmp = ::mkstemp(path);
  REQUIRE(tmp >= 0);
  REQUIRE(::ftruncate(tmp, 8192) == 0);
  const int ro = ::open(path, O_RDONLY | O_CLOEXEC);
  ::close(tmp);
  ::unlink(path);
  REQUIRE(ro >= 0);
  CHECK(thrown([&] { e.pd->register_dmabuf(ro, 0, 4096, 0, rw); }) == anydoor::errc::registration_failed);
  ::close(ro);
  // A closed fd.
  const int gone = ::dup(buf.memfd);
  ::close(gone);
  CHECK(thrown([&] { e.pd->register_dmabuf(gone, 0, 4096, 0, rw); }) == anydoor::errc::registration_failed);
  // And one that is right.
  auto mr = e.pd->register_dmabuf(buf.fd, 4096, 4096, 0x1000, rw);
  CHECK(mr->addr() == reinterpret_cast<void*>(std::uintptr_t{0x1000}));
  CHECK(mr->length() == 4096);
  CHECK(mr->access() == rw);
}

TEST_CASE("dma-buf registration: writes, reads, atomics, sends and receives reach the buffer at iova - "
          "nothing outside the range or after deregistration",
          "[conformance]") {
  test_buffer buf;
  connected_pair p;  // a holds the dma-buf registration; b is its peer with plain memory
  if (!device_has_dmabuf(*p.a.dev)) return;
  if (!buf.real_dmabuf && !testing_tcp()) {
    WARN("skipped: " << p.a.dev->name() << " needs a real dma-buf and this host has no /dev/udmabuf");
    return;
  }
  INFO("the buffer is " << buf.kind);
  // Bytes [kOff, kOff + kLen) of the buffer, addressed from kIova: an
  // offset that is not page-aligned and an iova far from any mapping.
  constexpr std::size_t kOff = 4096 + 256, kLen = 32 << 10;
  constexpr std::uint64_t kIova = 0x5a5a00000000ull + 256;
  constexpr auto rights = access::local_write | access::remote_read | access::remote_write | access::remote_atomic;
  auto mr = p.a.pd->register_dmabuf(buf.fd, kOff, kLen, kIova, rights);
  buf.close_fd();  // the registration holds the buffer
  REQUIRE(reinterpret_cast<std::uint64_t>(mr->addr()) == kIova);

  std::vector<std::uint8_t> local(8192);
  std::iota(local.begin(), local.end(), std::uint8_t{7});
  auto lmr = p.b.pd->register_memory(local.data(), local.size(), access::local_write);

  // b writes 1000 bytes at iova + 500.
  tp::sge sg = lmr->slice(0, 1000);
  tp::work_request wr{.wr_id = 1, .op = tp::opcode::write, .sg_list = {&sg, 1}, .remote_addr = kIova + 500,
                      .rkey = mr->rkey()};
  REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::success);
  CHECK(std::memcmp(buf.view + kOff + 500, local.data(), 1000) == 0);
  CHECK(buf.filled_except(kOff + 500, 1000));

  // b reads 2000 bytes from iova + 9000, which the CPU wrote.
  for (std::size_t i = 0; i < 2000; ++i) buf.view[kOff + 9000 + i] = static_cast<std::byte>(i * 13);
  sg = lmr->slice(4096, 2000);
  wr = {.wr_id = 2, .op = tp::opcode::read, .sg_list = {&sg, 1}, .remote_addr = kIova + 9000, .rkey = mr->rkey()};
  REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::success);
  CHECK(std::memcmp(local.data() + 4096, buf.view + kOff + 9000, 2000) == 0);

  // An atomic on the word at iova + 16384 - 256 (8-byte aligned in iova).
  std::uint64_t word = 40;
  std::memcpy(buf.view + kOff + 16384 - 256, &word, 8);
  std::uint64_t old = 0;
  auto omr = p.b.pd->register_memory(&old, 8, access::local_write);
  sg = omr->slice(0, 8);
  wr = {.wr_id = 3, .op = tp::opcode::fetch_add, .sg_list = {&sg, 1}, .remote_addr = kIova + 16384 - 256,
        .rkey = mr->rkey(), .compare_add = 2};
  if (p.a.dev->caps().atomics) {
    REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
    REQUIRE(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::success);
    CHECK(old == 40);
    std::memcpy(&word, buf.view + kOff + 16384 - 256, 8);
    CHECK(word == 42);
  }

  // a sends 256 bytes from its dma-buf region (a local gather at iova + 3000)...
  std::vector<std::uint8_t> in(512, 0);
  auto imr = p.b.pd->register_memory(in.data(), in.size(), access::local_write);
  tp::sge rsg = imr->slice(0, 512);
  tp::recv_request rr{.wr_id = 4, .sg_list = {&rsg, 1}};
  REQUIRE_FALSE(p.b.qp->post_recv({&rr, 1}));
  for (std::size_t i = 0; i < 256; ++i) buf.view[kOff + 3000 + i] = static_cast<std::byte>(255 - i);
  tp::sge ssg = mr->slice(3000, 256);
  CHECK(ssg.addr == kIova + 3000);
  wr = send_wr(5, {&ssg, 1});
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
  auto rc = p.drv.wait_one(p.b.cq.get());
  REQUIRE(rc.status == tp::wc_status::success);
  CHECK(rc.byte_len == 256);
  CHECK(std::memcmp(in.data(), buf.view + kOff + 3000, 256) == 0);
  // ...and receives 300 into it at iova + 20000.
  tp::sge asg = mr->slice(20000, 300);
  rr = {.wr_id = 6, .sg_list = {&asg, 1}};
  REQUIRE_FALSE(p.a.qp->post_recv({&rr, 1}));
  tp::sge bsg = lmr->slice(100, 300);
  wr = send_wr(7, {&bsg, 1});
  REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::success);
  rc = p.drv.wait_one(p.a.cq.get());
  REQUIRE(rc.status == tp::wc_status::success);
  CHECK(rc.byte_len == 300);
  CHECK(std::memcmp(buf.view + kOff + 20000, local.data() + 100, 300) == 0);

  // Large ones: a write straight from the socket into the mapping, a read
  // response gathered from it (24 KiB each, at odd offsets).
  std::vector<std::uint8_t> big(24 << 10);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<std::uint8_t>(i * 7 + 3);
  auto bmr = p.b.pd->register_memory(big.data(), big.size(), access::local_write);
  sg = bmr->slice(0, static_cast<std::uint32_t>(big.size()));
  wr = {.wr_id = 11, .op = tp::opcode::write, .sg_list = {&sg, 1}, .remote_addr = kIova + 1000, .rkey = mr->rkey()};
  REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::success);
  CHECK(std::memcmp(buf.view + kOff + 1000, big.data(), big.size()) == 0);
  for (std::size_t i = 0; i < big.size(); ++i) buf.view[kOff + 5000 + i] = static_cast<std::byte>(i * 11 + 1);
  std::fill(big.begin(), big.end(), std::uint8_t{0});
  wr = {.wr_id = 12, .op = tp::opcode::read, .sg_list = {&sg, 1}, .remote_addr = kIova + 5000, .rkey = mr->rkey()};
  REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::success);
  CHECK(std::memcmp(big.data(), buf.view + kOff + 5000, big.size()) == 0);
  // And a large send from the region (a gather straight from the mapping).
  std::vector<std::uint8_t> in2(big.size());
  auto i2mr = p.b.pd->register_memory(in2.data(), in2.size(), access::local_write);
  tp::sge r2 = i2mr->slice(0, static_cast<std::uint32_t>(in2.size()));
  rr = {.wr_id = 13, .sg_list = {&r2, 1}};
  REQUIRE_FALSE(p.b.qp->post_recv({&rr, 1}));
  tp::sge s2 = mr->slice(2000, static_cast<std::uint32_t>(in2.size()));
  wr = send_wr(14, {&s2, 1});
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
  REQUIRE(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::success);
  CHECK(std::memcmp(in2.data(), buf.view + kOff + 2000, in2.size()) == 0);

  SECTION("a write that ends past iova + length is refused and writes nothing") {
    std::vector<std::byte> before(buf.view, buf.view + kBufferSize);
    sg = lmr->slice(0, 64);
    wr = {.wr_id = 8, .op = tp::opcode::write, .sg_list = {&sg, 1}, .remote_addr = kIova + kLen - 32,
          .rkey = mr->rkey()};
    REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
    CHECK(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::remote_access_error);
    CHECK(std::equal(before.begin(), before.end(), buf.view));
  }
  SECTION("a write below iova is refused and writes nothing") {
    std::vector<std::byte> before(buf.view, buf.view + kBufferSize);
    sg = lmr->slice(0, 64);
    wr = {.wr_id = 9, .op = tp::opcode::write, .sg_list = {&sg, 1}, .remote_addr = kIova - 16, .rkey = mr->rkey()};
    REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
    CHECK(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::remote_access_error);
    CHECK(std::equal(before.begin(), before.end(), buf.view));
  }
  SECTION("after deregistration its key writes nothing") {
    const std::uint32_t rkey = mr->rkey();
    mr.reset();
    std::vector<std::byte> before(buf.view, buf.view + kBufferSize);
    sg = lmr->slice(0, 64);
    wr = {.wr_id = 10, .op = tp::opcode::write, .sg_list = {&sg, 1}, .remote_addr = kIova + 64, .rkey = rkey};
    REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
    CHECK(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::remote_access_error);
    CHECK(std::equal(before.begin(), before.end(), buf.view));
  }
}

TEST_CASE("dma-buf registration: a memory window bound on it reaches the buffer's bytes", "[conformance]") {
  test_buffer buf;
  connected_pair p;
  if (!device_has_dmabuf(*p.a.dev)) return;
  if (!p.a.dev->caps().memory_windows) {
    WARN("skipped: " << p.a.dev->name() << " has no memory windows");
    return;
  }
  if (!buf.real_dmabuf && !testing_tcp()) {
    WARN("skipped: " << p.a.dev->name() << " needs a real dma-buf and this host has no /dev/udmabuf");
    return;
  }
  constexpr std::size_t kOff = 8192, kLen = 8192;
  constexpr std::uint64_t kIova = 0x7e0000000000ull;
  auto mr = p.a.pd->register_dmabuf(buf.fd, kOff, kLen, kIova, access::local_write | access::mw_bind);
  auto w = p.a.pd->alloc_window();
  tp::work_request bw{.wr_id = 1, .op = tp::opcode::bind_window};
  bw.bind = {w.get(), mr.get(), kIova + 1024, 2048, access::remote_write | access::remote_read};
  REQUIRE_FALSE(p.a.qp->post_send({&bw, 1}));
  REQUIRE(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);

  std::vector<std::uint8_t> src(512, 0x3c);
  auto smr = p.b.pd->register_memory(src.data(), src.size(), access::local_write);
  tp::sge sg = smr->slice(0, 512);
  tp::work_request wr{.wr_id = 2, .op = tp::opcode::write, .sg_list = {&sg, 1}, .remote_addr = kIova + 1500,
                      .rkey = w->rkey()};
  REQUIRE_FALSE(p.b.qp->post_send({&wr, 1}));
  REQUIRE(p.drv.wait_one(p.b.cq.get()).status == tp::wc_status::success);
  CHECK(std::all_of(buf.view + kOff + 1500, buf.view + kOff + 2012, [](std::byte b) { return b == std::byte{0x3c}; }));
  CHECK(buf.filled_except(kOff + 1500, 512));
  w.reset();  // windows go before their registration
}
