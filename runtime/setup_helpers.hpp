// Threads for blocking connection setup (a provider's connect). Each call
// runs on a helper thread of its own; its result is handled on the io
// thread. stop_all() (the fabric's destruction) stops every helper through
// its std::stop_token, joins it and completes what it was doing as aborted,
// so no helper outlives the fabric or posts to an io_context that is gone.
#pragma once

#include <boost/asio/io_context.hpp>

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <stop_token>
#include <thread>
#include <vector>

namespace anydoor::detail {

class setup_helpers {
 public:
  explicit setup_helpers(boost::asio::io_context& io) noexcept : io_(io) {}
  ~setup_helpers() { stop_all(); }
  setup_helpers(const setup_helpers&) = delete;
  setup_helpers& operator=(const setup_helpers&) = delete;

  // Runs work(stop) on a new thread, then finish(false) on the io thread.
  // When stop_all() comes first, finish(true) runs instead, on stop_all()'s
  // thread, after the helper has ended. After stop_all(), finish(true) runs
  // at once. Either way finish runs exactly once. Throws std::system_error
  // when no thread can be started (nothing runs then).
  void start(std::function<void(std::stop_token)> work, std::function<void(bool aborted)> finish);
  void stop_all() noexcept;
  std::size_t running() const;  // helpers not yet joined (tests)

 private:
  struct job {
    std::function<void(std::stop_token)> work;
    std::function<void(bool)> finish;
    std::atomic<bool> claimed{false};  // finish taken (by the io thread or stop_all)
    std::atomic<bool> ended{false};    // the thread's function has returned
    std::jthread thread;
    void run_finish(bool aborted);
  };
  void reap_locked();  // joins helpers that have ended

  boost::asio::io_context& io_;
  mutable std::mutex m_;
  std::vector<std::shared_ptr<job>> jobs_;
  bool stopped_ = false;
};

}  // namespace anydoor::detail
