// Public setup API: options, argument checks and error reporting.
#include "../support/harness.hpp"

#include <cstdlib>

using namespace anydoor::test;
using tp::access;

namespace {

struct env_guard {
  std::string name;
  env_guard(const char* n, const char* v) : name(n) { ::setenv(n, v, 1); }
  ~env_guard() { ::unsetenv(name.c_str()); }
};
}  // namespace

TEST_CASE("open_device: providers and device names", "[unit]") {
  CHECK(tp::open_device({.provider = "tcp"})->provider() == "tcp");
  CHECK(tp::open_device({.provider = "tcp"})->name() == "tcp0");
  CHECK(thrown([] { tp::open_device({.provider = "carrier-pigeon"}); }) == anydoor::errc::provider_unavailable);
  CHECK(thrown([] { tp::open_device({.provider = "tcp", .name = "mlx5_0"}); }) == anydoor::errc::no_device);
  const auto providers = tp::available_providers();
  REQUIRE(providers.front() == "tcp");
  if (providers.size() == 1) {  // built with ANYDOOR_WITH_VERBS=OFF
    CHECK(thrown([] { tp::open_device({.provider = "verbs"}); }) == anydoor::errc::provider_unavailable);
    CHECK(tp::open_device({.provider = "auto"})->provider() == "tcp");
  } else {
    REQUIRE(providers == std::vector<std::string>{"tcp", "verbs"});
    // provider=auto takes verbs exactly when a verbs device opens
    std::error_code verbs_ec = thrown([] { tp::open_device({.provider = "verbs"}); });
    CHECK((!verbs_ec || verbs_ec == anydoor::errc::no_device));
    CHECK(tp::open_device({.provider = "auto"})->provider() == (verbs_ec ? "tcp" : "verbs"));
    CHECK(thrown([] { tp::open_device({.provider = "verbs", .name = "no-such-hca"}); }) == anydoor::errc::no_device);
  }
}

TEST_CASE("open_device: ANYDOOR_PROVIDER and ANYDOOR_DEVICE override the options", "[unit]") {
  {
    env_guard g("ANYDOOR_PROVIDER", "bogus");
    CHECK(thrown([] { tp::open_device({.provider = "tcp"}); }) == anydoor::errc::provider_unavailable);
  }
  {
    env_guard g("ANYDOOR_DEVICE", "nope0");
    CHECK(thrown([] { tp::open_device({.provider = "tcp"}); }) == anydoor::errc::no_device);
  }
  {
    env_guard g("ANYDOOR_PROVIDER", "tcp");
    CHECK(tp::open_device({.provider = "verbs"})->provider() == "tcp");
  }
}

TEST_CASE("capabilities of the tcp provider", "[unit]") {
  auto dev = tp::open_device({.provider = "tcp"});
  const auto& c = dev->caps();
  CHECK(c.max_sge >= 4);
  CHECK(c.max_inline >= 64);
  CHECK(c.max_msg_size >= (1u << 30));
  CHECK(c.max_private_data == 56);
  CHECK(c.atomics);
  CHECK(c.dmabuf);             // tcp maps a buffer fd
  CHECK_FALSE(c.peer_memory);  // and never takes a GPU pointer as such
}

TEST_CASE("setup calls refuse bad arguments with clear errors", "[unit]") {
  auto dev = tp::open_device({.provider = "tcp"});
  auto pd = dev->alloc_pd();
  CHECK(thrown([&] { dev->create_cq(0); }) == anydoor::errc::invalid_argument);
  CHECK(thrown([&] { dev->create_cq(dev->caps().max_cqe + 1); }) == anydoor::errc::invalid_argument);
  auto cq = dev->create_cq(8);
  CHECK(cq->depth() == 8);

  char buf[64];
  CHECK(thrown([&] { pd->register_memory(nullptr, 8, access::none); }) == anydoor::errc::invalid_argument);
  CHECK(thrown([&] { pd->register_memory(buf, 0, access::none); }) == anydoor::errc::invalid_argument);
  CHECK(thrown([&] { pd->register_memory(buf, 8, access::remote_write); }) == anydoor::errc::invalid_argument);
  CHECK(thrown([&] { pd->register_memory(buf, 8, static_cast<tp::access>(1u << 10)); }) ==
        anydoor::errc::invalid_argument);
  auto mr = pd->register_memory(buf, 64, access::local_write | access::remote_read);
  CHECK(mr->addr() == buf);
  CHECK(mr->length() == 64);
  CHECK(mr->access() == (access::local_write | access::remote_read));
  CHECK(mr->lkey() != 0);

  tp::qp_attributes ok{.send_cq = cq.get(), .recv_cq = cq.get()};
  auto bad = [&](auto mutate) {
    tp::qp_attributes a = ok;
    mutate(a);
    return thrown([&] { pd->create_qp(a); });
  };
  CHECK(bad([](auto& a) { a.send_cq = nullptr; }) == anydoor::errc::invalid_argument);
  CHECK(bad([](auto& a) { a.max_send_wr = 0; }) == anydoor::errc::invalid_argument);
  CHECK(bad([](auto& a) { a.max_recv_wr = 1u << 20; }) == anydoor::errc::invalid_argument);
  CHECK(bad([](auto& a) { a.max_send_sge = 17; }) == anydoor::errc::invalid_argument);
  CHECK(bad([](auto& a) { a.max_recv_sge = 0; }) == anydoor::errc::invalid_argument);
  CHECK(bad([](auto& a) { a.max_inline_data = 4096; }) == anydoor::errc::invalid_argument);
  CHECK(bad([](auto& a) { a.rnr_retry = 8; }) == anydoor::errc::invalid_argument);
  CHECK(thrown([&] { dev->listen("no-such-host.invalid", 0); }) == anydoor::errc::address_error);
}

TEST_CASE("post_send and post_recv validate every request before accepting any", "[unit]") {
  connected_pair p({.max_send_wr = 4, .max_recv_wr = 2, .max_send_sge = 2, .max_recv_sge = 1});
  char buf[64];
  auto mr = p.a.pd->register_memory(buf, 64, access::local_write);
  tp::sge sg[3] = {mr->slice(0, 8), mr->slice(8, 8), mr->slice(16, 8)};
  std::size_t bad = 99;
  tp::work_request too_many_sge = send_wr(1, sg);
  tp::work_request wrs[] = {send_wr(0, {sg, 1}), too_many_sge};
  CHECK(p.a.qp->post_send(wrs, &bad) == anydoor::errc::invalid_argument);
  CHECK(bad == 1);
  CHECK(p.a.qp->counters().send_wrs == 0);  // nothing was accepted
  tp::work_request atomic_bad{.wr_id = 2, .op = tp::opcode::fetch_add, .sg_list = {sg, 2}};
  CHECK(p.a.qp->post_send({&atomic_bad, 1}, &bad) == anydoor::errc::invalid_argument);
  tp::work_request inline_read{.wr_id = 3, .op = tp::opcode::read, .sg_list = {sg, 1}, .inline_data = true};
  CHECK(p.a.qp->post_send({&inline_read, 1}, &bad) == anydoor::errc::invalid_argument);
  std::vector<tp::work_request> five(5, send_wr(4, {sg, 1}));
  CHECK(p.a.qp->post_send(five, &bad) == anydoor::errc::queue_full);
  CHECK(bad == 4);

  tp::recv_request r2{.wr_id = 5, .sg_list = {sg, 2}};
  CHECK(p.a.qp->post_recv({&r2, 1}, &bad) == anydoor::errc::invalid_argument);
  std::vector<tp::recv_request> three(3, tp::recv_request{.wr_id = 6, .sg_list = {sg, 1}});
  CHECK(p.a.qp->post_recv(three, &bad) == anydoor::errc::queue_full);
  CHECK(bad == 2);
}

TEST_CASE("error codes have names and messages", "[unit]") {
  using anydoor::errc;
  for (int e = static_cast<int>(errc::invalid_argument); e <= static_cast<int>(anydoor::errc_last); ++e) {
    const std::error_code ec = static_cast<errc>(e);
    CHECK(std::string(ec.category().name()) == "anydoor");
    CHECK(ec.message().find("unknown") == std::string::npos);
  }
  for (int s = 0; s <= 21; ++s) {
    const std::error_code ec = static_cast<tp::wc_status>(s);
    CHECK(std::string(ec.category().name()) == "anydoor.wc");
    CHECK(ec.message() != "unknown completion status");
  }
  CHECK(std::error_code(tp::wc_status::remote_access_error).message() == "remote access error");
  CHECK(tp::to_string(tp::qp_state::rts) == "rts");
  CHECK(tp::to_string(tp::opcode::compare_swap) == "compare_swap");
  CHECK(tp::to_string(tp::wc_opcode::recv_rdma_with_imm) == "recv_rdma_with_imm");
}

TEST_CASE("registration fails cleanly when the domain's key space is exhausted", "[unit]") {
  auto dev = tp::open_device({.provider = "tcp"});
  auto pd = dev->alloc_pd();
  char buf[16];
  std::vector<std::unique_ptr<tp::memory_region>> mrs;
  std::error_code ec;
  while (!ec && mrs.size() < 100000) {
    ec = thrown([&] { mrs.push_back(pd->register_memory(buf, sizeof buf, access::local_write)); });
  }
  CHECK(ec == anydoor::errc::registration_failed);
  CHECK(mrs.size() == 16383);
  mrs.pop_back();  // a freed key can be used again
  CHECK_NOTHROW(mrs.push_back(pd->register_memory(buf, sizeof buf, access::local_write)));
}
