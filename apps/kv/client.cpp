#include "client.hpp"

#include "service.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <cstring>

namespace anydoor::apps::kv {

namespace {
constexpr auto tuple = asio::as_tuple(asio::use_awaitable);
}

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

client::client(fabric& fab, connection c, std::chrono::milliseconds timeout)
    : fab_(fab), cli_(std::move(c), {.timeout = timeout}) {}

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
  co_return rpc::status();
}

client::reader client::make_reader() {
  // The neighbourhood, or the largest item (capped: a larger value is
  // fetched by RPC).
  std::size_t n = kNeighbourhoodBytes;
  if (layout_) {
    n = std::max<std::size_t>(n, std::min<std::size_t>(kItemHeader + layout_->max_key + layout_->max_value,
                                                       std::size_t{4} << 20));
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
  for (int attempt = 0; attempt < kReadAttempts; ++attempt) {
    if (attempt != 0) ++rs_.retries;
    ++rs_.reads;
    auto [ec, n] = co_await conn.async_get(r.mr.at(0, kNeighbourhoodBytes),
                                           table_.at(home * kBucketSize, kNeighbourhoodBytes), tuple);
    if (ec) co_return rpc::status(rpc::errc::unavailable, "READ failed: " + ec.message());
    const neighbourhood nb = scan_neighbourhood(r.mr.bytes().first(kNeighbourhoodBytes), h);
    bool torn = nb.torn;
    bool too_large = false;
    for (std::size_t i = 0; i < nb.n; ++i) {
      const slot& s = nb.cand[i];
      std::span<const std::byte> value;
      match m;
      if ((s.length & kInlineFlag) != 0) {
        m = check_inline(s, key, value);
      } else if (!item_in_bounds(s, l)) {
        m = match::torn;
      } else if (s.length > r.mr.size()) {
        too_large = true;
        continue;
      } else {
        ++rs_.reads;
        auto [ec2, n2] = co_await conn.async_get(r.mr.at(0, s.length), table_.at(l.arena_offset + s.offset, s.length),
                                                 tuple);
        if (ec2) co_return rpc::status(rpc::errc::unavailable, "READ failed: " + ec2.message());
        m = check_item(r.mr.bytes().first(s.length), s, key, value);
      }
      if (m == match::yes) {
        out.assign(reinterpret_cast<const char*>(value.data()), value.size());
        ++rs_.hits;
        co_return rpc::status();
      }
      if (m == match::torn) torn = true;
    }
    if (too_large) break;
    if (!torn) {
      if (nb.overflow != 0) break;  // it may be in the server-only table
      ++rs_.misses;
      co_return rpc::status(rpc::errc::not_found, "not found");
    }
  }
  ++rs_.fallbacks;
  co_return co_await get(key, out);
}

}  // namespace anydoor::apps::kv
