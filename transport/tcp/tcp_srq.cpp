// The tcp provider's shared receive queue: a ring of posted receives under
// a mutex. Queue pairs take the oldest (tcp_qp::take_recv) and complete it
// on their own receive completion queue.
#include "tcp/tcp_provider.hpp"

#include <anydoor/error.hpp>

#include "contract_checks.hpp"
#include "log.hpp"

#include <algorithm>

namespace anydoor::transport::tcp {

tcp_srq::tcp_srq(const registration_table& table, const srq_attributes& attr) : state_(std::make_shared<state>()) {
  state_->table = &table;
  state_->attr = attr;
  state_->wr_ids.resize(attr.max_wr);
  state_->nsges.resize(attr.max_wr);
  state_->sges.resize(std::size_t{attr.max_wr} * attr.max_sge);
}

tcp_srq::~tcp_srq() {
  if (const auto n = state_->users.load(std::memory_order_relaxed); n != 0) {
    log().error("tcp: a shared receive queue destroyed before its {} queue pair(s) (destroy them first)", n);
  }
}

std::error_code tcp_srq::post_recv(std::span<const recv_request> wrs, std::size_t* bad) noexcept {
  state& s = *state_;
  std::lock_guard lock(s.mutex);
  if (auto ec = check_recv(wrs, s.attr.max_sge, s.attr.max_wr, s.tail - s.head, bad)) return ec;
  for (const recv_request& wr : wrs) {
    const std::size_t slot = ring_slot(s.tail++, s.attr.max_wr);
    s.wr_ids[slot] = wr.wr_id;
    s.nsges[slot] = static_cast<std::uint32_t>(wr.sg_list.size());
    std::copy(wr.sg_list.begin(), wr.sg_list.end(), s.sges.begin() + static_cast<std::ptrdiff_t>(slot * s.attr.max_sge));
  }
  return {};
}

std::error_code tcp_srq::arm_limit(std::uint32_t limit) noexcept {
  state& s = *state_;
  if (limit > s.attr.max_wr) return errc::invalid_argument;
  std::lock_guard lock(s.mutex);
  s.limit = limit;
  return {};
}

bool tcp_srq::limit_reached() noexcept { return state_->limit_hit.exchange(false, std::memory_order_acq_rel); }

bool tcp_srq::state::take(taken& out) noexcept {
  std::lock_guard lock(mutex);
  if (head == tail) return false;
  const std::size_t slot = ring_slot(head++, attr.max_wr);
  out.wr_id = wr_ids[slot];
  out.num_sge = nsges[slot];
  std::copy_n(sges.begin() + static_cast<std::ptrdiff_t>(slot * attr.max_sge), out.num_sge, out.sges.begin());
  if (limit != 0 && tail - head < limit) {
    limit = 0;  // fires once, as IBV_EVENT_SRQ_LIMIT_REACHED
    limit_hit.store(true, std::memory_order_release);
  }
  return true;
}

}  // namespace anydoor::transport::tcp
