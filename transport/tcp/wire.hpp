// The tcp provider's wire format, version 3.
//
// A queue pair is one TCP connection. After the connection handshake
// (hello/accept messages, see handshake_*), each direction carries frames:
// a fixed 48-byte little-endian header, followed by `length` payload bytes.
//
//   off size field
//    0   1   version (kWireVersion, 3)
//    1   1   type (frame_type)
//    2   2   flags (kFlagImm; kFlagLast on read responses; kFlagAck)
//    4   4   psn: requests: the request's sequence number; responses: the
//            sequence number of the request they answer (ACK: the newest
//            request acknowledged, cumulative)
//    8   4   length: payload bytes that follow the header
//   12   4   imm (send/write with immediate) or the NAK's nak_code
//   16   8   remote_addr (write, read, atomics; read responses: the offset)
//   24   4   rkey (write, read, atomics)
//   28   4   read_length (read request), or with kFlagAck (the other
//            requests) ack_psn: the newest of the receiver's own requests
//            acknowledged, cumulative, as an ACK frame with that psn would;
//            it is taken before the request itself, whatever becomes of
//            that (a held-back ACK travels in the next request's header
//            instead of a frame of its own)
//   32   8   compare_add (atomics) or the original value (atomic response)
//   40   8   swap (compare_swap)
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace anydoor::transport::tcp {

inline constexpr std::uint8_t kWireVersion = 3;
inline constexpr std::size_t kHeaderSize = 48;
inline constexpr std::uint16_t kFlagImm = 1u << 0;
inline constexpr std::uint16_t kFlagLast = 1u << 1;  // read_response: the read is complete
inline constexpr std::uint16_t kFlagAck = 1u << 2;   // requests but read_request: ack_psn is set
inline constexpr std::uint16_t kKnownFlags = kFlagImm | kFlagLast | kFlagAck;
// A read's data leaves in fragments of at most this many bytes.
inline constexpr std::uint32_t kReadFragment = 256 * 1024;
// Largest payload one frame may carry (the provider's max_msg_size).
inline constexpr std::uint32_t kMaxPayload = 1u << 30;

enum class frame_type : std::uint8_t {
  send = 1,         // payload: message
  write = 2,        // payload: data for [remote_addr, +length)
  read_request = 3, // no payload; read_length bytes from remote_addr
  fetch_add = 4,    // no payload
  compare_swap = 5, // no payload
  ack = 16,         // no payload; every request up to psn succeeded
  nak = 17,         // no payload; imm holds a nak_code: why the request psn failed
  read_response = 18,   // payload: a fragment of the data read, at offset remote_addr;
                        // the last frame of a read has kFlagLast and no payload
  atomic_response = 19, // no payload; compare_add holds the original value
};

// Why a responder refused a request (a NAK's imm field).
enum class nak_code : std::uint32_t {
  rnr = 1,               // no receive posted: retry later (receiver not ready)
  remote_access = 2,     // bad key, bounds or access rights (remote_access_error)
  invalid_request = 3,   // e.g. a message larger than the receive (remote_invalid_request)
  remote_operation = 4,  // the responder failed locally (remote_operation_error)
};

struct frame_header {
  frame_type type{};
  std::uint16_t flags = 0;
  std::uint32_t psn = 0;
  std::uint32_t length = 0;
  std::uint32_t imm = 0;  // or status
  std::uint64_t remote_addr = 0;
  std::uint32_t rkey = 0;
  std::uint32_t read_length = 0;
  std::uint32_t ack_psn = 0;  // with kFlagAck (the same bytes as read_length)
  std::uint64_t compare_add = 0;
  std::uint64_t swap = 0;
};

enum class decode_error : std::uint8_t {
  none,
  bad_version,
  bad_type,
  bad_flags,
  oversized,            // length above kMaxPayload
  unexpected_payload,   // a frame type that carries no payload has length != 0
  bad_field,            // a field that must be zero is not, or read_length too large
};
std::string_view to_string(decode_error e) noexcept;

void encode(const frame_header& h, std::span<std::byte, kHeaderSize> out) noexcept;
// Validates everything that can be checked without the queue pair's state.
decode_error decode(std::span<const std::byte, kHeaderSize> in, frame_header& out) noexcept;

inline bool is_request(frame_type t) noexcept { return static_cast<std::uint8_t>(t) < 16; }

// --- connection handshake -----------------------------------------------
// hello (connector -> listener) and reply (listener -> connector), each:
//   magic "ADTP" (4), version (1), kind (1: 1 hello, 2 accept, 3 reject),
//   private_data_len (2), qp_num (4), max_send_wr (4), max_recv_wr (4),
//   reserved (4) = 24 bytes, then private_data_len bytes.
inline constexpr std::size_t kHandshakeSize = 24;
inline constexpr std::size_t kMaxPrivateData = 56;  // rdma_cm's limit for RC connect
enum class handshake_kind : std::uint8_t { hello = 1, accept = 2, reject = 3 };
struct handshake {
  std::uint8_t version = kWireVersion;
  handshake_kind kind = handshake_kind::hello;
  std::uint16_t private_data_len = 0;
  std::uint32_t qp_num = 0;
  std::uint32_t max_send_wr = 0;
  std::uint32_t max_recv_wr = 0;
};
void encode(const handshake& h, std::span<std::byte, kHandshakeSize> out) noexcept;
enum class handshake_error : std::uint8_t { none, bad_magic, bad_version, bad_kind, bad_length };
handshake_error decode(std::span<const std::byte, kHandshakeSize> in, handshake& out) noexcept;
std::string_view to_string(handshake_error e) noexcept;

}  // namespace anydoor::transport::tcp
