# Shared by the compare-*.sh scripts (sourced). Expects $port to be set.

# require_tools NAME TOOL...: exits 2 with a hint when a tool is missing.
require_tools() {
  local name=$1 t
  shift
  for t in "$@"; do
    command -v "$t" >/dev/null || { echo "$name: $t not found (run scripts/setup --bench and build first)" >&2; exit 2; }
  done
}

# pair "server command" "client command": runs the server on CPU 0 and the
# client on CPU 1 (PORT in either is replaced by a fresh port); prints the
# client's output.
pair() {
  local srv=$1 cli=$2
  port=$((port + 1))
  eval "taskset -c 0 ${srv//PORT/$port}" >/dev/null 2>&1 &
  local spid=$!
  sleep 0.4
  local out
  out=$(eval "timeout 120 taskset -c 1 ${cli//PORT/$port}" 2>&1) || true
  wait "$spid" 2>/dev/null || true
  echo "$out"
}

# median of the numbers on stdin, one per line
median() { sort -g | awk '{a[NR]=$1} END {if (NR==0) print "nan"; else if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }

# round_ratios "A1 A2 ..." "B1 B2 ...": the median of the rounds' ratios
# Ai/Bi, the lists as the scripts build them (one value and a space per
# round, nothing where a run gave no figure): a round where either figure
# is missing or not a positive number is left out (nan when none is left);
# three decimals.
# Each round runs the tools back to back, so this cancels most of the
# machine's drift between rounds, which the ratio of the two medians does
# not.
round_ratios() {
  awk -v a="$1" -v b="$2" 'BEGIN {
    num = "^([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][-+]?[0-9]+)?$"
    n = split(a, x, / /); split(b, y, / /)
    for (i = 1; i <= n; i++) if (x[i] ~ num && y[i] ~ num && x[i] + 0 > 0 && y[i] + 0 > 0) printf "%.4f\n", x[i] / y[i]
  }' | median | awk '$1 == "nan" {print; next} {printf "%.3f\n", $1}'
}

# json_line FILE TOOL TEST SIZE KEY=VALUE...: appends one JSON object (the
# keys of anydoor-perf --json, provider tcp) to FILE, for JSON=FILE; a value
# that is not a JSON number (nan, inf, nothing) is written as null; negative
# numbers and exponents (1.5e+06, as awk prints a large median) are kept.
json_line() {
  local file=$1 tool=$2 test=$3 size=$4 kv="" p v
  shift 4
  for p in "$@"; do
    v=${p#*=}
    [[ "$v" =~ ^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?$ ]] || v=null
    kv+=",\"${p%%=*}\":$v"
  done
  printf '{"tool":"%s","provider":"tcp","test":"%s","size":%s%s}\n' "$tool" "$test" "$size" "$kv" >> "$file"
}
