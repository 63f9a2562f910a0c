// anydoor-echo's client against servers that echo wrongly: a flipped byte
// fails a run with --verify (and passes one without it: what --verify
// adds), an echo of the wrong length fails any run. The client runs in
// this process (echo::run_client), the servers on a thread of their own.
#include "../support/runtime.hpp"
#include "echo/echo.hpp"

#include <anydoor/rpc.hpp>

#include <boost/asio/post.hpp>

#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>

namespace asio = boost::asio;
namespace echo = anydoor::apps::echo;
using anydoor::test::addr;
using anydoor::test::test_host;
using anydoor::test::test_options;

namespace {

// An echo server whose reply is mangle(request).
class mangling_server {
 public:
  explicit mangling_server(std::function<std::string(std::string)> mangle)
      : fab_(io_, test_options()), mangle_(std::move(mangle)) {
    srv_.add(echo::method.id, [this](anydoor::rpc::server_call& call) -> anydoor::rpc::status {
      const auto req = call.request();
      call.reply(mangle_(std::string(reinterpret_cast<const char*>(req.data()), req.size())));
      return {};
    });
    anydoor::acceptor acc = fab_.listen(test_host(), 0);
    where_ = addr(acc);
    srv_.async_serve(std::move(acc), [](anydoor::error_code) {});
    thread_ = std::thread([this] { io_.run(); });
  }
  ~mangling_server() {
    asio::post(io_, [this] {
      srv_.stop();
      io_.stop();
    });
    thread_.join();
  }
  const std::string& where() const { return where_; }

 private:
  asio::io_context io_{1};
  anydoor::fabric fab_;
  std::function<std::string(std::string)> mangle_;
  anydoor::rpc::server srv_;
  std::string where_;
  std::thread thread_;
};

// run_client's exit code, and what it wrote to stderr.
int run_capturing(const echo::client_options& o, std::string& err) {
  char path[] = "/tmp/anydoor-echo-unit-XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  std::fflush(stderr);
  const int saved = ::dup(2);
  ::dup2(fd, 2);
  int rc = -1;
  try {
    rc = echo::run_client(o);
  } catch (...) {
    rc = -2;  // (stderr given back first)
  }
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  ::close(fd);
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  err = ss.str();
  ::unlink(path);
  return rc;
}

echo::client_options options_for(const mangling_server& s, bool verify) {
  echo::client_options o;
  REQUIRE(anydoor::apps::parse_endpoint(s.where(), o.connect));
  o.provider = anydoor::test::provider_under_test();
  o.size = 64;
  o.count = 20;
  o.timeout = 10;
  o.verify = verify;
  return o;
}

}  // namespace

TEST_CASE("echo client: --verify fails a run whose echo differs - and only it checks the bytes", "[apps]") {
  mangling_server s([](std::string m) {
    m[5] = static_cast<char>(m[5] ^ 0x40);
    return m;
  });
  std::string err;
  CHECK(run_capturing(options_for(s, true), err) == 1);
  INFO(err);
  CHECK(err.find("anydoor-echo: message 1: the echo differs at byte 5") != std::string::npos);
  CHECK(run_capturing(options_for(s, false), err) == 0);
}

TEST_CASE("echo client: an echo of another length fails the run - with or without --verify", "[apps]") {
  mangling_server s([](std::string m) {
    m.pop_back();
    return m;
  });
  for (const bool verify : {true, false}) {
    std::string err;
    CHECK(run_capturing(options_for(s, verify), err) == 1);
    INFO(err);
    CHECK(err.find("the echo has 63 bytes, sent 64") != std::string::npos);
  }
}
