// A reactor per core: N threads, each running its own io_context with its
// own fabric (device, completion queue, reactor, buffer pool), behind one
// listening socket. A connection and its handlers stay on the thread of the
// reactor it was placed on; nothing is shared on the data path, so nothing
// there takes a lock. Work for another reactor goes through its executor
// (asio::post(group.get_executor(i), ...)).
//
//   anydoor::reactor_group group({.threads = 4, .fabric = {...}});
//   auto acceptors = group.listen("0.0.0.0", 7471);        // one per reactor
//   for (std::size_t i = 0; i < group.size(); ++i)
//     asio::co_spawn(group.context(i), serve(std::move(acceptors[i])), asio::detached);
//   ...                                  // connections arrive round robin
//   group.stop();
//
// Threads are pinned: to reactor_group_options::cpus when given (reactor i
// on cpus[i % size]); else to the cores of the RDMA device's NUMA node
// (sysfs numa_node) that the process may use, else to all cores it may use,
// reactor i on the i-th of them (round robin). Each thread pins itself
// before it builds its fabric, so the fabric's memory (pool slabs, queues)
// is first touched on the reactor's own node. The log says where each
// reactor runs. Threads a reactor starts (its fabric's connection-setup
// helpers and liveness timer) inherit its core. Two groups in one process
// with automatic placement both start at the first core: give `cpus` to
// keep them apart.
#pragma once

#include <anydoor/fabric.hpp>

#include <boost/asio/io_context.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace anydoor {

struct reactor_group_options {
  std::size_t threads = 1;    // reactors: 1..256
  fabric_options fabric;      // each reactor's fabric (the same for all)
  // Cores to pin the reactors to (reactor i on cpus[i % cpus.size()]); each
  // must be one the process may run on. Empty: automatic (see above).
  std::vector<int> cpus;
  bool pin = true;            // false: threads run wherever the system puts them (cpus must be empty)
};

// Where a reactor runs.
struct reactor_placement {
  int cpu = -1;         // the core it is pinned to; -1: not pinned
  int numa_node = -1;   // that core's NUMA node; -1: unknown
};

// Which reactor takes an accepted connection: called on the listener's
// thread with the attempt's sequence number (0, 1, 2, ... per listen()) and
// the number of reactors; returns a reactor index. It must not block (every
// attempt waits for it, and so does closing the last acceptor). An index
// out of range, or an exception, is logged (once) and the attempt placed
// round robin. A reactor whose acceptor is closed (or holds
// `kMaxQueuedPerReactor` attempts not yet taken) is skipped for the next
// one. An attempt that waits on a reactor longer than twice the handshake
// timeout (a reactor too busy to accept, or an application that stopped
// calling async_accept there) is refused with too_many_connections.
struct placement_request {
  std::uint64_t sequence = 0;
  std::size_t reactors = 0;
};
using placement_hook = std::function<std::size_t(const placement_request&)>;

class reactor_group {
 public:
  // Attempts placed on one reactor and not yet taken by its acceptor.
  static constexpr std::size_t kMaxQueuedPerReactor = 64;

  // Starts the threads; each pins itself, builds its fabric and runs its
  // io_context until stop(). Throws std::system_error: errc::invalid_argument
  // (threads out of range, a core the process may not use), or what a
  // fabric's construction threw (the threads already started are stopped).
  explicit reactor_group(reactor_group_options options = {});
  // stop(). As with a fabric, connections and acceptors should be gone
  // first (close them on their reactors and let their coroutines end);
  // the fabrics are destroyed after their threads ended, then the io_contexts.
  ~reactor_group();
  reactor_group(const reactor_group&) = delete;
  reactor_group& operator=(const reactor_group&) = delete;

  std::size_t size() const noexcept;
  // Reactor i's fabric, io_context, executor and placement. Throws
  // std::system_error (errc::invalid_argument) when i >= size().
  fabric& at(std::size_t i);
  asio::io_context& context(std::size_t i);
  asio::io_context::executor_type get_executor(std::size_t i);
  reactor_placement placement(std::size_t i) const;

  // Listens on host:port (port 0: a free one) with one listening socket and
  // returns one acceptor per reactor (acceptors[i] on reactor i; its
  // async_accept completes there). Each good connection attempt is placed
  // on a reactor (round robin, or `hook`) and completes that reactor's
  // async_accept; attempts no reactor can take (every open one full, or
  // waited too long) are refused with too_many_connections. Those, and the
  // listener's own refusals (bad handshakes), are counted in reactor 0's
  // fabric_stats::refused while its acceptor is open; each reactor's
  // acceptor counts its own as usual. The socket closes when the last of
  // the acceptors does (later attempts: connection_refused). Throws
  // std::system_error.
  std::vector<acceptor> listen(const std::string& host, std::uint16_t port, placement_hook hook = {});

  // Stops every io_context and joins the threads (not from a reactor's own
  // thread: errc::invalid_state is thrown there; destroying the group there
  // terminates the program). Idempotent; call it from one thread. A group
  // does not restart: what is posted to a reactor afterwards never runs.
  void stop();

 private:
  struct reactor;
  std::vector<std::unique_ptr<reactor>> reactors_;
};

}  // namespace anydoor
