// Opens the tcp provider through the installed headers and library and
// moves one message across a connected pair.
#include <anydoor/error.hpp>
#include <anydoor/transport/provider.hpp>

#include <cstdio>
#include <cstring>
#include <thread>

namespace tp = anydoor::transport;

int main() {
  auto dev = tp::open_device({.provider = "tcp"});
  auto pd = dev->alloc_pd();
  auto cq = dev->create_cq(16);
  auto a = pd->create_qp({.send_cq = cq.get(), .recv_cq = cq.get()});
  auto b = pd->create_qp({.send_cq = cq.get(), .recv_cq = cq.get()});
  auto lis = dev->listen("127.0.0.1", 0);
  std::error_code accept_ec;
  std::thread t([&] {
    std::error_code ec;
    auto req = lis->get_request(std::chrono::seconds(10), ec);
    accept_ec = req ? req->accept(*b, {}) : ec;
  });
  auto r = dev->connect(*a, "127.0.0.1", lis->port(), {}, std::chrono::seconds(10));
  t.join();
  if (r.ec || accept_ec) return 1;
  char src[] = "consumer", dst[16] = {};
  auto smr = pd->register_memory(src, sizeof src, tp::access::none);
  auto dmr = pd->register_memory(dst, sizeof dst, tp::access::local_write);
  tp::sge rs = dmr->slice(0, sizeof dst), ss = smr->slice(0, sizeof src);
  tp::recv_request rr{.wr_id = 1, .sg_list = {&rs, 1}};
  tp::work_request wr{.wr_id = 2, .sg_list = {&ss, 1}};
  if (b->post_recv({&rr, 1}) || a->post_send({&wr, 1})) return 1;
  int done = 0;
  for (int spins = 0; done < 2 && spins < 10'000'000; ++spins) {
    tp::completion c[4];
    std::error_code ec;
    const auto n = cq->poll(c, ec);
    for (std::size_t i = 0; i < n; ++i) done += c[i].status == tp::wc_status::success ? 1 : 100;
  }
  std::printf("consumer: %s\n", dst);
  return done == 2 && std::strcmp(dst, "consumer") == 0 ? 0 : 1;
}
