#include <anydoor/error.hpp>
#include <anydoor/fabric.hpp>

#include "connection_impl.hpp"
#include "fabric_state.hpp"
#include "log.hpp"
#include "staging.hpp"
#include "registration_cache.hpp"
#include "split_region.hpp"
#include "cuda/driver.hpp"
#include "cuda/register.hpp"

#include <boost/asio/post.hpp>

#include <sanitizer/asan_interface.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <new>
#include <stop_token>
#include <string>
#include <thread>

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

namespace anydoor {

namespace detail {

namespace {

void require(bool ok, const char* what) {
  if (!ok) throw std::system_error(errc::invalid_argument, what);
}

const fabric_options& checked(const fabric_options& o) {
  const connection_options& c = o.connection;
  require(o.max_connections >= 1 && o.max_connections <= 4096, "fabric: max_connections must be in 1..4096");
  require(c.credits >= 4 && c.credits <= 4096, "fabric: connection.credits must be in 4..4096");
  require(c.eager_limit >= 1 && c.eager_limit <= (1u << 20), "fabric: connection.eager_limit must be in 1..1 MiB");
  require(c.max_message >= 1 && c.max_message <= (std::uint64_t{1} << 40),
          "fabric: connection.max_message must be in 1..2^40");
  require(c.send_queue >= 8 && c.send_queue <= 4096, "fabric: connection.send_queue must be in 8..4096");
  require(c.signal_interval >= 1 && c.signal_interval <= c.send_queue,
          "fabric: connection.signal_interval must be in 1..send_queue");
  require(c.connect_timeout.count() > 0, "fabric: connection.connect_timeout must be positive");
  require(c.handshake_timeout.count() > 0 && c.handshake_timeout <= std::chrono::minutes(10),
          "fabric: connection.handshake_timeout must be in 1 ms..10 min");
  require(c.buffer_wait.count() >= 0, "fabric: connection.buffer_wait must not be negative");
  require(c.rendezvous_memory >= 4096 && c.rendezvous_memory <= (std::uint64_t{1} << 40),
          "fabric: connection.rendezvous_memory must be in 4096..2^40");
  require(c.fragment_size == 0 || (c.fragment_size >= 4096 && c.fragment_size <= (1u << 30)),
          "fabric: connection.fragment_size must be 0 or in 4096..2^30");
  require(c.eager_split_limit <= (1u << 24), "fabric: connection.eager_split_limit must be in 0..16 MiB");
  require(o.cache_max_entries >= 1 && o.cache_max_entries <= (std::size_t{1} << 20),
          "fabric: cache_max_entries must be in 1..2^20");
  require(o.cache_max_bytes >= 4096, "fabric: cache_max_bytes must be at least 4096");
  require(o.max_piece_bytes == 0 || o.max_piece_bytes >= 4096, "fabric: max_piece_bytes must be 0 or at least 4096");
  require(c.auth_token.size() <= 1024, "fabric: connection.auth_token must be at most 1024 bytes");
  require(o.srq_buffers == 0 || (o.srq_buffers >= 8 && o.srq_buffers <= (1u << 20)),
          "fabric: srq_buffers must be 0 or in 8..2^20");
  require(o.gpu_staging_chunk >= 4096 && o.gpu_staging_chunk <= (std::size_t{1} << 30),
          "fabric: gpu_staging_chunk must be in 4096..2^30");
  require(o.gpu_bounce_threshold <= (std::size_t{1} << 30), "fabric: gpu_bounce_threshold must be at most 2^30");
  require(o.gpu_staging_buffers >= 2 && o.gpu_staging_buffers <= 1024,
          "fabric: gpu_staging_buffers must be in 2..1024");
  require(o.gpu_staging_chunk * o.gpu_staging_buffers <= (std::size_t{1} << 34),
          "fabric: gpu_staging_chunk x gpu_staging_buffers must be at most 16 GiB");
  require(o.late_read_grace.count() >= 0 && o.late_read_grace <= std::chrono::seconds(10),
          "fabric: late_read_grace must be in 0..10 s");
  require(c.keepalive.count() == 0 || (c.keepalive >= std::chrono::milliseconds(200) && c.keepalive <= std::chrono::hours(1)),
          "fabric: connection.keepalive must be 0 or in 200 ms..1 h");
  return o;
}

reactor_options reactor_for(const fabric_options& o) {
  reactor_options r = o.reactor;
  // Two persistent slots per connection.
  r.max_operations = std::max<std::uint32_t>(r.max_operations, 2 * o.max_connections + 16);
  return r;
}

std::error_code reason_error(protocol::refuse_reason r) {
  switch (r) {
    case protocol::refuse_reason::version: return errc::version_mismatch;
    case protocol::refuse_reason::authentication: return errc::authentication_failed;
    case protocol::refuse_reason::resources: return errc::too_many_connections;
    case protocol::refuse_reason::malformed:
    case protocol::refuse_reason::none: break;
  }
  return errc::protocol_error;
}

protocol::refuse_reason refuse_for(std::error_code ec) {
  if (ec == errc::version_mismatch) return protocol::refuse_reason::version;
  if (ec == errc::authentication_failed) return protocol::refuse_reason::authentication;
  // (invalid_state: the fabric can take no connection, its completion queue
  // lost; the peer is not at fault.)
  if (ec == errc::too_many_connections || ec == errc::no_buffer_space || ec == errc::invalid_state) {
    return protocol::refuse_reason::resources;
  }
  return protocol::refuse_reason::malformed;
}

}  // namespace

fabric_state::fabric_state(asio::io_context& io_ctx, const fabric_options& o)
    : io(io_ctx), options(checked(o)), device(transport::open_device(o.device)) {
  const transport::capabilities& caps = device->caps();
  const connection_options& c = options.connection;
  if (caps.late_duplicates && options.late_read_grace.count() > 0) retired_limit_ = held_sources_limit();
  // Receive completions: each connection's own receives, or the shared
  // queue's (whichever connection takes them).
  const std::uint64_t depth = options.srq_buffers != 0
                                  ? std::uint64_t{options.max_connections} * c.send_queue + options.srq_buffers
                                  : std::uint64_t{options.max_connections} * (c.send_queue + c.credits);
  if (depth > caps.max_cqe) {
    throw std::system_error(errc::invalid_argument,
                            std::string(options.srq_buffers != 0 ? "fabric: max_connections * send_queue + srq_buffers = "
                                                                 : "fabric: max_connections * (send_queue + credits) = ") +
                                std::to_string(depth) + " exceeds the device's completion queue limit " +
                                std::to_string(caps.max_cqe));
  }
  if (options.srq_buffers != 0 && (caps.max_srq == 0 || options.srq_buffers > caps.max_srq_wr)) {
    throw std::system_error(caps.max_srq == 0 ? errc::not_supported : errc::invalid_argument,
                            caps.max_srq == 0 ? "fabric: srq_buffers: device " + std::string(device->name()) +
                                                    " has no shared receive queues"
                                              : "fabric: srq_buffers above the device's max_srq_wr " +
                                                    std::to_string(caps.max_srq_wr));
  }
  if (c.send_queue > caps.max_qp_wr || c.credits > caps.max_qp_wr) {
    throw std::system_error(errc::invalid_argument, "fabric: send_queue or credits above the device's max_qp_wr " +
                                                        std::to_string(caps.max_qp_wr));
  }
  pd = device->alloc_pd();
  // (The reactor, the queue's one consumer, arms it again before it sleeps.)
  cq = device->create_cq(static_cast<std::uint32_t>(depth),
                         {.progress_thread = options.progress_thread, .owner_rearms = true});
  inline_cap = std::min<std::uint32_t>(caps.max_inline, 256);
  recv_buffer = static_cast<std::uint32_t>((protocol::kHeaderSize + c.eager_limit + 63) / 64 * 64);
  pool = std::make_unique<buffer_pool>(
      *pd, buffer_pool_options{.buffer_size = recv_buffer, .buffers_per_slab = options.buffers_per_slab,
                               .initial_slabs = 1, .max_bytes = options.pool_max_bytes});
  {
    // (a device that states no limit has none we know of)
    const std::uint64_t device_limit = caps.max_mr_size != 0 ? caps.max_mr_size : ~std::uint64_t{0};
    const std::uint64_t limit =
        options.max_piece_bytes == 0 ? device_limit : std::min(options.max_piece_bytes, device_limit);
    piece_shift = detail::piece_shift(limit);
    if (piece_shift == 0) {
      throw std::system_error(errc::not_supported, "fabric: device " + std::string(device->name()) +
                                                       " registers at most " + std::to_string(caps.max_mr_size) +
                                                       " bytes at once (max_mr_size), less than a page");
    }
  }
  cache = std::make_unique<registration_cache>(*pd, options.cache_max_bytes, options.cache_max_entries, piece_shift,
                                               device.get());
  kept_blocks_.reserve(kKeptBlocks);
  kept_clock_ = std::chrono::steady_clock::now();
  spare_holders_.reserve(kKeptBlocks);
  reactor = std::make_unique<anydoor::reactor>(io, *cq, reactor_for(options));
  reactor->set_after_dispatch(&fabric_state::flush_after_dispatch, this);
  reactor->set_yield_check(&fabric_state::has_queued_handlers, this);
  reactor->set_before_poll(&fabric_state::flush_before_poll, this);
  if (options.srq_buffers != 0) {
    srq = pd->create_srq({.max_wr = options.srq_buffers, .max_sge = 1});
    srq_op_.f = this;
    srq_base_ = reactor->track_persistent(srq_op_);
    for (std::uint32_t i = 0; i < options.srq_buffers; ++i) {
      const std::uint32_t b = pool->try_get();
      if (b == buffer_pool::npos) {
        throw std::system_error(errc::no_buffer_space, "fabric: the buffer pool (pool_max_bytes) cannot hold srq_buffers " +
                                                           std::to_string(options.srq_buffers) + " receive buffers");
      }
      srq_repost(b);
    }
    if (srq_posted != options.srq_buffers) {
      throw std::system_error(errc::no_buffer_space, "fabric: posting the shared receive queue failed");
    }
  }
  if (c.keepalive.count() > 0) {
    tick_ms_ = std::max(kMinTick, std::min(kMaxTick, std::chrono::milliseconds(c.keepalive / 8))).count();
  }
  auth = !c.auth_token.empty();
  if (auth && c.auth_token.size() < 16) {
    log().warn("fabric: the auth token has {} bytes: a sniffed handshake lets an attacker guess short tokens "
               "offline; use at least 16 random bytes",
               c.auth_token.size());
  }
  log().info("fabric: provider {} device {}, up to {} connections, eager limit {} B, {} credits, poll mode {}{}",
             device->provider(), device->name(), options.max_connections, c.eager_limit, c.credits,
             to_string(reactor->mode()),
             srq != nullptr ? ", shared receive queue of " + std::to_string(options.srq_buffers) + " buffers" : "");
  // Which path each kind of memory takes, and why (GPU memory needs a
  // driver: without one the line is for the curious only).
  // (A process that has not loaded the driver has no GPU memory: the
  // driver is not loaded, let alone initialised, for this line.)
  if (cuda::detail::installed_test_backend() != nullptr) {
    log().info("fabric: memory kinds: a test stands in for the GPU; cuda_device: {}",
               cuda::detail::device_memory_path(*device));
  } else if (!cuda::built_with_cuda()) {
    log().debug("fabric: memory kinds: host only (built without CUDA)");
  } else if (!cuda::detail::process_has_cuda(true)) {
    log().debug("fabric: memory kinds: host only (this process has not loaded the CUDA driver)");
  } else if (!cuda::driver().usable) {
    log().info("fabric: memory kinds: host only: {}", cuda::driver().why);
  } else {
    log().info("fabric: memory kinds: host and cuda_host: registered as they are; cuda_device: {}",
               cuda::detail::device_memory_path(*device));
  }
}

void fabric_state::start_liveness() {
  // A thread, not an Asio timer: a timer would keep io_context::run() from
  // returning while connections are open (so would a wait on the notify
  // fd). The thread only posts: ticks, one at a time, and with watch_cq_
  // idle_progress(), one at a time.
  // It never holds the fabric (the destructor stops and joins it before
  // anything it reads goes away: the completion queue's fd too); what it
  // posts holds a weak reference.
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) throw std::system_error(errno, std::system_category(), "fabric: eventfd");
  watch_cq_ = cq->progress_in_poll();
  const int cq_fd = watch_cq_ ? cq->notify_fd() : -1;
  liveness_ = std::jthread([this, w = weak_from_this(), cq_fd](std::stop_token stop) {
    const std::stop_callback on_stop(stop, [this] { wake_liveness(); });
    using clock = std::chrono::steady_clock;
    auto next_tick = clock::now() + std::chrono::milliseconds(tick_ms_.load(std::memory_order_relaxed));
    while (!stop.stop_requested()) {
      const bool watch = cq_fd >= 0 && reactor_idle_.load(std::memory_order_acquire) &&
                         !progress_posted_.load(std::memory_order_acquire);
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(next_tick - clock::now());
      std::array<pollfd, 2> fds{{{wake_fd_, POLLIN, 0}, {cq_fd, POLLIN, 0}}};
      const int n = ::poll(fds.data(), watch ? 2 : 1, static_cast<int>(std::max<std::int64_t>(left.count(), 0)));
      if (stop.stop_requested()) return;
      if (n > 0 && (fds[0].revents & POLLIN) != 0) {
        std::uint64_t count = 0;
        [[maybe_unused]] const auto r = ::read(wake_fd_, &count, sizeof count);
      }
      if (watch && n > 0 && (fds[1].revents & POLLIN) != 0 && !progress_posted_.exchange(true)) {
        asio::post(io, [w] {
          if (auto f = w.lock()) f->idle_progress();
        });
      }
      // Woken early by want_tick (a new connection wants ticks sooner): a
      // tick now, the next after the new period.
      const auto now = clock::now();
      if (tick_wanted_.exchange(false) || now >= next_tick) {
        next_tick = now + std::chrono::milliseconds(tick_ms_.load(std::memory_order_relaxed));
        if (!tick_posted_.exchange(true)) {
          asio::post(io, [w] {
            if (auto f = w.lock()) f->liveness_tick();
          });
        }
      }
    }
  });
}

void fabric_state::wake_liveness() noexcept {
  const std::uint64_t one = 1;
  [[maybe_unused]] const auto r = ::write(wake_fd_, &one, sizeof one);
}

void fabric_state::stop_liveness() noexcept {
  liveness_.request_stop();  // (its stop callback wakes the thread)
  if (liveness_.joinable()) liveness_.join();
}

void fabric_state::want_tick(std::chrono::milliseconds within) {
  const std::int64_t ms = std::max(within, kMinTick).count();
  if (ms >= tick_ms_.load(std::memory_order_relaxed)) return;
  tick_ms_.store(ms, std::memory_order_relaxed);
  tick_wanted_.store(true);
  wake_liveness();
}

void fabric_state::idle_progress() noexcept {
  // A failed reactor polls no more: nothing would take what makes the fd
  // readable (an overflowed queue's eventfd), so the watch ends here, for
  // good, instead of waking over and over.
  if (reactor->failed()) return;
  // (A reactor started meanwhile polls by itself.)
  if (active_ == 0) reactor->poll_stopped();
  progress_posted_.store(false, std::memory_order_release);
  wake_liveness();  // watch again
}

void fabric_state::add(connection_impl* c) { conns_.push_back(c); }

void fabric_state::count_failure(std::error_code ec) noexcept {
  for (failure_count& f : failures) {
    if (f.error == ec) {
      ++f.count;
      return;
    }
  }
  try {
    failures.push_back({ec, 1});
  } catch (const std::bad_alloc&) {
    // (out of memory: this one goes uncounted)
  }
}

void fabric_state::remove(connection_impl* c) noexcept { std::erase(conns_, c); }

// Backwards: a connection that goes in abandon() leaves conns_, moving only
// those after it, already seen.
void fabric_state::abandon_connections() noexcept {
  for (std::size_t i = conns_.size(); i-- > 0;) {
    if (i < conns_.size()) conns_[i]->abandon();
  }
}

void fabric_state::trim_free_lists() noexcept {
  nodes_.trim();
  batches_.trim();
  // Each kept block carries the time of the trim before it was given back
  // (no clock on the data path): one unused for kKeptQuiet goes, whatever
  // the others do.
  kept_clock_ = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < kept_blocks_.size();) {
    if (kept_clock_ - kept_blocks_[i]->deadline < kKeptQuiet) {
      ++i;
      continue;
    }
    free_block(*unkeep(i));
  }
}

void fabric_state::retire_source(std::unique_ptr<transport::memory_region> mr, std::unique_ptr<std::byte[]> copy,
                                 std::size_t bytes) noexcept {
  const auto now = std::chrono::steady_clock::now();
  release_sources(now, false);
  const auto grace = options.late_read_grace;
  bool held = grace.count() > 0 && bytes <= retired_limit_;
  if (held && retired_.empty()) {
    try {
      retired_.resize(kRetiredMax);
    } catch (const std::bad_alloc&) {
      held = false;  // (no memory for the ring)
    }
  }
  if (!held) {
    if (grace.count() > 0) ++retired_early_;
    mr.reset();  // the registration before the memory it covers
    copy.reset();
    return;
  }
  const std::uint64_t early = retired_early_;
  while (retired_count_ != 0 && (retired_count_ == kRetiredMax || retired_bytes_ + bytes > retired_limit_)) {
    release_oldest_source();
    ++retired_early_;
  }
  if (retired_early_ != early && (early == 0 || std::has_single_bit(retired_early_))) {
    log().warn("fabric: rendezvous sources held for late duplicate READs reached {} or {} bytes: {} deregistered "
               "before late_read_grace so far (a late READ of one fails its connection)",
               kRetiredMax, retired_limit_, retired_early_);
  }
  retired_source& r = retired_[(retired_head_ + retired_count_) % kRetiredMax];
  r = {now + grace, bytes, std::move(mr), std::move(copy)};
  ++retired_count_;
  retired_bytes_ += bytes;
  if (retired_count_ == 1) {
    try {
      want_tick(grace);
    } catch (...) {
      // (the next tick, within kMaxTick, deregisters it)
    }
  }
}

std::size_t fabric_state::held_sources_limit() {
  // Held registrations pin pages: under a finite RLIMIT_MEMLOCK (without
  // CAP_IPC_LOCK, which lifts it) they hold at most an eighth of it, so
  // that registrations of the rest of the process still fit.
  rlimit rl{};
  if (::getrlimit(RLIMIT_MEMLOCK, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return kRetiredBytes;
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("CapEff:", 0) != 0) continue;
    try {
      const unsigned long long eff = std::stoull(line.substr(7), nullptr, 16);
      if ((eff & (1ull << 14)) != 0) return kRetiredBytes;  // CAP_IPC_LOCK
    } catch (const std::exception&) {
      // (unreadable: the limit applies)
    }
    break;
  }
  const std::size_t limit = std::min<std::size_t>(kRetiredBytes, static_cast<std::size_t>(rl.rlim_cur / 8));
  log().info("fabric: RLIMIT_MEMLOCK is {} bytes: rendezvous sources held for late duplicate READs take at most {}",
             static_cast<unsigned long long>(rl.rlim_cur), limit);
  return limit;
}

void fabric_state::release_oldest_source() noexcept {
  retired_source& r = retired_[retired_head_];
  r.mr.reset();  // the registration before the memory it covers
  r.copy.reset();
  retired_bytes_ -= r.bytes;
  retired_head_ = (retired_head_ + 1) % kRetiredMax;
  --retired_count_;
}

std::size_t fabric_state::release_sources(std::chrono::steady_clock::time_point now, bool all) noexcept {
  std::size_t n = 0;
  for (; retired_count_ != 0 && (all || retired_[retired_head_].until <= now); ++n) release_oldest_source();
  return n;
}

void fabric_state::liveness_tick() noexcept {
  tick_posted_ = false;
  trim_free_lists();
  // Completions that came while nothing was pending here (a peer's
  // heartbeat to an idle fabric) are taken now, so that they count.
  reactor->poll_now();
  const auto now = std::chrono::steady_clock::now();
  std::chrono::milliseconds next = kMaxTick;
  release_sources(now, false);
  // Held sources: a tick every late_read_grace while any is held (each
  // goes within twice the grace). Not the time left to the oldest: a
  // deadline that nears by a millisecond per tick would have every tick
  // wake the thread for the next at once.
  if (retired_count_ != 0) next = std::min(next, options.late_read_grace);
  // (connection_impl::liveness may fail a connection: that never removes it from conns_ here.)
  for (std::size_t i = 0; i < conns_.size(); ++i) next = std::min(next, conns_[i]->liveness(now));
  next = std::max(next, kMinTick);
  if (next.count() < tick_ms_.load(std::memory_order_relaxed)) {
    want_tick(next);  // sooner than the thread's current wait: wake it
  } else {
    tick_ms_.store(next.count(), std::memory_order_relaxed);
  }
}

fabric_state::~fabric_state() {
  stop_liveness();
  if (wake_fd_ >= 0) ::close(std::exchange(wake_fd_, -1));
  helpers.stop_all();
  srq.reset();  // its queue pairs are gone (connections hold the fabric); before the pool's memory
  reactor.reset();
  cache.reset();
  release_sources({}, true);  // (before the protection domain)
  drop_kept();
  pool.reset();
}

// Kept blocks are poisoned for AddressSanitizer: a released message read
// after its block was kept is reported, not silently the next message.
namespace {
void poison_block(const op_node& h) noexcept {
  ASAN_POISON_MEMORY_REGION(h.large.get(), h.mr->length());
  (void)h;
}
void unpoison_block(const op_node& h) noexcept {
  ASAN_UNPOISON_MEMORY_REGION(h.large.get(), h.mr->length());
  (void)h;
}
}  // namespace

std::unique_ptr<op_node> fabric_state::unkeep(std::size_t i) noexcept {
  std::unique_ptr<op_node> h = std::move(kept_blocks_[i]);
  kept_blocks_[i] = std::move(kept_blocks_.back());
  kept_blocks_.pop_back();
  kept_bytes_ -= h->mr->length();
  return h;
}

void fabric_state::free_block(op_node& h) noexcept {
  unpoison_block(h);
  h.mr.reset();  // the registration before the memory
  h.large.reset();
}

void fabric_state::drop_kept() noexcept {
  for (auto& h : kept_blocks_) free_block(*h);
  kept_blocks_.clear();
  kept_bytes_ = 0;
}

bool fabric_state::take_block(std::size_t n, std::unique_ptr<std::byte[]>& large,
                              std::unique_ptr<transport::memory_region>& mr) noexcept {
  // The smallest that fits, and not one far larger than the message (it
  // would be held by a small message while a large one allocates).
  std::size_t best = kept_blocks_.size();
  for (std::size_t i = 0; i < kept_blocks_.size(); ++i) {
    const std::size_t cap = kept_blocks_[i]->mr->length();
    if (cap >= n && cap <= 2 * n + (std::size_t{64} << 10) &&
        (best == kept_blocks_.size() || cap < kept_blocks_[best]->mr->length())) {
      best = i;
    }
  }
  if (best == kept_blocks_.size()) return false;
  std::unique_ptr<op_node> h = unkeep(best);
  unpoison_block(*h);
  large = std::move(h->large);
  mr = std::move(h->mr);
  if (spare_holders_.size() < kKeptBlocks) spare_holders_.push_back(std::move(h));  // (capacity reserved)
  return true;
}

std::unique_ptr<op_node> fabric_state::take_holder() noexcept {
  if (!spare_holders_.empty()) {
    std::unique_ptr<op_node> h = std::move(spare_holders_.back());
    spare_holders_.pop_back();
    return h;
  }
  try {
    return std::make_unique<op_node>();
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}

void fabric_state::keep_block(std::unique_ptr<op_node> h) noexcept {
  if (h->mr != nullptr && h->large != nullptr && h->mr->addr() == h->large.get()) {
    const std::size_t cap = h->mr->length();
    if (cap <= kKeptBlockMax && kept_blocks_.size() < kKeptBlocks && kept_bytes_ + cap <= kKeptBytes) {
      kept_bytes_ += cap;
      h->deadline = kept_clock_;  // (its age, counted from the last trim)
      poison_block(*h);
      kept_blocks_.push_back(std::move(h));  // (capacity reserved)
      return;
    }
  }
  h->mr.reset();  // the registration before the memory
  h->large.reset();
  if (spare_holders_.size() < kKeptBlocks) spare_holders_.push_back(std::move(h));
}

doorbell_batch* fabric_state::make_batch(std::size_t wrs, std::size_t sges, std::size_t inline_bytes) noexcept {
  try {
    auto b = std::make_unique<doorbell_batch>();
    b->wrs.reserve(wrs);
    b->sges.resize(sges);
    b->inline_bytes.resize(inline_bytes);
    return batches_.add(std::move(b));
  } catch (const std::bad_alloc&) {
    log().error("fabric: no memory for a doorbell batch");
    return nullptr;
  }
}

staging_area& fabric_state::staging() {
  if (staging_ == nullptr) {
    staging_ = std::make_unique<staging_area>(*pd, piece_shift, options.gpu_staging_chunk, options.gpu_staging_buffers);
  }
  return *staging_;
}

copy_thread& fabric_state::copies() {
  if (copies_ == nullptr) copies_ = std::make_unique<copy_thread>(io);
  return *copies_;
}

void fabric_state::stop_copies() noexcept {
  if (copies_ != nullptr) copies_->shutdown();
}

void fabric_state::busy() noexcept {
  if (active_++ == 0) {
    reactor->start();
    // Only where the reactor had stopped (not on every first operation
    // after a completion: the stop check finds those busy again): the
    // watch ends now rather than at its next wake-up.
    if (reactor_idle_.load(std::memory_order_relaxed)) {
      reactor_idle_.store(false, std::memory_order_relaxed);
      if (watch_cq_) wake_liveness();
    }
  }
}

void fabric_state::idle() noexcept {
  if (--active_ != 0 || stop_check_posted_) return;
  stop_check_posted_ = true;
  asio::post(io, [w = weak_from_this()] {
    auto s = w.lock();
    if (!s) return;
    s->stop_check_posted_ = false;
    if (s->active_ == 0) {
      s->reactor->stop();
      if (s->watch_cq_ && !s->reactor->running() && !s->reactor->failed()) {
        s->reactor_idle_.store(true, std::memory_order_release);
        s->wake_liveness();  // the idle watch begins
      }
    }
  });
}

void fabric_state::schedule_flush(connection_impl* c) {
  dirty_.push_back(c);
  // Queued while handling a completion: the reactor flushes it after its
  // pass. Queued during flush_all (by the handlers a flush ran): its next
  // round flushes it, or it posts one.
  if (in_completion > 0 || in_flush_all_) return;
  post_flush();
}

void fabric_state::post_flush() {
  // A spinning reactor flushes before its next poll (flush_before_poll).
  if (flush_posted_ || reactor->spinning()) return;
  flush_posted_ = true;
  asio::post(io, [w = weak_from_this()] {
    auto s = w.lock();
    if (!s) return;
    s->flush_posted_ = false;
    s->flush_all(true);
  });
}

bool fabric_state::has_queued_handlers(const void* self) noexcept {
  const auto* s = static_cast<const fabric_state*>(self);
  return s->posted_completions > 0 || s->flush_posted_;
}

void fabric_state::flush_after_dispatch(void* self) noexcept {
  auto* f = static_cast<fabric_state*>(self);
  // (reactor::fail_all ends here too.)
  if (f->reactor->failed()) f->cq_lost.store(true, std::memory_order_release);
  f->end_turn(false);
}

void fabric_state::flush_before_poll(void* self) noexcept { static_cast<fabric_state*>(self)->end_turn(true); }

void fabric_state::end_turn(bool defer) noexcept {
  if (!dirty_.empty()) {
    flush_all(defer);  // (counts the turn)
  } else {
    ++turns;
  }
}

void fabric_state::flush_all(bool defer) noexcept {
  // What the handlers of this flush queue (a reply's send completes at its
  // doorbell and resumes its coroutine, which drops the request: its
  // buffer goes back) is urgent (connection_impl::schedule): a second
  // round flushes it here. A reactor that sleeps between messages used to
  // post a flush for it: an io_context round, with its epoll_wait, per
  // message.
  // (Called again from a handler it runs - one that runs the io_context
  // itself: the connections stay dirty for this call's next round or its
  // post. Swapping the lists under the running loop would flush some twice.
  // So a handler that runs the io_context until its own send has left
  // waits for ever, as one run by a completion already did: what it queues
  // is flushed after the reactor's pass that runs it.)
  if (in_flush_all_) return;
  in_flush_all_ = true;
  for (int round = 0; round < 2; ++round) {
    ++turns;
    flushing_.swap(dirty_);
    std::size_t waiting = 0;
    for (std::size_t i = 0; i < flushing_.size(); ++i) {
      connection_impl* c = flushing_[i];
      if (c == nullptr) continue;
      // A coroutine whose send completion is still queued will likely send
      // again: wait for it, so that a pipelined sender fills one doorbell.
      const bool wait = defer ? posted_completions > 0 && c->queued_sends() < kEarlyFlush : !c->urgent;
      if (wait) {
        dirty_.push_back(c);
        ++waiting;
        continue;
      }
      c->flush();
    }
    flushing_.clear();
    if (dirty_.size() == waiting) break;  // nothing new from the handlers
  }
  in_flush_all_ = false;
  if (!dirty_.empty()) post_flush();
}

void fabric_state::wait_for_buffer(connection_impl* c) { buffer_waiters_.push_back(c); }

void fabric_state::put_buffer(std::uint32_t index) noexcept {
  pool->put(index);
  if (buffer_waiters_.empty()) return;
  std::vector<connection_impl*> waiters;
  waiters.swap(buffer_waiters_);
  for (connection_impl* c : waiters) c->on_buffer_available();
}

void fabric_state::srq_repost(std::uint32_t buffer) noexcept {
  const transport::sge sg = pool->slice(buffer, 0, recv_buffer);
  const transport::recv_request r{reactor::persistent_id(srq_base_, buffer), {&sg, 1}};
  if (auto ec = srq->post_recv({&r, 1})) {
    log().error("fabric: posting a buffer to the shared receive queue: {} (the queue is a receive short)", ec.message());
    pool->put(buffer);
    return;
  }
  ++srq_posted;
}

void fabric_state::srq_attach(std::uint32_t qp_num, connection_impl* c) { srq_conns_[qp_num] = c; }

void fabric_state::srq_detach(std::uint32_t qp_num) noexcept { srq_conns_.erase(qp_num); }

void fabric_state::on_srq_recv(const transport::completion& wc) noexcept {
  if (wc.status == transport::wc_status::fatal && (wc.wr_id & 0xffffffff00000000ull) == reactor::kPersistent) {
    return;  // the reactor gave up: every connection hears it through its own operations
  }
  const std::uint32_t buffer = reactor::tag_of(wc.wr_id);
  if (buffer >= pool->stats().buffers) {
    log().error("fabric: a shared receive queue completion names no buffer ({}); dropped", buffer);
    return;
  }
  --srq_posted;
  const auto it = srq_conns_.find(wc.qp_num);
  if (it == srq_conns_.end()) {
    // Its connection is gone (a flushed receive of a destroyed queue pair).
    srq_repost(buffer);
    return;
  }
  it->second->on_srq_completion(wc, buffer);
}

void fabric_state::forget(connection_impl* c) noexcept {
  std::erase(dirty_, c);
  std::erase(buffer_waiters_, c);
  std::replace(flushing_.begin(), flushing_.end(), c, static_cast<connection_impl*>(nullptr));
}

protocol::hello fabric_state::local_hello() const noexcept {
  const connection_options& c = options.connection;
  protocol::hello h;
  h.kind = protocol::hello_kind::hello;
  // With a shared receive queue a connection starts with the floor of its
  // window and grows while the queue has spare receives.
  h.credits = srq != nullptr ? std::min<std::uint16_t>(c.credits, kSrqMinCredits) : c.credits;
  h.max_credits = c.credits;
  h.recv_buffer = recv_buffer;
  h.eager_limit = c.eager_limit;
  h.max_message = c.max_message;
  h.flags = auth ? protocol::kAuth : 0;
  h.keepalive_ms = static_cast<std::uint32_t>(c.keepalive.count());
  return h;
}

void fabric_state::refuse_if_cq_lost(const char* what) const {
  if (!reactor->failed()) return;
  throw std::system_error(errc::invalid_state, std::string("fabric: ") + what +
                                                   ": its completion queue was lost (the reactor gave up on it); "
                                                   "no connection can be made on this fabric");
}

std::error_code fabric_state::check_peer(const protocol::hello& peer) const noexcept {
  if (peer.version != protocol::kVersion) return errc::version_mismatch;
  if (((peer.flags & protocol::kAuth) != 0) != auth) return errc::authentication_failed;
  return {};
}

}  // namespace detail

// ---------------------------------------------------------------- fabric

fabric::fabric(asio::io_context& io, fabric_options options)
    : state_(std::make_shared<detail::fabric_state>(io, options)) {
  state_->reactor->set_owner(state_);  // (a handler it runs may destroy this fabric)
  state_->start_liveness();
}
// Connection attempts in progress end now (their handlers complete with
// operation_canceled); connections and acceptors must be gone already.
fabric::~fabric() {
  // No liveness tick is posted to the io_context after this: a connection
  // kept past its fabric (against the rule above) must not have a thread
  // posting to an io_context that may go next.
  state_->stop_liveness();
  state_->helpers.stop_all();
  state_->stop_copies();
  // A connection whose handle is gone waits for its flushes to let itself
  // go, and it holds the fabric's state: if the io_context stopped before
  // they were polled (a server's shutdown often stops it), both would stay
  // for ever, the device's descriptors and threads included.
  state_->abandon_connections();
}

std::string_view fabric::provider() const noexcept { return state_->device->provider(); }
transport::device& fabric::device() noexcept { return *state_->device; }
transport::protection_domain& fabric::protection_domain() noexcept { return *state_->pd; }

memory_region fabric::register_memory(std::span<std::byte> memory, access acc) {
  if (memory.empty()) throw std::system_error(errc::invalid_argument, "fabric: registering empty memory");
  const memory_kind kind =
      cuda::detail::any_gpu_memory(true) ? cuda::detail::kind_here(memory.data()) : memory_kind::host;
  if (kind == memory_kind::cuda_device) {
    return memory_region(cuda::detail::register_device_memory(*state_->device, *state_->pd, memory.data(),
                                                              memory.size(), acc),
                         kind);
  }
  if (kind == memory_kind::cuda_managed) {
    throw std::system_error(errc::not_supported,
                            "fabric: CUDA managed memory cannot be registered (it migrates between host and GPU): "
                            "register a cuMemAlloc or cuMemHostAlloc buffer");
  }
  return memory_region(state_->register_releasing([&] {
                         return detail::register_in_pieces(*state_->pd, memory.data(), memory.size(), acc,
                                                           state_->piece_shift);
                       }),
                       kind);
}

std::size_t fabric::forget_memory(const void* addr, std::size_t length) noexcept {
  return length == 0 ? 0 : state_->cache->forget(addr, length);
}
const fabric_options& fabric::options() const noexcept { return state_->options; }
asio::io_context::executor_type fabric::get_executor() const noexcept { return state_->io.get_executor(); }

fabric_stats fabric::stats() const noexcept {
  fabric_stats s;
  s.reactor = state_->reactor->stats();
  s.pool = state_->pool->stats();
  s.connections = state_->open_connections;
  s.accepted = state_->accepted;
  s.connected = state_->connected;
  s.refused = state_->refused.load(std::memory_order_relaxed);
  s.cache = state_->cache->stats();
  s.srq_posted = state_->srq_posted;
  s.srq_spare = state_->srq_spare();
  s.kept_blocks = state_->kept_blocks();
  s.kept_bytes = state_->kept_bytes();
  s.retired_sources = state_->retired_sources();
  s.retired_bytes = state_->retired_bytes();
  s.retired_early = state_->retired_early();
  return s;
}

std::vector<connection_report> fabric::connection_reports() const {
  std::vector<connection_report> out;
  out.reserve(state_->connections().size());
  for (const detail::connection_impl* c : state_->connections()) {
    out.push_back({c->qp_num(), c->connected_path(), c->is_open(), c->stats(), c->holds_queue_pair()});
  }
  return out;
}

std::vector<failure_count> fabric::failure_counts() const { return state_->failures; }

namespace {

bool parse_address(std::string_view a, std::string& host, std::uint16_t& port) {
  const auto colon = a.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == a.size()) return false;
  std::string_view h = a.substr(0, colon);
  if (h.front() == '[') {
    if (h.size() < 3 || h.back() != ']') return false;
    h = h.substr(1, h.size() - 2);
  }
  const std::string_view p = a.substr(colon + 1);
  unsigned v = 0;
  const auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), v);
  if (ec != std::errc{} || end != p.data() + p.size() || v == 0 || v > 65535) return false;
  host = std::string(h);
  port = static_cast<std::uint16_t>(v);
  return true;
}

// The client's end of the authentication exchange: completes the user's
// connect.
struct connect_waiter final : detail::setup_waiter {
  std::unique_ptr<detail::pending_handler> handler;
  std::string host;
  std::uint16_t port = 0;
  connect_waiter(std::unique_ptr<detail::pending_handler> h, std::string hst, std::uint16_t p)
      : handler(std::move(h)), host(std::move(hst)), port(p) {}
  void done(std::error_code ec, const std::shared_ptr<detail::connection_impl>& conn) noexcept override {
    if (conn == nullptr) {  // the connection is being destroyed
      handler->complete(false, ec, connection{});
      return;
    }
    detail::fabric_state& f = conn->fabric();
    if (ec) {
      if (ec == errc::authentication_failed) ++f.refused;
      log().warn("fabric: connect to {}:{} failed: {}", host, port, ec.message());
      handler->complete(false, ec, connection{});
      return;
    }
    // (One that ended since, its queue pair gone if ~fabric abandoned it, is
    // still delivered, as from an accept: its first operation reports why.)
    ++f.connected;
    log().info("fabric: connected to {}:{} (qp {}, authenticated)", host, port, conn->qp_num());
    handler->complete(false, std::error_code{}, connection(conn));
  }
};

// The io thread, with a connect helper's result (or aborted: the fabric is
// going away).
void finish_connect(detail::connection_impl& conn, std::unique_ptr<detail::pending_handler> h,
                    const std::string& host, std::uint16_t port, bool aborted,
                    std::span<const std::byte> hello_sent, const transport::connect_result& res) {
  auto impl = conn.shared_from_this();
  detail::fabric_state& f = conn.fabric();
  f.idle();
  const detail::auth::nonce mine = protocol::nonce_of(hello_sent);
  // Every ending but a started authentication (it forgets at its end).
  struct forget_unless_started {
    detail::fabric_state& f;
    const detail::auth::nonce& n;
    bool active;
    ~forget_unless_started() {
      if (active) f.own_nonces.forget(n);
    }
  } forget{f, mine, f.auth};
  if (aborted) {  // the fabric is going away
    impl->on_setup_failed();
    h->complete(true, std::make_error_code(std::errc::operation_canceled), connection{});
    return;
  }
  std::error_code ec = res.ec;
  protocol::hello peer;
  if (ec == errc::connection_rejected) {
    if (protocol::decode(res.private_data, peer) == protocol::decode_status::ok &&
        peer.kind == protocol::hello_kind::refuse) {
      ec = detail::reason_error(peer.reason);
    }
  } else if (!ec) {
    if (protocol::decode(res.private_data, peer) != protocol::decode_status::ok ||
        peer.kind != protocol::hello_kind::welcome) {
      ec = errc::protocol_error;
    } else {
      ec = f.check_peer(peer);
      // The completion queue was lost during the handshake: the connection
      // can serve nothing (on_connected below lets its queue pair go).
      if (!ec && f.reactor->failed()) ec = errc::invalid_state;
      if (!ec && f.auth && f.own_nonces.contains(peer.nonce)) {
        log().warn("fabric: connect to {}:{}: the welcome carries a nonce of our own handshakes (a reflection)",
                   host, port);
        ec = errc::authentication_failed;
      }
    }
    if (ec) {
      impl->on_connected(peer);  // so that fail() can tear it down
      impl->abort();
    }
  }
  if (ec) {
    if (ec == errc::authentication_failed || ec == errc::version_mismatch) ++f.refused;
    log().warn("fabric: connect to {}:{} failed: {}", host, port, ec.message());
    if (res.ec) impl->on_setup_failed();
    h->complete(false, ec, connection{});
    return;
  }
  if (f.auth) {
    // The welcome names the listener's nonce: both proofs are known now.
    // The connect completes when the listener has proven the token too.
    auto setup = std::make_unique<detail::auth_setup>();
    try {
      setup->exchange = detail::auth::prepare(f.options.connection.auth_token, detail::auth::role::client,
                                              hello_sent, res.private_data);
    } catch (const std::system_error& e) {
      log().warn("fabric: connect to {}:{}: {}", host, port, e.what());
      impl->on_connected(peer);
      impl->abort();
      h->complete(false, e.code(), connection{});
      return;
    }
    setup->waiter = std::make_unique<connect_waiter>(std::move(h), host, port);
    forget.active = false;  // end_auth forgets it
    impl->on_connected(peer, std::move(setup));
    return;
  }
  impl->on_connected(peer);
  if (f.device->caps().established_by_message) impl->speak_first();
  ++f.connected;
  log().info("fabric: connected to {}:{} (qp {})", host, port, impl->qp_num());
  h->complete(false, std::error_code{}, connection(std::move(impl)));
}

}  // namespace

void fabric::start_connect(std::shared_ptr<detail::fabric_state> fab, std::string address,
                           detail::pending_handler* h) {
  std::string host;
  std::uint16_t port = 0;
  if (!parse_address(address, host, port)) {
    log().warn("fabric: connect: '{}' is not host:port", address);
    h->complete(true, make_error_code(errc::invalid_argument), connection{});
    delete h;
    return;
  }
  auto conn = std::make_shared<detail::connection_impl>(fab);
  try {
    conn->prepare();
  } catch (const std::system_error& e) {
    log().warn("fabric: connect to {}: {}", address, e.what());
    h->complete(true, e.code(), connection{});
    delete h;
    return;
  }
  fab->busy();
  // Shared by the helper (which fills res) and the io thread.
  struct attempt {
    std::shared_ptr<detail::connection_impl> conn;
    std::unique_ptr<detail::pending_handler> handler;
    std::string host;
    std::uint16_t port;
    std::array<std::byte, protocol::kHelloSize> hello;
    transport::connect_result res;
  };
  protocol::hello hello = fab->local_hello();
  try {
    if (fab->auth) {
      hello.nonce = detail::auth::fresh_nonce();
      fab->own_nonces.remember(hello.nonce);  // finish_connect or the exchange forgets it
    }
  } catch (const std::system_error& e) {
    log().warn("fabric: connect to {}: {}", address, e.what());
    conn->on_setup_failed();
    fab->idle();
    h->complete(true, e.code(), connection{});
    delete h;
    return;
  }
  auto at = std::make_shared<attempt>(attempt{std::move(conn), std::unique_ptr<detail::pending_handler>(h),
                                              std::move(host), port, protocol::encode(hello), {}});
  auto work = [at, dev = fab->device.get(), timeout = fab->options.connection.connect_timeout](std::stop_token stop) {
    at->res = dev->connect(at->conn->qp(), at->host, at->port, at->hello, timeout, stop);
  };
  auto finish = [at](bool aborted) {
    finish_connect(*at->conn, std::move(at->handler), at->host, at->port, aborted, at->hello, at->res);
  };
  try {
    fab->helpers.start(std::move(work), std::move(finish));
  } catch (const std::system_error& e) {  // no thread: the attempt never started
    log().warn("fabric: connect to {}: {}", address, e.what());
    at->conn->on_setup_failed();
    fab->idle();
    at->handler->complete(true, e.code(), connection{});
  }
}

// The acceptor: a listener thread takes connection requests from the
// provider (which runs the handshakes of many attempts at once, each with
// its own deadline), refuses bad ones itself (counted, logged; they never
// reach the user), and for a good one asks the io thread for a candidate
// connection (queue pair and receives are made there), accepts on it and
// posts the result. The user's async_accept completes only with a
// connection, or when the listener fails or is closed.
struct acceptor::state : std::enable_shared_from_this<state> {
  std::shared_ptr<detail::fabric_state> fab;
  std::unique_ptr<transport::listener> listener;  // the worker's; closed when it ends
  std::uint16_t port = 0;
  std::jthread worker;
  std::uint64_t listener_refused = 0;  // worker only: the listener's count already added to fab

  // io thread
  detail::pending_handler* pending = nullptr;
  bool closed = false;
  std::error_code failed;  // the listener's own failure
  std::shared_ptr<detail::connection_impl> in_use;  // the candidate the worker holds
  // With an auth token: accepted connections whose peers are still proving
  // it (each within the handshake timeout; the worker goes on meanwhile),
  // and those that have, waiting for the user's next accept.
  std::vector<std::weak_ptr<detail::connection_impl>> authenticating;
  struct ready_connection {
    std::shared_ptr<detail::connection_impl> conn;
    std::chrono::steady_clock::time_point deadline;
  };
  std::deque<ready_connection> ready;

  // shared by the worker and the io thread
  std::mutex m;
  std::condition_variable_any cv;
  bool wants = false;        // the worker holds a good request and waits for a candidate
  bool offered = false;      // the io thread answered
  detail::connection_impl* offer = nullptr;
  std::error_code offer_ec;  // no candidate: why (the request is refused)

  ~state() {
    worker.request_stop();
    if (worker.joinable()) worker.join();
    if (in_use != nullptr) in_use->on_setup_failed();
    drop_unaccepted();
    if (pending != nullptr) {
      fab->idle();
      pending->complete(true, std::make_error_code(std::errc::operation_canceled), connection{});
      delete pending;
    }
  }
  void run(std::stop_token stop);
  void serve(const std::stop_token& stop);
  void offer_candidate();
  void finish(std::error_code ec, const protocol::hello& peer, const detail::auth::exchange& ex);
  void deliver(std::shared_ptr<detail::connection_impl> conn);  // an accepted, authenticated connection
  // The listener's end of the authentication exchange.
  struct waiter final : detail::setup_waiter {
    std::weak_ptr<state> acc;
    explicit waiter(std::weak_ptr<state> a) : acc(std::move(a)) {}
    void done(std::error_code ec, const std::shared_ptr<detail::connection_impl>& conn) noexcept override;
  };
  void drop_unaccepted() noexcept;  // closed: nobody takes them
  void on_failed(std::error_code ec);
  void count_listener_refusals();
};

acceptor fabric::listen(const std::string& host, std::uint16_t port) {
  state_->refuse_if_cq_lost("listen");
  const connection_options& c = state_->options.connection;
  auto l = state_->device->listen(host, port, {.handshake_timeout = c.handshake_timeout});
  log().info("fabric: listening on {}:{}", host, l->port());
  return listen(std::move(l));
}

acceptor fabric::listen(std::unique_ptr<transport::listener> listener) {
  if (listener == nullptr) throw std::system_error(errc::invalid_argument, "fabric: listen: no listener");
  state_->refuse_if_cq_lost("listen");
  auto s = std::make_shared<acceptor::state>();
  s->fab = state_;
  s->listener = std::move(listener);
  s->port = s->listener->port();
  s->worker = std::jthread([raw = s.get()](std::stop_token stop) { raw->run(stop); });
  return acceptor(std::move(s));
}

void acceptor::state::count_listener_refusals() {
  const std::uint64_t now = listener->refused();
  fab->refused.fetch_add(now - listener_refused, std::memory_order_relaxed);
  listener_refused = now;
}

// The listener thread. It touches the io thread's state only through
// posted handlers (weak references: the state may be gone) and m/cv. When it
// ends (close, destruction, failure) it closes the listening socket: later
// attempts are refused by the system, not left waiting.
void acceptor::state::run(std::stop_token stop) {
  serve(stop);
  listener.reset();
}

void acceptor::state::serve(const std::stop_token& stop) {
  asio::io_context& io = fab->io;
  std::weak_ptr<state> weak = weak_from_this();
  while (!stop.stop_requested()) {
    if (fab->cq_lost.load(std::memory_order_acquire)) {
      // The fabric can serve nobody now: the listener closes (run()), and
      // the accept waiting, and every later one, ends with the error.
      log().warn("fabric: accept: the fabric's completion queue was lost: no longer listening on port {}", port);
      listener.reset();  // (closed before the accept hears: a peer then finds nobody there)
      asio::post(io, [weak] {
        if (auto s = weak.lock()) s->on_failed(errc::invalid_state);
      });
      return;
    }
    std::error_code ec;
    auto req = listener->get_request(std::chrono::milliseconds(100), ec);
    count_listener_refusals();
    if (req == nullptr) {
      if (ec == errc::timed_out || stop.stop_requested()) continue;
      log().error("fabric: the listener failed: {}", ec.message());
      asio::post(io, [weak, ec] {
        if (auto s = weak.lock()) s->on_failed(ec);
      });
      return;
    }
    protocol::hello peer;
    if (protocol::decode(req->private_data(), peer) != protocol::decode_status::ok ||
        peer.kind != protocol::hello_kind::hello) {
      ec = errc::protocol_error;
    } else {
      ec = fab->check_peer(peer);
    }
    auto refuse = [&](std::error_code why) {
      protocol::hello r;
      r.kind = protocol::hello_kind::refuse;
      r.reason = detail::refuse_for(why);
      fab->refused.fetch_add(1, std::memory_order_relaxed);  // counted before the client can see it
      req->reject(protocol::encode(r));
      log().warn("fabric: accept: refused a connection attempt: {}", why.message());
    };
    if (!ec && fab->auth && fab->own_nonces.contains(peer.nonce)) {
      log().warn("fabric: accept: the hello carries a nonce of our own handshakes (a reflection)");
      ec = errc::authentication_failed;
    }
    if (ec) {
      refuse(ec);
      continue;
    }
    // A good request: a candidate connection from the io thread (made when
    // the user accepts), then accept on it here.
    {
      std::lock_guard lock(m);
      wants = true;
      offered = false;
      offer = nullptr;
    }
    asio::post(io, [weak] {
      if (auto s = weak.lock()) s->offer_candidate();
    });
    // Nobody accepting within the handshake timeout (an application that
    // stopped calling async_accept): the client is refused rather than left
    // waiting for its connect timeout, and other attempts get their turn.
    detail::connection_impl* cand = nullptr;
    bool timed_out = false;
    {
      std::unique_lock lock(m);
      if (!cv.wait_for(lock, stop, fab->options.connection.handshake_timeout, [this] { return offered; })) {
        if (stop.stop_requested()) return;  // closed meanwhile
        wants = false;                      // offer_candidate() no longer answers this one
        timed_out = true;
      } else {
        wants = offered = false;
        cand = std::exchange(offer, nullptr);
        ec = offer_ec;
      }
    }
    if (timed_out) {
      log().warn("fabric: accept: nobody accepted a connection attempt within the handshake timeout ({} ms)",
                 fab->options.connection.handshake_timeout.count());
      refuse(errc::too_many_connections);
      continue;
    }
    if (cand == nullptr) {
      refuse(ec);
      continue;
    }
    protocol::hello welcome = fab->local_hello();
    welcome.kind = protocol::hello_kind::welcome;
    detail::auth::exchange ex;
    if (fab->auth) {
      try {
        welcome.nonce = detail::auth::fresh_nonce();
        ex = detail::auth::prepare(fab->options.connection.auth_token, detail::auth::role::server,
                                   req->private_data(), protocol::encode(welcome));
        fab->own_nonces.remember(welcome.nonce);  // finish() or the exchange forgets it
      } catch (const std::system_error& e) {
        log().error("fabric: accept: {}", e.what());
        refuse(e.code());
        asio::post(io, [weak] {  // the candidate was never used
          auto s = weak.lock();
          if (s == nullptr || s->in_use == nullptr) return;
          std::exchange(s->in_use, nullptr)->on_setup_failed();
          s->offer_candidate();
        });
        continue;
      }
    }
    ec = req->accept(cand->qp(), protocol::encode(welcome), stop);
    asio::post(io, [weak, f = std::weak_ptr<detail::fabric_state>(fab), ec, peer, ex] {
      if (auto s = weak.lock()) {
        s->finish(ec, peer, ex);
      } else if (auto fs = f.lock()) {
        fs->own_nonces.forget(ex);
      }
    });
  }
}

// io thread: the worker waits for a candidate; make one if the user is
// accepting (else async_accept does when it is called).
void acceptor::state::offer_candidate() {
  if (pending == nullptr || in_use != nullptr || closed) return;
  {
    std::lock_guard lock(m);
    if (!wants || offered) return;
  }
  std::error_code ec;
  auto cand = std::make_shared<detail::connection_impl>(fab);
  try {
    cand->prepare();
  } catch (const std::system_error& e) {
    log().warn("fabric: accept: cannot take another connection: {}", e.what());
    ec = e.code();
    cand.reset();
    if (fab->reactor->failed()) {
      // For good: the accept waiting (and every later one) ends with the
      // error rather than waiting on a fabric that can serve nobody.
      asio::post(fab->io, [weak = weak_from_this(), ec] {
        if (auto s = weak.lock()) s->on_failed(ec);
      });
    }
  }
  {
    std::lock_guard lock(m);
    if (!wants || offered) {
      // The worker stopped waiting meanwhile (the attempt outlived the
      // handshake timeout): the candidate is nobody's. Keeping it in in_use
      // would block every later offer.
      if (cand != nullptr) cand->on_setup_failed();
      return;
    }
    offer = cand.get();
    offer_ec = ec;
    offered = true;
  }
  in_use = cand;
  cv.notify_one();
}

void acceptor::state::finish(std::error_code ec, const protocol::hello& peer, const detail::auth::exchange& ex) {
  auto cand = std::move(in_use);
  if (ec || cand == nullptr || !fab->auth || closed) fab->own_nonces.forget(ex);  // no exchange starts
  if (cand == nullptr) return;
  if (ec) {
    // The attempt failed after all (the peer went away during accept): the
    // user's accept waits for the next one.
    fab->refused.fetch_add(1, std::memory_order_relaxed);
    log().warn("fabric: accept: a connection attempt failed: {}", ec.message());
    cand->on_setup_failed();
    offer_candidate();
    return;
  }
  if (fab->auth && !closed) {
    // The peer proves the token on the connection; the worker takes the next
    // attempt meanwhile (an idle or slow peer holds nobody up).
    auto setup = std::make_unique<detail::auth_setup>();
    setup->exchange = ex;
    setup->waiter = std::make_unique<waiter>(weak_from_this());
    std::erase_if(authenticating, [](const auto& w) { return w.expired(); });
    authenticating.push_back(cand);
    cand->on_connected(peer, std::move(setup));
    offer_candidate();
    return;
  }
  if (fab->reactor->failed()) {
    // Its completion queue was lost during the handshake: the connection
    // can serve nothing (on_connected lets its queue pair go).
    cand->on_connected(peer);
    on_failed(errc::invalid_state);
    return;
  }
  cand->on_connected(peer);
  deliver(std::move(cand));
}

void acceptor::state::waiter::done(std::error_code ec,
                                   const std::shared_ptr<detail::connection_impl>& conn) noexcept {
  auto s = acc.lock();
  if (s == nullptr || conn == nullptr) {  // the acceptor is gone (nobody takes it), or the connection
    if (!ec && conn != nullptr) conn->abort();
    return;
  }
  std::erase_if(s->authenticating, [&](const auto& w) { return w.expired() || w.lock() == conn; });
  if (ec && s->closed) return;  // aborted by close(): not a refusal
  if (ec && s->fab->reactor->failed()) return;  // (the completion queue was lost: not the peer's doing)
  if (ec) {
    s->fab->refused.fetch_add(1, std::memory_order_relaxed);
    log().warn("fabric: accept: a peer did not authenticate: {}", ec.message());
    return;
  }
  s->deliver(conn);
}

void acceptor::state::deliver(std::shared_ptr<detail::connection_impl> conn) {
  if (closed) {  // nobody takes it
    conn->abort();
    return;
  }
  // (A connection that failed during setup is still delivered: its first
  // operation reports why.)
  if (pending == nullptr) {
    // Authenticated while no accept waits: the next accept takes it if it
    // comes within the handshake timeout, else it is dropped (start_accept).
    ready.push_back({std::move(conn), std::chrono::steady_clock::now() + fab->options.connection.handshake_timeout});
    return;
  }
  detail::pending_handler* h = std::exchange(pending, nullptr);
  fab->idle();
  ++fab->accepted;
  log().info("fabric: accepted a connection (qp {}{})", conn->qp_num(), fab->auth ? ", authenticated" : "");
  h->complete(false, std::error_code{}, connection(std::move(conn)));
  delete h;
}

void acceptor::state::drop_unaccepted() noexcept {
  for (auto& r : ready) r.conn->abort();
  ready.clear();
  auto waiting = std::move(authenticating);
  for (auto& w : waiting) {
    if (auto c = w.lock()) c->abort();
  }
}

void acceptor::state::on_failed(std::error_code ec) {
  failed = ec;
  if (pending == nullptr) return;
  detail::pending_handler* h = std::exchange(pending, nullptr);
  fab->idle();
  h->complete(false, ec, connection{});
  delete h;
}

// ---------------------------------------------------------------- acceptor

acceptor::acceptor() noexcept = default;
acceptor::acceptor(std::shared_ptr<state> s) noexcept : state_(std::move(s)) {}
acceptor::acceptor(acceptor&&) noexcept = default;
acceptor& acceptor::operator=(acceptor&& o) noexcept {
  if (this != &o) {
    close();
    state_ = std::move(o.state_);
  }
  return *this;
}
acceptor::~acceptor() { close(); }

std::uint16_t acceptor::port() const noexcept { return state_ ? state_->port : 0; }

asio::io_context::executor_type acceptor::executor() const {
  if (!state_) throw std::system_error(errc::invalid_state, "acceptor: not listening");
  return state_->fab->io.get_executor();
}

void acceptor::close() noexcept {
  if (!state_) return;
  state& s = *state_;
  s.closed = true;
  s.drop_unaccepted();
  s.worker.request_stop();  // the listener thread ends within its 100 ms wait; ~state joins it
  if (s.pending != nullptr) {
    detail::pending_handler* h = std::exchange(s.pending, nullptr);
    s.fab->idle();
    h->complete(true, std::make_error_code(std::errc::operation_canceled), connection{});
    delete h;
  }
}

void acceptor::start_accept(const std::shared_ptr<state>& sp, detail::pending_handler* h) {
  state& s = *sp;
  std::error_code ec;
  if (s.closed) ec = std::make_error_code(std::errc::operation_canceled);
  else if (s.failed) ec = s.failed;
  else if (s.pending != nullptr) ec = errc::invalid_state;
  else if (s.fab->reactor->failed()) ec = errc::invalid_state;  // (its completion queue was lost: prepare())
  if (ec) {
    h->complete(true, ec, connection{});
    delete h;
    return;
  }
  while (!s.ready.empty()) {  // authenticated while no accept waited
    auto [conn, deadline] = std::move(s.ready.front());
    s.ready.pop_front();
    if (!conn->is_open()) continue;  // failed meanwhile (the peer went away)
    if (std::chrono::steady_clock::now() > deadline) {
      // Nobody accepted it within the handshake timeout, as for a waiting attempt.
      s.fab->refused.fetch_add(1, std::memory_order_relaxed);
      log().warn("fabric: accept: nobody accepted an authenticated connection within the handshake timeout");
      conn->abort();
      continue;
    }
    ++s.fab->accepted;
    log().info("fabric: accepted a connection (qp {}, authenticated)", conn->qp_num());
    h->complete(true, std::error_code{}, connection(std::move(conn)));
    delete h;
    return;
  }
  s.pending = h;
  s.fab->busy();
  s.offer_candidate();
}

}  // namespace anydoor
