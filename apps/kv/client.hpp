// A key-value client: PUT, GET, DEL by RPC, and GET by one-sided READ of
// the server's table (fetch the layout once; then per GET one READ of the
// key's neighbourhood and, unless the value sits in its slot, one READ of
// the item), retrying a torn or moved read up to kReadAttempts times and
// then asking by RPC. Coroutines on the connection's io thread.
//
// The location cache: where a key's item was last found (direct-mapped by
// the key's hash; a fixed table, allocated and cleared when the layout is
// fetched). A GET by READ whose key is
// there READs that item beside the neighbourhood, both in flight at once:
// one round trip instead of two. The neighbourhood decides: the item is
// taken only if the slot it holds for the key points at the same offset
// and length and the item passes every check a sequential READ's would
// (the slot's version, the key, the CRC). An item updated since (moved:
// updates are out of place) is READ again after the neighbourhood, as
// without the cache; so is one READ before it was complete.
#pragma once

#include "layout.hpp"
#include "read.hpp"

#include <anydoor/fabric.hpp>
#include <anydoor/rpc.hpp>

#include <boost/asio/awaitable.hpp>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace anydoor::apps::kv {

inline constexpr int kReadAttempts = 4;
// Location cache entries by default (24 bytes each, allocated when the
// layout is fetched); 0 turns it off.
inline constexpr std::size_t kLocationCache = 16384;
// Items larger than this are not READ ahead of their slot (a stale guess
// would move that many bytes for nothing).
inline constexpr std::uint32_t kReadAheadMax = 16 * 1024;

struct read_stats {
  std::uint64_t gets = 0;       // GETs by READ
  std::uint64_t reads = 0;      // READs issued
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;     // not found, decided from the table
  std::uint64_t retries = 0;    // torn or moved reads read again
  std::uint64_t fallbacks = 0;  // asked by RPC (retries used up, an overflowed bucket, a value too large)
  std::uint64_t ahead = 0;      // item READs sent beside the neighbourhood (the location cache's guesses)
  std::uint64_t ahead_hits = 0; // of those, items taken as the value
};

class client {
 public:
  // location_cache: entries of the location cache (0: every GET by READ
  // reads its item after the neighbourhood).
  client(fabric& fab, connection c, std::chrono::milliseconds timeout, std::size_t location_cache = kLocationCache);

  // Per concurrent GET by READ: its registered landing buffer.
  struct reader {
    std::unique_ptr<std::byte, void (*)(void*)> mem{nullptr, &std::free};
    memory_region mr;  // over mem; deregistered first
  };

  asio::awaitable<rpc::status> put(std::string_view key, std::span<const std::byte> value);
  asio::awaitable<rpc::status> get(std::string_view key, std::string& out);  // not_found: status
  asio::awaitable<rpc::status> del(std::string_view key, bool& existed);

  // Fetches and checks the layout; an unusable one leaves GETs by RPC.
  asio::awaitable<rpc::status> fetch_layout();
  bool can_read() const noexcept { return layout_.has_value(); }
  reader make_reader();
  asio::awaitable<rpc::status> read_get(reader& r, std::string_view key, std::string& out);

  const read_stats& reads() const noexcept { return rs_; }
  rpc::client& rpc() noexcept { return cli_; }

 private:
  fabric& fab_;
  rpc::client cli_;
  struct location {
    std::uint64_t hash = 0;
    std::uint64_t offset = 0;
    std::uint32_t length = 0;  // 0: empty
  };
  location* cached(std::uint64_t hash) noexcept;
  void remember(std::uint64_t hash, const slot& s) noexcept;
  void forget(std::uint64_t hash) noexcept;

  std::optional<layout> layout_;
  remote_region table_;
  read_stats rs_;
  std::size_t location_entries_;
  std::vector<location> locations_;  // location_entries_ once a layout is fetched
};

// An rpc call's outcome as a status: the server's, or the call's own.
rpc::status call_status(const error_code& ec, const rpc::reply& r);

}  // namespace anydoor::apps::kv
