#!/usr/bin/env bash
# anydoor-perf on the tcp provider: every test with --json and in RESULT
# lines, --all-sizes (every size reported, in order), a server that follows
# the client's plan, and the command-line errors (exit 2).
#   test/apps/perf.sh BIN_DIR
bin=${1:?usage: perf.sh BIN_DIR}
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
export ANYDOOR_PROVIDER=tcp
perf=$bin/anydoor-perf

# client ARGS...: one server (any port) and one client; the client's output in $tmp/last.out
client() {
  start_server perf "$perf" --server --port 0
  run_cmd 0 "$perf" --connect 127.0.0.1 --port "$PORT" "$@"
  wait_exit perf "$*"
}

# check_json FILE TEST: every line one JSON object with exactly the
# interface's keys, in order; numbers where measured, null where a streamed
# test measures no single operation; positive rates.
check_json() {
  python3 - "$1" "$2" <<'PY' || fail "$2: bad JSON lines: $(cat "$1")"
import json, sys
keys = ["tool", "provider", "test", "size", "iters", "t_min_us", "t_typical_us", "t_avg_us", "p99_us",
        "p999_us", "bw_avg_MBps", "msg_rate_Mpps"]
streamed = sys.argv[2] in ("send_bw", "msg_rate", "write_bw", "read_bw")
lines = [l for l in open(sys.argv[1]) if l.strip()]
assert lines, "no output"
for l in lines:
    r = json.loads(l)
    assert list(r) == keys, list(r)
    assert r["tool"] == "anydoor" and r["provider"] == "tcp" and r["test"] == sys.argv[2], r
    assert isinstance(r["size"], int) and r["size"] > 0 and isinstance(r["iters"], int) and r["iters"] > 0, r
    for k in ("t_min_us", "t_typical_us", "p99_us", "p999_us"):
        assert (r[k] is None) if streamed else (isinstance(r[k], (int, float)) and r[k] > 0), (k, r)
    for k in ("t_avg_us", "bw_avg_MBps", "msg_rate_Mpps"):
        assert isinstance(r[k], (int, float)) and r[k] > 0, (k, r)
PY
}

for t in lat send_bw msg_rate write_bw read_bw atomic_lat write_lat; do
  client --test "$t" -n 300 --json
  [ "$(wc -l <"$tmp/last.out")" = 1 ] || fail "$t: one JSON line expected: $(cat "$tmp/last.out")"
  check_json "$tmp/last.out" "$t"
  expect_in "$tmp/last.out" '"iters":300,'
  case $t in
    lat|write_lat) expect_in "$tmp/last.out" '"size":64,"iters":300,"t_min_us":[0-9]' ;;
    msg_rate|atomic_lat) expect_in "$tmp/last.out" '"size":8,' ;;
    *) expect_in "$tmp/last.out" '"size":65536,"iters":300,"t_min_us":null' ;;
  esac
  pass "$t --json"
done

# One size's numbers agree with each other: bandwidth is size over the average.
client --test lat -s 256 -n 2000 --json
python3 - "$tmp/last.out" <<'PY' || fail "lat: percentiles out of order: $(cat "$tmp/last.out")"
import json, sys
r = json.loads(open(sys.argv[1]).read())
assert r["size"] == 256 and r["iters"] == 2000
assert 0 < r["t_min_us"] <= r["t_typical_us"] <= r["p99_us"] <= r["p999_us"], r
assert abs(r["bw_avg_MBps"] - 256 / r["t_avg_us"]) < 0.01 * r["bw_avg_MBps"] + 0.01, r
PY
pass "lat: -s and -n as asked; bandwidth = size / average"

# RESULT lines (the compare scripts read median_us= and MBps=).
client --test lat -n 300
expect_in "$tmp/last.out" '^RESULT test=lat size=64 iters=300 median_us=[0-9.]+ p99_us=[0-9.]+ mean_us=[0-9.]+ min_us=[0-9.]+ p999_us=[0-9.]+ MBps=[0-9.]+ Mpps=[0-9.]+$'
client --test write_bw -n 300
expect_in "$tmp/last.out" '^RESULT test=write_bw size=65536 iters=300 MBps=[0-9.]+ Mpps=[0-9.]+ avg_us=[0-9.]+$'
pass "RESULT lines"

# --slots: write_bw and read_bw through N places of SIZE (1: one, reused); more than half the buffer holds is refused.
for t in write_bw read_bw; do
  for n in 1 3; do
    client --test "$t" -s 4096 -n 300 --slots "$n"
    expect_in "$tmp/last.out" "^RESULT test=$t size=4096 iters=300 MBps=[0-9.]+ "
  done
done
client --test write_bw --all-sizes -n 20 --slots 1 --json
[ "$(wc -l <"$tmp/last.out")" = 23 ] || fail "write_bw --all-sizes --slots 1: 23 sizes expected"
run_cmd 2 "$perf" --connect 127.0.0.1 --test write_bw -s 4194304 --slots 9
expect_in "$tmp/last.err" '^anydoor-perf: --slots 9: 8 places of 4194304 bytes fit half the buffer$'
run_cmd 2 "$perf" --connect 127.0.0.1 --test write_bw --all-sizes --slots 5
expect_in "$tmp/last.err" '4 places of 8388608 bytes'
run_cmd 2 "$perf" --connect 127.0.0.1 --test lat --slots 1;      expect_in "$tmp/last.err" '--slots applies to write_bw and read_bw'
run_cmd 2 "$perf" --connect 127.0.0.1 --test write_bw --slots 0; expect_in "$tmp/last.err" 'positive number'
pass "--slots"

# --all-sizes: 23 sizes, 2 B to 8 MiB, in order; the server follows without being told.
for t in lat send_bw read_bw write_lat; do
  client --test "$t" --all-sizes -n 20 --json
  check_json "$tmp/last.out" "$t"
  sizes=$(sed -n 's/.*"size":\([0-9]*\),.*/\1/p' "$tmp/last.out" | tr '\n' ' ')
  want=$(for ((s = 2; s <= 8388608; s *= 2)); do printf '%s ' "$s"; done)
  [ "$sizes" = "$want" ] || fail "$t --all-sizes: sizes '$sizes', expected '$want'"
  expect_in "$tmp/last.err" "$t 8388608 B done \(23 of 23\)"
  pass "$t --all-sizes"
done
client --test atomic_lat --all-sizes -n 50 --json
[ "$(wc -l <"$tmp/last.out")" = 1 ] || fail "atomic_lat --all-sizes: one size (8 B) expected"
pass "atomic_lat --all-sizes: 8 B only"

# A server's own --test is the client's to decide.
start_server perf "$perf" --server --port 0 --test write_bw
run_cmd 0 "$perf" --connect 127.0.0.1 --port "$PORT" --test lat -n 200
wait_exit perf "the server did not follow the client's plan"
expect_in "$tmp/last.out" '^RESULT test=lat '
pass "the server follows the client's plan"

# Command-line errors: exit 2 with the reason.
run_cmd 2 "$perf" --connect 127.0.0.1 --all-sizes -s 64;   expect_in "$tmp/last.err" 'not both'
run_cmd 2 "$perf" --connect 127.0.0.1 --test atomic_lat -s 16; expect_in "$tmp/last.err" 'atomic_lat operates on 8 bytes'
run_cmd 2 "$perf" --server --json;                           expect_in "$tmp/last.err" "the client's"
run_cmd 2 "$perf" --server --all-sizes;                      expect_in "$tmp/last.err" "the client's"
run_cmd 2 "$perf" --connect 127.0.0.1 --window 4097;         expect_in "$tmp/last.err" 'at most 4096'
run_cmd 2 "$perf" --connect 127.0.0.1 -s 67108865;           expect_in "$tmp/last.err" 'at most 67108864'
run_cmd 2 "$perf" --connect 127.0.0.1 -n 1000000001;         expect_in "$tmp/last.err" 'at most 1000000000'
run_cmd 2 "$perf" --connect 127.0.0.1 --port 0;              expect_in "$tmp/last.err" "server's"
run_cmd 2 "$perf" --connect 127.0.0.1 --test nope;           expect_in "$tmp/last.err" 'unknown --test nope'
run_cmd 2 "$perf" --connect 127.0.0.1 -s 0;                  expect_in "$tmp/last.err" 'positive number'
run_cmd 2 "$perf";                                           expect_in "$tmp/last.err" 'exactly one of --server and --connect'
pass "command-line errors exit 2 with the reason"

# A client that is not anydoor-perf (the runtime's handshake): refused, the server exits 1 saying why.
start_server perf "$perf" --server --port 0
timeout 30 "$bin/anydoor-runtime-perf" --connect 127.0.0.1 --port "$PORT" -n 10 >"$tmp/rt.out" 2>&1 && fail "anydoor-runtime-perf got through to anydoor-perf's server"
for i in $(seq 1 100); do kill -0 "$PID_perf" 2>/dev/null || break; sleep 0.1; done
wait "$PID_perf"; rc=$?
[ "$rc" = 1 ] || fail "the server exited with $rc after a foreign client, expected 1"
expect_in "$tmp/perf.err" 'anydoor-perf: .*(no region description|no anydoor-perf plan)'
pass "a foreign client is refused; the server says why"

# Nobody listening: exit 1 with the reason.
run_cmd 1 "$perf" --connect 127.0.0.1 --port 1 -n 10
expect_in "$tmp/last.err" 'anydoor-perf: connect to 127.0.0.1:1'
pass "a failed connect exits 1"
echo "perf: all checks passed"
