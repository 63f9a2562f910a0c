// The store's durability: an append-only log of PUT and DEL records, each
// with a CRC-32C, written by its own thread.
//
//   sync always:   a write is acknowledged once an fsync covers it; writers
//                  waiting at the same time share one fsync (group commit)
//   sync everysec: a write is acknowledged once the log thread has written
//                  it to the file (write(2): a kill -9 of the server loses
//                  nothing acknowledged), fsynced about once a second (a
//                  power failure loses at most about a second)
//   sync no:       acknowledged once written the same way; the OS decides
//                  when it reaches the disk
// The records of one io_context turn are written together, in one write(2)
// (with always also one fsync). With always the log thread writes and
// fsyncs them; with everysec and no the io thread writes them itself at
// the end of the turn, as Redis writes its AOF buffer before it replies,
// and the thread only fsyncs (everysec).
// (Redis's appendfsync terms, on purpose.) A write is visible to readers
// as soon as it is applied, before it is durable, as in Redis.
//
// With always the thread reserves the file ahead of its writes, 4 MiB at a
// time (fallocate): a write into reserved space does not grow the file, so
// its fdatasync has no new size to commit (the file system still marks the
// reserved blocks written; measured on ext4 here: 103 us against 149 us a
// record, p50). A clean stop cuts the reserve off; after a crash the file
// ends with zeros, which replay skips and reports (not a torn tail: they
// hold nothing). A file system without fallocate gets plain appends.
// Known limit: should power fail while an fdatasync of a batch spanning
// pages runs, and a later page of it reach the disk before an earlier one,
// replay finds zeros with good records after them and refuses to start as
// for corruption (saying where); those records were never acknowledged.
//
// A write or fsync that fails (a full disk, an I/O error, a file size
// limit) fails the log: the records it held and every later one are not
// acknowledged (error(), error_text() say why), stderr is told once, and
// nothing more is written; a restart replays what was acknowledged.
// A failed fdatasync of the log (or fsync of the data dir after a
// compaction's rename) also leaves DIR/kv.log.sync-failed: the kernel
// reports a lost write-back once and may then call the pages clean, so a
// restart would read the log from the page cache and its own fdatasync
// would succeed over what never reached the disk. A start that finds the
// marker rewrites the log into a new file (as for version 1, below),
// fsyncs it and renames it over the log, so that what it replayed is on
// the disk; then it removes the marker. If that rewrite fails, the start
// is refused (removing the marker starts on the log as it is).
//
// On start the log is replayed; a torn tail (a bad record with no valid
// record anywhere after it: cut short, a CRC that fails) is cut off,
// saved to kv.log.torn-<time> and reported; a bad record with a valid one
// after it is corruption: the server refuses to start. DIR/LOCK keeps a
// second server out.
//
// Compaction, when the log grows past twice the live data and
// compact_min: the io thread snapshots the live data (one put record per
// key); a thread of its own writes it to kv.log.compact and fsyncs it
// while writes go on to the old log and are answered as usual; it then
// copies the records written since the snapshot from the old log, in
// rounds (each copies what was written during the one before), and only
// for the last round, the fsync and the rename over kv.log does it hold
// the writers: their records wait in memory for what the round before
// left, normally milliseconds, not the whole rewrite. A crash at any point
// leaves either the old log, complete, or the new one, complete (the new
// one is checked, before the rename, to hold as many record bytes after
// the snapshot as were appended after it, by the sequence numbers). A
// compaction that fails leaves the old log and is retried after another
// compact_min.
//
// File: "ADKVLOG1" + u32 version (2) + u32 salt (random, nonzero), then records:
//   u32 crc (CRC-32C of the rest, seeded with the salt), u8 type (1 put,
//   2 del), u24 header check (24 bits of a CRC-32C of the type and the
//   two lengths, seeded with salt ^ 0x9e3779b9), u32 key length,
//   u32 value length, key, value.
// The salt keeps a client from writing, inside a value, bytes that pass
// for a record (short of guessing 32 bits; it is never sent to clients):
// replay tells a torn tail from corruption by what follows a bad record
// (see parse_log), which must not depend on what clients stored. Integers
// are little-endian (the hosts this runs on; the check bytes explicitly).
// Version 1 (salt 0, zero check bytes, unseeded CRCs: logs of earlier
// servers) is read and rewritten as version 2 at start (should that fail,
// it is written on and compacted as version 1).
#pragma once

#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace anydoor::apps::kv {

namespace asio = boost::asio;

enum class sync_mode { always, everysec, no };
const char* to_string(sync_mode m) noexcept;

inline constexpr std::size_t kLogHeader = 16;
inline constexpr std::size_t kRecordHeader = 16;
enum class record_type : std::uint8_t { put = 1, del = 2 };

// Parses a whole log file. `apply` sees every good record in order.
struct log_parse {
  enum class outcome { ok, torn, corrupt, not_a_log };
  outcome result = outcome::ok;
  std::size_t valid_end = 0;  // bytes of good records (with the file header)
  std::size_t zero_tail = 0;  // ok: zeros from valid_end to the end (space reserved ahead)
  std::size_t records = 0;
  std::string why;            // torn or corrupt: what was wrong, and where
  std::uint32_t salt = 0;     // the log's (0: version 1)
};
log_parse parse_log(std::span<const std::byte> file,
                    const std::function<void(record_type, std::string_view, std::span<const std::byte>)>& apply);

// A compaction's snapshot, which the io thread fills in steps (as large as
// the live data, written once front to back, freed once written to the new
// log): a chain of blocks, so that it grows without ever copying what it
// holds (a vector's growth would copy it all inside one step). Blocks of
// 8 MiB (or one record's size, if larger) are mapped and marked for
// transparent huge pages (madvise; the kernel may decline): one page fault
// per 2 MiB instead of one per 4 KiB, which on a VM costs much of a step.
// Appended bytes are left uninitialised for the caller to write.
class snapshot_buffer {
 public:
  snapshot_buffer() = default;
  snapshot_buffer(snapshot_buffer&& o) noexcept;
  snapshot_buffer& operator=(snapshot_buffer&& o) noexcept;
  ~snapshot_buffer();
  snapshot_buffer(const snapshot_buffer&) = delete;
  snapshot_buffer& operator=(const snapshot_buffer&) = delete;

  // n contiguous bytes at the end, to write; throws std::bad_alloc.
  std::byte* append(std::size_t n);
  std::size_t size() const noexcept { return size_; }
  std::size_t blocks() const noexcept { return blocks_.size(); }
  // The bytes in order, one contiguous span per block.
  std::span<const std::byte> block(std::size_t i) const noexcept { return {blocks_[i].p, blocks_[i].used}; }
  void clear() noexcept;  // frees every block

 private:
  struct chunk {
    std::byte* p = nullptr;
    std::size_t mapped = 0;
    std::size_t used = 0;
  };
  std::vector<chunk> blocks_;
  std::size_t size_ = 0;
};

// Appends one record to `out`, for a log with this salt (0: version 1).
void encode_record(std::vector<std::byte>& out, record_type t, std::string_view key, std::span<const std::byte> value,
                   std::uint32_t salt);
void encode_record(snapshot_buffer& out, record_type t, std::string_view key, std::span<const std::byte> value,
                   std::uint32_t salt);

struct log_options {
  std::string dir;
  sync_mode sync = sync_mode::everysec;
  std::uint64_t compact_min = std::uint64_t{64} << 20;  // no compaction below this file size (Redis: auto-aof-rewrite-min-size 64mb)
  // Fault injection for tests: called instead of fdatasync(2) on the log
  // file by the log thread (its fsyncs, and the last one after a failed
  // write) and by the start (an existing log's); null: fdatasync. A failed fdatasync cannot be staged on a
  // real file system here.
  int (*fdatasync_hook)(int fd) = nullptr;
};

struct log_stats {
  std::uint64_t file_bytes = 0;   // the log's size as it will be once written
  std::uint64_t records = 0;      // appended since start
  std::uint64_t fsyncs = 0;
  // The log thread's rounds: each a wake-up (records handed to it, the
  // first write after an fsync with everysec, a timer, a stop).
  std::uint64_t thread_rounds = 0;
  // The current file's bytes an fdatasync covered: all of it at start (an
  // existing log is fdatasynced when opened, in every sync mode).
  std::uint64_t synced_bytes = 0;
  std::uint64_t compactions = 0;
  std::uint64_t compaction_failures = 0;  // the old log kept, retried later
  // The io thread takes each compaction's snapshot (a copy of the live
  // data) in steps, requests waiting during each: the longest step of the
  // last snapshot (of the one being taken, while it is), the longest of all,
  // and the last snapshot's steps.
  std::uint64_t last_snapshot_us = 0;
  std::uint64_t max_snapshot_us = 0;
  std::uint64_t last_snapshot_steps = 0;
  std::uint64_t last_snapshot_bytes = 0;  // the last complete snapshot's, with the file header
};

struct replay_report {
  std::uint64_t records = 0;
  std::uint64_t bytes = 0;
  std::uint64_t torn_bytes = 0;  // cut off the tail
  std::string torn_why;
  std::string torn_copy;         // where the cut bytes were saved (without 4 KiB or more of trailing zeros)
  std::uint64_t zero_bytes = 0;  // zeros after the records, skipped (space reserved ahead)
  bool rewritten = false;        // rewritten into a new file at start (version 1, or the marker below)
  std::string rewrite_failed;    // why a log of version 1 was not (it stays version 1)
  // The first line of kv.log.sync-failed, left by a run whose fdatasync of
  // the log failed ("" when there was none): the log was rewritten because
  // of it, and the marker removed.
  std::string sync_failed_before;
  double ms = 0;
};

class durable_log {
 public:
  using apply_fn = std::function<void(record_type, std::string_view, std::span<const std::byte>)>;
  // Opens DIR/kv.log (creating DIR and the log), replays it through
  // `apply`, cuts a torn tail. Throws std::runtime_error (refusal to start:
  // corruption, another server, an unreadable file) with the reason.
  durable_log(asio::io_context& io, log_options o, const apply_fn& apply);
  // Closes. Destroy it once the io_context has run out of work (the log
  // posts to it while records are pending) or is destroyed unrun.
  ~durable_log();
  durable_log(const durable_log&) = delete;
  durable_log& operator=(const durable_log&) = delete;

  const replay_report& replayed() const noexcept { return report_; }
  const log_options& options() const noexcept { return o_; }
  // The salt records of this log are encoded with (encode_record; 0: version 1).
  std::uint32_t salt() const noexcept { return salt_; }

  // On the io thread. The record's log sequence number (its end); 0 when
  // the log has failed (error() says why): the write must not be acknowledged.
  std::uint64_t append(record_type t, std::string_view key, std::span<const std::byte> value);
  std::error_code error() const noexcept;
  std::string error_text() const;  // "the log cannot be written: ..." (for clients: no path; stderr names it)
  // On the io thread: the log sequence number of the last record appended,
  // whether `lsn` is as durable as the sync mode promises, and whether the
  // log has failed (nothing more becomes durable then).
  std::uint64_t appended() const noexcept { return lsn_; }
  bool is_durable(std::uint64_t lsn) const noexcept { return lsn <= durable_; }
  std::uint64_t durable_lsn() const noexcept { return durable_; }  // every record up to it is
  bool failed() const noexcept { return failed_; }
  // Once failed: the log sequence number up to which the file holds every
  // record whole (written, if not all fsynced: a restart replays them).
  // The records after it never reached the file, or only in part (a torn
  // tail a restart cuts off).
  std::uint64_t held() const noexcept { return held_; }
  // On the io thread, once, when the log fails: before any waiter learns of
  // it, and before failed() is seen by anything else run there (the kv
  // service takes back the writes the file does not hold). Null: none.
  void on_failure(std::function<void()> f) { on_failure_ = std::move(f); }

  // void(std::error_code): once the record `lsn` is as durable as the sync
  // mode promises (always: fsynced; everysec and no: written to the file).
  template <class Token>
  auto async_wait(std::uint64_t lsn, Token&& token) {
    return asio::async_initiate<Token, void(std::error_code)>(
        [this, lsn](auto handler) {
          if (lsn <= durable_ || failed_) {
            const std::error_code ec = failed_ ? error() : std::error_code();
            asio::post(io_, [h = std::move(handler), ec]() mutable { std::move(h)(ec); });
            return;
          }
          waiters_.emplace_back(lsn, std::move(handler));
        },
        token);
  }

  // On the io thread after writes: starts a compaction when the log holds
  // more than twice `live_bytes` (the records the live data needs) and at
  // least compact_min. The snapshot is taken in steps on the io thread,
  // requests running in between: each call of `snapshot_step` appends put
  // records of live keys and returns true once every live key has been
  // appended. A key must be appended in a step unless a write changes it
  // after the first step began (its records then follow the snapshot);
  // appended twice is harmless. The first step runs inside this call.
  void maybe_compact(std::uint64_t live_bytes, std::function<bool(snapshot_buffer&)> snapshot_step);
  // Whether maybe_compact(live_bytes, ...) would start one: asked first,
  // it spares a write the snapshot step's making (a std::function).
  bool compaction_due(std::uint64_t live_bytes) const noexcept;

  // On the io thread: a compaction is under way (its snapshot being taken,
  // or its thread writing).
  bool compacting() const noexcept { return compacting_ || snapshotting_; }
  // On the io thread: its snapshot is being taken (steps still to run).
  bool snapshotting() const noexcept { return snapshotting_; }
  // On the io thread, at shutdown: a compaction under way gives up (the old
  // log stays; unless it is swapping the files already) and none starts
  // again; its end is still posted here. Writes go on as before.
  void stop_compaction() noexcept;

  // Writes and fsyncs what is pending, stops the thread (a clean stop).
  void close() noexcept;
  log_stats stats() const noexcept;

 private:
  struct compaction {
    snapshot_buffer snapshot;
    std::uint64_t logical_at_start = 0;  // logical_bytes_ when the snapshot began
    std::uint64_t start = 0;  // the offset in the old log where records the snapshot lacks begin
    std::uint64_t lsn = 0;    // the log sequence number the snapshot covers
    // The offset in the old log where the records appended before the
    // snapshot was complete end: among them, those of the keys it left out
    // (written since it began), which the new file must hold before it
    // takes the old one's place.
    std::uint64_t complete_at = 0;
  };
  void snapshot_step_now(std::unique_ptr<compaction> c, std::function<bool(snapshot_buffer&)> step);
  void give_up_snapshot() noexcept;
  // Reports on stderr "<what> <path> (<why>)", counts the failure, and tries again after compact_min.
  void compaction_failed(const char* what, const char* why) noexcept;
  void run() noexcept;
  void reserve(std::size_t n) noexcept;
  void end_of_turn() noexcept;
  // `done` (if given) grows by the bytes written, those before an error too.
  std::error_code write_all(int fd, const std::byte* p, std::size_t n, std::size_t* done = nullptr) noexcept;
  void tell_failure() noexcept;
  // After a failed fdatasync of fd_ (or fsync of the data dir after a
  // compaction's rename): leaves DIR/kv.log.sync-failed saying `what`,
  // once; on stderr should it fail. Not under m_.
  void leave_sync_marker(const char* what, std::error_code ec) noexcept;
  // At start: writes the first `size` bytes of the log (records) into
  // kv.log.compact, with a new salt, fsyncs it and renames it over the
  // log; then fd_ is the new file and `size` its length. Returns why it
  // did not ("" when it did; the directory is left to fsync).
  std::string rewrite_log(std::uint64_t& size);
  // The log thread, once a write failed: one more fdatasync of fd_, which
  // covers at least `covered` bytes; its error.
  std::error_code final_sync(std::uint64_t covered) noexcept;
  int sync_file(int fd) const noexcept;  // fdatasync, or the test's hook
  // On compactor_: the whole compaction; posts its end to the io thread.
  void compact(compaction c) noexcept;
  // Copies [from, to) of the old log (fd_) to the end of `fd`.
  std::error_code copy_records(int fd, std::uint64_t from, std::uint64_t to, std::vector<std::byte>& buf) noexcept;
  void on_durable(std::uint64_t lsn, std::error_code ec, bool compacted, std::error_code compact_ec) noexcept;

  asio::io_context& io_;
  log_options o_;
  replay_report report_;
  std::string path_, tmp_path_, marker_path_;
  int fd_ = -1;
  int lock_fd_ = -1;
  int dir_fd_ = -1;

  // io thread only
  std::uint64_t lsn_ = 0;
  std::uint64_t durable_ = 0;
  std::uint64_t logical_bytes_ = 0;
  std::uint64_t logical_if_failed_ = 0;  // the old file's size, should the compaction under way fail
  std::uint64_t retry_compact_at_ = 0;
  bool compacting_ = false;
  bool snapshotting_ = false;  // a compaction's snapshot is being taken (steps posted to io_)
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);  // a posted step runs only while the log does
  bool compaction_stopped_ = false;  // stop_compaction()
  bool failed_ = false;
  std::uint64_t held_ = 0;  // see held()
  std::function<void()> on_failure_;
  std::uint32_t salt_ = 0;  // set once at open
  std::atomic<bool> failure_told_{false};  // stderr told of the log's failure (tell_failure)
  bool wake_posted_ = false;
  // Keeps io_context::run() going while the thread has something to report.
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_;
  std::deque<std::pair<std::uint64_t, asio::any_completion_handler<void(std::error_code)>>> waiters_;
  log_stats stats_;

  // shared with the thread, under m_
  mutable std::mutex m_;
  std::condition_variable cv_;
  std::vector<std::byte> pending_, spare_;
  std::uint64_t pending_end_ = 0;
  bool handed_ = false;          // the thread is to write what pending_ holds
  bool thread_writing_ = false;  // the thread writes records it took
  bool thread_syncing_ = false;  // the thread fsyncs fd_
  bool io_writing_ = false;      // the io thread writes records it took
  // The compactor swaps the files: nobody touches fd_ (records wait in
  // pending_); fd_ changes only then, with none of the three flags above set.
  bool switching_ = false;
  bool new_file_ = false;        // fd_ was swapped: the thread's reserve starts over
  bool compactor_waits_ = false;  // on switch_cv_: writers say when they finish a write
  bool no_compaction_ = false;    // stop_compaction()
  std::uint64_t taken_end_ = 0;  // the offset in fd_ where the records taken from pending_ end
  std::uint64_t written_end_ = 0;  // ... and where those written end
  // The log sequence number up to which the file holds every record whole
  // (held() once failed: a failed write's whole records count).
  std::uint64_t held_end_ = 0;
  std::condition_variable switch_cv_;  // the compactor waits for writers to finish
  bool unsynced_ = false;  // the io thread wrote records that wait for an fsync
  bool stop_ = false;
  std::error_code write_error_;
  bool sync_failed_ = false;  // the failure was an fdatasync's (what it covered is unknown)
  std::atomic<bool> marker_left_{false};  // leave_sync_marker() ran
  std::string write_error_what_;
  std::atomic<std::uint64_t> fsyncs_{0};
  std::atomic<std::uint64_t> thread_rounds_{0};
  std::atomic<std::uint64_t> synced_end_{0};  // see log_stats::synced_bytes
  std::thread compactor_;  // started by the io thread, joined by it (or close())
  // The log thread's (set before it starts, reset by it after a swap of
  // the files; close() reads it once it is joined): where the space
  // reserved ahead ends.
  std::uint64_t reserved_ = 0;
  bool reserving_ = true;  // false once fallocate failed
  std::thread thread_;
};

}  // namespace anydoor::apps::kv
