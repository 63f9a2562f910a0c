#include "common/session.hpp"

#include <anydoor/error.hpp>

#include <poll.h>

#include <algorithm>
#include <array>
#include <numeric>
#include <span>
#include <stdexcept>
#include <system_error>

namespace anydoor::examples {
namespace {

session make_session(const session_options& opt) {
  session s;
  s.dev = tp::open_device({.provider = opt.provider});
  s.pd = s.dev->alloc_pd();
  s.cq = s.dev->create_cq(opt.queue_depth * 4);
  s.qp = s.pd->create_qp({.send_cq = s.cq.get(), .recv_cq = s.cq.get(), .max_send_wr = opt.queue_depth,
                          .max_recv_wr = opt.queue_depth});
  s.buf.resize(opt.buffer_size);
  s.mr = s.pd->register_memory(s.buf.data(), s.buf.size(),
                               tp::access::local_write | tp::access::remote_write | tp::access::remote_read |
                                   tp::access::remote_atomic);
  return s;
}

// The packed form fits the smallest private data a provider carries (55
// bytes on verbs).
static_assert(remote_region::packed_size <= 55);

remote_region unpack(std::span<const std::byte> b) {
  remote_region r;
  if (auto ec = remote_region::unpack(b, r)) throw std::system_error(ec, "peer sent no region description");
  return r;
}

std::array<std::byte, remote_region::packed_size> describe(const session& s) {
  return remote_region{reinterpret_cast<std::uint64_t>(s.buf.data()), s.buf.size(), s.mr->rkey()}.pack();
}

}  // namespace

tp::completion session::wait(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  tp::completion c;
  std::error_code ec;
  for (std::uint32_t spins = 0;; ++spins) {
    if (cq->poll({&c, 1}, ec) == 1) break;
    if (ec) throw std::system_error(ec, "poll");
    if ((spins & 0xfff) == 0 && std::chrono::steady_clock::now() > deadline) {
      throw std::system_error(anydoor::errc::timed_out, "waiting for a completion");
    }
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
                   void (*on_listen)(std::uint16_t, void*), void* ctx) {
  session s = make_session(opt);
  auto lis = s.dev->listen(host, port);
  if (on_listen != nullptr) on_listen(lis->port(), ctx);
  std::error_code ec;
  auto req = lis->get_request(std::chrono::seconds(60), ec);
  if (!req) throw std::system_error(ec, "waiting for a connection");
  s.peer = unpack(req->private_data());
  const auto info = describe(s);
  if (auto aec = req->accept(*s.qp, info)) throw std::system_error(aec, "accept");
  return s;
}

session connect_to(const std::string& host, std::uint16_t port, const session_options& opt) {
  session s = make_session(opt);
  const auto info = describe(s);
  auto r = s.dev->connect(*s.qp, host, port, info, std::chrono::seconds(10));
  if (r.ec) throw std::system_error(r.ec, "connect to " + host + ":" + std::to_string(port));
  s.peer = unpack(r.private_data);
  return s;
}

std::vector<double> pingpong(session& s, std::uint32_t size, std::uint32_t iters, bool initiator) {
  constexpr std::uint32_t kWarmup = 1000;
  const std::uint32_t total = iters + kWarmup;
  const bool use_inline = size <= s.qp->attributes().max_inline_data;
  const tp::sge sg = s.mr->slice(0, size);
  const tp::work_request wr{.wr_id = 1, .op = tp::opcode::send, .sg_list = {&sg, 1}, .inline_data = use_inline};
  std::vector<double> rtt;
  rtt.reserve(iters);
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
    s.post_recv(2, size);
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

double stream(session& s, tp::opcode op, std::uint32_t size, std::uint64_t count, std::uint32_t window) {
  const std::uint64_t span = std::min<std::uint64_t>(s.buf.size() / 2, s.peer.length / 2) / size;
  if (span == 0) throw std::invalid_argument("stream: transfer size larger than half the buffers");
  // Posts go out in batches of up to kBatch (one doorbell each) and only the
  // last request of a batch is signaled: its completion retires the batch.
  constexpr std::uint32_t kBatch = 16;
  std::array<tp::sge, kBatch> sg;
  std::array<tp::work_request, kBatch> wr;
  // Half a window per batch keeps a second batch in flight while one completes.
  const std::uint32_t batch = std::max<std::uint32_t>(1, std::min(kBatch, window / 2));
  std::uint64_t posted = 0, done = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (done < count) {
    const std::uint64_t room = std::min<std::uint64_t>(window - (posted - done), count - posted);
    const auto n = static_cast<std::uint32_t>(std::min<std::uint64_t>(room, batch));
    if (n > 0 && (n == batch || posted + n == count || posted == done)) {
      for (std::uint32_t i = 0; i < n; ++i) {
        const std::uint64_t off = ((posted + i) % span) * size;
        sg[i] = s.mr->slice(off, size);
        wr[i] = {.wr_id = posted + i, .op = op, .sg_list = {&sg[i], 1}, .signaled = i + 1 == n,
                 .remote_addr = s.peer.addr + off, .rkey = s.peer.rkey};
      }
      if (auto ec = s.qp->post_send({wr.data(), n})) throw std::system_error(ec, "post_send");
      posted += n;
      continue;
    }
    done = s.wait().wr_id + 1;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void serve_until_disconnect(session& s) {
  tp::completion c[16];
  std::error_code ec;
  // The tcp provider executes one-sided work inside poll(): busy-poll. An
  // RDMA device needs no CPU for it: sleep on the notify fd (arm, poll again,
  // then wait) and wake for completions and connection events.
  const bool busy = s.dev->provider() == "tcp";
  for (std::uint32_t i = 1; !ec; ++i) {
    const bool got = s.cq->poll(c, ec) > 0;
    if ((i & 1023) == 0 && s.qp->state() != tp::qp_state::rts) break;
    if (busy || got || ec) continue;
    if ((ec = s.cq->arm())) break;
    if (s.cq->poll(c, ec) > 0 || ec) continue;
    pollfd p{s.cq->notify_fd(), POLLIN, 0};
    ::poll(&p, 1, 10);  // 10 ms: the state is looked at again
    s.cq->ack_events();
    i = 1023;  // look at the state after each wait
  }
}

summary summarize(std::vector<double> v) {
  summary s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.min = v.front();
  s.median = v[v.size() / 2];
  s.p99 = v[std::min(v.size() - 1, v.size() * 99 / 100)];
  s.mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  return s;
}

}  // namespace anydoor::examples
