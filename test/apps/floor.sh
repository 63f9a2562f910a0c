#!/usr/bin/env bash
# anydoor-tcp-floor (compare-peers.sh's TCP floor): both tests, --slots, and
# the command-line errors (exit 2).
#   test/apps/floor.sh BIN_DIR
bin=${1:?usage: floor.sh BIN_DIR}
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
floor=$bin/anydoor-tcp-floor

# pair ARGS...: a server on --port 0 (it prints the port it took) and a
# client with the same ARGS; the client's output in $tmp/last.out.
pair() {
  start_server floor "$floor" --server --port 0 "$@"
  run_cmd 0 "$floor" --connect 127.0.0.1 --port "$PORT" "$@"
  wait_exit floor "$*"
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
