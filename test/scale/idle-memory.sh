#!/bin/sh
# Memory per idle connection end, without the fixed costs: anydoor-scale
# opens N and then 2N connections (in two runs, both ends in the process)
# and the difference in resident memory with all of them open and idle is
# divided by the 2N ends it adds. Fails when that is above LIMIT KiB.
# usage: idle-memory.sh ANYDOOR_SCALE LIMIT_KIB N [anydoor-scale options...]
# Exit: 0 within the limit, 1 above it or without a result, anydoor-scale's
# own code when it fails (77: skipped, e.g. the descriptor limit).
set -u
if [ $# -lt 3 ]; then
  echo "usage: idle-memory.sh ANYDOOR_SCALE LIMIT_KIB N [anydoor-scale options...]" >&2
  exit 2
fi
scale=$1 limit=$2 n=$3
shift 3
run() {
  count=$1
  shift
  out=$("$scale" --connections "$count" "$@" 2>&1)
  rc=$?
  if [ $rc -ne 0 ]; then
    printf '%s\n' "$out" >&2
    echo "idle-memory: anydoor-scale --connections $count exited $rc" >&2
    exit $rc
  fi
  printf '%s\n' "$out" | grep '^scale: connections=' >&2
  printf '%s\n' "$out" | sed -n 's/.* rss_idle_kib=\([0-9][0-9]*\) .*/\1/p' | tail -n 1
}
a=$(run "$n" "$@") || exit $?
b=$(run "$((2 * n))" "$@") || exit $?
if [ -z "$a" ] || [ -z "$b" ]; then
  echo "idle-memory: no rss_idle_kib in anydoor-scale's result line" >&2
  exit 1
fi
per=$(awk -v a="$a" -v b="$b" -v n="$n" 'BEGIN { printf "%.3f", (b - a) / (2 * n) }')
echo "idle-memory: rss_idle_kib=$a at $n connections, $b at $((2 * n)): kib_per_idle_connection_end=$per (limit $limit)"
awk -v p="$per" -v l="$limit" 'BEGIN { exit !(p <= l) }' || {
  echo "idle-memory: FAIL: $per KiB per idle connection end is above $limit" >&2
  exit 1
}
