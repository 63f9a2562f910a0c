// libFuzzer target: the kv store's Redis protocol parser (apps/kv/resp.hpp)
// on a client's bytes, whole and trickled in pieces (the first byte of the
// input picks the piece size). Both ways must find the same commands with
// the same arguments, or fail at the same command; nothing reads past the
// buffer, and consumed bytes always advance.
#include "kv/resp.hpp"

#include <cstdlib>
#include <string>
#include <vector>

namespace kv = anydoor::apps::kv;

namespace {

struct outcome {
  std::vector<std::vector<std::string>> commands;
  bool error = false;
  bool operator==(const outcome&) const = default;
};

outcome parse(std::string_view all, std::size_t piece) {
  const kv::resp_limits lim{.max_args = 64, .max_bulk = 4096, .max_inline = 1024};
  kv::resp_parser parser(lim);
  outcome o;
  std::vector<std::string_view> args;
  std::string why;
  std::size_t start = 0;  // the unconsumed bytes begin here
  std::size_t have = piece == 0 ? all.size() : std::min(piece, all.size());
  for (;;) {
    std::size_t consumed = 0;
    const kv::resp_parse r = parser.next(all.substr(start, have - start), args, consumed, why);
    if (r == kv::resp_parse::error) {
      if (why.empty()) std::abort();
      o.error = true;
      return o;
    }
    if (r == kv::resp_parse::command) {
      if (consumed == 0 || consumed > have - start) std::abort();
      std::vector<std::string> c;
      for (auto a : args) c.emplace_back(a);
      o.commands.push_back(std::move(c));
      start += consumed;
      continue;
    }
    if (have == all.size()) return o;  // incomplete with nothing more to come
    have = piece == 0 ? all.size() : std::min(have + piece, all.size());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::size_t piece = 1 + data[0] % 16;
  const std::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (!(parse(in, 0) == parse(in, piece))) std::abort();
  return 0;
}
