#!/usr/bin/env bash
# anydoor-echo from the command line: every option, sizes from 1 byte to
# several MiB (eager and rendezvous), JSON, progress, and the failure paths
# (unreachable, server killed, server stopped, bad options), and SIGINT/SIGTERM.
# usage: echo.sh BIN_DIR
source "$(dirname "$0")/lib.sh"
echo_bin=$1/anydoor-echo

start_server srv "$echo_bin" server --listen 127.0.0.1:0 --provider tcp
expect_in "$tmp/srv.out" "listening on 127.0.0.1:$PORT \(provider tcp"

for size in 1 7 64 4096 8191 8192 8193 65536 1M 3M; do
  run_cmd 0 "$echo_bin" client --connect 127.0.0.1:$PORT --size $size --count 40 --in-flight 4 --verify
  expect_in "$tmp/last.out" "^anydoor-echo: 40 messages of [0-9]+ B .*every byte verified"
done
pass "sizes 1 B .. 3 MiB, verified"

run_cmd 0 "$echo_bin" client --connect 127.0.0.1:$PORT --size 100 --count 2000 --in-flight 8 --connections 3 --json
[ "$(wc -l <"$tmp/last.out")" = 1 ] || fail "--json printed more than one line"
python3 - "$tmp/last.out" <<'PY' || fail "--json is not the expected object"
import json, sys
o = json.load(open(sys.argv[1]))
keys = {"provider", "size", "connections", "in_flight", "messages", "seconds", "msgs_per_s", "mb_per_s",
        "p50_us", "p99_us", "p999_us", "max_us", "verified"}
assert keys <= o.keys(), keys - o.keys()
assert o["messages"] == 2000 and o["size"] == 100 and o["connections"] == 3 and o["in_flight"] == 8
assert o["msgs_per_s"] > 0 and 0 < o["p50_us"] <= o["p99_us"] <= o["p999_us"] <= o["max_us"]
assert o["verified"] is False
PY
pass "--json, --connections"

run_cmd 0 "$echo_bin" client --connect 127.0.0.1:$PORT --duration 3.2 --in-flight 2
expect_in "$tmp/last.out" "messages/s [0-9.]+ +MB/s [0-9.]+"
expect_in "$tmp/last.out" "latency us +p50 [0-9.]+ +p99 [0-9.]+ +p99.9 [0-9.]+ +max [0-9.]+"
[ "$(grep -c '^anydoor-echo: [0-9] s: ' "$tmp/last.err")" -ge 2 ] || fail "no progress lines on a 3.2 s run"
pass "--duration with progress lines"
run_cmd 0 "$echo_bin" client --connect 127.0.0.1:$PORT --duration 3.2 --json
grep -q 's: ' "$tmp/last.err" && fail "progress lines with --json"
pass "no progress with --json"

# A size above the server's maximum message fails with the reason.
start_server small "$echo_bin" server --listen 127.0.0.1:0 --provider tcp --max-message 64K
run_cmd 1 "$echo_bin" client --connect 127.0.0.1:$PORT --size 65537 --count 1
expect_in "$tmp/last.err" "resource exhausted"
run_cmd 0 "$echo_bin" client --connect 127.0.0.1:$PORT --size 64K --count 3 --verify
pass "--max-message"

# Unreachable: a port nobody listens on.
kill -TERM "$PID_small"; wait "$PID_small" 2>/dev/null
run_cmd 1 "$echo_bin" client --connect 127.0.0.1:$PORT --count 1
expect_in "$tmp/last.err" "^anydoor-echo: cannot connect to 127.0.0.1:$PORT: "
pass "unreachable server"

# The server stops answering (SIGSTOP): the run ends within --timeout.
start_server frozen "$echo_bin" server --listen 127.0.0.1:0 --provider tcp
# Stopped once the client reports its first second of traffic.
rm -f "$tmp/last.err"
when_line "$tmp/last.err" '^anydoor-echo: [0-9]+ s: ' kill -STOP "$PID_frozen"
start=$SECONDS
run_cmd 1 "$echo_bin" client --connect 127.0.0.1:$PORT --duration 30 --timeout 2
expect_in "$tmp/last.err" "stopped answering: no reply within 2"
[ $((SECONDS - start)) -le 10 ] || fail "a stopped server took $((SECONDS - start)) s to notice"
# Stopped before the client connects: the connection's set-up is bounded by --timeout too.
start=$SECONDS
run_cmd 1 "$echo_bin" client --connect 127.0.0.1:$PORT --count 1 --timeout 1
expect_in "$tmp/last.err" "^anydoor-echo: cannot connect to 127.0.0.1:$PORT: .*timed out"
[ $((SECONDS - start)) -le 6 ] || fail "connecting to a stopped server took $((SECONDS - start)) s with --timeout 1"
kill -KILL "$PID_frozen"
pass "stopped server noticed within --timeout, connecting or running"

# The server dies mid-run (SIGKILL).
start_server victim "$echo_bin" server --listen 127.0.0.1:0 --provider tcp
rm -f "$tmp/last.err"
when_line "$tmp/last.err" '^anydoor-echo: [0-9]+ s: ' kill -KILL "$PID_victim"
run_cmd 1 "$echo_bin" client --connect 127.0.0.1:$PORT --duration 30 --in-flight 4
expect_in "$tmp/last.err" "lost the connection to the server"
pass "killed server"

# SIGTERM and SIGINT: connections closed, exit 0.
for sig in TERM INT; do
  start_server graceful "$echo_bin" server --listen 127.0.0.1:0 --provider tcp
  timeout 60 "$echo_bin" client --connect 127.0.0.1:$PORT --duration 30 >"$tmp/c.out" 2>"$tmp/c.err" &
  cpid=$!
  sleep 1
  kill -$sig "$PID_graceful"
  timeout 10 tail --pid="$PID_graceful" -f /dev/null || fail "the server did not exit within 10 s of SIG$sig"
  wait "$PID_graceful"; rc=$?
  [ "$rc" = 0 ] || fail "the server exited $rc after SIG$sig"
  expect_in "$tmp/graceful.err" "SIG$sig: closing 1 connection"
  expect_in "$tmp/graceful.out" "served [0-9]+ calls on 1 connection"
  wait "$cpid"; [ $? = 1 ] || fail "the client did not fail when the server went away"
  expect_in "$tmp/c.err" "lost the connection"
done
pass "SIGTERM and SIGINT exit 0"

# --threads: reactors behind one socket, connections placed round robin,
# SIGTERM closes them on every reactor.
start_server group env ANYDOOR_LOG=info "$echo_bin" server --listen 127.0.0.1:0 --provider tcp --threads 2
expect_in "$tmp/group.out" "listening on 127.0.0.1:$PORT \(provider tcp, .*, 2 reactor threads\)"
expect_in "$tmp/group.err" "reactor_group: reactor 1 runs on cpu [0-9]+"
run_cmd 0 "$echo_bin" client --connect 127.0.0.1:$PORT --size 9000 --count 400 --in-flight 4 --connections 4 --verify
expect_in "$tmp/last.out" "every byte verified"
run_cmd 0 "$echo_bin" client --connect 127.0.0.1:$PORT --size 100 --count 400 --in-flight 2 --connections 4 --credits 4 --verify
expect_in "$tmp/last.out" "every byte verified"
# client --threads: each thread its own fabric and share of the connections
run_cmd 0 "$echo_bin" client --connect 127.0.0.1:$PORT --size 300 --count 1001 --in-flight 4 --connections 3 --threads 2 --verify
expect_in "$tmp/last.out" "^anydoor-echo: 1001 messages of 300 B in .* over 3 connection\(s\), 4 in flight each \(provider tcp, 2 client threads, every byte verified\)"
run_cmd 0 "$echo_bin" client --connect 127.0.0.1:$PORT --count 500 --connections 2 --threads 2 --json
python3 -c 'import json,sys; o=json.load(open(sys.argv[1])); assert o["threads"]==2 and o["messages"]==500 and o["connections"]==2, o' "$tmp/last.out" || fail "client --threads --json: $(cat "$tmp/last.out")"
run_cmd 0 "$echo_bin" client --connect 127.0.0.1:$PORT --duration 2.5 --connections 2 --threads 2
[ "$(grep -c '^anydoor-echo: [0-9] s: .* msg/s, .* MB/s (2 client threads)$' "$tmp/last.err")" -ge 2 ] || fail "client --threads: no progress lines: $(cat "$tmp/last.err")"
run_cmd 2 "$echo_bin" client --connect 127.0.0.1:$PORT --connections 1 --threads 2; expect_in "$tmp/last.err" "--threads must not exceed --connections"
run_cmd 2 "$echo_bin" client --connect 127.0.0.1:$PORT --threads 0; expect_in "$tmp/last.err" "--threads takes"
# A server that goes away ends a --threads client too (every thread, not just the one that noticed first).
timeout 60 "$echo_bin" client --connect 127.0.0.1:$PORT --duration 30 --connections 2 --threads 2 >"$tmp/c.out" 2>"$tmp/c.err" &
cpid=$!
sleep 1
kill -TERM "$PID_group"
timeout 10 tail --pid="$PID_group" -f /dev/null || fail "the --threads server did not exit within 10 s of SIGTERM"
wait "$PID_group"; rc=$?
[ "$rc" = 0 ] || fail "the --threads server exited $rc after SIGTERM"
expect_in "$tmp/group.err" "SIGTERM: closing 2 connection\(s\) on 2 reactors"
expect_in "$tmp/group.out" "served [0-9]+ calls on 17 connection\(s\) \(per reactor: 9 8\)"
wait "$cpid"; [ $? = 1 ] || fail "the client did not fail when the --threads server went away"
pass "--threads 2"

# --srq: every connection of a reactor receives from one shared receive
# queue (64 buffers for up to 8 connections: all admitted, windows grow).
start_server srq env ANYDOOR_LOG=info "$echo_bin" server --listen 127.0.0.1:0 --provider tcp --srq 64 --max-connections 8
expect_in "$tmp/srq.out" "listening on 127.0.0.1:$PORT \(provider tcp, .*, shared receive queue of 64 buffers\)"
# (the fabric's own word that it made the queue)
expect_in "$tmp/srq.err" "fabric: provider tcp .*, shared receive queue of 64 buffers"
run_cmd 0 "$echo_bin" client --connect 127.0.0.1:$PORT --size 3000 --count 2000 --in-flight 8 --connections 4 --verify
expect_in "$tmp/last.out" "every byte verified"
run_cmd 0 "$echo_bin" client --connect 127.0.0.1:$PORT --size 200000 --count 40 --in-flight 2 --verify
expect_in "$tmp/last.out" "every byte verified"
kill -TERM "$PID_srq"; wait "$PID_srq" 2>/dev/null
pass "--srq"

# Bad command lines: exit 2 with the reason.
run_cmd 2 "$echo_bin" client --connect nowhere --count 1; expect_in "$tmp/last.err" "takes HOST:PORT"
run_cmd 2 "$echo_bin" client --connect 127.0.0.1:1 --count 1 --duration 1; expect_in "$tmp/last.err" "not both"
run_cmd 2 "$echo_bin" client --connect 127.0.0.1:1 --size 0; expect_in "$tmp/last.err" "--size takes a number"
run_cmd 2 "$echo_bin" client --connect 127.0.0.1:1 --size 2G; expect_in "$tmp/last.err" "--size takes a number"
run_cmd 2 "$echo_bin" client --connect 127.0.0.1:1 --in-flight x; expect_in "$tmp/last.err" "--in-flight takes"
run_cmd 2 "$echo_bin" client --connect 127.0.0.1:1 --duration -1; expect_in "$tmp/last.err" "--duration takes"
run_cmd 2 "$echo_bin" client --connect 127.0.0.1:1 --bogus; expect_in "$tmp/last.err" "unknown option --bogus"
run_cmd 2 "$echo_bin" client --count 1; expect_in "$tmp/last.err" "needs --connect"
run_cmd 2 "$echo_bin" server; expect_in "$tmp/last.err" "needs --listen"
run_cmd 2 "$echo_bin" server --listen 127.0.0.1:0 --provider foo; expect_in "$tmp/last.err" "--provider takes"
run_cmd 2 "$echo_bin" server --listen 127.0.0.1:0 --threads 0; expect_in "$tmp/last.err" "--threads takes"
run_cmd 2 "$echo_bin" server --listen 127.0.0.1:0 --threads 257; expect_in "$tmp/last.err" "--threads takes"
run_cmd 2 "$echo_bin" server --listen 127.0.0.1:0 --credits 3; expect_in "$tmp/last.err" "--credits takes"
run_cmd 2 "$echo_bin" client --connect 127.0.0.1:1 --credits 5000; expect_in "$tmp/last.err" "--credits takes"
run_cmd 2 "$echo_bin" server --listen 127.0.0.1:0 --srq 4; expect_in "$tmp/last.err" "--srq takes"
run_cmd 2 "$echo_bin" dance; expect_in "$tmp/last.err" "unknown mode"
run_cmd 2 "$echo_bin"; expect_in "$tmp/last.err" "say server or client"; expect_in "$tmp/last.err" "usage:"
run_cmd 0 "$echo_bin" --help; expect_in "$tmp/last.out" "anydoor-echo server --listen"
run_cmd 0 "$echo_bin" -h; expect_in "$tmp/last.out" "anydoor-echo client --connect"
run_cmd 2 "$echo_bin" client --connect; expect_in "$tmp/last.err" "missing value after --connect"
run_cmd 2 "$echo_bin" server --listen 127.0.0.1:0 --bogus; expect_in "$tmp/last.err" "unknown option --bogus"
run_cmd 2 "$echo_bin" server --listen 127.0.0.1:0 --max-message 0; expect_in "$tmp/last.err" "--max-message takes a number from 1 to 1073741824"
run_cmd 2 "$echo_bin" server --listen 127.0.0.1:0 --max-connections 4097; expect_in "$tmp/last.err" "--max-connections takes a number from 1 to 4096"
run_cmd 2 "$echo_bin" server --listen 127.0.0.1:0 --metrics-listen nope; expect_in "$tmp/last.err" "takes HOST:PORT"
run_cmd 2 "$echo_bin" client --connect 127.0.0.1:1 --count 0; expect_in "$tmp/last.err" "--count takes a number from 1"
run_cmd 2 "$echo_bin" client --connect 127.0.0.1:1 --connections 4097; expect_in "$tmp/last.err" "--connections takes a number from 1 to 4096"
run_cmd 2 "$echo_bin" client --connect 127.0.0.1:1 --timeout 0; expect_in "$tmp/last.err" "--timeout takes a positive number of seconds, not '0'"
run_cmd 2 "$echo_bin" client --connect 127.0.0.1:1 --provider foo; expect_in "$tmp/last.err" "--provider takes"
pass "bad command lines"

# What the fabric refuses: the completion queue its options need is larger
# than the device's (the tcp provider's 2^20 entries).
run_cmd 1 "$echo_bin" server --listen 127.0.0.1:0 --provider tcp --max-connections 4096 --credits 4096
expect_in "$tmp/last.err" "exceeds the device's completion queue limit 1048576"
# A port already taken: exit 1 with the reason.
start_server taken "$echo_bin" server --listen 127.0.0.1:0 --provider tcp --max-connections 1
run_cmd 1 "$echo_bin" server --listen 127.0.0.1:$PORT --provider tcp
expect_in "$tmp/last.err" "^anydoor-echo: listen: cannot bind 127.0.0.1:$PORT: Address already in use"
# --max-connections 1: the first connection is served, the second refused.
run_cmd 1 "$echo_bin" client --connect 127.0.0.1:$PORT --provider tcp --connections 2 --count 10
expect_in "$tmp/last.err" "^anydoor-echo: cannot connect to 127.0.0.1:$PORT: too many connections"
# (the server frees the refused client's slot once it has seen it go: a few tries)
for try in 1 2 3 4 5 6 7 8 9 10; do
  timeout 60 "$echo_bin" client --connect 127.0.0.1:$PORT --provider tcp --connections 1 --count 10 >"$tmp/last.out" 2>"$tmp/last.err" && break
  [ $try = 10 ] && fail "--max-connections 1: no connection admitted after the refusal: $(cat "$tmp/last.err")"
  sleep 0.5
done
expect_in "$tmp/last.out" "\\(provider tcp"
kill -TERM "$PID_taken"; wait "$PID_taken" 2>/dev/null
pass "the fabric's refusal, a port taken, --max-connections, --provider tcp"

# Many connections: a progress line for every 500 opened (stderr, not with
# --json), then the run over all of them (each side needs about 1100
# descriptors: skipped where the hard limit is lower).
hard=$(ulimit -Hn)
if [ "$hard" != unlimited ] && [ "$hard" -lt 2200 ]; then
  echo "skipped: --connections 1000 (the hard descriptor limit is $hard; each side needs about 1100)"
else
start_server many "$echo_bin" server --listen 127.0.0.1:0 --provider tcp --max-connections 1100
run_cmd 0 "$echo_bin" client --connect 127.0.0.1:$PORT --provider tcp --connections 1000 --count 2000
expect_in "$tmp/last.err" "^anydoor-echo: 500 of 1000 connections open$"
[ "$(grep -c 'connections open' "$tmp/last.err")" = 1 ] || fail "expected one 'connections open' line for 1000 connections"
expect_in "$tmp/last.out" "^anydoor-echo: 2000 messages of 64 B in .* over 1000 connection\\(s\\)"
run_cmd 0 "$echo_bin" client --connect 127.0.0.1:$PORT --provider tcp --connections 600 --count 600 --json
grep -q 'connections open' "$tmp/last.err" && fail "a 'connections open' line with --json"
pass "--connections 1000: progress while connecting"
fi

# A descriptor limit too low for --connections (and one the process may not
# raise: no CAP_SYS_RESOURCE): one line naming the limit and what is needed,
# then the connection that hits it fails the run with the reason.
# (A shell with CAP_SYS_RESOURCE drops it for these runs with setpriv; one
# without it needs only prlimit.)
has_sys_resource() { (( (0x$(awk '/^CapEff/ {print $2}' /proc/self/status) >> 24) & 1 )); }
if has_sys_resource; then
  nocap=(setpriv --inh-caps=-sys_resource --bounding-set=-sys_resource)
else
  nocap=()
fi
if command -v prlimit >/dev/null && prlimit --nofile=100:100 "${nocap[@]}" true 2>/dev/null; then
  lowfd=(prlimit --nofile=100:100 "${nocap[@]}")
  start_server fdsrv "$echo_bin" server --listen 127.0.0.1:0 --provider tcp --max-connections 300
  if [ -n "${ANYDOOR_SANITIZE:-}" ]; then
    # (the sanitizers' own checks need descriptors: out of them, UBSan
    # reports a false "invalid vptr" in the log's formatting; the warning
    # comes before that, and the run fails either way)
    timeout 60 "${lowfd[@]}" "$echo_bin" client --connect 127.0.0.1:$PORT --provider tcp --connections 200 --count 200 \
      >"$tmp/last.out" 2>"$tmp/last.err" && fail "a run out of descriptors succeeded"
    expect_in "$tmp/last.err" "^anydoor-echo: 264 descriptors are needed, more than the descriptor limit allows \\(RLIMIT_NOFILE: soft 100, hard 100\\)"
    echo "skipped under the sanitizers (${ANYDOOR_SANITIZE}): the reason of a run out of descriptors"
  else
    run_cmd 1 "${lowfd[@]}" "$echo_bin" client --connect 127.0.0.1:$PORT --provider tcp --connections 200 --count 200
    expect_in "$tmp/last.err" "^anydoor-echo: 264 descriptors are needed, more than the descriptor limit allows \\(RLIMIT_NOFILE: soft 100, hard 100\\)"
    expect_in "$tmp/last.err" "^anydoor-echo: cannot connect to 127.0.0.1:$PORT: Too many open files$"
  fi
  # Where the limit is enough, nothing is said.
  run_cmd 0 "${lowfd[@]}" "$echo_bin" client --connect 127.0.0.1:$PORT --provider tcp --connections 10 --count 10
  grep -q 'descriptors are needed' "$tmp/last.err" && fail "a descriptor warning with a limit that is enough"
  # A soft limit below the hard one is raised as far as needed: no warning.
  run_cmd 0 prlimit --nofile=100:1000 "${nocap[@]}" \
    "$echo_bin" client --connect 127.0.0.1:$PORT --provider tcp --connections 200 --count 200
  grep -q 'descriptors are needed' "$tmp/last.err" && fail "a descriptor warning where the hard limit allows"
  # The server warns at start and goes on serving what the limit allows.
  start_server lowfd "${lowfd[@]}" "$echo_bin" server --listen 127.0.0.1:0 --provider tcp --max-connections 100
  expect_in "$tmp/lowfd.err" "^anydoor-echo: 180 descriptors are needed, more than the descriptor limit allows \\(RLIMIT_NOFILE: soft 100, hard 100\\)"
  run_cmd 0 "$echo_bin" client --connect 127.0.0.1:$PORT --provider tcp --connections 2 --count 10
  # A process that may (CAP_SYS_RESOURCE) raises the limit beyond the hard
  # one: no warning, every connection served.
  if has_sys_resource; then
    start_server rootfd prlimit --nofile=100:100 "$echo_bin" server --listen 127.0.0.1:0 --provider tcp --max-connections 100
    grep -q 'descriptors are needed' "$tmp/rootfd.err" && fail "CAP_SYS_RESOURCE could not raise its descriptor limit"
    run_cmd 0 prlimit --nofile=100:100 "$echo_bin" client --connect 127.0.0.1:$PORT --provider tcp --connections 90 --count 90
    grep -q 'descriptors are needed' "$tmp/last.err" && fail "CAP_SYS_RESOURCE could not raise its descriptor limit (client)"
  else
    echo "skipped: raising the descriptor limit beyond the hard one (this shell lacks CAP_SYS_RESOURCE)"
  fi
  pass "a descriptor limit too low: named, and the run fails with the reason"
else
  echo "skipped: descriptor limit (no prlimit, or setpriv cannot drop CAP_SYS_RESOURCE here)"
fi
echo "echo app: all passed"
