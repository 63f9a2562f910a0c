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

#include <anydoor/transport/provider.hpp>

#include <boost/asio/buffer.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <system_error>

namespace anydoor {

namespace asio = boost::asio;

// local_write, remote_write, remote_read, remote_atomic (combine with |);
// mw_bind only for memory windows (provider contract), which
// connection::async_register_memory sets itself.
using access = transport::access;

// The peer's memory, as its owner described it.
struct remote_region {
  std::uint64_t addr = 0;
  std::uint64_t length = 0;
  std::uint32_t rkey = 0;

  // [offset, offset + len) of this region. Throws std::system_error
  // (errc::out_of_range) when it does not lie inside.
  remote_region at(std::uint64_t offset, std::uint64_t len) const;

  // The wire form (version 1, 32 bytes, little-endian): magic "ADRR", u8
  // version, 3 zero bytes, u64 addr, u64 length, u32 rkey, u32 check (FNV-1a
  // of the 28 bytes before it).
  static constexpr std::size_t packed_size = 32;
  std::array<std::byte, packed_size> pack() const noexcept;
  // Validates and decodes: errc::protocol_error for a wrong size, magic,
  // check, nonzero reserved bytes, a zero length or a range that wraps
  // around; errc::version_mismatch for another version. `out` is unchanged
  // on error.
  static std::error_code unpack(std::span<const std::byte> in, remote_region& out) noexcept;

  friend bool operator==(const remote_region&, const remote_region&) = default;
};

class memory_region;

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
  memory_region(memory_region&&) noexcept;
  memory_region& operator=(memory_region&&) noexcept;
  ~memory_region();

  explicit operator bool() const noexcept { return mr_ != nullptr; }
  std::byte* data() const noexcept;
  std::size_t size() const noexcept;
  std::span<std::byte> bytes() const noexcept { return {data(), size()}; }
  anydoor::access access() const noexcept;
  std::uint32_t lkey() const noexcept;
  std::uint32_t rkey() const noexcept;

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

 private:
  std::unique_ptr<transport::memory_region> mr_;
};

inline local_range::local_range(const memory_region& region) noexcept
    : data_(region.data()), size_(region.size()), region_(&region) {}

// What async_receive_notification() delivers: the value given to the
// peer's async_put_with_notify and the range of our memory it wrote.
struct notification {
  std::uint32_t value = 0;
  remote_region range;  // addr, length and rkey as the writer used them
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
