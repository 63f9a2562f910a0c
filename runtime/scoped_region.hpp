// Memory exposed to one connection's peer only (connection::
// async_register_memory): a registration with no remote rights of its own
// (access::mw_bind) and a type-2 memory window bound to the connection's
// queue pair, whose rkey is the only one that opens the memory remotely.
// Runtime-internal.
#pragma once

#include <anydoor/transport/provider.hpp>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>

namespace anydoor::detail {

// The window, shared by the region exposing memory through it and the
// connection whose queue pair it is bound to: whichever ends first revokes
// it (destroys the window: its key stops working). Any thread. While a bind
// of the window is staged or on the queue pair (begin_bind .. end_bind, the
// connection's thread), a revoke only marks it: the window is destroyed when
// the bind completes or is flushed, never under a request that names it.
class window_slot {
 public:
  explicit window_slot(std::unique_ptr<transport::memory_window> w) noexcept : window_(std::move(w)) {}
  void revoke() noexcept;
  // True once the window is destroyed (its key opens nothing).
  bool revoked() const noexcept { return revoked_.load(std::memory_order_acquire); }
  // The window for its bind, or nullptr when revoked (or being revoked).
  transport::memory_window* begin_bind() noexcept;
  void end_bind() noexcept;
  // The bound window's key, when the bind completed and nothing revoked it.
  bool bound_key(std::uint32_t& rkey) noexcept;

 private:
  std::mutex mutex_;
  std::unique_ptr<transport::memory_window> window_;
  bool binding_ = false;
  bool revoke_pending_ = false;
  std::atomic<bool> revoked_{false};
};

class scoped_region final : public transport::memory_region {
 public:
  // mr: the registration (local rights | mw_bind); acc: what the region
  // reports (the local rights and the window's remote ones).
  scoped_region(std::unique_ptr<transport::memory_region> mr, std::shared_ptr<window_slot> slot,
                transport::access acc) noexcept;
  ~scoped_region() override;  // revokes the window, then deregisters

  const transport::memory_region& registration() const noexcept { return *mr_; }
  window_slot& slot() const noexcept { return *slot_; }
  // The bind completed: the window's key becomes the region's rkey. False
  // when the window was revoked meanwhile.
  bool adopt_key() noexcept;
  bool revoked() const noexcept { return slot_->revoked(); }

 private:
  // Declared in this order so that the slot (and with it the window, if
  // nothing else holds it) goes before the registration.
  std::unique_ptr<transport::memory_region> mr_;
  std::shared_ptr<window_slot> slot_;
};

}  // namespace anydoor::detail
