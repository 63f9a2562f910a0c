// The reactor: one per io_context (thread) and completion queue. It turns the
// queue's completions into calls of the operations that are waiting for them.
//
// Event mode: the CQ's notify fd (a dup of it) is an asio stream_descriptor;
// when it is readable the reactor acknowledges the events, polls in batches
// until the queue is empty, arms, and polls again before waiting (the
// arm-then-drain rule: no lost wake-ups; not again where the queue's arm
// reports what is already there, completion_queue::arm_reports_queued);
// it arms again before it sleeps
// after any poll that returned completions, so a queue made with
// transport::cq_options::owner_rearms may skip the wake-up for a completion
// its poll made (poll_now() keeps this too). Busy mode: it polls from a handler
// that re-posts itself, up to spin_polls polls per round; the notify fd
// is never handed to the io_context (every readiness change of a descriptor
// in its epoll set costs the kernel work on the data path, on the sending
// side's system call). Adaptive mode: busy for `spin` after the last
// completion, then event mode (the notify fd joins the io_context the first
// time the reactor sleeps).
//
// Operations are owned by the caller (pooled there); the reactor keeps a
// fixed table of slots mapping wr_id to operation, so nothing is allocated
// per operation. A slot from track() serves one completion: track only the
// signaled requests (an unsignaled one has no completion of its own). A
// persistent slot (track_persistent) serves any number: its wr_ids carry a
// 31-bit tag of the caller's choosing (a sequence number), so a connection
// can route every request of a queue pair, signaled or not (errors flush
// them all), through one slot.
#pragma once

#include <anydoor/transport/provider.hpp>

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

namespace anydoor {

namespace asio = boost::asio;

enum class poll_mode : std::uint8_t { event, busy, adaptive };
std::string_view to_string(poll_mode m) noexcept;
// "event", "busy" or "adaptive"; false for anything else.
bool parse_poll_mode(std::string_view text, poll_mode& out) noexcept;

struct reactor_options {
  poll_mode mode = poll_mode::adaptive;     // ANYDOOR_POLL overrides
  std::chrono::microseconds spin{50};       // adaptive: busy time after the last completion
  std::uint32_t batch = 16;                 // completions per poll call, 16..1024
  std::uint32_t max_operations = 4096;      // operation slots, 1..2^24
  std::uint32_t spin_polls = 16;            // busy/adaptive: polls per io_context round, 1..1024
};

// What the reactor calls when a tracked work request completes.
class operation {
 public:
  virtual void complete(const transport::completion& c) noexcept = 0;

 protected:
  virtual ~operation() = default;  // not deleted through this base
};

struct reactor_stats {
  std::uint64_t polls = 0;        // poll calls
  std::uint64_t empty_polls = 0;  // poll calls that found nothing
  std::uint64_t completions = 0;  // completions dispatched
  std::uint64_t wakeups = 0;      // notify-fd readiness handled
  std::uint64_t arms = 0;
  std::uint64_t stray = 0;        // completions whose wr_id no operation holds
};

class reactor {
 public:
  // Throws std::system_error (errc::invalid_argument) for bad options or an
  // unknown ANYDOOR_POLL value.
  reactor(asio::io_context& io, transport::completion_queue& cq, reactor_options options = {});
  ~reactor();
  reactor(const reactor&) = delete;
  reactor& operator=(const reactor&) = delete;

  // A wr_id for one work request whose completion goes to `op`; 0 when every
  // slot is taken.
  std::uint64_t track(operation& op) noexcept;
  // Forgets a wr_id whose request was never posted (post failed), or a
  // persistent slot (any of its wr_ids) once nothing of it is outstanding.
  void untrack(std::uint64_t wr_id) noexcept;

  // A persistent slot for `op`: 0 when every slot is taken, else a base
  // that persistent_id() combines with tags.
  std::uint64_t track_persistent(operation& op) noexcept;
  static constexpr std::uint64_t persistent_id(std::uint64_t base, std::uint32_t tag) noexcept {
    return base | (std::uint64_t{tag & 0x7fffffffu} << 32);
  }
  static constexpr std::uint32_t tag_of(std::uint64_t wr_id) noexcept {
    return static_cast<std::uint32_t>(wr_id >> 32) & 0x7fffffffu;
  }
  static constexpr std::uint64_t kPersistent = std::uint64_t{1} << 63;

  // Called after each poll pass that dispatched completions, before the
  // reactor polls again: where the runtime posts what those completions'
  // handlers queued (one doorbell per connection per pass).
  void set_after_dispatch(void (*fn)(void* ctx) noexcept, void* ctx) noexcept {
    after_dispatch_ = fn;
    after_dispatch_ctx_ = ctx;
  }

  // Busy and adaptive modes repeat polls within one io_context round (up
  // to spin_polls; other handlers, timers and sockets of the io_context wait
  // at most that long) unless fn(ctx) says the owner has handlers queued
  // that should run first, or something was posted from the io thread
  // during the round (a handler the completions resumed did: it runs next),
  // or the round has dispatched a batch of completions.
  // On an io_context not made with concurrency hint 1 such posts cannot be
  // seen, and a pass that dispatched completions ends the round; so it does
  // on an io_context shared with other reactors (what the completions sent
  // them is theirs to poll next).
  void set_yield_check(bool (*fn)(const void* ctx) noexcept, const void* ctx) noexcept {
    yield_check_ = fn;
    yield_check_ctx_ = ctx;
  }

  // What owns the reactor, held by the reactor's own handlers (its loop's
  // steps, its wait on the notify fd) while they run: a completion handler
  // they dispatch may destroy the owner (a fabric destroyed by the
  // coroutine one of its completions resumed), and the reactor then goes
  // once that handler of its own has returned, not under it.
  void set_owner(std::weak_ptr<const void> owner) noexcept { owner_ = std::move(owner); }

  // Busy and adaptive modes call fn(ctx) before each poll of a round and
  // once as the round ends: where the runtime posts what was queued outside
  // a completion pass (re-posted receives, sends of resumed coroutines)
  // without a handler of its own. While spinning() the owner may rely on it.
  void set_before_poll(void (*fn)(void* ctx) noexcept, void* ctx) noexcept {
    before_poll_ = fn;
    before_poll_ctx_ = ctx;
  }
  // True inside a busy or adaptive round, until its last before-poll call.
  bool spinning() const noexcept { return spinning_; }

  void start();  // begin polling (idempotent)
  void stop();   // stop polling; io_context::run() returns once nothing else is pending
  // Polls the completion queue now (also while stopped), dispatching what
  // is there: the fabric's liveness tick, so that a peer's heartbeats to an
  // idle side count. Not from inside a completion's handler. Returns the
  // completions dispatched.
  std::size_t poll_now();
  // poll_now() for a stopped reactor whose provider makes progress in poll
  // (completion_queue::progress_in_poll) and whose notify fd became
  // readable: the notifications are consumed first, so that the fd goes
  // quiet once nothing is left to do. Nothing while running (the reactor
  // polls itself then).
  std::size_t poll_stopped();
  bool running() const noexcept { return running_; }
  // It gave up on the completion queue (an overflow, a failed arm or wait):
  // it polls no more, and every operation it tracked has failed.
  bool failed() const noexcept { return failed_; }

  poll_mode mode() const noexcept { return mode_; }
  // Whether the notify fd is in the io_context's descriptor set (event mode
  // after its first wait; adaptive mode once it slept; busy mode never).
  bool watches_notify_fd() const noexcept { return fd_.is_open(); }
  const reactor_stats& stats() const noexcept { return stats_; }
  std::size_t tracked() const noexcept { return tracked_; }

 private:
  struct slot {
    operation* op = nullptr;
    std::uint32_t generation = 0;  // 31 bits
    std::uint32_t next_free = 0;
    bool persistent = false;
  };
  std::uint32_t take_slot(operation& op, bool persistent) noexcept;  // index + 1, or 0
  std::size_t drain();  // polls until empty; returns completions dispatched
  void dispatch(const transport::completion& c) noexcept;
  void fail_all() noexcept;
  void wait_readable();
  void on_readable();
  // drained: a drain just emptied the queue (a wake-up's), so the arm comes
  // first.
  void arm_and_wait(bool drained = false);
  // One busy round; `alive` is alive_'s reference a posted step carries (empty: none).
  void spin_step(std::shared_ptr<bool> alive = nullptr);
  void post_spin_step(std::shared_ptr<bool> alive, std::uint64_t epoch);
  bool watch_notify_fd();  // the notify fd joins the io_context (first sleep); false: failed
  // Whether a round can see what the io thread posts: concurrency hint 1,
  // no other reactor on the io_context.
  bool sees_posts() const noexcept;
  // Whether anything was posted on this thread since the running handler
  // began (if sees_posts()); `otherwise` where it cannot tell.
  bool handlers_posted_here(bool otherwise) const noexcept;

  asio::io_context& io_;
  transport::completion_queue& cq_;
  reactor_options options_;
  poll_mode mode_;
  int notify_fd_ = -1;  // our dup of the CQ's notify fd, until fd_ takes it
  asio::posix::stream_descriptor fd_;
  std::vector<slot> slots_;
  std::uint32_t free_head_ = 0;  // index + 1; 0: none free
  std::size_t tracked_ = 0;
  std::vector<transport::completion> buf_;
  void (*after_dispatch_)(void*) noexcept = nullptr;
  void* after_dispatch_ctx_ = nullptr;
  bool (*yield_check_)(const void*) noexcept = nullptr;
  const void* yield_check_ctx_ = nullptr;
  void (*before_poll_)(void*) noexcept = nullptr;
  void* before_poll_ctx_ = nullptr;
  bool spinning_ = false;
  bool one_thread_ = false;  // the io_context was made with concurrency hint 1
  // The reactors of this io_context (its registry's count, this one among them).
  std::atomic<std::uint32_t>* reactors_here_ = nullptr;
  bool running_ = false;
  std::uint64_t epoch_ = 0;  // bumped by start(): handlers of an earlier run retire
  // The epoch whose loop has its next step queued (start()'s first, a busy
  // round's next), 0 when none: a wake-up then leaves the polling to it.
  std::uint64_t queued_loop_ = 0;
  bool waiting_ = false;
  bool failed_ = false;
  std::chrono::steady_clock::time_point last_activity_{};
  reactor_stats stats_;
  // Handlers still queued in the io_context when the reactor is destroyed
  // see this flag cleared and do nothing.
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
  std::weak_ptr<const void> owner_;  // set_owner
};

}  // namespace anydoor
