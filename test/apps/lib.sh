# Shared by the app tests (sourced): a scratch directory, background servers
# that are always stopped, and checks that name what they expected.
#   start_server NAME CMD...   runs CMD in the background (stdout/stderr in
#                              $tmp/NAME.out/.err), waits for its "listening
#                              on HOST:PORT" line; sets PORT and PID_NAME
#   run_cmd WANT_RC CMD...     runs CMD (60 s limit), output in $tmp/last.out/.err
#   expect_in FILE REGEX       FILE has a line matching REGEX
#   wait_exit NAME [WHAT]      the server start_server NAME started exits by
#                              itself, with 0, within 30 s (WHAT: for the
#                              failure's message)
#   when_line FILE REGEX CMD... in the background: once FILE has a line
#                              matching REGEX (at most 30 s), runs CMD; a
#                              loaded machine cannot make CMD come too early
set -uo pipefail
export ANYDOOR_LOG=${ANYDOOR_LOG:-warn}
tmp=$(mktemp -d)
declare -a _pids=()
cleanup() {
  for p in "${_pids[@]}"; do kill -CONT "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in "$tmp"/*.out "$tmp"/*.err; do
    [ -s "$f" ] && { echo "--- $f" >&2; tail -20 "$f" >&2; }
  done
  exit 1
}
pass() { echo "ok: $*"; }

start_server() {
  local name=$1; shift
  # Emptied here, not only by the background job's redirection: a server
  # of the same name before left its "listening on" line in the file, and
  # the loop below could read that port before the new job truncates it.
  : >"$tmp/$name.out"
  : >"$tmp/$name.err"
  "$@" >"$tmp/$name.out" 2>"$tmp/$name.err" &
  local pid=$!
  _pids+=("$pid")
  printf -v "PID_$name" '%s' "$pid"
  local i
  for i in $(seq 1 200); do
    PORT=$(sed -n 's/.*listening on [^ ]*:\([0-9][0-9]*\).*/\1/p' "$tmp/$name.out" | head -1)
    [ -n "$PORT" ] && return 0
    kill -0 "$pid" 2>/dev/null || fail "$name exited before listening: $*"
    sleep 0.05
  done
  fail "$name did not say 'listening on' within 10 s: $*"
}

wait_exit() {
  local pid_var="PID_$1" i
  local pid=${!pid_var:-}
  [ -n "$pid" ] || fail "no server named $1"
  for i in $(seq 1 300); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "$pid" 2>/dev/null && fail "$1 did not exit within 30 s of its client: ${2:-}"
  wait "$pid" || fail "$1 exited with $? after: ${2:-}"
}

run_cmd() {
  local want=$1; shift
  timeout 60 "$@" >"$tmp/last.out" 2>"$tmp/last.err"
  local rc=$?
  local cmd="$*"
  [ ${#cmd} -le 300 ] || cmd="${cmd:0:300}..."
  [ "$rc" = 124 ] && fail "hung (60 s): $cmd"
  [ "$rc" = "$want" ] || fail "exit code $rc, expected $want: $cmd"
}

expect_in() {
  grep -Eq -- "$2" "$1" || fail "$1 has no line matching '$2'"
}

when_line() {
  local file=$1 re=$2; shift 2
  (
    for _ in $(seq 1 600); do
      [ -f "$file" ] && grep -Eq -- "$re" "$file" && break
      sleep 0.05
    done
    "$@"
  ) &
}
