// A codec for protobuf messages (needs protobuf's headers and library):
//   inline constexpr rpc::method<my::GetRequest, my::GetReply, rpc::protobuf_codec> get{"kv.Get"};
#pragma once

#include <anydoor/rpc/codec.hpp>

#include <google/protobuf/message_lite.h>

#include <climits>
#include <type_traits>

namespace anydoor::rpc {

template <class T>
struct protobuf_codec {
  static_assert(std::is_base_of_v<google::protobuf::MessageLite, T>, "protobuf_codec needs a protobuf message");
  static void encode(const T& v, writer& w) {
    const std::size_t n = v.ByteSizeLong();
    if (n == 0) return;
    auto out = w.prepare(n);
    v.SerializeWithCachedSizesToArray(reinterpret_cast<std::uint8_t*>(out.data()));
  }
  static bool decode(std::span<const std::byte> in, T& out) {
    if (in.size() > static_cast<std::size_t>(INT_MAX)) return false;
    return out.ParseFromArray(in.data(), static_cast<int>(in.size()));
  }
};

}  // namespace anydoor::rpc
