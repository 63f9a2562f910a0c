// The kv client's GET by READ when memory runs out as its two READs start
// (the location cache's pair: the neighbourhood and the item, in flight at
// once). A READ that cannot start (std::bad_alloc: the fabric's pool of
// operation nodes is empty and a new node cannot be made) leaves the
// initiation as Asio's own operations do, out of the io_context's run();
// the waiting coroutine is never resumed, and its frames are freed once
// the other READ, if it started, has completed: never leaked, never freed
// under a READ still in flight.
//
// operator new is replaced in this binary (support/replaced_new.hpp):
// while `fail_size` is set on this thread, allocations of exactly that many
// bytes (an operation node's) throw. Pending receives on an idle
// connection take the nodes the pool holds until one cannot be made, so
// the pool is known to be empty; one message to that connection then gives
// exactly one node back. (Not under sanitizers: they replace operator new.)
#include "../support/replaced_new.hpp"
#include "../support/runtime.hpp"
#include "kv/client.hpp"
#include "kv_rig.hpp"

#include <anydoor/detail/op_node.hpp>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/steady_timer.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <new>
#include <string>

using namespace anydoor::apps::kv;
using anydoor::test::addr;
using anydoor::test::failure;
using anydoor::test::test_host;
using anydoor::test::test_options;
using anydoor::test::until;
namespace alloc = anydoor::test::alloc;

namespace {

std::span<const std::byte> B(std::string_view s) { return {reinterpret_cast<const std::byte*>(s.data()), s.size()}; }

struct flag_on_destroy {
  bool* gone;
  ~flag_on_destroy() { *gone = true; }
};

// A GET by READ whose end (resumed, or its frames destroyed) the test sees.
asio::awaitable<void> watched_get(client& cli, client::reader& r, std::string key, bool& gone, bool& resumed) {
  flag_on_destroy flag{&gone};
  std::string got;
  co_await cli.read_get(r, key, got);
  resumed = true;
}

}  // namespace

TEST_CASE("kv client: a READ pair that cannot start for want of memory frees the waiting GET - never leaked, never "
          "freed under a READ in flight",
          "[kv][oom]") {
  asio::io_context io;
  anydoor::test::kv_rig rig(io, {.max_memory = 1 << 20, .max_key = 64, .max_value = 4096});
  anydoor::fabric& sfab = rig.sfab;
  anydoor::fabric& cfab = rig.cfab;
  const std::string& where = rig.where;
  anydoor::acceptor idle_acc = sfab.listen(test_host(), 0);
  // (io.run() below is run again after each exception it lets out: this
  // bounds the whole test instead of a watchdog thread.)
  bool timed_out = false;
  asio::steady_timer guard(io, std::chrono::seconds(60));
  guard.async_wait([&](anydoor::error_code ec) {
    if (!ec) {
      timed_out = true;
      io.stop();
    }
  });
  const std::string key = "key", value(200, 'v');  // an arena item: READ beside its neighbourhood once cached
  bool gone_a = false, resumed_a = false, ended_a = false;
  bool gone_b = false, resumed_b = false, ended_b = false;
  std::uint64_t refused_a = 0, refused_b = 0;
  int waiting = 0, received = 0;  // the idle connection's receives
  bool driver_done = false;
  failure f;
  asio::co_spawn(io, [&]() -> asio::awaitable<void> {
    client cli(cfab, co_await cfab.async_connect(where, asio::use_awaitable), std::chrono::seconds(10));
    anydoor::rpc::status s = co_await cli.fetch_layout();
    REQUIRE(s.is_ok());
    client::reader r = cli.make_reader();
    s = co_await cli.put(key, B(value));
    REQUIRE(s.is_ok());
    std::string got;
    s = co_await cli.read_get(r, key, got);  // caches the item's place
    REQUIRE(s.is_ok());
    s = co_await cli.read_get(r, key, got);  // a pair: neighbourhood and item
    REQUIRE(s.is_ok());
    REQUIRE(cli.reads().ahead == 1);
    REQUIRE(got == value);

    anydoor::connection idle_peer;
    idle_acc.async_accept([&](anydoor::error_code, anydoor::connection c) { idle_peer = std::move(c); });
    anydoor::connection idle = co_await cfab.async_connect(addr(idle_acc), asio::use_awaitable);
    const bool accepted = co_await until([&] { return static_cast<bool>(idle_peer); });
    REQUIRE(accepted);

    // No memory for a new node; receives take every node the pool holds.
    alloc::refused = 0;
    alloc::fail_size = sizeof(anydoor::detail::op_node);
    for (;;) {
      try {
        idle.async_receive([&](anydoor::error_code, anydoor::message) { ++received; });
      } catch (const std::bad_alloc&) {
        break;
      }
      ++waiting;
      REQUIRE(waiting < 100000);
    }
    REQUIRE(alloc::refused == 1);

    // A: the first READ cannot start. Nothing is in flight; the GET's
    // frames are freed, and it is never resumed.
    asio::co_spawn(io, watched_get(cli, r, key, gone_a, resumed_a), [&](std::exception_ptr) { ended_a = true; });
    co_await until([&] { return gone_a; }, std::chrono::seconds(5), std::chrono::milliseconds(1));
    refused_a = alloc::refused - 1;

    // B: one node back (a message for one of the receives): the
    // neighbourhood's READ starts, the item's cannot. The frames are freed
    // only once the first READ has completed into them.
    co_await idle_peer.async_send(asio::buffer("x", 1), asio::use_awaitable);
    const bool one_back = co_await until([&] { return received == 1; });
    REQUIRE(one_back);
    const std::uint64_t before_b = alloc::refused;
    const auto reads_before = cli.reads();
    asio::co_spawn(io, watched_get(cli, r, key, gone_b, resumed_b), [&](std::exception_ptr) { ended_b = true; });
    co_await until([&] { return gone_b; }, std::chrono::seconds(5), std::chrono::milliseconds(1));
    refused_b = alloc::refused - before_b;
    CHECK(cli.reads().ahead == reads_before.ahead + 1);

    // Memory is back: the same client GETs by READ again, in pairs.
    alloc::fail_size = 0;
    got.clear();
    s = co_await cli.read_get(r, key, got);
    CHECK(s.is_ok());
    CHECK(got == value);
    CHECK(cli.reads().ahead == reads_before.ahead + 2);
    co_await idle.async_close(asio::as_tuple(asio::use_awaitable));
    co_await idle_peer.async_close(asio::as_tuple(asio::use_awaitable));
    rig.srv.stop();
    driver_done = true;
    // A frame never freed keeps co_spawn's work (io.run() would not
    // return): stopped then, for the checks below to fail.
    if (gone_a && gone_b) guard.cancel();
    else io.stop();
  }, f.handler());
  int escaped = 0;
  bool gone_b_at_escape = false;  // B's frames freed before its first READ could complete
  for (;;) {
    try {
      io.run();
      break;
    } catch (const std::bad_alloc&) {
      ++escaped;  // out of a READ's start, as Asio's own operations let it out
      if (escaped == 2) gone_b_at_escape = gone_b;
    }
  }
  alloc::fail_size = 0;
  f.check();
  CHECK_FALSE(timed_out);
  CHECK(driver_done);
  CHECK(escaped == 2);
  CHECK(refused_a == 1);
  CHECK(refused_b == 1);
  CHECK(gone_a);  // the kept handler, and with it the frames, destroyed
  CHECK_FALSE(resumed_a);
  CHECK_FALSE(ended_a);
  CHECK_FALSE(gone_b_at_escape);  // (the neighbourhood's READ still pointed into them)
  CHECK(gone_b);
  CHECK_FALSE(resumed_b);
  CHECK_FALSE(ended_b);
  CHECK(waiting >= 1);
  CHECK(received == waiting);  // the rest ended with the idle connection's close
}
