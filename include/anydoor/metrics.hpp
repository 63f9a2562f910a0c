// Live counters for the people who run a service: a fabric's counters and
// each connection's in the Prometheus text format, and an opt-in HTTP
// endpoint that serves them (GET /metrics) while the application runs.
//
//   anydoor::metrics_endpoint m(io, "0.0.0.0", 9464, anydoor::collect(fab));
//   // curl http://host:9464/metrics, or anydoor-doctor --attach host:9464
#pragma once

#include <anydoor/fabric.hpp>
#include <anydoor/reactor_group.hpp>

#include <boost/asio/io_context.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace anydoor {

// What one fabric counts: taken on its thread (snapshot), rendered on any.
struct metrics_snapshot {
  std::string reactor;  // the `reactor` label of its samples
  std::string provider;
  fabric_stats fabric;
  transport::device_counters device;  // port-wide on verbs: the same for every reactor of a device
  std::vector<connection_report> connections;
  std::vector<failure_count> failures;
};

// On the fabric's thread.
metrics_snapshot snapshot(fabric& f, std::string reactor_label);

// The Prometheus text exposition format (0.0.4): every family once, with
// HELP and TYPE, and the samples of every snapshot. Families (prefix
// anydoor_): per reactor connections_open, connections_accepted_total,
// connections_connected_total, connections_refused_total,
// connection_failures_total{error}, reactor_polls_total,
// reactor_empty_polls_total, reactor_completions_total,
// reactor_wakeups_total, pool_buffers, pool_free_buffers,
// pool_registered_bytes, pool_exhausted_total, srq_posted, srq_spare,
// device_rnr_naks_sent_total, device_rnr_naks_received_total,
// device_rnr_retry_exceeded_total, device_transport_retries_total,
// device_transport_retry_exceeded_total (where the device reads them; once
// per counter source: verbs' are port-wide), device_async_events_total,
// device_async_errors_total (verbs: each reactor's device object); per
// connection {qp, peer, state} connection_messages_sent_total,
// connection_messages_received_total, connection_bytes_sent_total,
// connection_bytes_received_total, connection_posts_total,
// connection_doorbells_total, connection_credit_stalls_total,
// connection_buffer_stalls_total, connection_rnr_naks_total,
// connection_puts_total, connection_gets_total, connection_atomics_total,
// connection_heartbeats_total.
std::string prometheus_text(const std::vector<metrics_snapshot>& snapshots);

// An HTTP/1.1 endpoint on plain TCP that answers GET /metrics with what its
// collector produces (404 for other paths, 405 for other methods) and
// closes each connection after its answer. It faces whoever can reach the
// port: a request is read up to 8 KiB within 5 s, and at most max_clients
// are served at once (more are closed at once). Not thread-safe: create,
// use and destroy it on its io_context's thread.
class metrics_endpoint {
 public:
  // Produces the page: calls done(text) exactly once, from any thread.
  using collector = std::function<void(std::function<void(std::string)> done)>;

  // Listens on host:port (0: a free one). Throws std::system_error.
  metrics_endpoint(asio::io_context& io, const std::string& host, std::uint16_t port, collector collect,
                   std::size_t max_clients = 16);
  ~metrics_endpoint();  // stop()
  metrics_endpoint(const metrics_endpoint&) = delete;
  metrics_endpoint& operator=(const metrics_endpoint&) = delete;

  std::uint16_t port() const noexcept;
  // Stops listening and closes the connections being served.
  void stop() noexcept;
  std::uint64_t scrapes() const noexcept;   // pages served
  std::uint64_t rejected() const noexcept;  // requests refused: bad, too large, too slow, too many clients

 private:
  struct state;
  std::shared_ptr<state> state_;
};

// A collector for one fabric: the snapshot is taken on the fabric's thread
// (at once when the endpoint runs on the fabric's io_context, else posted
// there). The fabric must outlive the endpoint.
metrics_endpoint::collector collect(fabric& f);
// A collector for every reactor of a group: each snapshot is taken on its
// reactor's thread (reactor="0", "1", ...), the page rendered on the last.
// Stop the endpoint before the group, and stop (or destroy) the group
// before the endpoint's io_context is destroyed: a collection under way
// posts its page there.
metrics_endpoint::collector collect(reactor_group& g);

}  // namespace anydoor
