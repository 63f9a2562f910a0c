// What a fabric shares with its connections and acceptors (runtime-internal).
#pragma once

#include <anydoor/buffer_pool.hpp>
#include <anydoor/fabric.hpp>
#include <anydoor/reactor.hpp>

#include "auth.hpp"
#include "protocol.hpp"
#include "free_list.hpp"
#include "setup_helpers.hpp"

#include <anydoor/detail/op_node.hpp>

#include <boost/asio/io_context.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <mutex>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <cstddef>
#include <memory>
#include <vector>

namespace anydoor::detail {

class connection_impl;
class copy_thread;
class registration_cache;
class staging_area;

// The work requests of one doorbell, with the gather entries and inline
// bytes they point to until posted (connection_impl::batch_).
struct doorbell_batch {
  std::vector<transport::work_request> wrs;  // capacity reserved: never grows
  std::vector<transport::sge> sges;
  std::vector<std::byte> inline_bytes;
};

class fabric_state : public std::enable_shared_from_this<fabric_state> {
 public:
  fabric_state(asio::io_context& io, const fabric_options& options);
  ~fabric_state();

  asio::io_context& io;
  const fabric_options options;
  std::unique_ptr<transport::device> device;
  std::unique_ptr<transport::protection_domain> pd;
  std::unique_ptr<transport::completion_queue> cq;
  std::unique_ptr<buffer_pool> pool;
  std::unique_ptr<registration_cache> cache;
  // GPU memory's staging buffers and copy thread (staging.hpp), made on
  // first use.
  staging_area& staging();
  const staging_area* staging_if_made() const noexcept { return staging_.get(); }
  copy_thread& copies();
  void stop_copies() noexcept;  // ~fabric: no copy completion is posted after it
  unsigned piece_shift = 0;  // registrations above 2^piece_shift bytes are made in pieces
  std::unique_ptr<anydoor::reactor> reactor;
  bool auth = false;                  // options.connection.auth_token is set: peers must prove it
  auth::own_nonces own_nonces;        // of our handshakes in progress (reflections are refused)
  std::uint32_t inline_cap = 0;       // max_inline_data of our queue pairs
  std::uint32_t recv_buffer = 0;      // bytes per receive buffer (pool buffer size)

  // The shared receive queue (options.srq_buffers; null without): pool
  // buffers posted to it, found again by the tag of their wr_id. Credits
  // granted over all connections (srq_promised) never exceed the receives
  // posted (srq_posted), so no conforming peer meets RNR: see
  // connection_impl's grant() for who gets the spare ones.
  static constexpr std::uint32_t kSrqMinCredits = 4;  // a connection's grant at the start, and its floor
  std::unique_ptr<transport::shared_receive_queue> srq;
  std::uint64_t srq_posted = 0;
  std::uint64_t srq_promised = 0;
  std::uint64_t srq_spare() const noexcept { return srq_posted > srq_promised ? srq_posted - srq_promised : 0; }
  // Posts a buffer (back) to the shared queue; a failure logs and returns
  // the buffer to the pool.
  void srq_repost(std::uint32_t buffer) noexcept;
  // Connections by queue pair number (receives of the shared queue name
  // only that).
  void srq_attach(std::uint32_t qp_num, connection_impl* c);
  void srq_detach(std::uint32_t qp_num) noexcept;

  // Activity: the reactor polls while something is pending (user operations,
  // signaled sends in flight, connections flushing after an error). The
  // last idle() stops it once the current handler has finished (so a
  // coroutine that completes one operation and starts the next keeps it on).
  void busy() noexcept;
  void idle() noexcept;

  // Operation nodes of every connection of the fabric (one thread): a
  // connection takes one per operation and gives it back when the
  // operation ends, so an idle connection holds none. Never allocates once
  // the most in use at once have been made.
  op_node* take_node() {                    // throws std::bad_alloc
    if (op_node* n = nodes_.take()) return n;
    return nodes_.add(std::make_unique<op_node>());
  }
  // Doorbell batches of the fabric's connections (connection_impl::batch_),
  // the same way: a connection holds one from its first work request queued
  // until they are posted. nullptr when memory runs out.
  doorbell_batch* take_batch(std::size_t wrs, std::size_t sges, std::size_t inline_bytes) noexcept {
    if (doorbell_batch* b = batches_.take()) return b;
    return make_batch(wrs, sges, inline_bytes);
  }
  void give_batch(doorbell_batch* b) noexcept { batches_.give(b); }  // b from take_batch, empty
  std::size_t batches_made() const noexcept { return batches_.made(); }
  std::size_t batches_free() const noexcept { return batches_.free_count(); }
  // After a burst (each liveness tick, at least once a second): frees the
  // nodes and batches waiting beyond max(16, twice the most in use at once
  // since the last trim), and the kept blocks of rendezvous messages after
  // kKeptQuiet without use. A steady load frees nothing.
  void trim_free_lists() noexcept;
  void give_node(op_node* n) noexcept { nodes_.give(n); }  // n from take_node

  // Memory of rendezvous messages that async_receive delivers (a message's
  // holder node: large, and mr, its local registration): kept when the
  // message is released and taken by the next message it fits, so a stream
  // of large messages neither allocates nor registers (on a NIC a
  // registration is a system call that pins pages). Blocks are multiples
  // of 4 KiB;
  // one of c bytes is taken by an n-byte message when n <= c <= 2n + 64 KiB.
  // At most kKeptBlocks blocks of at most kKeptBlockMax bytes, kKeptBytes in
  // all, local access only (never exposed to a peer), and as many empty
  // holders. A block kept unused for kKeptQuiet (2 to 3 s: counted in
  // liveness ticks) is freed by trim_free_lists. Only on the fabric's
  // io_context thread: a message released elsewhere frees its block.
  static constexpr std::size_t kKeptBlocks = 8;
  static constexpr std::size_t kKeptBlockMax = std::size_t{2} << 20;
  static constexpr std::size_t kKeptBytes = std::size_t{8} << 20;
  static constexpr std::chrono::seconds kKeptQuiet{2};
  static constexpr std::size_t block_size(std::size_t n) noexcept { return (n + 4095) & ~std::size_t{4095}; }
  // A kept block for an n-byte message (the smallest that fits) into
  // `large` and `mr`; false when none fits.
  bool take_block(std::size_t n, std::unique_ptr<std::byte[]>& large,
                  std::unique_ptr<transport::memory_region>& mr) noexcept;
  // A holder for a delivered message (a kept empty one, or a new one);
  // null when memory runs out.
  std::unique_ptr<op_node> take_holder() noexcept;
  // A released message's holder: its block kept where the limits allow,
  // else deregistered and freed (the registration before the memory).
  void keep_block(std::unique_ptr<op_node> h) noexcept;
  std::size_t kept_blocks() const noexcept { return kept_blocks_.size(); }
  std::size_t kept_bytes() const noexcept { return kept_bytes_; }
  // Registrations of rendezvous sources once their sends end, where the
  // device may deliver a stale duplicate of the peer's READ late
  // (capabilities::late_duplicates): the peer read the source and said so,
  // but a READ it resent may still be on its way, and the responder
  // re-executes it, checking the key anew; a key already revoked fails the
  // queue pair. Each registration (with the host copy it covers, of a
  // staged GPU message) is kept options.late_read_grace after its send
  // ended, then deregistered by a tick; at most kRetiredMax of them,
  // kRetiredBytes in all, less under a finite RLIMIT_MEMLOCK
  // (held_sources_limit; past either the oldest go early; a larger one is
  // not kept). Meanwhile any peer of the fabric that has the key (one
  // protection domain) can read the range it names, whatever the
  // application has put there since (SECURITY.md). Only on the fabric's
  // io_context thread.
  static constexpr std::size_t kRetiredMax = 256;
  static constexpr std::size_t kRetiredBytes = std::size_t{64} << 20;
  void retire_source(std::unique_ptr<transport::memory_region> mr, std::unique_ptr<std::byte[]> copy,
                     std::size_t bytes) noexcept;
  // Deregisters those whose grace is over at `now` (every one with `all`);
  // returns how many.
  std::size_t release_sources(std::chrono::steady_clock::time_point now, bool all) noexcept;
  std::size_t retired_sources() const noexcept { return retired_count_; }
  std::size_t retired_bytes() const noexcept { return retired_bytes_; }
  std::uint64_t retired_early() const noexcept { return retired_early_; }
  // Registers with `reg` (which throws std::system_error on failure); a
  // registration the device refused (errc::registration_failed: verbs'
  // ENOMEM under RLIMIT_MEMLOCK among others) while held sources pin
  // memory releases them all and tries once more.
  template <class Register>
  auto register_releasing(Register&& reg) -> decltype(reg()) {
    try {
      return reg();
    } catch (const std::system_error& e) {
      if (e.code() != errc::registration_failed) throw;
      const std::size_t n = release_sources({}, true);
      if (n == 0) throw;
      retired_early_ += n;
    }
    return reg();
  }
  std::size_t nodes_made() const noexcept { return nodes_.made(); }
  std::size_t nodes_free() const noexcept { return nodes_.free_count(); }
  std::size_t active() const noexcept { return active_; }

  // Posting: connections queue work requests during a turn and flush them,
  // one doorbell each, from a handler posted once per turn (or, while the
  // reactor spins, before its next poll).
  void schedule_flush(connection_impl* c);
  // From the reactor after a pass of completions: flushes every connection
  // now (the replies their handlers queued leave before the next poll).
  static void flush_after_dispatch(void* self) noexcept;
  // From a spinning reactor before each poll: flushes what was queued
  // outside a completion pass (no posted flush while it spins).
  static void flush_before_poll(void* self) noexcept;
  // For the reactor's busy spin: completions or a flush this fabric posted
  // are waiting to run.
  static bool has_queued_handlers(const void* self) noexcept;
  // Connections whose queued sends wait for a pool buffer.
  void wait_for_buffer(connection_impl* c);
  void put_buffer(std::uint32_t index) noexcept;
  // A connection going away leaves every list.
  void forget(connection_impl* c) noexcept;

  // Send completions posted by the runtime that have not run yet: their
  // coroutines may queue more sends, so the flush waits for them (up to a
  // batch of kEarlyFlush work requests).
  std::size_t posted_completions = 0;
  // Nonzero while a connection handles a completion: what gets queued then
  // (a reply, a credit, a fin) is flushed at the end of the reactor's pass
  // (the reactor's after-dispatch hook), without a posted flush.
  std::uint32_t in_completion = 0;
  // Turns so far: a turn ends at each flush pass and each of the
  // reactor's flush hooks (before a poll, after a pass of completions).
  // What the application issues within one turn is one burst
  // (connection_impl::issue).
  std::uint64_t turns = 0;
  // Nonzero while a flush completes its connection's sends with their
  // handlers run in place (connection_impl::flush): what they issue then
  // is a completion handler's, batched (connection_impl::issue), and what
  // they queue (a send, the buffer of a message they drop) is flushed by
  // flush_all's second round, not by a posted flush.
  std::uint32_t in_handlers = 0;
  static constexpr std::size_t kEarlyFlush = 32;

  std::uint64_t open_connections = 0;
  std::uint64_t accepted = 0;
  std::uint64_t connected = 0;
  std::atomic<std::uint64_t> refused{0};  // also counted by acceptors' listener threads
  // The reactor gave up on the completion queue (set on the io thread when
  // it does): the acceptors' listener threads take no more peers.
  std::atomic<bool> cq_lost{false};
  // The connect helpers (fabric::~fabric stops them).
  setup_helpers helpers{io};

  // Liveness (connection_options::keepalive): a thread posts a tick every
  // tick_ms_; each tick takes what the completion queue holds and lets
  // every connection check its peer's silence and send its heartbeat.
  void start_liveness();
  void stop_liveness() noexcept;  // joins the thread (~fabric, ~fabric_state)
  void liveness_tick() noexcept;
  void want_tick(std::chrono::milliseconds within);  // the next tick within this (a new connection)
  // With a provider whose poll() serves the peers' one-sided operations
  // (completion_queue::progress_in_poll: tcp without its progress thread,
  // which serves them itself), the same thread watches the
  // completion queue's notify fd while the reactor is stopped (nothing of
  // ours pending) and posts idle_progress() when it becomes readable: a
  // put towards this side is then answered within a wake-up, not at the
  // next tick (up to a second later).
  void idle_progress() noexcept;
  // A connection failed with ec (connection_impl::fail): counted by error.
  void count_failure(std::error_code ec) noexcept;
  std::vector<failure_count> failures;  // a handful of distinct errors
  const std::vector<connection_impl*>& connections() const noexcept { return conns_; }
  void add(connection_impl* c);        // prepare()
  void remove(connection_impl* c) noexcept;  // ~connection_impl
  void abandon_connections() noexcept;       // ~fabric (connection_impl::abandon)
  static constexpr std::chrono::milliseconds kMinTick{20};
  static constexpr std::chrono::milliseconds kMaxTick{1000};

  // Our hello (kind hello, no nonce: each attempt adds its own).
  protocol::hello local_hello() const noexcept;
  // Checks a peer's hello or welcome against ours (version, whether both
  // sides authenticate); errc on refusal.
  std::error_code check_peer(const protocol::hello& peer) const noexcept;
  // Throws errc::invalid_state naming `what` when the reactor gave up on the
  // completion queue: nothing polls it, so no operation of a new connection
  // would ever end.
  void refuse_if_cq_lost(const char* what) const;

 private:
  doorbell_batch* make_batch(std::size_t wrs, std::size_t sges, std::size_t inline_bytes) noexcept;
  free_list<doorbell_batch> batches_;
  free_list<op_node> nodes_;
  std::vector<std::unique_ptr<op_node>> kept_blocks_;    // capacity kKeptBlocks, reserved
  std::vector<std::unique_ptr<op_node>> spare_holders_;  // capacity kKeptBlocks, reserved
  std::size_t kept_bytes_ = 0;
  std::chrono::steady_clock::time_point kept_clock_{};  // of the last trim (a kept holder's deadline field)
  struct retired_source {
    std::chrono::steady_clock::time_point until{};
    std::size_t bytes = 0;
    std::unique_ptr<transport::memory_region> mr;
    std::unique_ptr<std::byte[]> copy;  // (after mr: the registration goes first)
  };
  std::vector<retired_source> retired_;  // a ring of kRetiredMax (sized at the first retire_source)
  std::size_t retired_head_ = 0;
  std::size_t retired_count_ = 0;
  std::size_t retired_bytes_ = 0;
  std::uint64_t retired_early_ = 0;
  std::size_t retired_limit_ = kRetiredBytes;  // kRetiredBytes, less under a finite RLIMIT_MEMLOCK
  static std::size_t held_sources_limit();
  void release_oldest_source() noexcept;
  std::unique_ptr<op_node> unkeep(std::size_t i) noexcept;  // kept block i out of the list
  void free_block(op_node& h) noexcept;  // unpoisoned, deregistered, freed (the holder stays)
  void drop_kept() noexcept;             // frees every kept block
  void flush_all(bool defer) noexcept;
  void end_turn(bool defer) noexcept;  // the hooks: flush_all where anything is dirty, else only count the turn
  void post_flush();  // one posted flush_all(true) at a time
  std::size_t active_ = 0;
  bool stop_check_posted_ = false;
  bool flush_posted_ = false;
  bool in_flush_all_ = false;  // flush_all runs: what gets dirty waits for its next round (or its post)
  std::vector<connection_impl*> dirty_;
  std::vector<connection_impl*> flushing_;
  std::vector<connection_impl*> buffer_waiters_;
  std::vector<connection_impl*> conns_;  // every prepared connection
  struct srq_recv_op final : operation {
    fabric_state* f = nullptr;
    void complete(const transport::completion& wc) noexcept override { f->on_srq_recv(wc); }
  };
  void on_srq_recv(const transport::completion& wc) noexcept;
  srq_recv_op srq_op_;
  std::uint64_t srq_base_ = 0;  // persistent wr_id base; the tag is the buffer
  std::unordered_map<std::uint32_t, connection_impl*> srq_conns_;
  std::atomic<std::int64_t> tick_ms_{kMaxTick.count()};
  std::atomic<bool> tick_posted_{false};
  std::atomic<bool> tick_wanted_{false};  // want_tick: a tick now, then every tick_ms_
  // The liveness thread waits on this eventfd (and, with watch_cq_, on the
  // completion queue's notify fd while reactor_idle_ and no idle_progress
  // is queued).
  int wake_fd_ = -1;
  bool watch_cq_ = false;
  std::atomic<bool> reactor_idle_{true};      // the reactor is stopped (set on the io thread)
  std::atomic<bool> progress_posted_{false};  // an idle_progress() is queued
  void wake_liveness() noexcept;
  std::jthread liveness_;  // last: stopped first
  std::unique_ptr<staging_area> staging_;
  std::unique_ptr<copy_thread> copies_;
};

}  // namespace anydoor::detail
