// The verbs provider's connection manager (rdma_cm): connection requests,
// the listener, and verbs_device::listen/connect.
#include "verbs/verbs_provider.hpp"
#include "verbs/verbs_util.hpp"

#include <anydoor/error.hpp>

#include "contract_checks.hpp"
#include "log.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <span>
#include <system_error>
#include <vector>

namespace anydoor::transport::verbs {
using namespace detail;

// ---------------------------------------------------------------- connection manager

namespace {

// How often an accept waiting for ESTABLISHED looks whether the peer's
// first message has come instead.
constexpr std::chrono::milliseconds kEstablishPoll{20};

// Waits for the next event on a private cm channel, until the deadline
// (timed_out) or a stop request (operation_canceled, seen within 50 ms).
std::error_code next_event(rdma_event_channel* ch, clock::time_point deadline, rdma_cm_event** ev,
                           const std::stop_token& stop = {}) {
  for (;;) {
    if (rdma_get_cm_event(ch, ev) == 0) return {};
    if (errno != EAGAIN && errno != EWOULDBLOCK) return {errno, std::system_category()};
    if (stop.stop_requested()) return std::make_error_code(std::errc::operation_canceled);
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()).count();
    if (left <= 0) return errc::timed_out;
    pollfd p{ch->fd, POLLIN, 0};
    ::poll(&p, 1, static_cast<int>(std::min<long long>(left, stop.stop_possible() ? 50 : 1 << 30)));
  }
}

std::vector<std::byte> user_private_data(const rdma_conn_param& p) {
  const auto* data = static_cast<const std::byte*>(p.private_data);
  if (data == nullptr || p.private_data_len == 0) return {};
  const std::size_t n = std::min<std::size_t>(static_cast<std::size_t>(data[0]), p.private_data_len - 1u);
  return {data + 1, data + 1 + n};
}

std::array<std::byte, kConnectPrivateData> wrap_private_data(std::span<const std::byte> pdata) {
  std::array<std::byte, kConnectPrivateData> b{};
  b[0] = static_cast<std::byte>(pdata.size());
  std::copy(pdata.begin(), pdata.end(), b.begin() + 1);
  return b;
}

rdma_conn_param conn_param(const verbs_qp& qp, const std::array<std::byte, kConnectPrivateData>& pdata,
                           const ibv_device_attr& attr) {
  rdma_conn_param p{};
  p.private_data = pdata.data();
  p.private_data_len = static_cast<std::uint8_t>(pdata.size());
  p.responder_resources = static_cast<std::uint8_t>(std::min(attr.max_qp_rd_atom, 16));
  p.initiator_depth = static_cast<std::uint8_t>(std::min(attr.max_qp_init_rd_atom, 16));
  p.retry_count = kRetryCount;
  p.rnr_retry_count = qp.attributes().rnr_retry;
  p.qp_num = qp.qp_num();
  p.srq = qp.attributes().srq != nullptr ? 1 : 0;  // the CM's SRQ bit (our QP is not the id's)
  return p;
}

void set_ack_timeout(rdma_cm_id* id) {
  // 4.096 us * 2^14 = 67 ms per transport retry: a dead peer is noticed in
  // about half a second instead of rdma_cm's default of several seconds.
  std::uint8_t timeout = kAckTimeout;
  if (rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &timeout, sizeof timeout) != 0) {
    log().debug("verbs: RDMA_OPTION_ID_ACK_TIMEOUT not supported: {}", std::strerror(errno));
  }
}

class verbs_request final : public connection_request {
 public:
  verbs_request(rdma_cm_id* id, std::vector<std::byte> pdata, std::chrono::milliseconds timeout)
      : id_(id), pdata_(std::move(pdata)), timeout_(timeout) {}
  ~verbs_request() override {
    if (id_ != nullptr) {
      rdma_reject(id_, nullptr, 0);
      rdma_destroy_id(id_);
    }
  }
  std::span<const std::byte> private_data() const noexcept override { return pdata_; }

  std::error_code accept(queue_pair& qp, std::span<const std::byte> pdata,
                         std::stop_token stop) noexcept override {
    auto* vqp = dynamic_cast<verbs_qp*>(&qp);
    if (vqp == nullptr || pdata.size() > kMaxUserPrivateData) return errc::invalid_argument;
    if (id_ == nullptr || !vqp->can_connect()) return errc::invalid_state;
    if (id_->verbs != vqp->context()) {
      log().warn("verbs: connection request arrived on another device than the queue pair's");
      return errc::invalid_argument;
    }
    // A private channel, so that waiting for ESTABLISHED does not consume
    // the listener's events.
    rdma_event_channel* ch = rdma_create_event_channel();
    if (ch == nullptr || rdma_migrate_id(id_, ch) != 0) {
      const std::error_code ec(errno, std::system_category());
      if (ch != nullptr) rdma_destroy_event_channel(ch);
      return ec;
    }
    set_nonblocking(ch->fd);
    set_ack_timeout(id_);
    if (vqp->state() == qp_state::reset) {
      if (auto ec = vqp->cm_transition(id_, IBV_QPS_INIT)) return fail(ch, ec);
    }
    // RTR and RTS before the REP goes out, as the kernel's own accept and
    // librdmacm's rdma_accept do (the CM allows RTS in REQ_RCVD: our send
    // PSN is the one the peer chose in its REQ). After ESTABLISHED it may be
    // too late: a peer that disconnects at once (its DREQ right behind its
    // RTU) moves the CM to DREQ_RCVD, where rdma_init_qp_attr refuses RTS
    // with EINVAL, and the connection it saw established would be lost here.
    // No send is posted on the queue pair until the accept completes.
    if (!vqp->iwarp()) {
      if (auto ec = vqp->cm_transition(id_, IBV_QPS_RTR)) return fail(ch, ec);
      if (auto ec = vqp->cm_transition(id_, IBV_QPS_RTS)) return fail(ch, ec);
    }
    ibv_device_attr attr{};
    ibv_query_device(id_->verbs, &attr);
    const auto wrapped = wrap_private_data(pdata);
    rdma_conn_param p = conn_param(*vqp, wrapped, attr);
    if (rdma_accept(id_, &p) != 0) return fail(ch, {errno, std::system_category()});
    rdma_cm_event* ev = nullptr;
    // The peer's establishment (its RTU), within the listener's handshake
    // timeout. The network can lose the RTU, and the CM resends its REP,
    // which brings another, only after the peer's CM response timeout
    // (about 4 s with rdma_cm), past the default 2 s handshake. The peer's
    // first message proves the connection too (a connecting runtime speaks
    // first: capabilities::established_by_message); the CM is told with
    // rdma_notify, and reports ESTABLISHED at once.
    const auto deadline = clock::now() + timeout_;
    bool notified = false;
    for (;;) {
      const auto ec = next_event(ch, std::min(deadline, clock::now() + kEstablishPoll), &ev, stop);
      if (!ec) break;
      // (next_event counts whole milliseconds: within the last one it
      // returns at once, and that is the deadline.)
      if (ec != errc::timed_out || clock::now() + std::chrono::milliseconds(1) >= deadline) return fail(ch, ec);
      if (!notified && vqp->peer_message_seen()) {
        notified = true;
        if (rdma_notify(id_, IBV_EVENT_COMM_EST) == 0) {
          log().info("verbs: qp {}: the peer's first message came before its RTU (lost?): established by it",
                     vqp->qp_num());
        } else {
          log().debug("verbs: qp {}: rdma_notify: {}", vqp->qp_num(), std::strerror(errno));
        }
      }
    }
    const rdma_cm_event_type type = ev->event;
    rdma_ack_cm_event(ev);
    if (type != RDMA_CM_EVENT_ESTABLISHED) {
      log().warn("verbs: accept: expected ESTABLISHED, got {}", rdma_event_str(type));
      return fail(ch, errc::connection_refused);
    }
    vqp->adopt(id_, ch);
    id_ = nullptr;
    return {};
  }

  void reject(std::span<const std::byte> pdata) noexcept override {
    if (id_ == nullptr) return;
    const auto wrapped = wrap_private_data(pdata.first(std::min(pdata.size(), kMaxUserPrivateData)));
    rdma_reject(id_, wrapped.data(), static_cast<std::uint8_t>(wrapped.size()));
    rdma_destroy_id(id_);
    id_ = nullptr;
  }

 private:
  std::error_code fail(rdma_event_channel* ch, std::error_code ec) {
    log().warn("verbs: accept failed: {}", ec.message());
    rdma_destroy_id(id_);
    id_ = nullptr;
    rdma_destroy_event_channel(ch);
    return ec;
  }
  rdma_cm_id* id_;
  std::vector<std::byte> pdata_;
  std::chrono::milliseconds timeout_;
};

class verbs_listener final : public listener {
 public:
  verbs_listener(rdma_event_channel* ch, rdma_cm_id* id, const listen_options& o) : ch_(ch), id_(id), opt_(o) {}
  ~verbs_listener() override {
    rdma_destroy_id(id_);
    rdma_destroy_event_channel(ch_);
  }
  int fd() const noexcept override { return ch_->fd; }
  std::uint16_t port() const noexcept override { return ntohs(rdma_get_src_port(id_)); }
  // rdma_cm refuses malformed requests itself; the runtime counts its own refusals.
  std::uint64_t refused() const noexcept override { return 0; }

  std::unique_ptr<connection_request> get_request(std::chrono::milliseconds timeout,
                                                  std::error_code& ec) noexcept override {
    const auto deadline = clock::now() + timeout;
    for (;;) {
      rdma_cm_event* ev = nullptr;
      ec = next_event(ch_, deadline, &ev);
      if (ec) return nullptr;
      if (ev->event == RDMA_CM_EVENT_CONNECT_REQUEST) {
        rdma_cm_id* id = ev->id;
        auto pdata = user_private_data(ev->param.conn);
        rdma_ack_cm_event(ev);
        return std::make_unique<verbs_request>(id, std::move(pdata), opt_.handshake_timeout);
      }
      log().debug("verbs listener: ignoring {}", rdma_event_str(ev->event));
      rdma_ack_cm_event(ev);
    }
  }

 private:
  rdma_event_channel* ch_;
  rdma_cm_id* id_;
  listen_options opt_;
};

// Resolves host:port for rdma_cm; nullptr with ec set on failure.
rdma_addrinfo* resolve(const std::string& host, std::uint16_t port, bool passive, std::error_code& ec) {
  rdma_addrinfo hints{};
  hints.ai_port_space = RDMA_PS_TCP;
  hints.ai_flags = passive ? RAI_PASSIVE : 0;
  rdma_addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (rdma_getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res) != 0) {
    log().warn("verbs: cannot resolve '{}:{}'", host, port);
    ec = errc::address_error;
    return nullptr;
  }
  return res;
}

}  // namespace

std::unique_ptr<listener> verbs_device::listen(const std::string& host, std::uint16_t port,
                                               const listen_options& options) {
  check_listen(options);
  std::error_code ec;
  rdma_addrinfo* res = resolve(host, port, true, ec);
  if (res == nullptr) throw std::system_error(ec, "listen: cannot resolve '" + host + "'");
  rdma_event_channel* ch = rdma_create_event_channel();
  rdma_cm_id* id = nullptr;
  if (ch == nullptr || rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP) != 0) {
    const int err = errno;
    rdma_freeaddrinfo(res);
    if (ch != nullptr) rdma_destroy_event_channel(ch);
    throw sys_error(err, "rdma_create_id");
  }
  set_nonblocking(ch->fd);
  const int rc = rdma_bind_addr(id, res->ai_src_addr);
  const int err = errno;
  rdma_freeaddrinfo(res);
  if (rc != 0 || rdma_listen(id, 128) != 0) {
    rdma_destroy_id(id);
    rdma_destroy_event_channel(ch);
    throw sys_error(rc != 0 ? err : errno, "listen: cannot bind " + host + ":" + std::to_string(port));
  }
  return std::make_unique<verbs_listener>(ch, id, options);
}

connect_result verbs_device::connect(queue_pair& qp, const std::string& host, std::uint16_t port,
                                     std::span<const std::byte> pdata, std::chrono::milliseconds timeout,
                                     std::stop_token stop) noexcept {
  connect_result result;
  auto* vqp = check_connect<verbs_qp>(qp, pdata, kMaxUserPrivateData, stop, result.ec);
  if (vqp == nullptr) return result;
  const auto deadline = clock::now() + timeout;
  const int timeout_ms = static_cast<int>(std::max<long long>(timeout.count(), 1));
  rdma_addrinfo* res = resolve(host, port, false, result.ec);
  if (res == nullptr) return result;
  if (stop.stop_requested()) {  // while resolving (which cannot be interrupted)
    rdma_freeaddrinfo(res);
    result.ec = std::make_error_code(std::errc::operation_canceled);
    return result;
  }
  rdma_event_channel* ch = rdma_create_event_channel();
  rdma_cm_id* id = nullptr;
  auto fail = [&](std::error_code ec, const char* what) {
    log().warn("verbs: connect to {}:{} failed at {}: {}", host, port, what, ec.message());
    if (id != nullptr) rdma_destroy_id(id);
    if (ch != nullptr) rdma_destroy_event_channel(ch);
    result.ec = ec;
    return result;
  };
  auto expect = [&](rdma_cm_event_type want, std::error_code on_other, const char* what) -> std::error_code {
    rdma_cm_event* ev = nullptr;
    if (auto ec = next_event(ch, deadline, &ev, stop)) return ec;
    const rdma_cm_event_type got = ev->event;
    std::error_code ec;
    if (got != want) {
      ec = on_other;
      if (got == RDMA_CM_EVENT_REJECTED) {
        // status 28: the consumer (our listener) rejected; anything else: no listener or unreachable
        ec = ev->status == 28 ? std::error_code(errc::connection_rejected) : std::error_code(errc::connection_refused);
        result.private_data = user_private_data(ev->param.conn);
        if (ec == errc::connection_refused) result.private_data.clear();
      } else if (got == RDMA_CM_EVENT_UNREACHABLE) {
        ec = errc::connection_refused;
      } else if (got == RDMA_CM_EVENT_ADDR_ERROR || got == RDMA_CM_EVENT_ROUTE_ERROR) {
        ec = errc::address_error;
      }
      log().debug("verbs: {}: got {} (status {})", what, rdma_event_str(got), ev->status);
    } else if (got == RDMA_CM_EVENT_CONNECT_RESPONSE || got == RDMA_CM_EVENT_ESTABLISHED) {
      result.private_data = user_private_data(ev->param.conn);
    }
    rdma_ack_cm_event(ev);
    return ec;
  };
  if (ch == nullptr || rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP) != 0) {
    rdma_freeaddrinfo(res);
    return fail({errno, std::system_category()}, "rdma_create_id");
  }
  set_nonblocking(ch->fd);
  sockaddr_in gid_src{};
  sockaddr* src = res->ai_src_addr;
  if (state_->gid_forced) {
    if (res->ai_dst_addr->sa_family != AF_INET) {
      rdma_freeaddrinfo(res);
      return fail(errc::address_error, "address resolution (ANYDOOR_GID_INDEX forces an IPv4 source GID; "
                                       "the destination is not IPv4)");
    }
    gid_src.sin_family = AF_INET;
    gid_src.sin_addr.s_addr = state_->gid_ipv4;
    src = reinterpret_cast<sockaddr*>(&gid_src);
  }
  const int rc = rdma_resolve_addr(id, src, res->ai_dst_addr, timeout_ms);
  rdma_freeaddrinfo(res);
  if (rc != 0) return fail(errc::address_error, "rdma_resolve_addr");
  if (auto ec = expect(RDMA_CM_EVENT_ADDR_RESOLVED, errc::address_error, "address resolution")) {
    return fail(ec, "address resolution");
  }
  if (id->verbs != state_->ctx) {
    return fail(errc::address_error, "address resolution (the address routes through another RDMA device)");
  }
  set_ack_timeout(id);
  if (rdma_resolve_route(id, timeout_ms) != 0) return fail({errno, std::system_category()}, "rdma_resolve_route");
  if (auto ec = expect(RDMA_CM_EVENT_ROUTE_RESOLVED, errc::address_error, "route resolution")) {
    return fail(ec, "route resolution");
  }
  if (vqp->state() == qp_state::reset) {
    if (auto ec = vqp->cm_transition(id, IBV_QPS_INIT)) return fail(ec, "INIT");
  }
  ibv_device_attr attr{};
  ibv_query_device(state_->ctx, &attr);
  const auto wrapped = wrap_private_data(pdata);
  rdma_conn_param p = conn_param(*vqp, wrapped, attr);
  if (rdma_connect(id, &p) != 0) return fail({errno, std::system_category()}, "rdma_connect");
  // IB/RoCE with a user-managed QP: CONNECT_RESPONSE, then RTR, RTS and
  // rdma_establish. iWARP: the CM moves the QP and reports ESTABLISHED.
  const rdma_cm_event_type reply = vqp->iwarp() ? RDMA_CM_EVENT_ESTABLISHED : RDMA_CM_EVENT_CONNECT_RESPONSE;
  if (auto ec = expect(reply, errc::connection_refused, "connect")) {
    const auto keep = result.private_data;
    fail(ec, "connect");
    result.private_data = keep;
    vqp->modify(qp_state::reset);
    return result;
  }
  if (!vqp->iwarp()) {
    if (auto ec = vqp->cm_transition(id, IBV_QPS_RTR)) return fail(ec, "RTR");
    if (auto ec = vqp->cm_transition(id, IBV_QPS_RTS)) return fail(ec, "RTS");
    if (rdma_establish(id) != 0) return fail({errno, std::system_category()}, "rdma_establish");
  }
  vqp->adopt(id, ch);
  return result;
}

}  // namespace anydoor::transport::verbs
