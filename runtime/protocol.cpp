#include "protocol.hpp"

#include "bytes.hpp"

#include <cstring>

namespace anydoor::protocol {

namespace {

using detail::get_le;
using detail::put_le;

}  // namespace

std::array<std::byte, kHelloSize> encode(const hello& h) noexcept {
  std::array<std::byte, kHelloSize> out{};
  std::byte* p = out.data();
  put_le<std::uint32_t>(p, kMagic);
  put_le<std::uint16_t>(p, h.version);
  put_le<std::uint8_t>(p, static_cast<std::uint8_t>(h.kind));
  put_le<std::uint8_t>(p, static_cast<std::uint8_t>(h.reason));
  put_le<std::uint16_t>(p, h.credits);
  put_le<std::uint16_t>(p, h.flags);
  put_le<std::uint32_t>(p, h.recv_buffer);
  put_le<std::uint32_t>(p, h.eager_limit);
  put_le<std::uint64_t>(p, h.max_message);
  std::memcpy(p, h.nonce.data(), h.nonce.size());
  p += h.nonce.size();
  put_le<std::uint32_t>(p, h.keepalive_ms);
  put_le<std::uint16_t>(p, h.max_credits);
  return out;
}

decode_status decode(std::span<const std::byte> in, hello& out) noexcept {
  if (in.size() < 8) return decode_status::truncated;
  const std::byte* p = in.data();
  if (get_le<std::uint32_t>(p) != kMagic) return decode_status::bad_magic;
  out.version = get_le<std::uint16_t>(p);
  const auto kind = get_le<std::uint8_t>(p);
  const auto reason = get_le<std::uint8_t>(p);
  if (kind < 1 || kind > 3 || reason > 4) return decode_status::bad_field;
  out.kind = static_cast<hello_kind>(kind);
  out.reason = static_cast<refuse_reason>(reason);
  if (out.kind == hello_kind::refuse) return decode_status::ok;  // a refusal needs no more
  if (out.version != kVersion) return decode_status::ok;         // the caller refuses it by version
  if (in.size() < kHelloSize) return decode_status::truncated;
  out.credits = get_le<std::uint16_t>(p);
  out.flags = get_le<std::uint16_t>(p);
  out.recv_buffer = get_le<std::uint32_t>(p);
  out.eager_limit = get_le<std::uint32_t>(p);
  out.max_message = get_le<std::uint64_t>(p);
  std::memcpy(out.nonce.data(), p, out.nonce.size());
  p += out.nonce.size();
  out.keepalive_ms = get_le<std::uint32_t>(p);
  out.max_credits = get_le<std::uint16_t>(p);
  if (out.credits < 2 || out.max_credits < out.credits || out.recv_buffer <= kHeaderSize || out.max_message == 0 || (out.flags & ~kAuth) != 0) {
    return decode_status::bad_field;
  }
  return decode_status::ok;
}

void encode(const header& h, std::byte* p) noexcept {
  put_le<std::uint8_t>(p, static_cast<std::uint8_t>(h.type));
  put_le<std::uint8_t>(p, h.status);
  put_le<std::uint16_t>(p, h.credits);
  put_le<std::uint32_t>(p, h.aux);
}

void encode(const rts_body& b, std::byte* p) noexcept {
  put_le<std::uint64_t>(p, b.length);
  put_le<std::uint64_t>(p, b.addr);
  put_le<std::uint32_t>(p, b.rkey);
  put_le<std::uint32_t>(p, b.cookie);
}

bool decode(std::span<const std::byte> in, header& h) noexcept {
  if (in.size() < kHeaderSize) return false;
  const std::byte* p = in.data();
  const auto type = get_le<std::uint8_t>(p);
  h.status = get_le<std::uint8_t>(p);
  h.credits = get_le<std::uint16_t>(p);
  h.aux = get_le<std::uint32_t>(p);
  if (type < 1 || type > 9) return false;
  h.type = static_cast<msg_type>(type);
  switch (h.type) {
    case msg_type::eager: return true;
    case msg_type::split: return in.size() > kHeaderSize;
    case msg_type::rts:
    case msg_type::notify: return in.size() == kRtsSize;
    case msg_type::fin: return in.size() == kHeaderSize && h.status <= 4;
    case msg_type::withdraw: return in.size() == kHeaderSize && h.status <= 1;
    case msg_type::credit:
    case msg_type::close: return in.size() == kHeaderSize;
    case msg_type::auth:
      return (h.status == static_cast<std::uint8_t>(auth_status::proof) && in.size() == kAuthSize) ||
             ((h.status == static_cast<std::uint8_t>(auth_status::refused) ||
               h.status == static_cast<std::uint8_t>(auth_status::confirmed)) &&
              in.size() == kHeaderSize);
  }
  return false;
}

rts_body decode_rts(const std::byte* p) noexcept {
  rts_body b;
  b.length = get_le<std::uint64_t>(p);
  b.addr = get_le<std::uint64_t>(p);
  b.rkey = get_le<std::uint32_t>(p);
  b.cookie = get_le<std::uint32_t>(p);
  return b;
}

}  // namespace anydoor::protocol
