#!/bin/bash
# Runs INSIDE the rxe guest after guest-tests.sh set up rxe0 (ANYDOOR_RXE_BENCH=1):
# side by side on the same rxe device, REPS rounds each, interleaved:
#   64 B send latency:   anydoor-perf --test lat -s 64   vs ib_send_lat -s 64 (N round trips)
#   64 KiB write bandwidth: anydoor-perf --test write_bw vs ib_write_bw -s 65536
# Prints the medians and the ratios. Emulated Soft-RoCE makes absolute
# figures meaningless; the ratios are the result. perftest's MB/sec is
# 2^20 bytes per second; it is converted to 10^6 like anydoor-perf's.
set -u
IP=10.0.2.15
REPS=${REPS:-5}
N=${N:-5000}
port=19000
pair() {  # pair SERVER_CMD CLIENT_CMD -> client output
  port=$((port + 1))
  ${1//PORT/$port} > /dev/null 2>&1 &
  local spid=$!
  sleep 1
  timeout 120 ${2//PORT/$port} 2>&1
  wait $spid 2>/dev/null
}
median() { sort -g | awk '{a[NR]=$1} END {if (NR==0) print "nan"; else if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
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
ratios() { paste -d' ' <(tr ' ' '\n' <<<"$1" | grep -v '^$') <(tr ' ' '\n' <<<"$2" | grep -v '^$') | awk '{print $1/$2}' | median; }
echo "=== per-round ratio medians: latency $(ratios "$ours_lat" "$ib_lat"), bandwidth $(ratios "$ours_bw" "$ib_bw")"
echo "=== 64 B send latency (us, median): anydoor $ol | ib_send_lat $il"
awk -v o="$ol" -v i="$il" 'BEGIN {printf "=== ratio anydoor/ib_send_lat = %.2f (below 1: anydoor faster)\n", o/i}'
echo "=== 64 KiB write bandwidth (MB/s, median): anydoor $ob | ib_write_bw $ib"
awk -v o="$ob" -v i="$ib" 'BEGIN {printf "=== ratio anydoor/ib_write_bw = %.2f (above 1: anydoor faster)\n", o/i}'
[ -n "$ol" ] && [ "$ol" != nan ] && [ -n "$ob" ] && [ "$ob" != nan ]
