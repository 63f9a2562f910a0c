// A type-erased completion handler with inline storage, for operations that
// wait inside the runtime. Storing one keeps the handler's executor busy
// (outstanding work) and hooks its cancellation slot; completing it moves the
// handler out and dispatches (or posts) it on its associated executor.
// Handlers up to kInline bytes are stored without allocating. Handlers see
// boost::system::error_code (Asio's own, which wraps anydoor's std::error_code
// categories losslessly), so use_awaitable and use_future throw on errors.
#pragma once

#include <boost/asio/associated_cancellation_slot.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/cancellation_type.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/post.hpp>
#include <boost/system/error_code.hpp>

#include <cstddef>
#include <memory>
#include <new>
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
  template <class... Args, class Handler, class IoExecutor>
  void store(Handler&& handler, const IoExecutor& io_ex, cancel_fn on_cancel, void* ctx) {
    using handler_t = std::decay_t<Handler>;
    using holder_t = holder<handler_t, IoExecutor>;
    void* mem = sizeof(holder_t) <= kInline && alignof(holder_t) <= alignof(std::max_align_t)
                    ? static_cast<void*>(inline_)
                    : ::operator new(sizeof(holder_t));
    auto* h = new (mem) holder_t(std::forward<Handler>(handler), io_ex);
    obj_ = h;
    on_io_ = same_context(h->work.get_executor(), io_ex);
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

  // Completes with (ec, args...): Args must be those given to store(). With
  // post, the handler runs later even when called on its executor's thread.
  template <class... Args>
  void complete(bool post, std::error_code ec, Args&&... args) {
    complete_then(after_hook{}, post, ec, std::forward<Args>(args)...);
  }
  template <class... Args>
  void complete_then(after_hook after, bool post, std::error_code ec, Args&&... args) {
    std::tuple<boost::system::error_code, std::decay_t<Args>...> t(boost::system::error_code(ec),
                                                                   std::forward<Args>(args)...);
    auto* fn = call_;
    fn(*this, &t, post, after);
  }

  // Destroys the handler without calling it (its work guard is released).
  void reset() noexcept {
    if (destroy_ != nullptr) destroy_(*this);
  }

 private:
  template <class Executor, class IoExecutor>
  static bool same_context(const Executor& ex, const IoExecutor& io_ex) noexcept {
    if constexpr (std::is_same_v<Executor, IoExecutor>) {
      return &ex.context() == &io_ex.context();
    } else if constexpr (requires { ex.template target<IoExecutor>(); }) {
      const IoExecutor* t = ex.template target<IoExecutor>();  // any_io_executor (use_awaitable)
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

  template <class Handler, class IoExecutor>
  struct holder {
    using executor_t = asio::associated_executor_t<Handler, IoExecutor>;
    holder(Handler&& h, const IoExecutor& io_ex)
        : handler(std::move(h)), work(asio::get_associated_executor(handler, io_ex)) {}
    holder(const Handler& h, const IoExecutor& io_ex)
        : handler(h), work(asio::get_associated_executor(handler, io_ex)) {}
    Handler handler;
    asio::executor_work_guard<executor_t> work;
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
  }

  template <class Holder, class... Args>
  static void call(pending_handler& self, void* args, bool post, after_hook& after) {
    auto* h = static_cast<Holder*>(self.obj_);
    if (h->slot.is_connected()) h->slot.clear();
    auto handler = std::move(h->handler);
    auto work = std::move(h->work);
    destroy<Holder>(self);
    auto& t = *static_cast<std::tuple<boost::system::error_code, Args...>*>(args);
    auto fn = [handler = std::move(handler), t = std::move(t), after = std::move(after)]() mutable {
      std::apply(std::move(handler), std::move(t));
      after();
    };
    if (post) {
      asio::post(work.get_executor(), std::move(fn));
    } else {
      asio::dispatch(work.get_executor(), std::move(fn));
    }
    work.reset();
  }

  alignas(std::max_align_t) unsigned char inline_[kInline];
  void* obj_ = nullptr;
  bool on_io_ = false;
  void (*call_)(pending_handler&, void*, bool, after_hook&) = nullptr;
  void (*destroy_)(pending_handler&) noexcept = nullptr;
};

}  // namespace anydoor::detail
