#include <anydoor/reactor_group.hpp>

#include "log.hpp"
#include "shared_listener.hpp"

#include <anydoor/error.hpp>

#include <boost/asio/executor_work_guard.hpp>

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <exception>
#include <fstream>
#include <latch>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>

namespace anydoor {


namespace {

constexpr std::size_t kMaxThreads = 256;

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) {
    throw std::system_error(errno, std::system_category(), "reactor_group: sched_getaffinity");
  }
  std::vector<int> out;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(static_cast<std::size_t>(c), &set)) out.push_back(c);
  }
  return out;
}

// "0-3,8,10-11" (sysfs cpulist); empty on anything malformed.
std::vector<int> parse_cpulist(const std::string& text) {
  std::vector<int> out;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, ',')) {
    if (part.empty() || part == "\n") continue;
    int lo = 0, hi = 0;
    char dash = 0;
    std::stringstream p(part);
    if (!(p >> lo)) return {};
    hi = lo;
    if (p >> dash) {
      if (dash != '-' || !(p >> hi) || hi < lo) return {};
    }
    for (int c = lo; c <= hi && c < CPU_SETSIZE; ++c) out.push_back(c);
  }
  return out;
}

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

// The NUMA node of an RDMA device (-1: unknown, as sysfs says for hosts
// without NUMA, and for the tcp provider, which has no device).
int device_numa_node(const fabric_options& o) {
  try {
    auto dev = transport::open_device(o.device);
    if (dev->provider() != "verbs") return -1;
    const std::string v = read_line("/sys/class/infiniband/" + std::string(dev->name()) + "/device/numa_node");
    return v.empty() ? -1 : std::stoi(v);
  } catch (const std::exception&) {
    return -1;  // the fabric's own open reports what is wrong
  }
}

int cpu_numa_node(int cpu) {
  for (int node = 0; node < 1024; ++node) {
    std::ifstream f("/sys/devices/system/node/node" + std::to_string(node) + "/cpulist");
    if (!f) {
      if (node > 64) break;
      continue;
    }
    std::string list;
    std::getline(f, list);
    for (int c : parse_cpulist(list)) {
      if (c == cpu) return node;
    }
  }
  return -1;
}

}  // namespace

struct reactor_group::reactor {
  asio::io_context io{1};
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> guard;
  std::unique_ptr<fabric> fab;  // built after io, destroyed before it (declared after it)
  reactor_placement where;
  std::thread thread;
  std::thread::id id;
  std::exception_ptr failed;
};

reactor_group::reactor_group(reactor_group_options o) {
  if (o.threads == 0 || o.threads > kMaxThreads) {
    throw std::system_error(errc::invalid_argument,
                            "reactor_group: threads must be 1.." + std::to_string(kMaxThreads) + ", not " +
                                std::to_string(o.threads));
  }
  if (!o.pin && !o.cpus.empty()) {
    throw std::system_error(errc::invalid_argument, "reactor_group: cpus given with pin = false");
  }
  std::vector<int> cpus;
  int node = -1;
  if (o.pin) {
    const std::vector<int> allowed = allowed_cpus();
    if (!o.cpus.empty()) {
      for (int c : o.cpus) {
        if (std::find(allowed.begin(), allowed.end(), c) == allowed.end()) {
          throw std::system_error(errc::invalid_argument,
                                  "reactor_group: cpu " + std::to_string(c) + " is not one this process may run on");
        }
      }
      cpus = o.cpus;
    } else {
      node = device_numa_node(o.fabric);
      if (node >= 0) {
        for (int c : parse_cpulist(read_line("/sys/devices/system/node/node" + std::to_string(node) + "/cpulist"))) {
          if (std::find(allowed.begin(), allowed.end(), c) != allowed.end()) cpus.push_back(c);
        }
        if (cpus.empty()) {
          log().warn("reactor_group: none of the cores of the device's NUMA node {} may be used; using all", node);
        }
      }
      if (cpus.empty()) cpus = allowed;
    }
  }

  std::latch built(static_cast<std::ptrdiff_t>(o.threads));
  for (std::size_t i = 0; i < o.threads; ++i) {
    auto r = std::make_unique<reactor>();
    r->guard.emplace(r->io.get_executor());
    if (!cpus.empty()) {
      r->where.cpu = cpus[i % cpus.size()];
      r->where.numa_node = cpu_numa_node(r->where.cpu);
    }
    reactors_.push_back(std::move(r));
  }
  for (std::size_t i = 0; i < o.threads; ++i) {
    reactor& r = *reactors_[i];
    try {
      r.thread = std::thread([&r, &o, &built, i] {
        if (r.where.cpu >= 0) {
          cpu_set_t set;
          CPU_ZERO(&set);
          CPU_SET(static_cast<std::size_t>(r.where.cpu), &set);
          if (const int rc = ::pthread_setaffinity_np(::pthread_self(), sizeof set, &set); rc != 0) {
            r.failed = std::make_exception_ptr(std::system_error(
                rc, std::system_category(), "reactor_group: pinning reactor " + std::to_string(i)));
          }
        }
        if (r.failed == nullptr) {
          try {
            r.fab = std::make_unique<fabric>(r.io, o.fabric);
          } catch (...) {
            r.failed = std::current_exception();
          }
        }
        built.count_down();  // `o` and `built` are not touched after this
        if (r.failed == nullptr) r.io.run();
      });
      r.id = r.thread.get_id();
    } catch (const std::system_error&) {
      for (std::size_t k = i; k < o.threads; ++k) built.count_down();  // never started
      r.failed = std::current_exception();
      break;
    }
  }
  built.wait();
  std::exception_ptr first;
  for (auto& r : reactors_) {
    if (first == nullptr && r->failed != nullptr) first = r->failed;
  }
  if (first != nullptr) {
    stop();
    reactors_.clear();
    std::rethrow_exception(first);
  }
  for (std::size_t i = 0; i < reactors_.size(); ++i) {
    const reactor_placement& w = reactors_[i]->where;
    if (w.cpu < 0) {
      log().info("reactor_group: reactor {} is not pinned (provider {})", i, reactors_[i]->fab->provider());
    } else {
      log().info("reactor_group: reactor {} runs on cpu {} (numa node {}; {}; provider {})", i, w.cpu, w.numa_node,
                 !o.cpus.empty() ? "as configured"
                 : node >= 0     ? "the device's numa node " + std::to_string(node)
                                 : std::string("the device has no numa node: all cores"),
                 reactors_[i]->fab->provider());
    }
  }
}

reactor_group::~reactor_group() {
  try {
    stop();
  } catch (const std::exception& e) {
    // Destroyed on one of its own reactors: the fabrics would go while
    // their threads run.
    log().critical("reactor_group: {}", e.what());
    std::terminate();
  }
  // each reactor: its fabric first, then its io_context (member order)
}

std::size_t reactor_group::size() const noexcept { return reactors_.size(); }

fabric& reactor_group::at(std::size_t i) {
  if (i >= reactors_.size()) throw std::system_error(errc::invalid_argument, "reactor_group: no reactor " + std::to_string(i));
  return *reactors_[i]->fab;
}

asio::io_context& reactor_group::context(std::size_t i) {
  if (i >= reactors_.size()) throw std::system_error(errc::invalid_argument, "reactor_group: no reactor " + std::to_string(i));
  return reactors_[i]->io;
}

asio::io_context::executor_type reactor_group::get_executor(std::size_t i) { return context(i).get_executor(); }

reactor_placement reactor_group::placement(std::size_t i) const {
  if (i >= reactors_.size()) throw std::system_error(errc::invalid_argument, "reactor_group: no reactor " + std::to_string(i));
  return reactors_[i]->where;
}

std::vector<acceptor> reactor_group::listen(const std::string& host, std::uint16_t port, placement_hook hook) {
  fabric& first = at(0);
  auto inner = first.device().listen(host, port,
                                     {.handshake_timeout = first.options().connection.handshake_timeout});
  log().info("reactor_group: listening on {}:{} for {} reactor(s)", host, inner->port(), reactors_.size());
  auto hub = std::make_shared<detail::shared_listener>(std::move(inner), reactors_.size(), std::move(hook),
                                                       kMaxQueuedPerReactor, 2 * first.options().connection.handshake_timeout);
  std::vector<acceptor> out;
  out.reserve(reactors_.size());
  for (std::size_t i = 0; i < reactors_.size(); ++i) {
    out.push_back(reactors_[i]->fab->listen(detail::shared_listener::routed(hub, i)));
  }
  return out;
}

void reactor_group::stop() {
  const auto self = std::this_thread::get_id();
  for (auto& r : reactors_) {
    if (r->thread.joinable() && r->id == self) {
      throw std::system_error(errc::invalid_state, "reactor_group: stop() called on one of its own reactors");
    }
  }
  for (auto& r : reactors_) {
    r->guard.reset();
    r->io.stop();
  }
  for (auto& r : reactors_) {
    if (r->thread.joinable()) r->thread.join();
  }
}

}  // namespace anydoor
