// A listener that fails: the provider's listening socket (or rdma_cm id)
// breaking under an acceptor, alone or shared by a reactor group's
// reactors. The provider cannot be made to fail on demand, so a wrapper
// around a real listener fails in its place.
#include "../support/runtime.hpp"

#include "shared_listener.hpp"

#include <anydoor/anydoor.hpp>

#include <atomic>
#include <memory>
#include <optional>

using namespace anydoor::test;
using namespace std::chrono_literals;
namespace tp = anydoor::transport;

namespace {

// What a test sets and sees of its breaking_listener.
struct break_switch {
  std::atomic<bool> broken{false};  // set: every wait fails
  std::atomic<bool> gone{false};    // the listener (and the provider's under it) was destroyed
};

// Hands out the inner listener's requests until `broken` is set, then fails
// every wait with `why`.
class breaking_listener final : public tp::listener {
 public:
  breaking_listener(std::unique_ptr<tp::listener> inner, std::shared_ptr<break_switch> sw, std::error_code why)
      : inner_(std::move(inner)), sw_(std::move(sw)), why_(why) {}
  ~breaking_listener() override {
    inner_.reset();  // the listening socket closes
    sw_->gone.store(true);
  }
  int fd() const noexcept override { return inner_->fd(); }
  std::uint16_t port() const noexcept override { return inner_->port(); }
  std::unique_ptr<tp::connection_request> get_request(std::chrono::milliseconds timeout,
                                                      std::error_code& ec) noexcept override {
    if (sw_->broken.load()) {
      ec = why_;
      return nullptr;
    }
    return inner_->get_request(std::min<std::chrono::milliseconds>(timeout, 20ms), ec);  // sees a break soon
  }
  std::uint64_t refused() const noexcept override { return inner_->refused(); }

 private:
  std::unique_ptr<tp::listener> inner_;
  std::shared_ptr<break_switch> sw_;
  std::error_code why_;
};

// Once the listener is destroyed (within 2 s of its failure), a connect
// to `where` is refused at once by the system (connection_refused), not
// left waiting for its own timeout.
void check_refused_at_once(asio::io_context& io, ad::fabric& client, const std::string& where,
                           const break_switch& sw) {
  const auto until = std::chrono::steady_clock::now() + 2s;
  while (!sw.gone.load() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(5ms);
  REQUIRE(sw.gone.load());
  std::optional<ad::error_code> late;
  const auto start = std::chrono::steady_clock::now();
  client.async_connect(where, [&](ad::error_code ec, ad::connection) { late = ec; });
  run_until(io, [&] { return late.has_value(); }, 20s);
  CHECK(*late == ad::errc::connection_refused);
  CHECK(std::chrono::steady_clock::now() - start < 2s);
}

}  // namespace

TEST_CASE("accept: a listener that fails ends the waiting accept with its error - later accepts get it and its socket closes",
          "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::fabric client(io, test_options());
  auto sw = std::make_shared<break_switch>();
  const auto why = std::make_error_code(std::errc::too_many_files_open);
  ad::acceptor acc = server.listen(
      std::make_unique<breaking_listener>(server.device().listen(test_host(), 0, {}), sw, why));
  const std::string where = addr(acc);
  connect_through(io, client, acc, where);  // it serves until it fails
  std::optional<ad::error_code> waiting;
  acc.async_accept([&](ad::error_code ec, ad::connection) { waiting = ec; });
  io.poll();
  CHECK_FALSE(waiting.has_value());
  sw->broken.store(true);
  run_until(io, [&] { return waiting.has_value(); });
  CHECK(*waiting == why);
  std::optional<ad::error_code> later;
  acc.async_accept([&](ad::error_code ec, ad::connection) { later = ec; });
  run_until(io, [&] { return later.has_value(); });
  CHECK(*later == why);
  check_refused_at_once(io, client, where, *sw);  // (the acceptor's thread lets go of the listener)
  CHECK(server.stats().refused == 0);
}

TEST_CASE("reactor group: a shared listener that fails ends every reactor's waiting accept with its error - its socket closes",
          "[runtime]") {
  // Two fabrics stand for two reactors (one io_context: the test's thread
  // checks everything); the hub is reactor_group::listen's, made by hand
  // around a listener that can fail.
  asio::io_context io;
  ad::fabric r0(io, test_options());
  ad::fabric r1(io, test_options());
  ad::fabric client(io, test_options());
  auto sw = std::make_shared<break_switch>();
  const auto why = std::make_error_code(std::errc::network_down);
  auto hub = std::make_shared<ad::detail::shared_listener>(
      std::make_unique<breaking_listener>(r0.device().listen(test_host(), 0, {}), sw, why), 2,
      ad::placement_hook{}, 16, 4s);
  ad::acceptor acc0 = r0.listen(ad::detail::shared_listener::routed(hub, 0));
  ad::acceptor acc1 = r1.listen(ad::detail::shared_listener::routed(hub, 1));
  const std::string where = test_host() + ":" + std::to_string(hub->port());
  hub.reset();  // the acceptors' routes hold it, as after reactor_group::listen
  connect_through(io, client, acc0, where);  // round robin: the first to reactor 0
  connect_through(io, client, acc1, where);  // the second to reactor 1
  std::optional<ad::error_code> w0, w1;
  acc0.async_accept([&](ad::error_code ec, ad::connection) { w0 = ec; });
  acc1.async_accept([&](ad::error_code ec, ad::connection) { w1 = ec; });
  io.poll();
  CHECK_FALSE(w0.has_value());
  CHECK_FALSE(w1.has_value());
  sw->broken.store(true);
  run_until(io, [&] { return w0 && w1; });
  CHECK(*w0 == why);
  CHECK(*w1 == why);
  // Both acceptors' threads let go of their routes, and with the last the
  // hub and the listening socket go.
  check_refused_at_once(io, client, where, *sw);
}
