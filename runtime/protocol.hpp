// The runtime's wire protocol, version 1 (all integers little-endian).
//
// Connection handshake, carried in the connection manager's private data
// (it must fit rdma_cm's 56 bytes): see `hello`. The connecting side sends
// kind=hello; the listener answers kind=welcome in its accept, or kind=refuse
// with a reason in its reject.
//
// Messages: every SEND starts with an 8-byte header
//   u8 type | u8 status | u16 credits | u32 aux
// `credits` returns receive buffers the sender has re-posted since its last
// report. Types:
//   eager  payload follows the header (byte_len - 8 bytes)
//   rts    rendezvous request: body { u64 length, u64 addr, u32 rkey, u32 cookie }:
//          the receiver RDMA-READs [addr, addr + length) with rkey, then sends fin
//   fin    rendezvous done: aux = cookie, status = fin_status
//   credit only returns credits
//   close  graceful close: the sender sends nothing after it
//   notify follows an RDMA WRITE (async_put_with_notify) on the same queue
//          pair: aux = the user's value, body as rts { length, addr, rkey,
//          0 } = the range written (RC order: the data is in place when the
//          notify arrives)
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace anydoor::protocol {

inline constexpr std::uint32_t kMagic = 0x31524441;  // "ADR1"
inline constexpr std::uint16_t kVersion = 2;  // 2: fin status 3 is no_memory
inline constexpr std::size_t kHelloSize = 44;
inline constexpr std::size_t kHeaderSize = 8;
inline constexpr std::size_t kRtsSize = kHeaderSize + 24;

enum class hello_kind : std::uint8_t { hello = 1, welcome = 2, refuse = 3 };
enum class refuse_reason : std::uint8_t { none = 0, version = 1, authentication = 2, malformed = 3, resources = 4 };

struct hello {
  hello_kind kind = hello_kind::hello;
  refuse_reason reason = refuse_reason::none;
  std::uint16_t version = kVersion;
  std::uint16_t credits = 0;        // receives posted for the peer
  std::uint32_t recv_buffer = 0;    // bytes per receive buffer, header included
  std::uint32_t eager_limit = 0;    // payload bytes the sender sends eagerly
  std::uint64_t max_message = 0;    // largest message the sender accepts
  std::array<std::byte, 16> token{};  // digest of the auth token (zero: none)
};

enum class decode_status : std::uint8_t { ok, truncated, bad_magic, bad_field };

std::array<std::byte, kHelloSize> encode(const hello& h) noexcept;
// Decodes and validates a hello: the magic, the kind, and for hello/welcome
// credits >= 2 and recv_buffer > kHeaderSize. The version is returned as sent
// (the caller decides what it accepts).
decode_status decode(std::span<const std::byte> in, hello& out) noexcept;

// A 128-bit digest of an auth token (all zero for an empty token). A check
// against misconfiguration, not a cryptographic protection: the digest is a
// fixed function of the token and travels in clear.
std::array<std::byte, 16> token_digest(std::string_view token) noexcept;

enum class msg_type : std::uint8_t { eager = 1, rts = 2, fin = 3, credit = 4, close = 5, notify = 6 };
// ok; message_size: larger than the receiver's buffer or its rendezvous
// memory budget; read_failed: the RDMA READ failed; no_memory: the receiver
// could not allocate or register the destination.
enum class fin_status : std::uint8_t { ok = 0, message_size = 1, read_failed = 2, no_memory = 3 };

struct header {
  msg_type type = msg_type::eager;
  std::uint8_t status = 0;
  std::uint16_t credits = 0;
  std::uint32_t aux = 0;
};

struct rts_body {
  std::uint64_t length = 0;
  std::uint64_t addr = 0;
  std::uint32_t rkey = 0;
  std::uint32_t cookie = 0;
};

void encode(const header& h, std::byte* out) noexcept;           // kHeaderSize bytes
void encode(const rts_body& b, std::byte* out) noexcept;         // 24 bytes
// Validates a received message of byte_len bytes: a known type, and a length
// that fits it (eager >= header, rts and notify == kRtsSize, others ==
// kHeaderSize).
bool decode(std::span<const std::byte> in, header& h) noexcept;
rts_body decode_rts(const std::byte* body) noexcept;              // 24 bytes

}  // namespace anydoor::protocol
