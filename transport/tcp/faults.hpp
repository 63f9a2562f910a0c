// Fault injection for the tcp provider: what ANYDOOR_TCP_FAULTS asks a
// device's queue pairs to do wrong, for tests of everything above them.
// Off unless the variable is set (read when a tcp device is opened).
//
//   ANYDOOR_TCP_FAULTS="key=value[,key=value...]"
//     qp=K            only the K-th queue pair of the device to connect
//                     (1-based, in connection order); default: every one
//     cut=N           after sending N frames, the connection is cut: the
//                     socket closes, so the peer sees it end at once (a
//                     silent cut is what keepalive detects: see the
//                     liveness tests, which freeze the peer instead)
//     delay=MS        every batch of frames waits MS ms before it is sent
//     corrupt=N       the N-th frame sent goes out with a malformed header
//     stop_reading=N  after receiving N frames, the socket is not read...
//     stall=MS        ...for MS ms, then reading resumes (without stall:
//                     until the connection ends)
//     post_fail=N     the queue pair's N-th post_send of two or more
//                     requests (counted from its connection) fails past the
//                     provider's checks with a device error (ENOMEM,
//                     system_category) after posting every request but the
//                     last (*bad names it), as ibv_post_send can leave a
//                     batch
//     lose_late=1     a request posted while the queue pair is in error
//                     never completes (as a user-space queue pair of siw,
//                     Linux 6.1, leaves it), where it would complete
//                     flushed at once
//     late_duplicates=1  the device reports capabilities::late_duplicates
//                     (as InfiniBand and RoCE do) without delivering any
//                     duplicate itself: for tests of what the runtime
//                     holds for them (fabric_options::late_read_grace);
//                     the device's, as cq_depth
//     cq_depth=N      the device's completion queues hold at most N
//                     completions, whatever depth was asked: a queue too
//                     small for its queue pairs, which overflows
//                     (cq_overflow) as a NIC's would; the device's, so qp=K
//                     with it alone is refused
// Frames are counted per queue pair: requests, responses, ACKs and read
// fragments alike. The variable applies to every tcp device the process
// opens while it is set (the fabrics of a test set and unset it around
// each); qp=K counts the device's socket attachments. The verbs provider
// ignores it (open_device warns).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace anydoor::transport::tcp {

inline constexpr const char* kFaultsVariable = "ANYDOOR_TCP_FAULTS";

struct fault_plan {
  std::uint32_t qp = 0;  // 0: every queue pair
  std::optional<std::uint64_t> cut_after;
  std::uint32_t delay_ms = 0;
  std::optional<std::uint64_t> corrupt;
  std::optional<std::uint64_t> stop_reading_after;
  std::uint32_t stall_ms = 0;  // 0: for good
  std::uint32_t cq_depth = 0;  // 0: as asked
  std::optional<std::uint64_t> post_fail;
  bool lose_late = false;
  bool late_duplicates = false;

  // A fault of the queue pairs'.
  bool active() const noexcept {
    return cut_after || delay_ms != 0 || corrupt || stop_reading_after || post_fail || lose_late;
  }
  // Any fault at all (the device's included).
  bool any() const noexcept { return active() || cq_depth != 0 || late_duplicates; }
  bool applies_to(std::uint32_t ordinal) const noexcept { return active() && (qp == 0 || qp == ordinal); }
};

// Parses a specification; throws std::system_error (invalid_argument) that
// names the variable and the offending item.
fault_plan parse_faults(std::string_view spec);
// The plan in ANYDOOR_TCP_FAULTS (an inactive one when unset or empty).
fault_plan faults_from_environment();
// One line for logs: "cut=40,qp=2".
std::string to_string(const fault_plan& plan);

}  // namespace anydoor::transport::tcp
