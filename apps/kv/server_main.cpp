// anydoor-kv-server: the key-value store behind RPC (with one-sided GETs
// on its table) and, with --resp-listen, the Redis protocol.
#include "common/args.hpp"
#include "resp.hpp"
#include "service.hpp"

#include <anydoor/fabric.hpp>

#include <boost/asio/signal_set.hpp>

#include <csignal>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>

namespace {

constexpr const char* kUsage =
    "anydoor-kv-server --listen HOST:PORT [--data-dir DIR] [--sync always|everysec|no] [--resp-listen HOST:PORT]\n"
    "       [--max-memory BYTES] [--max-key BYTES] [--max-value BYTES] [--compact-min BYTES]\n"
    "       [--max-connections N] [--resp-max-clients N] [--provider auto|tcp|verbs]";

namespace kv = anydoor::apps::kv;
namespace asio = boost::asio;
using anydoor::apps::arg_scanner;
using anydoor::apps::endpoint;

struct options {
  endpoint listen;
  std::optional<endpoint> resp;
  std::string data_dir;
  kv::sync_mode sync = kv::sync_mode::everysec;
  kv::store_options store;
  std::uint64_t compact_min = std::uint64_t{1} << 20;
  std::uint32_t resp_max_clients = 1000;
  std::uint32_t max_connections = 128;  // x (send queue + credits) must fit the device's CQ (rxe: 32767)
  std::string provider = "auto";
};

options parse(int argc, char** argv) {
  options o;
  arg_scanner a(argc, argv, 1, kUsage);
  bool listen = false;
  auto ep = [&] {
    const std::string opt(a.arg());
    const std::string_view v = a.value();
    endpoint e;
    if (!anydoor::apps::parse_endpoint(v, e)) a.fail(opt + " takes HOST:PORT, not '" + std::string(v) + "'");
    return e;
  };
  while (a.next()) {
    const std::string_view opt = a.arg();
    if (opt == "--help" || opt == "-h") {
      std::printf("usage: %s\n", kUsage);
      std::exit(0);
    } else if (opt == "--listen") {
      o.listen = ep();
      listen = true;
    } else if (opt == "--resp-listen") {
      o.resp = ep();
    } else if (opt == "--data-dir") {
      o.data_dir = std::string(a.value());
      if (o.data_dir.empty()) a.fail("--data-dir takes a directory");
    } else if (opt == "--sync") {
      const std::string_view v = a.value();
      if (v == "always") o.sync = kv::sync_mode::always;
      else if (v == "everysec") o.sync = kv::sync_mode::everysec;
      else if (v == "no") o.sync = kv::sync_mode::no;
      else a.fail("--sync takes always, everysec or no, not '" + std::string(v) + "'");
    } else if (opt == "--max-memory") {
      o.store.max_memory = a.size_value(4096, std::uint64_t{1} << 40);
    } else if (opt == "--max-key") {
      o.store.max_key = static_cast<std::uint32_t>(a.size_value(1, 65535));
    } else if (opt == "--max-value") {
      o.store.max_value = static_cast<std::uint32_t>(a.size_value(0, std::uint64_t{1} << 30));
    } else if (opt == "--compact-min") {
      o.compact_min = a.size_value(0);
    } else if (opt == "--resp-max-clients") {
      o.resp_max_clients = static_cast<std::uint32_t>(a.size_value(1, 100000));
    } else if (opt == "--max-connections") {
      o.max_connections = static_cast<std::uint32_t>(a.size_value(1, 4096));
    } else if (opt == "--provider") {
      o.provider = std::string(a.value());
      if (o.provider != "auto" && o.provider != "tcp" && o.provider != "verbs") {
        a.fail("--provider takes auto, tcp or verbs, not '" + o.provider + "'");
      }
    } else {
      a.fail("unknown option " + std::string(opt));
    }
  }
  if (!listen) a.fail("needs --listen HOST:PORT");
  return o;
}

int run(const options& o) {
  asio::io_context io;
  kv::store st(o.store);
  std::unique_ptr<kv::durable_log> log;
  if (!o.data_dir.empty()) {
    log = std::make_unique<kv::durable_log>(
        io, kv::log_options{.dir = o.data_dir, .sync = o.sync, .compact_min = o.compact_min},
        [&](kv::record_type t, std::string_view k, std::span<const std::byte> v) {
          if (t == kv::record_type::del) {
            st.del(k);
            return;
          }
          const auto r = st.put(k, v, true);
          if (r == kv::put_status::ok) return;
          throw std::runtime_error(r == kv::put_status::out_of_memory
                                       ? "the log holds more data than --max-memory " +
                                             std::to_string(o.store.max_memory) + " bytes takes: raise it"
                                       : "the log holds a key of " + std::to_string(k.size()) + " or a value of " +
                                             std::to_string(v.size()) +
                                             " bytes, above --max-key/--max-value: raise them");
        });
    const auto& rep = log->replayed();
    std::printf("anydoor-kv-server: data dir %s, sync %s: replayed %llu records (%llu keys, %llu log bytes) in %.1f ms\n",
                o.data_dir.c_str(), kv::to_string(o.sync), static_cast<unsigned long long>(rep.records),
                static_cast<unsigned long long>(st.stats().keys), static_cast<unsigned long long>(rep.bytes), rep.ms);
    if (rep.torn_bytes != 0) {
      std::printf("anydoor-kv-server: cut a torn tail of %llu bytes off the log: %s (saved to %s)\n",
                  static_cast<unsigned long long>(rep.torn_bytes), rep.torn_why.c_str(), rep.torn_copy.c_str());
    }
  } else {
    std::printf("anydoor-kv-server: memory-only (no --data-dir): the data is lost when the server stops\n");
  }
  kv::service svc(st, log.get());
  svc.maybe_compact();  // a log already past twice the live data

  anydoor::fabric_options fo;
  fo.device.provider = o.provider;
  fo.max_connections = o.max_connections;
  fo.connection.max_message = std::max<std::uint64_t>(std::uint64_t{1} << 20, 4 + o.store.max_key + std::uint64_t{o.store.max_value} + 64);
  fo.connection.rendezvous_memory = std::max<std::uint64_t>(std::uint64_t{16} << 20, fo.connection.max_message);
  anydoor::fabric fab(io, fo);
  anydoor::memory_region table = fab.register_memory(st.memory(), anydoor::access::remote_read);
  anydoor::rpc::server srv({.max_concurrent_calls = 64});
  svc.add_methods(srv, table);
  anydoor::acceptor acc = fab.listen(o.listen.host, o.listen.port);
  endpoint bound = o.listen;
  bound.port = acc.port();
  asio::signal_set signals(io, SIGINT, SIGTERM);
  std::unique_ptr<kv::resp_door> door;
  bool failed = false;
  auto stop_all = [&] {
    signals.cancel();
    srv.shutdown(std::chrono::seconds(2));
    if (door) door->stop();
  };
  srv.async_serve(std::move(acc), [&](anydoor::error_code ec) {
    if (ec && ec != std::errc::operation_canceled) {
      std::fprintf(stderr, "anydoor-kv-server: the listener failed: %s\n", ec.message().c_str());
      failed = true;
      stop_all();
    }
  });
  if (o.resp) {
    door = std::make_unique<kv::resp_door>(io, svc, o.resp->host, o.resp->port, o.resp_max_clients);
    endpoint rb = *o.resp;
    rb.port = door->port();
    std::printf("anydoor-kv-server: redis protocol on %s\n", rb.str().c_str());
  }
  signals.async_wait([&](const anydoor::error_code& ec, int sig) {
    if (ec) return;
    std::fprintf(stderr, "anydoor-kv-server: %s: shutting down\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
    stop_all();
  });
  std::printf("anydoor-kv-server: listening on %s (provider %.*s, %llu buckets, max memory %llu bytes)\n",
              bound.str().c_str(), static_cast<int>(fab.provider().size()), fab.provider().data(),
              static_cast<unsigned long long>(st.describe().buckets),
              static_cast<unsigned long long>(o.store.max_memory));
  std::fflush(stdout);
  io.run();
  if (log) log->close();
  const auto ss = st.stats();
  std::printf("anydoor-kv-server: stopped with %llu keys\n", static_cast<unsigned long long>(ss.keys));
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "anydoor-kv-server: %s\n", e.what());
    return 1;
  }
}
