#!/bin/bash
# Runs INSIDE the rxe guest (cwd = the share, binaries in bin/): brings up
# Soft-RoCE on eth0, runs the verbs tests and the provider conformance suite
# with provider=verbs, and (when the file `bench` says 1) the perftest
# comparison. Exit code: the number of failed suites.
set -u
IP=10.0.2.15
IP2=10.0.3.15  # a second address (and so a second RoCE v2 GID) for the GID tests
fail=0
suite() {  # suite NAME CMD...
  local name=$1; shift
  echo; echo "=== [$name] $*"
  local t0=$(date +%s.%N)
  timeout 600 "$@"; local rc=$?
  echo "=== [$name] rc=$rc ($(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}") s)"
  [ $rc -eq 0 ] || fail=$((fail + 1))
}
modprobe -a rdma_rxe ib_uverbs rdma_ucm || { echo "cannot load rdma_rxe"; exit 100; }
ip addr add $IP/24 dev eth0 && ip addr add $IP2/24 dev eth0 && ip link set eth0 up
rdma link add rxe0 type rxe netdev eth0 || { echo "cannot create rxe0"; exit 101; }
ulimit -l unlimited
rdma link show
export ANYDOOR_TEST_HOST=$IP ANYDOOR_TEST_HOST2=$IP2 ANYDOOR_TEST_PROVIDER=verbs ANYDOOR_LOG=$(cat log-level 2>/dev/null || echo warn)
filter=$(cat filter 2>/dev/null)
# --warn NoTests: a spec that matches nothing fails instead of passing.
# The filters `kv` and `doctor` run only that suite (below).
if [ "$filter" != kv ] && [ "$filter" != doctor ]; then
  suite verbs-tests bin/anydoor-verbs-tests --warn NoTests ${filter:+"$filter"}
  suite conformance bin/anydoor-conformance --warn NoTests ${filter:+"$filter"}
  suite runtime bin/anydoor-runtime-tests --warn NoTests ${filter:+"$filter"}
  suite onesided bin/anydoor-onesided-tests --warn NoTests ${filter:+"$filter"}
  suite rpc bin/anydoor-rpc-tests --warn NoTests ${filter:+"$filter"}
fi
if [ -x bin/anydoor-kv-server ] && { [ -z "$filter" ] || [ "$filter" = kv ]; }; then
  suite kv bash ./kv.sh
elif [ "$filter" = kv ]; then
  echo "=== [kv] the apps are not built (no bin/anydoor-kv-server): nothing to run"
  fail=$((fail + 1))
fi
# anydoor-doctor with rxe0 up: the device, its port, the GID anydoor uses,
# the modules and rdma_cm's route to our own address all pass (exit 0).
doctor_check() {
  local out rc
  out=$(bin/anydoor-doctor --provider verbs --peer $IP:7471); rc=$?
  echo "$out"
  [ $rc = 0 ] || { echo "doctor: exit $rc, expected 0"; return 1; }
  local want
  for want in "^\[pass\] kernel modules: loaded: ib_core, ib_uverbs, rdma_ucm; software RDMA: rdma_rxe" \
              "^\[pass\] rdma devices: 1 found: rxe0" \
              "^\[pass\] device rxe0: InfiniBand, " \
              "^\[pass\] port rxe0/1: active, Ethernet \(RoCE\), netdev eth0" \
              "^\[pass\] gid rxe0/1: index [0-9]+ \(RoCE v2, $IP\) is the one anydoor expects rdma_cm to use" \
              "^\[pass\] peer $IP:7471: rdma_cm routes it through rxe0 port 1" \
              "^\[pass\] memlock: unlimited"; do
    echo "$out" | grep -Eq "$want" || { echo "doctor: no line matching '$want'"; return 1; }
  done
  echo "doctor: all verdicts as expected"
}
if [ -x bin/anydoor-doctor ] && { [ -z "$filter" ] || [ "$filter" = doctor ]; }; then
  export IP
  export -f doctor_check
  suite doctor bash -c doctor_check
elif [ "$filter" = doctor ]; then
  echo "=== [doctor] the apps are not built (no bin/anydoor-doctor): nothing to run"
  fail=$((fail + 1))
fi
if [ "$(cat bench 2>/dev/null)" = 1 ] && [ -x bin/anydoor-perf ]; then
  bash ./bench.sh || fail=$((fail + 1))
fi

# Soft-iWARP (siw, built for the guest kernel by build-image.sh) on the same
# netdev: rxe0 goes away so that rdma_cm resolves the address to siw0.
# iWARP lacks verbs that RoCE has (atomics, immediate data, RNR retry), so
# the suite is gated on the cases iWARP supports; the full suite runs for
# the record (its failures are listed in the log, not counted).
if [ -z "$filter" ] && modprobe siw 2>/dev/null; then
  rdma link delete rxe0
  if rdma link add siw0 type siw netdev eth0; then
    rdma link show
    export ANYDOOR_DEVICE=siw0
    # Catch2 takes one spec: names joined by commas (a comma inside a name escaped).
    suite siw-verbs-tests bin/anydoor-verbs-tests --warn NoTests \
      "verbs: opening devices,verbs: registration keeps exactly the requested access"
    # The cases iWARP supports and siw passes (the others and why: README).
    suite siw-conformance bin/anydoor-conformance --warn NoTests "$(printf '%s,' \
      "send/recv gathers on send and scatters on receive" \
      "inline send copies the payload at post time" \
      "write places data remotely and consumes no receive" \
      "requests execute and complete in order on a queue pair" \
      "a batch of requests in one post_send rings one doorbell" \
      "unsignaled requests are retired by a later signaled one" \
      "a zero-length write with no key or address succeeds and retires the unsignaled requests before it" \
      "notify fd: a completion after arm makes the fd readable" \
      "notify fd: a completion arriving between the last poll and arm is not lost" \
      "a burst larger than one progress pass completes on a queue shared by many queue pairs" \
      "a receiver that arms its queue and sleeps still acknowledges what it received" \
      "memory windows: a device without them says so" \
      "shared receive queue: queue pairs take the oldest receive from one queue and completions name the queue pair" \
      "shared receive queue: creation and posting are checked and its queue pairs refuse their own receives" \
      "shared receive queue: the limit reports once when fewer than the limit remain posted" \
      "shared receive queue: a queue pair that fails takes no posted receive with it" \
      "shared receive queue: a queue pair destroyed while filling a shared receive gives it back flushed" \
      "a receive being filled when the sender goes away completes flushed (own or shared queue)" \
      | sed 's/,$//')"
    if [ "$(cat siw-record 2>/dev/null)" = 1 ]; then
      # Every conformance case on siw, one at a time with a time limit, for
      # the record (some wait for completions iWARP never produces).
      echo; echo "=== [siw-record] every conformance case on siw"
      bin/anydoor-conformance --list-test-names-only | grep -v '^$' | while read -r name; do
        spec=${name//,/\\,}
        timeout 15 bin/anydoor-conformance --warn NoTests "$spec" > /tmp/siw-case.log 2>&1
        rc=$?
        case $rc in 0) r=PASS ;; 124) r=TIMEOUT ;; *) r=FAIL ;; esac
        echo "=== [siw-record] $r: $name"
        [ $r = FAIL ] && grep -A3 "FAILED:" /tmp/siw-case.log | head -8
      done
    fi
    unset ANYDOOR_DEVICE
  else
    echo "siw: cannot create siw0"; fail=$((fail + 1))
  fi
elif [ -z "$filter" ]; then
  echo "siw: module not in this image"; fail=$((fail + 1))
fi
echo "=== failed suites: $fail"
exit $fail
