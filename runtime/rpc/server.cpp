// The RPC server engine: sessions (one per connection), their receive loop
// under the concurrency limit, handler dispatch, deadlines and replies, and
// the accept loops (see include/anydoor/rpc/server.hpp for the contract).
#include "server_impl.hpp"

#include "log.hpp"

#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/co_spawn.hpp>

#include <algorithm>
#include <cassert>
#include <cstdio>
#include <limits>
#include <optional>
#include <variant>

namespace anydoor::rpc {
namespace detail {

namespace {
void complete_done(::anydoor::detail::pending_handler*& done, std::error_code why, bool post) {
  if (done == nullptr) return;
  ::anydoor::detail::pending_handler* h = done;
  done = nullptr;
  h->complete(post, why);
  delete h;
}
}  // namespace

// ---------------------------------------------------------------- session

session::session(std::shared_ptr<server_state> st, connection c, ::anydoor::detail::pending_handler* done)
    : st_(std::move(st)), conn_(std::move(c)), ex_(conn_.get_executor()), done_(done), timer_(ex_), drain_timer_(ex_) {
  st_->sessions.push_back(this);
  ++st_->stats.connections;
  ++st_->stats.connections_served;
}

session::~session() {
  auto& v = st_->sessions;
  v.erase(std::remove(v.begin(), v.end(), this), v.end());
  --st_->stats.connections;
  complete_done(done_, std::make_error_code(std::errc::operation_canceled), true);
}

void session::ensure_receiving() noexcept {
  if (receiving_ || ended_ || (draining_ && awaiting_payload_ == nullptr)) return;
  if (active_ >= st_->opts.max_concurrent_calls && awaiting_payload_ == nullptr) return;
  receiving_ = true;
  conn_.async_receive(asio::bind_executor(ex_, [self = shared_from_this()](const error_code& ec, message m) {
    self->on_message(ec, std::move(m));
  }));
}

void session::on_message(const error_code& ec, message m) noexcept {
  receiving_ = false;
  if (ended_ || closing_) return;  // closing: what still arrives is dropped
  if (ec == anydoor::errc::message_size && awaiting_payload_ != nullptr) {
    // The payload was larger than this side's rendezvous memory: that call
    // fails, the connection serves on.
    call_slot& s = *awaiting_payload_;
    awaiting_payload_ = nullptr;
    s.request_msg = message();
    if (s.pre.is_ok()) s.pre = status(errc::resource_exhausted, "the request is larger than the server takes");
    dispatch(s);
    ensure_receiving();
    return;
  }
  if (ec) {
    log().debug("rpc server: a connection ended: {}", ec.message());
    end(ec, false);
    return;
  }
  if (awaiting_payload_ != nullptr) {
    call_slot& s = *awaiting_payload_;
    awaiting_payload_ = nullptr;
    s.request_msg = message();  // the header's buffer (and credit) goes back: one held per call
    s.payload_msg = std::move(m);
    s.request_ = s.payload_msg.bytes();
    dispatch(s);
    ensure_receiving();
    return;
  }
  wire::header h;
  if (!wire::decode(m.bytes(), h) || h.version != wire::kVersion ||
      (h.type != wire::kind::request && h.type != wire::kind::cancel)) {
    ++st_->stats.protocol_errors;
    log().warn("rpc server: a client sent a frame that is not an rpc request ({} bytes): its connection is closed",
               m.size());
    end(make_error_code(anydoor::errc::protocol_error), false);
    return;
  }
  if (h.type == wire::kind::cancel) {
    on_cancel(h.call_id);
  } else {
    on_request(h, std::move(m));
  }
  ensure_receiving();
}

call_slot& session::take_slot() {
  if (free_.empty()) {
    auto s = std::make_unique<call_slot>();
    s->owner = this;
    s->index = static_cast<std::uint32_t>(slots_.size());
    s->conn_ = &conn_;
    free_.reserve(slots_.size() + 1);
    slots_.push_back(std::move(s));
    free_.push_back(slots_.back()->index);
  }
  call_slot& s = *slots_[free_.back()];
  free_.pop_back();
  // (free_slot never lists a slot still busy or whose spawn has not
  // completed: its cancellation signal would be replaced under it.)
  assert(!s.busy && !s.spawned);
  s.busy = true;
  if (++active_ == st_->opts.max_concurrent_calls) ++st_->stats.throttled;
  return s;
}

void session::on_request(const wire::header& h, message m) noexcept {
  call_slot* sp = nullptr;
  try {
    sp = &take_slot();
  } catch (const std::bad_alloc&) {
    log().error("rpc server: no memory for a call slot: the connection is closed");
    end(make_error_code(anydoor::errc::peer_out_of_memory), false);
    return;
  }
  call_slot& s = *sp;
  ++st_->stats.calls;
  s.call_id_ = h.call_id;
  s.method_ = h.method;
  s.deadline_ = h.aux != 0 ? clock::now() + std::chrono::microseconds(h.aux) : clock::time_point::max();
  std::size_t off = wire::kHeaderSize;
  if (h.reserved != 0 || (h.flags & ~wire::kKnownFlags) != 0) {
    s.pre = status(errc::invalid_argument, "malformed request: unknown flags or reserved bits set");
  } else if ((h.flags & wire::kFlagBulk) != 0) {
    const std::size_t len = m.size() < off ? 0 : remote_region::packed_length_of(m.bytes().subspan(off));
    if (len == 0 || m.size() < off + len) {
      s.pre = status(errc::invalid_argument, "malformed request: the bulk region is missing");
    } else if (auto ec = remote_region::unpack(m.bytes().subspan(off, len), s.bulk_)) {
      s.pre = status(errc::invalid_argument, "malformed request: the bulk region does not decode");
    }
    off += std::max(len, remote_region::packed_size);
  }
  off = std::min(off, m.size());
  if ((h.flags & wire::kFlagPayloadFollows) != 0) {
    if (m.size() != off && s.pre.is_ok()) {
      s.pre = status(errc::invalid_argument, "malformed request: a payload both inline and to follow");
    }
    s.request_msg = std::move(m);
    awaiting_payload_ = &s;  // the next message is the payload
    return;
  }
  s.request_msg = std::move(m);
  s.request_ = s.request_msg.bytes().subspan(off);
  dispatch(s);
}

void session::on_cancel(std::uint64_t call_id) noexcept {
  for (auto& sp : slots_) {
    call_slot& s = *sp;
    // (Not one answered already whose spawn has yet to complete.)
    if (!s.busy || s.call_id_ != call_id || s.client_cancelled || s.sends != 0 || (s.spawned && !s.running)) continue;
    s.client_cancelled = true;
    ++st_->stats.cancelled;
    cancel_running(s);
    return;
  }
}

void session::cancel_running(call_slot& s) noexcept {
  s.cancelled_ = true;
  if (s.running) s.signal.emit(asio::cancellation_type::terminal);
}

void session::dispatch(call_slot& s) noexcept {
  if (!s.pre.is_ok()) {
    if (s.pre.code() == errc::invalid_argument) ++st_->stats.malformed;
    status st = std::move(s.pre);
    s.pre = status();
    finish(s, std::move(st));
    return;
  }
  auto it = st_->methods.find(s.method_);
  if (it == st_->methods.end()) {
    ++st_->stats.unimplemented;
    char text[64];
    std::snprintf(text, sizeof text, "no method 0x%016llx", static_cast<unsigned long long>(s.method_));
    finish(s, status(errc::unimplemented, text));
    return;
  }
  s.due = s.deadline_;
  if (deadlines_.insert(s)) arm_timer();
  const handler_entry& e = it->second;
  // The handler answers now (sync, or an outcome holding its status), or
  // gives the coroutine that will (every throw, whatever it throws, takes
  // one path: internal).
  std::optional<asio::awaitable<status>> body;
  {
    status st;
    try {
      if (e.sync) {
        st = e.sync(s);
      } else if (e.maybe) {
        outcome o = e.maybe(s);
        if (auto* later = std::get_if<asio::awaitable<status>>(&o)) {
          body.emplace(std::move(*later));
        } else {
          st = std::move(std::get<status>(o));
        }
      } else {
        body.emplace(e.coro(s));
      }
    } catch (const std::exception& ex) {
      ++st_->stats.exceptions;
      st = status(errc::internal, ex.what());
    } catch (...) {
      ++st_->stats.exceptions;
      st = status(errc::internal, "the handler threw something that is not a std::exception");
    }
    if (!body) {
      finish(s, std::move(st));
      return;
    }
  }
  s.running = true;
  s.spawned = true;
  try {
    // The call ends inside the coroutine (run_call), not in co_spawn's
    // completion handler: Asio posts that one when the coroutine ends
    // without having suspended (a handler that had nothing to wait for),
    // which sent the reply a turn late, after the provider had sent its
    // acknowledgement of the request on its own (two messages per call,
    // and the io_context turns between them). The slot stays taken until
    // co_spawn has completed (call_slot::spawned).
    asio::co_spawn(ex_, run_call(shared_from_this(), s, std::move(*body)),
                   asio::bind_cancellation_slot(s.signal.slot(), [self = shared_from_this(), &s](std::exception_ptr) {
                     s.spawned = false;
                     self->free_slot(s);  // (once its reply is sent)
                   }));
  } catch (...) {  // the spawn could not be made (no memory)
    s.running = false;
    s.spawned = false;
    ++st_->stats.exceptions;
    finish(s, status(errc::internal, "the handler's coroutine could not be started"));
  }
}

asio::awaitable<void> session::run_call(std::shared_ptr<session> self, call_slot& s, asio::awaitable<status> body) {
  status st;
  std::exception_ptr ep;
  try {
    st = co_await std::move(body);
  } catch (...) {
    ep = std::current_exception();
  }
  self->on_handler_done(s, ep, std::move(st));
}

void session::on_handler_done(call_slot& s, std::exception_ptr e, status st) noexcept {
  s.running = false;
  if (e) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      if (!s.cancelled_) ++st_->stats.exceptions;
      st = status(errc::internal, ex.what());
    } catch (...) {
      if (!s.cancelled_) ++st_->stats.exceptions;
      st = status(errc::internal, "the handler threw something that is not a std::exception");
    }
  }
  finish(s, std::move(st));
}

void session::finish(call_slot& s, status st) noexcept {
  deadlines_.remove(s);
  s.request_ = {};
  s.request_msg = message();  // the receive buffers (credits) go back now
  s.payload_msg = message();
  if (ended_) {
    free_slot(s);
    return;
  }
  if (s.expired) {
    st = status(errc::deadline_exceeded, "the deadline passed while the handler ran");
  } else if (s.client_cancelled) {
    st = status(errc::cancelled, "the client cancelled the call");
  }
  send_reply(s, st);
}

template <class Buffers>
void session::send(call_slot& s, const Buffers& bufs, bool payload) noexcept {
  ++s.sends;
  conn_.async_send(bufs, asio::bind_executor(ex_, [self = shared_from_this(), &s, payload](const error_code& ec,
                                                                                         std::size_t) {
                     self->on_sent(s, ec, payload);
                   }));
}

void session::send_reply(call_slot& s, const status& st) noexcept {
  std::span<const std::byte> payload;
  std::uint32_t code = static_cast<std::uint32_t>(st.code());
  if (st.is_ok()) {
    payload = s.reply_;
    if (payload.size() > conn_.peer().max_message) {
      code = static_cast<std::uint32_t>(errc::resource_exhausted);
      s.status_text = "the reply is larger than the client's max_message";
      payload = std::as_bytes(std::span(s.status_text));
    }
  }
  if (!st.is_ok()) {
    const std::string& text = st.message();
    s.status_text.assign(text, 0, std::min(text.size(), wire::kMaxStatusMessage));
    payload = std::as_bytes(std::span(s.status_text));
  }
  if (code == static_cast<std::uint32_t>(errc::ok)) {
    ++st_->stats.ok;
  } else {
    ++st_->stats.errors;
  }
  const bool follows = !payload.empty() && wire::kHeaderSize + payload.size() > conn_.eager_limit();
  wire::header h;
  h.type = wire::kind::reply;
  h.flags = follows ? wire::kFlagPayloadFollows : 0;
  h.aux = code;
  h.call_id = s.call_id_;
  wire::encode(h, s.reply_header.data());
  if (follows) {
    send(s, asio::buffer(s.reply_header));
    send(s, asio::buffer(payload.data(), payload.size()), true);
  } else {
    const std::array<asio::const_buffer, 2> bufs{asio::buffer(s.reply_header),
                                                 asio::buffer(payload.data(), payload.size())};
    send(s, bufs);
  }
}

void session::on_sent(call_slot& s, const error_code& ec, bool payload) noexcept {
  --s.sends;
  if (payload && ec == anydoor::errc::message_size) {
    // The client could not take this reply (above its rendezvous memory):
    // that call fails there with resource_exhausted; the connection serves on.
    log().debug("rpc server: a {}-byte reply was refused by the client", s.reply_.size());
  } else if (ec && !ended_) {
    log().warn("rpc server: sending a reply failed ({}): the connection is closed", ec.message());
    end(ec, false);
  }
  if (s.sends == 0 && !s.running) free_slot(s);
}

void session::free_slot(call_slot& s) noexcept {
  if (!s.busy || s.sends != 0 || s.running || s.spawned) return;
  s.busy = false;
  s.expired = s.client_cancelled = s.cancelled_ = false;
  s.pre = status();
  s.bulk_ = {};
  s.deadline_ = clock::time_point::max();
  if (s.reply_.capacity() > st_->opts.retained_reply_bytes) {
    std::vector<std::byte>().swap(s.reply_);
  } else {
    s.reply_.clear();
  }
  free_.push_back(s.index);
  --active_;
  ensure_receiving();
  maybe_close();
}

void session::drain(std::chrono::milliseconds grace) noexcept {
  if (ended_ || draining_) return;
  draining_ = true;
  drain_timer_.expires_after(grace);
  drain_timer_.async_wait(asio::bind_executor(ex_, [self = shared_from_this()](const error_code& ec) {
    if (ec || self->ended_) return;
    log().warn("rpc server: a connection was still busy when the shutdown grace ran out: aborted");
    self->end(std::make_error_code(std::errc::timed_out), false);
  }));
  maybe_close();
}

void session::maybe_close() noexcept {
  // A request whose payload is still to come holds its slot (active_).
  if (!draining_ || closing_ || ended_ || active_ != 0) return;
  closing_ = true;
  conn_.async_close(asio::bind_executor(ex_, [self = shared_from_this()](const error_code& ec) {
    if (ec) log().debug("rpc server: closing a connection at shutdown: {}", ec.message());
    self->drain_timer_.cancel();
    self->end(std::error_code(), false);
  }));
}

void session::end(std::error_code why, bool post) noexcept {
  if (ended_) return;
  ended_ = true;
  auto keep = shared_from_this();
  conn_.abort();
  timer_.cancel();
  drain_timer_.cancel();
  timer_at_ = clock::time_point::max();
  ++timer_seq_;
  if (awaiting_payload_ != nullptr) {
    call_slot& s = *awaiting_payload_;
    awaiting_payload_ = nullptr;
    s.request_msg = message();
    free_slot(s);
  }
  for (auto& sp : slots_) {
    if (sp->busy) cancel_running(*sp);
  }
  complete_done(done_, why, post);
}

void session::arm_timer() noexcept {
  const deadline_hook* first = deadlines_.first();
  if (first == nullptr || first->due >= timer_at_ || ended_) return;
  timer_at_ = first->due;
  const std::uint64_t seq = ++timer_seq_;
  timer_.expires_at(timer_at_);
  timer_.async_wait(
      asio::bind_executor(ex_, [self = shared_from_this(), seq](const error_code&) { self->on_timer(seq); }));
}

void session::on_timer(std::uint64_t seq) noexcept {
  if (seq != timer_seq_) return;
  timer_at_ = clock::time_point::max();
  const auto now = clock::now();
  while (deadlines_.first() != nullptr && deadlines_.first()->due <= now) {
    call_slot& s = static_cast<call_slot&>(*deadlines_.first());
    deadlines_.remove(s);
    s.expired = true;
    ++st_->stats.deadline_exceeded;
    cancel_running(s);
  }
  arm_timer();
}

// ---------------------------------------------------------------- accept loop

accept_loop::accept_loop(std::shared_ptr<server_state> st, acceptor a, ::anydoor::detail::pending_handler* done)
    : st_(std::move(st)), acc_(std::move(a)), ex_(acc_.get_executor()), done_(done) {
  st_->acceptors.push_back(this);
}

accept_loop::~accept_loop() {
  auto& v = st_->acceptors;
  v.erase(std::remove(v.begin(), v.end(), this), v.end());
  complete_done(done_, std::make_error_code(std::errc::operation_canceled), true);
}

void accept_loop::next() noexcept {
  acc_.async_accept(asio::bind_executor(ex_, [self = shared_from_this()](const error_code& ec, connection c) {
    self->on_accept(ec, std::move(c));
  }));
}

void accept_loop::on_accept(const error_code& ec, connection c) noexcept {
  if (ec || st_->stopped) {
    acc_.close();
    complete_done(done_, ec ? std::error_code(ec) : std::make_error_code(std::errc::operation_canceled), false);
    return;
  }
  serve_connection(st_, std::move(c), nullptr);
  next();
}

void serve_connection(const std::shared_ptr<server_state>& st, connection c,
                      ::anydoor::detail::pending_handler* done) {
  if (st->stopped || !c) {
    c.abort();
    complete_done(done, std::make_error_code(std::errc::operation_canceled), true);
    return;
  }
  auto s = std::make_shared<session>(st, std::move(c), done);
  s->start();
}

void serve_acceptor(const std::shared_ptr<server_state>& st, acceptor a, ::anydoor::detail::pending_handler* done) {
  if (st->stopped) {
    a.close();
    complete_done(done, std::make_error_code(std::errc::operation_canceled), true);
    return;
  }
  auto l = std::make_shared<accept_loop>(st, std::move(a), done);
  l->next();
}

}  // namespace detail

// ---------------------------------------------------------------- rpc::server

server::server(server_options options) : state_(std::make_shared<detail::server_state>()) {
  if (options.max_concurrent_calls < 1 || options.max_concurrent_calls > 65536) {
    throw std::system_error(make_error_code(anydoor::errc::invalid_argument),
                            "rpc::server: max_concurrent_calls must be 1..65536");
  }
  state_->opts = options;
}

server::~server() { stop(); }

void server::add_entry(std::uint64_t id, std::string_view name, detail::sync_fn s, detail::coro_fn c,
                       detail::maybe_fn m) {
  auto it = state_->methods.find(id);
  if (it != state_->methods.end()) {
    std::string what = "rpc::server::add: method id " + std::to_string(id);
    if (!name.empty() && !it->second.name.empty() && it->second.name != name) {
      what += ": '" + std::string(name) + "' collides with '" + it->second.name + "' (the same hash)";
    } else {
      what += " is already registered";
      if (!name.empty()) what += " ('" + std::string(name) + "')";
    }
    throw std::system_error(make_error_code(errc::already_exists), what);
  }
  state_->methods.emplace(id, detail::handler_entry{std::string(name), std::move(s), std::move(c), std::move(m)});
}

namespace {
// Marks the server stopped, closes its acceptors and returns its sessions
// (copies: ending a session or a loop removes it from the lists).
std::vector<std::shared_ptr<detail::session>> stop_listening(detail::server_state& st) {
  st.stopped = true;
  const std::vector<detail::accept_loop*> loops = st.acceptors;
  for (auto* l : loops) l->close();
  std::vector<std::shared_ptr<detail::session>> sessions;
  for (auto* s : st.sessions) {
    if (auto p = s->weak_from_this().lock()) sessions.push_back(std::move(p));
  }
  return sessions;
}
}  // namespace

void server::stop() noexcept {
  if (!state_) return;
  for (auto& s : stop_listening(*state_)) s->end(std::make_error_code(std::errc::operation_canceled), true);
}

void server::shutdown(std::chrono::milliseconds grace) noexcept {
  if (!state_) return;
  for (auto& s : stop_listening(*state_)) s->drain(grace);
}

server_stats server::stats() const noexcept { return state_->stats; }
const server_options& server::options() const noexcept { return state_->opts; }

}  // namespace anydoor::rpc
