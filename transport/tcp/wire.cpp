#include "tcp/wire.hpp"

#include <bit>
#include <cstring>

namespace anydoor::transport::tcp {
namespace {

// Little-endian fields, loaded and stored whole (one move each on
// little-endian hosts; a byte loop here cost ~300 instructions a header).
template <typename T>
T to_little(T v) noexcept {
  if constexpr (std::endian::native == std::endian::big && sizeof(T) == 2) return __builtin_bswap16(v);
  if constexpr (std::endian::native == std::endian::big && sizeof(T) == 4) return __builtin_bswap32(v);
  if constexpr (std::endian::native == std::endian::big && sizeof(T) == 8) return __builtin_bswap64(v);
  return v;
}

template <typename T>
void put(std::byte* p, T v) noexcept {
  v = to_little(v);
  std::memcpy(p, &v, sizeof v);
}

template <typename T>
T get(const std::byte* p) noexcept {
  T v;
  std::memcpy(&v, p, sizeof v);
  return to_little(v);
}

bool carries_payload(frame_type t) noexcept {
  return t == frame_type::send || t == frame_type::write || t == frame_type::read_response;
}

bool known_type(std::uint8_t t) noexcept {
  switch (static_cast<frame_type>(t)) {
    case frame_type::send:
    case frame_type::write:
    case frame_type::read_request:
    case frame_type::fetch_add:
    case frame_type::compare_swap:
    case frame_type::ack:
    case frame_type::nak:
    case frame_type::read_response:
    case frame_type::atomic_response:
      return true;
  }
  return false;
}

constexpr std::byte kMagic[4] = {std::byte{'A'}, std::byte{'D'}, std::byte{'T'}, std::byte{'P'}};

}  // namespace

std::string_view to_string(decode_error e) noexcept {
  switch (e) {
    case decode_error::none: return "no error";
    case decode_error::bad_version: return "unknown wire version";
    case decode_error::bad_type: return "unknown frame type";
    case decode_error::bad_flags: return "unknown flags";
    case decode_error::oversized: return "frame payload larger than the maximum message size";
    case decode_error::unexpected_payload: return "payload on a frame type that carries none";
    case decode_error::bad_field: return "reserved or inconsistent header field";
  }
  return "unknown decode error";
}

void encode(const frame_header& h, std::span<std::byte, kHeaderSize> out) noexcept {
  std::byte* p = out.data();
  p[0] = std::byte{kWireVersion};
  p[1] = static_cast<std::byte>(h.type);
  put<std::uint16_t>(p + 2, h.flags);
  put<std::uint32_t>(p + 4, h.psn);
  put<std::uint32_t>(p + 8, h.length);
  put<std::uint32_t>(p + 12, h.imm);
  put<std::uint64_t>(p + 16, h.remote_addr);
  put<std::uint32_t>(p + 24, h.rkey);
  put<std::uint32_t>(p + 28, h.type == frame_type::read_request ? h.read_length : h.ack_psn);
  put<std::uint64_t>(p + 32, h.compare_add);
  put<std::uint64_t>(p + 40, h.swap);
}

decode_error decode(std::span<const std::byte, kHeaderSize> in, frame_header& h) noexcept {
  const std::byte* p = in.data();
  if (static_cast<std::uint8_t>(p[0]) != kWireVersion) return decode_error::bad_version;
  const auto type = static_cast<std::uint8_t>(p[1]);
  if (!known_type(type)) return decode_error::bad_type;
  h.type = static_cast<frame_type>(type);
  h.flags = get<std::uint16_t>(p + 2);
  h.psn = get<std::uint32_t>(p + 4);
  h.length = get<std::uint32_t>(p + 8);
  h.imm = get<std::uint32_t>(p + 12);
  h.remote_addr = get<std::uint64_t>(p + 16);
  h.rkey = get<std::uint32_t>(p + 24);
  const auto at28 = get<std::uint32_t>(p + 28);
  h.read_length = h.type == frame_type::read_request ? at28 : 0;
  h.ack_psn = h.type == frame_type::read_request ? 0 : at28;
  h.compare_add = get<std::uint64_t>(p + 32);
  h.swap = get<std::uint64_t>(p + 40);

  if ((h.flags & ~kKnownFlags) != 0) return decode_error::bad_flags;
  if ((h.flags & kFlagImm) != 0 && h.type != frame_type::send && h.type != frame_type::write) {
    return decode_error::bad_flags;
  }
  if ((h.flags & kFlagLast) != 0 && h.type != frame_type::read_response) return decode_error::bad_flags;
  const bool may_ack = is_request(h.type) && h.type != frame_type::read_request;
  if ((h.flags & kFlagAck) != 0 && !may_ack) return decode_error::bad_flags;
  if (h.type == frame_type::read_response && h.length > kReadFragment) return decode_error::oversized;
  if (h.length > kMaxPayload) return decode_error::oversized;
  if (!carries_payload(h.type) && h.length != 0) return decode_error::unexpected_payload;
  if (h.type == frame_type::read_request) {
    if (h.read_length > kMaxPayload) return decode_error::oversized;
  } else if ((h.flags & kFlagAck) == 0 && h.ack_psn != 0) {
    return decode_error::bad_field;
  }
  return decode_error::none;
}

void encode(const handshake& h, std::span<std::byte, kHandshakeSize> out) noexcept {
  std::byte* p = out.data();
  std::memcpy(p, kMagic, 4);
  p[4] = std::byte{h.version};
  p[5] = static_cast<std::byte>(h.kind);
  put<std::uint16_t>(p + 6, h.private_data_len);
  put<std::uint32_t>(p + 8, h.qp_num);
  put<std::uint32_t>(p + 12, h.max_send_wr);
  put<std::uint32_t>(p + 16, h.max_recv_wr);
  put<std::uint32_t>(p + 20, 0);
}

handshake_error decode(std::span<const std::byte, kHandshakeSize> in, handshake& h) noexcept {
  const std::byte* p = in.data();
  if (std::memcmp(p, kMagic, 4) != 0) return handshake_error::bad_magic;
  h.version = static_cast<std::uint8_t>(p[4]);
  const auto kind = static_cast<std::uint8_t>(p[5]);
  if (kind < 1 || kind > 3) return handshake_error::bad_kind;
  h.kind = static_cast<handshake_kind>(kind);
  h.private_data_len = get<std::uint16_t>(p + 6);
  h.qp_num = get<std::uint32_t>(p + 8);
  h.max_send_wr = get<std::uint32_t>(p + 12);
  h.max_recv_wr = get<std::uint32_t>(p + 16);
  // The version is checked after the fields are read so that the receiver
  // can report which version the peer speaks.
  if (h.version != kWireVersion) return handshake_error::bad_version;
  if (h.private_data_len > kMaxPrivateData) return handshake_error::bad_length;
  // A peer's queue sizes are clamped to the provider's own limit (max_qp_wr).
  if (h.max_send_wr == 0 || h.max_send_wr > (1u << 15)) return handshake_error::bad_length;
  if (h.max_recv_wr == 0 || h.max_recv_wr > (1u << 15)) return handshake_error::bad_length;
  return handshake_error::none;
}

std::string_view to_string(handshake_error e) noexcept {
  switch (e) {
    case handshake_error::none: return "no error";
    case handshake_error::bad_magic: return "not an anydoor tcp provider peer (bad magic)";
    case handshake_error::bad_version: return "peer speaks another wire version";
    case handshake_error::bad_kind: return "unknown handshake message";
    case handshake_error::bad_length: return "handshake field out of range";
  }
  return "unknown handshake error";
}

}  // namespace anydoor::transport::tcp
