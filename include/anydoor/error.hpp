// anydoor's error codes: runtime/wire/protocol errors (anydoor::errc) and
// completion statuses (anydoor::transport::wc_status, see transport/types.hpp).
#pragma once

#include <system_error>

namespace anydoor {

enum class errc {
  invalid_argument = 1,  // a parameter is out of range or inconsistent
  invalid_state,         // the object is in a state that does not allow the call
  queue_full,            // a work queue has no free slot
  cq_overflow,           // a completion queue overflowed; completions were lost
  not_connected,         // the queue pair has no peer
  connection_refused,    // nobody listens at the address
  connection_rejected,   // the peer rejected the connection request
  protocol_error,        // the peer sent something the protocol forbids
  version_mismatch,      // the peer speaks another wire version
  timed_out,             // a setup step did not finish in time
  address_error,         // a host or port could not be resolved or bound
  provider_unavailable,  // the requested provider is not built or has no device
  no_device,             // no device matches the request
  registration_failed,   // memory could not be registered
  message_size,          // a message is larger than the receiving buffer or the peer's maximum
  authentication_failed, // the peer did not prove the shared auth token (or only one side has one)
  connection_closed,     // the connection was closed (by either side) before the operation finished
  no_buffer_space,       // no pool buffer became free within the bounded wait
  too_many_connections,  // the fabric's connection limit (its CQ sizing) is reached
  out_of_range,          // an offset or length falls outside a region
  not_supported,         // the device does not support the operation (atomics)
  peer_out_of_memory,    // the receiver could not allocate or register memory for the message
  device_copy_failed,    // a copy to or from GPU memory failed (the CUDA driver's error is logged)
};
// The last value, for tests that walk every code.
inline constexpr errc errc_last = errc::device_copy_failed;

const std::error_category& error_category() noexcept;

inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), error_category()};
}

}  // namespace anydoor

template <>
struct std::is_error_code_enum<anydoor::errc> : std::true_type {};
