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

using anydoor::transport::access;
using anydoor::transport::tcp::registration_table;

TEST_CASE("tcp provider: deregistration waits for an access in progress, and none starts after it", "[unit][tcp]") {
  for (int round = 0; round < 20; ++round) {
    registration_table table;
    auto mem = std::make_unique<std::byte[]>(4096);
    const auto addr = reinterpret_cast<std::uint64_t>(mem.get());
    const std::uint32_t key = table.add(mem.get(), 4096, access::local_write | access::remote_write);
    REQUIRE(key != 0);
    std::atomic<bool> removed{false};
    std::atomic<bool> started{false};
    std::uint64_t accesses = 0, while_removed = 0;
    bool refused = false;
    std::thread accessor([&] {
      for (;;) {
        std::byte* p = table.pin(key, addr + 64, 256, access::remote_write);
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
    table.remove(key);
    removed.store(true);
    mem.reset();  // the application frees the buffer at once
    accessor.join();
    CHECK(refused);
    CHECK(accesses > 0);
    CHECK(while_removed == 0);
    CHECK(table.pin(key, addr + 64, 256, access::remote_write) == nullptr);
  }
}
