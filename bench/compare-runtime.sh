#!/usr/bin/env bash
# The runtime against the raw provider and UCX, side by side in one run, on
# loopback with the tcp provider, busy polling, server on CPU 0 and client on
# CPU 1, REPS interleaved rounds (default 5); medians of the per-run figures.
#   64 B echo one-way latency: anydoor-runtime-perf echo (fabric + connection
#     + coroutines: co_await send, co_await receive) vs anydoor-perf lat (the
#     raw provider ping-pong, no runtime): the runtime's overhead
#   64 B message rate, 64 in flight: anydoor-runtime-perf msg_rate (credits 64)
#     vs ucx_perftest -t tag_bw -s 64 (UCX_TLS=tcp; its default window)
#   bench/compare-runtime.sh [BUILD_DIR]   (default build/; ucx_perftest from scripts/setup --bench)
# JSON=FILE also appends the medians to FILE, one object per tool and test
# (anydoor-perf --json's keys, with iters and runs): anydoor lat (anydoor-perf,
# the raw provider) and anydoor-runtime lat (the runtime's echo), 64 B,
# t_typical_us one way; anydoor-runtime msg_rate (msg_rate_Mpps, window,
# and the posts and doorbells of a run) and ucx msg_rate (tag_bw).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
perf=$build/bin/anydoor-perf
rperf=$build/bin/anydoor-runtime-perf
REPS=${REPS:-5}
ITERS=${ITERS:-20000}
MSGS=${MSGS:-200000}
port=$((10000 + RANDOM % 20000))  # below the ephemeral range (32768-60999): no clash with a connection's own port
export ANYDOOR_POLL=busy ANYDOOR_LOG=warn

# shellcheck source=lib.sh
source "$root/bench/lib.sh"
require_tools compare-runtime "$perf" "$rperf" ucx_perftest taskset

declare -A results
for ((r = 1; r <= REPS; r++)); do
  echo "round $r/$REPS" >&2
  out=$(pair "$perf --server --port PORT --provider tcp --test lat -n $ITERS" \
             "$perf --connect 127.0.0.1 --port PORT --provider tcp --test lat -n $ITERS")
  results[raw_lat]+="$(sed -n 's/.*median_us=\([0-9.]*\).*/\1/p' <<<"$out") "
  out=$(pair "$rperf --server --port PORT --provider tcp --test echo -n $ITERS" \
             "$rperf --connect 127.0.0.1 --port PORT --provider tcp --test echo -n $ITERS")
  results[echo_lat]+="$(sed -n 's/.*median_us=\([0-9.]*\).*/\1/p' <<<"$out") "
  out=$(pair "$rperf --server --port PORT --provider tcp --test msg_rate -n $MSGS --window 64" \
             "$rperf --connect 127.0.0.1 --port PORT --provider tcp --test msg_rate -n $MSGS --window 64")
  results[ours_rate]+="$(sed -n 's/.*Mmsgs=\([0-9.]*\).*/\1/p' <<<"$out") "
  results[ours_db]+="$(sed -n 's/.* posts=\([0-9]*\).*/\1/p' <<<"$out")/$(sed -n 's/.*doorbells=\([0-9]*\).*/\1/p' <<<"$out") "
  out=$(pair "env UCX_TLS=tcp ucx_perftest -p PORT" \
             "env UCX_TLS=tcp ucx_perftest 127.0.0.1 -p PORT -t tag_bw -s 64 -n $MSGS")
  # "Final:" line: msgrate overall is the 9th field (messages per second)
  results[ucx_rate]+="$(awk '$1 == "Final:" {printf "%.4f", $9 / 1e6}' <<<"$out") "
done

m() { tr ' ' '\n' <<<"${results[$1]}" | grep -v '^$' | median; }
raw=$(m raw_lat); echo_=$(m echo_lat); ours=$(m ours_rate); ucx=$(m ucx_rate)
echo
echo "runs per tool: $REPS (latency $ITERS round trips, message rate $MSGS messages)"
for k in raw_lat echo_lat ours_rate ucx_rate ours_db; do printf '  %-9s %s\n' "$k" "${results[$k]}"; done
echo
printf '64 B one-way latency (us, median of runs): runtime echo %s | raw provider ping-pong %s\n' "$echo_" "$raw"
awk -v e="$echo_" -v r="$raw" 'BEGIN {printf "  runtime overhead = %.1f %% (target: at most 4 %%)\n", (e/r - 1) * 100}'
awk -v q="$(round_ratios "${results[echo_lat]}" "${results[raw_lat]}")" \
  'BEGIN {printf "  per-round overhead (median of the rounds'"'"' ratios, each round runs both back to back) = "
         if (q == "nan") print "nan"; else printf "%.1f %%\n", (q - 1) * 100}'
printf '64 B message rate (M msg/s, median of runs): anydoor %s | UCX tcp tag_bw %s\n' "$ours" "$ucx"
awk -v o="$ours" -v u="$ucx" 'BEGIN {printf "  ratio anydoor/UCX = %.2f (above 1: anydoor faster)\n", o/u}'
echo "  posts/doorbells per run: ${results[ours_db]}"
if [[ -n "${JSON:-}" ]]; then
  # ours_db holds POSTS/DOORBELLS per run ("/" where a run printed neither)
  posts=$(tr ' ' '\n' <<<"${results[ours_db]}" | cut -d/ -f1 | awk NF | median)
  doorbells=$(tr ' ' '\n' <<<"${results[ours_db]}" | cut -d/ -f2 | awk NF | median)
  json_line "$JSON" anydoor lat 64 "t_typical_us=$raw" "iters=$ITERS" "runs=$REPS"
  json_line "$JSON" anydoor-runtime lat 64 "t_typical_us=$echo_" "iters=$ITERS" "runs=$REPS"
  json_line "$JSON" anydoor-runtime msg_rate 64 "msg_rate_Mpps=$ours" "iters=$MSGS" "window=64" \
    "posts=$posts" "doorbells=$doorbells" "runs=$REPS"
  json_line "$JSON" ucx msg_rate 64 "msg_rate_Mpps=$ucx" "iters=$MSGS" "runs=$REPS"
  echo "compare-runtime: medians appended to $JSON"
fi
