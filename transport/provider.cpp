#include <anydoor/error.hpp>
#include <anydoor/transport/provider.hpp>

#include "log.hpp"
#include "tcp/tcp_device.hpp"
#include "verbs/probe.hpp"
#ifdef ANYDOOR_HAVE_VERBS
#include "verbs/verbs_provider.hpp"
#endif

#include <cstdlib>
#include <new>
#include <string>

namespace anydoor {
namespace {

class anydoor_category final : public std::error_category {
 public:
  const char* name() const noexcept override { return "anydoor"; }
  std::string message(int ev) const override {
    switch (static_cast<errc>(ev)) {
      case errc::invalid_argument: return "invalid argument";
      case errc::invalid_state: return "operation not allowed in the current state";
      case errc::queue_full: return "work queue full";
      case errc::cq_overflow: return "completion queue overflow";
      case errc::not_connected: return "queue pair not connected";
      case errc::connection_refused: return "connection refused (nobody listening)";
      case errc::connection_rejected: return "connection rejected by the peer";
      case errc::protocol_error: return "protocol error";
      case errc::version_mismatch: return "peer speaks another protocol version";
      case errc::timed_out: return "timed out";
      case errc::address_error: return "address cannot be resolved or bound";
      case errc::provider_unavailable: return "provider unavailable";
      case errc::no_device: return "no such device";
      case errc::registration_failed: return "memory registration failed";
      case errc::message_size: return "message larger than the receiving buffer or the peer's maximum";
      case errc::authentication_failed: return "authentication failed (the peer did not prove the auth token, or only one side has one)";
      case errc::connection_closed: return "connection closed";
      case errc::no_buffer_space: return "no pool buffer became free in time";
      case errc::too_many_connections: return "too many connections on this fabric";
      case errc::out_of_range: return "offset or length outside the region";
      case errc::not_supported: return "operation not supported by the device";
      case errc::peer_out_of_memory: return "the receiver could not allocate or register memory for the message";
      case errc::device_copy_failed: return "a copy to or from GPU memory failed";
    }
    return "unknown anydoor error " + std::to_string(ev);
  }
};

class wc_category_impl final : public std::error_category {
 public:
  const char* name() const noexcept override { return "anydoor.wc"; }
  std::string message(int ev) const override {
    return std::string(transport::to_string(static_cast<transport::wc_status>(ev)));
  }
};

}  // namespace

const std::error_category& error_category() noexcept {
  static const anydoor_category c;
  return c;
}

}  // namespace anydoor

namespace anydoor::transport {

const std::error_category& wc_category() noexcept {
  static const wc_category_impl c;
  return c;
}

std::string_view to_string(wc_status s) noexcept {
  switch (s) {
    case wc_status::success: return "success";
    case wc_status::local_length_error: return "local length error";
    case wc_status::local_qp_operation_error: return "local QP operation error";
    case wc_status::local_eec_operation_error: return "local EE context operation error";
    case wc_status::local_protection_error: return "local protection error";
    case wc_status::work_request_flushed: return "work request flushed";
    case wc_status::memory_window_bind_error: return "memory window bind error";
    case wc_status::bad_response: return "bad response";
    case wc_status::local_access_error: return "local access error";
    case wc_status::remote_invalid_request: return "remote invalid request";
    case wc_status::remote_access_error: return "remote access error";
    case wc_status::remote_operation_error: return "remote operation error";
    case wc_status::retry_exceeded: return "transport retry counter exceeded";
    case wc_status::rnr_retry_exceeded: return "RNR retry counter exceeded";
    case wc_status::local_rdd_violation: return "local RDD violation";
    case wc_status::remote_invalid_rd_request: return "remote invalid RD request";
    case wc_status::remote_aborted: return "remote aborted";
    case wc_status::invalid_eec_number: return "invalid EE context number";
    case wc_status::invalid_eec_state: return "invalid EE context state";
    case wc_status::fatal: return "fatal error";
    case wc_status::response_timeout: return "response timeout";
    case wc_status::general_error: return "general error";
  }
  return "unknown completion status";
}

std::string_view to_string(opcode op) noexcept {
  switch (op) {
    case opcode::send: return "send";
    case opcode::send_with_imm: return "send_with_imm";
    case opcode::write: return "write";
    case opcode::write_with_imm: return "write_with_imm";
    case opcode::read: return "read";
    case opcode::fetch_add: return "fetch_add";
    case opcode::compare_swap: return "compare_swap";
    case opcode::bind_window: return "bind_window";
  }
  return "unknown";
}

std::string_view to_string(wc_opcode op) noexcept {
  switch (op) {
    case wc_opcode::send: return "send";
    case wc_opcode::write: return "write";
    case wc_opcode::read: return "read";
    case wc_opcode::compare_swap: return "compare_swap";
    case wc_opcode::fetch_add: return "fetch_add";
    case wc_opcode::recv: return "recv";
    case wc_opcode::recv_rdma_with_imm: return "recv_rdma_with_imm";
    case wc_opcode::bind_window: return "bind_window";
  }
  return "unknown";
}

std::string_view to_string(qp_state s) noexcept {
  switch (s) {
    case qp_state::reset: return "reset";
    case qp_state::init: return "init";
    case qp_state::rtr: return "rtr";
    case qp_state::rts: return "rts";
    case qp_state::error: return "error";
  }
  return "unknown";
}

std::vector<std::string> available_providers() {
#ifdef ANYDOOR_HAVE_VERBS
  return {"tcp", "verbs"};
#else
  return {"tcp"};
#endif
}

std::unique_ptr<memory_region> protection_domain::register_copied(void*, std::size_t, access,
                                                                  std::shared_ptr<memory_copier>) {
  throw std::system_error(errc::not_supported,
                          "register_copied: this device reaches memory directly or not at all (caps().copied_memory)");
}

std::shared_ptr<std::byte> memory_copier::bounce_buffer(std::size_t n) noexcept {
  std::byte* p = new (std::nothrow) std::byte[n];
  if (p == nullptr) return nullptr;
  try {
    return std::shared_ptr<std::byte>(p, std::default_delete<std::byte[]>());
  } catch (const std::bad_alloc&) {  // (the shared_ptr's count; it deleted p)
    return nullptr;
  }
}

std::unique_ptr<device> open_device(const device_options& options) {
  std::string provider = options.provider;
  std::string name = options.name;
  if (const char* env = std::getenv("ANYDOOR_PROVIDER"); env != nullptr && *env != '\0') provider = env;
  if (const char* env = std::getenv("ANYDOOR_DEVICE"); env != nullptr && *env != '\0') name = env;
  if (provider.empty()) provider = "auto";

  if (provider == "auto") {
    const verbs::probe_result probe = verbs::probe_devices();
    if (!probe.active_device.empty() && name != "tcp0") {
      log().info("provider=auto: RDMA device {} is active; using verbs", probe.active_device);
      provider = "verbs";
    } else {
      log().info("provider=auto: no RDMA device with an active port ({}); using tcp", probe.detail);
      provider = "tcp";
      if (!name.empty() && name != "tcp0") name.clear();  // a verbs device name does not apply to tcp
    }
  }
  if (provider == "tcp") {
    if (!name.empty() && name != "tcp0") {
      throw std::system_error(errc::no_device, "tcp provider: no device named '" + name + "' (it has tcp0)");
    }
    return std::make_unique<tcp::tcp_device>("tcp0", tcp::faults_from_environment());
  }
  if (provider == "verbs") {
    if (const char* f = std::getenv(tcp::kFaultsVariable); f != nullptr && *f != '\0') {
      log().warn("{} is set but the provider is verbs: no fault is injected", tcp::kFaultsVariable);
    }
#ifdef ANYDOOR_HAVE_VERBS
    return verbs::open(name);
#else
    throw std::system_error(errc::provider_unavailable,
                            "the verbs provider is not in this build (ANYDOOR_WITH_VERBS=OFF); use provider=tcp");
#endif
  }
  throw std::system_error(errc::provider_unavailable,
                          "unknown provider '" + provider + "' (known: auto, tcp, verbs)");
}

}  // namespace anydoor::transport
