// Plain types of the provider contract. They mirror libibverbs closely:
// anything ibv_post_send / ibv_poll_cq can express, these can.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>

namespace anydoor::transport {

// Memory access flags (ibv_access_flags). Local read is always allowed.
enum class access : std::uint32_t {
  none = 0,
  local_write = 1u << 0,
  remote_write = 1u << 1,
  remote_read = 1u << 2,
  remote_atomic = 1u << 3,
  // Memory windows may be bound to the registration (IBV_ACCESS_MW_BIND);
  // a window's remote access needs no remote_* bit here.
  mw_bind = 1u << 4,
};
// The remote_* bits.
inline constexpr access remote_access_bits =
    static_cast<access>((1u << 1) | (1u << 2) | (1u << 3));
constexpr access operator|(access a, access b) noexcept {
  return static_cast<access>(static_cast<std::uint32_t>(a) | static_cast<std::uint32_t>(b));
}
constexpr access operator&(access a, access b) noexcept {
  return static_cast<access>(static_cast<std::uint32_t>(a) & static_cast<std::uint32_t>(b));
}
constexpr bool has(access set, access flag) noexcept { return (set & flag) == flag; }

// Completion status; the numeric values equal enum ibv_wc_status.
enum class wc_status : std::uint8_t {
  success = 0,
  local_length_error = 1,
  local_qp_operation_error = 2,
  local_eec_operation_error = 3,
  local_protection_error = 4,
  work_request_flushed = 5,
  memory_window_bind_error = 6,
  bad_response = 7,
  local_access_error = 8,
  remote_invalid_request = 9,
  remote_access_error = 10,
  remote_operation_error = 11,
  retry_exceeded = 12,
  rnr_retry_exceeded = 13,
  local_rdd_violation = 14,
  remote_invalid_rd_request = 15,
  remote_aborted = 16,
  invalid_eec_number = 17,
  invalid_eec_state = 18,
  fatal = 19,
  response_timeout = 20,
  general_error = 21,
};
std::string_view to_string(wc_status s) noexcept;
const std::error_category& wc_category() noexcept;
inline std::error_code make_error_code(wc_status s) noexcept {
  return {static_cast<int>(s), wc_category()};
}

// Send-side operations (ibv_wr_opcode).
enum class opcode : std::uint8_t {
  send,
  send_with_imm,
  write,
  write_with_imm,
  read,
  fetch_add,
  compare_swap,
  bind_window,  // IBV_WR_BIND_MW: binds a type-2 memory window (work_request::bind)
};

// What a completion reports (ibv_wc_opcode).
enum class wc_opcode : std::uint8_t {
  send,
  write,
  read,
  compare_swap,
  fetch_add,
  recv,
  recv_rdma_with_imm,
  bind_window,
};
std::string_view to_string(opcode op) noexcept;
std::string_view to_string(wc_opcode op) noexcept;

// One scatter/gather element (ibv_sge): addr is a virtual address inside a
// registration of the same protection domain, lkey that registration's key.
struct sge {
  std::uint64_t addr = 0;
  std::uint32_t length = 0;
  std::uint32_t lkey = 0;
};

class memory_region;
class memory_window;

// What a bind_window request binds (ibv_mw_bind_info): `window` to
// [addr, addr + length) of `region`, for remote access `rights` (remote_*
// bits) through the posting queue pair only.
struct window_binding {
  memory_window* window = nullptr;
  const memory_region* region = nullptr;
  std::uint64_t addr = 0;
  std::uint64_t length = 0;
  access rights = access::none;
};

// A send-queue work request (ibv_send_wr). The provider copies it (and the
// scatter/gather list) at post time; the memory it points at must stay valid
// until the request completes, except with inline_data, which is copied.
struct work_request {
  std::uint64_t wr_id = 0;
  opcode op = opcode::send;
  std::span<const sge> sg_list{};
  bool signaled = true;
  bool inline_data = false;
  std::uint32_t imm = 0;            // send_with_imm, write_with_imm (host order)
  std::uint64_t remote_addr = 0;    // write, read, atomics
  std::uint32_t rkey = 0;           // write, read, atomics
  std::uint64_t compare_add = 0;    // fetch_add: the addend; compare_swap: the compare value
  std::uint64_t swap = 0;           // compare_swap: the new value
  window_binding bind{};            // bind_window
};

// A receive-queue work request (ibv_recv_wr).
struct recv_request {
  std::uint64_t wr_id = 0;
  std::span<const sge> sg_list{};
};

// A work completion (ibv_wc).
struct completion {
  std::uint64_t wr_id = 0;
  wc_status status = wc_status::success;
  wc_opcode opcode = wc_opcode::send;
  std::uint32_t byte_len = 0;  // receives and reads: bytes placed
  std::uint32_t imm = 0;       // valid when has_imm
  bool has_imm = false;
  std::uint32_t qp_num = 0;
};

// Queue-pair states (ibv_qp_state, the subset an RC queue pair uses).
enum class qp_state : std::uint8_t { reset, init, rtr, rts, error };
std::string_view to_string(qp_state s) noexcept;

struct capabilities {
  std::uint32_t max_qp_wr = 0;
  std::uint32_t max_sge = 0;
  std::uint32_t max_inline = 0;
  std::uint64_t max_mr_size = 0;
  std::uint32_t max_msg_size = 0;
  std::uint32_t max_cqe = 0;
  std::uint32_t max_private_data = 0;
  bool atomics = false;
  // Memory the CPU does not address the usual way:
  // dmabuf: protection_domain::register_dmabuf works (ibv_reg_dmabuf_mr;
  //   tcp: any buffer fd it can map, a udmabuf or a memfd);
  // peer_memory: register_memory takes GPU device pointers (verbs with
  //   nvidia-peermem loaded).
  // copied_memory: register_copied works (the device reaches memory the
  //   CPU cannot, GPU device memory, through the caller's copier: tcp).
  bool dmabuf = false;
  bool peer_memory = false;
  bool copied_memory = false;
  bool memory_windows = false;  // type-2 memory windows (protection_domain::alloc_window)
  // Shared receive queues (protection_domain::create_srq): how many, and
  // receives each holds at most; 0: none.
  std::uint32_t max_srq = 0;
  std::uint32_t max_srq_wr = 0;
  // The connection manager's last handshake message (rdma_cm's RTU) can be
  // lost, and the listener then learns that the peer is connected only
  // from the peer's first message (queue_pair::note_peer_message) or after
  // the connection manager's own resend, seconds later: a connecting
  // runtime speaks first.
  bool established_by_message = false;
  // The fabric is packet-switched (InfiniBand, RoCE: not iWARP's TCP, not
  // the tcp provider) and may deliver a stale duplicate of a request late:
  // an RDMA READ that the requester resent, arriving after the requester
  // saw the READ complete and spoke again. The responder re-executes it
  // (IBTA's duplicate READ), checking the key anew, and a key revoked
  // meanwhile fails its queue pair (rxe: the NAK, then the queue pair in
  // error with no completion of its own). The runtime keeps the keys of
  // its rendezvous sources alive a moment after their sends where this is
  // set (fabric_options::late_read_grace); a region the application
  // deregisters right after a peer's READ is exposed to the same.
  bool late_duplicates = false;
};

// Creation attributes of a shared receive queue (ibv_srq_init_attr).
struct srq_attributes {
  std::uint32_t max_wr = 1024;  // receives it holds: 1..capabilities::max_srq_wr
  std::uint32_t max_sge = 1;    // scatter/gather elements per receive: 1..capabilities::max_sge
};

// Creation attributes of an RC queue pair (ibv_qp_init_attr + the
// retry-related part of ibv_qp_attr).
class completion_queue;
class shared_receive_queue;
struct qp_attributes {
  completion_queue* send_cq = nullptr;
  completion_queue* recv_cq = nullptr;
  // Receives come from this shared receive queue (of the same protection
  // domain) instead of the queue pair's own: max_recv_wr and max_recv_sge
  // are then ignored and queue_pair::post_recv is refused.
  shared_receive_queue* srq = nullptr;
  std::uint32_t max_send_wr = 128;
  std::uint32_t max_recv_wr = 128;
  std::uint32_t max_send_sge = 4;
  std::uint32_t max_recv_sge = 4;
  std::uint32_t max_inline_data = 64;
  std::uint8_t rnr_retry = 7;             // 0..7, 7 means retry forever
  std::uint32_t min_rnr_timer_us = 100;   // wait before resending after an RNR NAK
  // The remote operations this queue pair executes as a target (RDMA WRITE,
  // READ, atomics; verbs' qp_access_flags). Any other is refused whatever
  // its key, with the IB spec's Invalid Request NAK: remote_invalid_request
  // at the requester, and the connection fails (both queue pairs go to
  // error). Only the remote_* bits count. Change it with set_remote_access.
  access remote_access = access::remote_write | access::remote_read | access::remote_atomic;
};

// Counters a provider keeps per queue pair (verbs keeps only the first
// three: the NIC counts RNR NAKs per port, see device_counters).
struct qp_counters {
  std::uint64_t send_wrs = 0;        // work requests accepted by post_send
  std::uint64_t recv_wrs = 0;        // work requests accepted by post_recv
  std::uint64_t doorbells = 0;       // post_send calls that accepted work
  std::uint64_t rnr_naks_sent = 0;   // receiver side: sends that found no receive
  std::uint64_t rnr_naks_received = 0;
  std::uint64_t retransmits = 0;     // requests sent again after an RNR NAK
  std::uint64_t tx_syscalls = 0;     // provider-specific (tcp: sendmsg calls)
  std::uint64_t rx_syscalls = 0;     // provider-specific (tcp: recv calls)
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_received = 0;
};

// A device's own counters since it came up (verbs: the port's sysfs
// hw_counters; tcp: every queue pair of the device summed). A counter the
// device does not keep is empty: callers that must see one check it.
struct device_counters {
  std::optional<std::uint64_t> rnr_naks_sent;       // responder: a send found no receive posted
  std::optional<std::uint64_t> rnr_naks_received;   // requester: the peer had no receive posted
  std::optional<std::uint64_t> rnr_retry_exceeded;  // requester: rnr_retry ran out (the request failed)
  std::string source;  // where they were read (a sysfs directory), or why there are none
  // Transport retries, read where the RNR counters are (verbs: port-wide;
  // tcp keeps none: the kernel's TCP retransmits for it).
  std::optional<std::uint64_t> transport_retries;         // requester: requests sent again (ACK timeout)
  std::optional<std::uint64_t> transport_retry_exceeded;  // requester: retry_cnt ran out (the request failed)
  // Asynchronous events this device object has taken (verbs:
  // ibv_get_async_event, every type), and the errors among them (CQ, QP,
  // SRQ, port and device errors). Empty where the provider has no event
  // channel (tcp).
  std::optional<std::uint64_t> async_events;
  std::optional<std::uint64_t> async_errors;
};

// Where a connected queue pair's traffic goes (ibv_query_qp's address
// vector; for logs and tools).
struct path_info {
  int sgid_index = -1;                  // verbs: the source GID's index; -1: none (tcp, iWARP)
  std::array<std::uint8_t, 16> sgid{};  // verbs: source and destination GIDs;
  std::array<std::uint8_t, 16> dgid{};  // tcp: the socket's addresses (IPv4 as ::ffff:a.b.c.d)
};

struct cq_counters {
  std::uint64_t polls = 0;
  std::uint64_t empty_polls = 0;
  std::uint64_t completions = 0;
  std::uint64_t events = 0;
};

}  // namespace anydoor::transport

template <>
struct std::is_error_code_enum<anydoor::transport::wc_status> : std::true_type {};
