// anydoor's RPC layer: typed and untyped calls over connections, with
// deadlines, cancellation, backpressure and bulk data by RDMA.
//   rpc/status.hpp   status codes (gRPC's) and rpc::status
//   rpc/codec.hpp    rpc::method<Request, Reply>, codecs
//   rpc/client.hpp   rpc::client over one connection
//   rpc/server.hpp   rpc::server, rpc::server_call, rpc::result
//   rpc/channel.hpp  rpc::channel: dials lazily, reconnects with backoff
//   rpc/protobuf.hpp rpc::protobuf_codec (include it where protobuf is used)
#pragma once

#include <anydoor/rpc/channel.hpp>
#include <anydoor/rpc/client.hpp>
#include <anydoor/rpc/codec.hpp>
#include <anydoor/rpc/server.hpp>
#include <anydoor/rpc/status.hpp>
