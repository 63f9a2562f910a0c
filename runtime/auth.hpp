// Challenge-response authentication of a connection's peer (runtime-internal;
// the exchange is described in protocol.hpp). The cryptography is OpenSSL's
// libcrypto: RAND_bytes for nonces, HMAC-SHA256 for proofs, CRYPTO_memcmp
// to compare them.
#pragma once

#include "protocol.hpp"

#include <array>
#include <cstddef>
#include <mutex>
#include <span>
#include <string_view>
#include <vector>

namespace anydoor::detail::auth {

using nonce = std::array<std::byte, protocol::kNonceSize>;
using mac = std::array<std::byte, protocol::kMacSize>;

enum class role : std::uint8_t { client, server };

// A fresh random nonce. Throws std::system_error when the system's random
// source fails (no connection is made without one).
nonce fresh_nonce();

// HMAC-SHA256 keyed with the token over a label naming the role, the hello
// and the welcome exactly as they were sent (the first kHelloSize bytes of
// each): the proof that `r`'s side knows the token, bound to both nonces
// and every parameter of this handshake.
mac proof(std::string_view token, role r, std::span<const std::byte> hello, std::span<const std::byte> welcome);

// Constant-time comparison.
bool equal(std::span<const std::byte> a, std::span<const std::byte> b) noexcept;

// What a connection needs to run the exchange: its own proof to send and
// the peer's it expects.
struct exchange {
  role local = role::client;
  mac send{};
  mac expect{};
  nonce own{};  // the nonce this side sent (registered with remember_own)
};

// A fabric's nonces of handshakes in progress (its connects' hellos, its
// listeners' welcomes). A peer that hands one back is reflecting our own
// handshake (relaying our hello to our listener, answering our connect with
// our listener's welcome) to make us prove the token to ourselves: it is
// refused. Thread-safe (the listener thread and the io thread); the setup
// path only.
class own_nonces {
 public:
  void remember(const nonce& n);
  void forget(const nonce& n) noexcept;
  void forget(const exchange& ex) noexcept { forget(ex.own); }
  bool contains(const nonce& n) const noexcept;

 private:
  mutable std::mutex m_;
  std::vector<nonce> v_;  // a handful: one per handshake in progress
};

// Both proofs of one handshake, as seen from `local`.
// (own: the nonce of whichever of the two this side sent.)
exchange prepare(std::string_view token, role local, std::span<const std::byte> hello,
                 std::span<const std::byte> welcome);

}  // namespace anydoor::detail::auth
