#include "shared_listener.hpp"

#include "log.hpp"
#include "protocol.hpp"

#include <anydoor/error.hpp>

#include <sys/eventfd.h>
#include <unistd.h>

#include <exception>
#include <string>
#include <utility>
#include <vector>
#include <system_error>

namespace anydoor::detail {


// A reactor's view of the shared listener: its own queue.
class shared_listener::route final : public transport::listener {
 public:
  route(std::shared_ptr<shared_listener> hub, std::size_t i) noexcept : hub_(std::move(hub)), i_(i) {}
  ~route() override { hub_->close_queue(i_); }
  int fd() const noexcept override { return hub_->queues_[i_]->event_fd; }
  std::uint16_t port() const noexcept override { return hub_->port_; }
  std::unique_ptr<transport::connection_request> get_request(std::chrono::milliseconds timeout,
                                                             std::error_code& ec) noexcept override {
    return hub_->take(i_, timeout, ec);
  }
  // The listener's own refusals, and those no reactor could take, count
  // once: on the first reactor.
  std::uint64_t refused() const noexcept override {
    return i_ == 0 ? hub_->inner_->refused() + hub_->refused_.load(std::memory_order_relaxed) : 0;
  }

 private:
  std::shared_ptr<shared_listener> hub_;
  std::size_t i_;
};

shared_listener::shared_listener(std::unique_ptr<transport::listener> inner, std::size_t queues,
                                 placement_hook hook, std::size_t max_queued, std::chrono::milliseconds max_wait)
    : inner_(std::move(inner)), port_(inner_->port()), hook_(std::move(hook)), max_queued_(max_queued),
      max_wait_(max_wait) {
  if (queues == 0) throw std::system_error(errc::invalid_argument, "shared_listener: no queues");
  for (std::size_t i = 0; i < queues; ++i) {
    auto q = std::make_unique<queue>();
    q->event_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC | EFD_SEMAPHORE);
    if (q->event_fd < 0) {
      const int err = errno;
      for (auto& done : queues_) ::close(done->event_fd);
      throw std::system_error(err, std::system_category(), "reactor_group: eventfd");
    }
    queues_.push_back(std::move(q));
  }
  distributor_ = std::jthread([this](std::stop_token stop) { distribute(stop); });
}

shared_listener::~shared_listener() {
  distributor_.request_stop();
  if (distributor_.joinable()) distributor_.join();
  for (auto& q : queues_) {
    for (auto& w : q->requests) refuse(*w.request);
    ::close(q->event_fd);
  }
}

std::unique_ptr<transport::listener> shared_listener::routed(const std::shared_ptr<shared_listener>& self,
                                                             std::size_t i) {
  return std::make_unique<route>(self, i);
}

void shared_listener::refuse(transport::connection_request& req) noexcept {
  protocol::hello r;
  r.kind = protocol::hello_kind::refuse;
  r.reason = protocol::refuse_reason::resources;  // the client sees too_many_connections
  req.reject(protocol::encode(r));
}

void shared_listener::distribute(std::stop_token stop) {
  const std::size_t n = queues_.size();
  while (!stop.stop_requested()) {
    std::error_code ec;
    auto req = inner_->get_request(std::chrono::milliseconds(100), ec);
    if (req == nullptr) {
      if (ec == errc::timed_out || stop.stop_requested()) continue;
      {
        std::lock_guard lock(m_);
        failed_ = ec;
      }
      for (auto& q : queues_) q->cv.notify_all();
      return;
    }
    std::size_t first = next_++ % n;
    if (hook_) {
      std::string bad;
      try {
        const std::size_t k = hook_(placement_request{.sequence = sequence_, .reactors = n});
        if (k < n) first = k;
        else bad = "chose reactor " + std::to_string(k) + " of " + std::to_string(n);
      } catch (const std::exception& e) {
        bad = std::string("threw (") + e.what() + ")";
      } catch (...) {
        bad = "threw";
      }
      if (!bad.empty() && !std::exchange(hook_warned_, true)) {
        log().warn("reactor_group: the placement hook {}; such attempts are placed round robin (logged once)", bad);
      }
    }
    ++sequence_;
    bool placed = false;
    {
      std::lock_guard lock(m_);
      placed = place(req, first);
    }
    if (!placed) {
      refused_.fetch_add(1, std::memory_order_relaxed);  // counted before the client can see it
      refuse(*req);
      log().warn("reactor_group: refused a connection attempt: no reactor can take it (all closed or {} waiting each)",
                 max_queued_);
    }
  }
}

bool shared_listener::place(std::unique_ptr<transport::connection_request>& req, std::size_t first) {
  const std::size_t n = queues_.size();
  for (std::size_t j = 0; j < n; ++j) {
    queue& q = *queues_[(first + j) % n];
    if (!q.open || q.requests.size() >= max_queued_) continue;
    q.requests.push_back({std::move(req), std::chrono::steady_clock::now()});
    const std::uint64_t one = 1;
    [[maybe_unused]] const auto w = ::write(q.event_fd, &one, sizeof one);
    q.cv.notify_one();
    return true;
  }
  return false;
}

std::unique_ptr<transport::connection_request> shared_listener::take(std::size_t i, std::chrono::milliseconds timeout,
                                                                     std::error_code& ec) {
  std::unique_ptr<transport::connection_request> r;
  std::vector<std::unique_ptr<transport::connection_request>> stale;
  {
    std::unique_lock lock(m_);
    queue& q = *queues_[i];
    if (!q.cv.wait_for(lock, timeout, [&] { return !q.requests.empty() || failed_; })) {
      ec = errc::timed_out;
      return nullptr;
    }
    const auto now = std::chrono::steady_clock::now();
    while (r == nullptr && !q.requests.empty()) {
      waiting w = std::move(q.requests.front());
      q.requests.pop_front();
      std::uint64_t one = 0;
      [[maybe_unused]] const auto rd = ::read(q.event_fd, &one, sizeof one);
      if (now - w.since > max_wait_) stale.push_back(std::move(w.request));
      else r = std::move(w.request);
    }
    ec = r != nullptr ? std::error_code{} : failed_ ? failed_ : std::error_code(errc::timed_out);
  }
  // This reactor was too slow to take them (busy, or not accepting): their
  // clients are about to give up.
  for (auto& s : stale) {
    refused_.fetch_add(1, std::memory_order_relaxed);
    refuse(*s);
  }
  if (!stale.empty()) {
    log().warn("reactor_group: refused {} connection attempt(s) that waited over {} ms for reactor {} to take them",
               stale.size(), max_wait_.count(), i);
  }
  return r;
}

// A reactor's acceptor is gone: its waiting attempts go to the others (or
// are refused when none can take them).
void shared_listener::close_queue(std::size_t i) noexcept {
  std::deque<std::unique_ptr<transport::connection_request>> orphans;
  {
    std::lock_guard lock(m_);
    queue& q = *queues_[i];
    q.open = false;
    std::uint64_t count = 0;
    while (::read(q.event_fd, &count, sizeof count) > 0) {
    }
    for (auto& w : q.requests) {
      if (!place(w.request, i + 1)) orphans.push_back(std::move(w.request));
    }
    q.requests.clear();
  }
  for (auto& r : orphans) {
    refused_.fetch_add(1, std::memory_order_relaxed);
    refuse(*r);
  }
}

}  // namespace anydoor::detail
