#include "client.hpp"

#include "service.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <cstring>
#include <new>
#include <utility>

namespace anydoor::apps::kv {

namespace {
constexpr auto tuple = asio::as_tuple(asio::use_awaitable);

// Two READs in flight at once and one wait for both. Lives in the awaiting
// coroutine's frame: the READs' handlers point at it, and it keeps the
// coroutine's own handler (inline, no allocation) until both READs have
// completed; the coroutine stays suspended until then, so the frame
// outlives both. The coroutine resumes through asio::dispatch on its own
// executor (inline: it is the connection's io thread). A READ handler
// destroyed without being called (its io_context destroyed first) counts
// as abandoned: once both are gone, the kept handler is destroyed, and
// with it the coroutine's frames, as use_awaitable's own would be. A READ
// that cannot start (std::bad_alloc from an empty node pool) counts as
// abandoned too, and the exception leaves the initiation as Asio's own
// would (out of the io_context's run(); the coroutine is never resumed):
// the kept handler is destroyed once the READ already started, if one
// did, has completed, so the frame holding this pair outlives it. The
// count starts at one, the initiation's own share, and each READ adds
// its share just before it is started: a READ never started is never
// waited for. One fabric is one thread, so the counts need no atomics.
class read_pair {
 public:
  error_code ec[2];

  asio::awaitable<void> both(connection& c, local_range d0, const remote_region& s0, local_range d1,
                             const remote_region& s1) {
    const auto ex = c.get_executor();  // (before anything is kept: it may throw)
    left_ = 1;  // the initiation's share
    abandoned_ = false;
    co_await asio::async_initiate<decltype(asio::use_awaitable), void()>(
        [&](auto handler) {
          using handler_t = decltype(handler);
          static_assert(sizeof(handler_t) <= sizeof storage_ && alignof(handler_t) <= alignof(std::max_align_t));
          new (storage_) handler_t(std::move(handler));
          finish_ = [](read_pair& p, bool resume) {
            auto* h = std::launder(reinterpret_cast<handler_t*>(p.storage_));
            handler_t local(std::move(*h));
            h->~handler_t();
            // Either may end the frame that holds p: nothing touches p after.
            if (resume) asio::dispatch(std::move(local));
          };
          try {
            ++left_;
            c.async_get(d0, s0, asio::bind_executor(ex, callback(this, 0)));
            ++left_;
            c.async_get(d1, s1, asio::bind_executor(ex, callback(this, 1)));
          } catch (...) {
            // (A callback not taken by its operation has settled as abandoned.)
            abandoned_ = true;
            release();  // may destroy the kept handler: nothing touches this after
            throw;
          }
          release();
        },
        asio::use_awaitable);
  }

 private:
  class callback {
   public:
    callback(read_pair* p, int i) noexcept : p_(p), i_(i) {}
    callback(callback&& o) noexcept : p_(std::exchange(o.p_, nullptr)), i_(o.i_) {}
    callback& operator=(callback&&) = delete;
    ~callback() {
      if (p_ != nullptr) p_->settle(i_, nullptr);
    }
    void operator()(error_code e, std::size_t) {
      read_pair* p = std::exchange(p_, nullptr);
      p->settle(i_, &e);
    }

   private:
    read_pair* p_;
    int i_;
  };

  void settle(int i, const error_code* e) {
    if (e != nullptr) ec[i] = *e;
    else abandoned_ = true;
    release();
  }
  void release() {
    if (--left_ == 0) finish_(*this, !abandoned_);
  }

  int left_ = 0;
  bool abandoned_ = false;
  void (*finish_)(read_pair&, bool resume) = nullptr;
  alignas(std::max_align_t) std::byte storage_[128];
};

}  // namespace

rpc::status call_status(const error_code& ec, const rpc::reply& r) {
  if (!ec) return {};
  const std::error_code sec = ec;  // boost wraps std categories; compare them as std
  if (sec.category() == rpc::error_category()) {
    const auto code = static_cast<rpc::errc>(sec.value());
    std::string text(r.status_message());
    if (text.empty()) text = ec.message();
    return {code, std::move(text)};
  }
  if (ec == std::errc::operation_canceled) return {rpc::errc::cancelled, ec.message()};
  return {rpc::errc::unavailable, ec.message()};
}

client::client(fabric& fab, connection c, std::chrono::milliseconds timeout, std::size_t location_cache)
    : fab_(fab), cli_(std::move(c), {.timeout = timeout}), location_entries_(location_cache) {}

client::location* client::cached(std::uint64_t hash) noexcept {
  if (locations_.empty()) return nullptr;
  location& e = locations_[(hash >> 32) % locations_.size()];
  return e.length != 0 && e.hash == hash ? &e : nullptr;
}

void client::remember(std::uint64_t hash, const slot& s) noexcept {
  if (locations_.empty()) return;
  locations_[(hash >> 32) % locations_.size()] = {hash, s.offset, s.length};
}

void client::forget(std::uint64_t hash) noexcept {
  if (location* e = cached(hash)) e->length = 0;
}

asio::awaitable<rpc::status> client::put(std::string_view key, std::span<const std::byte> value) {
  // The request is built in a buffer of the call's own (a coroutine frame
  // outlives the call): [u32 key length][key][value].
  std::vector<std::byte> req(4 + key.size() + value.size());
  const auto k = static_cast<std::uint32_t>(key.size());
  std::memcpy(req.data(), &k, 4);
  std::memcpy(req.data() + 4, key.data(), key.size());
  if (!value.empty()) std::memcpy(req.data() + 4 + key.size(), value.data(), value.size());
  auto [ec, r] = co_await cli_.async_call(kPutMethod, asio::buffer(req), tuple);
  co_return call_status(ec, r);
}

asio::awaitable<rpc::status> client::get(std::string_view key, std::string& out) {
  auto [ec, r] = co_await cli_.async_call(kGetMethod, asio::buffer(key.data(), key.size()), tuple);
  if (!ec) out.assign(reinterpret_cast<const char*>(r.data()), r.size());
  co_return call_status(ec, r);
}

asio::awaitable<rpc::status> client::del(std::string_view key, bool& existed) {
  auto [ec, r] = co_await cli_.async_call(kDelMethod, asio::buffer(key.data(), key.size()), tuple);
  existed = !ec && r.size() == 1 && r.data()[0] == std::byte{1};
  if (!ec && r.size() != 1) co_return rpc::status(rpc::errc::internal, "malformed del reply");
  co_return call_status(ec, r);
}

asio::awaitable<rpc::status> client::fetch_layout() {
  auto [ec, r] = co_await cli_.async_call(kLayoutMethod, asio::const_buffer(), tuple);
  if (ec) co_return call_status(ec, r);
  layout l;
  if (r.size() != sizeof l) co_return rpc::status(rpc::errc::internal, "malformed layout reply");
  std::memcpy(&l, r.data(), sizeof l);
  remote_region region;
  if (remote_region::unpack(std::span<const std::byte>(reinterpret_cast<const std::byte*>(l.region), 32), region) ||
      !layout_usable(l, region.length)) {
    co_return rpc::status(rpc::errc::failed_precondition, "the server's table layout is not one this client reads");
  }
  layout_ = l;
  table_ = region;
  locations_.assign(location_entries_, location{});  // (places in another layout mean nothing)
  co_return rpc::status();
}

client::reader client::make_reader() {
  // The neighbourhood, then the largest item (capped: a larger value is
  // fetched by RPC): an item READ beside the neighbourhood lands after it.
  std::size_t n = kNeighbourhoodBytes;
  if (layout_) {
    n += std::min<std::size_t>(kItemHeader + layout_->max_key + layout_->max_value, std::size_t{4} << 20);
  }
  // Page-aligned memory, whole pages, owned by the region's allocation below.
  auto* mem = static_cast<std::byte*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096));
  if (mem == nullptr) throw std::bad_alloc();
  reader r;
  r.mem.reset(mem);
  r.mr = fab_.register_memory(std::span<std::byte>(mem, (n + 4095) / 4096 * 4096), access::local_write);
  return r;
}

asio::awaitable<rpc::status> client::read_get(reader& r, std::string_view key, std::string& out) {
  if (!layout_ || key.empty() || key.size() > layout_->max_key) co_return co_await get(key, out);
  ++rs_.gets;
  const layout& l = *layout_;
  const std::uint64_t h = key_hash(l.seed, key);
  const std::uint64_t home = h & (l.buckets - 1);
  connection& conn = cli_.connection();
  const std::size_t item_room = r.mr.size() - std::min(r.mr.size(), kNeighbourhoodBytes);
  for (int attempt = 0; attempt < kReadAttempts; ++attempt) {
    if (attempt != 0) ++rs_.retries;
    // The item where this key's was last found, READ beside the
    // neighbourhood (not on a retry: that follows a torn or moved read).
    location ahead;
    if (const location* c = attempt == 0 ? cached(h) : nullptr;
        c != nullptr && c->length <= item_room && c->length <= kReadAheadMax && c->offset <= l.arena_size &&
        c->length <= l.arena_size - c->offset) {
      ahead = *c;
    }
    const auto nb_dst = r.mr.at(0, kNeighbourhoodBytes);
    const auto nb_src = table_.at(home * kBucketSize, kNeighbourhoodBytes);
    if (ahead.length != 0) {
      rs_.reads += 2;
      ++rs_.ahead;
      read_pair both;
      co_await both.both(conn, nb_dst, nb_src, r.mr.at(kNeighbourhoodBytes, ahead.length),
                         table_.at(l.arena_offset + ahead.offset, ahead.length));
      for (const error_code& ec : both.ec) {
        if (ec) co_return rpc::status(rpc::errc::unavailable, "READ failed: " + ec.message());
      }
    } else {
      ++rs_.reads;
      auto [ec, n] = co_await conn.async_get(nb_dst, nb_src, tuple);
      if (ec) co_return rpc::status(rpc::errc::unavailable, "READ failed: " + ec.message());
    }
    const neighbourhood nb = scan_neighbourhood(r.mr.bytes().first(kNeighbourhoodBytes), h);
    bool torn = nb.torn;
    bool too_large = false;
    for (std::size_t i = 0; i < nb.n; ++i) {
      const slot& s = nb.cand[i];
      std::span<const std::byte> value;
      match m = match::torn;
      if ((s.length & kInlineFlag) != 0) {
        m = check_inline(s, key, value);
      } else if (!item_in_bounds(s, l)) {
        m = match::torn;
      } else if (s.length > item_room) {
        too_large = true;
        continue;
      } else {
        // The item READ ahead counts only if this slot points at it and it
        // passes the checks; else it is READ now, after the slot.
        bool read_now = true;
        if (ahead.length != 0 && s.offset == ahead.offset && s.length == ahead.length) {
          ahead.length = 0;
          m = check_item(r.mr.bytes().subspan(kNeighbourhoodBytes, s.length), s, key, value);
          if (m == match::yes) ++rs_.ahead_hits;
          // Another key's item of the slot's version is the slot's item
          // (versions are never reused): READing it again would tell the same.
          read_now = m == match::torn;
        }
        if (read_now) {
          ahead.length = 0;  // its bytes are overwritten now
          ++rs_.reads;
          auto [ec2, n2] = co_await conn.async_get(r.mr.at(kNeighbourhoodBytes, s.length),
                                                   table_.at(l.arena_offset + s.offset, s.length), tuple);
          if (ec2) co_return rpc::status(rpc::errc::unavailable, "READ failed: " + ec2.message());
          m = check_item(r.mr.bytes().subspan(kNeighbourhoodBytes, s.length), s, key, value);
        }
        if (m == match::yes) remember(h, s);
      }
      if (m == match::yes) {
        if ((s.length & kInlineFlag) != 0) forget(h);  // nothing to READ ahead for it
        out.assign(reinterpret_cast<const char*>(value.data()), value.size());
        ++rs_.hits;
        co_return rpc::status();
      }
      if (m == match::torn) torn = true;
    }
    if (too_large) break;
    if (!torn) {
      if (nb.overflow != 0) break;  // it may be in the server-only table
      forget(h);
      ++rs_.misses;
      co_return rpc::status(rpc::errc::not_found, "not found");
    }
  }
  forget(h);  // (overflowed, grown past the buffer, or torn throughout: no guess next time)
  ++rs_.fallbacks;
  co_return co_await get(key, out);
}

}  // namespace anydoor::apps::kv
