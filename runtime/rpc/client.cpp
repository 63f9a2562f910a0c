// The RPC client engine: call slots, sending requests, the receive loop and
// deadlines (see include/anydoor/rpc/client.hpp for the contract).
#include "client_impl.hpp"
#include "wire.hpp"

#include "log.hpp"

#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/post.hpp>

#include <algorithm>
#include <array>
#include <limits>

namespace anydoor::rpc {
namespace detail {

namespace {
// A typed request's encoding buffer larger than this is not kept for reuse.
constexpr std::size_t kRetainedEncoding = std::size_t{64} << 10;
// The wire carries a deadline as 32-bit microseconds (71 min).
constexpr std::chrono::microseconds kMaxTimeout = std::chrono::hours(1);

std::uint32_t budget_us(clock::time_point deadline, clock::time_point now) noexcept {
  if (deadline == clock::time_point::max()) return 0;
  if (deadline <= now) return 1;
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(deadline - now).count();
  return static_cast<std::uint32_t>(std::clamp<std::int64_t>(us, 1, std::numeric_limits<std::uint32_t>::max()));
}
}  // namespace

client_impl::client_impl(asio::io_context::executor_type ex, const client_options& o)
    : ex_(ex), opts_(o), timer_(ex) {}

client_impl::~client_impl() = default;

void client_impl::attach(connection c) {
  if (state_ != state::connecting) {
    c.abort();
    return;
  }
  conn_ = std::move(c);
  state_ = state::open;
  ever_open_ = true;
  auto keep = shared_from_this();
  while (queue_head_ != nullptr && state_ == state::open) {
    call_op* op = queue_head_;
    unqueue(*op);
    send_request(*op, true);  // a call failing here completes later: the queue keeps its order
  }
}

void client_impl::fail(std::error_code why, bool post) noexcept {
  if (state_ == state::failed) return;
  state_ = state::failed;
  if (conn_) conn_.abort();
  queue_head_ = queue_tail_ = nullptr;
  awaiting_payload_ = false;
  for (std::size_t i = 0; i < ops_.size(); ++i) {
    call_op& op = *ops_[i];
    if (op.st != call_op::state::unsent && op.st != call_op::state::sent) continue;
    op.queue_next = nullptr;
    if (why == errc::unavailable) ++stats_.unavailable;
    if (why == std::errc::operation_canceled) ++stats_.cancelled;
    complete(op, why, {}, post);
  }
  timer_.cancel();
  timer_at_ = clock::time_point::max();
  ++timer_seq_;
}

void client_impl::shutdown() noexcept {
  if (state_ == state::failed) {
    if (conn_) conn_.abort();
    return;
  }
  fail(std::make_error_code(std::errc::operation_canceled), true);
}

call_op* client_impl::acquire(std::error_code& ec) noexcept {
  if (state_ == state::failed) {
    ec = make_error_code(errc::unavailable);
    return nullptr;
  }
  // Slots in use include calls that ended while their sends still run.
  if (ops_.size() - free_.size() >= opts_.max_calls) {
    ec = make_error_code(errc::resource_exhausted);
    return nullptr;
  }
  if (free_.empty()) {
    try {
      held_.resize(ops_.size() + 1);  // (first: a retry after a failure finds it done)
      auto op = std::make_unique<call_op>();
      op->owner = this;
      op->index = static_cast<std::uint32_t>(ops_.size());
      free_.reserve(ops_.size() + 1);  // release() never allocates
      ops_.push_back(std::move(op));
      free_.push_back(ops_.back()->index);
    } catch (const std::bad_alloc&) {
      ec = make_error_code(errc::resource_exhausted);
      return nullptr;
    }
  }
  call_op* op = ops_[free_.back()].get();
  free_.pop_back();
  return op;
}

void client_impl::abandon(call_op* op) noexcept { release(*op); }

void client_impl::start(call_op* op, const call_options& o) noexcept {
  ++stats_.calls;
  ++pending_;
  stats_.in_flight = pending_;
  const auto timeout = o.timeout.count() < 0 ? std::chrono::duration_cast<std::chrono::microseconds>(opts_.timeout)
                                             : std::min<std::chrono::microseconds>(o.timeout, kMaxTimeout);
  op->due = timeout.count() > 0 ? clock::now() + timeout : clock::time_point::max();
  op->bulk = o.bulk;
  if (op->bulk.length != 0) op->bulk.pack_into(std::span(op->header).subspan(wire::kHeaderSize));
  op->st = call_op::state::unsent;
  if (deadlines_.insert(*op)) arm_timer();
  if (state_ == state::connecting) {
    op->queue_next = nullptr;
    if (queue_tail_ != nullptr) {
      queue_tail_->queue_next = op;
    } else {
      queue_head_ = op;
    }
    queue_tail_ = op;
    return;
  }
  send_request(*op, true);
}

void client_impl::unqueue(call_op& op) noexcept {
  call_op** link = &queue_head_;
  call_op* prev = nullptr;
  while (*link != nullptr && *link != &op) {
    prev = *link;
    link = &(*link)->queue_next;
  }
  if (*link == nullptr) return;
  *link = op.queue_next;
  if (queue_tail_ == &op) queue_tail_ = prev;
  op.queue_next = nullptr;
}

template <class Buffers>
void client_impl::send(call_op* op, const Buffers& bufs, bool cancellable, bool payload) noexcept {
  ++op->sends;
  if (payload) op->payload_pending = true;
  auto done = asio::bind_executor(ex_, [self = shared_from_this(), op, payload](const error_code& ec, std::size_t) {
    self->on_sent(op, ec, payload);
  });
  if (cancellable) {
    conn_.async_send(bufs, asio::bind_cancellation_slot(op->send_cancel.slot(), std::move(done)));
  } else {
    conn_.async_send(bufs, std::move(done));
  }
}

void client_impl::send_request(call_op& op, bool post) noexcept {
  const std::uint64_t payload = op.request.size();
  if (payload > conn_.peer().max_message) {
    ++stats_.failed;
    complete(op, make_error_code(errc::resource_exhausted), {}, post);
    return;
  }
  const bool bulk = op.bulk.length != 0;
  const std::size_t head = wire::kHeaderSize + (bulk ? op.bulk.packed_length() : 0);
  const bool follows = head + payload > conn_.eager_limit() && payload != 0;
  wire::header h;
  h.type = wire::kind::request;
  h.flags = static_cast<std::uint8_t>((bulk ? wire::kFlagBulk : 0) | (follows ? wire::kFlagPayloadFollows : 0));
  h.aux = budget_us(op.due, clock::now());
  h.call_id = op.id();
  h.method = op.method;
  wire::encode(h, op.header.data());
  op.st = call_op::state::sent;
  ++sent_;
  const asio::const_buffer head_buf(op.header.data(), head);
  if (!follows) {
    // One message: while it waits for credits it can be withdrawn.
    const std::array<asio::const_buffer, 2> bufs{head_buf, op.request};
    send(&op, bufs, true, false);
  } else {
    ++stats_.large_requests;
    send(&op, head_buf, false, false);
    // Only the caller's memory needs waiting for when the call ends early
    // (a typed request is the op's own copy, kept until its sends are done).
    const bool callers_memory = op.request.data() != static_cast<const void*>(op.encoded.data());
    send(&op, op.request, false, callers_memory);
  }
  ensure_receiving();
}

void client_impl::send_cancel(call_op& op) noexcept {
  wire::header h;
  h.type = wire::kind::cancel;
  h.call_id = op.id();
  wire::encode(h, op.cancel_frame.data());
  send(&op, asio::buffer(op.cancel_frame), false, false);
}

void client_impl::on_sent(call_op* op, const error_code& ec, bool payload) noexcept {
  auto keep = shared_from_this();
  --op->sends;
  if (payload) op->payload_pending = false;
  if (ec && ec != std::errc::operation_canceled && state_ == state::open) {
    if (payload && ec == anydoor::errc::message_size) {
      // The server could not take this payload (above its rendezvous
      // memory): it answers the call with resource_exhausted and serves on.
      if (op->st == call_op::state::sent) {
        ++stats_.failed;
        complete(*op, make_error_code(errc::resource_exhausted), {}, false);
      }
    } else {
      // A refused send (no pool buffer in time, a registration failure) or a
      // failing connection: the frames that follow would be misread, so the
      // connection goes and every call with it.
      log().warn("rpc client: a send failed ({}): the connection is aborted", ec.message());
      fail(make_error_code(errc::unavailable), false);
    }
  }
  if (payload && op->deferred) {
    op->deferred = false;
    const std::error_code why = op->deferred_ec;
    reply r = std::exchange(held_[op->index], reply{});
    auto* fin = op->finish;
    if (op->sends == 0) release(*op);
    fin(*op, why, std::move(r), false);
    return;
  }
  if (op->st == call_op::state::done && op->sends == 0 && !op->deferred) release(*op);
}

void client_impl::ensure_receiving() noexcept {
  if (receiving_ || state_ != state::open || (sent_ == 0 && !awaiting_payload_)) return;
  receiving_ = true;
  conn_.async_receive(asio::bind_cancellation_slot(
      recv_cancel_.slot(), asio::bind_executor(ex_, [self = shared_from_this()](const error_code& ec, message m) {
        self->on_message(ec, std::move(m));
      })));
}

void client_impl::protocol_failure(const char* what) noexcept {
  log().warn("rpc client: {}: the connection is aborted", what);
  fail(make_error_code(errc::unavailable), false);
}

void client_impl::on_message(const error_code& ec, message m) noexcept {
  receiving_ = false;
  if (state_ != state::open) return;
  if (ec == std::errc::operation_canceled) {  // withdrawn while idle (became_idle)
    ensure_receiving();
    return;
  }
  if (ec == anydoor::errc::message_size && awaiting_payload_) {
    // A reply payload above this side's rendezvous memory: that call fails,
    // the connection carries on (the server's send failed likewise).
    awaiting_payload_ = false;
    if (call_op* op = find_sent(payload_call_)) {
      ++stats_.failed;
      complete(*op, make_error_code(errc::resource_exhausted), {}, false);
    }
    ensure_receiving();
    return;
  }
  if (ec) {
    log().debug("rpc client: the connection ended: {}", ec.message());
    fail(make_error_code(errc::unavailable), false);
    return;
  }
  if (awaiting_payload_) {
    awaiting_payload_ = false;
    deliver(payload_call_, payload_status_, std::move(m), 0);
    ensure_receiving();
    return;
  }
  wire::header h;
  if (!wire::decode(m.bytes(), h) || h.version != wire::kVersion || h.type != wire::kind::reply || h.reserved != 0 ||
      (h.flags & ~wire::kFlagPayloadFollows) != 0 || h.method != 0) {
    protocol_failure("the server sent a malformed reply");
    return;
  }
  const errc st = h.aux <= static_cast<std::uint32_t>(errc_last) ? static_cast<errc>(h.aux) : errc::unknown;
  if ((h.flags & wire::kFlagPayloadFollows) != 0) {
    if (m.size() != wire::kHeaderSize) {
      protocol_failure("the server sent a reply header with a payload and a payload to follow");
      return;
    }
    awaiting_payload_ = true;
    payload_call_ = h.call_id;
    payload_status_ = st;
  } else {
    deliver(h.call_id, st, std::move(m), wire::kHeaderSize);
  }
  ensure_receiving();
}

call_op* client_impl::find_sent(std::uint64_t call_id) noexcept {
  const auto index = static_cast<std::uint32_t>(call_id & 0xffffffffu);
  if (index >= ops_.size()) return nullptr;
  call_op* op = ops_[index].get();
  if (op->generation != static_cast<std::uint32_t>(call_id >> 32) || op->st != call_op::state::sent) return nullptr;
  return op;
}

void client_impl::deliver(std::uint64_t call_id, errc status, message m, std::size_t offset) noexcept {
  call_op* op = find_sent(call_id);
  if (op == nullptr) {
    ++stats_.late_replies;
    return;  // the message goes back now
  }
  if (status == errc::ok) {
    ++stats_.ok;
  } else {
    ++stats_.failed;
  }
  complete(*op, status == errc::ok ? std::error_code() : make_error_code(status), reply(std::move(m), offset, status),
           false);
}

void client_impl::complete(call_op& op, std::error_code ec, reply&& r, bool post, bool early) noexcept {
  deadlines_.remove(op);
  if (op.st == call_op::state::sent) --sent_;
  op.st = call_op::state::done;
  --pending_;
  stats_.in_flight = pending_;
  if (early) op.send_cancel.emit(asio::cancellation_type::terminal);  // a one-message request still queued never goes
  if (op.payload_pending) {
    // The peer may still read the payload from the caller's memory (its
    // registration stands until the send ends): the call completes when
    // that send does (on_sent). So it does when the reply came first: a
    // server that answers before reading the request all through must not
    // read what the caller puts in that memory next.
    op.deferred = true;
    op.deferred_ec = ec;
    held_[op.index] = std::move(r);
    if (pending_ == 0) became_idle();
    return;
  }
  auto* fin = op.finish;
  if (op.sends == 0) release(op);  // the handler is still in op until fin moves it out
  fin(op, ec, std::move(r), post);
  if (pending_ == 0) became_idle();
}

void client_impl::release(call_op& op) noexcept {
  op.st = call_op::state::free;
  ++op.generation;
  op.due = clock::time_point::max();
  op.request = {};
  op.bulk = {};
  if (op.encoded.capacity() > kRetainedEncoding) std::vector<std::byte>().swap(op.encoded);
  free_.push_back(op.index);
}

void client_impl::cancel(call_op* op) noexcept {
  auto keep = shared_from_this();
  if (op->st == call_op::state::unsent) {
    unqueue(*op);
  } else if (op->st == call_op::state::sent) {
    if (state_ == state::open) send_cancel(*op);
  } else {
    return;
  }
  ++stats_.cancelled;
  complete(*op, std::make_error_code(std::errc::operation_canceled), {}, true, true);
}

void client_impl::arm_timer() noexcept {
  const deadline_hook* first = deadlines_.first();
  if (first == nullptr || first->due >= timer_at_ || state_ == state::failed) return;
  timer_at_ = first->due;
  const std::uint64_t seq = ++timer_seq_;
  timer_.expires_at(timer_at_);
  timer_.async_wait(
      asio::bind_executor(ex_, [self = shared_from_this(), seq](const error_code&) { self->on_timer(seq); }));
}

void client_impl::on_timer(std::uint64_t seq) noexcept {
  if (seq != timer_seq_) return;
  timer_at_ = clock::time_point::max();
  const auto now = clock::now();
  while (deadlines_.first() != nullptr && deadlines_.first()->due <= now) {
    call_op& op = static_cast<call_op&>(*deadlines_.first());
    if (op.st == call_op::state::unsent) unqueue(op);
    ++stats_.deadline_exceeded;
    complete(op, make_error_code(errc::deadline_exceeded), {}, false, true);
  }
  arm_timer();
}

// No call is pending: a timer still armed for an old deadline, or a receive
// still waiting for a reply that will never come, would keep the io_context
// running, so they go, unless a call comes first (a client making one call
// at a time starts the next before this runs).
void client_impl::became_idle() noexcept {
  if ((timer_at_ == clock::time_point::max() && !receiving_) || idle_check_posted_) return;
  idle_check_posted_ = true;
  asio::post(ex_, [self = shared_from_this()] {
    self->idle_check_posted_ = false;
    if (self->pending_ != 0) return;
    if (self->timer_at_ != clock::time_point::max()) {
      self->timer_.cancel();
      self->timer_at_ = clock::time_point::max();
      ++self->timer_seq_;
    }
    if (self->receiving_ && !self->awaiting_payload_) self->recv_cancel_.emit(asio::cancellation_type::terminal);
  });
}

// ---------------------------------------------------------------- entry points of the templates

call_op* acquire_call(client_impl& c, std::error_code& ec) noexcept { return c.acquire(ec); }
void start_call(client_impl& c, call_op* op, const call_options& o) noexcept { c.start(op, o); }
void abandon_call(client_impl& c, call_op* op) noexcept { c.abandon(op); }
void cancel_call(void* op, asio::cancellation_type) {
  auto* o = static_cast<call_op*>(op);
  o->owner->cancel(o);
}

}  // namespace detail

// ---------------------------------------------------------------- rpc::client

client::client() noexcept = default;

client::client(anydoor::connection conn, client_options options) {
  if (!conn) throw std::system_error(make_error_code(anydoor::errc::invalid_argument), "rpc::client: no connection");
  if (options.max_calls < 1 || options.max_calls > (1u << 24) || options.timeout.count() < 0 ||
      options.timeout > detail::kMaxTimeout) {
    throw std::system_error(make_error_code(anydoor::errc::invalid_argument),
                            "rpc::client: max_calls must be 1..2^24 and timeout 0..1 h");
  }
  impl_ = std::make_shared<detail::client_impl>(conn.get_executor(), options);
  impl_->attach(std::move(conn));
}

client::client(client&&) noexcept = default;

client& client::operator=(client&& other) noexcept {
  if (this != &other) {
    if (impl_) impl_->shutdown();
    impl_ = std::move(other.impl_);
  }
  return *this;
}

client::~client() {
  if (impl_) impl_->shutdown();
}

bool client::is_open() const noexcept {
  return impl_ && impl_->current_state() == detail::client_impl::state::open && impl_->conn().is_open();
}

anydoor::connection& client::connection() {
  if (!impl_) throw std::system_error(make_error_code(anydoor::errc::not_connected), "rpc::client: empty");
  return impl_->conn();
}

client_stats client::stats() const noexcept { return impl_ ? impl_->stats() : client_stats{}; }

void client::abort() noexcept {
  if (impl_) impl_->fail(make_error_code(errc::unavailable), true);
}

asio::io_context::executor_type client::get_executor() const { return call_executor(); }

asio::io_context::executor_type client::call_executor() const {
  if (!impl_) throw std::system_error(make_error_code(anydoor::errc::not_connected), "rpc::client: empty");
  return impl_->executor();
}

}  // namespace anydoor::rpc
