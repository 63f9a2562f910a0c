// The fabric: one provider device, its protection domain, one completion
// queue with its reactor, and the buffer pool, bound to one io_context
// (thread). Connections are made with listen()/async_accept and
// async_connect.
//
//   asio::io_context io;
//   anydoor::fabric fab(io, {.connection = {.auth_token = "s3cret"}});
//   anydoor::acceptor acc = fab.listen("0.0.0.0", 7471);
//   anydoor::connection c = co_await acc.async_accept(asio::use_awaitable);
//   anydoor::connection d = co_await fab.async_connect("10.0.0.2:7471", asio::use_awaitable);
//
// The reactor polls only while operations are pending (or sends are still in
// flight), so io_context::run() returns once the work is done. Connection
// setup blocks in the provider (rdma_cm, the tcp handshake) and runs on a
// short-lived helper thread; its result is delivered on the io_context.
// A fabric, its connections and their messages belong to one thread; the
// fabric must outlive them (and its acceptors), and the io_context must
// outlive the fabric. A connection whose handle is gone lets itself go once
// the device has flushed what it posted; the fabric's destructor ends that
// wait when the io_context no longer runs (their queue pairs destroyed,
// their pending handlers posted with their error, never run there).
#pragma once

#include <anydoor/buffer_pool.hpp>
#include <anydoor/connection.hpp>
#include <anydoor/memory.hpp>
#include <anydoor/reactor.hpp>
#include <anydoor/transport/provider.hpp>

#include <boost/asio/async_result.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/io_context.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace anydoor {

struct connection_options {
  std::uint16_t credits = 64;            // receive buffers posted per connection: 4..4096
  std::uint32_t eager_limit = 8192;      // payload bytes sent eagerly (also sizes our receive buffers): 1..1 MiB
  std::uint64_t max_message = std::uint64_t{1} << 30;  // largest message sent or accepted: 1..2^40
  std::uint32_t send_queue = 128;        // send work requests in flight: 8..4096
  std::uint32_t signal_interval = 16;    // signal every k-th send and most doorbells' last (README): 1..send_queue
  // Shared secret each side proves to the other (HMAC-SHA256 over fresh
  // nonces: nothing of it travels, nothing is replayable); empty: no
  // authentication. At most 1024 bytes; use 16 or more random bytes.
  std::string auth_token;
  std::chrono::milliseconds connect_timeout{10000};
  // An accepted connection attempt must complete its handshake within this
  // (listen side), and with an auth token a peer must prove it within this
  // (both sides); attempts in progress never delay each other. A good
  // attempt that no async_accept takes within this is refused too (the
  // client gets too_many_connections).
  std::chrono::milliseconds handshake_timeout{2000};
  std::chrono::milliseconds buffer_wait{5000};  // a send waits this long for a pool buffer
  // A peer silent this long (no message and no heartbeat: a host powered
  // off, a process frozen, a cut link) fails the connection: every pending
  // operation completes with errc::timed_out. Both sides send a heartbeat
  // when they have sent nothing for a quarter of the smaller nonzero
  // keepalive of the two (so the peer's setting is served too). Checked
  // while the fabric's io_context runs. 0: this side detects nothing (it
  // still sends the heartbeats its peer asks for). 0 or 200 ms..1 h. An
  // application whose io thread does not run for this long looks dead to
  // its peer; so may a single transfer longer than this on a slow link (a
  // put, a get or a rendezvous message: the heartbeats queue behind it).
  std::chrono::milliseconds keepalive{10000};
  // Memory the runtime allocates for rendezvous messages being received on
  // one connection (async_receive() without a buffer): a message larger
  // than this fails with message_size on both sides, and reads wait while
  // earlier ones hold the budget. 16 MiB: 4 GiB for 256 connections. A
  // split message (eager_split_limit) larger than this fails with
  // message_size at the receiver.
  std::uint64_t rendezvous_memory = std::uint64_t{16} << 20;  // 4 KiB..2^40
  // Largest piece one work request of a put, get or rendezvous read
  // carries; 0: the device's message limit (at most 1 GiB). 0 or 4 KiB..1 GiB.
  std::uint32_t fragment_size = 0;
  // Messages above the eager limit and at most this many bytes (one
  // buffer, host memory) are sent as consecutive eager pieces, each in a
  // receive buffer of the peer's: copied on both sides, with no
  // registration of the source, no RDMA READ and no fin (one one-way trip
  // instead of three), completing when handed to the queue pair as eager
  // sends do. A message is sent so only when the credits, send queue
  // slots and pool buffers for all its pieces are there at once (it
  // needs one credit per piece, and one more kept back; at most 64 pieces);
  // else by rendezvous. Its receiver's refusals (message_size, out of
  // memory) are its own: the send has completed. 0: never. 0..16 MiB.
  std::uint32_t eager_split_limit = 64 << 10;
};

struct fabric_options {
  transport::device_options device;      // provider auto | tcp | verbs (ANYDOOR_PROVIDER)
  reactor_options reactor;               // poll mode (ANYDOOR_POLL), spin, batch
  connection_options connection;
  std::uint32_t max_connections = 64;    // sizes the completion queue: 1..4096
  std::size_t buffers_per_slab = 256;    // buffer pool growth step
  std::size_t pool_max_bytes = std::size_t{256} << 20;  // buffer pool watermark
  // The registration cache (one-sided operations on memory that is not a
  // memory_region): registrations kept, least recently used evicted first.
  std::size_t cache_max_entries = 1024;                  // 1..2^20
  std::size_t cache_max_bytes = std::size_t{1} << 30;    // at least 4096
  // Registrations (register_memory, and the cache's) larger than this are
  // made in pieces: the aligned blocks of the largest power of two at most
  // this that the memory touches, each its own registration (at most
  // remote_region::max_pieces). A region in pieces is one memory_region to
  // its user; its remote() carries every piece's key and operations on it
  // and on its ranges go to the right piece. 0 (the default): the device's
  // max_mr_size. 0 or at least 4096; above max_mr_size means max_mr_size.
  // Not in pieces: a connection-scoped registration (one window) must fit
  // one piece (not_supported otherwise); rendezvous messages register with
  // the device's own max_mr_size.
  std::uint64_t max_piece_bytes = 0;
  // Shared receive queue. 0 (the default): each connection posts
  // connection.credits receive buffers of its own. N: the fabric posts N
  // pool buffers to one shared receive queue (the device must have them:
  // caps().max_srq) that all its connections receive from, so receive
  // memory stays N buffers however many connections there are. Credits
  // still prevent RNR: grants never exceed what the queue holds. A
  // connection starts with 4 credits; its window grows by one per message
  // toward connection.credits while the queue holds more than 4 receives
  // for each connection max_connections still allows, and shrinks back
  // toward 4 (credits stay with the queue) when it does not. A connection
  // the queue cannot grant 4 is refused (errc::no_buffer_space; the peer
  // sees too_many_connections): 4 * max_connections buffers admit every
  // connection. 0 or 8..2^20, at most the device's max_srq_wr.
  std::uint32_t srq_buffers = 0;
  // tcp provider: its software NIC also runs on a thread of the fabric's
  // own (transport::cq_options::progress_thread), so that the peers' puts,
  // gets and atomics on this process's memory, and their messages into
  // receives already posted, are served while this fabric's io_context is
  // busy or not run at all; completions still wait for the io_context.
  // The reactor still makes progress when it polls (no latency lost while
  // it runs); the cost is a second thread woken by each arrival, a look-in
  // by that thread once a millisecond for 10 ms after the reactor last
  // polled (for acknowledgements the reactor held back), and a mutex on
  // the provider's entry points. No effect on verbs (the NIC serves them
  // itself).
  bool progress_thread = false;
  // GPU device memory given as a plain buffer to a put or get (see README
  // "GPU memory"): where the device reaches GPU memory (GPUDirect RDMA;
  // tcp: its CUDA copies) it is registered and used in place, except that
  // a transfer of at most gpu_bounce_threshold bytes (0: none) goes
  // through the staging buffers; where it does not, or with gpu_staging
  // set, every transfer goes through the staging pipeline: chunks of
  // gpu_staging_chunk bytes through host buffers (gpu_staging_buffers of
  // them for the fabric, two at most per transfer), the copy of one chunk
  // overlapping the transfer of the one before. The connection's later
  // operations wait for a staged transfer (they start, in order, once it
  // is done; a held one can be cancelled): nothing overtakes its data,
  // and async_flush and a close after it cover it. Messages of GPU
  // memory: eager ones are copied through pool buffers; rendezvous ones
  // without a direct path (or with gpu_staging) through a host copy of the
  // whole message.
  bool gpu_staging = false;
  std::size_t gpu_bounce_threshold = 0;               // 0..2^30
  std::size_t gpu_staging_chunk = std::size_t{1} << 20;  // 4096..2^30
  std::uint32_t gpu_staging_buffers = 4;               // 2..1024
  // How long a rendezvous source's registration outlives its send where
  // the fabric may deliver a stale duplicate of the peer's READ late
  // (transport::capabilities::late_duplicates: InfiniBand, RoCE): the
  // peer's NIC resends a READ after its ack timeout (67 ms with anydoor's
  // verbs provider), and a resent request still on its way when the READ
  // completes is executed again, key checked anew; a key gone by then
  // fails the connection. The default covers one resend. At most 256
  // sources and 64 MiB are held (past either, the oldest go early; a
  // larger one is not held); while held, peers of this fabric that have
  // the key can read that buffer (SECURITY.md). 0: not held. 0..10 s.
  std::chrono::milliseconds late_read_grace{100};
};

struct fabric_stats {
  reactor_stats reactor;
  buffer_pool_stats pool;
  std::uint64_t connections = 0;         // open now
  std::uint64_t accepted = 0;
  std::uint64_t connected = 0;
  std::uint64_t refused = 0;             // connection attempts refused: handshakes that failed (either
                                         // side: auth, version, garbage, too slow) or found the fabric full
  registration_cache_stats cache;
  // With srq_buffers: receives in the shared queue now, and how many of
  // them no connection has been granted (what a new connection or a
  // growing window can still get).
  std::uint64_t srq_posted = 0;
  std::uint64_t srq_spare = 0;
  // Memory of rendezvous messages delivered by async_receive, kept for the
  // next ones once released (registered, local access only): at most 8
  // blocks of at most 2 MiB, 8 MiB in all; one unused for 2 to 3 s is freed.
  std::uint64_t kept_blocks = 0;
  std::uint64_t kept_bytes = 0;
  // Registrations of rendezvous sources whose sends have ended, held
  // late_read_grace longer (fabric_options): now, and how many went before
  // their time because the 256 or 64 MiB were reached (or one was larger).
  std::uint64_t retired_sources = 0;
  std::uint64_t retired_bytes = 0;
  std::uint64_t retired_early = 0;
};

// One connection of a fabric, for monitoring (fabric::connection_reports).
struct connection_report {
  std::uint32_t qp_num = 0;
  transport::path_info path;  // where its traffic goes (tcp: the socket's addresses); empty during setup
  bool open = false;          // false: failed or closed, its handle not yet dropped
  connection_stats stats;
  // Its queue pair (a device resource) is still allocated: until the
  // connection object goes (its handle dropped and its work requests back),
  // or at once when the fabric's completion queue is lost.
  bool holds_queue_pair = false;
};

// How many connections of a fabric failed with each error (a local abort,
// connection_closed, is not counted).
struct failure_count {
  error_code error;
  std::uint64_t count = 0;
};

class acceptor;

class fabric {
 public:
  // Opens the device (provider=auto: verbs when a device with an active port
  // exists, else tcp; logged). Throws std::system_error.
  fabric(asio::io_context& io, fabric_options options = {});
  // Destroy it on its io_context's thread, or while no run() is active:
  // connection attempts still in progress are stopped (within ~50 ms; a
  // host name being resolved finishes resolving first) and complete with
  // operation_canceled when the io_context runs next.
  ~fabric();
  fabric(const fabric&) = delete;
  fabric& operator=(const fabric&) = delete;

  std::string_view provider() const noexcept;
  transport::device& device() noexcept;
  transport::protection_domain& protection_domain() noexcept;
  const fabric_options& options() const noexcept;
  fabric_stats stats() const noexcept;
  // For monitoring (anydoor/metrics.hpp), on the fabric's thread: every
  // connection it holds, and its connections' failures by error.
  std::vector<connection_report> connection_reports() const;
  std::vector<failure_count> failure_counts() const;
  asio::io_context::executor_type get_executor() const noexcept;

  // Registers [memory.data(), +size) with exactly `acc` (local reads are
  // always allowed), in pieces when it is larger than the device registers
  // at once (max_piece_bytes); the region deregisters when destroyed.
  // GPU device memory (cudaMalloc) is registered as the device reaches it
  // (GPUDirect RDMA; tcp: its CUDA copies), never in pieces (see README
  // "GPU memory"). Throws std::system_error: errc::invalid_argument (empty
  // memory; remote write or atomics without local_write, as verbs
  // requires; GPU memory past its allocation), registration_failed;
  // not_supported for CUDA managed memory, for GPU memory on a device that
  // does not reach it, and for GPU memory with remote_atomic where the
  // device reaches it by copies (tcp).
  memory_region register_memory(std::span<std::byte> memory, access acc);

  // The registration cache (one-sided operations on plain buffers):
  // a buffer is registered on first use (whole pages, local access only,
  // never exposed to peers) and stays registered for later operations
  // until it is evicted (cache_max_entries, cache_max_bytes; never while an
  // operation uses it) or forgotten. Lifetime contract: before memory that
  // one-sided operations used is unmapped or freed back to the system
  // (munmap, a large free(), cudaFree of GPU memory), call forget_memory
  // for it; a registration
  // that outlives its memory keeps the old pages and would move data to
  // memory the program no longer sees. Returns how many registrations it
  // dropped (those in use go when their operations end).
  std::size_t forget_memory(const void* addr, std::size_t length) noexcept;

  // Listens on host:port (port 0: a free one). Throws std::system_error.
  acceptor listen(const std::string& host, std::uint16_t port);
  // Serves the connection requests of a listener made elsewhere (for
  // example one of a reactor_group's shares of its listening socket): the
  // acceptor checks, accepts and authenticates them on this fabric, as for
  // its own. The listener's requests must be for this fabric's provider.
  // Throws std::system_error (errc::invalid_argument: no listener).
  acceptor listen(std::unique_ptr<transport::listener> listener);

  // Connects to "host:port". void(error_code, connection). Errors:
  // errc::connection_refused, connection_rejected, authentication_failed,
  // version_mismatch, protocol_error, timed_out, address_error,
  // too_many_connections (also: the listener's application did not accept
  // within its handshake_timeout), invalid_argument (a malformed address),
  // operation_canceled (the fabric was destroyed meanwhile).
  template <class Token>
  auto async_connect(std::string_view address, Token&& token) {
    return asio::async_initiate<Token, void(error_code, connection)>(
        [this](auto handler, std::string addr) {
          auto* n = new detail::pending_handler;  // setup path: one allocation per connect
          n->template store<connection>(std::move(handler), get_executor(), nullptr, nullptr);
          // Setup runs on the fabric's thread (a call from another thread is
          // posted there, not raced with run()).
          asio::dispatch(get_executor(), [fab = state_, n, a = std::move(addr)]() mutable {
            start_connect(std::move(fab), std::move(a), n);
          });
        },
        token, std::string(address));
  }

 private:
  static void start_connect(std::shared_ptr<detail::fabric_state> fab, std::string address,
                            detail::pending_handler* h);
  std::shared_ptr<detail::fabric_state> state_;
};

class acceptor {
 public:
  acceptor() noexcept;
  acceptor(acceptor&&) noexcept;
  acceptor& operator=(acceptor&&) noexcept;
  ~acceptor();  // closes

  std::uint16_t port() const noexcept;
  // The fabric's io_context executor. Throws std::system_error
  // (errc::invalid_state) when not listening (moved from).
  asio::io_context::executor_type get_executor() const { return executor(); }

  // The next connection. void(error_code, connection). Connection attempts
  // that fail (a wrong auth token, another version, garbage, a client too
  // slow to finish its handshake, a fabric at max_connections) are refused
  // (the client gets the reason), logged and counted in
  // fabric_stats::refused; they never complete this operation, so an accept
  // loop keeps serving. Errors: operation_canceled (closed), the listener's
  // own failure. One accept at a time (else errc::invalid_state).
  template <class Token>
  auto async_accept(Token&& token) {
    return asio::async_initiate<Token, void(error_code, connection)>(
        [this](auto handler) {
          auto* n = new detail::pending_handler;  // setup path: one allocation per accept
          n->template store<connection>(std::move(handler), executor(), nullptr, nullptr);
          asio::dispatch(executor(), [s = state_, n] { start_accept(s, n); });
        },
        token);
  }

  // Stops listening (on the fabric's thread): a pending accept completes
  // with operation_canceled, and the listening socket (or rdma_cm id) is
  // closed within about 100 ms, so later attempts are refused at once.
  void close() noexcept;

 private:
  friend class fabric;
  struct state;
  explicit acceptor(std::shared_ptr<state> s) noexcept;
  asio::io_context::executor_type executor() const;  // throws when not listening
  static void start_accept(const std::shared_ptr<state>& s, detail::pending_handler* h);
  std::shared_ptr<state> state_;
};

}  // namespace anydoor
