// Methods the RPC tests and their server process share.
#pragma once

#include <anydoor/rpc.hpp>

#include <cstdint>
#include <string>

namespace anydoor::test::rpc_methods {

namespace rpc = anydoor::rpc;

struct add_req {
  std::int64_t a = 0;
  std::int64_t b = 0;
};
inline constexpr rpc::method<add_req, std::int64_t> add{"test.add"};
inline constexpr rpc::method<std::string, std::string> echo{"test.echo"};
// Sleeps the given number of microseconds (a coroutine), then returns it.
inline constexpr rpc::method<std::uint32_t, std::uint32_t> sleep_us{"test.sleep_us"};
// Never replies unless cancelled.
inline constexpr rpc::method<std::uint32_t, std::uint32_t> hang{"test.hang"};
inline constexpr std::uint64_t raw_echo = 0x1001;

}  // namespace anydoor::test::rpc_methods
