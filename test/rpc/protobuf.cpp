// rpc::protobuf_codec: protobuf messages as typed requests and replies
// (built when protobuf is found; scripts/setup installs it).
#include "support.hpp"

#include <anydoor/rpc/protobuf.hpp>

#include "kv.pb.h"

using namespace anydoor::test;

namespace {
namespace pb = anydoor::test;
inline constexpr rpc::method<pb::GetRequest, pb::GetReply, rpc::protobuf_codec> get{"test.kv.Get"};
}  // namespace

TEST_CASE("rpc: protobuf messages travel with protobuf_codec, and bytes that do not parse are refused",
          "[rpc]") {
  rpc_env env;
  env.srv.add(get, [](const pb::GetRequest& req, rpc::server_call&) -> rpc::result<pb::GetReply> {
    if (req.key() == "missing") return rpc::status(rpc::errc::not_found, req.key());
    pb::GetReply rep;
    rep.set_value(std::string(100000, 'v') + req.key());  // above the eager limit: two messages
    rep.set_version(7);
    return rep;
  });
  env.serve();
  failure f;
  asio::co_spawn(env.io, [&]() -> awaitable<void> {
    rpc::client cli = co_await env.connect();
    pb::GetRequest req;
    req.set_key("k1");
    pb::GetReply rep = co_await cli.async_call(get, req, use_awaitable);
    CHECK(rep.version() == 7);
    CHECK(rep.value().size() == 100002);
    CHECK(rep.value().substr(100000) == "k1");
    req.set_key("missing");
    auto [ec, r2] = co_await cli.async_call(get, req, asio::as_tuple(use_awaitable));
    CHECK(ec == rpc::errc::not_found);
    // Field 1 with wire type 7 does not exist: the server's codec refuses it.
    const unsigned char junk[] = {0x0f, 0xff, 0xff};
    auto [ec3, r3] = co_await cli.async_call(get.id, asio::buffer(junk), asio::as_tuple(use_awaitable));
    CHECK(ec3 == rpc::errc::invalid_argument);
    CHECK(r3.status_message() == "the request could not be decoded");
    env.srv.stop();
  }, f.handler());
  run_to_completion(env.io);
  f.check();
}
