#!/usr/bin/env bash
# Message rate of anydoor-echo (tcp provider, loopback) with one and two
# reactors: server --threads S and client --threads C in the pairs
# (1,1) (2,1) (2,2), 64-byte messages, 4 connections with 16 calls in
# flight each, ROUNDS rounds with the pairs alternated; medians of msgs/s
# and each pair's ratio to (1,1). Nothing is pinned: the threads share
# whatever cores the machine has (on 2 cores shared by client and server,
# no scaling is expected; the table says what there is).
# usage: bench/message-rate.sh [BUILD_DIR] [ROUNDS] [SECONDS]
# Output: one JSON object per run (the client's --json, with the pair
# added), then the table.
set -u
build=${1:-build}
rounds=${2:-3}
secs=${3:-4}
echo_bin=$build/bin/anydoor-echo
[ -x "$echo_bin" ] || { echo "message-rate.sh: $echo_bin not found (build first)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$tmp"' EXIT
pairs="1,1 2,1 2,2"
for r in $(seq 1 "$rounds"); do
  for p in $pairs; do
    s=${p%,*}; c=${p#*,}
    "$echo_bin" server --listen 127.0.0.1:0 --provider tcp --threads "$s" >"$tmp/srv.out" 2>"$tmp/srv.err" &
    spid=$!
    port=
    for _ in $(seq 1 100); do
      port=$(sed -n 's/.*listening on [^ ]*:\([0-9][0-9]*\).*/\1/p' "$tmp/srv.out" | head -1)
      [ -n "$port" ] && break
      sleep 0.05
    done
    [ -n "$port" ] || { echo "message-rate.sh: the server did not start: $(cat "$tmp/srv.err")" >&2; exit 1; }
    if ! out=$(timeout $((secs + 60)) "$echo_bin" client --connect "127.0.0.1:$port" --provider tcp --size 64 \
        --connections 4 --in-flight 16 --threads "$c" --duration "$secs" --json 2>"$tmp/cli.err"); then
      echo "message-rate.sh: round $r pair $p failed: $(tail -1 "$tmp/cli.err")" >&2
      exit 1
    fi
    kill -TERM "$spid"; wait "$spid" 2>/dev/null
    echo "${out%\}},\"server_threads\":$s,\"client_threads\":$c,\"round\":$r}"
    rate=$(echo "$out" | sed -n 's/.*"msgs_per_s":\([0-9.]*\).*/\1/p')
    echo "$rate" >>"$tmp/rate-$s-$c"
  done
done
median() { sort -g | awk '{a[NR]=$1} END {if (NR==0) print "nan"; else if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
base=$(median <"$tmp/rate-1-1")
echo
echo "anydoor-echo message rate, 64 B, 4 connections x 16 in flight, tcp loopback, $(nproc) cores, median of $rounds x ${secs} s"
printf '%-16s %-16s %14s %10s\n' "server threads" "client threads" "msgs/s" "vs (1,1)"
for p in $pairs; do
  s=${p%,*}; c=${p#*,}
  m=$(median <"$tmp/rate-$s-$c")
  printf '%-16s %-16s %14.0f %9.2fx\n' "$s" "$c" "$m" "$(awk -v a="$m" -v b="$base" 'BEGIN{print a/b}')"
done
