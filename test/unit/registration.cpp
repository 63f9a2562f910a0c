// The tcp provider's registration table under threads: a deregistration
// waits for the access in progress and no access starts after it (as a NIC
// never touches a region after ibv_dereg_mr returns). ThreadSanitizer and
// AddressSanitizer check the memory: it is freed right after remove().
#include "tcp/tcp_provider.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

using anydoor::transport::access;
using anydoor::transport::tcp::registration_table;

TEST_CASE("tcp provider: deregistration waits for an access in progress, and none starts after it", "[unit][tcp]") {
  // Directly, or through a memory window bound to the registration (the
  // window stays; deregistering its registration cuts it off).
  const bool window = GENERATE(false, true);
  CAPTURE(window);
  for (int round = 0; round < 20; ++round) {
    registration_table table;
    auto mem = std::make_unique<std::byte[]>(4096);
    const auto addr = reinterpret_cast<std::uint64_t>(mem.get());
    const std::uint32_t reg = table.add(mem.get(), 4096,
                                        access::local_write | (window ? access::mw_bind : access::remote_write));
    REQUIRE(reg != 0);
    std::uint32_t key = reg;
    if (window) key = table.bind(table.add_window(), reg, addr, 4096, access::remote_write, 1);
    REQUIRE(key != 0);
    std::atomic<bool> removed{false};
    std::atomic<bool> started{false};
    std::uint64_t accesses = 0, while_removed = 0;
    bool refused = false;
    std::thread accessor([&] {
      for (;;) {
        std::byte* p = table.pin(key, addr + 64, 256, access::remote_write, 1);
        if (p == nullptr) {
          refused = true;
          return;
        }
        std::memset(p, round, 256);  // the bytes a write delivers
        if (removed.load()) ++while_removed;  // remove() returned while this pin was held
        ++accesses;
        started.store(true);
        table.unpin(key);
      }
    });
    while (!started.load()) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::microseconds(200 * round));
    table.remove(reg);
    removed.store(true);
    mem.reset();  // the application frees the buffer at once
    accessor.join();
    CHECK(refused);
    CHECK(accesses > 0);
    CHECK(while_removed == 0);
    CHECK(table.pin(key, addr + 64, 256, access::remote_write, 1) == nullptr);
  }
}

TEST_CASE("tcp provider: a memory window answers to its queue pair only, within its range and rights", "[unit][tcp]") {
  registration_table t;
  std::vector<std::byte> mem(4096);
  const auto addr = reinterpret_cast<std::uint64_t>(mem.data());
  const std::uint32_t parent = t.add(mem.data(), mem.size(), access::local_write | access::mw_bind);
  const std::uint32_t unbound = t.add_window();
  REQUIRE(parent != 0);
  REQUIRE(unbound != 0);
  // Unbound: opens nothing, for anyone.
  CHECK(t.check(unbound, 0, 0, access::none, 5) == nullptr);
  CHECK(t.check(unbound, addr, 8, access::remote_write, 5) == nullptr);
  CHECK(t.bind(unbound, parent, addr + 64, 256, access::remote_write, 0) == 0);  // local use cannot own it
  const std::uint32_t w = t.bind(unbound, parent, addr + 64, 256, access::remote_write | access::remote_read, 5);
  REQUIRE(w != 0);
  CHECK(w != unbound);
  CHECK(t.check(unbound, addr + 64, 8, access::remote_write, 5) == nullptr);  // the old key is gone
  CHECK(t.bind(w, parent, addr, 8, access::remote_read, 5) == 0);              // bound once
  CHECK(t.check(w, addr + 64, 256, access::remote_write, 5) != nullptr);
  CHECK(t.check(w, addr + 64, 8, access::remote_read, 5) != nullptr);
  CHECK(t.check(w, addr + 64, 8, access::remote_write, 6) == nullptr);   // another queue pair
  CHECK(t.check(w, addr + 64, 8, access::none, 0) == nullptr);           // not an lkey
  CHECK(t.check(w, addr, 8, access::remote_write, 5) == nullptr);        // in the registration, not the window
  CHECK(t.check(w, addr + 64, 257, access::remote_write, 5) == nullptr);
  CHECK(t.check(w, addr + 64, 8, access::remote_atomic, 5) == nullptr);  // not granted
  CHECK(t.check(parent, addr + 64, 8, access::remote_write, 5) == nullptr);  // the registration has no remote rights
  CHECK(t.check(parent, addr + 64, 8, access::local_write, 0) != nullptr);
  // A pin through the window holds the registration too; unpin releases both
  // (a leaked pin would make remove() below wait forever).
  REQUIRE(t.pin(w, addr + 64, 8, access::remote_write, 5) != nullptr);
  t.unpin(w);
  std::byte* other_qp = t.pin(w, addr + 64, 8, access::remote_write, 6);
  CHECK(other_qp == nullptr);
  if (other_qp != nullptr) t.unpin(w);
  // A window bound to another window, or to a registration that is gone, fails.
  const std::uint32_t second = t.add_window();
  CHECK(t.bind(second, w, addr + 64, 8, access::remote_read, 5) == 0);
  t.remove(parent);
  CHECK(t.check(w, addr + 64, 8, access::remote_write, 5) == nullptr);
  CHECK(t.pin(w, addr + 64, 8, access::remote_write, 5) == nullptr);
  CHECK(t.bind(second, parent, addr + 64, 8, access::remote_read, 5) == 0);
  t.remove(w);
  t.remove(second);
}
