#include "resp.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <system_error>

#include <fnmatch.h>
#include <unistd.h>

namespace anydoor::apps::kv {

namespace {

using asio::ip::tcp;
constexpr auto tuple = asio::as_tuple(asio::use_awaitable);

bool parse_int(std::string_view s, long long& v) {
  if (s.empty() || s.size() > 20) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  return ec == std::errc() && p == s.data() + s.size();
}

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const char x = a[i] >= 'a' && a[i] <= 'z' ? static_cast<char>(a[i] - 32) : a[i];
    if (x != b[i]) return false;
  }
  return true;
}

void simple(std::string& out, std::string_view s) {
  out += '+';
  out += s;
  out += "\r\n";
}
void error(std::string& out, std::string_view s) {
  out += '-';
  for (char c : s) out += (c == '\r' || c == '\n') ? ' ' : c;  // a peer's bytes never break the framing
  out += "\r\n";
}
void integer(std::string& out, long long v) {
  out += ':';
  out += std::to_string(v);
  out += "\r\n";
}
void bulk(std::string& out, std::string_view s) {
  out += '$';
  out += std::to_string(s.size());
  out += "\r\n";
  out += s;
  out += "\r\n";
}
void bulk(std::string& out, std::span<const std::byte> b) {
  bulk(out, std::string_view(reinterpret_cast<const char*>(b.data()), b.size()));
}
void nil(std::string& out) { out += "$-1\r\n"; }
void array(std::string& out, std::size_t n) {
  out += '*';
  out += std::to_string(n);
  out += "\r\n";
}
std::span<const std::byte> bytes(std::string_view s) { return {reinterpret_cast<const std::byte*>(s.data()), s.size()}; }

std::string lower(std::string_view s) {
  std::string r(s);
  for (char& c : r) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
  }
  return r;
}

void wrong_args(std::string& out, std::string_view cmd) {
  error(out, "ERR wrong number of arguments for '" + lower(cmd) + "' command");
}

// Inline commands: words split by blanks; "double quoted" words may hold
// blanks (with \" and \\ inside).
bool split_inline(std::string_view line, std::vector<std::string_view>& args, std::string& why,
                  std::vector<std::string>& unquoted) {
  std::size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
    if (i == line.size()) break;
    if (line[i] == '"') {
      std::string w;
      ++i;
      bool closed = false;
      while (i < line.size()) {
        if (line[i] == '\\' && i + 1 < line.size()) {
          w += line[i + 1];
          i += 2;
        } else if (line[i] == '"') {
          closed = true;
          ++i;
          break;
        } else {
          w += line[i++];
        }
      }
      if (!closed || (i < line.size() && line[i] != ' ' && line[i] != '\t')) {
        why = "Protocol error: unbalanced quotes in request";
        return false;
      }
      unquoted.push_back(std::move(w));
      args.push_back({});  // filled below (the strings may move while growing)
    } else {
      const std::size_t b = i;
      while (i < line.size() && line[i] != ' ' && line[i] != '\t') ++i;
      args.push_back(line.substr(b, i - b));
    }
  }
  std::size_t q = 0;
  for (auto& a : args) {
    if (a.data() == nullptr) a = unquoted[q++];
  }
  return true;
}

}  // namespace

void resp_parser::reset() noexcept {
  pos_ = 0;
  want_ = -1;
  if (spans_.capacity() > kKeptArgs) {
    std::vector<std::pair<std::size_t, std::size_t>>().swap(spans_);
  } else {
    spans_.clear();
  }
}

resp_parse resp_parser::next(std::string_view in, std::vector<std::string_view>& args, std::size_t& consumed,
                             std::string& why) {
  args.clear();
  consumed = 0;
  if (in.empty()) return resp_parse::incomplete;
  auto error = [&](std::string w) {
    why = std::move(w);
    reset();
    return resp_parse::error;
  };
  if (in[0] != '*') {
    // Inline: a line. pos_ is how far we have looked for its end.
    const std::size_t nl = in.find('\n', pos_);
    if (nl == std::string_view::npos) {
      if (in.size() > lim_.max_inline) return error("Protocol error: too big inline request");
      pos_ = in.size();
      return resp_parse::incomplete;
    }
    std::string_view line = in.substr(0, nl);
    if (line.size() > lim_.max_inline) return error("Protocol error: too big inline request");
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    unquoted_.clear();
    if (!split_inline(line, args, why, unquoted_)) {
      reset();
      return resp_parse::error;
    }
    consumed = nl + 1;
    reset();
    return resp_parse::command;
  }
  if (want_ < 0) {
    const std::size_t eol = in.find("\r\n");
    if (eol == std::string_view::npos) {
      if (in.size() > 32) return error("Protocol error: invalid multibulk length");
      return resp_parse::incomplete;
    }
    long long n = 0;
    if (!parse_int(in.substr(1, eol - 1), n) || n > static_cast<long long>(lim_.max_args)) {
      return error("Protocol error: invalid multibulk length");
    }
    want_ = std::max(n, 0LL);
    pos_ = eol + 2;
    spans_.clear();
  }
  while (static_cast<long long>(spans_.size()) < want_) {
    const std::size_t at = pos_;
    if (at >= in.size()) return resp_parse::incomplete;
    if (in[at] != '$') return error(std::string("Protocol error: expected '$', got '") + in[at] + "'");
    const std::size_t le = in.find("\r\n", at + 1);
    if (le == std::string_view::npos) {
      if (in.size() - at > 32) return error("Protocol error: invalid bulk length");
      return resp_parse::incomplete;
    }
    long long len = 0;
    if (!parse_int(in.substr(at + 1, le - at - 1), len) || len < 0 ||
        static_cast<unsigned long long>(len) > lim_.max_bulk) {
      return error("Protocol error: invalid bulk length");
    }
    const std::size_t data = le + 2;
    const auto ulen = static_cast<std::size_t>(len);
    if (data > in.size() || in.size() - data < ulen + 2) return resp_parse::incomplete;
    if (in[data + ulen] != '\r' || in[data + ulen + 1] != '\n') {
      return error("Protocol error: expected CRLF after a bulk string");
    }
    spans_.emplace_back(data, ulen);
    pos_ = data + ulen + 2;
  }
  args.reserve(spans_.size());
  for (const auto& [off, len] : spans_) args.push_back(in.substr(off, len));
  consumed = pos_;
  reset();
  return resp_parse::command;
}


resp_door::resp_door(asio::io_context& io, service& svc, const std::string& host, std::uint16_t port,
                     std::size_t max_clients)
    : io_(io), svc_(svc), acc_(io), max_clients_(max_clients) {
  // (Errors name the door and the address: Asio's own say only "bind".)
  error_code ec;
  const auto addr = asio::ip::make_address(host, ec);
  if (ec) throw std::system_error(ec, "redis protocol: bad listen address '" + host + "'");
  const tcp::endpoint ep(addr, port);
  acc_.open(ep.protocol());
  acc_.set_option(tcp::acceptor::reuse_address(true));
  acc_.bind(ep, ec);
  if (!ec) acc_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) throw std::system_error(ec, "redis protocol: cannot listen on " + host + ":" + std::to_string(port));
  port_ = acc_.local_endpoint().port();
  lim_.max_bulk = std::max<std::size_t>(svc.data().options().max_value, svc.data().options().max_key) + 1024;
  max_request_ = std::max<std::size_t>(std::size_t{4} << 20, 2 * lim_.max_bulk + (1 << 20));
  asio::co_spawn(io_, accept_loop(), asio::detached);
}

resp_door::~resp_door() { stop(); }

void resp_door::stop() {
  if (stopped_) return;
  stopped_ = true;
  error_code ignored;
  acc_.close(ignored);
  for (auto* s : open_) s->close(ignored);
}

asio::awaitable<void> resp_door::accept_loop() {
  while (!stopped_) {
    auto [ec, sock] = co_await acc_.async_accept(tuple);
    if (stopped_) co_return;
    if (ec) {
      if (ec == asio::error::operation_aborted) co_return;
      // Out of descriptors, say: wait a little instead of spinning, and
      // tell the operator (at most every 10 s: the clients waiting to be
      // accepted retry all the while).
      ++st_.accept_errors;
      const auto now = std::chrono::steady_clock::now();
      if (st_.accept_errors == 1 || now - last_accept_report_ >= std::chrono::seconds(10)) {
        last_accept_report_ = now;
        std::fprintf(stderr,
                     "anydoor-kv-server: redis protocol: accepting a connection failed: %s (%llu times so far; "
                     "retrying every 100 ms%s)\n",
                     ec.message().c_str(), static_cast<unsigned long long>(st_.accept_errors),
                     ec == asio::error::no_descriptors ? "; raise the open-file limit, ulimit -n" : "");
      }
      asio::steady_timer t(io_, std::chrono::milliseconds(100));
      co_await t.async_wait(tuple);
      continue;
    }
    if (open_.size() >= max_clients_) {
      ++st_.rejected;
      error_code ignored;
      asio::write(sock, asio::buffer(std::string_view("-ERR max number of clients reached\r\n")), ignored);
      sock.close(ignored);
      continue;
    }
    error_code ignored;
    sock.set_option(tcp::no_delay(true), ignored);
    asio::co_spawn(io_, session(std::move(sock)), asio::detached);
  }
}

asio::awaitable<void> resp_door::session(tcp::socket s) {
  constexpr std::size_t kInput = 16 * 1024;  // the input buffer at rest
  std::string in(kInput, '\0');
  // However the session ends (an exception from a command, say bad_alloc,
  // included), the socket is closed and forgotten: stop() must not reach a
  // socket of a frame that is gone.
  struct session_end {
    resp_door& d;
    tcp::socket& s;
    const std::string& in;
    ~session_end() {
      error_code ignored;
      s.close(ignored);
      d.open_.erase(std::remove(d.open_.begin(), d.open_.end(), &s), d.open_.end());
      --d.st_.connections;
      d.st_.input_buffer_bytes -= in.size();
    }
  };
  open_.push_back(&s);
  ++st_.connections;
  ++st_.connections_total;
  st_.input_buffer_bytes += in.size();
  const session_end ending{*this, s, in};
  const std::size_t limit = max_request_;
  resp_parser parser(lim_);
  std::size_t start = 0, end = 0;
  std::string out;
  std::vector<std::string_view> args;
  bool close = false;
  for (;;) {
    std::uint64_t lsn = 0;
    bool more = false;
    for (;;) {
      std::size_t used = 0;
      std::string why;
      const resp_parse r = parser.next(std::string_view(in.data() + start, end - start), args, used, why);
      if (r == resp_parse::incomplete) break;
      if (r == resp_parse::error) {
        ++st_.protocol_errors;
        error(out, "ERR " + why);
        close = true;
        break;
      }
      start += used;
      if (args.empty()) continue;
      ++st_.commands;
      if (!execute(args, out, lsn)) {
        close = true;
        break;
      }
      if (out.size() >= (1u << 20)) {  // write what is there before going on
        more = true;
        break;
      }
    }
    // Every reply waits for what it may show (reads too: see read_fence).
    if (!out.empty()) lsn = std::max(lsn, svc_.read_fence());
    if (svc_.must_wait(lsn)) {
      const rpc::status st = co_await svc_.durable(lsn);
      if (!st.is_ok()) {
        out.clear();
        error(out, "ERR " + st.message());
        close = true;
      }
    }
    if (!out.empty()) {
      auto [ec, n] = co_await asio::async_write(s, asio::buffer(out), tuple);
      if (ec) break;
      if (out.capacity() > (4u << 20)) {
        std::string().swap(out);
      } else {
        out.clear();
      }
    }
    if (close || stopped_) break;
    if (more) continue;
    if (start == end) {
      start = end = 0;
    } else if (start > 0) {
      std::memmove(in.data(), in.data() + start, end - start);
      end -= start;
      start = 0;
    }
    // A buffer grown for a large request goes back to its size at rest
    // once what it holds fits (an idle connection keeps 16 KiB, not the
    // largest request it ever sent); so do the argument views.
    if (in.size() > kInput && end <= kInput / 2) {
      std::string rest(kInput, '\0');
      std::memcpy(rest.data(), in.data(), end);
      st_.input_buffer_bytes -= in.size() - kInput;
      in.swap(rest);
    }
    if (args.capacity() > resp_parser::kKeptArgs) std::vector<std::string_view>().swap(args);
    if (end == in.size()) {
      if (in.size() >= limit) {
        ++st_.protocol_errors;
        error(out, "ERR Protocol error: the request exceeds the query buffer limit");
        co_await asio::async_write(s, asio::buffer(out), tuple);
        break;
      }
      const std::size_t was = in.size();
      in.resize(std::min(limit, was * 2));
      st_.input_buffer_bytes += in.size() - was;  // (after: a resize that throws counts nothing)
    }
    auto [ec, n] = co_await s.async_read_some(asio::buffer(in.data() + end, in.size() - end), tuple);
    if (ec) break;
    end += n;
  }
}

void resp_door::info(std::string_view section, std::string& out) const {
  const std::string sec = lower(section);
  const bool all = sec.empty() || sec == "all" || sec == "default" || sec == "everything";
  std::string t;
  if (all || sec == "server") {
    t += "# Server\r\nredis_version:7.0.0\r\nredis_mode:standalone\r\nanydoor_kv:1\r\n";
    t += "process_id:" + std::to_string(::getpid()) + "\r\ntcp_port:" + std::to_string(port_) + "\r\n\r\n";
  }
  if (all || sec == "memory") {
    t += "# Memory\r\nused_memory:" + std::to_string(svc_.data().charged_bytes()) + "\r\nmaxmemory:" +
         std::to_string(svc_.data().options().max_memory) + "\r\nmaxmemory_policy:noeviction\r\nmem_clients_normal:" +
         std::to_string(st_.input_buffer_bytes) + "\r\n\r\n";
  }
  if (all || sec == "persistence") {
    const durable_log* log = const_cast<service&>(svc_).log();
    t += "# Persistence\r\naof_enabled:" + std::string(log != nullptr ? "1" : "0") + "\r\n";
    if (log != nullptr) {
      const auto ls = log->stats();
      t += "aof_current_size:" + std::to_string(ls.file_bytes) + "\r\naof_rewrite_in_progress:" +
           (log->compacting() ? "1" : "0") + "\r\naof_rewrites:" + std::to_string(ls.compactions) +
           "\r\naof_fsyncs:" + std::to_string(ls.fsyncs) + "\r\naof_last_write_status:" +
           (log->error() ? "err" : "ok") + "\r\n";
    }
    t += "\r\n";
  }
  if (all || sec == "stats") {
    const auto& vs = svc_.stats();
    t += "# Stats\r\ntotal_connections_received:" + std::to_string(st_.connections_total) +
         "\r\ntotal_commands_processed:" + std::to_string(st_.commands) +
         "\r\nrejected_connections:" + std::to_string(st_.rejected) + "\r\naccept_errors:" +
         std::to_string(st_.accept_errors) +
         "\r\nprotocol_errors:" + std::to_string(st_.protocol_errors) +
         "\r\nkeyspace_hits:" + std::to_string(vs.get_hits) +
         "\r\nkeyspace_misses:" + std::to_string(vs.gets - vs.get_hits) + "\r\n";
    // No fork here: the time the last compaction's snapshot held the io
    // thread (Redis's field for the same pause, the fork's); 0 before one.
    const durable_log* log = const_cast<service&>(svc_).log();
    t += "latest_fork_usec:" + std::to_string(log != nullptr ? log->stats().last_snapshot_us : 0) + "\r\n\r\n";
  }
  if (all || sec == "keyspace") {
    t += "# Keyspace\r\n";
    const auto keys = svc_.data().stats().keys;
    if (keys != 0) t += "db0:keys=" + std::to_string(keys) + ",expires=0,avg_ttl=0\r\n";
  }
  bulk(out, t);
}

bool resp_door::execute(const std::vector<std::string_view>& a, std::string& out, std::uint64_t& lsn) {
  const std::string_view cmd = a[0];
  const std::size_t n = a.size();
  auto put = [&](std::string_view k, std::string_view v) {
    std::uint64_t l = 0;
    const rpc::status st = svc_.put(k, bytes(v), l);
    lsn = std::max(lsn, l);
    return st;
  };
  auto fail = [&](const rpc::status& st) {
    error(out, st.code() == rpc::errc::resource_exhausted ? st.message() : "ERR " + st.message());
  };
  if (iequals(cmd, "GET")) {
    if (n != 2) return wrong_args(out, cmd), true;
    if (a[1].empty() || a[1].size() > svc_.data().options().max_key) return nil(out), true;
    if (auto v = svc_.get(a[1])) bulk(out, *v); else nil(out);
  } else if (iequals(cmd, "SET")) {
    if (n < 3) return wrong_args(out, cmd), true;
    bool nx = false, xx = false;
    for (std::size_t i = 3; i < n; ++i) {
      if (iequals(a[i], "NX")) nx = true;
      else if (iequals(a[i], "XX")) xx = true;
      else if (iequals(a[i], "EX") || iequals(a[i], "PX") || iequals(a[i], "EXAT") || iequals(a[i], "PXAT") ||
               iequals(a[i], "KEEPTTL")) return error(out, "ERR expiry (EX, PX, ...) is not supported by anydoor-kv"), true;
      else return error(out, "ERR syntax error"), true;
    }
    if (nx && xx) return error(out, "ERR syntax error"), true;
    if (nx || xx) {
      const bool exists = !a[1].empty() && a[1].size() <= svc_.data().options().max_key && svc_.data().contains(a[1]);
      if ((nx && exists) || (xx && !exists)) return nil(out), true;
    }
    const rpc::status st = put(a[1], a[2]);
    if (st.is_ok()) simple(out, "OK"); else fail(st);
  } else if (iequals(cmd, "DEL")) {
    if (n < 2) return wrong_args(out, cmd), true;
    long long count = 0;
    for (std::size_t i = 1; i < n; ++i) {
      bool existed = false;
      std::uint64_t l = 0;
      const rpc::status st = svc_.del(a[i], existed, l);
      if (!st.is_ok() && st.code() != rpc::errc::invalid_argument) return fail(st), true;
      lsn = std::max(lsn, l);
      count += existed ? 1 : 0;
    }
    integer(out, count);
  } else if (iequals(cmd, "EXISTS")) {
    if (n < 2) return wrong_args(out, cmd), true;
    long long count = 0;
    for (std::size_t i = 1; i < n; ++i) {
      count += !a[i].empty() && a[i].size() <= svc_.data().options().max_key && svc_.data().contains(a[i]) ? 1 : 0;
    }
    integer(out, count);
  } else if (iequals(cmd, "MGET")) {
    if (n < 2) return wrong_args(out, cmd), true;
    const std::size_t before = out.size();
    array(out, n - 1);
    for (std::size_t i = 1; i < n; ++i) {
      std::optional<std::span<const std::byte>> v;
      if (!a[i].empty() && a[i].size() <= svc_.data().options().max_key) v = svc_.get(a[i]);
      if (v) bulk(out, *v); else nil(out);
      if (out.size() - before > max_request_) {  // a reply is bounded like a request
        out.resize(before);
        return error(out, "ERR the MGET reply would exceed " + std::to_string(max_request_) +
                              " bytes: ask for fewer keys"), true;
      }
    }
  } else if (iequals(cmd, "MSET")) {
    if (n < 3 || n % 2 == 0) return wrong_args(out, cmd), true;
    // Checked first: a bad pair applies nothing. (Not atomic when memory or
    // the log fails midway: the pairs before stay written.)
    for (std::size_t i = 1; i < n; i += 2) {
      if (a[i].empty() || a[i].size() > svc_.data().options().max_key ||
          a[i + 1].size() > svc_.data().options().max_value) {
        return error(out, "ERR a key or value of MSET is empty or above the limits"), true;
      }
    }
    for (std::size_t i = 1; i < n; i += 2) {
      const rpc::status st = put(a[i], a[i + 1]);
      if (!st.is_ok()) return fail(st), true;
    }
    simple(out, "OK");
  } else if (iequals(cmd, "INCR")) {
    if (n != 2) return wrong_args(out, cmd), true;
    long long v = 0;
    if (!a[1].empty() && a[1].size() <= svc_.data().options().max_key) {
      if (auto cur = svc_.get(a[1])) {
        if (!parse_int(std::string_view(reinterpret_cast<const char*>(cur->data()), cur->size()), v)) {
          return error(out, "ERR value is not an integer or out of range"), true;
        }
      }
    }
    if (v == std::numeric_limits<long long>::max()) return error(out, "ERR increment or decrement would overflow"), true;
    ++v;
    const rpc::status st = put(a[1], std::to_string(v));
    if (st.is_ok()) integer(out, v); else fail(st);
  } else if (iequals(cmd, "PING")) {
    if (n > 2) return wrong_args(out, cmd), true;
    if (n == 2) bulk(out, a[1]); else simple(out, "PONG");
  } else if (iequals(cmd, "ECHO")) {
    if (n != 2) return wrong_args(out, cmd), true;
    bulk(out, a[1]);
  } else if (iequals(cmd, "DBSIZE")) {
    if (n != 1) return wrong_args(out, cmd), true;
    integer(out, static_cast<long long>(svc_.data().stats().keys));
  } else if (iequals(cmd, "INFO")) {
    info(n > 1 ? a[1] : std::string_view(), out);
  } else if (iequals(cmd, "SELECT")) {
    if (n != 2) return wrong_args(out, cmd), true;
    long long db = -1;
    if (!parse_int(a[1], db)) return error(out, "ERR value is not an integer or out of range"), true;
    if (db != 0) return error(out, "ERR DB index is out of range"), true;
    simple(out, "OK");
  } else if (iequals(cmd, "QUIT")) {
    simple(out, "OK");
    return false;
  } else if (iequals(cmd, "COMMAND")) {
    if (n >= 2 && iequals(a[1], "COUNT")) integer(out, 15);
    else out += "*0\r\n";  // COMMAND, COMMAND DOCS, COMMAND INFO: nothing to describe
  } else if (iequals(cmd, "CONFIG")) {
    if (n != 3 || !iequals(a[1], "GET")) {
      return error(out, "ERR only CONFIG GET <pattern> is supported"), true;
    }
    const durable_log* log = svc_.log();
    const std::pair<const char*, std::string> params[] = {
        {"save", ""},
        {"appendonly", log != nullptr ? "yes" : "no"},
        {"appendfsync", log != nullptr ? to_string(log->options().sync) : "no"},
        {"maxmemory", std::to_string(svc_.data().options().max_memory)},
        {"databases", "1"},
    };
    std::vector<const std::pair<const char*, std::string>*> hits;
    const std::string pattern = lower(a[2]);
    for (const auto& p : params) {
      if (::fnmatch(pattern.c_str(), p.first, 0) == 0) hits.push_back(&p);
    }
    array(out, hits.size() * 2);
    for (const auto* p : hits) {
      bulk(out, p->first);
      bulk(out, p->second);
    }
  } else {
    std::string msg = "ERR unknown command '" + std::string(cmd.substr(0, 128)) + "', with args beginning with: ";
    for (std::size_t i = 1; i < n && i < 8; ++i) msg += "'" + std::string(a[i].substr(0, 64)) + "' ";
    error(out, msg);
  }
  return true;
}

}  // namespace anydoor::apps::kv
