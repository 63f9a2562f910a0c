#!/usr/bin/env bash
# The runtime's benchmark programs on the tcp provider, briefly: every test
# of anydoor-runtime-perf and anydoor-rpc-perf gives its RESULT line with
# positive figures and both sides exit 0; servers on --port 0 print the
# port they took (as does anydoor-tcp-floor's); the shared command line's
# port errors (exit 2); anydoor-rpc-perf's --handler. The compare-*.sh scripts parse these lines.
#   test/apps/bench_tools.sh BIN_DIR
bin=${1:?usage: bench_tools.sh BIN_DIR}
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
export ANYDOOR_PROVIDER=tcp
num='[0-9]*[1-9][0-9]*\.?[0-9]*|0\.[0-9]*[1-9][0-9]*'  # a positive number

# run TOOL TEST PATTERN ARGS...: a server on --port 0 and a client, both
# with --test TEST and ARGS; the client's RESULT line must match PATTERN.
run() {
  local tool=$1 test=$2 pattern=$3
  shift 3
  start_server server "$bin/$tool" --server --port 0 --provider tcp --test "$test" "$@"
  [ "$(head -1 "$tmp/server.out")" = "$tool: listening on 0.0.0.0:$PORT" ] || fail "$tool's first line is not its port"
  run_cmd 0 "$bin/$tool" --connect 127.0.0.1 --port "$PORT" --provider tcp --test "$test" "$@"
  wait_exit server "$tool --test $test $*"
  expect_in "$tmp/last.out" "^RESULT test=$test $pattern"
}

rp=anydoor-runtime-perf
lat="median_us=($num) p99_us=($num) mean_us=($num)\$"
rlat="median_us=($num) p99_us=($num) mean_us=($num) p999_us=($num)\$"  # anydoor-runtime-perf's latency tests
run $rp echo "size=64 iters=300 $rlat" -n 300
run $rp echo_deferred "size=64 iters=300 $rlat" -n 300
run $rp echo_rate "size=64 iters=300 window=32 Mmsgs=($num)\$" -n 300
run $rp msg_rate "size=64 iters=300 window=64 Mmsgs=($num) MBps=($num) doorbells=($num) posts=300 signaled=($num) credit_stalls=[0-9]+\$" -n 300
run $rp put_lat "size=64 iters=300 $rlat" -n 300
run $rp put_lat "size=65536 iters=50 $rlat" -n 50 -s 65536
run $rp get_lat "size=64 iters=300 $rlat" -n 300
run $rp put_bw "size=4096 iters=300 window=16 MBps=($num) doorbells=($num) posts=300\$" -n 300 -s 4096
pass "anydoor-runtime-perf: every test"

run anydoor-rpc-perf lat "size=64 iters=300 $lat" -n 300
run anydoor-rpc-perf rate "size=64 iters=300 window=32 Mcalls=($num)\$" -n 300
run anydoor-rpc-perf lat "size=64 iters=300 $lat" -n 300 --handler coro
run anydoor-rpc-perf rate "size=64 iters=300 window=32 Mcalls=($num)\$" -n 300 --handler sync
for h in bogus ''; do
  run_cmd 2 "$bin/anydoor-rpc-perf" --server --port 0 --handler "$h"
  expect_in "$tmp/last.err" "--handler must be sync or coro: '$h'"
done
run_cmd 2 "$bin/anydoor-rpc-perf" --server --port 0 --handler
expect_in "$tmp/last.err" "--handler must be sync or coro: ''"
pass "anydoor-rpc-perf: both tests, both handlers"

# The floor's server prints the port it took.
start_server floor "$bin/anydoor-tcp-floor" --server --port 0 --test lat -n 100
expect_in "$tmp/floor.out" "^anydoor-tcp-floor: listening on 0\.0\.0\.0:$PORT\$"
run_cmd 0 "$bin/anydoor-tcp-floor" --connect 127.0.0.1 --port "$PORT" --test lat -n 100
wait_exit floor
expect_in "$tmp/last.out" "^RESULT test=lat size=64 iters=100 $lat"
pass "anydoor-tcp-floor --port 0"

# The shared command line: a port is 0..65535, and 0 is a server's.
for tool in $rp anydoor-rpc-perf anydoor-tcp-floor anydoor-perf; do
  for p in 65536 70000 -1 x '' ' 5' +5 '5 ' 0x10 1e3 000080; do
    run_cmd 2 "$bin/$tool" --connect 127.0.0.1 --port "$p"
    grep -qxF -- "$bin/$tool: --port must be 0..65535: $p" "$tmp/last.err" || fail "$tool --port '$p': $(head -1 "$tmp/last.err")"
  done
  run_cmd 2 "$bin/$tool" --connect 127.0.0.1 --port 0
  expect_in "$tmp/last.err" "--port 0 is the server's \(any free port\)"
  # 65535 is a port (a refused connection, exit 1, not a usage error)
  run_cmd 1 "$bin/$tool" --connect 127.0.0.1 --port 65535 -n 1
done
pass "--port errors"
