// What the verbs provider's files (verbs_device.cpp, verbs_cq.cpp,
// verbs_qp.cpp, verbs_cm.cpp) share. Internal to the provider.
#pragma once

#include <fcntl.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <system_error>

namespace anydoor::transport::verbs::detail {

using clock = std::chrono::steady_clock;
// The provider's wr_id: (generation << 56) | (cq index << 32) | kRecvBit |
// slot (see verbs_qp::make_wr_id; the CQ decodes it).
constexpr std::uint64_t kRecvBit = 1ull << 31;
constexpr std::uint32_t kSlotMask = 0x7fffffffu;
// Local ACK timeout: 4.096 us * 2^14 = 67 ms per transport retry, and 7
// retries: on a NIC a silent peer is reported (retry_exceeded) in about
// half a second. rxe (Linux 6.1) reads a transport retry count of 7 as
// "retry for ever" (rxe_comp.c decrements retry_cnt only while it is not
// 7), unlike the IB spec, which gives 7 that meaning only for the RNR retry
// count: there a request towards a peer whose queue pair went to error
// without a disconnect never ends (the runtime's keepalive ends an open
// connection to such a peer). 6 was tried and is worse on rxe: it spends
// retries on implicit NAKs and duplicates and resets them only on some
// ACKs, so a mildly lossy link (the rxe-netem "mixed" scenario: 1% loss,
// 1% duplicates, 1 ms delay) failed a healthy connection with
// retry_exceeded.
constexpr std::uint8_t kAckTimeout = 14;
constexpr std::uint8_t kRetryCount = 7;
// One length byte precedes the caller's private data (rdma_cm delivers the
// transport's full private-data area, not the length that was sent).
constexpr std::size_t kConnectPrivateData = 56;
constexpr std::size_t kMaxUserPrivateData = kConnectPrivateData - 1;

inline std::system_error sys_error(int err, const std::string& what) {
  return std::system_error(err, std::system_category(), what);
}

inline int set_nonblocking(int fd) { return ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

}  // namespace anydoor::transport::verbs::detail
