#include "service.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <anydoor/error.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <system_error>

namespace anydoor::apps::kv {

std::string oom_message(const store& st, std::size_t key, std::size_t value) {
  return "OOM command not allowed when used memory > 'maxmemory' (" + std::to_string(st.charged_bytes()) +
         " of " + std::to_string(st.options().max_memory) + " bytes in use; this item needs about " +
         std::to_string(kItemHeader + key + value) + ")";
}

service::service(store& st, durable_log* log) : st_(st), log_(log) {
  // (A token, not a reset in the destructor: the server may free the log
  // before the service.)
  if (log_ != nullptr) log_->on_failure([this, alive = std::weak_ptr<int>(alive_)] {
    if (!alive.expired()) take_back();
  });
}

bool service::restore(const undo_journal::before& b) noexcept {
  bool ok = true;
  try {
    switch (b.what) {
      case prior::kind::absent:
        st_.del(b.key);
        break;
      case prior::kind::inline_value:
        ok = st_.put(b.key, b.value, /*replay=*/true) == put_status::ok;
        break;
      case prior::kind::item:
        // (a copy of the kept item; the arena's slack covers the moment both exist)
        ok = st_.put(b.key, st_.item_value(b.item), /*replay=*/true) == put_status::ok;
        break;
    }
  } catch (const std::exception&) {
    ok = false;  // (memory for the overflow table)
  }
  if (b.what == prior::kind::item) st_.release(b.item);
  if (!ok) ++stats_.restore_failures;
  return ok;
}

void service::undo_last() noexcept {
  bool ok = true;
  journal_.take_back_last([&](const undo_journal::before& b) { ok = restore(b); });
  if (!ok) tell_unrestored("the log refused");
}

void service::tell_unrestored(const char* what) noexcept {
  std::fprintf(stderr,
               "anydoor-kv: a write %s could not be taken back (no room for the old value): its key shows it until a "
               "restart\n",
               what);
}

void service::take_back() noexcept {
  const std::uint64_t failures = stats_.restore_failures;
  const std::size_t n = journal_.take_back(
      log_->held(), [this](const undo_journal::before& b) { restore(b); },
      [this](std::uint64_t item) { st_.release(item); });
  stats_.taken_back += n;
  if (n == 0) return;
  const std::uint64_t lost = stats_.restore_failures - failures;
  std::fprintf(stderr,
               "anydoor-kv: %zu write%s the log did not take %s taken back: the store holds what the log holds%s\n", n,
               n == 1 ? "" : "s", n == 1 ? "was" : "were",
               lost == 0 ? "" : " (but the old values of some keys found no room: those keys show the failed writes until a restart)");
}

void service::forget_durable() noexcept {
  const std::uint64_t durable = log_->durable_lsn();
  if (durable == forgot_until_) return;  // (a write's lsn is above what was durable when it was noted)
  forgot_until_ = durable;
  journal_.forget_until(durable, [this](std::uint64_t item) { st_.release(item); });
}

rpc::status service::log_write(record_type t, std::string_view key, std::span<const std::byte> value,
                               const prior& was, std::uint64_t& lsn) {
  try {
    journal_.note(key, was);
  } catch (const std::exception&) {
    // (no room to journal it: the write is not made)
    if (!restore({key, was.what, was.item, was.value()})) tell_unrestored("that could not be journaled");
    throw;
  }
  const std::uint64_t before = log_->appended();
  try {
    lsn = log_->append(t, key, value);
  } catch (const std::exception&) {
    if (log_->appended() != before) {
      journal_.set_lsn(log_->appended());  // its record is in the log's buffer: the write stands
    } else {
      undo_last();
    }
    throw;
  }
  if (lsn == 0) {
    undo_last();
    return refused();
  }
  journal_.set_lsn(lsn);
  maybe_compact();
  return {};
}

rpc::status service::refused() const {
  std::string why = log_->error_text();
  return {rpc::errc::unavailable, why.empty() ? "the log is closed" : std::move(why)};
}

rpc::status service::check(std::string_view key, std::size_t value_size) const {
  if (key.empty()) return {rpc::errc::invalid_argument, "empty key"};
  if (key.size() > st_.options().max_key) {
    return {rpc::errc::invalid_argument, "key of " + std::to_string(key.size()) + " bytes is above the limit of " +
                                             std::to_string(st_.options().max_key) + " (--max-key)"};
  }
  if (value_size > st_.options().max_value) {
    return {rpc::errc::invalid_argument, "value of " + std::to_string(value_size) +
                                             " bytes is above the limit of " +
                                             std::to_string(st_.options().max_value) + " (--max-value)"};
  }
  if (log_ != nullptr && log_->error()) return {rpc::errc::unavailable, log_->error_text()};
  return {};
}

void service::maybe_compact() {
  if (log_ == nullptr) return;
  // The snapshot in steps of about kSnapshotStep bytes (requests run in
  // between): the slot table bucket by bucket, then the overflow table in
  // key order, each of the keys written before the snapshot began.
  const store_stats s = st_.stats();
  if (!log_->compaction_due(s.live_bytes + s.keys * kRecordHeader)) return;  // (the usual case: no step made)
  log_->maybe_compact(s.live_bytes + s.keys * kRecordHeader,
                      [this, salt = log_->salt(), before = st_.next_version(), next = std::uint64_t{0},
                       after = std::string()](snapshot_buffer& out) mutable {
                        auto put = [&](std::string_view k, std::span<const std::byte> v) {
                          const std::size_t before_record = out.size();
                          encode_record(out, record_type::put, k, v, salt);
                          return out.size() - before_record;  // what the record took
                        };
                        std::size_t budget = kSnapshotStep;
                        if (next < st_.slot_buckets()) {
                          next = st_.for_each_from(next, budget, before, put);
                          if (next < st_.slot_buckets()) return false;
                        }
                        return st_.for_each_overflow_from(after, budget, before, put);  // (with what is left)
                      });
}

rpc::status service::put(std::string_view key, std::span<const std::byte> value, std::uint64_t& lsn) {
  lsn = 0;
  if (auto bad = off_home()) return *bad;
  ++stats_.puts;
  if (auto st = check(key, value.size()); !st.is_ok()) {
    ++stats_.errors;
    return st;
  }
  prior was;
  if (log_ != nullptr) forget_durable();  // (the old items it kept are free again)
  put_status r = st_.put(key, value, false, log_ != nullptr ? &was : nullptr);
  if (r == put_status::out_of_memory && log_ != nullptr && journal_.kept_items() != 0) {
    // The old items of writes on their way to the log take the room: they
    // move to the journal, and --max-memory bounds the live data alone.
    // As few as the put needs. First the oldest whose block can take the
    // put's item: the arena gives it that block at once. Where the memory
    // limit still says no, a free block waiting (only after a restart
    // placed items in the arena's slack), oldest first in rounds, values
    // of the put's size and then twice as much as the round before each
    // time it still finds no room. Where no block, kept (merged with the
    // free blocks beside it) or free, is large enough, none moves, and the
    // put fails for memory as it would have (kept items side by side would
    // merge once all were released: not tried, the heap would hold their
    // copies for a put that may still not fit).
    const std::size_t c = st_.item_class(key.size(), value.size());
    auto value_of = [this](std::uint64_t item) { return st_.item_value(item); };
    auto release = [this](std::uint64_t item) {
      ++stats_.spilled;
      stats_.spilled_bytes += st_.item_value(item).size();
      st_.release(item);
    };
    std::uint64_t tried_at = stats_.spilled;  // what had moved at the last try of the put
    try {
      // (A scan that found no kept block of class c or more is not made
      // again for that class or a larger one until an item is kept anew.)
      if (c < no_fit_class_ || journal_.items_noted() != no_fit_noted_) {
        journal_.spill_if(value_of, release, 0, [&](std::uint64_t item) { return st_.block_fits(item, c); });
        if (stats_.spilled != tried_at) {
          tried_at = stats_.spilled;
          r = st_.put(key, value, false, &was);
        } else {
          no_fit_class_ = c;
          no_fit_noted_ = journal_.items_noted();
        }
      }
      std::size_t want = std::max<std::size_t>(key.size() + value.size(), 1);
      while (r == put_status::out_of_memory && journal_.kept_items() != 0 && st_.free_block_for(c)) {
        const std::size_t moved = journal_.spill(value_of, release, want);
        tried_at = stats_.spilled;
        r = st_.put(key, value, false, &was);
        want = std::max(want, moved) * 2;
      }
    } catch (const std::bad_alloc&) {
      // No heap for the next copy: those moved stay so, and the put tries
      // the room they made.
      if (stats_.spilled != tried_at) r = st_.put(key, value, false, &was);
    }
  }
  if (r == put_status::too_large) return {rpc::errc::invalid_argument, "key or value above the limits"};  // (check() said no)
  if (r == put_status::out_of_memory) {
    ++stats_.errors;
    ++stats_.oom;
    return {rpc::errc::resource_exhausted, oom_message(st_, key.size(), value.size())};
  }
  if (log_ == nullptr) return {};
  return log_write(record_type::put, key, value, was, lsn);
}

rpc::status service::del(std::string_view key, bool& existed, std::uint64_t& lsn) {
  lsn = 0;
  existed = false;
  if (auto bad = off_home()) return *bad;
  ++stats_.dels;
  if (auto st = check(key, 0); !st.is_ok()) {
    ++stats_.errors;
    return st;
  }
  if (log_ == nullptr) {
    existed = st_.del(key);
    return {};
  }
  forget_durable();
  prior was;
  existed = st_.del(key, &was);
  if (!existed) return {};
  rpc::status st = log_write(record_type::del, key, {}, was, lsn);
  if (!st.is_ok()) existed = false;  // (taken back)
  return st;
}

std::optional<std::span<const std::byte>> service::get(std::string_view key) {
  ++stats_.gets;
  auto v = st_.get(key);
  if (v) ++stats_.get_hits;
  return v;
}

asio::awaitable<rpc::status> service::durable(std::uint64_t lsn) {
  if (!must_wait(lsn)) co_return rpc::status();
  auto [ec] = co_await log_->async_wait(lsn, asio::as_tuple(asio::use_awaitable));
  if (ec) co_return rpc::status(rpc::errc::unavailable, log_->error_text());
  co_return rpc::status();
}

layout service::layout_for(const memory_region& table) const {
  layout l = st_.describe();
  // The layout carries one key: a table the device registered in pieces
  // (larger than its max_mr_size) cannot be read through it.
  if (table.remote().pack_into(std::as_writable_bytes(std::span(l.region))) == 0) {
    throw std::system_error(make_error_code(anydoor::errc::not_supported),
                            "kv: the table (" + std::to_string(table.size()) + " bytes) is registered in " +
                                std::to_string(table.pieces()) +
                                " pieces, and the layout names one: give the store less memory");
  }
  return l;
}

std::optional<rpc::status> service::off_home() {
  if (!home_ || home_->running_in_this_thread()) return std::nullopt;
  return rpc::status(rpc::errc::internal, "the store was reached off its home thread");
}

rpc::status service::get_request(std::span<const std::byte> req, std::optional<std::span<const std::byte>>& value) {
  if (auto bad = off_home()) return *bad;
  const std::string_view key(reinterpret_cast<const char*>(req.data()), req.size());
  if (key.empty() || key.size() > st_.options().max_key) return check(key, 0);  // the key's error
  value = get(key);
  if (!value) return {rpc::errc::not_found, "not found"};
  return {};
}

asio::awaitable<rpc::status> service::put_request(std::span<const std::byte> req) {
  std::uint32_t klen = 0;
  if (req.size() < 4) co_return rpc::status(rpc::errc::invalid_argument, "malformed put: shorter than 4 bytes");
  std::memcpy(&klen, req.data(), 4);
  if (klen > req.size() - 4) co_return rpc::status(rpc::errc::invalid_argument, "malformed put: key length past the end");
  const std::string_view key(reinterpret_cast<const char*>(req.data() + 4), klen);
  std::uint64_t lsn = 0;
  rpc::status st = put(key, req.subspan(4 + klen), lsn);
  if (!st.is_ok()) co_return st;
  co_return co_await durable(lsn);
}

asio::awaitable<rpc::status> service::del_request(std::span<const std::byte> req, bool& existed) {
  const std::string_view key(reinterpret_cast<const char*>(req.data()), req.size());
  std::uint64_t lsn = 0;
  rpc::status st = del(key, existed, lsn);
  if (!st.is_ok()) co_return st;
  if (!existed) lsn = read_fence();  // it saw the key absent: as a read does
  co_return co_await durable(lsn);
}

asio::awaitable<rpc::status> service::after_fence(std::uint64_t fence, rpc::status st) {
  rpc::status d = co_await durable(fence);
  if (!d.is_ok()) co_return d;
  co_return st;
}

std::uint64_t service::get_fence(const rpc::status& st) const noexcept {
  if (!st.is_ok() && st.code() != rpc::errc::not_found) return 0;  // (it showed nothing of the store)
  const std::uint64_t fence = read_fence();
  return must_wait(fence) ? fence : 0;
}

asio::awaitable<rpc::status> service::get_copy(std::span<const std::byte> req, std::vector<std::byte>& copy) {
  std::optional<std::span<const std::byte>> v;
  rpc::status st = get_request(req, v);
  if (st.is_ok()) copy.assign(v->begin(), v->end());  // now: the store may replace it while the reply waits
  if (const std::uint64_t fence = get_fence(st); fence != 0) co_return co_await after_fence(fence, std::move(st));
  co_return st;
}

namespace {

void reply_deleted(rpc::server_call& call, bool existed) {
  const std::byte b{static_cast<unsigned char>(existed ? 1 : 0)};
  call.reply(std::span<const std::byte>(&b, 1));
}

}  // namespace

void service::add_methods(rpc::server& srv, const memory_region& table) {
  srv.add(kLayoutMethod, [l = layout_for(table)](rpc::server_call& call) -> rpc::status {
    call.reply(std::span<const std::byte>(reinterpret_cast<const std::byte*>(&l), sizeof l));
    return {};
  });
  // Answered at once unless writes it may show are still on their way to
  // the log (then a coroutine waits for them).
  srv.add(kGetMethod, [this](rpc::server_call& call) -> rpc::outcome {
    std::optional<std::span<const std::byte>> v;
    rpc::status st = get_request(call.request(), v);
    if (st.is_ok()) call.reply(*v);  // copied now: the store may replace it while the reply waits
    const std::uint64_t fence = get_fence(st);
    if (fence == 0) return st;
    return after_fence(fence, std::move(st));
  });
  srv.add(kPutMethod, [this](rpc::server_call& call) -> asio::awaitable<rpc::status> {
    co_return co_await put_request(call.request());
  });
  srv.add(kDelMethod, [this](rpc::server_call& call) -> asio::awaitable<rpc::status> {
    bool existed = false;
    rpc::status st = co_await del_request(call.request(), existed);
    if (st.is_ok()) reply_deleted(call, existed);
    co_return st;
  });
}

// A call on another reactor: its body runs on the home thread (co_spawn
// there; the coroutine here resumes on its own reactor when it is done).
// The request stays valid meanwhile (the call holds it until its handler
// ends); a value is copied on the home thread, since the store may replace
// it as soon as that thread moves on.
// (No cancellation crosses to the home thread: Boost 1.81's co_spawn
// forwards the caller's cancellation there with a pointer to a signal the
// caller frees when it resumes, a use-after-free when a call's deadline or
// a cancel races its completion. A call the home thread has started runs
// to its end; the server drops a late reply.)
static auto uncancellable() { return asio::bind_cancellation_slot(asio::cancellation_slot(), asio::use_awaitable); }

void service::add_remote_methods(rpc::server& srv, const memory_region& table,
                                 asio::io_context::executor_type home) {
  srv.add(kLayoutMethod, [l = layout_for(table)](rpc::server_call& call) -> rpc::status {
    call.reply(std::span<const std::byte>(reinterpret_cast<const std::byte*>(&l), sizeof l));
    return {};
  });
  srv.add(kGetMethod, [this, home](rpc::server_call& call) -> asio::awaitable<rpc::status> {
    std::vector<std::byte> value;
    rpc::status st = co_await asio::co_spawn(
        home,
        [this, req = call.request(), &value]() -> asio::awaitable<rpc::status> {
          co_return co_await get_copy(req, value);
        },
        uncancellable());
    if (st.is_ok()) call.reply(value);
    co_return st;
  });
  srv.add(kPutMethod, [this, home](rpc::server_call& call) -> asio::awaitable<rpc::status> {
    co_return co_await asio::co_spawn(
        home, [this, req = call.request()]() -> asio::awaitable<rpc::status> { co_return co_await put_request(req); },
        uncancellable());
  });
  srv.add(kDelMethod, [this, home](rpc::server_call& call) -> asio::awaitable<rpc::status> {
    bool existed = false;
    rpc::status st = co_await asio::co_spawn(
        home,
        [this, req = call.request(), &existed]() -> asio::awaitable<rpc::status> {
          co_return co_await del_request(req, existed);
        },
        uncancellable());
    if (st.is_ok()) reply_deleted(call, existed);
    co_return st;
  });
}

}  // namespace anydoor::apps::kv
