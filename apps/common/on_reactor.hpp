// Runs a function on one reactor of a reactor_group and waits for it: how
// the apps' main threads touch objects that live on a reactor (servers,
// registrations, the kv store's door and log) without a lock.
#pragma once

#include <anydoor/reactor_group.hpp>

#include <boost/asio/post.hpp>

#include <chrono>
#include <cstddef>
#include <exception>
#include <future>
#include <memory>
#include <optional>
#include <type_traits>

namespace anydoor::apps {

// Runs f on reactor i and returns what it returned; what f throws is
// rethrown here. Waits as long as it takes: f may refer to the caller's
// locals. Not from reactor i's own thread (it would wait for itself).
template <class F>
auto on_reactor(reactor_group& g, std::size_t i, F f) -> decltype(f()) {
  using result = decltype(f());
  std::promise<result> p;
  auto done = p.get_future();
  boost::asio::post(g.get_executor(i), [&p, &f] {
    try {
      if constexpr (std::is_void_v<result>) {
        f();
        p.set_value();
      } else {
        p.set_value(f());
      }
    } catch (...) {
      p.set_exception(std::current_exception());
    }
  });
  return done.get();
}

// For a query the caller may give up on (stats while draining): f is
// moved into the work (it must not refer to the caller's locals, only to
// what outlives the reactors' run); nullopt when reactor i does not answer
// within `limit`.
template <class F>
auto on_reactor_within(reactor_group& g, std::size_t i, std::chrono::milliseconds limit, F f)
    -> std::optional<decltype(f())> {
  using result = decltype(f());
  auto p = std::make_shared<std::promise<result>>();
  auto done = p->get_future();
  boost::asio::post(g.get_executor(i), [p, f = std::move(f)]() mutable {
    try {
      p->set_value(f());
    } catch (...) {
      p->set_exception(std::current_exception());
    }
  });
  if (done.wait_for(limit) != std::future_status::ready) return std::nullopt;
  return done.get();
}

}  // namespace anydoor::apps
