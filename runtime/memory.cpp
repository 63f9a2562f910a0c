#include <anydoor/error.hpp>
#include <anydoor/memory.hpp>

#include "bytes.hpp"
#include "scoped_region.hpp"
#include "split_region.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <string>
#include <utility>

namespace anydoor {

namespace {

using detail::fnv1a32;
using detail::get_le;
using detail::put_le;

constexpr std::array<std::byte, 4> kMagic{std::byte{'A'}, std::byte{'D'}, std::byte{'R'}, std::byte{'R'}};
constexpr std::uint8_t kVersion = 1;        // a region in one piece
constexpr std::uint8_t kVersionPieces = 2;  // a region in pieces

[[noreturn]] void out_of_range(const char* what, std::uint64_t offset, std::uint64_t len, std::uint64_t size) {
  throw std::system_error(errc::out_of_range, std::string(what) + ": [" + std::to_string(offset) + ", +" +
                                                  std::to_string(len) + ") outside a region of " +
                                                  std::to_string(size) + " bytes");
}

}  // namespace

// ---------------------------------------------------------------- remote_region

bool operator==(const remote_pieces& a, const remote_pieces& b) noexcept {
  if (a.count_ != b.count_) return false;
  if (a.count_ == 0) return true;
  if (a.shift_ != b.shift_ || a.base_ != b.base_) return false;
  for (std::uint32_t i = 0; i < a.count_; ++i) {
    if (a.key(i) != b.key(i)) return false;
  }
  return true;
}

remote_region remote_region::at(std::uint64_t offset, std::uint64_t len) const {
  if (offset > length || len > length - offset) out_of_range("remote_region::at", offset, len, length);
  const std::uint64_t a = addr + offset;
  if (pieces.empty()) return {addr + offset, len, rkey};
  // Only the pieces [a, a + len) touches (an empty range: the piece of its
  // address, or of the last byte at the end).
  const std::uint64_t first = len == 0 && offset == length ? a - 1 : a;
  const std::uint64_t last = len == 0 ? first : a + len - 1;
  if (!pieces.covers(first, last - first + 1)) out_of_range("remote_region::at (pieces)", offset, len, length);
  remote_region r{a, len, pieces.key_at(first)};
  const std::uint32_t count = static_cast<std::uint32_t>((last >> pieces.shift_) - (first >> pieces.shift_) + 1);
  if (count > 1) {
    r.pieces.base_ = first >> pieces.shift_;
    const auto skip = static_cast<std::uint32_t>(r.pieces.base_ - pieces.base_);
    for (std::uint32_t i = 0; i < count; ++i) r.pieces.keys_[i] = pieces.keys_[skip + i];
    r.pieces.count_ = count;
    r.pieces.shift_ = pieces.shift_;
  }
  return r;
}

std::vector<std::byte> remote_region::pack() const {
  std::vector<std::byte> out(packed_length());
  pack_into(out);
  return out;
}

std::size_t remote_region::pack_into(std::span<std::byte> out_bytes) const noexcept {
  const std::size_t n = packed_length();
  if (out_bytes.size() < n) return 0;
  const std::span<std::byte> out = out_bytes.first(n);
  std::fill(out.begin(), out.end(), std::byte{0});
  std::memcpy(out.data(), kMagic.data(), kMagic.size());
  std::byte* p = out.data() + 8;
  if (pieces.empty()) {
    out[4] = std::byte{kVersion};
    put_le(p, addr);
    put_le(p, length);
    put_le(p, rkey);
  } else {
    out[4] = std::byte{kVersionPieces};
    out[5] = std::byte{pieces.shift_};
    put_le(p, addr);
    put_le(p, length);
    put_le(p, pieces.count_);
    for (std::uint32_t i = 0; i < pieces.count_; ++i) put_le(p, pieces.key(i));
  }
  put_le(p, fnv1a32(out.data(), out.size() - 4));
  return n;
}

std::size_t remote_region::packed_length_of(std::span<const std::byte> in) noexcept {
  if (in.size() < packed_size || std::memcmp(in.data(), kMagic.data(), kMagic.size()) != 0) return 0;
  const auto version = std::to_integer<std::uint8_t>(in[4]);
  if (version != kVersionPieces) return packed_size;  // version 1, or one unpack refuses
  const std::byte* p = in.data() + 24;
  const auto count = get_le<std::uint32_t>(p);
  if (count < 2 || count > max_pieces) return 0;
  return packed_size + 4 * std::size_t{count};
}

std::error_code remote_region::unpack(std::span<const std::byte> in, remote_region& out) noexcept {
  if (in.size() < packed_size || std::memcmp(in.data(), kMagic.data(), kMagic.size()) != 0) {
    return errc::protocol_error;
  }
  const auto version = std::to_integer<std::uint8_t>(in[4]);
  if (version == kVersionPieces) {
    if (packed_length_of(in) != in.size()) return errc::protocol_error;
  } else if (in.size() != packed_size) {
    return errc::protocol_error;
  }
  const std::byte* p = in.data() + in.size() - 4;
  if (get_le<std::uint32_t>(p) != fnv1a32(in.data(), in.size() - 4)) return errc::protocol_error;
  if (version != kVersion && version != kVersionPieces) return errc::version_mismatch;
  const std::uint8_t shift = version == kVersionPieces ? std::to_integer<std::uint8_t>(in[5]) : 0;
  if ((version == kVersion && in[5] != std::byte{0}) || in[6] != std::byte{0} || in[7] != std::byte{0}) {
    return errc::protocol_error;
  }
  p = in.data() + 8;
  remote_region r;
  r.addr = get_le<std::uint64_t>(p);
  r.length = get_le<std::uint64_t>(p);
  if (r.length == 0 || r.addr + r.length < r.addr) return errc::protocol_error;
  if (version == kVersion) {
    r.rkey = get_le<std::uint32_t>(p);
    out = std::move(r);
    return {};
  }
  // Pieces: exactly the blocks the range touches, at least two.
  if (shift < 12 || shift > 62) return errc::protocol_error;
  const std::uint32_t count = get_le<std::uint32_t>(p);
  const std::uint64_t first = r.addr >> shift;
  if ((r.addr + r.length - 1) >> shift != first + count - 1) return errc::protocol_error;
  for (std::uint32_t i = 0; i < count; ++i) r.pieces.keys_[i] = get_le<std::uint32_t>(p);
  r.pieces.base_ = first;
  r.pieces.count_ = count;
  r.pieces.shift_ = shift;
  r.rkey = r.pieces.key(0);
  out = std::move(r);
  return {};
}

// ---------------------------------------------------------------- memory_region

memory_region::memory_region() noexcept = default;
memory_region::memory_region(std::unique_ptr<transport::memory_region> mr) noexcept
    : mr_(std::move(mr)), split_(detail::as_split(mr_.get())) {}
memory_region::memory_region(std::unique_ptr<transport::memory_region> mr, memory_kind kind) noexcept
    : mr_(std::move(mr)), split_(detail::as_split(mr_.get())), kind_(kind) {}
memory_region::memory_region(memory_region&& o) noexcept
    : mr_(std::move(o.mr_)), split_(std::exchange(o.split_, nullptr)), kind_(std::exchange(o.kind_, memory_kind::host)) {}
memory_region& memory_region::operator=(memory_region&& o) noexcept {
  if (this != &o) {
    mr_ = std::move(o.mr_);
    split_ = std::exchange(o.split_, nullptr);
    kind_ = std::exchange(o.kind_, memory_kind::host);
  }
  return *this;
}
memory_region::~memory_region() = default;

std::byte* memory_region::data() const noexcept { return mr_ ? static_cast<std::byte*>(mr_->addr()) : nullptr; }
std::size_t memory_region::size() const noexcept { return mr_ ? mr_->length() : 0; }
access memory_region::access() const noexcept { return mr_ ? mr_->access() : access::none; }
std::uint32_t memory_region::lkey() const noexcept { return mr_ ? mr_->lkey() : 0; }
std::uint32_t memory_region::rkey() const noexcept { return mr_ ? mr_->rkey() : 0; }
std::size_t memory_region::pieces() const noexcept { return split_ != nullptr ? split_->count() : mr_ ? 1 : 0; }

remote_region memory_region::remote() const noexcept {
  if (!mr_) return {};
  remote_region r{reinterpret_cast<std::uint64_t>(mr_->addr()), mr_->length(), mr_->rkey()};
  if (split_ != nullptr) {
    for (std::uint32_t i = 0; i < split_->count(); ++i) r.pieces.keys_[i] = split_->rkeys()[i];
    r.pieces.base_ = split_->base();
    r.pieces.count_ = split_->count();
    r.pieces.shift_ = static_cast<std::uint8_t>(split_->shift());
  }
  return r;
}

local_range memory_region::at(std::size_t offset, std::size_t len) const {
  const std::size_t n = size();
  if (offset > n || len > n - offset) out_of_range("memory_region::at", offset, len, n);
  return {data() + offset, len, this};
}

void memory_region::reset() noexcept {
  split_ = nullptr;
  kind_ = memory_kind::host;
  mr_.reset();
}

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

// ---------------------------------------------------------------- registrations in pieces

namespace anydoor::detail {

split_region::split_region(transport::protection_domain& pd, void* addr, std::size_t length, transport::access acc,
                           unsigned shift)
    : transport::memory_region(addr, length, 0, 0, acc) {
  auto t = std::make_shared<piece_table>();
  const auto begin = reinterpret_cast<std::uint64_t>(addr);
  t->end = begin + length;
  t->base = begin >> shift;
  t->shift = shift;
  const std::uint64_t count = ((t->end - 1) >> shift) - t->base + 1;
  pieces_.reserve(count);
  t->lkeys = std::make_unique<std::uint32_t[]>(count);
  rkeys_ = std::make_unique<std::uint32_t[]>(count);
  for (std::uint64_t a = begin; a < t->end; a = t->piece_end(a)) {
    auto piece = pd.register_memory(reinterpret_cast<void*>(a), t->piece_end(a) - a, acc);
    const std::size_t i = pieces_.size();
    t->lkeys[i] = piece->lkey();
    rkeys_[i] = piece->rkey();
    pieces_.push_back(std::move(piece));
  }
  set_keys(t->lkeys[0], rkeys_[0]);
  table_ = std::move(t);
}

unsigned piece_shift(std::uint64_t limit) noexcept {
  if (limit < 4096) return 0;
  return static_cast<unsigned>(std::bit_width(limit) - 1);
}

std::unique_ptr<transport::memory_region> register_in_pieces(transport::protection_domain& pd, void* addr,
                                                             std::size_t length, transport::access acc,
                                                             unsigned shift) {
  if (shift >= 64 || length <= (std::uint64_t{1} << shift)) return pd.register_memory(addr, length, acc);
  const auto begin = reinterpret_cast<std::uint64_t>(addr);
  const std::uint64_t count = ((begin + length - 1) >> shift) - (begin >> shift) + 1;
  if (count > remote_region::max_pieces) {
    throw std::system_error(errc::registration_failed,
                            "registering " + std::to_string(length) + " bytes would take " + std::to_string(count) +
                                " pieces of at most " + std::to_string(std::uint64_t{1} << shift) +
                                " bytes, more than remote_region::max_pieces (" +
                                std::to_string(remote_region::max_pieces) +
                                "): register it as several regions (or raise fabric_options::max_piece_bytes)");
  }
  return std::make_unique<split_region>(pd, addr, length, acc, shift);
}

const split_region* as_split(const transport::memory_region* mr) noexcept {
  return dynamic_cast<const split_region*>(mr);
}

}  // namespace anydoor::detail
