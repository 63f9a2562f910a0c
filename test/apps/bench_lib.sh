#!/usr/bin/env bash
# bench/lib.sh, the compare scripts' arithmetic, on numbers whose answers
# are known: median, round_ratios (rounds kept aligned where a run gave no
# figure) and json_line.
#   test/apps/bench_lib.sh
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
root=$(cd "$(dirname "$0")/../.." && pwd)
port=0
# shellcheck source=../../bench/lib.sh
source "$root/bench/lib.sh"

is() {  # is WHAT GOT WANT
  [ "$2" = "$3" ] || fail "$1: got '$2', want '$3'"
  pass "$1 = $3"
}

is "median of 3 1 2" "$(printf '3\n1\n2\n' | median)" 2
is "median of an even count" "$(printf '4\n1\n2\n8\n' | median)" 3
is "median of nothing" "$(printf '' | median)" nan

# Lists as the scripts build them: a value and a space per round.
is "round ratios" "$(round_ratios "2 4 6 " "1 1 3 ")" 2.000
# Round 2 of A gave no figure: the rounds stay aligned (6/3, not 6/1) and
# round 2 is left out.
is "a round without a figure" "$(round_ratios "2  6 " "1 1 3 ")" 2.000
is "nan and zero rounds left out" "$(round_ratios "nan 3 0 5 " "1 1 1 2 ")" 2.750
is "an even count of rounds" "$(round_ratios "1 3 " "1 1 ")" 2.000
is "no usable round" "$(round_ratios " nan " "1 1 ")" nan
# Two rounds of three say 1.1: the median of the rounds' ratios is 1.1,
# where the ratio of the medians (2.2 / 1.5) would say 1.467.
is "the rounds' ratios, not the medians' ratio" "$(round_ratios "1.1 2.2 3.3 " "1 2 1.5 ")" 1.100
is "exponents" "$(round_ratios "3e+06 1.5E3 " "1e+06 500 ")" 3.000
is "inf, a negative and not a number left out" "$(round_ratios "inf -2 1.2.3 4 " "1 1 1 2 ")" 2.000

f=$tmp/r.jsonl
json_line "$f" anydoor lat 64 "a=1.5" "b=nan" "c=-2" "d=1.5e+06" "e="
is "json_line" "$(cat "$f")" \
  '{"tool":"anydoor","provider":"tcp","test":"lat","size":64,"a":1.5,"b":null,"c":-2,"d":1.5e+06,"e":null}'
