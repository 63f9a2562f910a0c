// libFuzzer target: the connection handshake's decoders, fed what a peer
// puts on the wire before any connection exists: the tcp provider's
// connection-manager frame (24 bytes) and the runtime's hello/welcome/refuse
// in its private data (runtime/protocol.hpp). Whatever decodes must encode
// back to the same bytes (nothing is accepted that the protocol cannot
// express), and the authentication proofs over it are computed without
// reading past it.
#include "auth.hpp"
#include "protocol.hpp"
#include "tcp/wire.hpp"

#include <cstdlib>
#include <cstring>
#include <span>

namespace {

void check(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);
  namespace tcp = anydoor::transport::tcp;
  namespace pr = anydoor::protocol;

  if (in.size() >= tcp::kHandshakeSize) {
    tcp::handshake h;
    if (tcp::decode(in.first<tcp::kHandshakeSize>(), h) == tcp::handshake_error::none) {
      check(h.private_data_len <= tcp::kMaxPrivateData);
      std::array<std::byte, tcp::kHandshakeSize> again{};
      tcp::encode(h, again);
      tcp::handshake h2;
      check(tcp::decode(std::span<const std::byte, tcp::kHandshakeSize>(again), h2) == tcp::handshake_error::none);
      check(h2.kind == h.kind && h2.qp_num == h.qp_num && h2.private_data_len == h.private_data_len &&
            h2.max_send_wr == h.max_send_wr && h2.max_recv_wr == h.max_recv_wr);
    }
  }
  // What follows the frame is the private data the runtime decodes.
  const std::span<const std::byte> pdata = in.size() > tcp::kHandshakeSize ? in.subspan(tcp::kHandshakeSize) : in;
  pr::hello h;
  if (pr::decode(pdata, h) == pr::decode_status::ok && h.kind != pr::hello_kind::refuse && h.version == pr::kVersion) {
    check(h.credits >= 2 && h.recv_buffer > pr::kHeaderSize && h.max_message > 0 && (h.flags & ~pr::kAuth) == 0);
    const auto again = pr::encode(h);
    check(pdata.size() >= again.size() && std::memcmp(again.data(), pdata.data(), again.size()) == 0);
    // The proofs of a handshake with this hello (and a fixed welcome): what
    // one side sends is what the other expects, and the nonce each side
    // remembers as its own is the one it sent.
    namespace au = anydoor::detail::auth;
    pr::hello w = h;
    w.kind = pr::hello_kind::welcome;
    w.nonce.fill(std::byte{0x77});
    const auto welcome = pr::encode(w);
    const auto client = au::prepare("fuzz-token", au::role::client, pdata, welcome);
    const auto server = au::prepare("fuzz-token", au::role::server, pdata, welcome);
    check(au::equal(client.send, server.expect) && au::equal(server.send, client.expect));
    check(client.own == h.nonce && server.own == w.nonce);
  }
  return 0;
}
