// rpc::channel: a client engine per connection, dialled lazily and again
// after failures, with backoff (see include/anydoor/rpc/channel.hpp).
#include <anydoor/rpc/channel.hpp>

#include "client_impl.hpp"

#include "log.hpp"

#include <boost/asio/bind_executor.hpp>

#include <random>

namespace anydoor::rpc {
namespace detail {

class channel_state : public std::enable_shared_from_this<channel_state> {
 public:
  channel_state(fabric& fab, std::string address, const channel_options& o)
      : fab_(fab), ex_(fab.get_executor()), address_(std::move(address)), opts_(o), backoff_(o.initial_backoff),
        rng_(std::random_device{}()) {}

  client_impl* client(std::error_code& why) noexcept {
    const auto now = clock::now();
    if (current_ && current_->current_state() == client_impl::state::open && !current_->conn().is_open()) {
      current_->fail(make_error_code(errc::unavailable), true);  // it died while idle: dial again
    }
    if (current_ && current_->current_state() == client_impl::state::failed) {
      if (current_->ever_open()) {
        last_error_ = make_error_code(errc::unavailable);
        // A connection that worked has failed: dial again now.
        backoff_ = opts_.initial_backoff;
        retry_at_ = clock::time_point::min();
      }
      retired_stats_ = current_->stats();
      current_.reset();
    }
    if (current_) return current_.get();
    if (now < retry_at_) {
      ++stats_.fast_failures;
      why = make_error_code(errc::unavailable);
      return nullptr;
    }
    try {
      current_ = std::make_shared<client_impl>(ex_, opts_.client);
    } catch (const std::bad_alloc&) {
      why = make_error_code(errc::resource_exhausted);
      return nullptr;
    }
    ++stats_.dials;
    dial(current_);
    return current_.get();
  }

  void shutdown() noexcept {
    closed_ = true;
    if (current_) current_->shutdown();
    current_.reset();
  }

  bool connected() const noexcept {
    return current_ && current_->current_state() == client_impl::state::open && current_->conn().is_open();
  }
  std::error_code last_error() const noexcept { return last_error_; }
  const std::string& address() const noexcept { return address_; }
  channel_stats stats() const noexcept {
    channel_stats s = stats_;
    s.client = current_ ? current_->stats() : retired_stats_;
    return s;
  }
  asio::io_context::executor_type executor() const noexcept { return ex_; }

 private:
  void dial(const std::shared_ptr<client_impl>& c) {
    std::weak_ptr<channel_state> weak = weak_from_this();
    fab_.async_connect(address_, asio::bind_executor(ex_, [weak, c](const error_code& ec, connection conn) {
                         auto self = weak.lock();
                         if (!self || self->closed_) {
                           conn.abort();
                           c->shutdown();
                           return;
                         }
                         self->on_dialled(c, ec, std::move(conn));
                       }));
  }

  void on_dialled(const std::shared_ptr<client_impl>& c, const error_code& ec, connection conn) {
    if (!ec) {
      backoff_ = opts_.initial_backoff;
      c->attach(std::move(conn));
      return;
    }
    ++stats_.dial_failures;
    last_error_ = ec;
    // Jitter of +-20 % so that many clients do not dial in step.
    std::uniform_real_distribution<double> jitter(0.8, 1.2);
    const auto wait = std::chrono::duration_cast<clock::duration>(backoff_ * jitter(rng_));
    retry_at_ = clock::now() + wait;
    log().debug("rpc channel {}: dialling failed ({}); next attempt in {} ms", address_, ec.message(),
                std::chrono::duration_cast<std::chrono::milliseconds>(wait).count());
    backoff_ = std::min(backoff_ * 2, opts_.max_backoff);
    c->fail(make_error_code(errc::unavailable), false);
  }

  fabric& fab_;
  asio::io_context::executor_type ex_;
  std::string address_;
  channel_options opts_;
  std::shared_ptr<client_impl> current_;
  std::chrono::milliseconds backoff_;
  clock::time_point retry_at_ = clock::time_point::min();
  std::error_code last_error_;
  std::mt19937 rng_;
  channel_stats stats_;
  client_stats retired_stats_;
  bool closed_ = false;
};

client_impl* channel_client(channel_state& ch, std::error_code& why) { return ch.client(why); }
asio::io_context::executor_type channel_executor(const channel_state& ch) noexcept { return ch.executor(); }

}  // namespace detail

channel::channel(fabric& fab, std::string address, channel_options options) {
  if (options.initial_backoff.count() < 1 || options.max_backoff < options.initial_backoff ||
      options.client.max_calls < 1 || options.client.max_calls > (1u << 24) || options.client.timeout.count() < 0 ||
      options.client.timeout > std::chrono::hours(1) || options.max_backoff > std::chrono::hours(1)) {
    throw std::system_error(make_error_code(anydoor::errc::invalid_argument),
                            "rpc::channel: initial_backoff must be at least 1 ms and at most max_backoff (at most 1 h); "
                            "client options as rpc::client's");
  }
  state_ = std::make_shared<detail::channel_state>(fab, std::move(address), options);
}

channel::channel(channel&&) noexcept = default;
channel& channel::operator=(channel&& other) noexcept {
  if (this != &other) {
    if (state_) state_->shutdown();
    state_ = std::move(other.state_);
  }
  return *this;
}
channel::~channel() {
  if (state_) state_->shutdown();
}

detail::channel_state& channel::state() const {
  if (!state_) throw std::system_error(make_error_code(anydoor::errc::not_connected), "rpc::channel: moved from");
  return *state_;
}

bool channel::connected() const noexcept { return state_ && state_->connected(); }
std::error_code channel::last_error() const noexcept { return state_ ? state_->last_error() : std::error_code(); }
const std::string& channel::address() const noexcept {
  static const std::string none;
  return state_ ? state_->address() : none;
}
channel_stats channel::stats() const noexcept { return state_ ? state_->stats() : channel_stats{}; }

}  // namespace anydoor::rpc
