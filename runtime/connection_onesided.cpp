// The connection engine's one-sided operations (put, get, put_with_notify,
// atomics, flush) and the delivery of the notifications that arrive.
#include "connection_impl.hpp"

#include <anydoor/error.hpp>

#include "log.hpp"
#include "cuda/driver.hpp"
#include "cuda/register.hpp"
#include "registration_cache.hpp"
#include "scoped_region.hpp"
#include "split_region.hpp"
#include "staging.hpp"

#include <algorithm>
#include <cstring>
#include <utility>

namespace anydoor::detail {

// ---------------------------------------------------------------- one-sided

void connection_impl::start_onesided(op_node* n) {
  if (n->kind == op_kind::receive_notification) {
    note_waiting_.push_back(n);
    deliver(true);
    return;
  }
  if (refuses_sends()) {
    complete(n, true, send_refusal());
    return;
  }
  if (staged_ != 0) {
    // Held after the staged transfers (release_held). Its local memory is
    // checked and keyed now, while the caller's regions are known to be
    // alive (a small put's bytes copied): released, it is only queued. A
    // transfer that stages itself keeps its plain buffer, which is checked
    // when it starts.
    if (!stages(n)) {
      if (const std::error_code ec = prepare_onesided(n)) {
        complete(n, true, ec);
        return;
      }
      n->prepared = true;
    }
    behind_staged_.push_back(n);
    return;
  }
  dispatch_onesided(n);
}

void connection_impl::start_chunk(op_node* n) {
  if (ended()) {
    complete(n, true, ended_refusal());
    return;
  }
  if (const std::error_code ec = prepare_onesided(n)) {
    complete(n, true, ec);
    return;
  }
  queue_send(n);
}

void connection_impl::dispatch_onesided(op_node* n) {
  if (stages(n)) {
    start_staged(n);
    return;
  }
  if (const std::error_code ec = prepare_onesided(n)) {
    complete(n, true, ec);
    return;
  }
  queue_send(n);
}

void connection_impl::release_held() noexcept {
  while (staged_ == 0 && !behind_staged_.empty()) {
    op_node* n = behind_staged_.pop_front();
    if (ended()) {  // (issued before a close that waits: they go)
      complete(n, true, ended_refusal());
      continue;
    }
    if (n->kind == op_kind::send || n->prepared) {
      queue_send(n);
    } else {
      dispatch_onesided(n);
    }
  }
}

// Whether a put or get goes through the staging pipeline: its local side
// is one plain buffer of GPU device memory, and the fabric stages (always,
// for small transfers, or because the device cannot reach GPU memory).
bool connection_impl::stages(const op_node* n) const noexcept {
  if ((n->kind != op_kind::put && n->kind != op_kind::get) || n->nbufs != 1 || n->regions[0] != nullptr) return false;
  if (!cuda::detail::any_gpu_memory() || cuda::detail::kind_here(n->bufs[0].data()) != memory_kind::cuda_device) {
    return false;
  }
  const fabric_options& o = fab_->options;
  return o.gpu_staging || n->length <= o.gpu_bounce_threshold || !cuda::detail::reaches_gpu_memory(*fab_->device);
}

void connection_impl::start_staged(op_node* n) {
  if (n->length > n->remote.length) {
    complete(n, true, errc::out_of_range);
    return;
  }
  if (n->kind == op_kind::get && n->read_only) {
    complete(n, true, errc::invalid_argument);
    return;
  }
  try {
    auto t = std::make_shared<staged_transfer>(shared_from_this(), n, fab_->staging(), fab_->copies());
    staging_now_.push_back(t);  // (for cancel: it waits for a buffer until its first chunk)
    ++staged_;
    t->start();
  } catch (const std::exception& e) {
    log().warn("connection: staging a {}-byte transfer of GPU memory failed: {}", n->length, e.what());
    complete(n, true, errc::registration_failed);
  }
}

void connection_impl::complete_staged(op_node* n, std::error_code ec, std::size_t size) noexcept {
  auto keep = shared_from_this();
  if (!ec) {  // (its chunks are not counted: stats count operations)
    if (n->kind == op_kind::put) {
      ++stats_.puts;
      stats_.bytes_put += size;
    } else {
      ++stats_.gets;
      stats_.bytes_got += size;
    }
  }
  std::erase_if(staging_now_, [n](const std::weak_ptr<staged_transfer>& w) {
    const auto t = w.lock();
    return t == nullptr || t->parent() == n;
  });
  complete(n, true, ec, size);
  if (--staged_ == 0) release_held();
  if (staged_ == 0 && close_waiting_ != nullptr) {
    op_node* c = std::exchange(close_waiting_, nullptr);
    try {
      start_close(c);
    } catch (...) {
      complete(c, true, errc::invalid_state);
    }
  }
}

std::error_code connection_impl::prepare_onesided(op_node* n) noexcept {
  switch (n->kind) {
    case op_kind::fetch_add:
    case op_kind::compare_swap:
      if (!fab_->device->caps().atomics) return errc::not_supported;
      if (n->remote.length < 8 || n->remote.addr % 8 != 0) return errc::invalid_argument;
      // In pieces: an aligned word lies in one (pieces are 4 KiB or more).
      if (!n->remote.pieces.empty()) {
        if (!n->remote.pieces.covers(n->remote.addr, 8)) return errc::out_of_range;
        n->remote.rkey = n->remote.pieces.key_at(n->remote.addr);
      }
      return {};
    case op_kind::flush: return {};
    case op_kind::register_memory: return prepare_window(n);
    default: break;
  }
  if (n->nbufs == 0xff) return errc::invalid_argument;
  const bool into_local = n->kind == op_kind::get;
  if (into_local && n->read_only) return errc::invalid_argument;
  if (n->length > n->remote.length) return errc::out_of_range;
  // A remote region in pieces whose fields were changed after at() or
  // unpack made it: its pieces must still cover what is written.
  if (!n->remote.pieces.empty() && n->length != 0) {
    if (!n->remote.pieces.covers(n->remote.addr, n->length)) return errc::out_of_range;
    n->remote.rkey = n->remote.pieces.key_at(n->remote.addr);  // what a notification names
  }
  // A local piece registered in pieces: its keys come from the region's
  // table, which the operation holds until it is released.
  auto hold_pieces = [n](std::uint8_t i, const split_region* s) noexcept {
    if (s == nullptr) return;
    n->split[i] = s->table();
    n->split_mask = static_cast<std::uint16_t>(n->split_mask | (1u << i));
  };
  // A small put of host memory in one work request goes inline: its bytes
  // are copied now, while its memory is known valid (a region checked
  // below, a buffer its caller keeps), and posted from the operation, so
  // the device does not fetch them (no DMA read on a NIC; the tcp
  // provider's single sendmsg). Its region is not read after this point.
  // GPU memory is never copied by the CPU; managed memory takes the
  // cache's refusal.
  static_assert(kInlinePut <= 255, "inline_len is 8 bits");
  bool copy = (n->kind == op_kind::put || n->kind == op_kind::put_notify) && n->length > 0 &&
              n->length <= std::min<std::size_t>(fab_->inline_cap, kInlinePut) &&
              (n->remote.pieces.empty() || n->remote.pieces.piece_end(n->remote.addr) - n->remote.addr >= n->length);
  // Plain buffers are registered (pinned in the cache) unless the put is
  // copied in a process where no pointer can be GPU memory: where one can,
  // the cache's entry knows the memory's kind (no driver call on a hit)
  // and refuses managed memory.
  bool pin = !copy;
  bool asked = false;     // any_gpu_memory(), at the first plain buffer
  std::size_t total = 0;  // (with each piece at most kInlinePut: the copy's bound, whatever length says)
  for (std::uint8_t i = 0; i < n->nbufs; ++i) {
    const asio::const_buffer b = n->bufs[i];
    total += b.size();
    copy = copy && b.size() <= kInlinePut;
    if (const memory_region* r = n->regions[i]) {
      // A range of a region that has since been moved or reset is refused.
      const auto* p = static_cast<const std::byte*>(b.data());
      if (!*r || p < r->data() || b.size() > r->size() || p - r->data() > static_cast<std::ptrdiff_t>(r->size() - b.size())) {
        return errc::invalid_argument;
      }
      if (into_local && !has(r->access(), access::local_write)) return errc::invalid_argument;
      n->lkeys[i] = r->lkey();
      hold_pieces(i, r->split());
      copy = copy && r->kind() != memory_kind::cuda_device;  // (managed memory is never registered)
    } else if (!asked && !pin) {
      asked = true;
      pin = cuda::detail::any_gpu_memory();
    }
  }
  copy = copy && total == n->length;
  pin = pin || !copy;
  for (std::uint8_t i = 0; i < n->nbufs && pin; ++i) {
    const asio::const_buffer b = n->bufs[i];
    if (n->regions[i] != nullptr) continue;
    try {
      registration_cache::entry& e =
          fab_->cache->pin(b.data(), b.size(), into_local ? access::local_write : access::none);
      n->pins[n->npins++] = &e;
      n->lkeys[i] = e.mr->lkey();
      hold_pieces(i, e.split);
      copy = copy && !e.device;
    } catch (const std::system_error& e) {
      log().warn("connection: registering {} bytes at {} for a one-sided operation failed: {}", b.size(), b.data(),
                 e.what());
      return e.code() == errc::not_supported || e.code() == errc::invalid_argument
                 ? e.code()
                 : make_error_code(errc::registration_failed);
    } catch (const std::exception& e) {
      log().warn("connection: registering {} bytes at {} for a one-sided operation failed: {}", b.size(), b.data(),
                 e.what());
      return errc::registration_failed;
    }
  }
  if (copy) {
    std::size_t at = 0;
    for (std::uint8_t i = 0; i < n->nbufs; ++i) {
      const std::size_t len = n->bufs[i].size();
      if (len != 0) std::memcpy(n->inline_bytes.data() + at, n->bufs[i].data(), len);
      at += len;
    }
    n->inline_len = static_cast<std::uint8_t>(at);
  }
  return {};
}

// A connection-scoped registration: the memory registered for binding
// only, and a window for the bind that try_start_onesided queues.
std::error_code connection_impl::prepare_window(op_node* n) noexcept {
  using transport::access;
  using transport::remote_access_bits;
  const auto acc = static_cast<access>(n->operand);
  const auto remote = acc & remote_access_bits;
  if (n->dest.size() == 0 || remote == access::none || (acc & (access::local_write | remote)) != acc ||
      ((has(acc, access::remote_write) || has(acc, access::remote_atomic)) && !has(acc, access::local_write))) {
    return errc::invalid_argument;
  }
  if (!fab_->device->caps().memory_windows) return errc::not_supported;
  // A window binds within one registration: no pieces.
  if (n->dest.size() > (std::uint64_t{1} << fab_->piece_shift)) return errc::not_supported;
  // Registered as host memory: not GPU memory (fabric::register_memory takes that).
  if (!cuda::detail::host_registrable(n->dest.data(), true)) return errc::not_supported;
  try {
    auto mr = fab_->pd->register_memory(n->dest.data(), n->dest.size(), (acc & access::local_write) | access::mw_bind);
    auto slot = std::make_shared<window_slot>(fab_->pd->alloc_window());
    // Forget the windows of regions already gone (amortized: at most one
    // pass per doubling).
    if (windows_.size() == windows_.capacity()) {
      std::erase_if(windows_, [](const std::weak_ptr<window_slot>& w) { return w.expired(); });
    }
    windows_.push_back(slot);
    n->mr = std::make_unique<scoped_region>(std::move(mr), std::move(slot), acc);
  } catch (const std::exception& e) {
    log().warn("connection: registering {} bytes at {} for the peer failed: {}", n->dest.size(), n->dest.data(),
               e.what());
    const auto* se = dynamic_cast<const std::system_error*>(&e);
    if (se != nullptr && (se->code() == errc::invalid_argument || se->code() == errc::not_supported)) return se->code();
    return errc::registration_failed;
  }
  return {};
}

void connection_impl::revoke_windows() noexcept {
  for (const std::weak_ptr<window_slot>& w : windows_) {
    if (auto slot = w.lock()) slot->revoke();
  }
  windows_.clear();
}

// A put or get goes out as work requests of at most sge_per_wr_ pieces and
// fragment_ bytes each, the remote address advancing with them; a transfer
// larger than the send queue can hold is queued in parts as it drains.
// Memory registered in pieces: a work request ends where the remote piece
// does (one rkey each), and a local piece is a scatter/gather element of
// its own (one lkey each).
bool connection_impl::emit_segments(op_node* n, bool last_completes, std::size_t max_wrs) noexcept {
  const bool remote_pieces = !n->remote.pieces.empty();
  if (n->inline_len != 0 && n->issued == 0 && max_wrs > 0 && sq_free() > 0) {
    // Its bytes, copied when it started (prepare_onesided), in one inline
    // work request; it still completes when the peer acknowledges it.
    transport::sge* sg = take_sges(1);
    *sg = {reinterpret_cast<std::uint64_t>(n->inline_bytes.data()), n->inline_len, 0};
    transport::work_request& wr = next_wr(last_completes ? slot_kind::onesided_last : slot_kind::none,
                                          buffer_pool::npos, last_completes ? n : nullptr, {sg, 1});
    wr.op = transport::opcode::write;
    wr.inline_data = true;
    wr.remote_addr = n->remote.addr;
    wr.rkey = remote_pieces ? n->remote.pieces.key_at(n->remote.addr) : n->remote.rkey;
    n->issued = n->length;
    n->cur_buf = n->nbufs;
    n->cur_off = 0;
    ++stats_.inline_puts;
    return true;
  }
  for (std::size_t wrs = 0; n->cur_buf < n->nbufs && wrs < max_wrs && sq_free() > 0; ++wrs) {
    transport::sge* sg = take_sges(0);  // filled first, then taken: k entries
    const std::uint32_t max_k = std::min(sge_per_wr_, sge_room());
    const std::uint64_t raddr = n->remote.addr + n->issued;
    std::uint64_t limit = fragment_;
    std::uint32_t rkey = n->remote.rkey;
    if (remote_pieces) {
      rkey = n->remote.pieces.key_at(raddr);
      limit = std::min(limit, n->remote.pieces.piece_end(raddr) - raddr);
    }
    std::uint64_t bytes = 0;
    std::uint32_t k = 0;
    for (; k < max_k && n->cur_buf < n->nbufs && bytes < limit; ++k) {
      const asio::const_buffer& b = n->bufs[n->cur_buf];
      const std::uint64_t at = reinterpret_cast<std::uint64_t>(b.data()) + n->cur_off;
      std::uint64_t take = std::min<std::uint64_t>(b.size() - n->cur_off, limit - bytes);
      std::uint32_t lkey = n->lkeys[n->cur_buf];
      if (((static_cast<unsigned>(n->split_mask) >> n->cur_buf) & 1u) != 0) {
        const piece_table& s = *n->split[n->cur_buf];
        lkey = s.lkey_at(at);
        take = std::min(take, s.piece_end(at) - at);
      }
      sg[k] = {at, static_cast<std::uint32_t>(take), lkey};
      bytes += take;
      n->cur_off += take;
      if (n->cur_off == b.size()) {
        ++n->cur_buf;
        n->cur_off = 0;
      }
    }
    const bool last = last_completes && n->cur_buf == n->nbufs;
    transport::work_request& wr = next_wr(last ? slot_kind::onesided_last : slot_kind::none, buffer_pool::npos,
                                          last ? n : nullptr, {take_sges(k), k});
    wr.op = n->kind == op_kind::get ? transport::opcode::read : transport::opcode::write;
    wr.inline_data = false;
    wr.remote_addr = raddr;
    wr.rkey = rkey;
    n->issued += bytes;
  }
  return n->cur_buf == n->nbufs;
}

connection_impl::start_result connection_impl::try_start_onesided(op_node* n, bool post) noexcept {
  switch (n->kind) {
    case op_kind::flush:
      // Complete once every work request queued before it has retired.
      // What is queued and not posted yet goes out with a signaled last
      // one (flush_now signals a doorbell's last while a flush waits). A
      // tail already posted unsignaled (flush_now) may see nothing
      // signaled follow it: a marker is queued behind it then.
      if (sq_queued_ == sq_posted_ && uncovered_tail()) {
        if (sq_free() == 0) return start_result::blocked_queue;
        queue_tail_marker(next_wr(slot_kind::none, buffer_pool::npos, nullptr, {}));
        schedule();
      }
      send_waiting_.remove(n);
      n->operand = sq_queued_;
      if (sq_retired_ >= sq_queued_) {
        ++stats_.flushes;
        complete(n, post, {});
      } else {
        n->phase = op_phase::posted;
        flushes_.push_back(n);
      }
      return start_result::started;
    case op_kind::register_memory: {
      auto& r = *static_cast<scoped_region*>(n->mr.get());
      transport::memory_window* w = r.slot().begin_bind();  // ended by complete()
      if (w == nullptr) {  // revoked: the connection is ending
        send_waiting_.remove(n);
        complete(n, post, send_refusal() ? send_refusal() : make_error_code(errc::connection_closed));
        return start_result::started;
      }
      if (sq_free() == 0) return start_result::blocked_queue;
      transport::work_request& wr = next_wr(slot_kind::onesided_last, buffer_pool::npos, n, {});
      wr.op = transport::opcode::bind_window;
      wr.inline_data = false;
      wr.bind = {w, &r.registration(), reinterpret_cast<std::uint64_t>(r.addr()), r.length(),
                 r.access() & transport::remote_access_bits};
      ++tx_count_;
      break;
    }
    case op_kind::fetch_add:
    case op_kind::compare_swap: {
      if (sq_free() == 0) return start_result::blocked_queue;
      const std::size_t slot = ring_slot(sq_queued_, sq_.size());
      transport::sge* sg = take_sges(1);
      *sg = atomic_mr_->slice(slot * sizeof(std::uint64_t), sizeof(std::uint64_t));
      transport::work_request& wr = next_wr(slot_kind::onesided_last, buffer_pool::npos, n, {sg, 1});
      wr.op = n->kind == op_kind::fetch_add ? transport::opcode::fetch_add : transport::opcode::compare_swap;
      wr.inline_data = false;
      wr.remote_addr = n->remote.addr;
      wr.rkey = n->remote.rkey;
      wr.compare_add = n->operand;
      wr.swap = n->operand2;
      break;
    }
    default: {  // put, get, put_notify
      const bool notify = n->kind == op_kind::put_notify;
      if (n->length == 0 && !notify) {
        send_waiting_.remove(n);
        complete(n, post, {}, 0);
        return start_result::started;
      }
      // The data first, in parts while the send queue is short of room (the
      // operation stays at the head, so nothing behind it overtakes it).
      if (n->cur_buf < n->nbufs) {
        if (sq_free() == 0) return start_result::blocked_queue;
        n->phase = op_phase::posted;  // on the wire from here: no longer cancellable
        if (!emit_segments(n, !notify, sq_free())) {
          schedule();
          return start_result::blocked_queue;
        }
        if (!notify) break;
      }
      // put_with_notify: then the notify message, which needs a credit.
      if (credits_ < 2) {
        schedule();
        return credit_stall(n);
      }
      if (sq_free() == 0) {
        schedule();
        return start_result::blocked_queue;
      }
      const bool inl = can_inline(protocol::kRtsSize);
      std::uint32_t buf = buffer_pool::npos;
      if (!inl && !take_send_buffer(n, buf)) {
        schedule();
        return start_result::blocked_buffer;
      }
      if (n->stalled_buffer && buffer_timer_armed_) buffer_timer_.cancel();
      {
        // RC order: the peer sees the notification after the data is in place.
        std::byte* out = stage_send(slot_kind::onesided_last, buf, n, protocol::kRtsSize);
        --credits_;
        protocol::encode(protocol::header{protocol::msg_type::notify, 0, take_owed(), n->value}, out);
        protocol::encode(protocol::rts_body{n->length, n->remote.addr, n->remote.rkey, 0}, out + protocol::kHeaderSize);
      }
      break;
    }
  }
  send_waiting_.remove(n);
  n->phase = op_phase::posted;
  schedule();
  return start_result::started;
}

void connection_impl::on_onesided_done(op_node* n, transport::wc_status status, std::size_t slot, bool post) noexcept {
  if (status != transport::wc_status::success) {
    complete(n, post, error_ ? error_ : make_error_code(status));
    return;
  }
  // A staged transfer's chunk is not counted: its transfer is, whole
  // (complete_staged).
  auto chunk = [&] {
    const staging_area* area = fab_->staging_if_made();
    return area != nullptr && n->nbufs == 1 && n->regions[0] == &area->region();
  };
  switch (n->kind) {
    case op_kind::put:
    case op_kind::put_notify:
      if (n->kind == op_kind::put && chunk()) break;
      ++stats_.puts;
      stats_.bytes_put += n->length;
      if (n->kind == op_kind::put_notify) ++stats_.notifications_sent;
      break;
    case op_kind::get:
      if (chunk()) break;
      ++stats_.gets;
      stats_.bytes_got += n->length;
      break;
    case op_kind::register_memory:
      if (!static_cast<scoped_region*>(n->mr.get())->adopt_key()) {
        complete(n, post, error_ ? error_ : make_error_code(errc::connection_closed));
        return;
      }
      ++stats_.scoped_registrations;
      break;
    default:
      ++stats_.atomics;
      n->result = atomic_results_[slot];
      break;
  }
  complete(n, post, {}, static_cast<std::size_t>(n->length));
}

void connection_impl::complete_flushes(std::uint64_t done) noexcept {
  while (flushes_.head != nullptr && flushes_.head->operand <= done) {
    op_node* n = flushes_.pop_front();
    ++stats_.flushes;
    complete(n, false, {});
  }
}

std::error_code connection_impl::receive_ending() const noexcept {
  if (peer_closed_ || state_ == state::closed) return errc::connection_closed;
  if (state_ == state::failed) return error_ ? error_ : make_error_code(errc::connection_closed);  // (never empty)
  return {};
}

void connection_impl::end_receives(op_list& waiting, bool post) noexcept {
  const std::error_code ec = receive_ending();
  if (!ec) return;
  while (op_node* n = waiting.pop_front()) complete(n, post, ec);
}

void connection_impl::deliver_notes(bool post) noexcept {
  while (!note_waiting_.empty()) {
    if (notes_head_ == notes_tail_) {
      end_receives(note_waiting_, post);
      return;
    }
    // The buffer is unchanged since handle_message validated it (a held
    // buffer is not posted again until this repost).
    const std::uint32_t buffer = notes_[ring_slot(notes_head_++, notes_.size())];
    const std::byte* data = fab_->pool->data(buffer);
    protocol::header h;
    (void)protocol::decode({data, protocol::kRtsSize}, h);
    const protocol::rts_body b = protocol::decode_rts(data + protocol::kHeaderSize);
    op_node* n = note_waiting_.pop_front();
    n->note = notification{h.aux, remote_region{b.addr, b.length, b.rkey}};
    repost(buffer);
    ++stats_.notifications_received;
    complete(n, post, {});
  }
}

}  // namespace anydoor::detail
