// anydoor-kv-server: the key-value store behind RPC (with one-sided GETs
// on its table) and, with --resp-listen, the Redis protocol. With
// --threads N (N > 1) it runs N reactors (a reactor_group) behind one
// listening socket: the store, its log and the Redis door live on reactor
// 0; the RPC servers of the others hand each call to reactor 0 and answer
// from their own thread; GETs by READ touch no server thread at all (the
// table is registered with every reactor's fabric).
#include "common/args.hpp"
#include "common/on_reactor.hpp"
#include "resp.hpp"
#include "service.hpp"

#include <anydoor/fabric.hpp>
#include <anydoor/metrics.hpp>
#include <anydoor/reactor_group.hpp>

#include <boost/asio/signal_set.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

namespace {

constexpr const char* kUsage =
    "anydoor-kv-server --listen HOST:PORT [--data-dir DIR] [--sync always|everysec|no] [--resp-listen HOST:PORT]\n"
    "       [--max-memory BYTES] [--max-key BYTES] [--max-value BYTES] [--compact-min BYTES]\n"
    "       [--max-connections N] [--resp-max-clients N] [--threads N] [--metrics-listen HOST:PORT]\n"
    "       [--provider auto|tcp|verbs] [--progress-thread]";

namespace kv = anydoor::apps::kv;
namespace asio = boost::asio;
using anydoor::apps::arg_scanner;
using anydoor::apps::endpoint;
using anydoor::apps::on_reactor;
using anydoor::apps::on_reactor_within;

struct options {
  endpoint listen;
  std::optional<endpoint> resp;
  std::optional<endpoint> metrics;  // --metrics-listen: live counters (GET /metrics)
  std::string data_dir;
  kv::sync_mode sync = kv::sync_mode::everysec;
  kv::store_options store;
  std::uint64_t compact_min = std::uint64_t{64} << 20;  // as Redis's auto-aof-rewrite-min-size
  std::uint32_t resp_max_clients = 1000;
  std::uint32_t max_connections = 128;  // x (send queue + credits) must fit the device's CQ (rxe: 32767)
  std::size_t threads = 1;              // reactors (per reactor: max_connections)
  std::string provider = "auto";
  bool progress_thread = false;  // tcp: GETs by READ served while the io thread is busy
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
    } else if (opt == "--metrics-listen") {
      o.metrics = ep();
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
    } else if (opt == "--threads") {
      o.threads = static_cast<std::size_t>(a.size_value(1, 256));
    } else if (opt == "--progress-thread") {
      o.progress_thread = true;
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

// Opens the log in --data-dir (replaying it into the store), or says the
// server is memory-only. Throws std::runtime_error (refusal to start).
std::unique_ptr<kv::durable_log> open_log(const options& o, asio::io_context& io, kv::store& st) {
  if (o.data_dir.empty()) {
    std::printf("anydoor-kv-server: memory-only (no --data-dir): the data is lost when the server stops\n");
    return nullptr;
  }
  auto log = std::make_unique<kv::durable_log>(
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
  if (rep.zero_bytes != 0) {
    std::printf("anydoor-kv-server: %llu bytes of zeros after the last record skipped (space the log reserved "
                "ahead with --sync always, left by a crash or a kill; or a file extended without its data)\n",
                static_cast<unsigned long long>(rep.zero_bytes));
  }
  if (!rep.sync_failed_before.empty() && !rep.rewritten) {
    std::printf("anydoor-kv-server: found the marker of a failed fdatasync (%s) beside an empty log: nothing to "
                "rewrite; removed it\n",
                rep.sync_failed_before.c_str());
  } else if (!rep.sync_failed_before.empty()) {
    std::printf("anydoor-kv-server: the last run could not make the log durable (%s): rewrote it into a new file from "
                "what it read, so that all of it is on the disk now; check what the clients wrote last (what the "
                "page cache lost is not there)\n",
                rep.sync_failed_before.c_str());
  } else if (rep.rewritten) {
    std::printf("anydoor-kv-server: rewrote the log (version 1, an earlier server's) as version 2 (salted records)\n");
  }
  if (log->salt() == 0) {
    std::printf("anydoor-kv-server: the log stays version 1 (%s): its records are not salted, so a value holding a "
                "well-formed record, cut short by a crash, reads as corruption; the next start tries again\n",
                rep.rewrite_failed.c_str());
  }
  if (rep.torn_bytes != 0) {
    std::printf("anydoor-kv-server: cut a torn tail of %llu bytes off the log: %s (saved to %s)\n",
                static_cast<unsigned long long>(rep.torn_bytes), rep.torn_why.c_str(), rep.torn_copy.c_str());
  }
  return log;
}

anydoor::fabric_options fabric_options_for(const options& o) {
  anydoor::fabric_options fo;
  fo.device.provider = o.provider;
  fo.max_connections = o.max_connections;
  fo.progress_thread = o.progress_thread;
  fo.connection.max_message = std::max<std::uint64_t>(std::uint64_t{1} << 20, 4 + o.store.max_key + std::uint64_t{o.store.max_value} + 64);
  fo.connection.rendezvous_memory = std::max<std::uint64_t>(std::uint64_t{16} << 20, fo.connection.max_message);
  return fo;
}

void print_listening(const options& o, std::uint16_t port, std::string_view provider, const kv::store& st) {
  endpoint bound = o.listen;
  bound.port = port;
  std::string threads;
  if (o.threads > 1) {
    threads = ", ";  // (not ", " + to_string(): GCC 12 at -O3 warns falsely, -Wrestrict)
    threads += std::to_string(o.threads);
    threads += " reactor threads";
  }
  if (o.progress_thread && provider == "tcp") threads += o.threads > 1 ? ", a progress thread each" : ", progress thread";
  std::printf("anydoor-kv-server: listening on %s (provider %.*s, %llu buckets, max memory %llu bytes%s%s)\n",
              bound.str().c_str(), static_cast<int>(provider.size()), provider.data(),
              static_cast<unsigned long long>(st.describe().buckets),
              static_cast<unsigned long long>(o.store.max_memory), threads.c_str(),
              st.index_resident() ? "" : ", index faulted in as keys arrive: larger than half the memory (RAM or cgroup limit)");
  std::fflush(stdout);
}

std::unique_ptr<kv::resp_door> open_door(const options& o, asio::io_context& io, kv::service& svc) {
  if (!o.resp) return nullptr;
  auto door = std::make_unique<kv::resp_door>(io, svc, o.resp->host, o.resp->port, o.resp_max_clients);
  endpoint rb = *o.resp;
  rb.port = door->port();
  std::printf("anydoor-kv-server: redis protocol on %s\n", rb.str().c_str());
  return door;
}

std::unique_ptr<anydoor::metrics_endpoint> open_metrics(const options& o, asio::io_context& io,
                                                        anydoor::metrics_endpoint::collector c) {
  if (!o.metrics) return nullptr;
  auto m = std::make_unique<anydoor::metrics_endpoint>(io, o.metrics->host, o.metrics->port, std::move(c));
  endpoint bound = *o.metrics;
  bound.port = m->port();
  std::printf("anydoor-kv-server: metrics on %s (GET /metrics)\n", bound.str().c_str());
  return m;
}

int run(const options& o) {
  asio::io_context io{1};  // hint 1: one thread runs it (Asio queues what that thread posts without a lock)
  kv::store st(o.store);
  std::unique_ptr<kv::durable_log> log = open_log(o, io, st);
  kv::service svc(st, log.get());
  svc.maybe_compact();  // a log already past twice the live data

  anydoor::fabric fab(io, fabric_options_for(o));
  anydoor::memory_region table = fab.register_memory(st.memory(), anydoor::access::remote_read);
  anydoor::rpc::server srv({.max_concurrent_calls = 64});
  svc.add_methods(srv, table);
  anydoor::acceptor acc = fab.listen(o.listen.host, o.listen.port);
  const std::uint16_t port = acc.port();
  asio::signal_set signals(io, SIGINT, SIGTERM);
  std::unique_ptr<kv::resp_door> door;
  std::unique_ptr<anydoor::metrics_endpoint> metrics = open_metrics(o, io, anydoor::collect(fab));
  bool failed = false;
  auto stop_all = [&] {
    signals.cancel();
    if (log) log->stop_compaction();  // (else io.run() would wait for a compaction under way to finish)
    srv.shutdown(std::chrono::seconds(2));
    if (door) door->stop();
    if (metrics) metrics->stop();
  };
  srv.async_serve(std::move(acc), [&](anydoor::error_code ec) {
    if (ec && ec != std::errc::operation_canceled) {
      std::fprintf(stderr, "anydoor-kv-server: the listener failed: %s\n", ec.message().c_str());
      failed = true;
      stop_all();
    }
  });
  door = open_door(o, io, svc);
  signals.async_wait([&](const anydoor::error_code& ec, int sig) {
    if (ec) return;
    std::fprintf(stderr, "anydoor-kv-server: %s: shutting down\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
    stop_all();
  });
  print_listening(o, port, fab.provider(), st);
  io.run();
  if (log) log->close();
  const auto ss = st.stats();
  std::printf("anydoor-kv-server: stopped with %llu keys\n", static_cast<unsigned long long>(ss.keys));
  return failed ? 1 : 0;
}

// --threads N: reactor 0 is the store's home (the store, the log, the
// Redis door, and its own RPC server); every other reactor serves the
// connections placed on it and hands each call to reactor 0. The main
// thread waits for the signal, shuts every server down on its own reactor
// and lets the connections drain; then one teardown (below) ends the rest.
int run_group(const options& o) {
  // Declared before the group: coroutines still suspended when the reactors
  // stop are destroyed with their io_contexts, and may touch the store.
  kv::store st(o.store);
  std::unique_ptr<kv::service> svc;
  auto group = std::make_unique<anydoor::reactor_group>(
      anydoor::reactor_group_options{.threads = o.threads, .fabric = fabric_options_for(o)});
  anydoor::reactor_group& g = *group;
  const std::size_t n = g.size();
  // Objects of reactor 0's io_context: destroyed while it exists (see the
  // teardown).
  std::unique_ptr<kv::durable_log> log;
  std::unique_ptr<kv::resp_door> door;
  std::vector<anydoor::memory_region> tables(n);
  std::vector<std::unique_ptr<anydoor::rpc::server>> servers;

  // What the serving handlers touch (declared before the teardown, which
  // completes them: they must outlive it on every path).
  asio::io_context main_io;
  asio::signal_set signals(main_io, SIGINT, SIGTERM);
  std::unique_ptr<anydoor::metrics_endpoint> metrics;  // on main_io, opened once everything serves
  std::atomic<std::size_t> serving{n};
  std::atomic<bool> failed{false};
  auto shutdown_all = [&] {
    if (metrics) metrics->stop();
    for (std::size_t i = 0; i < servers.size(); ++i) {
      asio::post(g.get_executor(i), [&, i] {
        servers[i]->shutdown(std::chrono::seconds(2));
        if (i == 0 && door) door->stop();
      });
    }
  };

  // The one way this run ends, on the normal path and when the start fails
  // part way (an exception: the log, the door or the listener refused):
  // the servers and the door stop on their reactors and the door's
  // connections get a bounded time to end; the log writes what it holds;
  // each reactor drops its table registration; the reactors stop; then the
  // door and the log are destroyed while their io_context still exists and
  // nothing runs it, and the servers before the group.
  struct teardown_guard {
    std::function<void()> f;
    ~teardown_guard() { f(); }
  };
  teardown_guard teardown{[&] {
    bool door_idle = true;
    try {
      for (std::size_t i = 0; i < servers.size(); ++i) {
        on_reactor(g, i, [&, i] {
          servers[i]->shutdown(std::chrono::seconds(2));
          if (i == 0 && door) door->stop();
        });
      }
      if (servers.empty()) on_reactor(g, 0, [&] { if (door) door->stop(); });
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
      while (!(door_idle = on_reactor(g, 0, [&] { return !door || door->stats().connections == 0; })) &&
             std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      on_reactor(g, 0, [&] {
        if (log) log->close();
      });
      for (std::size_t i = 0; i < n; ++i) on_reactor(g, i, [&, i] { tables[i] = anydoor::memory_region(); });
    } catch (const std::exception& e) {
      std::fprintf(stderr, "anydoor-kv-server: while stopping: %s\n", e.what());
    }
    g.stop();
    // A door session still open after the grace is a coroutine of reactor
    // 0 that refers to the door: the door is then left to the process's
    // exit rather than freed under it.
    if (door_idle) {
      door.reset();
    } else {
      std::fprintf(stderr, "anydoor-kv-server: Redis connections still open after 3 s: not waiting longer\n");
      (void)door.release();
    }
    log.reset();
    servers.clear();
    group.reset();
  }};

  log = open_log(o, g.context(0), st);  // nothing on reactor 0 touches it yet
  svc = std::make_unique<kv::service>(st, log.get());
  svc->set_home(g.get_executor(0));
  on_reactor(g, 0, [&] { svc->maybe_compact(); });
  // The Redis door before anything serves: a busy port fails the start
  // while nothing else runs yet.
  on_reactor(g, 0, [&] { door = open_door(o, g.context(0), *svc); });
  for (std::size_t i = 0; i < n; ++i) {
    servers.push_back(std::make_unique<anydoor::rpc::server>(anydoor::rpc::server_options{.max_concurrent_calls = 64}));
    on_reactor(g, i, [&, i] {
      tables[i] = g.at(i).register_memory(st.memory(), anydoor::access::remote_read);
      if (i == 0) {
        svc->add_methods(*servers[i], tables[i]);
      } else {
        svc->add_remote_methods(*servers[i], tables[i], g.get_executor(0));
      }
    });
  }
  std::vector<anydoor::acceptor> accs = g.listen(o.listen.host, o.listen.port);
  const std::uint16_t port = accs[0].port();
  for (std::size_t i = 0; i < n; ++i) {
    on_reactor(g, i, [&, i] {
      servers[i]->async_serve(std::move(accs[i]), [&](anydoor::error_code ec) {
        if (ec && ec != std::errc::operation_canceled) {
          std::fprintf(stderr, "anydoor-kv-server: the listener failed: %s\n", ec.message().c_str());
          failed = true;
          asio::post(main_io, [&] { signals.cancel(); shutdown_all(); });
        }
        if (--serving == 0) {  // the last server done
          asio::post(main_io, [&] {
            signals.cancel();
            if (metrics) metrics->stop();
          });
        }
      });
    });
  }
  signals.async_wait([&](const anydoor::error_code& ec, int sig) {
    if (ec) return;
    std::fprintf(stderr, "anydoor-kv-server: %s: shutting down\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
    shutdown_all();
  });
  metrics = open_metrics(o, main_io, anydoor::collect(g));
  print_listening(o, port, g.at(0).provider(), st);
  main_io.run();  // until every server's accepting has ended (the signal's shutdown, or a failure)
  while (serving > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  // Running calls answer and the RPC connections close within the
  // shutdown's grace (the teardown waits for the Redis ones).
  const auto drain_until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  for (;;) {
    std::uint64_t open = 0;
    for (std::size_t i = 0; i < n; ++i) {
      // (a reactor that does not answer counts as one still open)
      open += on_reactor_within(g, i, std::chrono::seconds(1),
                                [srv = servers[i].get()] { return srv->stats().connections; })
                  .value_or(1);
    }
    if (open == 0 || std::chrono::steady_clock::now() > drain_until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::string per;
  for (std::size_t i = 0; i < n; ++i) {
    per.push_back(' ');  // (not " " + to_string(): GCC 12 at -O3 warns falsely, -Wrestrict)
    per += std::to_string(on_reactor(g, i, [&, i] { return servers[i]->stats().calls; }));
  }
  teardown.f();
  teardown.f = [] {};
  std::printf("anydoor-kv-server: stopped with %llu keys (RPC calls per reactor:%s)\n",
              static_cast<unsigned long long>(st.stats().keys), per.c_str());
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  // A file size limit (ulimit -f, systemd's LimitFSIZE) would kill the
  // server at the log's first write past it (SIGXFSZ); ignored, the write
  // fails with EFBIG instead, and the log fails as on a full disk: writes
  // refused with the reason, reads going on, the operator told.
  std::signal(SIGXFSZ, SIG_IGN);
  try {
    return o.threads > 1 ? run_group(o) : run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "anydoor-kv-server: %s\n", e.what());
    return 1;
  }
}
