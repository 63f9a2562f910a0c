// The RPC frame, carried in connection messages (little-endian, 24 bytes):
//   u8  version (1)
//   u8  kind: 1 request, 2 reply, 3 cancel
//   u8  flags: request: 1 bulk (a packed remote_region follows the header);
//              request or reply: 2 payload follows (the payload is the next
//              message, sent on its own so that a large one can go by
//              rendezvous, zero copy, or split)
//   u8  reserved (0)
//   u32 aux: request: the deadline, in microseconds from when the server
//            takes the request (0: none); reply: the status (rpc::errc)
//   u64 call id (the client's; a reply and a cancel name it)
//   u64 method id (request; 0 otherwise)
// then: request: [bulk region (32 bytes)] [payload]; reply: [payload, or the
// status message when the status is not ok]; cancel: nothing.
#pragma once

#include "../bytes.hpp"

#include <cstddef>
#include <cstdint>
#include <span>

namespace anydoor::rpc::wire {

inline constexpr std::size_t kHeaderSize = 24;
inline constexpr std::uint8_t kVersion = 1;
enum class kind : std::uint8_t { request = 1, reply = 2, cancel = 3 };
inline constexpr std::uint8_t kFlagBulk = 1;
inline constexpr std::uint8_t kFlagPayloadFollows = 2;
inline constexpr std::uint8_t kKnownFlags = kFlagBulk | kFlagPayloadFollows;
// A status message is cut to this many bytes.
inline constexpr std::size_t kMaxStatusMessage = 1024;

struct header {
  std::uint8_t version = kVersion;
  kind type = kind::request;
  std::uint8_t flags = 0;
  std::uint8_t reserved = 0;
  std::uint32_t aux = 0;
  std::uint64_t call_id = 0;
  std::uint64_t method = 0;
};

inline void encode(const header& h, std::byte* out) noexcept {
  using anydoor::detail::put_le;
  put_le(out, h.version);
  put_le(out, static_cast<std::uint8_t>(h.type));
  put_le(out, h.flags);
  put_le(out, h.reserved);
  put_le(out, h.aux);
  put_le(out, h.call_id);
  put_le(out, h.method);
}

// False when `in` is too short to hold a header; the fields are not checked.
inline bool decode(std::span<const std::byte> in, header& h) noexcept {
  using anydoor::detail::get_le;
  if (in.size() < kHeaderSize) return false;
  const std::byte* p = in.data();
  h.version = get_le<std::uint8_t>(p);
  h.type = static_cast<kind>(get_le<std::uint8_t>(p));
  h.flags = get_le<std::uint8_t>(p);
  h.reserved = get_le<std::uint8_t>(p);
  h.aux = get_le<std::uint32_t>(p);
  h.call_id = get_le<std::uint64_t>(p);
  h.method = get_le<std::uint64_t>(p);
  return true;
}

}  // namespace anydoor::rpc::wire
