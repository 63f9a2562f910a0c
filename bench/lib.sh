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
