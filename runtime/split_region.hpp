// Registrations in pieces (runtime-internal): memory larger than the
// device registers at once is registered as the 2^shift-byte aligned blocks
// it touches (the first and last may be partial), and is one
// transport::memory_region to the rest of the runtime: its addr() and
// length() are the whole memory's, its lkey() and rkey() the first piece's.
// Operations find each piece's keys with lkey_at and rkeys().
#pragma once

#include <anydoor/transport/provider.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace anydoor::detail {

// The local keys of a registration in pieces, shared with the operations
// that use it: an operation that outlives its region (destroyed mid-way,
// a user error) reads valid keys and fails at the device, as with a region
// in one piece, instead of reading freed memory.
struct piece_table {
  std::uint64_t base = 0;  // the first piece's block
  std::uint64_t end = 0;   // the region's end
  unsigned shift = 0;
  std::unique_ptr<std::uint32_t[]> lkeys;

  // For an address of the region: its piece's local key, and where that
  // piece ends (the region's end for the last).
  std::uint32_t lkey_at(std::uint64_t a) const noexcept { return lkeys[(a >> shift) - base]; }
  std::uint64_t piece_end(std::uint64_t a) const noexcept { return std::min(((a >> shift) + 1) << shift, end); }
};

class split_region final : public transport::memory_region {
 public:
  // Registers [addr, addr + length) in pieces of the 2^shift-byte aligned
  // blocks it touches (at least two). Throws std::system_error: what the
  // provider's register_memory throws (pieces made so far are released).
  split_region(transport::protection_domain& pd, void* addr, std::size_t length, transport::access acc,
               unsigned shift);

  unsigned shift() const noexcept { return table_->shift; }
  std::uint32_t count() const noexcept { return static_cast<std::uint32_t>(pieces_.size()); }
  std::uint64_t base() const noexcept { return table_->base; }
  const std::shared_ptr<const piece_table>& table() const noexcept { return table_; }
  // Every piece's remote key, in order (count() of them).
  const std::uint32_t* rkeys() const noexcept { return rkeys_.get(); }

 private:
  std::vector<std::unique_ptr<transport::memory_region>> pieces_;
  std::shared_ptr<const piece_table> table_;
  std::unique_ptr<std::uint32_t[]> rkeys_;
};

// The shift of the pieces for a registration limit: the largest power of
// two at most `limit`; 0 when the limit is below a page (4096).
unsigned piece_shift(std::uint64_t limit) noexcept;

// Registers [addr, addr + length): in one piece when it is at most
// 2^shift bytes, else as a split_region (at most remote_region::max_pieces
// pieces, else errc::registration_failed).
std::unique_ptr<transport::memory_region> register_in_pieces(transport::protection_domain& pd, void* addr,
                                                             std::size_t length, transport::access acc,
                                                             unsigned shift);

// The region's pieces when it is a split_region (one dynamic_cast: call it
// once per registration, not per operation).
const split_region* as_split(const transport::memory_region* mr) noexcept;

}  // namespace anydoor::detail
