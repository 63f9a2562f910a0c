#include "common/session.hpp"

#include <anydoor/error.hpp>

#include <poll.h>

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <array>
#include <chrono>
#include <numeric>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>

namespace anydoor::examples {
namespace {

// A busy wait's time limit, cheap per spin: the clock is read only every
// 4096 fruitless spins (not per completion: two clock reads a message were
// 2 % of a ping-pong's instructions), the limit counting from the first
// read, so it is noticed a few milliseconds late at most.
class spin_deadline {
 public:
  explicit spin_deadline(std::chrono::milliseconds limit) noexcept : limit_(limit) {}
  // Once per fruitless spin: whether the limit has passed.
  bool expired() noexcept {
    if ((++spins_ & 0xfff) != 0) return false;
    const auto now = std::chrono::steady_clock::now();
    if (deadline_ == std::chrono::steady_clock::time_point{}) {
      deadline_ = now + limit_;
      return false;
    }
    return now > deadline_;
  }

 private:
  std::chrono::milliseconds limit_;
  std::chrono::steady_clock::time_point deadline_{};
  std::uint32_t spins_ = 0;
};

// The device is opened first (a listener needs it); the rest follows.
void equip(session& s, const session_options& opt) {
  s.pd = s.dev->alloc_pd();
  // Sends and receives share it: twice the queue depth, and some room (at
  // most what the device allows).
  s.cq = s.dev->create_cq(std::min<std::uint32_t>(opt.queue_depth * 2 + 64, s.dev->caps().max_cqe));
  s.qp = s.pd->create_qp({.send_cq = s.cq.get(), .recv_cq = s.cq.get(), .max_send_wr = opt.queue_depth,
                          .max_recv_wr = opt.queue_depth, .max_inline_data = opt.max_inline});
  s.buf.resize(opt.buffer_size);
  s.mr = s.pd->register_memory(s.buf.data(), s.buf.size(),
                               tp::access::local_write | tp::access::remote_write | tp::access::remote_read |
                                   tp::access::remote_atomic);
}

// The packed form fits the smallest private data a provider carries (55
// bytes on verbs).
static_assert(remote_region::packed_size <= 55);

// The peer's region, and what follows it.
void take_peer(session& s, std::span<const std::byte> b) {
  remote_region r;
  const std::error_code ec =
      b.size() < remote_region::packed_size ? make_error_code(anydoor::errc::protocol_error)
                                            : remote_region::unpack(b.first(remote_region::packed_size), r);
  if (ec) throw std::system_error(ec, "peer sent no region description");
  s.peer = r;
  s.peer_extra.assign(b.begin() + remote_region::packed_size, b.end());
}

std::vector<std::byte> describe(const session& s, std::span<const std::byte> extra = {}) {
  if (extra.size() > kMaxExtra) throw std::invalid_argument("session: too much extra private data");
  const auto r = remote_region{reinterpret_cast<std::uint64_t>(s.buf.data()), s.buf.size(), s.mr->rkey()}.pack();
  std::vector<std::byte> out(r.size() + extra.size());
  std::memcpy(out.data(), r.data(), r.size());
  if (!extra.empty()) std::memcpy(out.data() + r.size(), extra.data(), extra.size());
  return out;
}

}  // namespace

tp::completion session::wait(std::chrono::milliseconds timeout) {
  tp::completion c;
  std::error_code ec;
  spin_deadline limit(timeout);
  for (;;) {
    if (cq->poll({&c, 1}, ec) == 1) break;
    if (ec) throw std::system_error(ec, "poll");
    if (limit.expired()) throw std::system_error(anydoor::errc::timed_out, "waiting for a completion");
  }
  if (c.status != tp::wc_status::success) {
    throw std::system_error(c.status, "work request " + std::to_string(c.wr_id) + " (" +
                                          std::string(tp::to_string(c.opcode)) + ")");
  }
  return c;
}

void session::post_recv(std::uint64_t wr_id, std::uint32_t length) {
  const tp::sge sg = mr->slice(buf.size() / 2, length);
  const tp::recv_request rr{.wr_id = wr_id, .sg_list = {&sg, 1}};
  if (auto ec = qp->post_recv({&rr, 1})) throw std::system_error(ec, "post_recv");
}

void session::post(const tp::work_request& wr) {
  if (auto ec = qp->post_send({&wr, 1})) throw std::system_error(ec, "post_send");
}

session accept_one(const std::string& host, std::uint16_t port, const session_options& opt,
                   void (*on_listen)(std::uint16_t, void*), void* ctx,
                   const std::function<session_options(std::span<const std::byte>)>& configure) {
  session s;
  s.dev = tp::open_device({.provider = opt.provider});
  auto lis = s.dev->listen(host, port);
  if (on_listen != nullptr) on_listen(lis->port(), ctx);
  std::error_code ec;
  auto req = lis->get_request(std::chrono::seconds(60), ec);
  if (!req) throw std::system_error(ec, "waiting for a connection");
  try {
    take_peer(s, req->private_data());
    equip(s, configure ? configure(s.peer_extra) : opt);
  } catch (...) {
    req->reject({});
    throw;
  }
  const auto info = describe(s);
  if (auto aec = req->accept(*s.qp, info)) throw std::system_error(aec, "accept");
  return s;
}

session connect_to(const std::string& host, std::uint16_t port, const session_options& opt,
                   std::span<const std::byte> extra) {
  session s;
  s.dev = tp::open_device({.provider = opt.provider});
  equip(s, opt);
  const auto info = describe(s, extra);
  auto r = s.dev->connect(*s.qp, host, port, info, std::chrono::seconds(10));
  if (r.ec) throw std::system_error(r.ec, "connect to " + host + ":" + std::to_string(port));
  take_peer(s, r.private_data);
  return s;
}

std::vector<double> pingpong(session& s, std::uint32_t size, std::uint32_t iters, bool initiator,
                             std::uint32_t warmup) {
  const std::uint32_t kWarmup = warmup;
  const std::uint32_t total = iters + kWarmup;
  const bool use_inline = size <= s.qp->attributes().max_inline_data;
  const tp::sge sg = s.mr->slice(0, size);
  const tp::work_request wr{.wr_id = 1, .op = tp::opcode::send, .sg_list = {&sg, 1}, .inline_data = use_inline};
  std::vector<double> rtt;
  if (initiator) rtt.reserve(iters);  // (the responder records nothing)
  s.post_recv(2, size);
  std::uint32_t sent = 0, received = 0;
  auto t0 = std::chrono::steady_clock::now();
  if (initiator) {
    s.post(wr);
  }
  // Send completions (the peer's ACK) and receives arrive in either order.
  while (sent < total || received < total) {
    const tp::completion c = s.wait();
    if (c.opcode != tp::wc_opcode::recv) {
      ++sent;
      continue;
    }
    ++received;
    if (received < total) s.post_recv(2, size);  // none left behind for a next run (maybe larger)
    if (initiator) {
      const auto t1 = std::chrono::steady_clock::now();
      if (received > kWarmup) rtt.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count());
      t0 = t1;
      if (received < total) s.post(wr);
    } else {
      s.post(wr);
    }
  }
  return rtt;
}

std::vector<double> write_pingpong(session& s, std::uint32_t size, std::uint32_t iters, bool initiator,
                                   std::uint32_t warmup) {
  const std::size_t half = s.buf.size() / 2;
  if (size == 0 || size > half || size > s.peer.length / 2) {
    throw std::invalid_argument("write_pingpong: " + std::to_string(size) + " bytes do not fit half the buffers");
  }
  const tp::sge sg = s.mr->slice(0, size);
  const tp::work_request wr{.wr_id = 4, .op = tp::opcode::write, .sg_list = {&sg, 1}, .signaled = true,
                            .inline_data = size <= s.qp->attributes().max_inline_data,
                            .remote_addr = s.peer.addr + s.peer.length / 2, .rkey = s.peer.rkey};
  volatile std::byte* const depart = s.buf.data() + size - 1;
  const volatile std::byte* const arrive = s.buf.data() + half + size - 1;
  const std::uint32_t room = s.qp->attributes().max_send_wr;
  std::uint32_t outstanding = 0;
  std::array<tp::completion, 16> done;
  auto progress = [&] {
    std::error_code ec;
    const std::size_t n = s.cq->poll(done, ec);
    if (ec) throw std::system_error(ec, "poll");
    for (std::size_t i = 0; i < n; ++i) {
      if (done[i].status != tp::wc_status::success) {
        throw std::system_error(done[i].status, "an RDMA WRITE (" + std::string(tp::to_string(done[i].opcode)) + ")");
      }
      if (done[i].opcode == tp::wc_opcode::recv) throw std::runtime_error("write_pingpong: a message arrived mid-run");
      // (A responder's earlier call left its last write unacknowledged:
      // the initiator's next write carries that ACK, so it completes here.)
      if (outstanding > 0) --outstanding;
    }
  };
  auto await = [&](std::byte tag) {
    spin_deadline limit(std::chrono::seconds(30));
    while (*arrive != tag) {
      progress();
      if (limit.expired()) throw std::system_error(anydoor::errc::timed_out, "waiting for the peer's write");
    }
  };
  auto write = [&](std::byte tag) {
    while (outstanding + 1 >= room) progress();
    *depart = tag;
    s.post(wr);
    ++outstanding;
  };
  std::vector<double> rtt;
  if (initiator) rtt.reserve(iters);
  for (std::uint32_t i = 0; i < warmup + iters; ++i) {
    const auto tag = static_cast<std::byte>(i % 255 + 1);  // never 0, the buffer's first value; each round's differs
    if (initiator) {
      const auto t0 = std::chrono::steady_clock::now();
      write(tag);
      await(tag);
      if (i >= warmup) rtt.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count());
    } else {
      await(tag);
      write(tag);
    }
  }
  // The initiator's last write is acknowledged with the peer's last one.
  // The responder's waits for the initiator's next word (its next write,
  // or the message that ends the run, which serve_until_message takes):
  // with the tcp provider a lone ACK is held back until then.
  if (initiator) {
    while (outstanding > 0) progress();
  }
  return rtt;
}

namespace {

// Streams `count` requests with `window` in flight. They go out in batches
// of up to kBatch (one doorbell each) and only the last request of a batch
// is signaled: its completion retires the batch. fill(i, seq, last) makes
// the batch's i-th request, number seq. Returns the elapsed seconds.
constexpr std::uint32_t kBatch = 16;
template <class Fill>
double pump(session& s, std::uint64_t count, std::uint32_t window, Fill fill) {
  std::array<tp::work_request, kBatch> wr;
  // Half a window per batch keeps a second batch in flight while one completes.
  const std::uint32_t batch = std::max<std::uint32_t>(1, std::min(kBatch, window / 2));
  std::uint64_t posted = 0, done = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (done < count) {
    const std::uint64_t room = std::min<std::uint64_t>(window - (posted - done), count - posted);
    const auto n = static_cast<std::uint32_t>(std::min<std::uint64_t>(room, batch));
    if (n > 0 && (n == batch || posted + n == count || posted == done)) {
      for (std::uint32_t i = 0; i < n; ++i) wr[i] = fill(i, posted + i, i + 1 == n);
      if (auto ec = s.qp->post_send({wr.data(), n})) throw std::system_error(ec, "post_send");
      posted += n;
      continue;
    }
    const tp::completion c = s.wait();
    if (c.opcode != tp::wc_opcode::recv) done = c.wr_id + 1;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

double stream(session& s, tp::opcode op, std::uint32_t size, std::uint64_t count, std::uint32_t window,
              std::uint64_t slots) {
  const std::uint64_t fit = std::min<std::uint64_t>(s.buf.size() / 2, s.peer.length / 2) / size;
  if (fit == 0) throw std::invalid_argument("stream: transfer size larger than half the buffers");
  if (slots > fit) {
    throw std::invalid_argument("stream: " + std::to_string(slots) + " slots of " + std::to_string(size) +
                                " bytes do not fit half the buffers (" + std::to_string(fit) + " do)");
  }
  const std::uint64_t span = slots != 0 ? slots : fit;
  std::array<tp::sge, kBatch> sg;
  return pump(s, count, window, [&](std::uint32_t i, std::uint64_t seq, bool last) {
    const std::uint64_t off = (seq % span) * size;
    sg[i] = s.mr->slice(off, size);
    return tp::work_request{.wr_id = seq, .op = op, .sg_list = {&sg[i], 1}, .signaled = last,
                            .remote_addr = s.peer.addr + off, .rkey = s.peer.rkey};
  });
}

double send_stream(session& s, std::uint32_t size, std::uint64_t count, std::uint32_t window) {
  if (size > s.buf.size() / 2) throw std::invalid_argument("send_stream: message larger than half the buffer");
  const bool use_inline = size <= s.qp->attributes().max_inline_data;
  const tp::sge sg = s.mr->slice(0, size);
  return pump(s, count, window, [&](std::uint32_t, std::uint64_t seq, bool last) {
    return tp::work_request{.wr_id = seq, .op = tp::opcode::send, .sg_list = {&sg, 1}, .signaled = last,
                            .inline_data = use_inline};
  });
}

void receive_count(session& s, std::uint64_t count, std::uint32_t max_size, std::uint32_t depth) {
  std::uint64_t posted = 0, received = 0;
  for (; posted < std::min<std::uint64_t>(depth, count); ++posted) s.post_recv(posted, max_size);
  while (received < count) {
    const tp::completion c = s.wait();
    if (c.opcode != tp::wc_opcode::recv) continue;
    ++received;
    if (posted < count) s.post_recv(posted++, max_size);
  }
}

std::vector<double> atomic_roundtrips(session& s, std::uint32_t iters, std::uint32_t warmup) {
  const tp::sge sg = s.mr->slice(0, 8);
  const tp::work_request wr{.wr_id = 3, .op = tp::opcode::fetch_add, .sg_list = {&sg, 1},
                            .remote_addr = s.peer.addr, .rkey = s.peer.rkey, .compare_add = 1};
  std::vector<double> t;
  t.reserve(iters);
  for (std::uint32_t i = 0; i < warmup + iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    s.post(wr);
    (void)s.wait();
    if (i >= warmup) t.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count());
  }
  return t;
}

namespace {

// Polls until the queue pair leaves rts (false) or, with `message`, until a
// receive completes successfully (true). A failed receive ends it too.
bool serve_until(session& s, bool message, std::uint64_t wr_id) {
  tp::completion c[16];
  std::error_code ec;
  // The tcp provider executes one-sided work inside poll(): busy-poll. An
  // RDMA device needs no CPU for it: sleep on the notify fd (arm, poll again,
  // then wait) and wake for completions and connection events.
  const bool busy = s.dev->provider() == "tcp";
  auto arrived = [&](std::size_t n) {
    for (std::size_t k = 0; k < n; ++k) {
      if (c[k].opcode != tp::wc_opcode::recv) continue;
      if (c[k].status != tp::wc_status::success) return std::optional<bool>(false);
      if (message && c[k].wr_id == wr_id) return std::optional<bool>(true);
    }
    return std::optional<bool>();
  };
  for (std::uint32_t i = 1; !ec; ++i) {
    std::size_t n = s.cq->poll(c, ec);
    if (auto r = arrived(n)) return *r;
    if ((i & 1023) == 0 && s.qp->state() != tp::qp_state::rts) break;
    if (busy || n > 0 || ec) continue;
    if ((ec = s.cq->arm())) break;
    n = s.cq->poll(c, ec);
    if (auto r = arrived(n)) return *r;
    if (n > 0 || ec) continue;
    pollfd p{s.cq->notify_fd(), POLLIN, 0};
    ::poll(&p, 1, 10);  // 10 ms: the state is looked at again
    s.cq->ack_events();
    i = 1023;  // look at the state after each wait
  }
  return false;
}

}  // namespace

void serve_until_disconnect(session& s) { (void)serve_until(s, false, 0); }

bool serve_until_message(session& s, std::uint64_t wr_id) { return serve_until(s, true, wr_id); }

summary summarize(std::vector<double> v) {
  summary s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.min = v.front();
  s.max = v.back();
  s.median = v[v.size() / 2];
  s.p99 = v[std::min(v.size() - 1, v.size() * 99 / 100)];
  s.p999 = v[std::min(v.size() - 1, v.size() * 999 / 1000)];
  s.mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  return s;
}

}  // namespace anydoor::examples
