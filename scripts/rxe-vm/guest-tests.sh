#!/bin/bash
# Runs INSIDE the rxe guest (cwd = the share, binaries in bin/): brings up
# Soft-RoCE on eth0, runs the verbs tests and the provider conformance suite
# with provider=verbs, and (when the file `bench` says 1) the perftest
# comparison. Exit code: the number of failed suites.
set -u
IP=10.0.2.15
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
ip addr add $IP/24 dev eth0 && ip link set eth0 up
rdma link add rxe0 type rxe netdev eth0 || { echo "cannot create rxe0"; exit 101; }
ulimit -l unlimited
rdma link show
export ANYDOOR_TEST_HOST=$IP ANYDOOR_TEST_PROVIDER=verbs ANYDOOR_LOG=$(cat log-level 2>/dev/null || echo warn)
filter=$(cat filter 2>/dev/null)
suite verbs-tests bin/anydoor-verbs-tests ${filter:+"$filter"}
suite conformance bin/anydoor-conformance ${filter:+"$filter"}
if [ "$(cat bench 2>/dev/null)" = 1 ] && [ -x bin/anydoor-perf ]; then
  bash ./bench.sh || fail=$((fail + 1))
fi
echo "=== failed suites: $fail"
exit $fail
