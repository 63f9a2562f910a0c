// The provider contract: the NIC as anydoor's runtime sees it. Two providers
// implement it: "verbs" (rdma-core) and "tcp" (a software RC NIC over TCP).
//
// Threading: a completion queue, and the queue pairs whose send CQ it is, are
// driven by one thread at a time (the thread that polls it also posts to those
// queue pairs). Different completion queues of one device may be driven by
// different threads. Memory registration is thread-safe. Connection setup
// (device::connect, listener::get_request, connection_request::accept and
// reject) blocks, and may run on another thread while the queue pair's
// completion queues are being polled, provided nothing else uses that queue
// pair until the call returns: the provider publishes the connected queue pair
// to its completion queues safely. Create queue pairs and post their first
// receives on the completion queue's thread. A blocking setup call given a
// std::stop_token returns within about 50 ms of a stop request, with
// std::errc::operation_canceled, leaving the queue pair unconnected; name
// resolution (getaddrinfo) cannot be interrupted: a host name may delay
// the stop by its resolver's timeout (numeric addresses do not).
#pragma once

#include <anydoor/transport/types.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stop_token>
#include <string>
#include <system_error>
#include <vector>

namespace anydoor::transport {

// A registration (ibv_mr). Destroying it deregisters: the keys stop working,
// locally and remotely.
class memory_region {
 public:
  virtual ~memory_region() = default;
  memory_region(const memory_region&) = delete;
  memory_region& operator=(const memory_region&) = delete;

  void* addr() const noexcept { return addr_; }
  std::size_t length() const noexcept { return length_; }
  std::uint32_t lkey() const noexcept { return lkey_; }
  std::uint32_t rkey() const noexcept { return rkey_; }
  transport::access access() const noexcept { return access_; }

  // A scatter/gather element for [offset, offset + len) of this region.
  sge slice(std::size_t offset, std::uint32_t len) const noexcept {
    return {reinterpret_cast<std::uint64_t>(static_cast<std::byte*>(addr_) + offset), len, lkey_};
  }

 protected:
  memory_region(void* addr, std::size_t length, std::uint32_t lkey, std::uint32_t rkey,
                transport::access acc) noexcept
      : addr_(addr), length_(length), lkey_(lkey), rkey_(rkey), access_(acc) {}
  // For a wrapper whose remote key is known only later (a window's).
  void set_remote_key(std::uint32_t rkey) noexcept { rkey_ = rkey; }
  // For a wrapper whose keys are known only once it has registered.
  void set_keys(std::uint32_t lkey, std::uint32_t rkey) noexcept {
    lkey_ = lkey;
    rkey_ = rkey;
  }

 private:
  void* addr_;
  std::size_t length_;
  std::uint32_t lkey_;
  std::uint32_t rkey_;
  transport::access access_;
};

// A type-2 memory window (ibv_mw of IBV_MW_TYPE_2): a range of a
// registration that exactly one queue pair can reach remotely. It starts
// unbound (its rkey opens nothing); a bind_window work request posted on a
// queue pair binds it, once, to a range of a registration made with
// access::mw_bind, and gives it a new rkey: rkey() returns it as soon as
// post_send has accepted the request, and the bind is in effect for every
// request the peer sends after that one was posted (RC order). Requests
// arriving on any other queue pair, even of the same protection domain,
// find the key invalid (remote_access_error). Destroying the window
// revokes it (ibv_dealloc_mw): the key stops working at once. Destroy the
// windows bound to a registration before the registration (verbs refuses
// to deregister memory with windows bound), and never while a bind of it is
// still on the queue pair (wait for its completion or flush).
// Known deviation: rxe (Linux 6.1) checks an access through a window
// against its registration's range, not the window's; binding windows over
// whole registrations (as the runtime does) makes the two the same.
class memory_window {
 public:
  virtual ~memory_window() = default;
  memory_window(const memory_window&) = delete;
  memory_window& operator=(const memory_window&) = delete;

  std::uint32_t rkey() const noexcept { return rkey_; }
  // A bind of it was accepted by post_send (whether it then completed is
  // its completion's to say: a flushed bind binds nothing on verbs).
  bool bound() const noexcept { return bound_; }

 protected:
  explicit memory_window(std::uint32_t rkey) noexcept : rkey_(rkey) {}
  // A provider's post_send, when it accepts the bind.
  void set_bound(std::uint32_t rkey) noexcept {
    rkey_ = rkey;
    bound_ = true;
  }

 private:
  std::uint32_t rkey_;
  bool bound_ = false;
};

// How a completion queue is made (device::create_cq).
struct cq_options {
  // A provider whose software NIC runs in the target's process (tcp:
  // completion_queue::progress_in_poll) makes progress on a thread of the
  // queue's own as well as in poll(): the peers' one-sided operations on
  // this side's memory, and their messages into posted receives, are
  // executed and answered while the queue's owner does not poll (busy, or
  // asleep), as a NIC does; completions wait in the queue (notify_fd()
  // becomes readable once armed, as always). poll() still makes progress
  // itself, so an owner that polls keeps its latency. Every entry point of
  // the queue and of its queue pairs then takes the queue's mutex, and its
  // queue pairs must have it as both their send and receive completion
  // queue (create_qp: errc::invalid_argument otherwise). The thread starts
  // with the queue, inherits the creating thread's CPU affinity and is
  // joined when the queue is destroyed. No effect on a provider whose NIC
  // needs nothing from the target (verbs).
  bool progress_thread = false;
  // The owner promises to arm the queue again before it sleeps on
  // notify_fd() whenever a poll() returned completions (the runtime's
  // reactor does). A completion that the owner's own poll() makes (tcp:
  // progress_in_poll) and returns then does not make an armed queue's
  // notify_fd() readable, which would only wake the owner for nothing; the
  // arm is spent all the same. Without it, such a completion notifies, as
  // a NIC's event does whoever polls it: a consumer that polls once and
  // sleeps without arming again is woken. No effect on completions made
  // elsewhere (the progress thread's, a NIC's), nor on verbs.
  bool owner_rearms = false;
};

// A completion queue (ibv_cq with its completion channel).
class completion_queue {
 public:
  virtual ~completion_queue() = default;

  // Moves up to out.size() completions into out; returns how many. With the
  // tcp provider this is also where progress happens. An overflowed queue
  // returns 0 and sets ec to errc::cq_overflow from then on.
  virtual std::size_t poll(std::span<completion> out, std::error_code& ec) noexcept = 0;

  // Request a notification (ibv_req_notify_cq): the next completion makes
  // notify_fd() readable. Poll again after arming: completions that arrived
  // before the arm do not notify.
  virtual std::error_code arm() noexcept = 0;

  // A non-blocking file descriptor that becomes readable after arm() when a
  // completion arrives, or, where progress_in_poll(), when there is
  // progress to make (tcp without its progress thread). Owned by the queue.
  virtual int notify_fd() const noexcept = 0;

  // Consumes pending notifications (ibv_get_cq_event + ibv_ack_cq_events);
  // returns how many were consumed. Never blocks.
  virtual std::size_t ack_events() noexcept = 0;

  virtual std::uint32_t depth() const noexcept = 0;
  virtual cq_counters counters() const noexcept = 0;

  // True where poll() is also what executes the peers' one-sided operations
  // on this side's memory and answers them (tcp: the software NIC runs in
  // the target's process): its owner must poll when notify_fd() becomes
  // readable even with nothing of its own pending. notify_fd() is then
  // readable, armed or not, while there is progress to make. False for a
  // NIC, which needs nothing from the target.
  virtual bool progress_in_poll() const noexcept { return false; }

  // True where arm() itself makes notify_fd() readable when completions
  // are already queued or work is already waiting for poll() (tcp: input
  // read but not processed, or left in a socket by a pass that stopped at
  // its limits), and what comes after the arm makes it readable as usual:
  // the poll after arming then finds nothing the fd would not report, and
  // a consumer may skip it (even one that watches the fd edge-triggered).
  // False for a NIC (ibv_req_notify_cq notifies only for completions that
  // arrive after it: poll again after arming).
  virtual bool arm_reports_queued() const noexcept { return false; }
};

// A shared receive queue (ibv_srq): receives that every queue pair created with it (qp_attributes::srq)
// takes from, oldest first, so that receive memory does not grow with the number of queue pairs. A receive
// taken by a queue pair completes on that queue pair's receive completion queue, with its qp_num. A queue
// pair that goes to error flushes only the receive it was filling; the others stay posted for the rest.
// Destroyed, it flushes that receive too (the completion may come after the destroy: verbs keeps the QP,
// in error, until its last receive is back). Size completion queues for the shared queue's receives too:
// the providers' "can overflow" warning counts queue pairs' own work requests only. An empty queue turns
// a send back with an RNR NAK, as an empty receive queue does. Destroy its queue pairs before it (verbs
// refuses otherwise; tcp logs an error); one still kept as above goes with it (or with its CQ or domain).
// (Conformance: srq.cpp.)
class shared_receive_queue {
 public:
  virtual ~shared_receive_queue() = default;

  // ibv_post_srq_recv; any thread. Either every request is accepted or
  // none is (*bad: the offending one): errc::invalid_argument (more sges
  // than max_sge), errc::queue_full (the queue holds max_wr receives).
  // (As for queue_pair::post_send, a device error past these checks leaves
  // the requests before *bad posted.)
  virtual std::error_code post_recv(std::span<const recv_request> wrs, std::size_t* bad = nullptr) noexcept = 0;

  // Arms the limit (ibv_modify_srq with IBV_SRQ_LIMIT): once fewer than
  // `limit` receives remain posted, limit_reached() reports it, once, and
  // the limit disarms (arm it again to hear again). 0 disarms. errc::
  // invalid_argument above max_wr.
  virtual std::error_code arm_limit(std::uint32_t limit) noexcept = 0;

  // Whether the armed limit was crossed since the last call; consumes the
  // report. Any thread. (verbs: the device's asynchronous event; this call
  // reads pending events first.)
  virtual bool limit_reached() noexcept = 0;

  // The queue's actual size (a device may round max_wr up).
  virtual const srq_attributes& attributes() const noexcept = 0;
};

// A reliable-connected queue pair (ibv_qp of type IBV_QPT_RC).
class queue_pair {
 public:
  virtual ~queue_pair() = default;

  virtual std::uint32_t qp_num() const noexcept = 0;
  virtual qp_state state() const noexcept = 0;

  // State transitions (ibv_modify_qp). Allowed: reset->init, init->rtr and
  // rtr->rts (need a connected peer, normally done by connect/accept),
  // any->error, any->reset. Anything else is errc::invalid_state.
  // ->reset discards outstanding work without completions, as verbs does:
  // that includes a shared queue's receive the queue pair was filling (its
  // wr_id never comes back). Move to error and drain first to get every
  // receive back.
  virtual std::error_code modify(qp_state next) noexcept = 0;

  // Posts the whole span with one doorbell. Either every request is accepted
  // or none is: on error, *bad (if given) is the index of the offending one.
  // The requests, their gather lists and the bytes of inline requests are
  // copied before it returns (ibv_post_send's rule): the caller may reuse
  // that memory at once; the memory a non-inline sge points to must stay
  // until the request completes.
  // (Every error named here is found before anything is posted. An error
  // from the device itself past those checks, a system error code, leaves
  // the requests before *bad posted, as ibv_post_send does; the runtime
  // fails the connection on any post error.)
  // errc::invalid_argument: too many sges, inline data above max_inline_data
  // or on a read/atomic, an atomic without exactly one 8-byte sge or with a
  // remote address that is not 8-byte aligned. errc::queue_full: the send
  // queue has no room (unsignaled requests hold their slot until a later
  // signaled one completes).
  // bind_window (work_request::bind; no sges, not inline): errc::
  // invalid_argument unless the window is this protection domain's and
  // unbound, the region this domain's with access::mw_bind, the range
  // non-empty and inside the region, the rights non-empty remote_* bits,
  // and, for remote_write or remote_atomic, the region has local_write.
  // Refused unless the state is rts (or error: then each request completes
  // with work_request_flushed).
  virtual std::error_code post_send(std::span<const work_request> wrs,
                                    std::size_t* bad = nullptr) noexcept = 0;

  // Likewise for receives; allowed in init, rtr, rts and error.
  // errc::invalid_argument on a queue pair that receives from a shared
  // receive queue.
  virtual std::error_code post_recv(std::span<const recv_request> wrs,
                                    std::size_t* bad = nullptr) noexcept = 0;

  // Sets which remote operations the queue pair executes from now on (see
  // qp_attributes::remote_access; ibv_modify_qp with IBV_QP_ACCESS_FLAGS):
  // in reset (applied when it moves to init), init and rts; bits other than
  // remote_* are ignored. A request already executing finishes under the
  // old rights. errc::invalid_state in rtr (verbs has no rtr->rtr change)
  // and in error.
  virtual std::error_code set_remote_access(access acc) noexcept = 0;

  virtual const qp_attributes& attributes() const noexcept = 0;
  virtual qp_counters counters() const noexcept = 0;
  // The path a connected queue pair uses (the GIDs on verbs); zeros before
  // it is connected.
  virtual path_info path() const noexcept = 0;

  // The runtime took a message of the peer's from this queue pair while its
  // accept may still be running (any thread). A provider whose passive side
  // waits for the connection manager's word that the peer is connected
  // (rdma_cm's RTU, which the network can lose) takes the message as that
  // word: the peer could not have sent it otherwise
  // (capabilities::established_by_message).
  virtual void note_peer_message() noexcept {}
};

// How a device without direct access reaches memory the CPU cannot load
// or store (GPU device memory): copies to and from host memory, which the
// caller of protection_domain::register_copied provides (the runtime: CUDA
// copies). The device calls it from its own threads, several at once, with
// ranges inside the registration: implementations are thread-safe. A copy
// that fails is reported as the error, never thrown.
class memory_copier {
 public:
  virtual ~memory_copier() = default;
  // [src, src + n) of the copied memory into host memory at dst.
  virtual std::error_code to_host(void* dst, const void* src, std::size_t n) noexcept = 0;
  // Host memory [src, src + n) into the copied memory at dst.
  virtual std::error_code to_device(void* dst, const void* src, std::size_t n) noexcept = 0;
  // A host buffer of n bytes for the device's copies to and from this
  // memory (its bounce buffers): memory those copies move fastest (CUDA:
  // page-locked, which the GPU reaches by DMA, where pageable memory is
  // copied once more by the driver, in small pieces), usable with any
  // copier; null when there is no memory. It may outlive the copier. The
  // default: ordinary memory.
  virtual std::shared_ptr<std::byte> bounce_buffer(std::size_t n) noexcept;
  // Copies as to_host and to_device, started now and waited for by
  // finish(), so that the device overlaps them with other work (the tcp
  // provider: the network). The destination's bytes are there, and the
  // source is no longer read, only once finish() has returned; a failure
  // shows in the start's result or in finish()'s. finish() waits for
  // every copy the copier started (from any thread). The defaults copy at
  // once (finish() has nothing to wait for).
  virtual std::error_code start_to_host(void* dst, const void* src, std::size_t n) noexcept {
    return to_host(dst, src, n);
  }
  virtual std::error_code start_to_device(void* dst, const void* src, std::size_t n) noexcept {
    return to_device(dst, src, n);
  }
  virtual std::error_code finish() noexcept { return {}; }
};

// A protection domain (ibv_pd): registrations and queue pairs live in one.
class protection_domain {
 public:
  virtual ~protection_domain() = default;

  // Registers [addr, addr + length) with exactly the given access. Throws
  // std::system_error (errc::registration_failed, errc::invalid_argument).
  virtual std::unique_ptr<memory_region> register_memory(void* addr, std::size_t length,
                                                         access acc) = 0;

  // Registers [offset, offset + length) of the buffer behind the dma-buf
  // file descriptor `fd` (ibv_reg_dmabuf_mr), addressed by work requests
  // and by peers as [iova, iova + length): the region's addr() is iova,
  // and slice() and remote accesses use that range. The fd stays the
  // caller's: the registration holds its own reference to the buffer, so
  // the fd may be closed at once. Throws std::system_error:
  // errc::not_supported when caps().dmabuf is false (rxe, siw);
  // errc::invalid_argument for a negative fd, a zero length, a range that
  // wraps (offset or iova) or ends past the buffer, iova and offset at
  // different places within a 4 KiB page, or access as for
  // register_memory; errc::registration_failed when the device refuses the
  // buffer (not a dma-buf, not mappable) or has no room. An iova is not a
  // CPU address: gather lists of inline sends (which the CPU copies) must
  // not point into such a region. tcp maps the buffer: a memfd truncated
  // under a registration faults the process (seal it, F_SEAL_SHRINK).
  virtual std::unique_ptr<memory_region> register_dmabuf(int fd, std::uint64_t offset, std::size_t length,
                                                         std::uint64_t iova, access acc) = 0;

  // Registers [addr, addr + length) of memory the CPU cannot reach (GPU
  // device memory), which the device reads and writes through `copier`
  // (held until the region is gone): the region's addr() is addr, and
  // work requests and peers use it as any other. Throws std::system_error:
  // errc::not_supported where caps().copied_memory is false (verbs: a NIC
  // reaches GPU memory directly or not at all), and for remote_atomic
  // access (an atomic needs the memory itself); errc::invalid_argument as
  // register_memory, and for a null copier; errc::registration_failed
  // when the device has no room. Inline sends must not gather from such a
  // region (the CPU copies them).
  virtual std::unique_ptr<memory_region> register_copied(void* addr, std::size_t length, access acc,
                                                         std::shared_ptr<memory_copier> copier);

  // Creates a queue pair in state reset. Throws std::system_error
  // (errc::invalid_argument: attributes out of range, completion queues or
  // a shared receive queue of another provider or domain).
  virtual std::unique_ptr<queue_pair> create_qp(const qp_attributes& attr) = 0;

  // Creates a shared receive queue. Throws std::system_error:
  // errc::not_supported when caps().max_srq is 0, errc::invalid_argument
  // when max_wr or max_sge is 0 or above the device's limit.
  virtual std::unique_ptr<shared_receive_queue> create_srq(const srq_attributes& attr) = 0;

  // Allocates an unbound type-2 memory window (ibv_alloc_mw). Throws
  // std::system_error: errc::not_supported when caps().memory_windows is
  // false, errc::registration_failed.
  virtual std::unique_ptr<memory_window> alloc_window() = 0;
};

// An incoming connection request (rdma_cm's RDMA_CM_EVENT_CONNECT_REQUEST).
class connection_request {
 public:
  virtual ~connection_request() = default;
  virtual std::span<const std::byte> private_data() const noexcept = 0;
  // Connects qp (state reset or init) to the requester and moves it to rts.
  virtual std::error_code accept(queue_pair& qp, std::span<const std::byte> private_data,
                                 std::stop_token stop) noexcept = 0;
  std::error_code accept(queue_pair& qp, std::span<const std::byte> private_data) noexcept {
    return accept(qp, private_data, std::stop_token{});
  }
  // Refuses the request; the requester's connect fails with connection_rejected.
  virtual void reject(std::span<const std::byte> private_data) noexcept = 0;
};

struct listen_options {
  // A connection attempt must complete its part of the handshake (tcp: the
  // hello; verbs: rdma_cm's establishment after accept) within this, or it
  // is dropped; attempts in progress do not delay each other.
  std::chrono::milliseconds handshake_timeout{2000};
  // Handshakes in progress at once; a new one beyond this drops the oldest.
  std::uint32_t max_pending = 256;
};

class listener {
 public:
  virtual ~listener() = default;
  // Readable when a request may be waiting (for a reactor).
  virtual int fd() const noexcept = 0;
  virtual std::uint16_t port() const noexcept = 0;
  // Waits up to timeout for the next complete request; nullptr with ec set
  // on failure (errc::timed_out when none came). Attempts that fail their
  // handshake (garbage, another wire version, too slow) are refused,
  // logged and counted in refused(); they never end the wait.
  virtual std::unique_ptr<connection_request> get_request(std::chrono::milliseconds timeout,
                                                          std::error_code& ec) noexcept = 0;
  // Connection attempts this listener refused itself (any thread).
  virtual std::uint64_t refused() const noexcept = 0;
};

struct connect_result {
  std::error_code ec;
  std::vector<std::byte> private_data;  // the peer's, from its accept or reject
};

// A device (ibv_context) with its connection manager.
class device {
 public:
  virtual ~device() = default;
  virtual std::string_view provider() const noexcept = 0;
  virtual std::string_view name() const noexcept = 0;
  virtual const capabilities& caps() const noexcept = 0;

  // The device's counters (reads sysfs on verbs: not for the data path).
  virtual device_counters counters() const = 0;

  virtual std::unique_ptr<protection_domain> alloc_pd() = 0;
  // Throws std::system_error when depth is 0 or above caps().max_cqe.
  virtual std::unique_ptr<completion_queue> create_cq(std::uint32_t depth, const cq_options& options) = 0;
  std::unique_ptr<completion_queue> create_cq(std::uint32_t depth) { return create_cq(depth, cq_options{}); }

  // Listens on host:port (port 0: any free port). Throws std::system_error.
  virtual std::unique_ptr<listener> listen(const std::string& host, std::uint16_t port,
                                           const listen_options& options = {}) = 0;

  // Connects qp (state reset or init) to a listener and moves it to rts.
  virtual connect_result connect(queue_pair& qp, const std::string& host, std::uint16_t port,
                                 std::span<const std::byte> private_data, std::chrono::milliseconds timeout,
                                 std::stop_token stop) noexcept = 0;
  connect_result connect(queue_pair& qp, const std::string& host, std::uint16_t port,
                         std::span<const std::byte> private_data, std::chrono::milliseconds timeout) noexcept {
    return connect(qp, host, port, private_data, timeout, std::stop_token{});
  }
};

struct device_options {
  std::string provider = "auto";  // auto | tcp | verbs (ANYDOOR_PROVIDER overrides)
  std::string name;               // device name; empty: the first usable (ANYDOOR_DEVICE overrides)
};

// Names of the providers built into this library.
std::vector<std::string> available_providers();

// Opens a device. provider=auto picks verbs when an RDMA device with an
// active port exists and the verbs provider is built, else tcp; the choice is
// logged. Throws std::system_error (errc::provider_unavailable, errc::no_device).
std::unique_ptr<device> open_device(const device_options& options = {});

}  // namespace anydoor::transport
