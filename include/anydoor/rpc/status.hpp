// RPC status codes (gRPC's numbering) and a status: a code with a message.
//
//   rpc::status st{rpc::errc::not_found, "no such key"};
//   if (ec == rpc::errc::unavailable) { /* the connection failed */ }
//
// A call completes with an error_code in rpc's category for every status a
// server sends and for the client-side ends: deadline_exceeded (the call's
// deadline passed), unavailable (the connection failed or could not be
// made), resource_exhausted (too many calls in flight on one client),
// invalid_argument (the client could not encode the request or decode the
// reply). A call cancelled through its cancellation slot completes with
// std::errc::operation_canceled, as every anydoor operation does.
#pragma once

#include <string>
#include <system_error>
#include <utility>

namespace anydoor::rpc {

enum class errc {
  ok = 0,
  cancelled = 1,            // the call was cancelled (the server saw the client's cancel)
  unknown = 2,              // a status outside this set came over the wire
  invalid_argument = 3,     // the request was malformed (framing, or the codec refused it)
  deadline_exceeded = 4,    // the deadline passed before the reply
  not_found = 5,
  already_exists = 6,
  permission_denied = 7,
  resource_exhausted = 8,   // a limit was reached
  failed_precondition = 9,
  aborted = 10,
  out_of_range = 11,
  unimplemented = 12,       // no handler for the method
  internal = 13,            // the handler threw (the message carries what())
  unavailable = 14,         // the connection failed or could not be made
  data_loss = 15,
  unauthenticated = 16,
};
inline constexpr errc errc_last = errc::unauthenticated;

const std::error_category& error_category() noexcept;

inline std::error_code make_error_code(errc e) noexcept { return {static_cast<int>(e), rpc::error_category()}; }

// A handler's outcome: ok, or a code with a message for the caller.
class status {
 public:
  status() noexcept = default;  // ok
  status(errc code, std::string message = {}) : code_(code), message_(std::move(message)) {}  // NOLINT

  static status ok() noexcept { return {}; }
  errc code() const noexcept { return code_; }
  const std::string& message() const noexcept { return message_; }
  bool is_ok() const noexcept { return code_ == errc::ok; }

 private:
  errc code_ = errc::ok;
  std::string message_;
};

}  // namespace anydoor::rpc

template <>
struct std::is_error_code_enum<anydoor::rpc::errc> : std::true_type {};
