// The runtime's wire protocol, version 1 (all integers little-endian).
//
// Connection handshake, carried in the connection manager's private data
// (it must fit rdma_cm's 56 bytes): see `hello`. The connecting side sends
// kind=hello; the listener answers kind=welcome in its accept, or kind=refuse
// with a reason in its reject.
//
// Authentication (both sides configured with the same auth token; flag
// kAuth in hello and welcome, each with a fresh random 16-byte nonce):
// right after the connection is established, the connecting side sends an
// auth message whose body is HMAC-SHA256(token, "anydoor-auth-v3 client" ||
// hello || welcome) (the kHelloSize bytes of each as sent). The listener checks it
// in constant time and answers with an auth message carrying the same MAC
// under the label "... server", or with status auth_refused and no body.
// The connecting side checks that MAC, opens its queue pair to the
// listener's one-sided operations, and sends an auth message with status
// confirmed and no body; the listener's accept completes only then, so that
// nothing the listener's user does after it finds the connecting side's
// queue pair still shut. (Each side's queue pair admits no remote WRITE,
// READ or atomic until it has checked its peer's MAC.)
// Until a side has checked its peer's MAC it accepts nothing but the auth
// message and grants the peer one credit (the auth message itself): the
// hello's credits are the total, the rest travel in the header of the
// listener's auth answer and of the connecting side's confirmation.
// Nothing of the token travels: a sniffer sees two nonces and two MACs
// bound to them, useless on another connection.
//
// Messages: every SEND starts with an 8-byte header
//   u8 type | u8 status | u16 credits | u32 aux
// `credits` returns receive buffers the sender has re-posted since its last
// report. Types:
//   eager  payload follows the header (byte_len - 8 bytes)
//   split  one piece of a message sent as several eager ones (a message
//          above the eager limit and at most connection_options::
//          eager_split_limit): aux = the whole message's length (u32) in
//          every piece, payload follows the header (at least 1 byte). The
//          pieces of a message are consecutive SENDs: nothing but credit
//          and fin messages comes between them; the message ends with the
//          piece that brings the bytes received to aux (more is a protocol
//          error), and aux is at most 64 of the receiver's receive buffers
//          (payload) and its max_message.
//   rts    rendezvous request: body { u64 length, u64 addr, u32 rkey, u32 cookie }:
//          the receiver RDMA-READs [addr, addr + length) with rkey, then sends fin
//   fin    rendezvous done: aux = cookie, status = fin_status
//   withdraw  status 0: the sender of a rendezvous message takes it back
//          (its send was cancelled): aux = its cookie, no body. A receiver
//          that has not started reading it drops it (its application never
//          sees it) and answers fin with status withdrawn; one that is
//          reading it answers withdraw with status 1 (too late: the fin
//          follows when the read ends); one that has finished has sent its
//          fin already, and an unknown cookie is ignored. A receiver that
//          has sent close answers nothing (the close ends the send).
//   credit only returns credits
//   close  graceful close: the sender sends nothing after it
//   auth   the authentication step above: body = 32-byte MAC (status 0), or
//          no body (status 1: refused; status 2: confirmed)
//   notify follows an RDMA WRITE (async_put_with_notify) on the same queue
//          pair: aux = the user's value, body as rts { length, addr, rkey,
//          0 } = the range written (RC order: the data is in place when the
//          notify arrives)
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace anydoor::protocol {

inline constexpr std::uint32_t kMagic = 0x31524441;  // "ADR1"
// 2: fin status 3 is no_memory; 3: challenge-response authentication;
// 4: keepalive in the hello (48 bytes); 6: max_credits in the hello (50
// bytes): credits are the initial grant, max_credits the window; 7: split;
// 8: withdraw, fin status 4 is withdrawn
inline constexpr std::uint16_t kVersion = 8;
inline constexpr std::size_t kHelloSize = 50;
inline constexpr std::size_t kHeaderSize = 8;
inline constexpr std::size_t kRtsSize = kHeaderSize + 24;
inline constexpr std::size_t kMacSize = 32;  // HMAC-SHA256
inline constexpr std::size_t kAuthSize = kHeaderSize + kMacSize;
inline constexpr std::size_t kNonceSize = 16;
inline constexpr std::size_t kNonceOffset = 28;  // in the encoded hello

// The nonce of an encoded hello or welcome; zeros when `encoded` is shorter
// than a hello.
inline std::array<std::byte, kNonceSize> nonce_of(std::span<const std::byte> encoded) noexcept {
  std::array<std::byte, kNonceSize> n{};
  if (encoded.size() >= kHelloSize) {
    for (std::size_t i = 0; i < kNonceSize; ++i) n[i] = encoded[kNonceOffset + i];
  }
  return n;
}
// hello.flags
inline constexpr std::uint16_t kAuth = 1;  // the sender has an auth token and requires the peer to prove it

enum class hello_kind : std::uint8_t { hello = 1, welcome = 2, refuse = 3 };
enum class refuse_reason : std::uint8_t { none = 0, version = 1, authentication = 2, malformed = 3, resources = 4 };

struct hello {
  hello_kind kind = hello_kind::hello;
  refuse_reason reason = refuse_reason::none;
  std::uint16_t version = kVersion;
  std::uint16_t credits = 0;        // receives granted to the peer at the start
  // The most credits the sender will ever have granted and unused at once
  // (its window, >= credits): returned credits beyond it are a protocol
  // error. Equal to credits unless the sender receives from a shared
  // receive queue, where grants follow what the queue can cover.
  std::uint16_t max_credits = 0;
  std::uint32_t recv_buffer = 0;    // bytes per receive buffer, header included
  std::uint32_t eager_limit = 0;    // payload bytes the sender sends eagerly
  std::uint64_t max_message = 0;    // largest message the sender accepts
  std::uint16_t flags = 0;          // kAuth
  std::array<std::byte, kNonceSize> nonce{};  // fresh per attempt with kAuth, else zero
  // The sender's connection_options::keepalive in ms (0: it detects no
  // silence). Each side sends a heartbeat when idle for a quarter of the
  // smaller nonzero keepalive of the two.
  std::uint32_t keepalive_ms = 0;
};

enum class decode_status : std::uint8_t { ok, truncated, bad_magic, bad_field };

std::array<std::byte, kHelloSize> encode(const hello& h) noexcept;
// Decodes and validates a hello: the magic, the kind, and for hello/welcome
// credits >= 2, max_credits >= credits, recv_buffer > kHeaderSize,
// max_message > 0 and only known flags. The version is returned as sent (the caller decides what it
// accepts).
decode_status decode(std::span<const std::byte> in, hello& out) noexcept;

enum class msg_type : std::uint8_t {
  eager = 1, rts = 2, fin = 3, credit = 4, close = 5, notify = 6, auth = 7, split = 8, withdraw = 9
};
enum class auth_status : std::uint8_t { proof = 0, refused = 1, confirmed = 2 };
// ok; message_size: larger than the receiver's buffer or its rendezvous
// memory budget; read_failed: the RDMA READ failed; no_memory: the receiver
// could not allocate or register the destination; withdrawn: dropped unread
// at the sender's request (withdraw).
enum class fin_status : std::uint8_t { ok = 0, message_size = 1, read_failed = 2, no_memory = 3, withdrawn = 4 };
enum class withdraw_status : std::uint8_t { request = 0, too_late = 1 };

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
// that fits it (eager >= header, split > header, rts and notify == kRtsSize, auth ==
// kAuthSize with a proof and kHeaderSize refused or confirmed, others ==
// kHeaderSize).
bool decode(std::span<const std::byte> in, header& h) noexcept;
rts_body decode_rts(const std::byte* body) noexcept;              // 24 bytes

}  // namespace anydoor::protocol
