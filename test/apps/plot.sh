#!/usr/bin/env bash
# scripts/plot and bench/perf-report.sh: the plots and tables from results
# whose numbers are known (ratios checked), the refusals (exit 1 and 2), and
# a short report run of anydoor alone (PEERS=0) that writes every file.
#   test/apps/plot.sh BIN_DIR
bin=${1:?usage: plot.sh BIN_DIR}
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
root=$(cd "$(dirname "$0")/../.." && pwd)
plot=$root/scripts/plot
command -v gnuplot >/dev/null || { echo "SKIPPED: gnuplot is not installed (scripts/setup installs gnuplot-nox)"; exit 77; }

is_png() { [ "$(head -c 8 "$1" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] || fail "$1 is not a PNG"; }

# Known numbers: anydoor's medians 2 and 8 us over three runs (one an
# outlier), UCX's 4 us; bandwidth 1000 against 500 MB/s.
cat > "$tmp/r.jsonl" <<'J'
{"tool":"anydoor","provider":"tcp","test":"lat","size":64,"iters":10,"t_typical_us":2.0,"rep":1}
{"tool":"anydoor","provider":"tcp","test":"lat","size":64,"iters":10,"t_typical_us":2.0,"rep":2}
{"tool":"anydoor","provider":"tcp","test":"lat","size":64,"iters":10,"t_typical_us":90.0,"rep":3}
{"tool":"anydoor","provider":"tcp","test":"lat","size":4096,"iters":10,"t_typical_us":8.0}
{"tool":"ucx","provider":"tcp","test":"lat","size":64,"iters":10,"t_typical_us":4.0}
{"tool":"libfabric","provider":"tcp","test":"lat","size":64,"iters":10,"t_avg_us":5.0}
{"tool":"anydoor","provider":"tcp","test":"write_bw","size":65536,"iters":10,"t_min_us":null,"bw_avg_MBps":1000.0}
{"tool":"ucx","provider":"tcp","test":"write_bw","size":65536,"iters":10,"bw_avg_MBps":500.0}
{"tool":"anydoor","provider":"tcp","test":"other","size":8,"iters":10,"t_typical_us":1.0}
J
run_cmd 0 "$plot" "$tmp/r.jsonl" "$tmp/out" --title test
is_png "$tmp/out/latency.png"
is_png "$tmp/out/bandwidth.png"
t=$tmp/out/tables.md
expect_in "$t" '^### Latency'
expect_in "$t" '^\| 64 B \| 2\.00 \| 5\.00 \| 4\.00 \| 0\.40 \| 0\.50 \|$'  # median 2 (not the outlier); fi's mean; ratios
expect_in "$t" '^\| 4 KiB \| 8\.00 \|'
expect_in "$t" '^\| 64 KiB \| 1000\.00 \| 500\.00 \| 2\.00 \|$'
if grep -q 'other' "$t"; then fail "a test the script does not draw made it into the tables"; fi
pass "plots (PNG) and tables: medians of runs, a mean where only a mean exists, ratios"

run_cmd 2 "$plot";                                 expect_in "$tmp/last.err" 'expected RESULTS.jsonl and OUT_DIR'
run_cmd 2 "$plot" "$tmp/none.jsonl" "$tmp/o2";    expect_in "$tmp/last.err" 'no such file'
run_cmd 2 "$plot" "$tmp/r.jsonl" "$tmp/o2" --title; expect_in "$tmp/last.err" 'missing value after --title'
printf '{"tool":"a","test":"lat","size":1,"t_typical_us":1}\nnot json\n' > "$tmp/bad.jsonl"
run_cmd 1 "$plot" "$tmp/bad.jsonl" "$tmp/o2";     expect_in "$tmp/last.err" 'bad.jsonl:2: not JSON'
printf '{"tool":"a","test":"lat"}\n' > "$tmp/bad.jsonl"
run_cmd 1 "$plot" "$tmp/bad.jsonl" "$tmp/o2";     expect_in "$tmp/last.err" 'needs tool, test and size'
printf '{"tool":"a","test":"lat","size":1,"t_typical_us":-1}\n' > "$tmp/bad.jsonl"
run_cmd 1 "$plot" "$tmp/bad.jsonl" "$tmp/o2";     expect_in "$tmp/last.err" 'must be positive'
printf '{"tool":"a","test":"other","size":1}\n' > "$tmp/bad.jsonl"
run_cmd 1 "$plot" "$tmp/bad.jsonl" "$tmp/o2";     expect_in "$tmp/last.err" 'holds no latency or bandwidth results'
pass "refusals: bad command lines exit 2, unusable results 1, each with the reason"

# The report, anydoor alone, one short run: every file written, 23 sizes per test.
export ANYDOOR_PROVIDER=tcp
PEERS=0 REPS=1 ITERS=30 timeout 240 bash "$root/bench/perf-report.sh" "$(dirname "$bin")" "$tmp/docs" >"$tmp/report.out" 2>"$tmp/report.err" \
  || fail "perf-report.sh exited with $?"
r=$tmp/docs/perf/results.jsonl
for test in lat write_bw send_bw; do
  n=$(grep -c "\"tool\":\"anydoor\",\"provider\":\"tcp\",\"test\":\"$test\"" "$r")
  [ "$n" = 23 ] || fail "perf-report: $n $test results, expected 23 (2 B to 8 MiB)"
done
is_png "$tmp/docs/perf/latency.png"
is_png "$tmp/docs/perf/bandwidth.png"
expect_in "$tmp/docs/performance.md" '^# Performance'
expect_in "$tmp/docs/performance.md" 'bench/perf-report.sh build docs'
expect_in "$tmp/docs/performance.md" '^- CPU: '
expect_in "$tmp/docs/performance.md" '!\[one-way latency against message size\]\(perf/latency.png\)'
expect_in "$tmp/docs/performance.md" '^\| 8 MiB \| [0-9.]+ \|'
expect_in "$tmp/docs/performance.md" 'anydoor alone: the peers were not run'
pass "perf-report.sh (PEERS=0): results, plots and performance.md"
echo "plot: all checks passed"
