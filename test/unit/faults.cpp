// ANYDOOR_TCP_FAULTS: every key parsed, every malformed specification
// refused with the offending item named.
#include <anydoor/error.hpp>

#include "tcp/faults.hpp"

#include <catch2/catch.hpp>

#include <string>
#include <system_error>

using anydoor::transport::tcp::fault_plan;
using anydoor::transport::tcp::parse_faults;

namespace {

std::string refusal(const char* spec) {
  try {
    parse_faults(spec);
  } catch (const std::system_error& e) {
    CHECK(e.code() == anydoor::errc::invalid_argument);
    return e.what();
  }
  FAIL("accepted: " << spec);
  return {};
}

}  // namespace

TEST_CASE("fault plan: every key parses and an empty plan is inactive", "[unit][faults]") {
  const fault_plan none = parse_faults("");
  CHECK_FALSE(none.active());
  CHECK_FALSE(none.applies_to(1));

  const fault_plan p = parse_faults("cut=40,delay=5,corrupt=7,stop_reading=0,stall=250,qp=2");
  REQUIRE(p.cut_after);
  CHECK(*p.cut_after == 40);
  CHECK(p.delay_ms == 5);
  REQUIRE(p.corrupt);
  CHECK(*p.corrupt == 7);
  REQUIRE(p.stop_reading_after);
  CHECK(*p.stop_reading_after == 0);  // from the first frame on
  CHECK(p.stall_ms == 250);
  CHECK(p.qp == 2);
  CHECK(p.active());
  CHECK_FALSE(p.applies_to(1));
  CHECK(p.applies_to(2));
  CHECK_FALSE(p.applies_to(3));
  CHECK(to_string(p) == "cut=40,delay=5,corrupt=7,stop_reading=0,stall=250,qp=2");

  const fault_plan every = parse_faults("delay=1");
  CHECK(every.applies_to(1));
  CHECK(every.applies_to(99));
  CHECK(to_string(every) == "delay=1");

  const fault_plan post = parse_faults("post_fail=3,qp=1");
  REQUIRE(post.post_fail);
  CHECK(*post.post_fail == 3);
  CHECK(post.active());
  CHECK(post.applies_to(1));
  CHECK_FALSE(post.applies_to(2));
  CHECK(to_string(post) == "post_fail=3,qp=1");

  const fault_plan late = parse_faults("lose_late=1,qp=2");
  CHECK(late.lose_late);
  CHECK(late.active());
  CHECK(late.applies_to(2));
  CHECK_FALSE(late.applies_to(1));
  CHECK(to_string(late) == "lose_late=1,qp=2");
  CHECK_FALSE(post.lose_late);

  // The device's fault: no queue pair's.
  const fault_plan small = parse_faults("cq_depth=4");
  CHECK(small.cq_depth == 4);
  CHECK_FALSE(small.active());
  CHECK(small.any());
  CHECK_FALSE(small.applies_to(1));
  CHECK(to_string(small) == "cq_depth=4");
  const fault_plan dup = parse_faults("late_duplicates=1");
  CHECK(dup.late_duplicates);
  CHECK_FALSE(dup.active());  // the device's: no queue pair fault
  CHECK(dup.any());
  CHECK(to_string(dup) == "late_duplicates=1");
  CHECK_FALSE(small.late_duplicates);
  CHECK_FALSE(none.any());
}

TEST_CASE("fault plan: malformed specifications are refused, naming the item", "[unit][faults]") {
  CHECK(refusal("cut").find("'cut': expected key=value") != std::string::npos);
  CHECK(refusal("cut=").find("not a number") != std::string::npos);
  CHECK(refusal("cut=1x").find("'cut=1x'") != std::string::npos);
  CHECK(refusal("cut=-1").find("not a number") != std::string::npos);
  CHECK(refusal("cut=0").find("must be in 1..") != std::string::npos);
  CHECK(refusal("corrupt=0").find("must be in 1..") != std::string::npos);
  CHECK(refusal("delay=0").find("must be in 1..3600000") != std::string::npos);
  CHECK(refusal("delay=3600001").find("must be in 1..3600000") != std::string::npos);
  CHECK(refusal("stop_reading=1,stall=0").find("must be in 1..") != std::string::npos);
  CHECK(refusal("qp=0,cut=1").find("must be in 1..") != std::string::npos);
  CHECK(refusal("cut=99999999999999999999").find("not a number") != std::string::npos);
  CHECK(refusal("cut=1,,delay=2").find("an empty item") != std::string::npos);
  CHECK(refusal("cut=1,").find("an empty item") != std::string::npos);
  CHECK(refusal("cut=1,cut=2").find("given twice") != std::string::npos);
  CHECK(refusal("delay=1,delay=2").find("given twice") != std::string::npos);
  CHECK(refusal("drop=5").find("unknown key") != std::string::npos);
  CHECK(refusal("stall=100").find("stall needs stop_reading") != std::string::npos);
  CHECK(refusal("qp=1").find("none is given") != std::string::npos);
  CHECK(refusal("qp=1,cq_depth=4").find("cq_depth and late_duplicates are the device's") != std::string::npos);
  CHECK(refusal("cq_depth=0").find("must be in 1..1048576") != std::string::npos);
  CHECK(refusal("cq_depth=1048577").find("must be in 1..1048576") != std::string::npos);
  CHECK(refusal("cq_depth=4,cq_depth=8").find("given twice") != std::string::npos);
  CHECK(refusal("post_fail=0").find("must be in 1..") != std::string::npos);
  CHECK(refusal("post_fail=1,post_fail=2").find("given twice") != std::string::npos);
  CHECK(refusal("lose_late=0").find("must be in 1..1") != std::string::npos);
  CHECK(refusal("lose_late=2").find("must be in 1..1") != std::string::npos);
  CHECK(refusal("lose_late=1,lose_late=1").find("given twice") != std::string::npos);
  CHECK(refusal("late_duplicates=0").find("must be in 1..1") != std::string::npos);
  CHECK(refusal("late_duplicates=1,late_duplicates=1").find("given twice") != std::string::npos);
  CHECK(refusal("qp=1,late_duplicates=1").find("late_duplicates are the device's") != std::string::npos);
  CHECK(refusal("cut=1,drop=5").find("ANYDOOR_TCP_FAULTS") != std::string::npos);
}
