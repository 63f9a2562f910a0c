#include <anydoor/error.hpp>
#include <anydoor/reactor.hpp>

#include "log.hpp"

#include <boost/asio/execution.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/require.hpp>
#include <boost/asio/version.hpp>

// Boost.Asio 1.26 (Boost 1.81, the version this project is built with): the
// scheduler of an io_context run by one thread queues what that thread posts
// in the thread's own queue, moved to the shared queue after each handler.
// Its emptiness is what a busy round looks at (see handlers_posted_here).
#if BOOST_ASIO_VERSION == 102600 && defined(BOOST_ASIO_HAS_THREADS)
#define ANYDOOR_SEES_ASIO_THREAD_QUEUE 1
#include <boost/asio/detail/call_stack.hpp>
#include <boost/asio/detail/scheduler.hpp>
#include <boost/asio/detail/scheduler_thread_info.hpp>
#include <boost/asio/detail/thread_context.hpp>
#else
#define ANYDOOR_SEES_ASIO_THREAD_QUEUE 0
#endif

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <system_error>

namespace anydoor {

std::string_view to_string(poll_mode m) noexcept {
  switch (m) {
    case poll_mode::event: return "event";
    case poll_mode::busy: return "busy";
    case poll_mode::adaptive: return "adaptive";
  }
  return "unknown";
}

bool parse_poll_mode(std::string_view text, poll_mode& out) noexcept {
  for (poll_mode m : {poll_mode::event, poll_mode::busy, poll_mode::adaptive}) {
    if (text == to_string(m)) {
      out = m;
      return true;
    }
  }
  return false;
}

namespace {

// Counts the reactors of an io_context.
class reactor_registry final : public asio::execution_context::service {
 public:
  using key_type = reactor_registry;
  static inline asio::execution_context::id id;
  explicit reactor_registry(asio::execution_context& ctx) : asio::execution_context::service(ctx) {}
  std::atomic<std::uint32_t> reactors{0};

 private:
  void shutdown() override {}
};

poll_mode effective_mode(const reactor_options& o) {
  const char* env = std::getenv("ANYDOOR_POLL");
  if (env == nullptr || *env == '\0') return o.mode;
  poll_mode m{};
  if (!parse_poll_mode(env, m)) {
    throw std::system_error(errc::invalid_argument,
                            std::string("ANYDOOR_POLL='") + env + "': use event, busy or adaptive");
  }
  return m;
}

const reactor_options& checked(const reactor_options& o) {
  if (o.batch < 16 || o.batch > 1024) {
    throw std::system_error(errc::invalid_argument, "reactor: batch must be in 16..1024");
  }
  if (o.max_operations == 0 || o.max_operations > (1u << 24)) {
    throw std::system_error(errc::invalid_argument, "reactor: max_operations must be in 1..2^24");
  }
  if (o.spin_polls == 0 || o.spin_polls > 1024) {
    throw std::system_error(errc::invalid_argument, "reactor: spin_polls must be in 1..1024");
  }
  if (o.spin.count() < 0) throw std::system_error(errc::invalid_argument, "reactor: negative spin time");
  return o;
}

int dup_fd(int fd) {
  const int d = ::dup(fd);
  if (d < 0) throw std::system_error(errno, std::system_category(), "reactor: dup(notify fd)");
  return d;
}

}  // namespace

reactor::reactor(asio::io_context& io, transport::completion_queue& cq, reactor_options options)
    : io_(io), cq_(cq), options_(checked(options)), mode_(effective_mode(options_)),
      notify_fd_(dup_fd(cq.notify_fd())), fd_(io), slots_(options_.max_operations), buf_(options_.batch) {
  for (std::uint32_t i = 0; i < options_.max_operations; ++i) slots_[i].next_free = i + 2;
  slots_.back().next_free = 0;
  free_head_ = 1;
#if ANYDOOR_SEES_ASIO_THREAD_QUEUE
  // (Hint 1 only: with others, what the io thread posts goes to the shared
  // queue, and a round cannot see it.)
  one_thread_ = asio::use_service<asio::detail::io_context_impl>(io_).concurrency_hint() == 1;
#endif
  log().debug("reactor: poll mode {}, batch {}, {} operation slots", to_string(mode_), options_.batch,
              options_.max_operations);
  // (Last: the destructor, which takes it back, runs only if this ends.)
  reactors_here_ = &asio::use_service<reactor_registry>(io_).reactors;
  reactors_here_->fetch_add(1, std::memory_order_relaxed);
}

reactor::~reactor() {
  reactors_here_->fetch_sub(1, std::memory_order_relaxed);
  *alive_ = false;
  running_ = false;
  boost::system::error_code ignored;
  fd_.cancel(ignored);
  if (notify_fd_ >= 0) ::close(notify_fd_);
}

bool reactor::watch_notify_fd() {
  if (notify_fd_ < 0) return true;
  boost::system::error_code ec;
  fd_.assign(notify_fd_, ec);
  if (ec) {
    log().error("reactor: watching the completion queue's notify fd failed: {}; failing {} pending operations",
                ec.message(), tracked_);
    fail_all();
    return false;
  }
  notify_fd_ = -1;
  return true;
}

std::uint32_t reactor::take_slot(operation& op, bool persistent) noexcept {
  if (free_head_ == 0) return 0;
  const std::uint32_t index = free_head_ - 1;
  slot& s = slots_[index];
  free_head_ = s.next_free;
  s.op = &op;
  s.persistent = persistent;
  s.generation = (s.generation + 1) & 0x7fffffffu;
  ++tracked_;
  return index + 1;
}

std::uint64_t reactor::track(operation& op) noexcept {
  const std::uint32_t i = take_slot(op, false);
  if (i == 0) return 0;
  return (std::uint64_t{slots_[i - 1].generation} << 32) | i;
}

std::uint64_t reactor::track_persistent(operation& op) noexcept {
  const std::uint32_t i = take_slot(op, true);
  return i == 0 ? 0 : (kPersistent | i);
}

void reactor::untrack(std::uint64_t wr_id) noexcept {
  const auto index = static_cast<std::uint32_t>(wr_id & 0xffffffffu);
  if (index == 0 || index > slots_.size()) return;
  slot& s = slots_[index - 1];
  if (s.op == nullptr) return;
  if ((wr_id & kPersistent) != 0) {
    if (!s.persistent) return;
  } else if (s.persistent || s.generation != tag_of(wr_id)) {
    return;
  }
  s.op = nullptr;
  s.persistent = false;
  s.next_free = free_head_;
  free_head_ = index;
  --tracked_;
}

void reactor::dispatch(const transport::completion& c) noexcept {
  const auto index = static_cast<std::uint32_t>(c.wr_id & 0xffffffffu);
  slot* s = index == 0 || index > slots_.size() ? nullptr : &slots_[index - 1];
  const bool persistent = (c.wr_id & kPersistent) != 0;
  if (s == nullptr || s->op == nullptr || s->persistent != persistent ||
      (!persistent && s->generation != tag_of(c.wr_id))) {
    ++stats_.stray;
    log().warn("reactor: completion for unknown wr_id {:#x} ({}) dropped", c.wr_id, transport::to_string(c.status));
    return;
  }
  operation* op = s->op;
  if (!persistent) {
    // Checked above: the slot is free before the operation runs (it may
    // track again).
    s->op = nullptr;
    s->next_free = free_head_;
    free_head_ = index;
    --tracked_;
  }
  ++stats_.completions;
  op->complete(c);
}

void reactor::fail_all() noexcept {
  failed_ = true;
  running_ = false;
  for (std::uint32_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].op == nullptr) continue;
    const std::uint64_t wr_id = slots_[i].persistent ? (kPersistent | (i + 1))
                                                     : ((std::uint64_t{slots_[i].generation} << 32) | (i + 1));
    dispatch({.wr_id = wr_id, .status = transport::wc_status::fatal});
  }
  if (after_dispatch_ != nullptr) after_dispatch_(after_dispatch_ctx_);
}

std::size_t reactor::drain() {
  std::size_t total = 0;
  for (;;) {
    std::error_code ec;
    const std::size_t n = cq_.poll(buf_, ec);
    ++stats_.polls;
    if (ec) {
      log().error("reactor: polling the completion queue failed: {}; failing {} pending operations", ec.message(),
                  tracked_);
      fail_all();
      return total;
    }
    if (n == 0) ++stats_.empty_polls;
    for (std::size_t i = 0; i < n; ++i) dispatch(buf_[i]);
    total += n;
    if (n > 0 && after_dispatch_ != nullptr) after_dispatch_(after_dispatch_ctx_);
    if (n < buf_.size()) return total;
  }
}

std::size_t reactor::poll_now() {
  if (failed_) return 0;
  const std::size_t n = drain();
  // Stopped: armed again, as stop() leaves it (the tcp provider sends the
  // acknowledgements it holds back when armed). So is a queue the loop
  // sleeps on whose arm this poll may have spent: the reactor arms again
  // after any poll that returned completions before it sleeps (the queue
  // may count on it: cq_options::owner_rearms).
  if (!failed_ && (!running_ || (waiting_ && n > 0))) (void)cq_.arm();
  return n;
}

std::size_t reactor::poll_stopped() {
  if (running_ || failed_) return 0;
  cq_.ack_events();
  return poll_now();
}

void reactor::start() {
  if (running_ || failed_) return;
  running_ = true;
  const std::uint64_t epoch = ++epoch_;
  last_activity_ = std::chrono::steady_clock::now();
  queued_loop_ = epoch;
  asio::post(io_, [this, alive = alive_, epoch] {
    if (!*alive) return;
    const auto keep = owner_.lock();  // (set_owner)
    if (queued_loop_ == epoch) queued_loop_ = 0;
    if (!running_ || epoch != epoch_) return;
    if (mode_ == poll_mode::event) {
      arm_and_wait();
    } else {
      spin_step();
    }
  });
}

void reactor::stop() {
  // Arming also sends what a provider holds back until then (the tcp
  // provider's lone acknowledgements): the peer's requests this side has
  // received must not wait for this side's next poll to complete there.
  if (running_ && !failed_) (void)cq_.arm();
  running_ = false;
  boost::system::error_code ignored;
  fd_.cancel(ignored);
}

void reactor::post_spin_step(std::shared_ptr<bool> alive, std::uint64_t epoch) {
  // The reactor's own loop goes on: a continuation of the handler running
  // now. From inside the io_context's run(), Asio queues it for this thread
  // (one lock of its scheduler fewer, no atomic count of its work) and
  // appends it to the shared queue when this handler returns, behind what
  // others have posted. The flag's reference moves from step to step.
  auto ex = asio::require(io_.get_executor(), asio::execution::blocking.never,
                          asio::execution::relationship.continuation);
  if (epoch == epoch_) queued_loop_ = epoch;
  ex.execute([this, alive = std::move(alive), epoch]() mutable {
    if (!*alive) return;
    const auto keep = owner_.lock();  // (set_owner; released after the step, *this perhaps with it)
    if (queued_loop_ == epoch) queued_loop_ = 0;
    if (epoch == epoch_) spin_step(std::move(alive));
  });
}

bool reactor::sees_posts() const noexcept {
  return one_thread_ && reactors_here_->load(std::memory_order_relaxed) == 1;
}

bool reactor::handlers_posted_here(bool otherwise) const noexcept {
#if ANYDOOR_SEES_ASIO_THREAD_QUEUE
  using namespace asio::detail;
  io_context_impl& sched = asio::use_service<io_context_impl>(io_);
  if (thread_info_base* t = call_stack<thread_context, thread_info_base>::contains(&sched)) {
    return !static_cast<scheduler_thread_info*>(t)->private_op_queue.empty();
  }
#endif
  return otherwise;  // (not inside this io_context's run(): cannot tell)
}

void reactor::spin_step(std::shared_ptr<bool> alive) {
  if (!running_) return;
  // (A stop and a start from a handler of this round start another loop:
  // this one's next step retires.)
  const std::uint64_t epoch = epoch_;
  // Busy mode never sleeps: no clock read per round (adaptive mode keeps
  // the time of the last completion).
  const bool timed = mode_ != poll_mode::busy;
  const auto now = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  // Polls repeat within this round (up to spin_polls) while the owner has
  // none of its handlers waiting and nothing else was queued for this
  // thread: each io_context round costs Asio an epoll_wait, a system call
  // the raw provider loop does not make. Once the handlers a pass
  // dispatched have posted anything (a coroutine that yields with
  // asio::post, a co_spawn, a socket operation that completed at once),
  // the round ends so that it runs; so it does once the round has
  // dispatched a batch of completions. Where posts cannot be seen (an
  // io_context not made with concurrency hint 1), a pass that dispatched
  // completions ends the round; so it does where other reactors share the
  // io_context: what the completions' handlers sent one of them (two
  // fabrics talking in one process) is for that one to poll next, and its
  // step waits in the shared queue. Not seen, and served after the round:
  // timers (a wait started in a handler queues nothing until epoll_wait
  // finds it due), sockets, posts from other threads, an io_context::stop().
  const bool sees = sees_posts();
  std::size_t round_completions = 0;
  spinning_ = true;
  for (std::uint32_t i = 0; i < options_.spin_polls && running_; ++i) {
    if (before_poll_ != nullptr) before_poll_(before_poll_ctx_);
    if (!running_) break;
    const std::size_t n = drain();
    if (n > 0 && timed) last_activity_ = now;
    round_completions += n;
    if (n > 0 && (!sees || round_completions >= options_.batch)) break;
    if (sees && handlers_posted_here(n > 0)) break;
    if (yield_check_ != nullptr && yield_check_(yield_check_ctx_)) break;
  }
  spinning_ = false;
  if (before_poll_ != nullptr) before_poll_(before_poll_ctx_);
  if (!running_) return;
  if (!timed || now - last_activity_ < options_.spin) {
    post_spin_step(alive != nullptr ? std::move(alive) : alive_, epoch);
    return;
  }
  arm_and_wait();
}

void reactor::arm_and_wait(bool drained) {
  // (A stop and a start from a handler run by a drain below start another
  // loop: the step posted here then retires.)
  const std::uint64_t epoch = epoch_;
  while (running_) {
    if (!drained) drain();
    drained = false;
    if (!running_) return;
    if (auto ec = cq_.arm()) {
      log().error("reactor: arming the completion queue failed: {}", ec.message());
      fail_all();
      return;
    }
    ++stats_.arms;
    // Completions that arrived before the arm do not notify: drain again -
    // unless the queue's arm reports them itself (the fd is readable then).
    if (cq_.arm_reports_queued() || drain() == 0) break;
    if (mode_ == poll_mode::adaptive) {
      last_activity_ = std::chrono::steady_clock::now();
      post_spin_step(alive_, epoch);
      return;
    }
  }
  if (running_) wait_readable();
}

void reactor::wait_readable() {
  if (waiting_) return;
  if (!watch_notify_fd()) return;
  waiting_ = true;
  fd_.async_wait(asio::posix::stream_descriptor::wait_read,
                 [this, alive = alive_](const boost::system::error_code& ec) {
    if (!*alive) return;
    const auto keep = owner_.lock();  // (set_owner)
    waiting_ = false;
    if (!running_) return;
    // Cancelled by a stop() that a start() has since undone: wait again.
    if (ec == asio::error::operation_aborted) return wait_readable();
    if (ec) {
      // The notify fd cannot be waited on (e.g. a descriptor epoll refuses):
      // no wake-up would ever come, so pending operations would hang.
      log().error("reactor: waiting on the completion queue's notify fd failed: {}; failing {} pending operations",
                  ec.message(), tracked_);
      fail_all();
      return;
    }
    on_readable();
  });
}

void reactor::on_readable() {
  ++stats_.wakeups;
  cq_.ack_events();
  const std::size_t n = drain();
  if (!running_) return;
  // A loop of this epoch has its next step queued: a stop and a start from
  // a handler of the drain above, or a busy loop a start() began while this
  // wait was pending (a stop's cancel, then the wait renewed). That loop
  // polls (from now on, if these were completions); starting another would
  // poll twice per round, for good.
  if (queued_loop_ == epoch_) {
    if (mode_ == poll_mode::adaptive && n > 0) last_activity_ = std::chrono::steady_clock::now();
    return;
  }
  if (mode_ == poll_mode::adaptive && n > 0) {
    last_activity_ = std::chrono::steady_clock::now();
    spin_step();
    return;
  }
  arm_and_wait(true);
}

}  // namespace anydoor
