// Runtime-internal: GPU device memory through host buffers. The staging
// pipeline moves a put's or get's bytes in chunks through the fabric's
// staging buffers: for a put, chunk k+1 is copied out of the GPU while
// chunk k is written; for a get, chunk k+1 is read while chunk k is copied
// into the GPU. A transfer holds at most two buffers (double-buffered);
// one of at most gpu_bounce_threshold bytes goes this way too (the bounce).
// Copies run on the fabric's copy thread (synchronous driver copies, one
// at a time, completions posted to the io_context), so that the io thread
// drives the network meanwhile; the transfers of chunks are ordinary
// one-sided operations on the connection (flow control, errors and all).
// The connection holds its later operations until a staged transfer is
// done (connection_impl::behind_staged_), chunks excepted (start_chunk):
// nothing overtakes the data. A close waits for it too.
#pragma once

#include <anydoor/detail/op_node.hpp>
#include <anydoor/memory.hpp>
#include <anydoor/transport/provider.hpp>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace anydoor::detail {

class connection_impl;
class staged_transfer;

// Copies between host and GPU memory on a thread of their own, in order;
// each completion is posted to the io_context (never run inline).
class copy_thread {
 public:
  explicit copy_thread(asio::io_context& io);
  ~copy_thread();  // shutdown(), if not yet
  copy_thread(const copy_thread&) = delete;
  // No completion is posted after this returns (fabric::~fabric: the
  // io_context may go next): the copy in progress finishes, queued ones
  // are dropped, and the transfers they held are released on this thread
  // (their operations never complete: the fabric is going).
  void shutdown() noexcept;
  copy_thread& operator=(const copy_thread&) = delete;

  // dst <- src, n bytes; to_host: src is GPU memory, else dst is. Then
  // owner->on_copy_done(slot, ec) on the io thread.
  void start(bool to_host, void* dst, const void* src, std::size_t n, std::shared_ptr<staged_transfer> owner,
             std::uint32_t slot);

 private:
  struct job {
    bool to_host = false;
    void* dst = nullptr;
    const void* src = nullptr;
    std::size_t n = 0;
    std::shared_ptr<staged_transfer> owner;
    std::uint32_t slot = 0;
  };
  void run();
  asio::io_context& io_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<job> jobs_;
  std::vector<std::shared_ptr<staged_transfer>> parked_;  // finished after shutdown began
  bool stop_ = false;
  std::thread thread_;
};

// The fabric's staging buffers: `count` of `chunk` bytes each, in one
// host allocation registered once (in pieces above 2^piece_shift bytes).
class staging_area {
 public:
  staging_area(transport::protection_domain& pd, unsigned piece_shift, std::size_t chunk, std::uint32_t count);
  const memory_region& region() const noexcept { return region_; }
  std::byte* buffer(std::uint32_t i) noexcept { return memory_.get() + i * chunk_; }
  std::size_t chunk() const noexcept { return chunk_; }
  // A free buffer, or false when all are taken (then `waiter` is resumed,
  // posted, when one is given back: every waiter is, and takes it or waits
  // again).
  bool take(std::uint32_t& i, const std::shared_ptr<staged_transfer>& waiter);
  void give(std::uint32_t i) noexcept;
  void forget(const staged_transfer* waiter) noexcept;  // it ended while waiting

 private:
  std::size_t chunk_;
  std::unique_ptr<std::byte[]> memory_;
  std::shared_ptr<void> pinned_;  // page-locked for CUDA's copies while it lives (cuda::detail::pin_host)
  memory_region region_;
  std::vector<std::uint32_t> free_;
  // Transfers waiting for a buffer (held here: nothing else holds one that
  // waits; every buffer comes back, as every transfer ends).
  std::deque<std::shared_ptr<staged_transfer>> waiting_;
};

// One put or get of GPU memory through the staging area.
class staged_transfer : public std::enable_shared_from_this<staged_transfer> {
 public:
  // n: the put or get (one local piece, plain GPU memory), already checked.
  staged_transfer(std::shared_ptr<connection_impl> c, op_node* n, staging_area& area, copy_thread& copies);
  void start();  // (the io thread, as everything here but the copies)
  void on_copy_done(std::uint32_t slot, std::error_code ec) noexcept;
  // Ends it if no chunk has started (it waits for a staging buffer): it
  // completes with `why` (operation_canceled, or the connection's error);
  // false when it is under way.
  bool cancel(std::error_code why) noexcept;
  const op_node* parent() const noexcept { return parent_; }
  void on_chunk_done(std::uint32_t slot, std::error_code ec) noexcept;
  void resume() noexcept {  // a staging buffer was given back
    enlisted_ = false;
    pump();
  }
  // Whether to join the area's waiters (once until resumed).
  bool enlist() noexcept { return !std::exchange(enlisted_, true); }
  asio::io_context::executor_type executor() const noexcept;

 private:
  struct slot {
    std::uint32_t buffer = ~0u;  // in the staging area; ~0u: none held
    std::uint64_t off = 0;       // of the chunk it carries
    std::size_t len = 0;
    bool busy = false;
  };
  void pump() noexcept;
  void start_chunk_transfer(std::uint32_t s) noexcept;
  void finish_slot(std::uint32_t s) noexcept;
  void fail(std::error_code ec) noexcept;
  void maybe_complete() noexcept;

  std::shared_ptr<connection_impl> conn_;
  op_node* parent_;
  staging_area& area_;
  copy_thread& copies_;
  bool put_;
  std::byte* gpu_;
  std::uint64_t length_;
  std::uint64_t next_ = 0;  // the next chunk's offset
  std::uint64_t done_ = 0;  // bytes through
  std::uint32_t busy_ = 0;
  std::error_code error_;
  bool completed_ = false;
  bool enlisted_ = false;  // among the staging area's waiters
  std::array<slot, 2> slots_{};
  asio::executor_work_guard<asio::io_context::executor_type> work_;
};

}  // namespace anydoor::detail
