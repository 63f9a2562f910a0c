// Verbs-provider tests that only make sense on a real RDMA device (label
// verbs). They run inside the rxe VM (scripts/rxe-vm/run-tests), where
// ANYDOOR_TEST_HOST is the address of the rxe device's netdev.
#include "../support/harness.hpp"

#include <anydoor/error.hpp>

using namespace anydoor::test;
using tp::access;

namespace {
std::unique_ptr<tp::device> open_verbs() { return tp::open_device({.provider = "verbs"}); }
}  // namespace

TEST_CASE("verbs: opening devices", "[verbs]") {
  auto dev = open_verbs();
  CHECK(dev->provider() == "verbs");
  CHECK_FALSE(dev->name().empty());
  // by name, and auto picks verbs when a device is active
  CHECK(tp::open_device({.provider = "verbs", .name = std::string(dev->name())})->name() == dev->name());
  CHECK(tp::open_device({.provider = "auto"})->provider() == "verbs");
  if (std::getenv("ANYDOOR_DEVICE") == nullptr) {  // the variable overrides the name asked for
    try {
      tp::open_device({.provider = "verbs", .name = "no-such-hca"});
      FAIL("opened a device that does not exist");
    } catch (const std::system_error& e) {
      CHECK(e.code() == anydoor::errc::no_device);
    }
  }
}

TEST_CASE("verbs: capabilities come from the device", "[verbs]") {
  auto dev = open_verbs();
  const auto& c = dev->caps();
  CHECK(c.max_qp_wr >= 64);
  CHECK(c.max_sge >= 1);
  CHECK(c.max_inline >= 32);
  CHECK(c.max_mr_size > 0);
  CHECK(c.max_msg_size >= (1u << 20));
  CHECK(c.max_cqe >= 64);
  CHECK(c.max_private_data == 55);
  CHECK(c.atomics);  // rxe supports atomics
}

TEST_CASE("verbs: registration keeps exactly the requested access", "[verbs]") {
  auto dev = open_verbs();
  auto pd = dev->alloc_pd();
  std::vector<char> buf(4096);
  auto mr = pd->register_memory(buf.data(), buf.size(), access::remote_read);
  CHECK(mr->access() == access::remote_read);
  CHECK(mr->addr() == buf.data());
  CHECK(mr->length() == buf.size());
  CHECK(mr->rkey() != 0);
}

TEST_CASE("verbs: an unreachable address is address_error or timed_out", "[verbs]") {
  // (refused, rejected, private data and timeouts: test/conformance/connect.cpp)
  one_qp e;
  auto& dev = e.dev;
  auto& qp = e.qp;

  SECTION("unreachable address") {
    // nothing answers ARP for this address on the rxe netdev's subnet
    auto r = dev->connect(*qp, "10.0.2.99", 7471, {}, 2s);
    CHECK((r.ec == anydoor::errc::address_error || r.ec == anydoor::errc::timed_out));
  }
}

TEST_CASE("verbs: ANYDOOR_GID_INDEX chooses the GID connections leave from", "[verbs]") {
  struct env_guard {
    explicit env_guard(const char* v) { ::setenv("ANYDOOR_GID_INDEX", v, 1); }
    ~env_guard() { ::unsetenv("ANYDOOR_GID_INDEX"); }
  };
  {
    env_guard g("999");
    try {
      open_verbs();
      FAIL("opened a device with a GID index that does not exist");
    } catch (const std::system_error& e) {
      CHECK(e.code() == anydoor::errc::invalid_argument);
    }
  }
  env_guard g(std::getenv("ANYDOOR_TEST_GID_INDEX") != nullptr ? std::getenv("ANYDOOR_TEST_GID_INDEX") : "1");
  connected_pair p;  // both ends opened with the chosen GID: the connection works through it
  std::uint64_t src = 7, dst = 0;
  auto smr = p.a.pd->register_memory(&src, 8, access::none);
  auto dmr = p.b.pd->register_memory(&dst, 8, access::local_write | access::remote_write);
  tp::sge sg = smr->slice(0, 8);
  tp::work_request wr{.wr_id = 1, .op = tp::opcode::write, .sg_list = {&sg, 1},
                      .remote_addr = reinterpret_cast<std::uint64_t>(&dst), .rkey = dmr->rkey()};
  REQUIRE_FALSE(p.a.qp->post_send({&wr, 1}));
  CHECK(p.drv.wait_one(p.a.cq.get()).status == tp::wc_status::success);
  CHECK(dst == 7);
}
