// A kv server for in-process client tests: a store, its service, the
// server's fabric with the table registered for remote READ (as
// anydoor-kv-server exposes it), an RPC server serving a listener at
// `where`, and a fabric for clients, all on one io_context (which must
// outlive the rig: queued work calls the service).
#pragma once

#include "../support/runtime.hpp"
#include "kv/service.hpp"
#include "kv/store.hpp"

#include <anydoor/anydoor.hpp>

#include <string>

namespace anydoor::test {

struct kv_rig {
  // `log`: the service's (null: memory-only).
  kv_rig(asio::io_context& io, const apps::kv::store_options& o, apps::kv::durable_log* log = nullptr)
      : st(o), svc(st, log), sfab(io, test_options()), cfab(io, test_options()),
        table(sfab.register_memory(st.memory(), access::remote_read)) {
    svc.add_methods(srv, table);
    acceptor acc = sfab.listen(test_host(), 0);
    where = addr(acc);
    srv.async_serve(std::move(acc), [](error_code) {});
  }

  apps::kv::store st;
  apps::kv::service svc;
  fabric sfab;
  fabric cfab;
  memory_region table;
  rpc::server srv;
  std::string where;
};

}  // namespace anydoor::test
