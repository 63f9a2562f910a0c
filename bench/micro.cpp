// anydoor-micro: the runtime's CPU cost per operation (Google Benchmark).
//   reactor_dispatch        poll a batch, dispatch each completion by wr_id
//                           to its operation, re-track (per completion)
//   reactor_resume_coroutine/N/P  the same, and each completion resumes a
//                           coroutine co_awaiting it (through the runtime's
//                           pending_handler: dispatch, resume); N coroutines,
//                           P = the reactor's spin_polls: 16 (the default:
//                           a round polls on while its handlers post nothing,
//                           so Asio's epoll_wait per io_context round is
//                           shared by up to 16 passes) or 1 (one pass per
//                           round: the cost with an epoll_wait per pass).
//                           A round also ends once it has dispatched a batch
//                           of completions (here 32): with N = 16 a round is
//                           2 passes whatever P says
//   reactor_resume_deferred/N/P   the same through co_await op(asio::deferred)
//                           instead of use_awaitable
//   buffer_pool_get_put     one try_get + put on a registered pool
// The reactor is fed by `synthetic_cq`, a completion queue that hands out
// the completions the benchmark queued: it isolates the runtime's cost from
// a provider's (the tcp provider's poll is a socket syscall). Everything
// else is the real code.
#include <anydoor/buffer_pool.hpp>
#include <anydoor/detail/pending_handler.hpp>
#include <anydoor/reactor.hpp>

#include <benchmark/benchmark.h>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/deferred.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <vector>

namespace asio = boost::asio;
namespace ad = anydoor;
namespace tp = anydoor::transport;

namespace {

class synthetic_cq final : public tp::completion_queue {
 public:
  synthetic_cq() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}
  ~synthetic_cq() override { ::close(fd_); }
  void push(const tp::completion& c) { ring_.push_back(c); }
  std::size_t poll(std::span<tp::completion> out, std::error_code& ec) noexcept override {
    ec.clear();
    std::size_t n = 0;
    while (n < out.size() && head_ < ring_.size()) out[n++] = ring_[head_++];
    if (head_ == ring_.size()) {
      ring_.clear();
      head_ = 0;
    }
    return n;
  }
  std::error_code arm() noexcept override { return {}; }
  int notify_fd() const noexcept override { return fd_; }
  std::size_t ack_events() noexcept override { return 0; }
  std::uint32_t depth() const noexcept override { return 1u << 20; }
  tp::cq_counters counters() const noexcept override { return {}; }

 private:
  int fd_;
  std::vector<tp::completion> ring_;
  std::size_t head_ = 0;
};

struct counting_op final : ad::operation {
  std::uint64_t n = 0;
  void complete(const tp::completion&) noexcept override { ++n; }
};

constexpr int kBatch = 16;

void reactor_dispatch(benchmark::State& state) {
  asio::io_context io{1};  // hint 1: one thread runs it (Asio queues what that thread posts without a lock)
  synthetic_cq cq;
  // One poll per io_context round, so that each step below is one poll.
  ad::reactor r(io, cq, {.mode = ad::poll_mode::busy, .batch = kBatch, .spin_polls = 1});
  counting_op op;
  r.start();
  io.poll_one();  // the first spin step
  for (auto _ : state) {
    for (int i = 0; i < kBatch; ++i) cq.push({.wr_id = r.track(op)});
    io.poll_one();  // one spin step: poll, dispatch kBatch completions, re-post
  }
  r.stop();
  if (op.n != static_cast<std::uint64_t>(state.iterations()) * kBatch) state.SkipWithError("lost completions");
  state.SetItemsProcessed(state.iterations() * kBatch);
}
BENCHMARK(reactor_dispatch);

// An operation whose completion resumes a coroutine: the handler waits in a
// pending_handler as the runtime's operations do.
struct awaited_op final : ad::operation {
  ad::detail::pending_handler handler;
  std::uint64_t resumed = 0;
  void complete(const tp::completion&) noexcept override { handler.complete(false, std::error_code{}); }
};

template <class Token>
auto async_next(ad::reactor& r, synthetic_cq& cq, awaited_op& op, asio::io_context& io, Token&& token) {
  return asio::async_initiate<Token, void(boost::system::error_code)>(
      [r = &r, cq = &cq, op = &op, io = &io]<class H>(H&& h) {  // (asio::deferred runs it after the return)
        op->handler.store<>(std::forward<H>(h), io->get_executor(), nullptr, nullptr);
        cq->push({.wr_id = r->track(*op)});
      },
      token);
}

template <class Await>
void resume_coroutines(benchmark::State& state, Await await_next) {
  // state.range(0) coroutines each co_await their own operation: each pass
  // of a spin step polls, dispatches and resumes all of them; a step makes
  // up to state.range(1) passes (its spin_polls: the resumed coroutines post
  // nothing, so the round goes on).
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto passes = static_cast<std::uint32_t>(state.range(1));
  asio::io_context io{1};  // hint 1: one thread runs it (Asio queues what that thread posts without a lock)
  synthetic_cq cq;
  // A batch larger than n: the pass ends after the n completions (a full
  // batch would make the reactor poll again, and the resumed coroutines
  // have queued n more).
  constexpr std::uint32_t kResumeBatch = 2 * kBatch;
  ad::reactor r(io, cq, {.mode = ad::poll_mode::busy, .batch = kResumeBatch, .spin_polls = passes});
  std::deque<awaited_op> ops(n);
  bool stop = false;
  for (awaited_op& op : ops) {
    asio::co_spawn(io, [&]() -> asio::awaitable<void> {
      while (!stop) {
        co_await await_next(r, cq, op, io);
        ++op.resumed;
      }
    }, asio::detached);
  }
  r.start();
  // (busy mode re-posts its step forever: io.poll() would never return)
  for (std::size_t i = 0; i < n + 4; ++i) io.poll_one();  // start the coroutines and the reactor
  std::uint64_t before = 0;
  for (const awaited_op& op : ops) before += op.resumed;
  for (auto _ : state) io.poll_one();  // one spin step: (poll, dispatch, resume, re-await) x passes
  stop = true;
  r.stop();
  std::uint64_t after = 0;
  for (const awaited_op& op : ops) after += op.resumed;
  // Each step makes P passes, or fewer where its completions reach the
  // batch first (reactor::spin_step): every pass resumes all n.
  const std::uint64_t per_step = n * std::min<std::uint64_t>(passes, (kResumeBatch + n - 1) / n);
  if (after - before + n < static_cast<std::uint64_t>(state.iterations()) * per_step) {
    state.SkipWithError("coroutines not resumed");
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(after - before));  // resumes
}
// co_await op(asio::use_awaitable): Asio builds a coroutine frame to
// initiate each operation.
void reactor_resume_coroutine(benchmark::State& state) {
  resume_coroutines(state, [](ad::reactor& r, synthetic_cq& cq, awaited_op& op, asio::io_context& io) {
    return async_next(r, cq, op, io, asio::use_awaitable);
  });
}
BENCHMARK(reactor_resume_coroutine)->Args({1, 16})->Args({16, 16})->Args({16, 1});

// co_await op(asio::deferred): the awaitable initiates the operation
// itself, with no frame of its own.
void reactor_resume_deferred(benchmark::State& state) {
  resume_coroutines(state, [](ad::reactor& r, synthetic_cq& cq, awaited_op& op, asio::io_context& io) {
    return async_next(r, cq, op, io, asio::deferred);
  });
}
BENCHMARK(reactor_resume_deferred)->Args({1, 16})->Args({16, 16})->Args({16, 1});

void buffer_pool_get_put(benchmark::State& state) {
  auto dev = tp::open_device({.provider = "tcp"});
  auto pd = dev->alloc_pd();
  ad::buffer_pool pool(*pd, {.buffer_size = 8256, .buffers_per_slab = 256});
  for (auto _ : state) {
    const std::uint32_t b = pool.try_get();
    benchmark::DoNotOptimize(pool.data(b));
    pool.put(b);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(buffer_pool_get_put);

}  // namespace

BENCHMARK_MAIN();
