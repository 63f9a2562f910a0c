// Typed RPC methods: a method names its request and reply types and is
// identified on the wire by a 64-bit id hashed from its name at compile time.
//
//   struct add_req { std::int64_t a, b; };                  // trivially copyable
//   inline constexpr rpc::method<add_req, std::int64_t> add{"calc.add"};
//   inline constexpr rpc::method<std::string, std::string> echo{"echo"};
//
// A codec turns a value into bytes and back:
//   static void encode(const T& value, rpc::writer& out);     // appends
//   static bool decode(std::span<const std::byte> in, T& out); // false: malformed
// Built in (rpc::default_codec picks one): trivially copyable types (their
// bytes; decode needs the exact size), std::string and std::vector of a
// byte-sized type (the bytes). protobuf.hpp adds rpc::protobuf_codec for
// protobuf messages: rpc::method<Req, Rep, rpc::protobuf_codec>.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace anydoor::rpc {

// Where an encoder writes: the call's own reusable buffer (no allocation
// once it has grown to the largest message).
class writer {
 public:
  explicit writer(std::vector<std::byte>& out) noexcept : out_(out) {}
  // Appends n bytes and returns them to be filled.
  std::span<std::byte> prepare(std::size_t n) {
    const std::size_t at = out_.size();
    out_.resize(at + n);
    return {out_.data() + at, n};
  }
  void append(const void* data, std::size_t n) {
    if (n != 0) std::memcpy(prepare(n).data(), data, n);
  }
  void append(std::span<const std::byte> b) { append(b.data(), b.size()); }
  std::size_t size() const noexcept { return out_.size(); }

 private:
  std::vector<std::byte>& out_;
};

template <class C, class T>
concept codec_for = requires(const T& value, T& out, writer& w, std::span<const std::byte> in) {
  C::encode(value, w);
  { C::decode(in, out) } -> std::convertible_to<bool>;
};

// Trivially copyable types: their object representation (same ABI on both
// ends: the same struct, compiled for the same byte order).
template <class T>
struct trivial_codec {
  static_assert(std::is_trivially_copyable_v<T>, "trivial_codec needs a trivially copyable type");
  static void encode(const T& v, writer& w) { w.append(&v, sizeof(T)); }
  static bool decode(std::span<const std::byte> in, T& out) noexcept {
    if (in.size() != sizeof(T)) return false;
    std::memcpy(&out, in.data(), sizeof(T));
    return true;
  }
};

template <class T>
inline constexpr bool is_byte_container_v = false;
template <class Char>
inline constexpr bool is_byte_container_v<std::basic_string<Char>> = sizeof(Char) == 1;
template <class Byte>
inline constexpr bool is_byte_container_v<std::vector<Byte>> =
    sizeof(Byte) == 1 && std::is_trivially_copyable_v<Byte>;

// std::string, std::vector<std::byte | char | std::uint8_t>: the bytes.
template <class T>
struct bytes_codec {
  static_assert(is_byte_container_v<T>, "bytes_codec needs a string or vector of bytes");
  static void encode(const T& v, writer& w) { w.append(v.data(), v.size()); }
  static bool decode(std::span<const std::byte> in, T& out) {
    out.resize(in.size());
    if (!in.empty()) std::memcpy(out.data(), in.data(), in.size());
    return true;
  }
};

template <class T>
struct default_codec_for {
  static_assert(is_byte_container_v<T> || std::is_trivially_copyable_v<T>,
                "no default codec for this type: give the method a codec (rpc::method<Req, Rep, Codec>)");
  using type = std::conditional_t<is_byte_container_v<T>, bytes_codec<T>, trivial_codec<T>>;
};
template <class T>
struct default_codec : default_codec_for<T>::type {};

// FNV-1a (64-bit) of a method's name: its id on the wire.
consteval std::uint64_t method_id(std::string_view name) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (char c : name) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

template <class Request, class Reply, template <class> class Codec = default_codec>
struct method {
  using request_type = Request;
  using reply_type = Reply;
  using request_codec = Codec<Request>;
  using reply_codec = Codec<Reply>;
  static_assert(codec_for<request_codec, Request>, "the request codec does not fit (see codec_for)");
  static_assert(codec_for<reply_codec, Reply>, "the reply codec does not fit (see codec_for)");
  static_assert(std::is_default_constructible_v<Request> && std::is_default_constructible_v<Reply>,
                "requests and replies are decoded into default-constructed values");

  consteval explicit method(std::string_view n) : name(n), id(method_id(n)) {}
  // A pinned id (a method renamed without changing its id, say).
  consteval method(std::string_view n, std::uint64_t pinned) : name(n), id(pinned) {}
  std::string_view name;
  std::uint64_t id;
};

template <class M>
concept typed_method = requires {
  typename M::request_type;
  typename M::reply_type;
  typename M::request_codec;
  typename M::reply_codec;
};

}  // namespace anydoor::rpc
