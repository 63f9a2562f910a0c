// The free lists behind "an idle connection holds nothing": the tcp
// provider's per-completion-queue stashes (receive staging, transmit
// batches) and the fabric's operation nodes and doorbell batches. Each
// grows to the most in use at once, is reused, and shrinks again after a
// burst, never under a steady load.
#include "tcp/tcp_provider.hpp"

#include "fabric_state.hpp"

#include <boost/asio/io_context.hpp>
#include <catch2/catch.hpp>

#include <algorithm>
#include <vector>

namespace tcp = anydoor::transport::tcp;

TEST_CASE("tcp free_stash: reused, grown to the most taken at once, shrunk after a burst", "[unit]") {
  tcp::free_stash<std::array<std::byte, 4096>> stash;
  // A steady load of 10 at a time: made once, then only reused.
  for (int round = 0; round < 50; ++round) {
    std::vector<std::array<std::byte, 4096>*> held;
    for (int i = 0; i < 10; ++i) {
      held.push_back(stash.take());
      REQUIRE(held.back() != nullptr);
    }
    for (auto* p : held) stash.give(p);
  }
  CHECK(stash.created() == 10);
  CHECK(stash.free_count() == 10);
  // A burst of 100: all made; as they come back, once more than twice
  // max(16, twice those still out) wait, the rest beyond that is freed.
  std::vector<std::array<std::byte, 4096>*> burst;
  for (int i = 0; i < 100; ++i) burst.push_back(stash.take());
  CHECK(stash.created() == 100);
  CHECK(stash.free_count() == 0);
  for (std::size_t i = 0; i < 95; ++i) {
    stash.give(burst[i]);
    const std::size_t out = 100 - (i + 1);
    CHECK(stash.created() - stash.free_count() == out);
    CHECK(stash.free_count() <= 2 * std::max<std::size_t>(16, 2 * out));
  }
  for (std::size_t i = 95; i < 100; ++i) stash.give(burst[i]);
  CHECK(stash.free_count() == stash.created());
  CHECK(stash.created() <= 32);
  CHECK(stash.created() >= 16);
  // What stays is reused: a load of 10 again makes nothing.
  const std::size_t made = stash.created();
  std::vector<std::array<std::byte, 4096>*> again;
  for (int i = 0; i < 10; ++i) again.push_back(stash.take());
  for (auto* p : again) stash.give(p);
  CHECK(stash.created() == made);
}

TEST_CASE("fabric free lists: operation nodes and doorbell batches are reused and trimmed after a burst", "[unit]") {
  boost::asio::io_context io;
  anydoor::fabric_options o;
  o.device.provider = "tcp";
  auto fs = std::make_shared<anydoor::detail::fabric_state>(io, o);
  std::vector<anydoor::detail::op_node*> nodes;
  std::vector<anydoor::detail::doorbell_batch*> batches;
  for (int i = 0; i < 200; ++i) {
    nodes.push_back(fs->take_node());
    batches.push_back(fs->take_batch(16, 32, 4096));
    REQUIRE(batches.back() != nullptr);
  }
  CHECK(batches.front()->wrs.capacity() >= 16);
  CHECK(batches.front()->sges.size() == 32);
  CHECK(batches.front()->inline_bytes.size() == 4096);
  CHECK(fs->nodes_made() == 200);
  CHECK(fs->batches_made() == 200);
  // Back, but 3 still in use (marked, to see they are left alone).
  for (std::size_t i = 0; i < 3; ++i) {
    nodes[i]->cookie = 0xc0de0 + static_cast<std::uint32_t>(i);
    batches[i]->inline_bytes[17] = std::byte{0x5a};
  }
  for (std::size_t i = 3; i < nodes.size(); ++i) fs->give_node(nodes[i]);
  for (std::size_t i = 3; i < batches.size(); ++i) fs->give_batch(batches[i]);
  // The first tick after the burst keeps twice the most in use since the
  // last one (200): a load that comes back each second keeps what it needs.
  fs->trim_free_lists();
  CHECK(fs->nodes_made() == 200);
  CHECK(fs->batches_made() == 200);
  // The next keeps max(16, 2 x 3).
  fs->trim_free_lists();
  CHECK(fs->nodes_made() == 3 + 16);
  CHECK(fs->nodes_free() == 16);
  CHECK(fs->batches_made() == 3 + 16);
  CHECK(fs->batches_free() == 16);
  // Those still in use were not touched: they come back and are reused.
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(nodes[i]->cookie == 0xc0de0 + i);
    CHECK(batches[i]->inline_bytes[17] == std::byte{0x5a});
    fs->give_node(nodes[i]);
    fs->give_batch(batches[i]);
  }
  fs->trim_free_lists();  // 19 free, none in use: 16 stay
  CHECK(fs->nodes_made() == 16);
  CHECK(fs->batches_made() == 16);
  // A steady load within what is kept makes nothing and frees nothing.
  for (int round = 0; round < 20; ++round) {
    std::vector<anydoor::detail::op_node*> n;
    for (int i = 0; i < 10; ++i) n.push_back(fs->take_node());
    for (auto* p : n) fs->give_node(p);
    fs->trim_free_lists();
  }
  CHECK(fs->nodes_made() == 16);
  CHECK(fs->nodes_free() == 16);
}
