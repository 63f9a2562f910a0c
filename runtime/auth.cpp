#include "auth.hpp"

#include <anydoor/error.hpp>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <algorithm>
#include <cstring>
#include <system_error>

namespace anydoor::detail::auth {

namespace {

constexpr std::string_view kClientLabel{"anydoor-auth-v3 client", 23};  // with its terminating zero
constexpr std::string_view kServerLabel{"anydoor-auth-v3 server", 23};

}  // namespace

nonce fresh_nonce() {
  nonce n{};
  if (RAND_bytes(reinterpret_cast<unsigned char*>(n.data()), static_cast<int>(n.size())) != 1) {
    throw std::system_error(errc::authentication_failed, "auth: the random source failed (RAND_bytes)");
  }
  return n;
}

mac proof(std::string_view token, role r, std::span<const std::byte> hello, std::span<const std::byte> welcome) {
  const std::string_view label = r == role::client ? kClientLabel : kServerLabel;
  std::array<unsigned char, 23 + 2 * protocol::kHelloSize> input{};
  std::memcpy(input.data(), label.data(), label.size());
  // Shorter handshake data (a peer's truncated hello never gets here) is zero-padded.
  std::memcpy(input.data() + label.size(), hello.data(), std::min(hello.size(), protocol::kHelloSize));
  std::memcpy(input.data() + label.size() + protocol::kHelloSize, welcome.data(),
              std::min(welcome.size(), protocol::kHelloSize));
  mac out{};
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()), input.data(), input.size(),
           reinterpret_cast<unsigned char*>(out.data()), &len) == nullptr ||
      len != out.size()) {
    throw std::system_error(errc::authentication_failed, "auth: HMAC-SHA256 failed");
  }
  return out;
}

bool equal(std::span<const std::byte> a, std::span<const std::byte> b) noexcept {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

exchange prepare(std::string_view token, role local, std::span<const std::byte> hello,
                 std::span<const std::byte> welcome) {
  const role peer = local == role::client ? role::server : role::client;
  return {local, proof(token, local, hello, welcome), proof(token, peer, hello, welcome),
          protocol::nonce_of(local == role::client ? hello : welcome)};
}

void own_nonces::remember(const nonce& n) {
  std::lock_guard lock(m_);
  v_.push_back(n);
}

void own_nonces::forget(const nonce& n) noexcept {
  std::lock_guard lock(m_);
  const auto it = std::find(v_.begin(), v_.end(), n);
  if (it == v_.end()) return;
  *it = v_.back();
  v_.pop_back();
}

bool own_nonces::contains(const nonce& n) const noexcept {
  std::lock_guard lock(m_);
  return std::find(v_.begin(), v_.end(), n) != v_.end();
}

}  // namespace anydoor::detail::auth
