// An operation waiting inside a connection: pooled per connection (a free
// list that grows to the high-water mark and is then reused), so waiting
// allocates nothing in steady state.
#pragma once

#include <anydoor/detail/pending_handler.hpp>
#include <anydoor/transport/provider.hpp>

#include <boost/asio/buffer.hpp>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>

namespace anydoor::detail {

class connection_impl;

enum class op_kind : std::uint8_t { send, receive_message, receive_buffer, close };

// Where an operation is.
enum class op_phase : std::uint8_t {
  queued,       // waits for credits, a buffer, a send slot (send) or for a message (receive)
  rendezvous,   // send: request sent, waits for the peer's fin; receive: reading
  done,
};

inline constexpr std::size_t kMaxGather = 16;  // buffers in one async_send

struct op_node {
  op_node* next = nullptr;
  op_node* prev = nullptr;
  connection_impl* owner = nullptr;
  op_kind kind = op_kind::send;
  op_phase phase = op_phase::queued;
  pending_handler handler;
  // send
  std::array<asio::const_buffer, kMaxGather> bufs{};
  std::uint8_t nbufs = 0;
  std::uint64_t length = 0;  // send: total bytes; receive: bytes of the message being read
  std::chrono::steady_clock::time_point deadline{};  // send waiting for a pool buffer
  // receive_buffer
  asio::mutable_buffer dest{};
  // rendezvous (either side)
  std::uint32_t cookie = 0;
  std::unique_ptr<transport::memory_region> mr;
  std::unique_ptr<std::byte[]> large;  // receive_message of a rendezvous message
  bool stalled_credit = false;  // counted once per operation
  bool stalled_buffer = false;
};

}  // namespace anydoor::detail
