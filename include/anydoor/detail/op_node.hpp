// An operation waiting inside a connection: pooled per fabric (a free list
// that grows to the high-water mark and is then reused), so waiting
// allocates nothing in steady state.
#pragma once

#include <anydoor/detail/pending_handler.hpp>
#include <anydoor/memory.hpp>
#include <anydoor/transport/provider.hpp>

#include <boost/asio/buffer.hpp>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace anydoor::detail {

class connection_impl;
struct piece_table;

enum class op_kind : std::uint8_t {
  send,
  receive_message,
  receive_buffer,
  close,
  // one-sided (they queue with the sends, in order)
  put,
  get,
  put_notify,
  fetch_add,
  compare_swap,
  register_memory,  // connection-scoped: binds a memory window (in n->mr, a scoped region)
  flush,
  receive_notification,
};
constexpr bool is_onesided(op_kind k) noexcept { return k >= op_kind::put && k <= op_kind::flush; }

// Where an operation is.
enum class op_phase : std::uint8_t {
  queued,       // waits for credits, a buffer, a send slot (send) or for a message (receive)
  posted,       // on the wire (in part or whole): a rendezvous send waits for the peer's fin, a
                // receive reads, a one-sided operation or flush waits for its completion
  done,
};

inline constexpr std::size_t kMaxGather = 16;  // buffers in one async_send
inline constexpr std::size_t kInlinePut = 64;  // the largest put copied when it starts and posted inline

// What every operation touches comes first (a few cache lines), the rarer
// and larger parts after the handler.
struct op_node {
  op_node* next = nullptr;
  op_node* prev = nullptr;
  connection_impl* owner = nullptr;
  op_kind kind = op_kind::send;
  op_phase phase = op_phase::queued;
  std::uint8_t nbufs = 0;
  bool stalled_credit = false;  // counted once per operation
  bool stalled_buffer = false;
  std::uint32_t cookie = 0;  // rendezvous (either side)
  std::uint64_t length = 0;  // send: total bytes; receive: bytes of the message being read
  asio::mutable_buffer dest{};  // receive_buffer
  pending_handler handler;
  // send
  std::array<asio::const_buffer, kMaxGather> bufs{};
  std::chrono::steady_clock::time_point deadline{};  // send waiting for a pool buffer; a kept block: its age
  // rendezvous (either side); the memory first, so that its registration
  // (destroyed before it) never outlives it
  std::unique_ptr<std::byte[]> large;  // receive_message of a rendezvous message
  std::unique_ptr<transport::memory_region> mr;
  // one-sided: local pieces in bufs[0, nbufs) with their keys, the remote
  // range, the operands and the result
  std::array<const memory_region*, kMaxGather> regions{};
  std::array<std::uint32_t, kMaxGather> lkeys{};
  std::array<void*, kMaxGather> pins{};  // registration-cache entries held
  // Local memory registered in pieces (bit i: bufs[i] lies in split[i],
  // whose table gives its keys; lkeys[i] is then unused). Held until the
  // operation is released.
  std::array<std::shared_ptr<const piece_table>, kMaxGather> split{};
  std::uint16_t split_mask = 0;
  std::uint8_t npins = 0;
  bool read_only = false;  // a piece came from a const buffer
  // A one-sided operation held behind a staged transfer, checked and keyed
  // when it was issued (prepare_onesided): its local memory is not looked
  // at again when it is released.
  bool prepared = false;
  // GPU device memory: send, bit i: bufs[i] is; receive_buffer, bit 0: dest is.
  std::uint16_t device_mask = 0;
  // A small put of host memory: its bytes, copied when it started (while
  // its region was checked valid), posted inline from here.
  std::uint8_t inline_len = 0;
  std::array<std::byte, kInlinePut> inline_bytes;
  // Large transfers start in pieces as the send queue drains: the next
  // local piece (bufs[cur_buf] at cur_off) and the bytes already issued.
  std::uint8_t cur_buf = 0;
  std::uint64_t cur_off = 0;
  std::uint64_t issued = 0;
  remote_region remote{};
  std::uint64_t operand = 0;  // fetch_add: the addend; compare_swap: the expected value; flush: the target;
                              // register_memory: the access
  std::uint64_t operand2 = 0;  // compare_swap: the new value
  std::uint64_t result = 0;    // atomics: the value before
  std::uint32_t value = 0;     // put_notify: the notification's value
  notification note{};         // receive_notification
};

// Adds a piece's size to an operation's length: false when the sum would
// wrap around (pieces that cannot all exist; the operation is then
// refused with invalid_argument, never sized by the wrapped sum).
inline bool add_length(std::uint64_t& length, std::size_t size) noexcept {
  if (size > ~std::uint64_t{0} - length) return false;
  length += size;
  return true;
}

// Fills a one-sided operation's local pieces (empty ones are skipped);
// more than kMaxGather, a piece reaching the end of the address space, or
// sizes that add up past 2^64 mark it invalid (nbufs = 0xff).
void set_local(op_node& n, std::span<const local_range> ranges) noexcept;

}  // namespace anydoor::detail
