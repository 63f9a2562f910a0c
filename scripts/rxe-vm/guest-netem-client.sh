#!/bin/bash
# Runs INSIDE the client guest of run-netem: rdma_rxe on eth1 (10.77.0.2),
# netem on both directions of eth1 (egress directly, ingress through ifb0),
# one anydoor-netem-check run per impairment. Exit: failed scenarios.
# (Not here: delay with jitter as large as the delay, "delay 2ms 2ms". It
# reorders nearly every packet, and rxe's go-back-N then retransmits
# without end: 486 of 600 operations in 240 s, the rest never; a real
# fabric does not reorder like that within one flow.)
set -u
modprobe -a rdma_rxe ib_uverbs rdma_ucm sch_netem sch_prio ifb act_mirred act_gact cls_u32 sch_ingress || { echo "cannot load modules"; exit 100; }
ip link set lo up
ip addr add 10.77.0.2/24 dev eth1 && ip link set eth1 up || { echo "no eth1"; exit 101; }
rdma link add rxe0 type rxe netdev eth1 || { echo "cannot create rxe0"; exit 102; }
ip link add ifb0 type ifb 2>/dev/null; ip link set ifb0 up
tc qdisc add dev eth1 handle ffff: ingress
tc filter add dev eth1 parent ffff: protocol all u32 match u32 0 0 action mirred egress redirect dev ifb0
ulimit -l unlimited
export ANYDOOR_LOG=warn ANYDOOR_PROVIDER=verbs
ops=$(cat ops 2>/dev/null || echo 600)
only=$(cat only 2>/dev/null || true)  # NETEM_ONLY of run-netem: a regular expression over the scenario names
ran=0
wanted() { { [ -z "$only" ] || [[ "$1" =~ $only ]]; } && ran=$((ran + 1)); }
server=10.77.0.1:7300
for i in $(seq 1 120); do ping -c1 -W1 10.77.0.1 >/dev/null 2>&1 && break; sleep 1; done
ping -c1 -W1 10.77.0.1 >/dev/null || { echo "the server guest is unreachable on the link"; exit 103; }

counters() {  # rxe's counters that show retransmission work
  local d=/sys/class/infiniband/rxe0/ports/1/hw_counters
  for c in sent_pkts rcvd_pkts duplicate_request out_of_seq_request rcvd_seq_err ack_deferred retry_exceeded_err completer_retry_err; do
    printf '%s=%s ' "$c" "$(cat $d/$c 2>/dev/null || echo ?)"
  done
}
impair() {  # impair NETEM-ARGS...: the same rule on both directions
  if [ "$*" = none ]; then
    tc qdisc del dev eth1 root 2>/dev/null; tc qdisc del dev ifb0 root 2>/dev/null; return 0
  fi
  tc qdisc replace dev eth1 root netem "$@" && tc qdisc replace dev ifb0 root netem "$@"
}
fail=0
scenario() {  # scenario NAME NETEM-ARGS...
  local name=$1; shift
  wanted "$name" || return 0
  impair "$@" || { echo "netem: cannot apply '$*'"; fail=$((fail + 1)); return; }
  echo; echo "=== $name (netem: $*)"
  echo "rxe before: $(counters)"
  timeout 300 bin/anydoor-netem-check --connect $server --label "$name" --ops "$ops" --deadline 240 || fail=$((fail + 1))
  echo "rxe after:  $(counters)"
}
scenario baseline none
scenario loss-1pct loss 1%
scenario loss-5pct loss 5%
scenario delay-5ms delay 5ms
scenario duplicate-5pct duplicate 5%
scenario reorder delay 2ms reorder 25% 50%
scenario corrupt-1pct corrupt 1%
scenario mixed loss 1% duplicate 1% delay 1ms
impair none
# rdma_cm's RTU lost: every RTU this guest sends (a CM MAD to QP 1: UDP
# 4791, BTH destination QP 1, management class 7, attribute 0x0014) is
# dropped on its way out, resends included. The listener's accept learns
# that we are connected only from our first message (rdma_notify); without
# that it gives up after its 2 s handshake timeout and we wait for a region
# that never comes.
if ! wanted rtu-lost; then :
else
echo; echo "=== rtu-lost (every CM RTU from the client dropped)"
echo "rxe before: $(counters)"
if tc qdisc replace dev eth1 root handle 1: prio &&
   tc filter add dev eth1 parent 1: protocol ip prio 1 u32 match ip protocol 17 0xff match u16 4791 0xffff at 22 \
     match u32 1 0x00ffffff at 32 match u8 0x07 0xff at 49 match u16 0x0014 0xffff at 64 action drop; then
  timeout 300 bin/anydoor-netem-check --connect $server --label rtu-lost --ops 50 --deadline 60 || fail=$((fail + 1))
  dropped=$(tc -s filter show dev eth1 parent 1: | grep -o 'dropped [0-9]*' | head -1 | cut -d' ' -f2)
  echo "rtu-lost: RTUs dropped: ${dropped:-none}"
  # No RTU dropped: the filter matched nothing and the scenario proved nothing.
  [ "${dropped:-0}" -ge 1 ] || { echo "rtu-lost: verdict=fail (the filter dropped no RTU)"; fail=$((fail + 1)); }
else
  echo "netem: cannot install the RTU filter"; fail=$((fail + 1))
fi
echo "rxe after:  $(counters)"
impair none
fi
# A stale duplicate READ after the FIN: the server's RDMA READ requests
# (BTH opcode 0x0c) reach this guest 90 ms late, longer than the
# requester's ack timeout (67 ms), so its NIC sends each READ again; the
# first answer completes the READ and the server's FIN arrives while the
# resent request is still on its way. Our NIC executes it again with the
# key checked anew: the source's registration must still be there
# (fabric_options::late_read_grace), or our queue pair goes to error.
if wanted late-read; then
echo; echo "=== late-read (the server's READ requests delayed 90 ms on their way in; nothing else)"
echo "rxe before: $(counters)"
if tc qdisc replace dev ifb0 root handle 1: prio &&
   tc qdisc add dev ifb0 parent 1:1 handle 10: netem delay 90ms &&
   tc filter add dev ifb0 parent 1: protocol ip prio 1 u32 match ip protocol 17 0xff match u16 4791 0xffff at 22 \
     match u8 0x0c 0xff at 28 flowid 1:1; then
  dups=$(cat /sys/class/infiniband/rxe0/ports/1/hw_counters/duplicate_request 2>/dev/null || echo 0)
  timeout 300 bin/anydoor-netem-check --connect $server --label late-read --ops 100 --deadline 120 || fail=$((fail + 1))
  delayed=$(tc -s qdisc show dev ifb0 | awk '/qdisc netem 10:/{getline; print $4}')
  dups=$(( $(cat /sys/class/infiniband/rxe0/ports/1/hw_counters/duplicate_request 2>/dev/null || echo 0) - dups ))
  echo "late-read: READ requests delayed: ${delayed:-none}, duplicate requests executed here: $dups"
  # Nothing delayed, or no duplicate came: the scenario proved nothing.
  [ "${delayed:-0}" -ge 1 ] || { echo "late-read: verdict=fail (no READ request was delayed)"; fail=$((fail + 1)); }
  [ "$dups" -ge 1 ] || { echo "late-read: verdict=fail (no duplicate request reached this side)"; fail=$((fail + 1)); }
else
  echo "netem: cannot install the READ delay"; fail=$((fail + 1))
fi
echo "rxe after:  $(counters)"
impair none
fi
if wanted total-loss; then
echo; echo "=== total-loss (netem loss 100% after connecting)"
echo "rxe before: $(counters)"
# rxe (Linux 6.1) keeps retransmitting past the queue pair's retry count
# (7) under total loss, so the connection's keepalive (2 s here) is what
# ends the operations: all of them must have failed within 5 s.
timeout 300 bin/anydoor-netem-check --connect $server --label total-loss --ops 50 --window 8 --expect fail --deadline 60 \
  --keepalive 2000 --max-error-ms 5000 \
  --after-connect "tc qdisc replace dev eth1 root netem loss 100% && tc qdisc replace dev ifb0 root netem loss 100%" \
  || fail=$((fail + 1))
echo "rxe after:  $(counters)"
impair none
fi
bin/anydoor-netem-check --connect $server --quit >/dev/null || echo "could not stop the server"
[ "$ran" -gt 0 ] || { echo "netem: no scenario matches '$only'"; fail=$((fail + 1)); }
echo; echo "=== scenarios run: $ran, failed: $fail"
exit $fail
