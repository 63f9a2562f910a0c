#include <anydoor/error.hpp>
#include <anydoor/memory.hpp>

#include "bytes.hpp"
#include "scoped_region.hpp"

#include <cstring>
#include <string>

namespace anydoor {

namespace {

using detail::fnv1a32;
using detail::get_le;
using detail::put_le;

constexpr std::array<std::byte, 4> kMagic{std::byte{'A'}, std::byte{'D'}, std::byte{'R'}, std::byte{'R'}};
constexpr std::uint8_t kVersion = 1;

[[noreturn]] void out_of_range(const char* what, std::uint64_t offset, std::uint64_t len, std::uint64_t size) {
  throw std::system_error(errc::out_of_range, std::string(what) + ": [" + std::to_string(offset) + ", +" +
                                                  std::to_string(len) + ") outside a region of " +
                                                  std::to_string(size) + " bytes");
}

}  // namespace

// ---------------------------------------------------------------- remote_region

remote_region remote_region::at(std::uint64_t offset, std::uint64_t len) const {
  if (offset > length || len > length - offset) out_of_range("remote_region::at", offset, len, length);
  return {addr + offset, len, rkey};
}

std::array<std::byte, remote_region::packed_size> remote_region::pack() const noexcept {
  std::array<std::byte, packed_size> out{};
  std::memcpy(out.data(), kMagic.data(), kMagic.size());
  out[4] = std::byte{kVersion};
  std::byte* p = out.data() + 8;
  put_le(p, addr);
  put_le(p, length);
  put_le(p, rkey);
  put_le(p, fnv1a32(out.data(), 28));
  return out;
}

std::error_code remote_region::unpack(std::span<const std::byte> in, remote_region& out) noexcept {
  if (in.size() != packed_size || std::memcmp(in.data(), kMagic.data(), kMagic.size()) != 0) {
    return errc::protocol_error;
  }
  const std::byte* p = in.data() + 28;
  if (get_le<std::uint32_t>(p) != fnv1a32(in.data(), 28)) return errc::protocol_error;
  if (std::to_integer<std::uint8_t>(in[4]) != kVersion) return errc::version_mismatch;
  if (in[5] != std::byte{0} || in[6] != std::byte{0} || in[7] != std::byte{0}) return errc::protocol_error;
  p = in.data() + 8;
  remote_region r;
  r.addr = get_le<std::uint64_t>(p);
  r.length = get_le<std::uint64_t>(p);
  r.rkey = get_le<std::uint32_t>(p);
  if (r.length == 0 || r.addr + r.length < r.addr) return errc::protocol_error;
  out = r;
  return {};
}

// ---------------------------------------------------------------- memory_region

memory_region::memory_region() noexcept = default;
memory_region::memory_region(std::unique_ptr<transport::memory_region> mr) noexcept : mr_(std::move(mr)) {}
memory_region::memory_region(memory_region&&) noexcept = default;
memory_region& memory_region::operator=(memory_region&&) noexcept = default;
memory_region::~memory_region() = default;

std::byte* memory_region::data() const noexcept { return mr_ ? static_cast<std::byte*>(mr_->addr()) : nullptr; }
std::size_t memory_region::size() const noexcept { return mr_ ? mr_->length() : 0; }
access memory_region::access() const noexcept { return mr_ ? mr_->access() : access::none; }
std::uint32_t memory_region::lkey() const noexcept { return mr_ ? mr_->lkey() : 0; }
std::uint32_t memory_region::rkey() const noexcept { return mr_ ? mr_->rkey() : 0; }

remote_region memory_region::remote() const noexcept {
  if (!mr_) return {};
  return {reinterpret_cast<std::uint64_t>(mr_->addr()), mr_->length(), mr_->rkey()};
}

local_range memory_region::at(std::size_t offset, std::size_t len) const {
  const std::size_t n = size();
  if (offset > n || len > n - offset) out_of_range("memory_region::at", offset, len, n);
  return {data() + offset, len, this};
}

void memory_region::reset() noexcept { mr_.reset(); }

bool memory_region::connection_scoped() const noexcept {
  return dynamic_cast<const detail::scoped_region*>(mr_.get()) != nullptr;
}

bool memory_region::revoked() const noexcept {
  const auto* s = dynamic_cast<const detail::scoped_region*>(mr_.get());
  return s != nullptr && s->revoked();
}

}  // namespace anydoor

// ---------------------------------------------------------------- connection-scoped regions

namespace anydoor::detail {

void window_slot::revoke() noexcept {
  // Destroyed under the lock: a second revoke (the region's destructor on
  // another thread) returns only once the key is dead, so the registration
  // is never deregistered under a bound window.
  std::lock_guard lock(mutex_);
  if (binding_) {
    revoke_pending_ = true;  // end_bind destroys it
    return;
  }
  window_.reset();
  revoked_.store(true, std::memory_order_release);
}

transport::memory_window* window_slot::begin_bind() noexcept {
  std::lock_guard lock(mutex_);
  if (revoke_pending_ || window_ == nullptr) return nullptr;
  binding_ = true;
  return window_.get();
}

void window_slot::end_bind() noexcept {
  std::lock_guard lock(mutex_);
  if (!binding_) return;
  binding_ = false;
  if (revoke_pending_) {
    window_.reset();
    revoked_.store(true, std::memory_order_release);
  }
}

bool window_slot::bound_key(std::uint32_t& rkey) noexcept {
  std::lock_guard lock(mutex_);
  if (revoke_pending_ || window_ == nullptr || !window_->bound()) return false;
  rkey = window_->rkey();
  return true;
}

scoped_region::scoped_region(std::unique_ptr<transport::memory_region> mr, std::shared_ptr<window_slot> slot,
                             transport::access acc) noexcept
    : transport::memory_region(mr->addr(), mr->length(), mr->lkey(), 0, acc), mr_(std::move(mr)),
      slot_(std::move(slot)) {}

scoped_region::~scoped_region() { slot_->revoke(); }

bool scoped_region::adopt_key() noexcept {
  std::uint32_t rkey = 0;
  if (!slot_->bound_key(rkey)) return false;
  set_remote_key(rkey);
  return true;
}

}  // namespace anydoor::detail
