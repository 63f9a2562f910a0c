#!/usr/bin/env bash
# anydoor-tcp-floor (compare-peers.sh's TCP floor): both tests, --slots, and
# the command-line errors (exit 2).
#   test/apps/floor.sh BIN_DIR
bin=${1:?usage: floor.sh BIN_DIR}
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
floor=$bin/anydoor-tcp-floor

# pair ARGS...: a server on a free port and a client with the same ARGS; the
# client's output in $tmp/last.out. The floor has no --port 0: a port that
# turns out taken (the server exits at once) is tried again with another.
pair() {
  local attempt port
  for attempt in 1 2 3 4 5; do
    port=$((20000 + RANDOM % 30000))
    "$floor" --server --port "$port" "$@" >"$tmp/server.out" 2>"$tmp/server.err" &
    local spid=$!
    _pids+=("$spid")
    sleep 0.2
    kill -0 "$spid" 2>/dev/null || { wait "$spid"; continue; }
    run_cmd 0 "$floor" --connect 127.0.0.1 --port "$port" "$@"
    wait "$spid" || fail "the server exited with $?: $*"
    return 0
  done
  fail "no free port in 5 tries: $(cat "$tmp/server.err")"
}

pair --test lat -n 200
expect_in "$tmp/last.out" '^RESULT test=lat size=64 iters=200 median_us=[0-9.]+ p99_us=[0-9.]+ mean_us=[0-9.]+$'
pass "lat"
for n in 1 3; do
  pair --test stream -s 65536 -n 100 --slots "$n"
  expect_in "$tmp/last.out" '^RESULT test=stream size=65536 iters=100 MBps=[0-9.]+$'
done
pair --test stream -s 1000 -n 1000
expect_in "$tmp/last.out" '^RESULT test=stream size=1000 iters=1000 MBps=[0-9.]+$'
pass "stream, with and without --slots"

run_cmd 2 "$floor" --server --port 1 --test lat --slots 2
expect_in "$tmp/last.err" '--slots applies to --test stream'
run_cmd 2 "$floor" --server --port 1 --test stream -s 1073741824 --slots 2
expect_in "$tmp/last.err" '-s \(times --slots\) must be at most 1 GiB'
run_cmd 2 "$floor" --server --port 1 --test stream -s 2147483648; expect_in "$tmp/last.err" 'at most 1 GiB'
run_cmd 2 "$floor" --connect 127.0.0.1 --test nope;  expect_in "$tmp/last.err" 'unknown --test nope'
run_cmd 2 "$floor" --connect 127.0.0.1 --slots 0;    expect_in "$tmp/last.err" 'positive number'
run_cmd 2 "$floor";                                  expect_in "$tmp/last.err" 'exactly one of --server and --connect'
pass "command-line errors exit 2 with the reason"
echo "floor: all checks passed"
