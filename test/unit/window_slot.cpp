// The runtime's window slot (runtime/scoped_region.hpp): a revoke destroys
// the window at once, except while a bind of it is staged or on the queue
// pair; then the window lives until end_bind, so no request ever names a
// destroyed window.
#include "scoped_region.hpp"

#include <catch2/catch.hpp>

#include <memory>

namespace {

class fake_window final : public anydoor::transport::memory_window {
 public:
  explicit fake_window(bool& alive) noexcept : memory_window(0x100), alive_(alive) { alive_ = true; }
  ~fake_window() override { alive_ = false; }

 private:
  bool& alive_;
};

}  // namespace

TEST_CASE("window slot: a revoke during a bind waits for the bind's end", "[unit]") {
  using anydoor::detail::window_slot;
  bool alive = false;
  SECTION("no bind: revoked at once") {
    window_slot slot(std::make_unique<fake_window>(alive));
    REQUIRE(alive);
    slot.revoke();
    CHECK_FALSE(alive);
    CHECK(slot.revoked());
    CHECK(slot.begin_bind() == nullptr);
    slot.end_bind();  // harmless without a bind
    slot.revoke();    // and a second revoke
    CHECK(slot.revoked());
  }
  SECTION("revoke while binding: deferred to end_bind") {
    window_slot slot(std::make_unique<fake_window>(alive));
    REQUIRE(slot.begin_bind() != nullptr);
    slot.revoke();
    CHECK(alive);                 // the bind request still names it
    CHECK_FALSE(slot.revoked());  // and its key is not dead yet
    std::uint32_t key = 0;
    CHECK_FALSE(slot.bound_key(key));     // a bind that completes now is not handed out
    CHECK(slot.begin_bind() == nullptr);  // nor is another bind started
    slot.end_bind();
    CHECK_FALSE(alive);
    CHECK(slot.revoked());
  }
  SECTION("a bind that ends without a revoke leaves the window") {
    window_slot slot(std::make_unique<fake_window>(alive));
    REQUIRE(slot.begin_bind() != nullptr);
    slot.end_bind();
    CHECK(alive);
    CHECK_FALSE(slot.revoked());
    std::uint32_t key = 0;
    CHECK_FALSE(slot.bound_key(key));  // never bound (bound() false)
    slot.revoke();
    CHECK_FALSE(alive);
  }
}
