#!/usr/bin/env bash
# One-sided operations against UCX, side by side in one run, on loopback with
# the tcp provider and UCX_TLS=tcp, busy polling, server on CPU 0 and client
# on CPU 1, REPS interleaved rounds (default 3) per size; medians of the
# per-run figures and their ratios.
#   put latency  (one-way, ping-pong of puts spinning on memory):
#                anydoor-runtime-perf --test put_lat  vs ucx_perftest -t ucp_put_lat
#   get latency  (one get, waited for):
#                anydoor-runtime-perf --test get_lat  vs ucx_perftest -t ucp_get
#   put bandwidth (a window of puts in flight):
#                anydoor-runtime-perf --test put_bw   vs ucx_perftest -t ucp_put_bw
#                and vs anydoor-tcp-floor --test stream (plain TCP streaming
#                the same sizes, busy-polled: the floor for a TCP transport)
# Sizes 8 B to 4 MiB (SIZES overrides); ucx_perftest's MB/s (2^20) is
# converted to 10^6 bytes per second like ours.
#   bench/compare-onesided.sh [BUILD_DIR]   (ucx_perftest from scripts/setup --bench)
# JSON=FILE also appends the medians to FILE, one object per tool, test and
# size (anydoor-perf --json's keys, with iters and runs): tools
# anydoor-runtime (anydoor-runtime-perf), ucx and tcp-floor; tests put_lat and
# get_lat (t_typical_us: the median, one way for put_lat, the whole get for
# get_lat), write_bw (put bandwidth, bw_avg_MBps, as compare-peers.sh names
# ucp_put_bw) and, for the floor's stream, send_bw.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
rperf=$build/bin/anydoor-runtime-perf
floor=$build/bin/anydoor-tcp-floor
REPS=${REPS:-3}
SIZES=${SIZES:-"8 64 4096 65536 1048576 4194304"}
port=$((10000 + RANDOM % 20000))  # below the ephemeral range (32768-60999): no clash with a connection's own port
export ANYDOOR_POLL=busy ANYDOOR_LOG=warn

# shellcheck source=lib.sh
source "$root/bench/lib.sh"
require_tools compare-onesided "$rperf" "$floor" ucx_perftest taskset

iters() {  # fewer iterations for large transfers
  local s=$1 base=$2
  if ((s >= 1048576)); then echo $((base / 20)); elif ((s >= 65536)); then echo $((base / 4)); else echo "$base"; fi
}
ours() {  # ours TEST SIZE N -> the client's RESULT line
  pair "$rperf --server --port PORT --provider tcp --test $1 -s $2 -n $3" \
       "$rperf --connect 127.0.0.1 --port PORT --provider tcp --test $1 -s $2 -n $3"
}
ucx() {  # ucx TEST SIZE N -> the client's Final line
  pair "env UCX_TLS=tcp ucx_perftest -p PORT" "env UCX_TLS=tcp ucx_perftest 127.0.0.1 -p PORT -t $1 -s $2 -n $3" |
    awk '$1 == "Final:"'
}

declare -A r
for s in $SIZES; do
  for ((k = 1; k <= REPS; k++)); do
    echo "size $s round $k/$REPS" >&2
    n=$(iters "$s" 5000)
    r[put_lat_$s]+="$(ours put_lat "$s" "$n" | sed -n 's/.*median_us=\([0-9.]*\).*/\1/p') "
    r[ucx_put_lat_$s]+="$(ucx ucp_put_lat "$s" "$n" | awk '{print $3}') "
    n=$(iters "$s" 2000)
    r[get_lat_$s]+="$(ours get_lat "$s" "$n" | sed -n 's/.*median_us=\([0-9.]*\).*/\1/p') "
    r[ucx_get_lat_$s]+="$(ucx ucp_get "$s" "$n" | awk '{print $3}') "
    n=$(iters "$s" 20000)
    r[put_bw_$s]+="$(ours put_bw "$s" "$n" | sed -n 's/.*MBps=\([0-9.]*\).*/\1/p') "
    r[ucx_put_bw_$s]+="$(ucx ucp_put_bw "$s" "$n" | awk '{printf "%.1f", $7 * 1.048576}') "
    r[floor_bw_$s]+="$(pair "$floor --server --port PORT --test stream -s $s -n $n" \
                            "$floor --connect 127.0.0.1 --port PORT --test stream -s $s -n $n" |
                       sed -n 's/.*MBps=\([0-9.]*\).*/\1/p') "
  done
done

m() { tr ' ' '\n' <<<"${r[$1]}" | grep -v '^$' | median; }
echo
echo "runs per tool and size: $REPS (tcp provider vs UCX_TLS=tcp, loopback)"
printf '%-9s | %-28s | %-28s | %-28s | %-28s\n' size "put latency us (ours/ucx)" "get latency us (ours/ucx)" \
  "put MB/s (ours/ucx)" "put MB/s (ours/TCP floor)"
for s in $SIZES; do
  pl=$(m "put_lat_$s"); upl=$(m "ucx_put_lat_$s"); gl=$(m "get_lat_$s"); ugl=$(m "ucx_get_lat_$s")
  pb=$(m "put_bw_$s"); upb=$(m "ucx_put_bw_$s"); fb=$(m "floor_bw_$s")
  ratio() { awk -v a="$1" -v b="$2" 'BEGIN {if (b + 0 == 0) print "nan"; else printf "%.2f", a / b}'; }
  printf '%-9s | %8s %8s ratio %5s | %8s %8s ratio %5s | %8s %8s ratio %5s | %8s %8s ratio %5s\n' "$s" \
    "$pl" "$upl" "$(ratio "$pl" "$upl")" "$gl" "$ugl" "$(ratio "$gl" "$ugl")" "$pb" "$upb" "$(ratio "$pb" "$upb")" \
    "$pb" "$fb" "$(ratio "$pb" "$fb")"
done
echo "(latency ratio below 1 and bandwidth ratio above 1: anydoor faster)"
if [[ -n "${JSON:-}" ]]; then
  for s in $SIZES; do
    n=$(iters "$s" 5000)
    json_line "$JSON" anydoor-runtime put_lat "$s" "t_typical_us=$(m "put_lat_$s")" "iters=$n" "runs=$REPS"
    json_line "$JSON" ucx put_lat "$s" "t_typical_us=$(m "ucx_put_lat_$s")" "iters=$n" "runs=$REPS"
    n=$(iters "$s" 2000)
    json_line "$JSON" anydoor-runtime get_lat "$s" "t_typical_us=$(m "get_lat_$s")" "iters=$n" "runs=$REPS"
    json_line "$JSON" ucx get_lat "$s" "t_typical_us=$(m "ucx_get_lat_$s")" "iters=$n" "runs=$REPS"
    n=$(iters "$s" 20000)
    json_line "$JSON" anydoor-runtime write_bw "$s" "bw_avg_MBps=$(m "put_bw_$s")" "iters=$n" "runs=$REPS"
    json_line "$JSON" ucx write_bw "$s" "bw_avg_MBps=$(m "ucx_put_bw_$s")" "iters=$n" "runs=$REPS"
    json_line "$JSON" tcp-floor send_bw "$s" "bw_avg_MBps=$(m "floor_bw_$s")" "iters=$n" "runs=$REPS"
  done
  echo "compare-onesided: medians appended to $JSON"
fi
