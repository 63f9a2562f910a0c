#include "contract_checks.hpp"

#include <anydoor/error.hpp>

#include <cstdint>
#include <string>

namespace anydoor::transport {

bool binding_ok(const work_request& wr) noexcept {
  const window_binding& b = wr.bind;
  if (!wr.sg_list.empty() || wr.inline_data || b.window == nullptr || b.region == nullptr) return false;
  if (b.window->bound() || !has(b.region->access(), access::mw_bind)) return false;
  if (b.rights == access::none || (b.rights & remote_access_bits) != b.rights) return false;
  if ((has(b.rights, access::remote_write) || has(b.rights, access::remote_atomic)) &&
      !has(b.region->access(), access::local_write)) {
    return false;
  }
  const auto base = reinterpret_cast<std::uint64_t>(b.region->addr());
  return b.length > 0 && b.addr >= base && b.length <= b.region->length() &&
         b.addr - base <= b.region->length() - b.length;
}

std::error_code check_send(std::span<const work_request> wrs, const send_limits& lim, std::size_t* bad) noexcept {
  for (std::size_t i = 0; i < wrs.size(); ++i) {
    const work_request& wr = wrs[i];
    std::uint64_t total = 0;
    for (const sge& s : wr.sg_list) total += s.length;
    const bool ok = wr.op == opcode::bind_window ? binding_ok(wr) :
                    wr.sg_list.size() <= lim.max_sge && total <= lim.max_msg_size &&
                    (!wr.inline_data || (carries_data(wr.op) && total <= lim.max_inline)) &&
                    (!is_atomic(wr.op) ||
                     (wr.sg_list.size() == 1 && wr.sg_list[0].length == 8 && wr.remote_addr % 8 == 0));
    if (!ok || lim.outstanding + i + 1 > lim.queue_depth) {
      if (bad != nullptr) *bad = i;
      return ok ? errc::queue_full : errc::invalid_argument;
    }
  }
  return {};
}

std::error_code check_recv(std::span<const recv_request> wrs, std::uint32_t max_sge, std::uint32_t queue_depth,
                           std::uint64_t outstanding, std::size_t* bad) noexcept {
  for (std::size_t i = 0; i < wrs.size(); ++i) {
    const bool ok = wrs[i].sg_list.size() <= max_sge;
    if (!ok || outstanding + i + 1 > queue_depth) {
      if (bad != nullptr) *bad = i;
      return ok ? errc::queue_full : errc::invalid_argument;
    }
  }
  return {};
}

void check_srq(const srq_attributes& attr, const capabilities& caps) {
  if (caps.max_srq == 0) throw std::system_error(errc::not_supported, "create_srq: the device has no shared receive queues");
  if (attr.max_wr == 0 || attr.max_wr > caps.max_srq_wr) {
    throw std::system_error(errc::invalid_argument, "create_srq: max_wr must be in 1.." + std::to_string(caps.max_srq_wr));
  }
  if (attr.max_sge == 0 || attr.max_sge > caps.max_sge) {
    throw std::system_error(errc::invalid_argument, "create_srq: max_sge must be in 1.." + std::to_string(caps.max_sge));
  }
}

namespace {
void check_access(access acc, const char* what) {
  constexpr auto known =
      access::local_write | access::remote_write | access::remote_read | access::remote_atomic | access::mw_bind;
  if ((acc & known) != acc) throw std::system_error(errc::invalid_argument, std::string(what) + ": unknown access flag");
  // As with verbs: remote write and atomic access require local write.
  if ((has(acc, access::remote_write) || has(acc, access::remote_atomic)) && !has(acc, access::local_write)) {
    throw std::system_error(errc::invalid_argument, std::string(what) + ": remote_write/remote_atomic need local_write");
  }
}
}  // namespace

void check_registration(const void* addr, std::size_t length, access acc) {
  if (addr == nullptr || length == 0) {
    throw std::system_error(errc::invalid_argument, "register_memory: null address or zero length");
  }
  check_access(acc, "register_memory");
}

void check_dmabuf_registration(int fd, std::uint64_t offset, std::size_t length, std::uint64_t iova, access acc) {
  if (fd < 0) throw std::system_error(errc::invalid_argument, "register_dmabuf: no file descriptor (" + std::to_string(fd) + ")");
  if (length == 0) throw std::system_error(errc::invalid_argument, "register_dmabuf: zero length");
  if (offset > UINT64_MAX - length) {
    throw std::system_error(errc::invalid_argument, "register_dmabuf: offset + length wraps around");
  }
  if (iova > UINT64_MAX - length) throw std::system_error(errc::invalid_argument, "register_dmabuf: iova + length wraps around");
  // As devices map pages: iova and offset lie at the same place in their
  // pages (so an 8-byte-aligned iova is an 8-byte-aligned byte, for atomics).
  constexpr std::uint64_t kPage = 4096;
  if (((iova ^ offset) & (kPage - 1)) != 0) {
    throw std::system_error(errc::invalid_argument,
                            "register_dmabuf: iova and offset must have the same offset within a 4 KiB page");
  }
  check_access(acc, "register_dmabuf");
}

void check_copied_registration(const void* addr, std::size_t length, access acc, const memory_copier* copier) {
  if (addr == nullptr || length == 0) {
    throw std::system_error(errc::invalid_argument, "register_copied: null address or zero length");
  }
  if (reinterpret_cast<std::uintptr_t>(addr) > UINTPTR_MAX - length) {
    throw std::system_error(errc::invalid_argument, "register_copied: address + length wraps around");
  }
  if (copier == nullptr) throw std::system_error(errc::invalid_argument, "register_copied: no copier");
  check_access(acc, "register_copied");
  if (has(acc, access::remote_atomic)) {
    throw std::system_error(errc::not_supported,
                            "register_copied: remote_atomic: an atomic needs direct access to the memory, and this "
                            "device reaches it through copies");
  }
}

void check_listen(const listen_options& options) {
  if (options.handshake_timeout.count() <= 0 || options.max_pending == 0) {
    throw std::system_error(errc::invalid_argument, "listen: handshake_timeout and max_pending must be positive");
  }
}

}  // namespace anydoor::transport
