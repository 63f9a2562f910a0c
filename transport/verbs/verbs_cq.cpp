// The verbs provider's completion queue: polling, arming, and the
// asynchronous and connection events looked at while it is idle.
#include "verbs/verbs_provider.hpp"
#include "verbs/verbs_util.hpp"

#include <anydoor/error.hpp>

#include "log.hpp"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <system_error>

namespace anydoor::transport::verbs {
using namespace detail;
namespace {

constexpr std::uint32_t kMaxPollBatch = 32;

}  // namespace

// ---------------------------------------------------------------- completion queue

// A constructor that fails after ibv_create_cq: no event may find the
// verbs_cq that never was (its cq_context), then the queue and channel go.
void verbs_cq::destroy_unbuilt_cq() noexcept {
  {
    std::lock_guard lock(dev_->async_mutex());
    cq_->cq_context = nullptr;
  }
  ibv_destroy_cq(cq_);
  ibv_destroy_comp_channel(channel_);
}

verbs_cq::verbs_cq(std::shared_ptr<device_state> dev, std::uint32_t depth) : dev_(std::move(dev)) {
  flushing_.reserve(8);  // (before anything that would leak if it threw)
  channel_ = ibv_create_comp_channel(dev_->ctx);
  if (channel_ == nullptr) throw sys_error(errno, "ibv_create_comp_channel");
  set_nonblocking(channel_->fd);
  cq_ = ibv_create_cq(dev_->ctx, static_cast<int>(depth), this, channel_, 0);
  if (cq_ == nullptr) {
    const int err = errno;
    ibv_destroy_comp_channel(channel_);
    throw sys_error(err, "ibv_create_cq");
  }
  epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (epfd_ < 0) {
    const int err = errno;
    destroy_unbuilt_cq();
    throw sys_error(err, "epoll_create1");
  }
  flush_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (flush_fd_ < 0) {
    const int err = errno;
    ::close(epfd_);
    destroy_unbuilt_cq();
    throw sys_error(err, "eventfd");
  }
  retire_fd_ = ::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  if (retire_fd_ < 0) {
    const int err = errno;
    ::close(flush_fd_);
    ::close(epfd_);
    destroy_unbuilt_cq();
    throw sys_error(err, "timerfd_create");
  }
  overflow_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (overflow_fd_ < 0) {
    const int err = errno;
    ::close(retire_fd_);
    ::close(flush_fd_);
    ::close(epfd_);
    destroy_unbuilt_cq();
    throw sys_error(err, "eventfd");
  }
  watch(channel_->fd);
  watch(dev_->ctx->async_fd);
  watch(flush_fd_);
  watch(retire_fd_);
  watch(overflow_fd_);
}

verbs_cq::~verbs_cq() {
  {
    // No asynchronous event, read by any thread, finds this verbs_cq from
    // now on (an event read before waits for the lock).
    std::lock_guard lock(dev_->async_mutex());
    cq_->cq_context = nullptr;
    // Retired queue pairs on it go now (their receives with them): the CQ
    // cannot be destroyed under them.
    dev_->destroy_retired_locked(
        [&](const retired_qp& r) { return r.cq == this || r.qp->send_cq == cq_ || r.qp->recv_cq == cq_; });
  }
  ack_events();
  ::close(overflow_fd_);
  ::close(retire_fd_);
  ::close(flush_fd_);
  ::close(epfd_);
  if (ibv_destroy_cq(cq_) != 0) log().error("ibv_destroy_cq: {} (queue pairs still on it?)", std::strerror(errno));
  ibv_destroy_comp_channel(channel_);
}

void verbs_cq::watch(int fd) noexcept {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = fd;
  if (::epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev) != 0 && errno != EEXIST) {
    log().warn("verbs: epoll_ctl(add {}): {}", fd, std::strerror(errno));
  }
}

void verbs_cq::unwatch(int fd) noexcept { ::epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr); }

std::uint32_t verbs_cq::attach(verbs_qp* qp, std::uint32_t wrs) {
  wrs_ += wrs;
  if (wrs_ > static_cast<std::uint64_t>(cq_->cqe)) {
    log().warn("completion queue depth {} is below the {} work requests of its queue pairs: it can overflow",
               cq_->cqe, wrs_);
  }
  for (std::uint32_t i = 0; i < qps_.size(); ++i) {
    if (qps_[i].qp == nullptr) {
      qps_[i].qp = qp;
      // Generation 0 is never a queue pair's: it marks a shared receive
      // queue's work request (verbs_srq).
      if (++qps_[i].generation == 0) qps_[i].generation = 1;
      return i;
    }
  }
  if (qps_.size() >= (1u << 24)) throw std::system_error(errc::invalid_argument, "too many queue pairs on one CQ");
  qps_.push_back({qp, 1});
  return static_cast<std::uint32_t>(qps_.size() - 1);
}

void verbs_cq::detach(std::uint32_t index, std::uint32_t wrs) noexcept {
  if (index < qps_.size()) {
    if (std::erase(flushing_, qps_[index].qp) > 0 && flushing_.empty()) drain_flush_fd();
    qps_[index].qp = nullptr;
  }
  wrs_ -= wrs;
}

void verbs_cq::drain_flush_fd() noexcept {
  std::uint64_t count = 0;
  [[maybe_unused]] const auto r = ::read(flush_fd_, &count, sizeof count);  // not readable until the next flush_later
}

void verbs_cq::flush_later(verbs_qp* qp) noexcept {
  if (std::find(flushing_.begin(), flushing_.end(), qp) == flushing_.end()) {
    try {
      flushing_.push_back(qp);
    } catch (const std::bad_alloc&) {
      log().error("verbs: no memory to flush the receives of qp {}: they never complete", qp->qp_num());
      return;
    }
  }
  const std::uint64_t one = 1;
  [[maybe_unused]] const auto w = ::write(flush_fd_, &one, sizeof one);  // wakes a reactor asleep on notify_fd
}

void verbs_cq::set_retire_timer(std::chrono::steady_clock::time_point at) noexcept {
  timer_at_ = at;
  itimerspec t{};
  if (at != std::chrono::steady_clock::time_point{}) {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(at.time_since_epoch()).count();
    t.it_value.tv_sec = static_cast<time_t>(ns / 1000000000);
    t.it_value.tv_nsec = static_cast<long>(ns % 1000000000);
    if (t.it_value.tv_sec == 0 && t.it_value.tv_nsec == 0) t.it_value.tv_nsec = 1;  // (0 would disarm)
  }
  // steady_clock is CLOCK_MONOTONIC (libstdc++), the timer's clock.
  if (::timerfd_settime(retire_fd_, TFD_TIMER_ABSTIME, &t, nullptr) != 0) {
    log().warn("verbs: timerfd_settime: {}", std::strerror(errno));
  }
}

void verbs_cq::retired_added(std::chrono::steady_clock::time_point deadline) noexcept {
  retiring_.fetch_add(1, std::memory_order_relaxed);
  retire_wake_.store(true, std::memory_order_relaxed);  // the next poll learns its deadline (next_due_)
  if (timer_at_ == std::chrono::steady_clock::time_point{} || deadline < timer_at_) set_retire_timer(deadline);
}

void verbs_cq::wake_retired() noexcept {
  retire_wake_.store(true, std::memory_order_relaxed);
  set_retire_timer(std::chrono::steady_clock::now());  // wakes a reactor asleep on notify_fd
}

bool verbs_cq::arm_retired() noexcept {
  const auto now = clock::now();
  if (now < retire_check_ && now < next_due_ && !retire_wake_.load(std::memory_order_relaxed)) return retire_armed_;
  retire_wake_.store(false, std::memory_order_relaxed);
  retire_check_ = now + std::chrono::milliseconds(1);
  dev_->drain_async_events();  // IBV_EVENT_QP_LAST_WQE_REACHED
  std::uint64_t expirations = 0;
  [[maybe_unused]] const auto r = ::read(retire_fd_, &expirations, sizeof expirations);
  std::lock_guard lock(dev_->async_mutex());
  retire_armed_ = false;
  auto next = std::chrono::steady_clock::time_point::max();
  for (const auto& q : dev_->shared->retired) {
    if (q->cq != this) continue;
    if (!q->armed && (q->last_wqe || now >= q->deadline)) {
      q->armed = true;
      q->armed_at = taken_;
      if (!q->last_wqe) {
        log().debug("verbs: qp {}: no IBV_EVENT_QP_LAST_WQE_REACHED within {} ms; destroyed once the CQ is empty",
                    q->qp->qp_num, device_state::kLastWqeWait.count());
      }
    }
    if (q->armed) {
      retire_armed_ = true;
    } else {
      next = std::min(next, q->deadline);
    }
  }
  next_due_ = next;
  set_retire_timer(next == std::chrono::steady_clock::time_point::max() ? std::chrono::steady_clock::time_point{}
                                                                         : next);
  return retire_armed_;
}

// Once the queue ran empty, or gave as many completions as it can hold
// since the mark (FIFO: what it held at the mark is gone even under a load
// that never lets it run empty).
void verbs_cq::destroy_armed(bool emptied) noexcept {
  std::lock_guard lock(dev_->async_mutex());
  const auto depth = static_cast<std::uint64_t>(cq_->cqe);
  dev_->destroy_retired_locked(
      [&](const retired_qp& r) { return r.cq == this && r.armed && (emptied || taken_ - r.armed_at >= depth); });
  retire_armed_ = false;
  for (const auto& q : dev_->shared->retired) retire_armed_ = retire_armed_ || (q->cq == this && q->armed);
}

void verbs_cq::note_overflow() noexcept {
  overflow_noted_.store(true, std::memory_order_release);
  const std::uint64_t one = 1;
  [[maybe_unused]] const auto w = ::write(overflow_fd_, &one, sizeof one);  // wakes a reactor asleep on notify_fd
}

void verbs_cq::take_overflow() noexcept {
  if (!overflow_noted_.exchange(false, std::memory_order_acquire)) return;
  std::uint64_t count = 0;
  [[maybe_unused]] const auto r = ::read(overflow_fd_, &count, sizeof count);
  on_overflow();
}

void verbs_cq::on_overflow() noexcept {
  if (overflow_) return;
  overflow_ = true;
  log().error("verbs: completion queue overflow (depth {}): completions were lost; queue pairs on it move to error",
              cq_->cqe);
  for (auto& e : qps_) {
    if (e.qp != nullptr) e.qp->on_async_error();
  }
}

std::size_t verbs_cq::poll(std::span<completion> out, std::error_code& ec) noexcept {
  ++counters_.polls;
  if (overflow_noted_.load(std::memory_order_relaxed)) take_overflow();
  std::size_t n = 0;
  // Retired queue pairs whose last receive is back (or due) go once this
  // poll, which began after that, has emptied the queue.
  const bool retired_due = retiring_.load(std::memory_order_relaxed) != 0 && arm_retired();
  bool emptied = false;
  while (!overflow_ && n < out.size()) {
    ibv_wc wcs[kMaxPollBatch];
    const int want = static_cast<int>(std::min<std::size_t>(kMaxPollBatch, out.size() - n));
    const int got = ibv_poll_cq(cq_, want, wcs);
    if (got < 0) {
      ec = {-got, std::system_category()};
      return n;
    }
    taken_ += static_cast<std::uint64_t>(got);
    for (int i = 0; i < got; ++i) {
      const ibv_wc& wc = wcs[i];
      const auto gen = static_cast<std::uint8_t>(wc.wr_id >> 56);
      const auto index = static_cast<std::uint32_t>((wc.wr_id >> 32) & 0xffffff);
      const bool recv = (wc.wr_id & kRecvBit) != 0;
      const auto slot = static_cast<std::uint32_t>(wc.wr_id & kSlotMask);
      if (gen == 0) {
        // A shared receive queue's receive, taken by a queue pair of ours.
        if (!dev_->complete_srq(wc, index, slot, out[n])) {
          log().debug("verbs: dropped a completion of a destroyed shared receive queue (qp {})", wc.qp_num);
          continue;
        }
        ++n;
        continue;
      }
      if (index >= qps_.size() || qps_[index].qp == nullptr || qps_[index].generation != gen) {
        log().debug("verbs: dropped a completion of a destroyed queue pair {}", wc.qp_num);
        continue;
      }
      qps_[index].qp->complete(wc, slot, recv, out[n++]);
    }
    if (got < want) {
      emptied = true;
      break;
    }
  }
  if (retired_due) destroy_armed(emptied);
  if (!flushing_.empty() && n < out.size()) {
    for (verbs_qp* qp : flushing_) n += qp->complete_flushed(out.subspan(n));
    std::erase_if(flushing_, [](verbs_qp* qp) { return !qp->flush_pending(); });
    if (flushing_.empty()) drain_flush_fd();
  }
  if (n == 0) {
    ++counters_.empty_polls;
    // Asynchronous and connection events (CQ overflow, a peer's disconnect)
    // are looked at when idle, at most once a millisecond: each look is two
    // system calls.
    if ((++empty_streak_ & 63) == 0) {
      const auto now = clock::now();
      if (now - events_checked_ >= std::chrono::milliseconds(1)) {
        events_checked_ = now;
        check_events();
      }
    }
  } else {
    empty_streak_ = 0;
  }
  counters_.completions += n;
  if (overflow_ && n == 0) {
    ec = errc::cq_overflow;
    return 0;
  }
  ec.clear();
  return n;
}

void verbs_cq::check_events() noexcept {
  dev_->drain_async_events();
  take_overflow();  // (noted by this drain, or by another device's on the same context)
  for (std::size_t i = 0; i < qps_.size(); ++i) {
    if (qps_[i].qp != nullptr) qps_[i].qp->poll_cm_events();
  }
}

std::error_code verbs_cq::arm() noexcept {
  check_events();
  if (overflow_) return errc::cq_overflow;
  if (ibv_req_notify_cq(cq_, 0) != 0) return {errno, std::system_category()};
  return {};
}

std::size_t verbs_cq::ack_events() noexcept {
  unsigned count = 0;
  ibv_cq* ev_cq = nullptr;
  void* ctx = nullptr;
  while (ibv_get_cq_event(channel_, &ev_cq, &ctx) == 0) ++count;
  if (count > 0) ibv_ack_cq_events(cq_, count);
  counters_.events += count;
  return count;
}

}  // namespace anydoor::transport::verbs
