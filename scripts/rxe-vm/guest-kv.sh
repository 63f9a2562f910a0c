#!/bin/bash
# Runs INSIDE the rxe guest after guest-tests.sh set up rxe0: the key-value
# app on the verbs provider. put / get / get by one-sided READ / del, a
# value above the eager limit, a restart from the log, one-sided GETs
# racing PUTs of the same keys (every value read checked), then GET by READ
# against GET by RPC (1 in flight): latency, and the server's CPU time per
# GET (utime + stime from /proc, 10 ms ticks): a READ is served by the
# device, so the server should spend nearly nothing on it.
# Exit code 0 when everything held.
set -u
IP=10.0.2.15
D=${KV_SECONDS:-3}
fail() { echo "kv: FAIL: $*"; kill -KILL "${spid:-0}" 2>/dev/null; exit 1; }
start() {
  bin/anydoor-kv-server --listen $IP:0 --provider verbs --data-dir /tmp/kvdata --sync always >/tmp/kv.out 2>/tmp/kv.err &
  spid=$!
  for _ in $(seq 1 200); do
    port=$(sed -n 's/.*listening on [^ ]*:\([0-9][0-9]*\).*/\1/p' /tmp/kv.out)
    [ -n "$port" ] && return 0
    sleep 0.1
  done
  cat /tmp/kv.out /tmp/kv.err
  fail "the server did not start"
}
cpu_ticks() { awk '{print $14, $15}' "/proc/$spid/stat"; }  # utime stime
field() { sed -n "s/.*\"$2\":\"\{0,1\}\([^,\"}]*\).*/\1/p" "$1"; }  # one key of a one-line JSON object (no python3 in the guest)

rm -rf /tmp/kvdata
start
grep -q "provider verbs" /tmp/kv.out || fail "the server is not on verbs: $(cat /tmp/kv.out)"
K="bin/anydoor-kv --connect $IP:$port --provider verbs"
$K put greeting hello >/dev/null || fail "put"
[ "$($K get greeting)" = hello ] || fail "get by rpc"
[ "$($K get greeting --get read)" = hello ] || fail "get by read"
big=$(head -c 20000 /dev/zero | tr '\0' b)
$K put big "$big" >/dev/null || fail "put 20000 B"
[ "$($K get big --get read)" = "$big" ] || fail "get 20000 B by read"
$K get nothing --get read >/dev/null; [ $? = 1 ] || fail "a missing key by read"
kill -KILL $spid; wait $spid 2>/dev/null
start
K="bin/anydoor-kv --connect $IP:$port --provider verbs"
[ "$($K get big --get read)" = "$big" ] || fail "get after kill -9 and restart"
echo "kv: put, get (rpc, read), 20000 B by read, kill -9 and restart: ok"

$K bench --keys 20 --workload a --duration $D --in-flight 4 --json >/tmp/w.json 2>/tmp/w.err &
wpid=$!
$K bench --keys 20 --workload a --get read --duration $D --in-flight 4 --json >/tmp/r.json 2>/tmp/r.err ||
  fail "the racing reader: $(cat /tmp/r.err)"
wait $wpid || fail "the racing writer: $(cat /tmp/w.err)"
echo "kv: one-sided GETs racing PUTs on verbs: ok ($(field /tmp/r.json get_ops) gets, $(field /tmp/r.json read_retries) retries, $(field /tmp/r.json read_fallbacks) by rpc, $(field /tmp/r.json read_ahead) items READ ahead, $(field /tmp/r.json read_ahead_hits) taken)"
[ "$(field /tmp/r.json read_hits)" -gt 0 ] || fail "no GET went by READ"
[ "$(field /tmp/r.json read_ahead)" -gt 0 ] || fail "no item was READ beside its neighbourhood (location cache)"
# 16-byte values live inline in their slots (the in-place slot path).
$K bench --keys 20 --value-size 16 --workload a --duration $D --in-flight 4 --json >/tmp/w.json 2>/tmp/w.err &
wpid=$!
$K bench --keys 20 --value-size 16 --workload a --get read --duration $D --in-flight 4 --json >/tmp/r.json 2>/tmp/r.err ||
  fail "the racing reader (inline values): $(cat /tmp/r.err)"
wait $wpid || fail "the racing writer (inline values): $(cat /tmp/w.err)"
[ "$(field /tmp/r.json read_hits)" -gt 0 ] || fail "no GET of an inline value went by READ"
echo "kv: one-sided GETs racing PUTs of inline values on verbs: ok ($(field /tmp/r.json get_ops) gets, $(field /tmp/r.json read_retries) retries, $(field /tmp/r.json read_fallbacks) by rpc)"

for how in rpc read; do
  read -r u0 s0 <<<"$(cpu_ticks)"
  $K bench --keys 1000 --workload c --get $how --duration $D --in-flight 1 --json >/tmp/$how.json 2>/tmp/$how.err ||
    fail "bench --get $how: $(cat /tmp/$how.err)"
  read -r u1 s1 <<<"$(cpu_ticks)"
  gets=$(field /tmp/$how.json get_ops)
  p50=$(field /tmp/$how.json get_p50_us)
  per() { awk -v t="$1" -v hz="$(getconf CLK_TCK)" -v n="$gets" 'BEGIN{printf "%.2f", t / hz * 1e6 / n}'; }
  user_us=$(per $((u1 - u0))); sys_us=$(per $((s1 - s0))); cpu_us=$(per $((u1 - u0 + s1 - s0)))
  echo "RESULT kv_get how=$how gets=$gets p50_us=$p50 server_cpu_us_per_get=$cpu_us user_us=$user_us sys_us=$sys_us"
  eval "p50_$how=$p50 cpu_$how=$cpu_us user_$how=$user_us sys_$how=$sys_us"
done
echo "kv: GET by READ / GET by RPC, p50 latency: $(awk -v a="$p50_read" -v b="$p50_rpc" 'BEGIN{printf "%.2f", a / b}')"
echo "kv: server CPU per GET: by READ $cpu_read us (user $user_read, system $sys_read), by RPC $cpu_rpc us (user $user_rpc, system $sys_rpc)"
echo "kv: (rxe is the kernel's software RoCE: its READ responder runs in softirq, charged to whatever task it interrupts)"
kill -TERM $spid
wait $spid || fail "the server's exit code after SIGTERM"
echo "kv: all passed"
