// Memory for one-sided operations: registered regions, their remote
// descriptors, and local ranges.
//
//   anydoor::memory_region mr = fab.register_memory(std::span(buf), anydoor::access::remote_write);
//   auto packed = mr.remote().pack();              // send it to the peer (a message)
//   ...                                            // on the peer:
//   anydoor::remote_region r;
//   if (auto ec = anydoor::remote_region::unpack(bytes, r)) { /* garbage: refuse */ }
//   co_await conn.async_put(asio::buffer(src), r.at(64, src.size()), asio::use_awaitable);
//
// A region from fabric::register_memory is open to any peer holding its
// rkey (through any connection of the fabric) for as long as it lives: an
// rkey is a capability, and a leaked one opens the memory to whoever has it.
// connection::async_register_memory scopes a region to one connection: its
// rkey is a memory window bound to that connection's queue pair, refused on
// every other, and revoked when the connection ends.
//
// A memory_region is one registration with exactly the access it was given
// (local reads are always allowed); destroying it deregisters it, after
// which its keys no longer work, locally or remotely. A remote_region names
// memory of the peer: an address, a length and the peer's rkey. A
// local_range names local memory for an operation: a range of a
// memory_region (its key is known), or any memory, which the fabric's
// registration cache registers (see fabric.hpp for the cache's lifetime
// contract).
#pragma once

#include <anydoor/cuda.hpp>
#include <anydoor/transport/provider.hpp>

#include <boost/asio/buffer.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <system_error>
#include <type_traits>
#include <vector>

namespace anydoor {

namespace asio = boost::asio;

// local_write, remote_write, remote_read, remote_atomic (combine with |);
// mw_bind only for memory windows (provider contract), which
// connection::async_register_memory sets itself.
using access = transport::access;

// The most pieces one region may be registered in (its remote_region
// carries every key inline, so it stays a plain value: copied without
// allocating or counting references, destroyed trivially).
inline constexpr std::uint32_t max_region_pieces = 16;

// The remote keys of a region its owner registered in pieces (memory
// larger than the owner's device registers at once, its max_mr_size, or
// than fabric_options::max_piece_bytes): piece i covers the addresses of
// the 2^shift()-byte aligned block base() + i, within the region, and is
// reached with key(i). Filled by memory_region::remote() and by
// remote_region::unpack; read-only to users (for tools and tests).
class remote_pieces {
 public:
  bool empty() const noexcept { return count_ == 0; }
  std::uint32_t count() const noexcept { return count_; }
  unsigned shift() const noexcept { return shift_; }
  std::uint64_t base() const noexcept { return base_; }  // the first piece's block: address >> shift()
  std::uint32_t key(std::uint32_t i) const noexcept { return i < count_ ? keys_[i] : 0; }  // 0: no piece i

  // Whether [a, a + len) lies in the pieces (len > 0).
  bool covers(std::uint64_t a, std::uint64_t len) const noexcept {
    const std::uint64_t last = a + len - 1;
    return len != 0 && last >= a && (a >> shift_) >= base_ && (last >> shift_) - base_ < count_;
  }
  // The key for address a, and where its piece ends; a must be covered.
  std::uint32_t key_at(std::uint64_t a) const noexcept { return key(static_cast<std::uint32_t>((a >> shift_) - base_)); }
  std::uint64_t piece_end(std::uint64_t a) const noexcept { return ((a >> shift_) + 1) << shift_; }

  friend bool operator==(const remote_pieces& a, const remote_pieces& b) noexcept;

 private:
  friend struct remote_region;
  friend class memory_region;
  std::uint64_t base_ = 0;
  std::uint32_t count_ = 0;
  std::uint8_t shift_ = 0;
  std::array<std::uint32_t, max_region_pieces> keys_{};
};

// The peer's memory, as its owner described it.
struct remote_region {
  std::uint64_t addr = 0;
  std::uint64_t length = 0;
  std::uint32_t rkey = 0;  // the key for addr (of a region in pieces: of addr's piece)
  remote_pieces pieces{};  // empty unless the owner registered the region in pieces

  // [offset, offset + len) of this region (of a region in pieces: only the
  // pieces it touches; one piece makes it a plain region). Throws
  // std::system_error (errc::out_of_range) when it does not lie inside.
  remote_region at(std::uint64_t offset, std::uint64_t len) const;

  // The wire forms, little-endian, ending with a u32 check (FNV-1a of the
  // bytes before it):
  //  - version 1, a region in one piece, packed_size (32) bytes: magic
  //    "ADRR", u8 1, 3 zero bytes, u64 addr, u64 length, u32 rkey, check;
  //  - version 2, a region in pieces, 32 + 4 * pieces bytes: magic "ADRR",
  //    u8 2, u8 shift (12..62), 2 zero bytes, u64 addr, u64 length, u32
  //    pieces (2..max_pieces, exactly the blocks the range touches), a u32
  //    key per piece, check.
  static constexpr std::size_t packed_size = 32;
  static constexpr std::uint32_t max_pieces = max_region_pieces;
  static constexpr std::size_t max_packed_size = packed_size + 4 * max_pieces;
  std::size_t packed_length() const noexcept { return packed_size + (pieces.empty() ? 0 : 4 * pieces.count()); }
  std::vector<std::byte> pack() const;
  // Packs into the front of `out` without allocating: returns
  // packed_length(), or 0 (nothing written) when `out` is shorter.
  std::size_t pack_into(std::span<std::byte> out) const noexcept;
  // Validates and decodes exactly one descriptor: errc::protocol_error for
  // a wrong size, magic, check, nonzero reserved bytes, a zero length, a
  // range that wraps around, or pieces that do not match the range;
  // errc::version_mismatch for an unknown version of 32 bytes (a longer
  // one cannot be told from garbage: protocol_error). A peer built before
  // version 2 refuses a region in pieces with protocol_error. `out` is
  // unchanged on error.
  static std::error_code unpack(std::span<const std::byte> in, remote_region& out) noexcept;
  // The length of the descriptor that `in` starts with, read from its
  // first 32 bytes (for a descriptor inside a larger message; unpack still
  // validates it): 0 when `in` is shorter than that or is no descriptor.
  static std::size_t packed_length_of(std::span<const std::byte> in) noexcept;

  friend bool operator==(const remote_region&, const remote_region&) = default;
};

// A plain value: copies never allocate, and (GCC 12 destroys a braced
// temporary in a co_await expression twice) nothing it holds can be freed
// twice.
static_assert(std::is_trivially_copyable_v<remote_region> && std::is_trivially_destructible_v<remote_region>);

class memory_region;
namespace detail {
class split_region;
}

// Local memory of a one-sided operation. From a memory_region (whole, or
// at()), or from an Asio buffer: then the registration cache provides the
// key. A range made from a const buffer can only be read (a put's source).
class local_range {
 public:
  local_range() noexcept = default;
  local_range(const memory_region& region) noexcept;  // NOLINT: the whole region
  local_range(asio::mutable_buffer b) noexcept : data_(b.data()), size_(b.size()) {}  // NOLINT
  local_range(asio::const_buffer b) noexcept  // NOLINT
      : data_(const_cast<void*>(b.data())), size_(b.size()), read_only_(true) {}

  void* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  const memory_region* region() const noexcept { return region_; }  // null: through the cache
  bool read_only() const noexcept { return read_only_; }

 private:
  friend class memory_region;
  local_range(void* d, std::size_t n, const memory_region* r) noexcept : data_(d), size_(n), region_(r) {}
  void* data_ = nullptr;
  std::size_t size_ = 0;
  const memory_region* region_ = nullptr;
  bool read_only_ = false;
};

// One registration; move-only; destroying it deregisters.
class memory_region {
 public:
  memory_region() noexcept;
  explicit memory_region(std::unique_ptr<transport::memory_region> mr) noexcept;
  memory_region(std::unique_ptr<transport::memory_region> mr, memory_kind kind) noexcept;
  memory_region(memory_region&&) noexcept;
  memory_region& operator=(memory_region&&) noexcept;
  ~memory_region();

  explicit operator bool() const noexcept { return mr_ != nullptr; }
  std::byte* data() const noexcept;
  std::size_t size() const noexcept;
  std::span<std::byte> bytes() const noexcept { return {data(), size()}; }
  anydoor::access access() const noexcept;
  // The keys (of a region in pieces: of its first piece; remote() carries
  // them all, and operations on its ranges find each piece's own).
  std::uint32_t lkey() const noexcept;
  std::uint32_t rkey() const noexcept;
  // How many registrations it is: 1, or more for memory larger than the
  // device registers at once (fabric_options::max_piece_bytes); 0 when
  // empty. To its user a region in pieces is one region.
  std::size_t pieces() const noexcept;
  // What the memory is (fabric::register_memory asks the CUDA driver; see
  // <anydoor/cuda.hpp>): host for an empty region.
  memory_kind kind() const noexcept { return kind_; }

  // What a peer needs to reach this region (meaningful with remote access).
  remote_region remote() const noexcept;
  // [offset, offset + len) for a local operation. Throws std::system_error
  // (errc::out_of_range) when it does not lie inside.
  local_range at(std::size_t offset, std::size_t len) const;

  // Deregisters now (as the destructor does).
  void reset() noexcept;

  // A region from connection::async_register_memory: its rkey() opens it to
  // that connection's peer only, until the connection ends or the region is
  // destroyed.
  bool connection_scoped() const noexcept;
  // A connection-scoped region whose connection has ended: its rkey opens
  // nothing any more (local use goes on). False for any other region.
  bool revoked() const noexcept;

  // Runtime-internal: the pieces of a region in pieces, else null.
  const detail::split_region* split() const noexcept { return split_; }

 private:
  std::unique_ptr<transport::memory_region> mr_;
  const detail::split_region* split_ = nullptr;  // mr_ itself when it is one
  memory_kind kind_ = memory_kind::host;
};

inline local_range::local_range(const memory_region& region) noexcept
    : data_(region.data()), size_(region.size()), region_(&region) {}

// What async_receive_notification() delivers: the value given to the
// peer's async_put_with_notify and the range of our memory it wrote.
struct notification {
  std::uint32_t value = 0;
  remote_region range;  // addr, length and the rkey of addr's piece as the writer used them (never pieces)
};

// The fabric's registration cache (fabric::stats().cache).
struct registration_cache_stats {
  std::uint64_t hits = 0;           // operations served by an existing registration
  std::uint64_t misses = 0;         // operations that needed a new one
  std::uint64_t registrations = 0;  // registrations made (a miss may merge neighbours into one)
  std::uint64_t deregistrations = 0;
  std::uint64_t evictions = 0;      // deregistered to stay under the limits
  std::uint64_t invalidations = 0;  // deregistered by fabric::forget_memory
  std::uint64_t entries = 0;        // registrations held now
  std::uint64_t bytes = 0;          // bytes they cover
};

}  // namespace anydoor
