// The key-value service: the store and its log behind both front doors
// (RPC here, the Redis protocol in resp.hpp). The store and its log live on
// one io thread, the home; with several reactors (anydoor-kv-server
// --threads), the RPC servers of the other reactors hand each call to the
// home and reply from their own thread (add_remote_methods).
//
// RPC methods (untyped; little-endian):
//   kv.layout  ()                         -> layout (layout.hpp), the table's region inside
//   kv.get     key                        -> value | not_found
//   kv.put     u32 key length, key, value -> () ; answered when durable (sync always)
//   kv.del     key                        -> u8 1 (deleted) | 0 (absent)
// A reply waits until what it shows is as durable as --sync promises: a
// put or del its own record, a get (hit or miss) or a del of an absent key
// every write applied before it (read_fence).
// Errors: invalid_argument (an empty key, a key or value above the limits,
// a malformed request), resource_exhausted ("OOM ...": --max-memory),
// unavailable (the log cannot be written).
#pragma once

#include "log.hpp"
#include "store.hpp"
#include "undo.hpp"

#include <anydoor/rpc.hpp>

#include <boost/asio/awaitable.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace anydoor::apps::kv {

// The work of one step of a compaction's snapshot, which holds the io
// thread: bytes of records written, and kBucketSize per bucket of the
// slot table visited (store::for_each_from). A store of up to 4 MiB of
// --max-memory with little data is taken in one step.
inline constexpr std::size_t kSnapshotStep = std::size_t{4} << 20;

inline constexpr std::uint64_t kLayoutMethod = rpc::method_id("kv.layout");
inline constexpr std::uint64_t kGetMethod = rpc::method_id("kv.get");
inline constexpr std::uint64_t kPutMethod = rpc::method_id("kv.put");
inline constexpr std::uint64_t kDelMethod = rpc::method_id("kv.del");

struct service_stats {
  std::uint64_t gets = 0, get_hits = 0, puts = 0, dels = 0, errors = 0;
  std::uint64_t oom = 0;
  std::uint64_t taken_back = 0;  // writes taken back when the log failed (see take_back)
  std::uint64_t restore_failures = 0;  // of those (and of refused writes), the ones whose old value found no room
  std::uint64_t spilled = 0;        // kept old items a put over a full arena moved to the undo journal (see put)
  std::uint64_t spilled_bytes = 0;  // ... and their values' bytes
};

class service {
 public:
  // `log` may be null (memory-only).
  // The log's compaction snapshot steps, queued on its io_context, call
  // this service: it must outlive every run of that io_context after a
  // write (or the log's stop_compaction() must come first).
  // One service per log: it takes the log's on_failure (see take_back).
  // Either may be destroyed first.
  service(store& st, durable_log* log);
  service(const service&) = delete;
  service& operator=(const service&) = delete;

  // Applies a write; `lsn` is its log position (0: nothing to wait for).
  rpc::status put(std::string_view key, std::span<const std::byte> value, std::uint64_t& lsn);
  rpc::status del(std::string_view key, bool& existed, std::uint64_t& lsn);
  std::optional<std::span<const std::byte>> get(std::string_view key);
  // Waits until `lsn` is as durable as --sync promises.
  asio::awaitable<rpc::status> durable(std::uint64_t lsn);
  bool must_wait(std::uint64_t lsn) const noexcept { return lsn != 0 && log_ != nullptr && !log_->is_durable(lsn); }
  // What a reply that shows the store's contents waits for (0: nothing):
  // every write applied so far, so that no client sees a value (or the
  // absence of one) that a crash could still take back, as Redis sends no
  // reply before the AOF write (and, with always, its fsync) of the
  // commands run before it. Once the log has failed, 0: nothing more
  // becomes durable, the writes the file does not hold were taken back,
  // and reads go on over what it holds (see README, "Durability").
  std::uint64_t read_fence() const noexcept {
    return log_ == nullptr || log_->failed() ? 0 : log_->appended();
  }

  // Adds the four methods to a server on the home thread; `table` is the
  // table as registered with that server's fabric (its remote()).
  void add_methods(rpc::server& srv, const memory_region& table);
  // The same four methods for a server on another reactor: each call runs
  // on `home` (the store's thread) and is answered back on its own; `table`
  // is the table as registered with that reactor's fabric.
  void add_remote_methods(rpc::server& srv, const memory_region& table, asio::io_context::executor_type home);

  // Compacts the log when it has grown past twice the live data (after
  // writes, and once at start after the replay).
  void maybe_compact();

  // --threads: the store's thread. put, del and every RPC request then
  // check that they run there and refuse (errc::internal) if not: a call
  // that skipped the hop to home would race every other reactor on the store.
  void set_home(asio::io_context::executor_type home) { home_ = home; }

  store& data() noexcept { return st_; }
  durable_log* log() noexcept { return log_; }
  const service_stats& stats() const noexcept { return stats_; }

 private:
  rpc::status check(std::string_view key, std::size_t value_size) const;
  // When the log fails (its on_failure, on the io thread): every write
  // whose record the file does not hold whole (durable_log::held()) is
  // undone, newest first, so that the store holds what the log holds, as a
  // restart would find it. None of them was acknowledged, and no reply
  // by RPC or on the Redis door showed one (read_fence; a one-sided READ
  // may have). Told once on stderr.
  void take_back() noexcept;
  // Gives `b.key` back what it held (the arena's slack makes room); false
  // (counted) when that found no room. An old item kept is released.
  bool restore(const undo_journal::before& b) noexcept;
  // The status of a write the log refused: its error, or closed.
  rpc::status refused() const;
  // A write the log refused (append gave 0), or a throw: undone at once.
  void undo_last() noexcept;
  // stderr: a write `what` ("the log refused") stays in the store, its old value finding no room.
  static void tell_unrestored(const char* what) noexcept;
  // The journal forgets the writes made durable, their old items released.
  void forget_durable() noexcept;
  // After the store applied a write of `key` (which held `was`): journals
  // it and appends its record (`lsn`); a refusal is taken back, and so is
  // a throw before the record was in the log's buffer.
  rpc::status log_write(record_type t, std::string_view key, std::span<const std::byte> value, const prior& was,
                        std::uint64_t& lsn);
  // The methods' bodies, on the home thread, from the raw request.
  rpc::status get_request(std::span<const std::byte> req, std::optional<std::span<const std::byte>>& value);
  asio::awaitable<rpc::status> put_request(std::span<const std::byte> req);
  asio::awaitable<rpc::status> del_request(std::span<const std::byte> req, bool& existed);
  // What a GET that ended with `st` waits for (0: nothing): read_fence()
  // for a hit or a miss, nothing for an error that showed nothing of the store.
  std::uint64_t get_fence(const rpc::status& st) const noexcept;
  // Waits for `fence` (read_fence() when the reply was made), then `st`,
  // or the log's error.
  asio::awaitable<rpc::status> after_fence(std::uint64_t fence, rpc::status st);
  // get_request with the value copied into `copy`, then the wait for
  // read_fence() (a hit or a miss): a call from another reactor, on home.
  asio::awaitable<rpc::status> get_copy(std::span<const std::byte> req, std::vector<std::byte>& copy);
  layout layout_for(const memory_region& table) const;  // the store's layout with the table's region
  // A status when the caller runs off the home thread (see set_home).
  std::optional<rpc::status> off_home();
  store& st_;
  durable_log* log_;
  std::optional<asio::io_context::executor_type> home_;
  undo_journal journal_;  // with a log: the writes it has not made durable yet
  // The smallest size class a scan of the kept items found no block for,
  // as of journal_.items_noted() (see put).
  std::size_t no_fit_class_ = ~std::size_t{0};
  std::uint64_t no_fit_noted_ = 0;
  std::uint64_t forgot_until_ = 0;  // the log's durable_lsn() at the last forget_durable()
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);  // the log's on_failure runs only while this lives
  service_stats stats_;
};

// "OOM ..." as Redis words it, with the numbers.
std::string oom_message(const store& st, std::size_t key, std::size_t value);

}  // namespace anydoor::apps::kv
