// rpc's error category: gRPC's status names.
#include <anydoor/rpc/status.hpp>

#include <string>

namespace anydoor::rpc {
namespace {

class rpc_category final : public std::error_category {
 public:
  const char* name() const noexcept override { return "anydoor.rpc"; }
  std::string message(int ev) const override {
    switch (static_cast<errc>(ev)) {
      case errc::ok: return "ok";
      case errc::cancelled: return "cancelled";
      case errc::unknown: return "unknown status";
      case errc::invalid_argument: return "invalid argument";
      case errc::deadline_exceeded: return "deadline exceeded";
      case errc::not_found: return "not found";
      case errc::already_exists: return "already exists";
      case errc::permission_denied: return "permission denied";
      case errc::resource_exhausted: return "resource exhausted";
      case errc::failed_precondition: return "failed precondition";
      case errc::aborted: return "aborted";
      case errc::out_of_range: return "out of range";
      case errc::unimplemented: return "unimplemented";
      case errc::internal: return "internal error";
      case errc::unavailable: return "unavailable";
      case errc::data_loss: return "data loss";
      case errc::unauthenticated: return "unauthenticated";
    }
    return "rpc status " + std::to_string(ev);
  }
};

}  // namespace

const std::error_category& error_category() noexcept {
  static const rpc_category c;
  return c;
}

}  // namespace anydoor::rpc
