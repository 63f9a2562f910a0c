#!/usr/bin/env bash
# The comparison scripts (bench/compare-*.sh, bench/message-rate.sh,
# bench/instructions.sh), each
# once with a few iterations: they exit 0, every summary line carries its
# figures (a RESULT line a script no longer parses shows as nan or an empty
# field), and JSON=FILE appends objects that parse. The figures themselves
# are not judged here (too few iterations; these machines are noisy).
# Skips (77) where the peers are not installed (scripts/setup --bench).
#   test/apps/compare.sh SOURCE_DIR BUILD_DIR
src=${1:?usage: compare.sh SOURCE_DIR BUILD_DIR}
build=${2:?usage: compare.sh SOURCE_DIR BUILD_DIR}

missing=()
for t in fi_pingpong ucx_perftest redis-server redis-benchmark redis-cli taskset python3; do
  command -v "$t" >/dev/null || missing+=("$t")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "skipped: the comparison peers are not installed (${missing[*]}): run scripts/setup --bench"
  exit 77
fi

# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

n='-?[0-9]+(\.[0-9]+)?'  # a figure
json=$tmp/results.jsonl

# script NAME ENV... -- ARGS...: runs bench/NAME.sh, output in $tmp/NAME.out
script() {
  local name=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  timeout 240 env "${envs[@]}" "$src/bench/$name.sh" "$@" >"$tmp/$name.out" 2>"$tmp/$name.err"
  local rc=$?
  [ "$rc" = 0 ] || fail "$name exited with $rc"
  if grep -Eiq '(^|[^a-z])nan([^a-z]|$)' "$tmp/$name.out"; then fail "$name printed nan: $(grep -i nan "$tmp/$name.out" | head -3)"; fi
}

script compare-peers REPS=1 ITERS=500 BW_ITERS=200 "JSON=$json" -- "$build"
expect_in "$tmp/compare-peers.out" "^64 B one-way latency \(us, median of runs\): anydoor $n \| fi_pingpong tcp $n \| UCX tcp $n \| TCP floor $n\$"
expect_in "$tmp/compare-peers.out" "^    latency anydoor/floor $n, anydoor/UCX $n; 64 KiB anydoor/floor $n; 4 MiB anydoor/floor $n\$"
pass "compare-peers"

script compare-runtime REPS=1 ITERS=500 MSGS=5000 "JSON=$json" -- "$build"
expect_in "$tmp/compare-runtime.out" "^64 B one-way latency \(us, median of runs\): runtime echo $n \| raw provider ping-pong $n\$"
expect_in "$tmp/compare-runtime.out" "^  per-round overhead .* = $n %\$"
expect_in "$tmp/compare-runtime.out" "^  ratio anydoor/UCX = $n "
expect_in "$tmp/compare-runtime.out" "^  posts/doorbells per run: 5000/[0-9]+ \$"
pass "compare-runtime"

script compare-onesided REPS=1 "SIZES=64 65536" "JSON=$json" -- "$build"
for s in 64 65536; do
  expect_in "$tmp/compare-onesided.out" "^$s +\|( +$n){2} ratio +$n \|( +$n){2} ratio +$n \|( +$n){2} ratio +$n \|( +$n){2} ratio +$n\$"
done
pass "compare-onesided"

script compare-rpc REPS=1 ITERS=300 CALLS=3000 "JSON=$json" -- "$build"
expect_in "$tmp/compare-rpc.out" "^  rpc_rtt_ratio = $n "
expect_in "$tmp/compare-rpc.out" "^  rpc_rate_ratio = $n vs msg_rate"
pass "compare-rpc"

script compare-kv REPS=1 N_PIPE=20000 N_ONE=500 KV_SECONDS=1 "JSON=$json" -- "$build"
for sync in always everysec no; do
  for t in "SET -c 50 -P 16" "GET -c 50 -P 16" "SET -c 1 -P 1" "GET -c 1 -P 1"; do
    expect_in "$tmp/compare-kv.out" "^$sync +$t +[0-9]+ +[0-9]+ +$n\$"
  done
done
expect_in "$tmp/compare-kv.out" "^anydoor-kv bench --get read, 32 B values +$n +$n\$"
expect_in "$tmp/compare-kv.out" "^TCP floor round trip \(anydoor-tcp-floor\) +$n +$n\$"
pass "compare-kv"

for bad in "300 300" "08 300" "100 -5"; do
  read -r n1 n2 <<<"$bad"
  N1=$n1 N2=$n2 timeout 60 "$src/bench/instructions.sh" "$build" >/dev/null 2>"$tmp/instructions-bad.err"
  rc=$?
  [ "$rc" = 2 ] && grep -q "N1 and N2 must be" "$tmp/instructions-bad.err" || fail "instructions.sh with N1=$n1 N2=$n2: exit $rc"
done
if command -v valgrind >/dev/null; then
  script instructions N1=100 N2=300 -- "$build"
  for t in echo echo_deferred put_lat; do
    expect_in "$tmp/instructions.out" "^RESULT test=$t runtime_instr=[0-9]+ raw_instr=[0-9]+ extra_instr=-?[0-9]+ ratio=$n\$"
  done
  pass "instructions"
else
  echo "instructions.sh counts not run: valgrind is not installed (scripts/setup --bench)"
fi
script message-rate -- "$build" 1 1
expect_in "$tmp/message-rate.out" "^2 +2 +[0-9]+ +$n"x\$
pass "message-rate"

python3 - "$json" <<'EOF' || fail "JSON=: $(head -3 "$json")"
import json, sys
lines = [l for l in open(sys.argv[1]) if l.strip()]
assert len(lines) >= 10, f"only {len(lines)} objects"
for l in lines:
    o = json.loads(l)
    assert isinstance(o, dict) and o, l
print(f"{len(lines)} JSON objects")
EOF
pass "JSON= appends objects that parse"
