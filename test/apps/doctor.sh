#!/usr/bin/env bash
# anydoor-doctor from the command line: the verdicts on this host (no RDMA
# device here: warn with provider auto, fail with verbs, nothing needed with
# tcp), --json, exit codes, --peer, and the fail paths of memlock and of a
# GPU without a driver on made-up /proc and /sys trees.
# usage: doctor.sh BIN_DIR
source "$(dirname "$0")/lib.sh"
doctor=$1/anydoor-doctor

has_rdma=0
[ -n "$(ls /sys/class/infiniband 2>/dev/null)" ] && has_rdma=1

run_cmd 0 "$doctor" --provider tcp
expect_in "$tmp/last.out" "^\[pass\] rdma devices: provider tcp"
expect_in "$tmp/last.out" "^\[pass\] memlock: provider tcp pins no memory"
expect_in "$tmp/last.out" "^[0-9]+ pass, [0-9]+ warn, 0 fail"
grep -q "^\[fail\]" "$tmp/last.out" && fail "--provider tcp: a check failed"
pass "--provider tcp: nothing fails"

if [ $has_rdma = 0 ]; then
  run_cmd 0 "$doctor"
  expect_in "$tmp/last.out" "^\[warn\] rdma devices: no RDMA device.*provider auto will use tcp"
  expect_in "$tmp/last.out" "^       fix: install the NIC's driver .*rdma link add rxe0 type rxe"
  expect_in "$tmp/last.out" "^\[(pass|warn)\] kernel modules: "
  expect_in "$tmp/last.out" "ready, with warnings$"
  run_cmd 1 "$doctor" --provider verbs
  expect_in "$tmp/last.out" "^\[fail\] rdma devices: no RDMA device"
  expect_in "$tmp/last.out" "not ready$"
  run_cmd 0 "$doctor" --peer 127.0.0.1:7471
  expect_in "$tmp/last.out" "^\[warn\] peer 127.0.0.1:7471: .*\(provider auto will use tcp here\)"
  run_cmd 1 "$doctor" --provider verbs --peer 127.0.0.1:7471
  expect_in "$tmp/last.out" "^\[fail\] peer 127.0.0.1:7471: "
  expect_in "$tmp/last.out" "fix: the peer's address must be reachable through an RDMA device"
  pass "no RDMA device: warn with auto (exit 0), fail with verbs (exit 1), --peer likewise, each with its fix"
else
  echo "skip: this host has RDMA devices; the no-device verdicts are not checked here (the rxe VM checks the others)"
fi

# --json: one object whose verdict matches the exit code
for prov in auto verbs tcp; do
  "$doctor" --provider $prov --json >"$tmp/j.out" 2>"$tmp/j.err"; rc=$?
  python3 - "$tmp/j.out" $rc $prov <<'PY' || fail "--json --provider $prov: $(cat "$tmp/j.out")"
import json, sys
o = json.load(open(sys.argv[1]))
rc, prov = int(sys.argv[2]), sys.argv[3]
assert o["provider"] == prov, o
assert o["checks"] and all(set(c) == {"check", "verdict", "detail", "fix"} for c in o["checks"]), o
counts = {v: sum(c["verdict"] == v for c in o["checks"]) for v in ("pass", "warn", "fail")}
assert all(o[v] == counts[v] for v in counts), o
assert o["verdict"] == ("fail" if counts["fail"] else "warn" if counts["warn"] else "pass"), o
assert rc == (1 if counts["fail"] else 0), (rc, o)
assert all(c["fix"] for c in o["checks"] if c["verdict"] != "pass"), "a warn or fail without its fix"
PY
done
pass "--json: the checks, counts and verdict agree with the exit code; every warn and fail has a fix"

# Made-up /proc: a memlock limit of 64 KiB without CAP_IPC_LOCK fails.
mkdir -p "$tmp/proc/self"
cat /proc/meminfo >"$tmp/proc/meminfo"
printf 'Max locked memory         65536                65536                bytes\n' >"$tmp/proc/self/limits"
printf 'CapEff:\t0000000000000000\n' >"$tmp/proc/self/status"
run_cmd 1 "$doctor" --provider verbs --procfs "$tmp/proc" --pool-bytes 256M --register-bytes 16M
expect_in "$tmp/last.out" "^\[fail\] memlock: 64.0 KiB < 272.0 MiB \(--pool-bytes 256.0 MiB \+ --register-bytes 16.0 MiB\)"
expect_in "$tmp/last.out" "fix: raise it: ulimit -l unlimited"
if [ $has_rdma = 0 ]; then  # auto without a device runs on tcp: the limit does not matter
  "$doctor" --procfs "$tmp/proc" >"$tmp/last.out" 2>&1
  expect_in "$tmp/last.out" "^\[pass\] memlock: provider auto will use tcp here, which pins no memory \(the limit is 64.0 KiB\)"
fi
printf 'Max locked memory         unlimited            unlimited            bytes\n' >"$tmp/proc/self/limits"
"$doctor" --provider verbs --procfs "$tmp/proc" >"$tmp/last.out" 2>&1
expect_in "$tmp/last.out" "^\[pass\] memlock: unlimited"
pass "memlock: a low limit fails with its fix (unless tcp is in effect); unlimited passes"

# Made-up /sys: an NVIDIA GPU on the bus, no driver (no libcuda here): warn
# (GPU memory is optional: the GPU checks never fail).
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1'; then
  g=$tmp/sys/devices/pci0000:00/0000:00:01.0/0000:3b:00.0
  mkdir -p "$g" "$tmp/sys/bus/pci/devices" "$tmp/sys/kernel/mm/transparent_hugepage"
  echo 0x10de >"$g/vendor"; echo 0x030200 >"$g/class"
  ln -s ../../../devices/pci0000:00/0000:00:01.0/0000:3b:00.0 "$tmp/sys/bus/pci/devices/0000:3b:00.0"
  echo "always madvise [never]" >"$tmp/sys/kernel/mm/transparent_hugepage/enabled"
  printf 'HugePages_Total:       0\nHugePages_Free:        0\nHugepagesize:       2048 kB\n' >"$tmp/proc/meminfo"
  run_cmd 0 "$doctor" --provider tcp --sysfs "$tmp/sys" --procfs "$tmp/proc"
  expect_in "$tmp/last.out" "^\[warn\] gpu: 1 NVIDIA GPU\(s\) on the PCI bus but libcuda.so.1 not found"
  expect_in "$tmp/last.out" "fix: install the NVIDIA driver"
  expect_in "$tmp/last.out" "^\[warn\] hugepages: 0 reserved .*transparent hugepages: never"
  pass "a GPU on the bus without its driver warns; no hugepages and THP off warn"
  run_cmd 0 "$doctor" --provider tcp
  expect_in "$tmp/last.out" "^\[pass\] gpu: no NVIDIA GPU on the PCI bus: GPU memory checks skipped \(libcuda.so.1 not found"
  pass "no GPU: the GPU checks are skipped (pass)"
else
  echo "skip: this host has the CUDA driver; the no-driver verdicts are not checked here"
fi

# Bad command lines: exit 2 with the usage
for bad in "--provider x" "--peer nope" "--peer 1.2.3.4:0" "--pool-bytes lots" "--frobnicate"; do
  # shellcheck disable=SC2086
  run_cmd 2 "$doctor" $bad
  expect_in "$tmp/last.err" "usage: anydoor-doctor"
done
run_cmd 0 "$doctor" --help; expect_in "$tmp/last.out" "^usage: anydoor-doctor"
pass "bad options exit 2 with the usage; --help exits 0"
