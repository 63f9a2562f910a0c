// Live counters (anydoor/metrics.hpp): a fabric's page over HTTP while
// connections carry traffic, failures counted by error, the text format's
// escaping, and the endpoint's refusals.
#include "../support/runtime.hpp"

#include <anydoor/metrics.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <vector>

using namespace anydoor::test;
using asio::awaitable;
using asio::use_awaitable;

TEST_CASE("metrics: a fabric's page counts its connections, their traffic and their failures", "[runtime]") {
  asio::io_context io;
  // (keepalive 1 s: on verbs the server learns of the client's abort only
  // when its liveness check finds the peer gone; tcp sees the socket close)
  ad::connection_options co;
  co.keepalive = std::chrono::milliseconds(1000);
  ad::fabric server(io, test_options(co));
  ad::fabric client(io, test_options(co));
  ad::acceptor acc = server.listen(test_host(), 0);
  ad::metrics_endpoint ep(io, "127.0.0.1", 0, ad::collect(server));
  REQUIRE(ep.port() != 0);
  failure f;
  // The server echoes every message of its two connections (each echo
  // owns its connection: it goes when the peer does).
  asio::co_spawn(io, [&]() -> awaitable<void> {
    for (int i = 0; i < 2; ++i) {
      ad::connection accepted = co_await acc.async_accept(use_awaitable);
      asio::co_spawn(io, [](ad::connection c) -> awaitable<void> {
        for (;;) {
          auto [ec, m] = co_await c.async_receive(asio::as_tuple(use_awaitable));
          if (ec) co_return;
          auto [sec, n] = co_await c.async_send(asio::buffer(m.data(), m.size()), asio::as_tuple(use_awaitable));
          if (sec) co_return;
        }
      }(std::move(accepted)), asio::detached);
    }
  }, f.handler());
  std::string open_page, after_page;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    ad::connection a = co_await client.async_connect(addr(acc), use_awaitable);
    ad::connection b = co_await client.async_connect(addr(acc), use_awaitable);
    const std::vector<std::byte> out(100, std::byte{7});
    for (int k = 0; k < 5; ++k) {
      co_await a.async_send(asio::buffer(out), use_awaitable);
      (void)co_await a.async_receive(use_awaitable);
    }
    for (int k = 0; k < 3; ++k) {
      co_await b.async_send(asio::buffer(out), use_awaitable);
      (void)co_await b.async_receive(use_awaitable);
    }
    // A rendezvous message: the server keeps its memory once it is released.
    const std::vector<std::byte> large(20000, std::byte{9});
    co_await b.async_send(asio::buffer(large), use_awaitable);
    (void)co_await b.async_receive(use_awaitable);
    co_await until([&] { return server.stats().kept_bytes != 0; });
    open_page = co_await http_get_metrics(ep.port());
    a.abort();                                   // the server's side fails
    co_await b.async_close(use_awaitable);       // the server's side closes cleanly
    co_await until([&] { return server.stats().connections == 0; }, std::chrono::seconds(15));
    after_page = co_await http_get_metrics(ep.port());
    ep.stop();
  }, f.handler());
  run_to_completion(io);
  f.check();
  INFO(open_page);
  CHECK(metric_sum(open_page, "anydoor_connections_open") == 2);
  CHECK(metric_sum(open_page, "anydoor_connections_accepted_total") == 2);
  CHECK(metric_sum(open_page, "anydoor_connection_messages_received_total", "state=\"open\"") == 9);
  CHECK(metric_sum(open_page, "anydoor_connection_messages_sent_total") == 9);
  CHECK(metric_sum(open_page, "anydoor_connection_bytes_received_total") == 20800);
  CHECK(metric_sum(open_page, "anydoor_rendezvous_kept_bytes") == 20480);  // whole pages
  CHECK(open_page.find("# TYPE anydoor_rendezvous_retired_bytes gauge\n") != std::string::npos);
  CHECK(open_page.find("# TYPE anydoor_rendezvous_retired_early_total counter\n") != std::string::npos);
  CHECK(metric_sum(open_page, "anydoor_rendezvous_retired_early_total") == 0);
  if (!server.device().caps().late_duplicates) CHECK(metric_sum(open_page, "anydoor_rendezvous_retired_bytes") == 0);
  CHECK(metric_sum(open_page, "anydoor_connection_failures_total") == 0);
  CHECK(open_page.find("# TYPE anydoor_connections_open gauge\n") != std::string::npos);
  CHECK(open_page.find("peer=\"" + test_host() + "\"") != std::string::npos);
  INFO(after_page);
  CHECK(metric_sum(after_page, "anydoor_connections_open") == 0);
  CHECK(metric_sum(after_page, "anydoor_connection_failures_total") == 1);  // the abort, not the close
  CHECK(ep.scrapes() == 2);
}

TEST_CASE("metrics: label values are escaped and every family is declared once", "[runtime]") {
  ad::metrics_snapshot s;
  s.reactor = "a\"b\\c\nd";
  s.provider = "tcp";
  s.failures.push_back({ad::make_error_code(ad::errc::protocol_error), 3});
  s.connections.push_back({.qp_num = 7, .path = {}, .open = true, .stats = {.messages_sent = 5}});
  ad::metrics_snapshot t = s;
  t.reactor = "1";
  const std::string page = ad::prometheus_text({s, t});
  CHECK(page.find("reactor=\"a\\\"b\\\\c\\nd\"") != std::string::npos);
  CHECK(page.find('\r') == std::string::npos);
  std::size_t types = 0;
  for (std::size_t at = page.find("# TYPE anydoor_connections_open "); at != std::string::npos;
       at = page.find("# TYPE anydoor_connections_open ", at + 1)) {
    ++types;
  }
  CHECK(types == 1);
  CHECK(metric_sum(page, "anydoor_connection_messages_sent_total", "qp=\"7\"") == 10);  // both reactors
  CHECK(metric_sum(page, "anydoor_connection_failures_total", "reactor=\"1\"") == 3);
  CHECK(page.find(ad::make_error_code(ad::errc::protocol_error).message()) != std::string::npos);
}

TEST_CASE("metrics: device retries come once per source, asynchronous events once per reactor, absent ones not at all",
          "[runtime]") {
  ad::metrics_snapshot s;
  s.reactor = "0";
  s.provider = "verbs";
  s.device.source = "/sys/class/infiniband/rxe0/ports/1/hw_counters";
  s.device.transport_retries = 7;
  s.device.transport_retry_exceeded = 2;
  s.device.async_events = 5;
  s.device.async_errors = 1;
  ad::metrics_snapshot t = s;  // a second reactor on the same port, its own device object
  t.reactor = "1";
  t.device.async_events = 4;
  t.device.async_errors = 0;
  const std::string page = ad::prometheus_text({s, t});
  CHECK(metric_sum(page, "anydoor_device_transport_retries_total", "") == 7);  // port-wide: once
  CHECK(metric_sum(page, "anydoor_device_transport_retry_exceeded_total", "") == 2);
  CHECK(metric_sum(page, "anydoor_device_async_events_total", "") == 9);  // each reactor's own
  CHECK(metric_sum(page, "anydoor_device_async_events_total", "reactor=\"1\"") == 4);
  CHECK(metric_sum(page, "anydoor_device_async_errors_total", "") == 1);
  CHECK(page.find("# TYPE anydoor_device_async_events_total counter") != std::string::npos);
  // tcp keeps none of them: no family at all, rather than a zero that means nothing.
  ad::metrics_snapshot u;
  u.reactor = "0";
  u.provider = "tcp";
  const std::string tcp_page = ad::prometheus_text({u});
  CHECK(tcp_page.find("anydoor_device_transport_retries_total") == std::string::npos);
  CHECK(tcp_page.find("anydoor_device_async_events_total") == std::string::npos);
}

TEST_CASE("metrics: the endpoint refuses what is not GET /metrics, and a port in use", "[runtime]") {
  asio::io_context io;
  ad::fabric server(io, test_options());
  ad::metrics_endpoint ep(io, "127.0.0.1", 0, ad::collect(server));
  CHECK_THROWS_AS(ad::metrics_endpoint(io, "127.0.0.1", ep.port(), ad::collect(server)), std::system_error);
  CHECK_THROWS_AS(ad::metrics_endpoint(io, "not an address", 0, ad::collect(server)), std::system_error);
  failure f;
  std::vector<std::string> answers;
  asio::co_spawn(io, [&]() -> awaitable<void> {
    using tcp = asio::ip::tcp;
    for (std::string_view req : {std::string_view("GET /x HTTP/1.1\r\n\r\n"), std::string_view("PUT /metrics HTTP/1.1\r\n\r\n"),
                                 std::string_view("nonsense\r\n\r\n")}) {
      tcp::socket s(io);
      co_await s.async_connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), ep.port()), use_awaitable);
      co_await asio::async_write(s, asio::buffer(req), use_awaitable);
      std::string resp;
      (void)co_await asio::async_read(s, asio::dynamic_buffer(resp), asio::as_tuple(use_awaitable));
      answers.push_back(resp.substr(0, resp.find("\r\n")));
    }
    const std::string page = co_await http_get_metrics(ep.port());
    answers.push_back(page.empty() ? "no page" : "page");
    ep.stop();
  }, f.handler());
  run_to_completion(io);
  f.check();
  CHECK(answers == std::vector<std::string>{"HTTP/1.1 404 Not Found", "HTTP/1.1 405 Method Not Allowed",
                                            "HTTP/1.1 400 Bad Request", "page"});
  CHECK(ep.rejected() == 2);  // 405 and 400 (a 404 is an answer)
  CHECK(ep.scrapes() == 1);
}
