#!/usr/bin/env bash
# The performance report: anydoor-perf against its peers on this host's
# loopback, every size, each tool run REPS times side by side (interleaved,
# server on CPU 0, client on CPU 1, busy-polling), then scripts/plot draws the
# medians of the runs and this writes the report.
#
#   bench/perf-report.sh [BUILD_DIR] [OUT_DIR]     (defaults: build/ and docs/)
#
# Measured (the tcp provider: no RDMA NIC here; on a host with one, set
# PROVIDER=verbs and HOST to its address, and the peers are left out):
#   one-way latency   anydoor-perf lat (all sizes, 2 B..8 MiB) | UCX tag_lat (UCX_TLS=tcp)
#                     | fi_pingpong (tcp provider, msg endpoints) | the TCP floor
#                     (anydoor-tcp-floor: plain busy-polled sockets, no framing)
#   bandwidth         anydoor-perf write_bw and send_bw | UCX ucp_put_bw | the TCP floor stream
# The peers run at every other power of two (2 B, 8 B, ..., 8 MiB).
#
# Writes OUT_DIR/perf/results.jsonl (every run: one JSON object per tool,
# test, size and run, anydoor-perf --json's keys), OUT_DIR/perf/latency.png,
# bandwidth.png and tables.md (scripts/plot), and OUT_DIR/performance.md
# (the machine, the command, the plots and the tables).
# env: REPS (runs per tool and size, default 3), ITERS (iterations at sizes up
#      to 8 KiB, fewer above as anydoor-perf --all-sizes does; default 2000),
#      PROVIDER (tcp), HOST (127.0.0.1), PEERS (1; 0: anydoor alone, without
#      the peers; they are left out anyway with a PROVIDER other than tcp).
# Needs: scripts/setup --bench (UCX, libfabric) and gnuplot (gnuplot-nox);
# missing peers stop it with the hint (exit 2).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(realpath "${1:-$root/build}")
out=$(realpath -m "${2:-$root/docs}")
REPS=${REPS:-3}
ITERS=${ITERS:-2000}
PROVIDER=${PROVIDER:-tcp}
HOST=${HOST:-127.0.0.1}
perf=$build/bin/anydoor-perf
floor=$build/bin/anydoor-tcp-floor
port=$((10000 + RANDOM % 20000))  # below the ephemeral range (32768-60999): no clash with a connection's own port
[[ "$REPS" =~ ^[1-9][0-9]*$ && "$ITERS" =~ ^[1-9][0-9]*$ ]] || { echo "perf-report: REPS and ITERS must be positive numbers" >&2; exit 2; }

# shellcheck source=lib.sh
source "$root/bench/lib.sh"
peers=${PEERS:-1}
[[ "$PROVIDER" == tcp ]] || peers=0  # the peers here run over TCP only
[[ "$peers" == 0 || "$peers" == 1 ]] || { echo "perf-report: PEERS must be 0 or 1" >&2; exit 2; }
if [[ $peers == 1 ]]; then
  require_tools perf-report "$perf" "$floor" ucx_perftest fi_pingpong gnuplot taskset python3
else
  require_tools perf-report "$perf" gnuplot taskset python3
fi

mkdir -p "$out/perf"
results=$out/perf/results.jsonl
: > "$results"
peer_sizes=(2 8 32 128 512 2048 8192 32768 131072 524288 2097152 8388608)
# anydoor-perf --all-sizes' rule: all ITERS up to 8 KiB, ITERS*8KiB/size above, at least 100.
iters_at() { local s=$1; if (( s <= 8192 )); then echo "$ITERS"; else local n=$((ITERS * 8192 / s)); (( n < 100 )) && n=100; (( n > ITERS )) && n=$ITERS; echo "$n"; fi; }
# emit TOOL TEST SIZE ITERS REP KEY=VALUE...: one JSON line (bench/lib.sh json_line), or
# none, counted as missing, when a value is not a number
emit() {
  local tool=$1 test=$2 size=$3 iters=$4 rep=$5 p; shift 5
  for p in "$@"; do
    if ! [[ "${p#*=}" =~ ^[0-9]+(\.[0-9]+)?$ ]]; then
      echo "perf-report: $tool $test $size B, run $rep: no number for ${p%%=*} ('${p#*=}'): left out" >&2
      missing=$((missing + 1))
      return 0
    fi
  done
  json_line "$results" "$tool" "$test" "$size" "iters=$iters" "rep=$rep" "$@"
}

missing=0
start=$(date +%s)
for ((r = 1; r <= REPS; r++)); do
  echo "perf-report: run $r of $REPS ($(( $(date +%s) - start )) s so far)" >&2
  for t in lat write_bw send_bw; do
    echo "perf-report:   anydoor $t, all sizes" >&2
    # write_bw reuses one place in each buffer (--slots 1), as ucp_put_bw and the floor's stream do
    slots=""
    [[ $t == write_bw ]] && slots="--slots 1"
    pair "$perf --server --port PORT --provider $PROVIDER" \
         "$perf --connect $HOST --port PORT --provider $PROVIDER --test $t --all-sizes -n $ITERS $slots --json" |
      grep '^{' | sed "s/}\$/,\"rep\":$r}/" >> "$results"
  done
  [[ $peers == 1 ]] || continue
  echo "perf-report:   fi_pingpong, all sizes" >&2
  o=$(pair "fi_pingpong -p tcp -e msg -S all -I $ITERS -B PORT" "fi_pingpong -p tcp -e msg -S all -I $ITERS -P PORT 127.0.0.1")
  # rows: bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec (usec/xfer: a mean, one way);
  # its "all" has sizes between the powers of two too: only the powers of two from 2 B are kept
  # (sizes from 1 KiB on are printed as 1k, 1.5k, 8m: converted to bytes)
  while read -r bytes _ _ _ _ mbs usec mx; do
    (( bytes >= 2 && (bytes & (bytes - 1)) == 0 )) || continue
    emit libfabric lat "$bytes" "$ITERS" "$r" "t_avg_us=$usec" "bw_avg_MBps=$mbs" "msg_rate_Mpps=$mx"
  done < <(awk 'NF >= 8 && $1 ~ /^[0-9.]+[kmg]?$/ {
                  n = $1; m = 1
                  if (n ~ /k$/) m = 1024; else if (n ~ /m$/) m = 1048576; else if (n ~ /g$/) m = 1073741824
                  sub(/[kmg]$/, "", n); $1 = sprintf("%d", n * m); print }' <<<"$o")
  for s in "${peer_sizes[@]}"; do
    n=$(iters_at "$s")
    echo "perf-report:   UCX and the TCP floor, $s B" >&2
    # ucx_perftest's Final: iters, latency typical/average/overall (us, one way),
    # bandwidth average/overall (MB/s of 2^20 bytes), message rate average/overall
    o=$(pair "env UCX_TLS=tcp ucx_perftest -p PORT" "env UCX_TLS=tcp ucx_perftest 127.0.0.1 -p PORT -t tag_lat -s $s -n $n")
    read -r typ avg < <(awk '$1 == "Final:" {print $3, $4}' <<<"$o") || true  # (no Final line: left out by emit)
    emit ucx lat "$s" "$n" "$r" "t_typical_us=${typ:-}" "t_avg_us=${avg:-}"
    o=$(pair "env UCX_TLS=tcp ucx_perftest -p PORT" "env UCX_TLS=tcp ucx_perftest 127.0.0.1 -p PORT -t ucp_put_bw -s $s -n $n")
    read -r bw mr < <(awk '$1 == "Final:" {printf "%.3f %.6f\n", $6 * 1.048576, $8 / 1e6}' <<<"$o") || true
    emit ucx write_bw "$s" "$n" "$r" "bw_avg_MBps=${bw:-}" "msg_rate_Mpps=${mr:-}"
    o=$(pair "$floor --server --port PORT --test lat -s $s -n $n" "$floor --connect 127.0.0.1 --port PORT --test lat -s $s -n $n")
    read -r med mean < <(sed -n 's/.*median_us=\([0-9.]*\).*mean_us=\([0-9.]*\).*/\1 \2/p' <<<"$o") || true
    emit tcp-floor lat "$s" "$n" "$r" "t_typical_us=${med:-}" "t_avg_us=${mean:-}"
    o=$(pair "$floor --server --port PORT --test stream -s $s -n $n" "$floor --connect 127.0.0.1 --port PORT --test stream -s $s -n $n")
    mbps=$(sed -n 's/.*MBps=\([0-9.]*\).*/\1/p' <<<"$o") || true
    emit tcp-floor send_bw "$s" "$n" "$r" "bw_avg_MBps=${mbps:-}"
  done
done
echo "perf-report: $(wc -l < "$results") results in $results ($(( $(date +%s) - start )) s), $missing left out" >&2

"$root/scripts/plot" "$results" "$out/perf" --title "anydoor ($PROVIDER provider, loopback)"

cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
{
  echo "# Performance"
  echo
  echo "Generated by \`bench/perf-report.sh\` on $(date -u +%Y-%m-%d) from commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown). Reproduce with:"
  echo
  echo '```'
  echo "scripts/setup --bench && scripts/build build && REPS=$REPS ITERS=$ITERS bench/perf-report.sh build docs"
  echo '```'
  echo
  echo "## The machine"
  echo
  echo "- CPU: ${cpu:-unknown}, $(nproc) cores seen; server pinned to CPU 0, client to CPU 1"
  echo "- Kernel: $(uname -sr); $(. /etc/os-release && echo "$PRETTY_NAME")"
  echo "- Memory: $(free -g | awk '/^Mem:/ {print $2}') GiB"
  if [[ "$PROVIDER" == tcp ]]; then
    echo "- No RDMA NIC: every tool runs over TCP loopback (anydoor's tcp provider, UCX_TLS=tcp, libfabric's tcp provider)."
    echo "  These numbers compare software stacks on one host; they say nothing about a NIC's latency or bandwidth."
  else
    echo "- Provider $PROVIDER, server at $HOST."
  fi
  [[ $peers == 1 ]] || echo "- anydoor alone: the peers were not run (PEERS=0 or a provider other than tcp)."
  echo
  echo "## How to read it"
  echo
  echo "- Each tool ran $REPS times per size, the tools interleaved in one session; the plots and tables show the"
  echo "  median of the runs (the machines here are noisy: compare ratios measured side by side, not absolute numbers"
  echo "  across reports)."
  echo "- Latency is one way (half the round trip): anydoor-perf, UCX and the TCP floor report the typical (median)"
  echo "  value of a run, fi_pingpong only a mean (its column is the mean)."
  echo "- Bandwidth is in MB/s of 10^6 bytes (UCX's MB of 2^20 converted). anydoor's write_bw and UCX's put_bw are"
  echo "  one-sided writes; anydoor's send_bw and the TCP floor's stream are two-sided. Each reuses one buffer of the"
  echo "  size on each side (anydoor write_bw: --slots 1), so all of them move the same memory."
  echo "- Sizes above 8 KiB run fewer iterations (ITERS x 8 KiB / size, at least 100)."
  [[ $missing == 0 ]] || echo "- $missing peer measurements produced no number and are left out (see the run's output)."
  echo
  echo "## Latency"
  echo
  echo "![one-way latency against message size](perf/latency.png)"
  echo
  echo "## Bandwidth"
  echo
  echo "![bandwidth against message size](perf/bandwidth.png)"
  echo
  echo "## Tables"
  echo
  cat "$out/perf/tables.md"
  echo
  echo "The raw results, one JSON object per tool, test, size and run, are in [perf/results.jsonl](perf/results.jsonl)."
} > "$out/performance.md"
echo "perf-report: wrote $out/performance.md" >&2
