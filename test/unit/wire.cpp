// The tcp provider's frame and handshake codecs.
#include "tcp/wire.hpp"

#include <catch2/catch.hpp>

using namespace anydoor::transport::tcp;

namespace {
std::array<std::byte, kHeaderSize> encoded(const frame_header& h) {
  std::array<std::byte, kHeaderSize> b{};
  encode(h, b);
  return b;
}
}  // namespace

TEST_CASE("frame headers round-trip", "[unit]") {
  frame_header h{.type = frame_type::write, .flags = kFlagImm, .psn = 0xfffffffe, .length = 4096,
                 .imm = 0x01020304, .remote_addr = 0x1122334455667788, .rkey = 0x99aabbcc,
                 .read_length = 0, .compare_add = 0xdeadbeefcafef00d, .swap = 42};
  auto b = encoded(h);
  CHECK(static_cast<int>(b[0]) == kWireVersion);
  CHECK(static_cast<int>(b[16]) == 0x88);  // little-endian on the wire
  frame_header d;
  REQUIRE(decode(b, d) == decode_error::none);
  CHECK(d.type == h.type);
  CHECK(d.flags == h.flags);
  CHECK(d.psn == h.psn);
  CHECK(d.length == h.length);
  CHECK(d.imm == h.imm);
  CHECK(d.remote_addr == h.remote_addr);
  CHECK(d.rkey == h.rkey);
  CHECK(d.compare_add == h.compare_add);
  CHECK(d.swap == h.swap);
  CHECK(d.ack_psn == 0);
  // An ACK in a request's header (offset 28, where a read request has its length)
  h.flags |= kFlagAck;
  h.ack_psn = 0xfffffff0;
  b = encoded(h);
  CHECK(static_cast<int>(b[28]) == 0xf0);
  REQUIRE(decode(b, d) == decode_error::none);
  CHECK(d.flags == h.flags);
  CHECK(d.ack_psn == h.ack_psn);
  CHECK(d.read_length == 0);
  REQUIRE(decode(encoded({.type = frame_type::read_request, .read_length = 77}), d) == decode_error::none);
  CHECK(d.read_length == 77);
  CHECK(d.ack_psn == 0);
}

TEST_CASE("the frame decoder rejects every kind of malformed header", "[unit]") {
  frame_header d;
  SECTION("version") {
    auto b = encoded({.type = frame_type::send});
    b[0] = std::byte{kWireVersion + 1};
    CHECK(decode(b, d) == decode_error::bad_version);
  }
  SECTION("type") {
    auto b = encoded({.type = frame_type::send});
    b[1] = std::byte{99};
    CHECK(decode(b, d) == decode_error::bad_type);
    b[1] = std::byte{0};
    CHECK(decode(b, d) == decode_error::bad_type);
  }
  SECTION("flags") {
    CHECK(decode(encoded({.type = frame_type::send, .flags = 0x8000}), d) == decode_error::bad_flags);
    CHECK(decode(encoded({.type = frame_type::read_request, .flags = kFlagImm}), d) == decode_error::bad_flags);
    // "last" belongs to read responses only
    CHECK(decode(encoded({.type = frame_type::send, .flags = kFlagLast}), d) == decode_error::bad_flags);
    CHECK(decode(encoded({.type = frame_type::read_response, .flags = kFlagLast}), d) == decode_error::none);
  }
  SECTION("oversized") {
    CHECK(decode(encoded({.type = frame_type::send, .length = kMaxPayload + 1}), d) == decode_error::oversized);
    CHECK(decode(encoded({.type = frame_type::read_request, .read_length = kMaxPayload + 1}), d) ==
          decode_error::oversized);
    CHECK(decode(encoded({.type = frame_type::send, .length = kMaxPayload}), d) == decode_error::none);
    // a read's data comes in fragments
    CHECK(decode(encoded({.type = frame_type::read_response, .length = kReadFragment + 1}), d) ==
          decode_error::oversized);
    CHECK(decode(encoded({.type = frame_type::read_response, .length = kReadFragment}), d) == decode_error::none);
  }
  SECTION("payload on a frame that carries none") {
    CHECK(decode(encoded({.type = frame_type::ack, .length = 1}), d) == decode_error::unexpected_payload);
    CHECK(decode(encoded({.type = frame_type::fetch_add, .length = 8}), d) == decode_error::unexpected_payload);
  }
  SECTION("inconsistent field") {
    // offset 28 is a read request's length, else an ACK with kFlagAck
    CHECK(decode(encoded({.type = frame_type::write, .ack_psn = 4}), d) == decode_error::bad_field);
    CHECK(decode(encoded({.type = frame_type::ack, .ack_psn = 4}), d) == decode_error::bad_field);
  }
  SECTION("an ACK rides on requests other than a read request only") {
    for (auto t : {frame_type::read_request, frame_type::ack, frame_type::nak, frame_type::read_response,
                   frame_type::atomic_response}) {
      INFO("frame type " << static_cast<int>(t));
      CHECK(decode(encoded({.type = t, .flags = kFlagAck}), d) == decode_error::bad_flags);
    }
    for (auto t : {frame_type::send, frame_type::write, frame_type::fetch_add, frame_type::compare_swap}) {
      INFO("frame type " << static_cast<int>(t));
      CHECK(decode(encoded({.type = t, .flags = kFlagAck, .ack_psn = 7}), d) == decode_error::none);
      CHECK(d.ack_psn == 7);
    }
  }
  for (auto e : {decode_error::none, decode_error::bad_version, decode_error::bad_type, decode_error::bad_flags,
                 decode_error::oversized, decode_error::unexpected_payload, decode_error::bad_field}) {
    CHECK_FALSE(to_string(e).empty());
  }
}

TEST_CASE("handshakes round-trip and reject garbage", "[unit]") {
  std::array<std::byte, kHandshakeSize> b{};
  handshake h{.kind = handshake_kind::accept, .private_data_len = 56, .qp_num = 7, .max_send_wr = 128,
              .max_recv_wr = 64};
  encode(h, b);
  handshake d;
  REQUIRE(decode(b, d) == handshake_error::none);
  CHECK(d.kind == handshake_kind::accept);
  CHECK(d.private_data_len == 56);
  CHECK(d.qp_num == 7);
  CHECK(d.max_send_wr == 128);
  CHECK(d.max_recv_wr == 64);

  auto bad = b;
  bad[0] = std::byte{'X'};
  CHECK(decode(bad, d) == handshake_error::bad_magic);
  bad = b;
  bad[4] = std::byte{9};
  CHECK(decode(bad, d) == handshake_error::bad_version);
  CHECK(d.version == 9);
  bad = b;
  bad[5] = std::byte{4};
  CHECK(decode(bad, d) == handshake_error::bad_kind);
  h.private_data_len = 57;
  encode(h, bad);
  CHECK(decode(bad, d) == handshake_error::bad_length);
  h.private_data_len = 0;
  h.max_send_wr = 0;
  encode(h, bad);
  CHECK(decode(bad, d) == handshake_error::bad_length);
  // a peer's queue sizes above the provider's own limit (32768) are refused
  h.max_send_wr = (1u << 15) + 1;
  encode(h, bad);
  CHECK(decode(bad, d) == handshake_error::bad_length);
  h.max_send_wr = 1u << 15;
  h.max_recv_wr = (1u << 15) + 1;
  encode(h, bad);
  CHECK(decode(bad, d) == handshake_error::bad_length);
  h.max_recv_wr = 0;
  encode(h, bad);
  CHECK(decode(bad, d) == handshake_error::bad_length);
  h.max_recv_wr = 1u << 15;
  encode(h, bad);
  CHECK(decode(bad, d) == handshake_error::none);
}
