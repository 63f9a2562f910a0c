// The contract's argument checks and opcode mapping, shared by every
// provider so that they refuse exactly the same requests.
#pragma once

#include <anydoor/error.hpp>
#include <anydoor/transport/provider.hpp>
#include <anydoor/transport/types.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <stop_token>
#include <system_error>

namespace anydoor::transport {

constexpr bool is_atomic(opcode op) noexcept { return op == opcode::fetch_add || op == opcode::compare_swap; }

constexpr bool carries_data(opcode op) noexcept {
  return op == opcode::send || op == opcode::send_with_imm || op == opcode::write || op == opcode::write_with_imm;
}

constexpr wc_opcode completion_opcode(opcode op) noexcept {
  switch (op) {
    case opcode::send:
    case opcode::send_with_imm: return wc_opcode::send;
    case opcode::write:
    case opcode::write_with_imm: return wc_opcode::write;
    case opcode::read: return wc_opcode::read;
    case opcode::fetch_add: return wc_opcode::fetch_add;
    case opcode::compare_swap: return wc_opcode::compare_swap;
    case opcode::bind_window: return wc_opcode::bind_window;
  }
  return wc_opcode::send;
}

struct send_limits {
  std::uint32_t max_sge;
  std::uint32_t max_inline;
  std::uint32_t max_msg_size;
  std::uint32_t queue_depth;
  std::uint64_t outstanding;  // slots taken now
};

// A bind_window request's checks that need no provider (provider.hpp):
// whether the provider's own objects are given is the provider's check.
bool binding_ok(const work_request& wr) noexcept;

// post_send's checks (provider.hpp documents them); sets *bad on failure.
std::error_code check_send(std::span<const work_request> wrs, const send_limits& lim, std::size_t* bad) noexcept;
// post_recv's checks.
std::error_code check_recv(std::span<const recv_request> wrs, std::uint32_t max_sge, std::uint32_t queue_depth,
                           std::uint64_t outstanding, std::size_t* bad) noexcept;
// create_srq's checks against the device's capabilities; throws
// std::system_error (errc::not_supported, errc::invalid_argument).
void check_srq(const srq_attributes& attr, const capabilities& caps);
// register_memory's checks; throws std::system_error(errc::invalid_argument).
void check_registration(const void* addr, std::size_t length, access acc);
// register_dmabuf's arguments: errc::invalid_argument for a negative fd,
// a zero length, offset + length or iova + length wrapping, iova and offset
// at different places in a 4 KiB page, or access as check_registration
// refuses it. (The buffer's end is the provider's to check.)
void check_dmabuf_registration(int fd, std::uint64_t offset, std::size_t length, std::uint64_t iova, access acc);
// register_copied's (provider.hpp), for a device with caps().copied_memory.
void check_copied_registration(const void* addr, std::size_t length, access acc, const memory_copier* copier);
// listen's checks on its options; throws std::system_error(errc::invalid_argument).
void check_listen(const listen_options& options);

// device::connect's checks, before any I/O: the queue pair is the
// provider's own (QP) and can connect, the private data fits, no stop was
// requested. The provider's queue pair, or nullptr with ec set
// (invalid_argument, invalid_state, operation_canceled: the first that fails).
template <class QP>
QP* check_connect(queue_pair& qp, std::span<const std::byte> private_data, std::size_t max_private_data,
                  const std::stop_token& stop, std::error_code& ec) noexcept {
  auto* own = dynamic_cast<QP*>(&qp);
  if (own == nullptr || private_data.size() > max_private_data) {
    ec = errc::invalid_argument;
  } else if (!own->can_connect()) {
    ec = errc::invalid_state;
  } else if (stop.stop_requested()) {
    ec = std::make_error_code(std::errc::operation_canceled);
  } else {
    return own;
  }
  return nullptr;
}

}  // namespace anydoor::transport
