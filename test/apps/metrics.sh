#!/usr/bin/env bash
# Live counters: anydoor-echo server --metrics-listen (one reactor and
# --threads 2) scraped over HTTP while a client runs: the page is valid
# Prometheus text whose counters match the traffic; anydoor-doctor --attach
# prints them; the endpoint refuses bad requests, slow and surplus clients,
# and keeps serving; SIGTERM still exits 0.
# usage: metrics.sh BIN_DIR
source "$(dirname "$0")/lib.sh"
echo_bin=$1/anydoor-echo
doctor=$1/anydoor-doctor

metrics_port() { sed -n 's/.*metrics on [^ ]*:\([0-9][0-9]*\).*/\1/p' "$tmp/$1.out" | head -1; }
scrape() {  # scrape PORT OUT: GET /metrics into OUT, checked as Prometheus text
  python3 - "$1" "$2" <<'PY' || fail "scrape of port $1: $(cat "$2" 2>/dev/null | head -5)"
import re, sys, urllib.request
port, out = sys.argv[1], sys.argv[2]
r = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4"), r.headers
text = r.read().decode()
open(out, "w").write(text)
typed, seen = {}, set()
sample = re.compile(r'^([a-z_]+)\{((?:[a-z_]+="(?:[^"\\]|\\.)*",?)*)\} ([0-9]+)$')
for line in text.splitlines():
    if line.startswith("# TYPE "):
        _, _, name, kind = line.split(" ")
        assert name not in typed, "family declared twice: " + name
        typed[name] = kind
        continue
    if line.startswith("# HELP "):
        continue
    m = sample.match(line)
    assert m, "not a sample: " + line
    assert m.group(1) in typed, "sample before its TYPE: " + line
    assert (m.group(1), m.group(2)) not in seen, "duplicate sample: " + line
    seen.add((m.group(1), m.group(2)))
    if typed[m.group(1)] == "counter":
        assert m.group(1).endswith("_total"), line
PY
}
total() {  # total FILE NAME [LABEL-REGEX]: sum of NAME's samples (matching the labels)
  python3 - "$@" <<'PY'
import re, sys
f, name = sys.argv[1], sys.argv[2]
want = re.compile(sys.argv[3] if len(sys.argv) > 3 else "")
s = 0
for line in open(f):
    m = re.match(r'^([a-z_]+)\{(.*)\} ([0-9]+)$', line.strip())
    if m and m.group(1) == name and want.search(m.group(2)):
        s += int(m.group(3))
print(s)
PY
}

for threads in 1 2; do
  start_server m$threads "$echo_bin" server --listen 127.0.0.1:0 --provider tcp --threads $threads \
    --metrics-listen 127.0.0.1:0
  P=$PORT; M=$(metrics_port m$threads)
  [ -n "$M" ] || fail "no 'metrics on' line"
  # 3 connections busy for a while (20 s: under CI load the scrapes and
  # the --attach below took more than 8 s once); scrape in the middle of it
  timeout 60 "$echo_bin" client --connect 127.0.0.1:$P --duration 20 --connections 3 --in-flight 2 --provider tcp \
    --json >"$tmp/c.out" 2>"$tmp/c.err" &
  cpid=$!
  for _ in $(seq 1 100); do  # until all 3 are open and carrying traffic (at most 10 s)
    scrape "$M" "$tmp/mid.txt"
    [ "$(total "$tmp/mid.txt" anydoor_connections_open)" = 3 ] &&
      [ "$(total "$tmp/mid.txt" anydoor_connection_messages_received_total 'state="open"')" -gt 100 ] && break
    sleep 0.1
  done
  [ "$(total "$tmp/mid.txt" anydoor_connections_open)" = 3 ] || fail "threads $threads: open connections mid-run: $(grep connections_open "$tmp/mid.txt")"
  [ "$(total "$tmp/mid.txt" anydoor_connection_messages_received_total 'state="open"')" -gt 100 ] \
    || fail "threads $threads: messages received mid-run: $(grep messages_received "$tmp/mid.txt")"
  [ "$(grep -c '^anydoor_connection_messages_received_total{.*state="open"' "$tmp/mid.txt")" = 3 ] \
    || fail "threads $threads: one row per open connection"
  if [ $threads = 2 ]; then
    grep -q '^anydoor_connections_open{reactor="1",provider="tcp"}' "$tmp/mid.txt" || fail "no reactor 1 samples"
  fi
  run_cmd 0 "$doctor" --attach 127.0.0.1:$M --count 2 --interval 0.3
  [ "$(grep -c '^anydoor-doctor --attach 127.0.0.1:'$M' at .* (scrape [12], [0-9]* samples)' "$tmp/last.out")" = 2 ] \
    || fail "--attach --count 2: two scrapes expected: $(cat "$tmp/last.out")"
  expect_in "$tmp/last.out" "^reactor +provider +open +accepted"
  expect_in "$tmp/last.out" "^connections: 3 \(the 3 busiest\)"
  expect_in "$tmp/last.out" "^0 +[0-9]+ +127\.0\.0\.1 +open +[1-9][0-9]* +[1-9][0-9]*"
  # tcp keeps RNR counters, not transport retries or asynchronous events
  expect_in "$tmp/last.out" "^device \(reactor 0\): rnr_naks_sent [0-9]+ rnr_naks_received [0-9]+ rnr_retry_exceeded [0-9]+$"
  wait $cpid || fail "threads $threads: the client failed: $(cat "$tmp/c.err")"
  sent=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["messages"])' "$tmp/c.out")
  # The client's connections go away with it; what the server counted stays in the reactor totals.
  for _ in $(seq 1 100); do
    scrape "$M" "$tmp/after.txt"
    [ "$(total "$tmp/after.txt" anydoor_connections_open)" = 0 ] && break
    sleep 0.1
  done
  [ "$(total "$tmp/after.txt" anydoor_connections_accepted_total)" = 3 ] || fail "threads $threads: accepted"
  [ "$(total "$tmp/after.txt" anydoor_connections_open)" = 0 ] || fail "threads $threads: still open after the client"
  [ "$sent" -gt 0 ] || fail "the client sent nothing"
  pass "--threads $threads: /metrics is valid Prometheus text, counts the open connections and their traffic; --attach prints it"

  # Hostile and broken clients: each refused, the endpoint keeps serving.
  python3 - "$M" <<'PY' || fail "threads $threads: bad requests"
import socket, sys, time
port = int(sys.argv[1])
def ask(raw, want):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(raw)
    got = b""
    while True:
        b = s.recv(65536)
        if not b:
            break
        got += b
    s.close()
    assert got.split(b"\r\n")[0].startswith(want) or (want == b"" and got == b""), (raw[:40], got[:80])
ask(b"GET /other HTTP/1.1\r\n\r\n", b"HTTP/1.1 404")
ask(b"POST /metrics HTTP/1.1\r\n\r\n", b"HTTP/1.1 405")
ask(b"garbage\r\n\r\n", b"HTTP/1.1 400")
ask(b"GET /" + b"x" * 9000 + b"\r\n\r\n", b"HTTP/1.1 431")
# A client that says nothing is cut off within the 5 s limit.
s = socket.create_connection(("127.0.0.1", port), timeout=15)
t0 = time.time()
assert s.recv(10) == b""
assert 3 < time.time() - t0 < 10, time.time() - t0
# 20 silent clients (the limit is 16): the surplus are closed at once.
idle = [socket.create_connection(("127.0.0.1", port), timeout=15) for _ in range(20)]
for c in idle:
    c.setblocking(False)
shut = set()
deadline = time.time() + 3  # (well inside the 5 s limit the others get)
while len(shut) < 4 and time.time() < deadline:
    for i, c in enumerate(idle):
        if i in shut:
            continue
        try:
            if c.recv(10) == b"":
                shut.add(i)
        except BlockingIOError:
            pass
    time.sleep(0.05)
assert len(shut) >= 4, len(shut)
for c in idle:
    c.close()
PY
  # (the closed idle clients free their places as the server reads their EOF)
  for _ in $(seq 1 50); do
    curl_ok=$(python3 -c 'import sys,urllib.request; print(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5).status)' "$M" 2>/dev/null)
    [ "$curl_ok" = 200 ] && break
    sleep 0.1
  done
  scrape "$M" "$tmp/again.txt"
  pass "--threads $threads: 404, 405, 400, 431, a silent client cut off, surplus clients closed; still serving"
  stop_ok() {
    kill -TERM "$1"
    timeout 20 tail --pid="$1" -f /dev/null || fail "did not exit within 20 s of SIGTERM"
    wait "$1"; [ $? = 0 ] || fail "exit code after SIGTERM"
  }
  pid_var=PID_m$threads
  stop_ok "${!pid_var}"
done

run_cmd 1 "$doctor" --attach 127.0.0.1:1 --count 1
expect_in "$tmp/last.err" "^anydoor-doctor: --attach 127.0.0.1:1: "
run_cmd 2 "$doctor" --attach nowhere
expect_in "$tmp/last.err" "--attach takes HOST:PORT"
run_cmd 2 "$doctor" --attach 127.0.0.1:1 --interval 0
expect_in "$tmp/last.err" "--interval takes"
run_cmd 2 "$echo_bin" server --listen 127.0.0.1:0 --metrics-listen nope
expect_in "$tmp/last.err" "takes HOST:PORT"
pass "--attach to nothing exits 1 with the reason; bad --attach, --interval, --metrics-listen exit 2"
echo "metrics: all passed"
