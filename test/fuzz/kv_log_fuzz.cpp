// libFuzzer target: the kv store's log reader (apps/kv/log.hpp) on any file
// content. It never crashes or reads past the file; what it calls good ends
// at valid_end, and that prefix alone parses as a clean log with the same
// records (a torn tail is cut there, a corrupt middle refused).
#include "kv/log.hpp"

#include <algorithm>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

namespace kv = anydoor::apps::kv;

namespace {

struct record {
  kv::record_type type;
  std::string key;
  std::vector<std::byte> value;
  bool operator==(const record&) const = default;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> file(reinterpret_cast<const std::byte*>(data), size);
  std::vector<record> seen;
  auto collect = [](std::vector<record>& into) {
    return [&into](kv::record_type t, std::string_view key, std::span<const std::byte> value) {
      if (t != kv::record_type::put && t != kv::record_type::del) std::abort();
      into.push_back({t, std::string(key), std::vector<std::byte>(value.begin(), value.end())});
    };
  };
  const kv::log_parse p = kv::parse_log(file, collect(seen));
  if (p.valid_end > size || p.records != seen.size()) std::abort();
  if (p.result == kv::log_parse::outcome::not_a_log) return 0;
  if (p.result != kv::log_parse::outcome::ok && p.why.empty()) std::abort();
  // ok: the records, then nothing or only zeros (space reserved ahead);
  // torn and corrupt: no zero tail.
  if (p.result == kv::log_parse::outcome::ok) {
    if (p.valid_end + p.zero_tail != size) std::abort();
    for (std::size_t i = p.valid_end; i < size; ++i) {
      if (file[i] != std::byte{0}) std::abort();
    }
  } else if (p.zero_tail != 0) {
    std::abort();
  }
  std::vector<record> again;
  const kv::log_parse q = kv::parse_log(file.first(p.valid_end), collect(again));
  if (q.result != kv::log_parse::outcome::ok || q.valid_end != p.valid_end || again != seen) std::abort();
  // Re-encoding the records gives back the good prefix after the header.
  std::vector<std::byte> out;
  for (const record& r : seen) kv::encode_record(out, r.type, r.key, r.value, p.salt);
  if (out.size() != p.valid_end - kv::kLogHeader ||
      !std::equal(out.begin(), out.end(), file.begin() + static_cast<std::ptrdiff_t>(kv::kLogHeader))) {
    std::abort();
  }
  return 0;
}
