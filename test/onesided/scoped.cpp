// Connection-scoped memory (connection::async_register_memory): the region's
// rkey is a memory window bound to one connection's queue pair. Its peer
// reaches it; the same key presented through another connection of the same
// fabrics is refused and writes nothing; the window is revoked when the
// connection ends, however it ends, or when the region goes first.
#include "../support/onesided.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <cstring>
#include <optional>

using namespace anydoor::test;
using asio::awaitable;
using asio::use_awaitable;

namespace {

constexpr auto kAll = ad::access::local_write | ad::access::remote_write | ad::access::remote_read |
                      ad::access::remote_atomic;

bool has_windows(ad::fabric& f) {
  if (f.device().caps().memory_windows) return true;
  if (f.provider() == "tcp" || f.device().name().rfind("rxe", 0) == 0) {
    FAIL(f.provider() << " device " << f.device().name() << " reports no memory windows");
  }
  WARN("skipped: " << f.provider() << " device " << f.device().name() << " has no memory windows");
  return false;
}

// b registers `mem` for its connection's peer and sends remote() to a.
awaitable<ad::memory_region> expose(ad::connection& b, std::span<std::byte> mem, ad::access acc) {
  ad::memory_region r = co_await b.async_register_memory(mem, acc, use_awaitable);
  const auto packed = r.remote().pack();
  co_await b.async_send(asio::buffer(packed), use_awaitable);
  co_return r;
}

awaitable<ad::remote_region> receive_region(ad::connection& a) {
  ad::message m = co_await a.async_receive(use_awaitable);
  ad::remote_region r;
  REQUIRE_FALSE(ad::remote_region::unpack(m.bytes(), r));
  co_return r;
}

}  // namespace

TEST_CASE("connection-scoped memory: its peer reaches it, another connection with the leaked key cannot",
          "[onesided]") {
  onesided_pair p;
  if (!has_windows(p.fb)) return;
  // A second client of the same target fabric: fc -> fb (c and its accepted b2).
  ad::fabric fc(p.io, test_options());
  ad::connection c, b2;
  {
    failure f;
    asio::co_spawn(p.io, [&]() -> awaitable<void> { b2 = co_await p.acc.async_accept(use_awaitable); }, f.handler());
    asio::co_spawn(p.io, [&]() -> awaitable<void> { c = co_await fc.async_connect(addr(p.acc), use_awaitable); },
                   f.handler());
    run_to_completion(p.io);
    f.check();
  }
  std::vector<std::byte> target(8192, std::byte{0x5a});
  const auto data = pattern(1024, 7);
  ad::memory_region region;
  ad::remote_region leaked;
  ad::error_code leaked_put, leaked_get;
  failure f;
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    region = co_await expose(p.b, target, kAll);
    auto [ec, m] = co_await p.b.async_receive(asio::as_tuple(use_awaitable));  // "done"
  }, f.handler());
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    auto [ec, m] = co_await b2.async_receive(asio::as_tuple(use_awaitable));  // ends when c fails
  }, f.handler());
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    const ad::remote_region r = co_await receive_region(p.a);
    leaked = r;
    CHECK(r.length == target.size());
    const std::size_t put = co_await p.a.async_put(asio::buffer(data), r.at(512, data.size()), use_awaitable);
    CHECK(put == data.size());
    std::vector<std::byte> back(data.size());
    const std::size_t got = co_await p.a.async_get(asio::buffer(back), r.at(512, back.size()), use_awaitable);
    CHECK(got == back.size());
    CHECK(back == data);
    if (p.fa.device().caps().atomics) {
      const std::uint64_t before = co_await p.a.async_fetch_add(r.at(4096, 8), 3, use_awaitable);
      CHECK(before == 0x5a5a5a5a5a5a5a5aull);
    }
    // The key, leaked to another client of the same fabric: refused.
    auto [e1, n1] = co_await c.async_put(asio::buffer(pattern(64, 9)), r.at(0, 64), asio::as_tuple(use_awaitable));
    leaked_put = e1;
    CHECK_FALSE(c.is_open());
    co_await p.a.async_send(asio::buffer("done", 4), use_awaitable);
  }, f.handler());
  run_to_completion(p.io);
  f.check();
  CHECK(leaked_put == anydoor::transport::wc_status::remote_access_error);
  REQUIRE(region);
  CHECK(region.connection_scoped());
  CHECK_FALSE(region.revoked());
  CHECK(region.size() == target.size());
  CHECK(region.access() == kAll);
  CHECK(region.rkey() == leaked.rkey);
  CHECK(std::memcmp(target.data() + 512, data.data(), data.size()) == 0);
  CHECK(std::all_of(target.begin(), target.begin() + 512, [](std::byte b) { return b == std::byte{0x5a}; }));
  CHECK(p.b.stats().scoped_registrations == 1);
  // A get through a new connection of the same client fabric is refused too,
  // while the region's own connection is still open.
  ad::connection c2, b3;
  asio::co_spawn(p.io, [&]() -> awaitable<void> { b3 = co_await p.acc.async_accept(use_awaitable); }, f.handler());
  asio::co_spawn(p.io, [&]() -> awaitable<void> { c2 = co_await fc.async_connect(addr(p.acc), use_awaitable); },
                 f.handler());
  run_to_completion(p.io);
  f.check();
  REQUIRE(p.b.is_open());
  REQUIRE_FALSE(region.revoked());
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    auto [ec, m] = co_await b3.async_receive(asio::as_tuple(use_awaitable));
  }, f.handler());
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    std::vector<std::byte> back(64);
    auto [ec, n] = co_await c2.async_get(asio::buffer(back), leaked.at(0, 64), asio::as_tuple(use_awaitable));
    leaked_get = ec;
  }, f.handler());
  run_to_completion(p.io);
  f.check();
  CHECK(leaked_get == anydoor::transport::wc_status::remote_access_error);
  CHECK(p.b.is_open());
  CHECK_FALSE(region.revoked());
  // Local use of the region goes on whatever becomes of its connection.
  p.b.abort();
  run_to_completion(p.io);
  CHECK(region.revoked());
  CHECK(region.at(0, 16).region() == &region);
}

TEST_CASE("connection-scoped memory is revoked when its connection ends, however it ends", "[onesided]") {
  const std::string how = GENERATE(as<std::string>{}, "close", "abort", "peer abort", "handle destroyed",
                                   "region first");
  INFO(how);
  onesided_pair p;
  if (!has_windows(p.fb)) return;
  std::vector<std::byte> target(4096);
  ad::memory_region region;
  ad::remote_region r;
  failure f;
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    region = co_await expose(p.b, target, kAll);
    auto [ec, m] = co_await p.b.async_receive(asio::as_tuple(use_awaitable));
  }, f.handler());
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    r = co_await receive_region(p.a);
    co_await p.a.async_put(asio::buffer(pattern(16, 1)), r.at(0, 16), use_awaitable);
    co_await p.a.async_send(asio::buffer("next", 4), use_awaitable);
  }, f.handler());
  run_to_completion(p.io);
  f.check();
  REQUIRE(region);
  REQUIRE_FALSE(region.revoked());
  ad::error_code after;
  if (how == "close") {
    asio::co_spawn(p.io, [&]() -> awaitable<void> { co_await p.b.async_close(use_awaitable); }, f.handler());
    asio::co_spawn(p.io, [&]() -> awaitable<void> {
      auto [ec, m] = co_await p.a.async_receive(asio::as_tuple(use_awaitable));
      co_await p.a.async_close(use_awaitable);
    }, f.handler());
  } else if (how == "abort") {
    p.b.abort();
  } else if (how == "peer abort") {
    asio::co_spawn(p.io, [&]() -> awaitable<void> {
      auto [ec, m] = co_await p.b.async_receive(asio::as_tuple(use_awaitable));
    }, f.handler());
    p.a.abort();
  } else if (how == "handle destroyed") {
    p.b = {};
  } else {
    // The region goes first: the connection stays, and the key fails on it.
    region.reset();
    asio::co_spawn(p.io, [&]() -> awaitable<void> {
      auto [ec, m] = co_await p.b.async_receive(asio::as_tuple(use_awaitable));
    }, f.handler());
    asio::co_spawn(p.io, [&]() -> awaitable<void> {
      auto [ec, n] = co_await p.a.async_put(asio::buffer(pattern(16, 2)), r.at(0, 16), asio::as_tuple(use_awaitable));
      after = ec;
    }, f.handler());
  }
  run_to_completion(p.io);
  f.check();
  if (how == "region first") {
    CHECK(after == anydoor::transport::wc_status::remote_access_error);
    CHECK(target[0] == pattern(16, 1)[0]);
    return;
  }
  CHECK(region.revoked());
  CHECK(region.connection_scoped());
  CHECK(region.size() == target.size());  // local use goes on
}

TEST_CASE("connection-scoped memory: argument errors, ended connections, empty handles", "[onesided]") {
  onesided_pair p;
  if (!has_windows(p.fb)) return;
  std::vector<std::byte> mem(256);
  struct bad_case {
    const char* what;
    std::span<std::byte> memory;
    ad::access acc;
  };
  const std::vector<bad_case> cases = {
      {"empty memory", {}, kAll},
      {"no remote right", mem, ad::access::local_write},
      {"remote_write without local_write", mem, ad::access::remote_write},
      {"remote_atomic without local_write", mem, ad::access::remote_atomic},
      {"a flag other than local_write and remote_*", mem, ad::access::remote_read | ad::access::mw_bind},
  };
  std::vector<ad::error_code> got(cases.size());
  failure f;
  asio::co_spawn(p.io, [&]() -> awaitable<void> {
    for (std::size_t i = 0; i < cases.size(); ++i) {
      auto [ec, r] = co_await p.b.async_register_memory(cases[i].memory, cases[i].acc, asio::as_tuple(use_awaitable));
      got[i] = ec;
      CHECK_FALSE(r);
    }
    // The connection is unharmed: read-only exposure works.
    auto [ec, r] = co_await p.b.async_register_memory(mem, ad::access::remote_read, asio::as_tuple(use_awaitable));
    CHECK_FALSE(ec);
    CHECK(r.access() == ad::access::remote_read);
    CHECK(p.b.is_open());
    p.b.abort();
    auto [ec2, r2] = co_await p.b.async_register_memory(mem, kAll, asio::as_tuple(use_awaitable));
    CHECK(ec2 == ad::errc::connection_closed);
    CHECK_FALSE(r2);
    CHECK(r.revoked());
    ad::connection empty;
    auto [ec3, r3] = co_await empty.async_register_memory(mem, kAll, asio::as_tuple(use_awaitable));
    CHECK(ec3 == ad::errc::not_connected);
  }, f.handler());
  run_to_completion(p.io);
  f.check();
  for (std::size_t i = 0; i < cases.size(); ++i) {
    INFO(cases[i].what);
    CHECK(got[i] == ad::errc::invalid_argument);
  }
}

TEST_CASE("connection-scoped memory: a connection that ends while the bind is queued or on the wire", "[onesided]") {
  // The registration ends once, with the connection's error (or, if the bind
  // won the race, as a revoked region), and nothing leaks (LSan). That the
  // window outlives the bind request naming it is test/unit/window_slot.cpp's.
  const int when = GENERATE(0, 1);  // 0: abort at once (bind staged); 1: abort after one poll
  INFO(when);
  onesided_pair p;
  if (!has_windows(p.fb)) return;
  std::vector<std::byte> mem(4096);
  std::optional<ad::error_code> got;
  ad::memory_region kept;
  p.b.async_register_memory(mem, kAll, [&](ad::error_code ec, ad::memory_region r) {
    got = ec;
    kept = std::move(r);
  });
  if (when == 1) p.io.poll_one();
  p.b.abort();
  run_to_completion(p.io);
  REQUIRE(got.has_value());
  if (*got) {
    CHECK_FALSE(kept);
  } else {
    // The bind won the race: the region came out, and the abort revoked it.
    CHECK(kept.revoked());
  }
  CHECK_FALSE(p.b.is_open());
}
