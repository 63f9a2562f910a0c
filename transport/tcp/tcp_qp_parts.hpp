// What the three parts of the tcp queue pair (tcp_qp.cpp, tcp_qp_tx.cpp,
// tcp_qp_rx.cpp) share: sizes and an opcode test. Internal to the provider.
#pragma once

#include "contract_checks.hpp"
#include "tcp/tcp_provider.hpp"

#include <cstddef>

namespace anydoor::transport::tcp::detail {

constexpr std::size_t kRxBufferSize = kRxStagingBytes;
// Responses queued per connection: enough to keep the link busy; a peer
// with more requests outstanding waits (its frames stay in the socket).
constexpr std::size_t kMaxResponseSlots = 1024;

inline bool needs_response(opcode op) noexcept { return op == opcode::read || is_atomic(op); }

}  // namespace anydoor::transport::tcp::detail
