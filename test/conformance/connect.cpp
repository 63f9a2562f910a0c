// Provider conformance: the connection manager.
#include "../support/harness.hpp"

#include <stop_token>

using namespace anydoor::test;

TEST_CASE("connecting where nobody listens is connection_refused", "[conformance]") {
  one_qp e;
  auto lis = e.dev->listen(test_host(), 0);
  const std::uint16_t port = lis->port();
  lis.reset();
  auto r = e.dev->connect(*e.qp, test_host(), port, {}, 5s);
  CHECK(r.ec == anydoor::errc::connection_refused);
  CHECK(e.qp->state() == tp::qp_state::reset);
}

TEST_CASE("an unresolvable host is address_error", "[conformance]") {
  one_qp e;
  CHECK(e.dev->connect(*e.qp, "no-such-host.invalid", 1, {}, 2s).ec == anydoor::errc::address_error);
  CHECK_THROWS_AS(e.dev->listen("no-such-host.invalid", 0), std::system_error);
}

TEST_CASE("a rejected request is connection_rejected, with the rejecter's private data", "[conformance]") {
  one_qp e;
  auto lis = e.dev->listen(test_host(), 0);
  std::thread t([&] {
    std::error_code ec;
    auto req = lis->get_request(10s, ec);
    REQUIRE(req);
    CHECK(req->private_data().size() == 3);
    const std::byte why[] = {std::byte{'n'}, std::byte{'o'}};
    req->reject(why);
  });
  const std::byte hi[] = {std::byte{1}, std::byte{2}, std::byte{3}};
  auto r = e.dev->connect(*e.qp, test_host(), lis->port(), hi, 10s);
  t.join();
  CHECK(r.ec == anydoor::errc::connection_rejected);
  REQUIRE(r.private_data.size() == 2);
  CHECK(r.private_data[0] == std::byte{'n'});
  CHECK(e.qp->state() != tp::qp_state::rts);
}

TEST_CASE("private data travels both ways, up to max_private_data", "[conformance]") {
  one_qp e;
  const std::size_t max = e.dev->caps().max_private_data;
  auto lis = e.dev->listen(test_host(), 0);
  auto qp2 = e.pd->create_qp({.send_cq = e.cq.get(), .recv_cq = e.cq.get()});
  std::vector<std::byte> seen;
  std::thread t([&] {
    std::error_code ec;
    auto req = lis->get_request(10s, ec);
    REQUIRE(req);
    seen.assign(req->private_data().begin(), req->private_data().end());
    CHECK_FALSE(req->accept(*qp2, std::vector<std::byte>(max, std::byte{0x5a})));
  });
  const std::vector<std::byte> hi(max, std::byte{0x33});
  auto r = e.dev->connect(*e.qp, test_host(), lis->port(), hi, 10s);
  t.join();
  REQUIRE_FALSE(r.ec);
  CHECK(seen == hi);
  CHECK(r.private_data == std::vector<std::byte>(max, std::byte{0x5a}));
  CHECK(e.qp->state() == tp::qp_state::rts);
  CHECK(qp2->state() == tp::qp_state::rts);
  // a connected queue pair cannot connect again; too much private data is refused
  CHECK(e.dev->connect(*e.qp, test_host(), lis->port(), {}, 1s).ec == anydoor::errc::invalid_state);
  auto qp3 = e.pd->create_qp({.send_cq = e.cq.get(), .recv_cq = e.cq.get()});
  CHECK(e.dev->connect(*qp3, test_host(), lis->port(), std::vector<std::byte>(max + 1), 1s).ec ==
        anydoor::errc::invalid_argument);
}

TEST_CASE("get_request times out when nobody comes", "[conformance]") {
  one_qp e;
  auto lis = e.dev->listen(test_host(), 0);
  std::error_code ec;
  CHECK(lis->get_request(100ms, ec) == nullptr);
  CHECK(ec == anydoor::errc::timed_out);
}

TEST_CASE("a stop request ends a connect that waits for its peer: operation_canceled, not connected",
          "[conformance]") {
  // Nobody takes the request from the listener: the connect waits for an
  // answer until its timeout (30 s here) unless stopped.
  one_qp e;
  auto lis = e.dev->listen(test_host(), 0);
  std::stop_source stop;
  tp::connect_result r;
  std::chrono::steady_clock::time_point stopped_at;
  std::thread t([&] { r = e.dev->connect(*e.qp, test_host(), lis->port(), {}, 30s, stop.get_token()); });
  std::this_thread::sleep_for(300ms);
  stopped_at = std::chrono::steady_clock::now();
  stop.request_stop();
  t.join();
  const auto took = std::chrono::steady_clock::now() - stopped_at;
  INFO("the connect returned " << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                               << " ms after the stop request");
  CHECK(took < 250ms);
  CHECK(r.ec == std::errc::operation_canceled);
  CHECK(e.qp->state() != tp::qp_state::rts);
  // A stop requested before the call: nothing is attempted.
  auto qp2 = e.pd->create_qp({.send_cq = e.cq.get(), .recv_cq = e.cq.get()});
  std::stop_source early;
  early.request_stop();
  CHECK(e.dev->connect(*qp2, test_host(), lis->port(), {}, 5s, early.get_token()).ec == std::errc::operation_canceled);
}

TEST_CASE("a connected queue pair's path names both ends: one side's source is the other's destination",
          "[conformance]") {
  connected_pair p;
  const tp::path_info a = p.a.qp->path(), b = p.b.qp->path();
  const std::array<std::uint8_t, 16> zero{};
  CHECK(a.sgid != zero);
  CHECK(a.dgid != zero);
  CHECK(a.sgid == b.dgid);
  CHECK(a.dgid == b.sgid);
  if (testing_tcp()) {
    CHECK(a.sgid_index == -1);  // no GIDs: the socket's addresses
    // the test host is IPv4: ::ffff:a.b.c.d
    CHECK(a.sgid[10] == 0xff);
    CHECK(a.sgid[11] == 0xff);
  } else {
    CHECK(a.sgid_index >= 0);  // RoCE (iWARP has no GRH: not in its gated list)
  }
  one_qp fresh;
  CHECK(fresh.qp->path().sgid == zero);
}
