#!/usr/bin/env bash
# The runtime's own cost per operation in instructions, counted rather than
# timed: user-space instructions the client executes per iteration
# (valgrind --tool=callgrind), the runtime against the raw provider, tcp
# provider on loopback, busy polling. Counts do not swing with the
# machine's load the way timings here do (rounds differ by 10-40 %), so
# they show what a change to the data path costs or saves.
#   bench/instructions.sh [BUILD_DIR]   (default build/; valgrind from scripts/setup --bench)
# Each test runs twice, with N1 and N2 iterations (defaults 5000 and 15000):
# the difference of the two totals over N2 - N1 cancels start-up, warm-up
# and the final summary. The server runs natively on CPU 0 and answers at
# once, so the slowed client seldom polls empty: the runtime's counts
# repeat within about 1 % here, the raw ping-pong's within about 5 % (its
# loop polls the socket far more often than the runtime's, and an empty
# poll costs about 100 instructions). The kernel's work (system calls) is
# not counted.
# One RESULT line per pair:
#   echo           anydoor-runtime-perf echo (co_await send, co_await receive,
#                  use_awaitable) vs anydoor-perf lat, per round trip
#   echo_deferred  the same with asio::deferred, vs the same raw figure
#   put_lat        anydoor-runtime-perf put_lat (co_await async_put, the
#                  peer's memory polled) vs anydoor-perf write_lat, per round
# RESULT test=T runtime_instr=R raw_instr=W extra_instr=R-W ratio=R/W
set -euo pipefail
shopt -s inherit_errexit  # (a failure inside $(...) stops the script: no figure from a failed count)
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
perf=$build/bin/anydoor-perf
rperf=$build/bin/anydoor-runtime-perf
N1=${N1:-5000}
N2=${N2:-15000}
port=$((10000 + RANDOM % 20000))  # below the ephemeral range
export ANYDOOR_POLL=busy ANYDOOR_LOG=warn

if ! [[ "$N1" =~ ^[1-9][0-9]{0,8}$ && "$N2" =~ ^[1-9][0-9]{0,8}$ ]] || ((N2 <= N1)); then
  echo "instructions: N1 and N2 must be whole numbers with 0 < N1 < N2 < 10^9, no leading zeros (got $N1, $N2)" >&2
  exit 2
fi
# shellcheck source=lib.sh
source "$root/bench/lib.sh"
require_tools instructions "$perf" "$rperf" valgrind taskset

# count BIN TEST ITERS: the client's total instruction count.
count() {
  local out
  out=$(pair "$1 --server --port PORT --provider tcp --test $2 -n $3" \
             "valgrind --tool=callgrind --callgrind-out-file=/dev/null $1 --connect 127.0.0.1 --port PORT --provider tcp --test $2 -n $3")
  local n
  n=$(sed -n 's/.*I *refs: *\([0-9,]*\).*/\1/p' <<<"$out" | tr -d ,)
  if [[ -z "$n" ]] || ! grep -q '^RESULT' <<<"$out"; then
    echo "instructions: $2 with $3 iterations gave no count; its output:" >&2
    echo "$out" >&2
    exit 1
  fi
  echo "$n"
}

# per_iteration BIN TEST: instructions per iteration (N1 and N2 runs).
per_iteration() {
  echo "  $(basename "$1") $2" >&2
  local a b
  a=$(count "$1" "$2" "$N1")
  b=$(count "$1" "$2" "$N2")
  echo $(((b - a) / (N2 - N1)))
}

raw_lat=$(per_iteration "$perf" lat)
raw_write=$(per_iteration "$perf" write_lat)
for t in echo echo_deferred put_lat; do
  r=$(per_iteration "$rperf" "$t")
  w=$raw_lat
  [[ $t == put_lat ]] && w=$raw_write
  echo "RESULT test=$t runtime_instr=$r raw_instr=$w extra_instr=$((r - w)) ratio=$(awk -v r="$r" -v w="$w" 'BEGIN {printf "%.3f", r / w}')"
done
