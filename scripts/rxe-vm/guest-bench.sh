#!/bin/bash
# Runs INSIDE the rxe guest after guest-tests.sh set up rxe0 (ANYDOOR_RXE_BENCH=1):
# side by side on the same rxe device, REPS rounds each, interleaved:
#   64 B send latency:   anydoor-perf --test lat -s 64   vs ib_send_lat -s 64 (N round trips)
#   64 KiB write bandwidth: anydoor-perf --test write_bw vs ib_write_bw -s 65536
# and, when bin/anydoor-runtime-perf is there, the runtime's one-sided
# operations at 64 B and 64 KiB (RT_SIZES), RT_REPS rounds (default 3) of
# RT_N iterations (default 2000; emulated rxe is slow), each figure printed
# as it comes:
#   put latency (one-way, ping-pong on memory): --test put_lat vs ib_write_lat,
#     with the raw provider's (anydoor-perf --test write_lat, no runtime) beside
#     them: the provider's share of the gap and the runtime's
#   get latency (the whole read):               --test get_lat vs ib_read_lat
#   put bandwidth (16 in flight):               --test put_bw  vs ib_write_bw
# Prints the medians and the ratios. Emulated Soft-RoCE makes absolute
# figures meaningless; the ratios are the result. perftest's MB/sec is
# 2^20 bytes per second; it is converted to 10^6 like anydoor-perf's.
set -u
IP=10.0.2.15
REPS=${REPS:-5}
N=${N:-5000}
port=19000
# median and round_ratios: bench/lib.sh, which run-tests copies beside this
# script; its pair() is replaced by the guest's own below.
# shellcheck source=../../bench/lib.sh
source "$(dirname "$0")/bench-lib.sh"
pair() {  # pair SERVER_CMD CLIENT_CMD -> client output
  port=$((port + 1))
  timeout 150 ${1//PORT/$port} > /dev/null 2>&1 &   # a server that never ends must not stall the run
  local spid=$!
  sleep 1
  timeout 120 ${2//PORT/$port} 2>&1
  wait $spid 2>/dev/null
}
ours_lat="" ib_lat="" ours_bw="" ib_bw=""
for r in $(seq 1 "$REPS"); do
  out=$(pair "bin/anydoor-perf --server --port PORT --provider verbs --test lat -s 64 -n $N" \
             "bin/anydoor-perf --connect $IP --port PORT --provider verbs --test lat -s 64 -n $N")
  ours_lat+="$(sed -n 's/.*median_us=\([0-9.]*\).*/\1/p' <<<"$out") "
  out=$(pair "ib_send_lat -d rxe0 -s 64 -n $N -p PORT" "ib_send_lat -d rxe0 -s 64 -n $N -p PORT $IP")
  ib_lat+="$(awk '$1 == "64" && NF >= 5 {print $5}' <<<"$out") "   # t_typical
  out=$(pair "bin/anydoor-perf --server --port PORT --provider verbs --test write_bw -s 65536 -n 2000" \
             "bin/anydoor-perf --connect $IP --port PORT --provider verbs --test write_bw -s 65536 -n 2000")
  ours_bw+="$(sed -n 's/.*MBps=\([0-9.]*\).*/\1/p' <<<"$out") "
  out=$(pair "ib_write_bw -d rxe0 -s 65536 -n 2000 -p PORT" "ib_write_bw -d rxe0 -s 65536 -n 2000 -p PORT $IP")
  ib_bw+="$(awk '$1 == "65536" && NF >= 4 {printf "%.1f", $4 * 1.048576}' <<<"$out") "   # BW average
done
m() { tr ' ' '\n' <<<"$1" | grep -v '^$' | median; }
echo "=== rxe comparison ($REPS rounds): anydoor lat [$ours_lat] ib_send_lat [$ib_lat] anydoor bw [$ours_bw] ib_write_bw [$ib_bw]"
ol=$(m "$ours_lat"); il=$(m "$ib_lat"); ob=$(m "$ours_bw"); ib=$(m "$ib_bw")
# Each round runs the two back to back: the median of per-round ratios
# cancels most of the emulator's drift between rounds.
# (round_ratios keeps the rounds aligned where a run gave no figure)
ratios() { round_ratios "$1" "$2"; }
echo "=== per-round ratio medians: latency $(ratios "$ours_lat" "$ib_lat"), bandwidth $(ratios "$ours_bw" "$ib_bw")"
echo "=== 64 B send latency (us, median): anydoor $ol | ib_send_lat $il"
awk -v o="$ol" -v i="$il" 'BEGIN {printf "=== ratio anydoor/ib_send_lat = %.2f (below 1: anydoor faster)\n", o/i}'
echo "=== 64 KiB write bandwidth (MB/s, median): anydoor $ob | ib_write_bw $ib"
awk -v o="$ob" -v i="$ib" 'BEGIN {printf "=== ratio anydoor/ib_write_bw = %.2f (above 1: anydoor faster)\n", o/i}'
ok=1
[ -n "$ol" ] && [ "$ol" != nan ] && [ -n "$ob" ] && [ "$ob" != nan ] || ok=0

if [ -x bin/anydoor-runtime-perf ]; then
  rt() {  # rt TEST SIZE N -> the client's RESULT line
    pair "env ANYDOOR_POLL=busy bin/anydoor-runtime-perf --server --port PORT --provider verbs --test $1 -s $2 -n $3" \
         "env ANYDOOR_POLL=busy bin/anydoor-runtime-perf --connect $IP --port PORT --provider verbs --test $1 -s $2 -n $3"
  }
  for s in ${RT_SIZES:-64 65536}; do
    pl="" ppl="" ipl="" gl="" igl="" pb="" ipb=""
    n=${RT_N:-2000}; [ "$s" -ge 65536 ] && n=$((n / 5))
    for r in $(seq 1 "${RT_REPS:-3}"); do
      echo "=== one-sided $s B round $r: put_lat [$pl] provider write_lat [$ppl] ib_write_lat [$ipl] get_lat [$gl] ib_read_lat [$igl] put_bw [$pb] ib_write_bw [$ipb]"
      pl+="$(rt put_lat "$s" "$n" | sed -n 's/.*median_us=\([0-9.]*\).*/\1/p') "
      out=$(pair "bin/anydoor-perf --server --port PORT --provider verbs" \
                 "bin/anydoor-perf --connect $IP --port PORT --provider verbs --test write_lat -s $s -n $n")
      ppl+="$(sed -n 's/.*median_us=\([0-9.]*\).*/\1/p' <<<"$out") "
      out=$(pair "ib_write_lat -d rxe0 -s $s -n $n -p PORT" "ib_write_lat -d rxe0 -s $s -n $n -p PORT $IP")
      ipl+="$(awk -v s="$s" '$1 == s && NF >= 5 {print $5}' <<<"$out") "
      gl+="$(rt get_lat "$s" "$n" | sed -n 's/.*median_us=\([0-9.]*\).*/\1/p') "
      out=$(pair "ib_read_lat -d rxe0 -s $s -n $n -p PORT" "ib_read_lat -d rxe0 -s $s -n $n -p PORT $IP")
      igl+="$(awk -v s="$s" '$1 == s && NF >= 5 {print $5}' <<<"$out") "
      pb+="$(rt put_bw "$s" "$n" | sed -n 's/.*MBps=\([0-9.]*\).*/\1/p') "
      out=$(pair "ib_write_bw -d rxe0 -s $s -n $n -p PORT" "ib_write_bw -d rxe0 -s $s -n $n -p PORT $IP")
      ipb+="$(awk -v s="$s" '$1 == s && NF >= 4 {printf "%.1f", $4 * 1.048576}' <<<"$out") "
    done
    echo "=== one-sided $s B (${RT_REPS:-3} rounds): put_lat [$pl] provider write_lat [$ppl] ib_write_lat [$ipl] get_lat [$gl] ib_read_lat [$igl] put_bw [$pb] ib_write_bw [$ipb]"
    echo "=== one-sided $s B medians: put latency us $(m "$pl") vs $(m "$ipl") (ratio $(ratios "$pl" "$ipl")), get latency us $(m "$gl") vs $(m "$igl") (ratio $(ratios "$gl" "$igl")), put MB/s $(m "$pb") vs $(m "$ipb") (ratio $(ratios "$pb" "$ipb"))"
    echo "=== one-sided $s B put latency, where the gap is: provider write_lat us $(m "$ppl") vs ib_write_lat (ratio $(ratios "$ppl" "$ipl")), runtime put_lat vs provider (ratio $(ratios "$pl" "$ppl"))"
    [ "$(m "$pl")" != nan ] && [ "$(m "$ppl")" != nan ] && [ "$(m "$gl")" != nan ] && [ "$(m "$pb")" != nan ] || ok=0
  done
fi
[ $ok = 1 ]
