#!/usr/bin/env bash
# The RPC layer against the connection it runs on, side by side in one run,
# on loopback with the tcp provider, busy polling, server on CPU 0 and
# client on CPU 1, REPS interleaved rounds (default 5); medians of the
# per-run figures. For 64 B and 4 KiB payloads:
#   round trip, 1 call in flight: anydoor-rpc-perf lat vs anydoor-runtime-perf
#     echo (its one-way figure doubled): target rpc/echo <= 1.15
#   rate, 32 calls in flight: anydoor-rpc-perf rate vs anydoor-runtime-perf
#     msg_rate (one-way messages, 64 credits; the issue's baseline) and
#     echo_rate (echo round trips, 32 in flight: the same work as a call
#     without the RPC layer): target rpc/msg_rate >= 0.8
#   gRPC (bench/grpc, when built: needs libgrpc++-dev and
#     protobuf-compiler-grpc) is compared when anydoor-grpc-echo exists.
#   bench/compare-rpc.sh [BUILD_DIR]   (default build/)
# JSON=FILE also appends the medians to FILE, one object per tool, test and
# size (anydoor-perf --json's keys, with iters, window and runs): tools
# anydoor-rpc (anydoor-rpc-perf), anydoor-runtime (anydoor-runtime-perf: the
# connection) and grpc (when built); test rtt (the round trip, t_typical_us:
# not one way, unlike lat), call_rate (RPC and gRPC calls, msg_rate_Mpps),
# msg_rate and echo_rate (the connection's, msg_rate_Mpps).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
rpc=$build/bin/anydoor-rpc-perf
rperf=$build/bin/anydoor-runtime-perf
grpc=$build/bin/anydoor-grpc-echo
REPS=${REPS:-5}
ITERS=${ITERS:-20000}
CALLS=${CALLS:-200000}
port=$((10000 + RANDOM % 20000))  # below the ephemeral range (32768-60999): no clash with a connection's own port
export ANYDOOR_POLL=busy ANYDOOR_LOG=warn

# shellcheck source=lib.sh
source "$root/bench/lib.sh"
require_tools compare-rpc "$rpc" "$rperf" taskset
have_grpc=0
[[ -x "$grpc" ]] && have_grpc=1
[[ $have_grpc == 1 ]] || echo "compare-rpc: $grpc not built: the gRPC columns are skipped" >&2

field() { sed -n "s/.* $1=\([0-9.]*\).*/\1/p" <<<"$2"; }
declare -A results
for ((r = 1; r <= REPS; r++)); do
  echo "round $r/$REPS" >&2
  for s in 64 4096; do
    out=$(pair "$rperf --server --port PORT --provider tcp --test echo -s $s" \
               "$rperf --connect 127.0.0.1 --port PORT --provider tcp --test echo -s $s -n $ITERS")
    results[echo_$s]+="$(awk -v v="$(field median_us "$out")" 'BEGIN {print v * 2}') "
    out=$(pair "$rpc --server --port PORT --provider tcp --test lat -s $s" \
               "$rpc --connect 127.0.0.1 --port PORT --provider tcp --test lat -s $s -n $ITERS")
    results[rpc_lat_$s]+="$(field median_us "$out") "
    out=$(pair "$rpc --server --port PORT --provider tcp --test rate -s $s" \
               "$rpc --connect 127.0.0.1 --port PORT --provider tcp --test rate -s $s -n $CALLS --window 32")
    results[rpc_rate_$s]+="$(field Mcalls "$out") "
    out=$(pair "$rperf --server --port PORT --provider tcp --test msg_rate -s $s -n $CALLS --window 64" \
               "$rperf --connect 127.0.0.1 --port PORT --provider tcp --test msg_rate -s $s -n $CALLS --window 64")
    results[msg_rate_$s]+="$(field Mmsgs "$out") "
    out=$(pair "$rperf --server --port PORT --provider tcp --test echo_rate -s $s" \
               "$rperf --connect 127.0.0.1 --port PORT --provider tcp --test echo_rate -s $s -n $CALLS --window 32")
    results[echo_rate_$s]+="$(field Mmsgs "$out") "
    if [[ $have_grpc == 1 ]]; then
      out=$(pair "$grpc --server --port PORT" "$grpc --connect 127.0.0.1 --port PORT --test lat -s $s -n $ITERS")
      results[grpc_lat_$s]+="$(field median_us "$out") "
      out=$(pair "$grpc --server --port PORT" \
                 "$grpc --connect 127.0.0.1 --port PORT --test rate -s $s -n $((CALLS / 4)) --window 32")
      results[grpc_rate_$s]+="$(field Mcalls "$out") "
    fi
  done
done

m() { tr ' ' '\n' <<<"${results[$1]:-}" | grep -v '^$' | median; }
echo
echo "runs per tool: $REPS (latency $ITERS round trips, rate $CALLS calls or messages)"
for k in $(printf '%s\n' "${!results[@]}" | sort); do printf '  %-14s %s\n' "$k" "${results[$k]}"; done
echo
for s in 64 4096; do
  lat=$(m rpc_lat_$s); echo_=$(m echo_$s); rate=$(m rpc_rate_$s); msg=$(m msg_rate_$s); er=$(m echo_rate_$s)
  printf '%s B round trip (us, median): rpc %s | connection echo %s\n' "$s" "$lat" "$echo_"
  awk -v a="$lat" -v b="$echo_" 'BEGIN {printf "  rpc_rtt_ratio = %.3f (target: at most 1.15)\n", a/b}'
  printf '%s B rate, 32 in flight (M/s, median): rpc %s calls | connection msg_rate %s msgs | echo_rate %s round trips\n' \
    "$s" "$rate" "$msg" "$er"
  awk -v a="$rate" -v b="$msg" -v c="$er" \
    'BEGIN {printf "  rpc_rate_ratio = %.3f vs msg_rate (target: at least 0.8), %.3f vs echo_rate\n", a/b, a/c}'
  if [[ $have_grpc == 1 ]]; then
    gl=$(m grpc_lat_$s); gr=$(m grpc_rate_$s)
    printf '%s B gRPC: round trip %s us, rate %s M calls/s\n' "$s" "$gl" "$gr"
    awk -v a="$gl" -v b="$lat" -v c="$rate" -v d="$gr" \
      'BEGIN {printf "  grpc_rtt/rpc_rtt = %.1f, rpc_rate/grpc_rate = %.1f\n", a/b, c/d}'
  fi
  if [[ -n "${JSON:-}" ]]; then
    json_line "$JSON" anydoor-rpc rtt "$s" "t_typical_us=$lat" "iters=$ITERS" "runs=$REPS"
    json_line "$JSON" anydoor-runtime rtt "$s" "t_typical_us=$echo_" "iters=$ITERS" "runs=$REPS"
    json_line "$JSON" anydoor-rpc call_rate "$s" "msg_rate_Mpps=$rate" "iters=$CALLS" "window=32" "runs=$REPS"
    json_line "$JSON" anydoor-runtime msg_rate "$s" "msg_rate_Mpps=$msg" "iters=$CALLS" "window=64" "runs=$REPS"
    json_line "$JSON" anydoor-runtime echo_rate "$s" "msg_rate_Mpps=$er" "iters=$CALLS" "window=32" "runs=$REPS"
    if [[ $have_grpc == 1 ]]; then
      json_line "$JSON" grpc rtt "$s" "t_typical_us=$gl" "iters=$ITERS" "runs=$REPS"
      json_line "$JSON" grpc call_rate "$s" "msg_rate_Mpps=$gr" "iters=$((CALLS / 4))" "window=32" "runs=$REPS"
    fi
  fi
done
[[ -z "${JSON:-}" ]] || echo "compare-rpc: medians appended to $JSON"
