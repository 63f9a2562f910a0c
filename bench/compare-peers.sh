#!/usr/bin/env bash
# Side-by-side provider-level comparison on loopback, busy-polling, all in one
# run: anydoor-perf (tcp provider) against libfabric's fi_pingpong (tcp
# provider, msg endpoints), UCX's ucx_perftest (UCX_TLS=tcp) and the floor
# under any TCP transport, anydoor-tcp-floor (plain non-blocking sockets,
# busy-polled, no framing: bench/tcp_floor.cpp).
#   64 B send/recv one-way latency: anydoor lat, fi_pingpong -S 64, ucx tag_lat -s 64, floor lat
#   64 KiB bandwidth:               anydoor write_bw, ucx ucp_put_bw -s 65536, floor stream
#   4 MiB bandwidth:                anydoor write_bw, floor stream (BW_ITERS / 64 of them, at least 100)
# Every bandwidth test reuses one buffer of the size on each side (anydoor-perf
# and the floor: --slots 1; ucx_perftest always does), so all move the same memory.
# Every tool runs REPS times (default 5), interleaved, server on CPU 0 and
# client on CPU 1; the medians of the runs and the ratios are printed.
# fi_pingpong reports only a mean per run; UCX and anydoor report a median
# per run (UCX's 50th percentile), which is what is compared. Bandwidth is
# in MB/s of 10^6 bytes for both.
#   bench/compare-peers.sh [BUILD_DIR]   (default build/; needs scripts/setup --bench)
# JSON=FILE also appends the medians to FILE, one object per tool and test
# (anydoor-perf --json's keys; scripts/plot draws such a file).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
perf=$build/bin/anydoor-perf
floor=$build/bin/anydoor-tcp-floor
REPS=${REPS:-5}
ITERS=${ITERS:-20000}
BW_ITERS=${BW_ITERS:-20000}
BIG_ITERS=$((BW_ITERS / 64 > 100 ? BW_ITERS / 64 : 100))
port=$((10000 + RANDOM % 20000))  # below the ephemeral range (32768-60999): no clash with a connection's own port

# shellcheck source=lib.sh
source "$root/bench/lib.sh"
require_tools compare-peers "$perf" "$floor" fi_pingpong ucx_perftest taskset

declare -A results
# tool KEY FIELD BIN ARGS...: BIN's server and client (BIN anydoor-perf or
# the floor, ARGS on both sides), the client's FIELD= figure added to results[KEY]
tool() {
  local key=$1 field=$2 bin=$3 out
  shift 3
  local extra=""
  [[ $bin == "$perf" ]] && extra="--provider tcp"
  out=$(pair "$bin --server --port PORT $extra $*" "$bin --connect 127.0.0.1 --port PORT $extra $*")
  results[$key]+="$(sed -n "s/.*$field=\([0-9.]*\).*/\1/p" <<<"$out") "
}
for ((r = 1; r <= REPS; r++)); do
  echo "round $r/$REPS" >&2
  tool ours_lat median_us "$perf" --test lat -n "$ITERS"
  tool floor_lat median_us "$floor" --test lat -n "$ITERS"
  out=$(pair "fi_pingpong -p tcp -e msg -S 64 -I $ITERS -B PORT" \
             "fi_pingpong -p tcp -e msg -S 64 -I $ITERS -P PORT 127.0.0.1")
  results[fi_lat]+="$(awk '$1 == "64" {print $7}' <<<"$out") "
  out=$(pair "env UCX_TLS=tcp ucx_perftest -p PORT" \
             "env UCX_TLS=tcp ucx_perftest 127.0.0.1 -p PORT -t tag_lat -s 64 -n $ITERS")
  results[ucx_lat]+="$(awk '$1 == "Final:" {print $3}' <<<"$out") "
  # (the server of anydoor-perf takes --slots and follows its client)
  tool ours_bw MBps "$perf" --test write_bw -s 65536 -n "$BW_ITERS" --slots 1
  tool floor_bw MBps "$floor" --test stream -s 65536 -n "$BW_ITERS"
  tool ours_big MBps "$perf" --test write_bw -s 4194304 -n "$BIG_ITERS" --slots 1
  tool floor_big MBps "$floor" --test stream -s 4194304 -n "$BIG_ITERS"
  out=$(pair "env UCX_TLS=tcp ucx_perftest -p PORT" \
             "env UCX_TLS=tcp ucx_perftest 127.0.0.1 -p PORT -t ucp_put_bw -s 65536 -n $BW_ITERS")
  # ucx_perftest's MB is 2^20 bytes; converted to 10^6 like anydoor-perf's
  results[ucx_bw]+="$(awk '$1 == "Final:" {printf "%.1f", $6 * 1.048576}' <<<"$out") "
done

m() { tr ' ' '\n' <<<"${results[$1]}" | grep -v '^$' | median; }
ours_lat=$(m ours_lat); fi_lat=$(m fi_lat); ucx_lat=$(m ucx_lat); floor_lat=$(m floor_lat)
ours_bw=$(m ours_bw); ucx_bw=$(m ucx_bw); floor_bw=$(m floor_bw); ours_big=$(m ours_big); floor_big=$(m floor_big)
echo
echo "runs per tool: $REPS (latency $ITERS round trips, bandwidth $BW_ITERS x 64 KiB and $BIG_ITERS x 4 MiB)"
for k in ours_lat fi_lat ucx_lat floor_lat ours_bw ucx_bw floor_bw ours_big floor_big; do printf '  %-9s %s\n' "$k" "${results[$k]}"; done
echo
printf '64 B one-way latency (us, median of runs): anydoor %s | fi_pingpong tcp %s | UCX tcp %s | TCP floor %s\n' \
  "$ours_lat" "$fi_lat" "$ucx_lat" "$floor_lat"
awk -v o="$ours_lat" -v f="$fi_lat" -v u="$ucx_lat" -v t="$floor_lat" \
  'BEGIN {printf "  ratio anydoor/fi_pingpong = %.2f, anydoor/UCX = %.2f, anydoor/floor = %.2f (below 1: anydoor faster)\n", o/f, o/u, o/t}'
printf '64 KiB write bandwidth (MB/s, median of runs): anydoor %s | UCX tcp put_bw %s | TCP floor stream %s\n' \
  "$ours_bw" "$ucx_bw" "$floor_bw"
awk -v o="$ours_bw" -v u="$ucx_bw" -v t="$floor_bw" \
  'BEGIN {printf "  ratio anydoor/UCX = %.2f, anydoor/floor = %.2f (above 1: anydoor faster)\n", o/u, o/t}'
printf '4 MiB write bandwidth (MB/s, median of runs): anydoor %s | TCP floor stream %s\n' "$ours_big" "$floor_big"
awk -v o="$ours_big" -v t="$floor_big" 'BEGIN {printf "  ratio anydoor/floor = %.2f (above 1: anydoor faster)\n", o/t}'
r() { round_ratios "${results[$1]}" "${results[$2]}"; }
printf '  per-round ratios (median of the rounds'"'"' ratios; each round runs every tool back to back):\n'
printf '    latency anydoor/floor %s, anydoor/UCX %s; 64 KiB anydoor/floor %s; 4 MiB anydoor/floor %s\n' \
  "$(r ours_lat floor_lat)" "$(r ours_lat ucx_lat)" "$(r ours_bw floor_bw)" "$(r ours_big floor_big)"
if [[ -n "${JSON:-}" ]]; then
  json_line "$JSON" anydoor lat 64 "t_typical_us=$ours_lat" "runs=$REPS"
  json_line "$JSON" libfabric lat 64 "t_avg_us=$fi_lat" "runs=$REPS"
  json_line "$JSON" ucx lat 64 "t_typical_us=$ucx_lat" "runs=$REPS"
  json_line "$JSON" tcp-floor lat 64 "t_typical_us=$floor_lat" "runs=$REPS"
  json_line "$JSON" anydoor write_bw 65536 "bw_avg_MBps=$ours_bw" "runs=$REPS"
  json_line "$JSON" ucx write_bw 65536 "bw_avg_MBps=$ucx_bw" "runs=$REPS"
  json_line "$JSON" tcp-floor send_bw 65536 "bw_avg_MBps=$floor_bw" "runs=$REPS"
  json_line "$JSON" anydoor write_bw 4194304 "bw_avg_MBps=$ours_big" "runs=$REPS"
  json_line "$JSON" tcp-floor send_bw 4194304 "bw_avg_MBps=$floor_big" "runs=$REPS"
  echo "compare-peers: medians appended to $JSON"
fi
