// A type-erased completion handler with inline storage, for operations that
// wait inside the runtime. Storing one hooks its cancellation slot and, when
// the handler's executor is not the fabric's io_context, keeps that executor
// busy (outstanding work); completing it moves the handler out and
// dispatches (or posts) it on its associated executor.
// Handlers up to kInline bytes are stored without allocating. Handlers see
// boost::system::error_code (Asio's own, which wraps anydoor's std::error_code
// categories losslessly), so use_awaitable and use_future throw on errors.
#pragma once

#include <boost/asio/associated_cancellation_slot.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/cancellation_type.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/system/error_code.hpp>

#include <cstddef>
#include <memory>
#include <new>
#include <optional>
#include <system_error>
#include <tuple>
#include <type_traits>
#include <utility>

namespace anydoor::detail {

namespace asio = boost::asio;

class pending_handler {
 public:
  static constexpr std::size_t kInline = 192;
  using cancel_fn = void (*)(void* ctx, asio::cancellation_type type);

  pending_handler() noexcept = default;
  pending_handler(const pending_handler&) = delete;
  pending_handler& operator=(const pending_handler&) = delete;
  ~pending_handler() { reset(); }

  bool empty() const noexcept { return call_ == nullptr; }
  // The stored handler runs on the io_context given to store() (not, say,
  // on the system executor use_future completes on).
  bool runs_on_io() const noexcept { return on_io_; }

  // The handler's signature is void(boost::system::error_code, Args...). on_cancel(ctx,
  // type) runs when its cancellation slot is emitted.
  using io_executor = asio::io_context::executor_type;
  template <class... Args, class Handler>
  void store(Handler&& handler, const io_executor& io_ex, cancel_fn on_cancel, void* ctx) {
    using handler_t = std::decay_t<Handler>;
    using holder_t = holder<handler_t>;
    void* mem = sizeof(holder_t) <= kInline && alignof(holder_t) <= alignof(std::max_align_t)
                    ? static_cast<void*>(inline_)
                    : ::operator new(sizeof(holder_t));
    auto* h = new (mem) holder_t(std::forward<Handler>(handler), io_ex);
    obj_ = h;
    on_io_ = !h->work.has_value();
    io_ = on_io_ ? &io_ex.context() : nullptr;
    call_ = &call<holder_t, Args...>;
    destroy_ = &destroy<holder_t>;
    h->slot = asio::get_associated_cancellation_slot(h->handler);
    if (on_cancel != nullptr && h->slot.is_connected()) h->slot.template emplace<canceller>(on_cancel, ctx);
  }

  // Runs after a posted handler has run (the runtime counts completions it
  // has posted but that have not run yet; see fabric_state::flush_all).
  struct after_hook {
    std::shared_ptr<void> keep;    // keeps *counter alive
    std::size_t* counter = nullptr;
    void operator()() const noexcept {
      if (counter != nullptr) --*counter;
    }
  };

  // Runs the hook as the handler returns, or throws (an exception that
  // leaves io_context::run() must not leave the count up for good).
  struct run_after {
    after_hook& hook;
    ~run_after() { hook(); }
  };

  // Completes with (ec, args...): Args must be those given to store(). With
  // post, the handler runs later even when called on its executor's thread.
  template <class... Args>
  void complete(bool post, std::error_code ec, Args&&... args) {
    complete_then(after_hook{}, post, ec, std::forward<Args>(args)...);
  }
  template <class... Args>
  void complete_then(after_hook after, bool post, std::error_code ec, Args&&... args) {
    // (Converting a std::error_code costs a dynamic_cast even when it is 0.)
    std::tuple<boost::system::error_code, std::decay_t<Args>...> t(
        ec ? boost::system::error_code(ec) : boost::system::error_code(), std::forward<Args>(args)...);
    auto* fn = call_;
    fn(*this, &t, post, after);
  }

  // Destroys the handler without calling it (its work guard is released).
  void reset() noexcept {
    if (destroy_ != nullptr) destroy_(*this);
  }

 private:
  template <class Executor>
  static bool same_context(const Executor& ex, const io_executor& io_ex) noexcept {
    if constexpr (std::is_same_v<Executor, io_executor>) {
      return &ex.context() == &io_ex.context();
    } else if constexpr (requires { ex.template target<io_executor>(); }) {
      const io_executor* t = ex.template target<io_executor>();  // any_io_executor (use_awaitable)
      return t != nullptr && &t->context() == &io_ex.context();
    } else {
      return false;
    }
  }

  struct canceller {
    cancel_fn fn;
    void* ctx;
    canceller(cancel_fn f, void* c) noexcept : fn(f), ctx(c) {}
    void operator()(asio::cancellation_type type) const { fn(ctx, type); }
  };

  template <class Handler>
  struct holder {
    using handler_type = Handler;
    using executor_t = asio::associated_executor_t<Handler, io_executor>;
    holder(Handler&& h, const io_executor& io_ex) : handler(std::move(h)) { track(io_ex); }
    holder(const Handler& h, const io_executor& io_ex) : handler(h) { track(io_ex); }
    // A handler that runs on the fabric's io_context needs no work guard:
    // while it waits, the reactor keeps that io_context busy. Any other
    // executor is kept busy by the guard.
    void track(const io_executor& io_ex) {
      executor_t ex = asio::get_associated_executor(handler, io_ex);
      if (!same_context(ex, io_ex)) work.emplace(std::move(ex));
    }
    Handler handler;
    std::optional<asio::executor_work_guard<executor_t>> work;
    asio::cancellation_slot slot;
  };

  template <class Holder>
  static void destroy(pending_handler& self) noexcept {
    auto* h = static_cast<Holder*>(self.obj_);
    if (h->slot.is_connected()) h->slot.clear();
    h->~Holder();
    if (self.obj_ != static_cast<void*>(self.inline_)) ::operator delete(self.obj_);
    self.obj_ = nullptr;
    self.call_ = nullptr;
    self.destroy_ = nullptr;
    self.io_ = nullptr;
  }

  template <class Holder, class... Args>
  static void call(pending_handler& self, void* args, bool post, after_hook& after) {
    asio::io_context* io = self.io_;
    if (io != nullptr && !post && io->get_executor().running_in_this_thread()) [[likely]] {
      // The common case (a coroutine resumed by the reactor on its own
      // thread): the handler leaves its holder, which goes first (the
      // handler may end the operation's owner), and runs here.
      auto* h = static_cast<Holder*>(self.obj_);
      typename Holder::handler_type handler(std::move(h->handler));
      destroy<Holder>(self);  // (clears the cancellation slot)
      const run_after guard{after};
      std::apply(std::move(handler), std::move(*static_cast<std::tuple<boost::system::error_code, Args...>*>(args)));
      return;
    }
    call_later<Holder, Args...>(self, args, post, after);
  }

  // The handler runs later, or on another executor (out of line: the
  // common case above stays small).
  template <class Holder, class... Args>
  [[gnu::noinline]] static void call_later(pending_handler& self, void* args, bool post, after_hook& after) {
    auto* h = static_cast<Holder*>(self.obj_);
    if (h->slot.is_connected()) h->slot.clear();
    asio::io_context* io = self.io_;
    auto& t = *static_cast<std::tuple<boost::system::error_code, Args...>*>(args);
    auto fn = [handler = std::move(h->handler), t = std::move(t), after = std::move(after)]() mutable {
      const run_after guard{after};
      std::apply(std::move(handler), std::move(t));
    };
    if (io != nullptr) {
      // The handler's executor is this io_context's (possibly type-erased,
      // as use_awaitable's), and it may not run here (posted, or called
      // from another thread; call() ran the rest): posted there, without
      // going through the type-erased executor.
      destroy<Holder>(self);
      asio::post(io->get_executor(), std::move(fn));
      return;
    }
    // Another executor: kept busy until the handler is queued there. The
    // holder goes first (a handler dispatched inline may end its operation's
    // owner).
    asio::executor_work_guard<typename Holder::executor_t> work(h->work->get_executor());
    destroy<Holder>(self);
    if (post) {
      asio::post(work.get_executor(), std::move(fn));
    } else {
      asio::dispatch(work.get_executor(), std::move(fn));
    }
    work.reset();
  }

  // The bookkeeping first, next to the head of the storage (one cache line
  // for a small handler).
  void* obj_ = nullptr;
  asio::io_context* io_ = nullptr;  // set when the handler runs on this io_context
  void (*call_)(pending_handler&, void*, bool, after_hook&) = nullptr;
  void (*destroy_)(pending_handler&) noexcept = nullptr;
  bool on_io_ = false;
  alignas(std::max_align_t) unsigned char inline_[kInline];
};

}  // namespace anydoor::detail
