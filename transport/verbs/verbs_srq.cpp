// The verbs provider's shared receive queue (ibv_srq): posting with the
// provider's own wr_ids, the limit event, and the completion of a receive
// some queue pair took from it.
#include "verbs/verbs_provider.hpp"
#include "verbs/verbs_util.hpp"

#include <anydoor/error.hpp>

#include "contract_checks.hpp"
#include "log.hpp"

#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>

namespace anydoor::transport::verbs {
using namespace detail;

std::unique_ptr<shared_receive_queue> verbs_pd::create_srq(const srq_attributes& attr) {
  check_srq(attr, dev_->caps);
  return std::make_unique<verbs_srq>(dev_, pd_, attr);
}

verbs_srq::verbs_srq(std::shared_ptr<device_state> dev, ibv_pd* pd, const srq_attributes& attr)
    : dev_(std::move(dev)), attr_(attr) {
  ibv_srq_init_attr ia{};
  ia.srq_context = this;
  ia.attr.max_wr = attr.max_wr;
  ia.attr.max_sge = attr.max_sge;
  srq_ = ibv_create_srq(pd, &ia);
  if (srq_ == nullptr) throw sys_error(errno, "ibv_create_srq");
  // The device may round the size up; the slots follow what it holds (and
  // at most what a slot number can name).
  attr_.max_wr = std::min<std::uint32_t>(std::max(ia.attr.max_wr, attr.max_wr), kSlotMask);
  wr_ids_.resize(attr_.max_wr);
  free_.resize(attr_.max_wr);
  for (std::uint32_t i = 0; i < attr_.max_wr; ++i) free_[i] = attr_.max_wr - 1 - i;  // slot 0 on top
  rwr_.resize(attr_.max_wr);
  rsge_.resize(std::size_t{attr_.max_wr} * attr_.max_sge);
  {
    std::lock_guard lock(dev_->srq_mutex);
    for (std::uint32_t n = 0; n < device_state::kMaxSrqs; ++n) {
      const std::uint32_t i = (dev_->srq_next + n) % device_state::kMaxSrqs;
      if (dev_->srqs[i].load(std::memory_order_relaxed) != nullptr) continue;
      dev_->srq_next = i + 1;
      // A generation per use of the index, so that a completion of a queue
      // destroyed earlier never names its successor.
      dev_->srq_generation = static_cast<std::uint8_t>(dev_->srq_generation + 1);
      tag_ = i | (std::uint32_t{dev_->srq_generation} << 16);
      dev_->srqs[i].store(this, std::memory_order_release);
      return;
    }
  }
  ibv_destroy_srq(srq_);
  throw std::system_error(errc::invalid_argument, "create_srq: too many shared receive queues on the device");
}

verbs_srq::~verbs_srq() {
  {
    std::lock_guard lock(dev_->srq_mutex);
    dev_->srqs[tag_ & 0xffff].store(nullptr, std::memory_order_release);
  }
  // Holds async_mutex: a limit event for it is never handled mid-destroy.
  std::lock_guard lock(dev_->async_mutex());
  // Retired queue pairs still on it go first (what they flush now finds no
  // queue and is dropped).
  dev_->destroy_retired_locked([&](const retired_qp& r) { return r.qp->srq == srq_; });
  if (ibv_destroy_srq(srq_) != 0) {
    log().error("ibv_destroy_srq: {} (queue pairs still on it?)", std::strerror(errno));
  }
}

std::error_code verbs_srq::post_recv(std::span<const recv_request> wrs, std::size_t* bad) noexcept {
  std::lock_guard lock(mutex_);
  if (auto ec = check_recv(wrs, attr_.max_sge, attr_.max_wr, attr_.max_wr - free_.size(), bad)) return ec;
  if (wrs.empty()) return {};
  std::size_t sge_used = 0;
  const std::size_t top = free_.size();
  for (std::size_t i = 0; i < wrs.size(); ++i) {
    const std::uint32_t slot = free_[top - 1 - i];
    wr_ids_[slot] = wrs[i].wr_id;
    ibv_recv_wr& w = rwr_[i];
    w = {};
    w.wr_id = (std::uint64_t{tag_} << 32) | kRecvBit | slot;  // generation byte 0: a shared queue's
    w.next = i + 1 < wrs.size() ? &rwr_[i + 1] : nullptr;
    w.sg_list = &rsge_[sge_used];
    w.num_sge = static_cast<int>(wrs[i].sg_list.size());
    for (const sge& g : wrs[i].sg_list) rsge_[sge_used++] = {g.addr, g.length, g.lkey};
  }
  ibv_recv_wr* bad_wr = nullptr;
  const int rc = ibv_post_srq_recv(srq_, rwr_.data(), &bad_wr);
  // The requests before the bad one were posted (ibv_post_srq_recv is not
  // all or nothing): their slots stay taken.
  const std::size_t posted = rc == 0 ? wrs.size() : static_cast<std::size_t>(bad_wr - rwr_.data());
  free_.resize(top - posted);
  if (rc != 0) {
    if (bad != nullptr) *bad = posted;
    return {rc, std::system_category()};
  }
  return {};
}

std::error_code verbs_srq::arm_limit(std::uint32_t limit) noexcept {
  if (limit > attr_.max_wr) return errc::invalid_argument;
  ibv_srq_attr a{};
  a.srq_limit = limit;
  if (const int rc = ibv_modify_srq(srq_, &a, IBV_SRQ_LIMIT); rc != 0) return {rc, std::system_category()};
  return {};
}

bool verbs_srq::limit_reached() noexcept {
  dev_->drain_async_events();
  return limit_hit_.exchange(false, std::memory_order_acq_rel);
}

void verbs_srq::complete(const ibv_wc& wc, std::uint32_t slot, completion& out) noexcept {
  out.status = static_cast<wc_status>(wc.status);
  out.qp_num = wc.qp_num;
  out.byte_len = wc.byte_len;
  out.has_imm = (wc.wc_flags & IBV_WC_WITH_IMM) != 0;
  out.imm = out.has_imm ? ntohl(wc.imm_data) : 0;
  out.opcode = wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM ? wc_opcode::recv_rdma_with_imm
                                                                                     : wc_opcode::recv;
  std::lock_guard lock(mutex_);
  out.wr_id = wr_ids_[slot];
  free_.push_back(slot);
}

bool device_state::complete_srq(const ibv_wc& wc, std::uint32_t index, std::uint32_t slot,
                                completion& out) noexcept {
  verbs_srq* s = srqs[index & 0xffff].load(std::memory_order_acquire);
  if (s == nullptr || s->tag() != index || slot >= s->attributes().max_wr) return false;
  s->complete(wc, slot, out);
  return true;
}

}  // namespace anydoor::transport::verbs
