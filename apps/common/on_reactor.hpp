// Runs a function on one reactor of a reactor_group and waits for it: how
// the apps' main threads touch objects that live on a reactor (servers,
// registrations, the kv store's door and log) without a lock.
#pragma once

#include <anydoor/reactor_group.hpp>

#include <boost/asio/post.hpp>

#include <cstddef>
#include <exception>
#include <future>
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

}  // namespace anydoor::apps
