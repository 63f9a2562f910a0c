// One listening socket (or rdma_cm id) shared by the acceptors of several
// reactors: a distributor thread takes complete connection requests from
// the provider's listener and places each on a reactor's queue; each
// reactor's acceptor reads its queue through a `routed_listener`, an
// ordinary transport::listener to it, so the acceptor's own machinery
// (checks, candidates, authentication) is unchanged. Internal to the runtime.
#pragma once

#include <anydoor/reactor_group.hpp>
#include <anydoor/transport/provider.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stop_token>
#include <thread>
#include <vector>

namespace anydoor::detail {

class shared_listener {
 public:
  // Takes `inner` and starts the distributor; `queues` routed listeners are
  // made by routed(i), each exactly once.
  // An attempt that waited in a queue longer than `max_wait` (twice the
  // handshake timeout: a reactor that stopped taking attempts, whose
  // acceptor would make each wait a handshake timeout in turn) is refused
  // instead of handed out.
  shared_listener(std::unique_ptr<transport::listener> inner, std::size_t queues, placement_hook hook,
                  std::size_t max_queued, std::chrono::milliseconds max_wait);
  ~shared_listener();  // stops the distributor; requests still queued are refused
  shared_listener(const shared_listener&) = delete;
  shared_listener& operator=(const shared_listener&) = delete;

  static std::unique_ptr<transport::listener> routed(const std::shared_ptr<shared_listener>& self, std::size_t i);
  std::uint16_t port() const noexcept { return port_; }

 private:
  class route;
  struct waiting {
    std::unique_ptr<transport::connection_request> request;
    std::chrono::steady_clock::time_point since;
  };
  struct queue {
    std::deque<waiting> requests;
    std::condition_variable cv;
    bool open = true;
    int event_fd = -1;  // readable while requests wait (route::fd)
  };
  void distribute(std::stop_token stop);
  bool place(std::unique_ptr<transport::connection_request>& req, std::size_t first);  // hub lock held
  void close_queue(std::size_t i) noexcept;
  std::unique_ptr<transport::connection_request> take(std::size_t i, std::chrono::milliseconds timeout,
                                                       std::error_code& ec);
  static void refuse(transport::connection_request& req) noexcept;

  std::unique_ptr<transport::listener> inner_;
  std::uint16_t port_ = 0;
  placement_hook hook_;
  std::size_t max_queued_;
  std::chrono::milliseconds max_wait_;
  bool hook_warned_ = false;         // distributor only: a bad hook is logged once
  std::mutex m_;
  std::vector<std::unique_ptr<queue>> queues_;
  std::error_code failed_;           // the inner listener failed: every queue reports it
  std::uint64_t sequence_ = 0;       // distributor only
  std::uint64_t next_ = 0;           // round robin; distributor only
  std::atomic<std::uint64_t> refused_{0};  // refused here: no reactor could take them
  std::jthread distributor_;         // last: stopped first
};

}  // namespace anydoor::detail
