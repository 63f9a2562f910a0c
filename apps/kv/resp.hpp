// The Redis protocol front door (RESP2 over plain TCP, through Asio): the
// same store and durability as the RPC door. Requests in RESP arrays or
// inline; pipelined (replies go out in order, one write per batch; with
// --sync always a batch's replies wait for the fsync covering its writes).
// Commands: PING ECHO GET SET (NX XX) DEL EXISTS MGET MSET INCR DBSIZE INFO
// SELECT(0) QUIT COMMAND (COUNT, DOCS, INFO: empty) CONFIG GET. Anything
// else: "-ERR unknown command ...", as Redis answers. A request that
// breaks the protocol gets "-ERR Protocol error: ..." and its connection is
// closed; nobody else notices.
#pragma once

#include "service.hpp"

#include <boost/asio/awaitable.hpp>
#include <boost/asio/ip/tcp.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace anydoor::apps::kv {

// One command parsed from the front of `in`.
struct resp_limits {
  std::size_t max_args = 1024 * 1024;
  std::size_t max_bulk = std::size_t{512} << 20;
  std::size_t max_inline = 64 * 1024;
};
enum class resp_parse { command, incomplete, error };

// Parses one command at a time from a buffer that grows at its end: after
// `incomplete`, call again with the same bytes and more after them; what
// was parsed is not parsed again (a request trickling in byte by byte
// costs linear time, not quadratic). On `command`: `args` view into `in`,
// `consumed` bytes were used (an empty command, "*0" or a blank inline
// line, yields no args), and the parser starts afresh at the next call.
// On `error`: `why` (then reset()). Arguments of an inline command with
// quotes view into the parser: valid until its next call.
class resp_parser {
 public:
  explicit resp_parser(const resp_limits& lim) : lim_(lim) {}
  resp_parse next(std::string_view in, std::vector<std::string_view>& args, std::size_t& consumed, std::string& why);
  // Also lets go of the memory a command of many arguments took (more
  // than kKeptArgs), so that a connection does not keep it.
  void reset() noexcept;
  // Bytes the parser holds (for tests).
  std::size_t memory() const noexcept { return spans_.capacity() * sizeof(spans_[0]); }
  static constexpr std::size_t kKeptArgs = 4096;

 private:
  resp_limits lim_;
  std::size_t pos_ = 0;    // bytes of the command parsed so far
  long long want_ = -1;    // arguments of the array (-1: its header is not read yet)
  std::vector<std::pair<std::size_t, std::size_t>> spans_;  // arguments so far: offset, length
  std::vector<std::string> unquoted_;  // inline words in quotes
};


struct resp_stats {
  std::uint64_t connections = 0;       // open now
  std::uint64_t connections_total = 0;
  std::uint64_t commands = 0;
  std::uint64_t protocol_errors = 0;
  // Bytes the connections' input buffers hold now (16 KiB each at rest: one
  // grown for a large request is cut back once it is served).
  std::uint64_t input_buffer_bytes = 0;
  std::uint64_t rejected = 0;          // over max_clients
  std::uint64_t accept_errors = 0;     // accept(2) failed (out of descriptors, say): retried after 100 ms
};

class resp_door {
 public:
  // Listens on host:port (0: any). Throws std::system_error.
  // At most max_clients connections (one more is told so and closed);
  // each buffers at most one request of max(4 MiB, 2 x max value + 1 MiB)
  // and builds at most one reply of that size before writing it.
  resp_door(asio::io_context& io, service& svc, const std::string& host, std::uint16_t port,
            std::size_t max_clients = 1000);
  ~resp_door();
  std::uint16_t port() const noexcept { return port_; }
  // Stops listening and closes every connection.
  void stop();
  const resp_stats& stats() const noexcept { return st_; }

  // Runs one command: appends the reply to `out`; `lsn` grows to the log
  // position the reply must wait for; false: close after the reply (QUIT).
  bool execute(const std::vector<std::string_view>& args, std::string& out, std::uint64_t& lsn);

 private:
  asio::awaitable<void> accept_loop();
  asio::awaitable<void> session(asio::ip::tcp::socket s);
  void info(std::string_view section, std::string& out) const;

  asio::io_context& io_;
  service& svc_;
  asio::ip::tcp::acceptor acc_;
  std::uint16_t port_ = 0;
  std::size_t max_clients_;
  resp_limits lim_;
  std::size_t max_request_ = 0;  // bytes one connection buffers for a request; also the largest reply
  std::vector<asio::ip::tcp::socket*> open_;
  bool stopped_ = false;
  resp_stats st_;
  std::chrono::steady_clock::time_point last_accept_report_{};
};

}  // namespace anydoor::apps::kv
