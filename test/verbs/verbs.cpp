// Verbs-provider tests that only make sense on a real RDMA device (label
// verbs). They run inside the rxe VM (scripts/rxe-vm/run-tests), where
// ANYDOOR_TEST_HOST is the address of the rxe device's netdev.
#include "../support/harness.hpp"

#include <anydoor/error.hpp>

#include <arpa/inet.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

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

TEST_CASE("verbs: the device's counters: RNR, transport retries and asynchronous events", "[verbs]") {
  auto dev = open_verbs();
  const tp::device_counters c = dev->counters();
  CHECK(c.async_events.has_value());
  CHECK(c.async_errors.has_value());
  INFO("counters read from: " << c.source);
  if (!c.rnr_naks_sent && !c.rnr_naks_received) {
    WARN("this kernel's " << dev->name() << " has no hw_counters: " << c.source);
    return;
  }
  // Where the RNR counters are, rxe also has its retry counters.
  if (std::string(dev->name()).starts_with("rxe")) {
    CHECK(c.transport_retries.has_value());
    CHECK(c.transport_retry_exceeded.has_value());
  }
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

namespace {

struct gid_env {
  explicit gid_env(const std::string& v) { ::setenv("ANYDOOR_GID_INDEX", v.c_str(), 1); }
  ~gid_env() { ::unsetenv("ANYDOOR_GID_INDEX"); }
};

// The GID table of the device's port 1 from sysfs: index -> (gid text, type).
struct gid_row {
  int index;
  std::string gid;   // "0000:0000:0000:0000:0000:ffff:0a00:020f"
  std::string type;  // "RoCE v2", "IB/RoCE v1"
};
std::vector<gid_row> gid_table(std::string_view dev) {
  std::vector<gid_row> rows;
  const std::string base = "/sys/class/infiniband/" + std::string(dev) + "/ports/1/";
  for (int i = 0; i < 256; ++i) {
    std::ifstream g(base + "gids/" + std::to_string(i)), t(base + "gid_attrs/types/" + std::to_string(i));
    std::string gid, type;
    if (!g || !std::getline(g, gid)) break;
    if (!t || !std::getline(t, type)) type.clear();  // unused entries have no type (EINVAL)
    if (gid != "0000:0000:0000:0000:0000:0000:0000:0000") rows.push_back({i, gid, type});
  }
  return rows;
}
// ::ffff:a.b.c.d as sysfs writes it.
std::string gid_text(const std::string& ipv4) {
  in_addr a{};
  REQUIRE(::inet_pton(AF_INET, ipv4.c_str(), &a) == 1);
  const auto* b = reinterpret_cast<const unsigned char*>(&a);
  char buf[64];
  std::snprintf(buf, sizeof buf, "0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x", b[0], b[1], b[2], b[3]);
  return buf;
}
std::string gid_text(const std::array<std::uint8_t, 16>& g) {
  std::string s;
  char buf[8];
  for (int i = 0; i < 16; i += 2) {
    std::snprintf(buf, sizeof buf, "%s%02x%02x", i == 0 ? "" : ":", g[static_cast<std::size_t>(i)],
                  g[static_cast<std::size_t>(i) + 1]);
    s += buf;
  }
  return s;
}
int index_of(const std::vector<gid_row>& rows, const std::string& gid, const std::string& type) {
  for (const gid_row& r : rows) {
    if (r.gid == gid && r.type == type) return r.index;
  }
  return -1;
}

void write_once(connected_pair& p) {
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

}  // namespace

TEST_CASE("verbs: by default a connection uses the RoCE v2 GID of its source address", "[verbs]") {
  auto dev = open_verbs();
  const auto rows = gid_table(dev->name());
  const int expected = index_of(rows, gid_text(test_host()), "RoCE v2");
  INFO("the RoCE v2 GID of " << test_host() << " on " << dev->name());
  REQUIRE(expected >= 0);
  connected_pair p;
  write_once(p);
  const tp::path_info a = p.a.qp->path();
  CHECK(a.sgid_index == expected);  // the route's source is the test host's own address
  CHECK(gid_text(a.sgid) == gid_text(test_host()));
  CHECK(gid_text(a.dgid) == gid_text(test_host()));
}

TEST_CASE("verbs: ANYDOOR_GID_INDEX chooses the GID connections leave from", "[verbs]") {
  auto dev = open_verbs();
  const auto rows = gid_table(dev->name());
  {
    gid_env g("999");
    try {
      open_verbs();
      FAIL("opened a device with a GID index that does not exist");
    } catch (const std::system_error& e) {
      CHECK(e.code() == anydoor::errc::invalid_argument);
    }
  }
  // A GID without an IPv4 address (the link-local IPv6 one) cannot be
  // forced through rdma_cm: refused, never ignored.
  int v6 = -1;
  for (const gid_row& r : rows) {
    if (r.gid.rfind("fe80:", 0) == 0) v6 = r.index;
  }
  INFO("the link-local GID of " << dev->name());
  REQUIRE(v6 >= 0);
  {
    gid_env g(std::to_string(v6));
    try {
      open_verbs();
      FAIL("opened a device with a forced GID that has no IPv4 address");
    } catch (const std::system_error& e) {
      CHECK(e.code() == anydoor::errc::invalid_argument);
    }
  }
  // The second address of the netdev (ANYDOOR_TEST_HOST2, added by the VM
  // script): forcing its GID makes the client leave from it, although the
  // route to the test host would pick the first.
  const char* host2 = std::getenv("ANYDOOR_TEST_HOST2");
  REQUIRE(host2 != nullptr);
  const int second = index_of(rows, gid_text(host2), "RoCE v2");
  INFO("the RoCE v2 GID of " << host2);
  REQUIRE(second >= 0);
  gid_env g(std::to_string(second));
  connected_pair p;  // both ends opened with the chosen GID: the server listens on the test host
  write_once(p);
  const tp::path_info a = p.a.qp->path(), b = p.b.qp->path();
  CHECK(a.sgid_index == second);
  CHECK(gid_text(a.sgid) == gid_text(host2));
  CHECK(gid_text(b.dgid) == gid_text(host2));  // the server sees the client at the second address
  CHECK(gid_text(b.sgid) == gid_text(test_host()));
}
