#include "tcp/faults.hpp"

#include <anydoor/error.hpp>

#include <charconv>
#include <cstdlib>
#include <system_error>

namespace anydoor::transport::tcp {
namespace {

[[noreturn]] void fail(std::string_view item, std::string_view why) {
  throw std::system_error(errc::invalid_argument, std::string(kFaultsVariable) + ": '" + std::string(item) +
                                                      "': " + std::string(why));
}

std::uint64_t number(std::string_view item, std::string_view text, std::uint64_t lo, std::uint64_t hi) {
  std::uint64_t v = 0;
  const char* end = text.data() + text.size();
  const auto [p, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc{} || p != end) fail(item, "the value is not a number");
  if (v < lo || v > hi) fail(item, "the value must be in " + std::to_string(lo) + ".." + std::to_string(hi));
  return v;
}

}  // namespace

fault_plan parse_faults(std::string_view spec) {
  fault_plan plan;
  bool seen_qp = false, seen_delay = false, seen_stall = false, seen_cq_depth = false;
  constexpr std::uint64_t kMaxCount = 1ull << 62;
  constexpr std::uint64_t kMaxMs = 3'600'000;
  for (bool more = !spec.empty(); more;) {
    const std::size_t comma = spec.find(',');
    const std::string_view item = spec.substr(0, comma);
    more = comma != std::string_view::npos;  // "a," ends in an empty item
    spec = more ? spec.substr(comma + 1) : std::string_view{};
    if (item.empty()) fail(item, "an empty item");
    const std::size_t eq = item.find('=');
    if (eq == std::string_view::npos) fail(item, "expected key=value");
    const std::string_view key = item.substr(0, eq);
    const std::string_view value = item.substr(eq + 1);
    auto once = [&](bool seen) {
      if (seen) fail(item, "the key is given twice");
    };
    if (key == "qp") {
      once(seen_qp);
      seen_qp = true;
      plan.qp = static_cast<std::uint32_t>(number(item, value, 1, 0xffffffffu));
    } else if (key == "cut") {
      once(plan.cut_after.has_value());
      plan.cut_after = number(item, value, 1, kMaxCount);
    } else if (key == "delay") {
      once(seen_delay);
      seen_delay = true;
      plan.delay_ms = static_cast<std::uint32_t>(number(item, value, 1, kMaxMs));
    } else if (key == "corrupt") {
      once(plan.corrupt.has_value());
      plan.corrupt = number(item, value, 1, kMaxCount);
    } else if (key == "stop_reading") {
      once(plan.stop_reading_after.has_value());
      plan.stop_reading_after = number(item, value, 0, kMaxCount);
    } else if (key == "stall") {
      once(seen_stall);
      seen_stall = true;
      plan.stall_ms = static_cast<std::uint32_t>(number(item, value, 1, kMaxMs));
    } else if (key == "post_fail") {
      once(plan.post_fail.has_value());
      plan.post_fail = number(item, value, 1, kMaxCount);
    } else if (key == "lose_late") {
      once(plan.lose_late);
      plan.lose_late = number(item, value, 1, 1) == 1;
    } else if (key == "late_duplicates") {
      once(plan.late_duplicates);
      plan.late_duplicates = number(item, value, 1, 1) == 1;
    } else if (key == "cq_depth") {
      once(seen_cq_depth);
      seen_cq_depth = true;
      plan.cq_depth = static_cast<std::uint32_t>(number(item, value, 1, 1u << 20));
    } else {
      fail(item, "unknown key (known: qp, cut, delay, corrupt, stop_reading, stall, post_fail, lose_late, late_duplicates, "
           "cq_depth)");
    }
  }
  if (seen_stall && !plan.stop_reading_after) fail("stall", "stall needs stop_reading");
  if (seen_qp && !plan.active()) {
    fail("qp", plan.cq_depth != 0 || plan.late_duplicates ? "qp selects a queue pair for cut, delay, corrupt, stop_reading, post_fail or "
                                    "lose_late, and none is "
                                    "given (cq_depth and late_duplicates are the device's, for every queue pair)"
                                  : "qp selects a queue pair for a fault, and none is given");
  }
  return plan;
}

fault_plan faults_from_environment() {
  const char* env = std::getenv(kFaultsVariable);
  if (env == nullptr || *env == '\0') return {};
  return parse_faults(env);
}

std::string to_string(const fault_plan& plan) {
  std::string s;
  auto add = [&](std::string_view key, std::uint64_t v) {
    if (!s.empty()) s += ',';
    s += key;
    s += '=';
    s += std::to_string(v);
  };
  if (plan.cut_after) add("cut", *plan.cut_after);
  if (plan.delay_ms != 0) add("delay", plan.delay_ms);
  if (plan.corrupt) add("corrupt", *plan.corrupt);
  if (plan.stop_reading_after) add("stop_reading", *plan.stop_reading_after);
  if (plan.stall_ms != 0) add("stall", plan.stall_ms);
  if (plan.post_fail) add("post_fail", *plan.post_fail);
  if (plan.lose_late) add("lose_late", 1);
  if (plan.late_duplicates) add("late_duplicates", 1);
  if (plan.cq_depth != 0) add("cq_depth", plan.cq_depth);
  if (plan.qp != 0) add("qp", plan.qp);
  return s;
}

}  // namespace anydoor::transport::tcp
