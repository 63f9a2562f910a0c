#include "staging.hpp"

#include "connection_impl.hpp"
#include "cuda/driver.hpp"
#include "log.hpp"
#include "split_region.hpp"

#include <anydoor/error.hpp>

#include <boost/asio/post.hpp>

#include <algorithm>
#include <string>

namespace anydoor::detail {

// ---------------------------------------------------------------- copy_thread

copy_thread::copy_thread(asio::io_context& io) : io_(io), thread_([this] { run(); }) {}

copy_thread::~copy_thread() { shutdown(); }

void copy_thread::shutdown() noexcept {
  std::deque<job> dropped;
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
    dropped.swap(jobs_);
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
  parked_.clear();  // (here, not on the copy thread: the last owner of a fabric may be among them)
}

void copy_thread::start(bool to_host, void* dst, const void* src, std::size_t n,
                        std::shared_ptr<staged_transfer> owner, std::uint32_t slot) {
  {
    std::lock_guard lock(mutex_);
    if (!stop_) jobs_.push_back({to_host, dst, src, n, std::move(owner), slot});
  }
  if (owner != nullptr) {
    // After shutdown (a connection used past its fabric): the copy fails.
    asio::post(io_, [owner = std::move(owner), slot] { owner->on_copy_done(slot, errc::connection_closed); });
    return;
  }
  wake_.notify_one();
}

void copy_thread::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stopping, and nothing left
    job j = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    std::string why;
    const std::error_code ec = j.to_host ? cuda::detail::copy_to_host(j.dst, j.src, j.n, why)
                                         : cuda::detail::copy_to_device(j.dst, j.src, j.n, why);
    if (ec) log().warn("staging: copying {} bytes {} GPU memory failed: {}", j.n, j.to_host ? "out of" : "into", why);
    lock.lock();
    if (stop_) {
      parked_.push_back(std::move(j.owner));  // no post into an io_context that may be gone
      continue;
    }
    try {
      asio::post(io_, [owner = std::move(j.owner), slot = j.slot, ec] { owner->on_copy_done(slot, ec); });
    } catch (const std::exception&) {
      parked_.push_back(std::move(j.owner));  // (released by shutdown, never on this thread)
    }
  }
}

// ---------------------------------------------------------------- staging_area

staging_area::staging_area(transport::protection_domain& pd, unsigned piece_shift, std::size_t chunk,
                           std::uint32_t count)
    : chunk_(chunk),
      memory_(new std::byte[chunk * count]),
      pinned_(cuda::detail::pin_host(memory_.get(), chunk * count)),
      region_(register_in_pieces(pd, memory_.get(), chunk * count, transport::access::local_write, piece_shift),
              memory_kind::host) {
  free_.reserve(count);
  for (std::uint32_t i = count; i-- > 0;) free_.push_back(i);
}

bool staging_area::take(std::uint32_t& i, const std::shared_ptr<staged_transfer>& waiter) {
  if (free_.empty()) {
    if (waiter->enlist()) waiting_.push_back(waiter);
    return false;
  }
  i = free_.back();
  free_.pop_back();
  return true;
}

void staging_area::forget(const staged_transfer* waiter) noexcept {
  std::erase_if(waiting_, [waiter](const std::shared_ptr<staged_transfer>& w) { return w.get() == waiter; });
}

void staging_area::give(std::uint32_t i) noexcept {
  free_.push_back(i);
  // Every waiter looks again (one that finds none waits again): a waiter
  // woken for nothing cannot leave the buffer idle while another waits.
  std::deque<std::shared_ptr<staged_transfer>> waiting;
  waiting.swap(waiting_);
  for (auto& w : waiting) {
    const auto ex = w->executor();
    asio::post(ex, [w = std::move(w)] { w->resume(); });
  }
}

// ---------------------------------------------------------------- staged_transfer

staged_transfer::staged_transfer(std::shared_ptr<connection_impl> c, op_node* n, staging_area& area,
                                 copy_thread& copies)
    : conn_(std::move(c)),
      parent_(n),
      area_(area),
      copies_(copies),
      put_(n->kind == op_kind::put),
      gpu_(static_cast<std::byte*>(const_cast<void*>(n->bufs[0].data()))),
      length_(n->length),
      work_(asio::make_work_guard(conn_->fabric().io)) {}

asio::io_context::executor_type staged_transfer::executor() const noexcept { return conn_->fabric().io.get_executor(); }

void staged_transfer::start() {
  pump();  // (cancellable until its first chunk starts: cancel)
}

bool staged_transfer::cancel(std::error_code why) noexcept {
  if (completed_ || next_ != 0 || busy_ != 0) return false;
  error_ = why;
  maybe_complete();
  return true;
}

// Starts what can start: with a buffer free (held, or taken from the
// area), the next chunk's first step: for a put its copy out of the GPU,
// for a get its read.
void staged_transfer::pump() noexcept {
  if (completed_) return;
  auto self = shared_from_this();
  for (std::uint32_t s = 0; s < slots_.size() && !error_ && next_ < length_; ++s) {
    slot& sl = slots_[s];
    if (sl.busy) continue;
    if (sl.buffer == ~0u && !area_.take(sl.buffer, self)) break;  // resumed when one is back
    parent_->phase = op_phase::posted;  // under way: runs to completion (not cancellable)
    sl.off = next_;
    sl.len = static_cast<std::size_t>(std::min<std::uint64_t>(area_.chunk(), length_ - next_));
    sl.busy = true;
    ++busy_;
    next_ += sl.len;
    if (put_) {
      copies_.start(true, area_.buffer(sl.buffer), gpu_ + sl.off, sl.len, self, s);
    } else {
      start_chunk_transfer(s);
    }
  }
  maybe_complete();
}

void staged_transfer::start_chunk_transfer(std::uint32_t s) noexcept {
  slot& sl = slots_[s];
  op_node* c = nullptr;
  try {
    c = conn_->acquire(put_ ? op_kind::put : op_kind::get);
  } catch (const std::exception&) {
    on_chunk_done(s, errc::registration_failed);
    return;
  }
  c->bufs[0] = asio::const_buffer(area_.buffer(sl.buffer), sl.len);
  c->regions[0] = &area_.region();
  c->nbufs = 1;
  c->length = sl.len;
  c->read_only = put_;
  try {
    c->remote = parent_->remote.at(sl.off, sl.len);
  } catch (const std::exception&) {
    conn_->release(c);
    on_chunk_done(s, errc::out_of_range);
    return;
  }
  c->handler.template store<std::size_t>(
      [self = shared_from_this(), s](boost::system::error_code ec, std::size_t) { self->on_chunk_done(s, ec); },
      executor(), nullptr, nullptr);
  conn_->start_chunk(c);
}

void staged_transfer::on_copy_done(std::uint32_t s, std::error_code ec) noexcept {
  if (ec) fail(ec);
  if (put_ && !ec && !error_) {
    start_chunk_transfer(s);  // the chunk is in host memory: write it
    return;
  }
  finish_slot(s);  // a get's chunk is in the GPU (or the copy failed)
}

void staged_transfer::on_chunk_done(std::uint32_t s, std::error_code ec) noexcept {
  if (ec) fail(ec);
  if (!put_ && !ec && !error_) {
    const slot& sl = slots_[s];
    copies_.start(false, gpu_ + sl.off, area_.buffer(sl.buffer), sl.len, shared_from_this(), s);
    return;
  }
  finish_slot(s);  // a put's chunk is written (or the transfer failed)
}

void staged_transfer::finish_slot(std::uint32_t s) noexcept {
  slot& sl = slots_[s];
  sl.busy = false;
  --busy_;
  if (!error_) done_ += sl.len;
  // Keep the buffer for the next chunk; give it back when none is left.
  if (next_ >= length_ || error_) {
    area_.give(sl.buffer);
    sl.buffer = ~0u;
  }
  pump();
}

void staged_transfer::fail(std::error_code ec) noexcept {
  if (!error_) error_ = ec;  // (no more chunks start; those in flight finish)
}

void staged_transfer::maybe_complete() noexcept {
  if (completed_ || busy_ != 0 || (!error_ && done_ < length_)) return;
  completed_ = true;
  // No longer among the area's waiters: they hold it (and through it its
  // connection) until a buffer comes back, which may be never.
  if (std::exchange(enlisted_, false)) area_.forget(this);
  for (slot& sl : slots_) {
    if (sl.buffer != ~0u) {
      area_.give(sl.buffer);
      sl.buffer = ~0u;
    }
  }
  conn_->complete_staged(parent_, error_, error_ ? 0 : static_cast<std::size_t>(length_));
  work_.reset();
}

}  // namespace anydoor::detail
