#include "setup_helpers.hpp"

#include <boost/asio/post.hpp>

#include <algorithm>

namespace anydoor::detail {

void setup_helpers::job::run_finish(bool aborted) {
  if (claimed.exchange(true, std::memory_order_acq_rel)) return;
  auto f = std::move(finish);
  work = nullptr;  // what it captured goes now, not with the job
  f(aborted);      // a user handler it runs inline may throw (out of io_context::run, as Asio's do)
}

void setup_helpers::start(std::function<void(std::stop_token)> work, std::function<void(bool)> finish) {
  auto j = std::make_shared<job>();
  j->work = std::move(work);
  j->finish = std::move(finish);
  {
    std::lock_guard lock(m_);
    reap_locked();
    if (!stopped_) {
      jobs_.push_back(j);
      try {
        // The registry holds j until the thread is joined (so the last
        // reference never drops on the thread itself); the thread and its
        // posted result touch only *j, never j->thread (assigned here, under
        // the lock, after the thread started).
        j->thread = std::jthread([j, &io = io_](std::stop_token stop) {
          j->work(stop);
          // The io_context is alive: stop_all() (which runs before the
          // fabric goes) has not joined this thread yet.
          if (!stop.stop_requested()) boost::asio::post(io, [j] { j->run_finish(false); });
          j->ended.store(true, std::memory_order_release);
        });
        return;
      } catch (...) {
        jobs_.pop_back();
        throw;
      }
    }
  }
  j->run_finish(true);
}

void setup_helpers::reap_locked() {
  // A helper is forgotten once it has ended and its result was handled
  // (until then stop_all() must be able to abort it).
  std::erase_if(jobs_, [](const std::shared_ptr<job>& j) {
    if (!j->ended.load(std::memory_order_acquire)) return false;
    if (j->thread.joinable()) j->thread.join();
    return j->claimed.load(std::memory_order_acquire);
  });
}

void setup_helpers::stop_all() noexcept {
  std::vector<std::shared_ptr<job>> jobs;
  {
    std::lock_guard lock(m_);
    stopped_ = true;
    jobs.swap(jobs_);
  }
  for (auto& j : jobs) j->thread.request_stop();
  for (auto& j : jobs) {
    if (j->thread.joinable()) j->thread.join();
  }
  for (auto& j : jobs) j->run_finish(true);
}

std::size_t setup_helpers::running() const {
  std::lock_guard lock(m_);
  return jobs_.size();
}

}  // namespace anydoor::detail
