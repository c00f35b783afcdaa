# Sourced by scripts that run `rdram serve` / `rdram gateway` in the background: a scratch
# folder ($work), the processes started ($pids), both cleaned up on exit, and `start`.

work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# start NAME CMD...: runs CMD in the background, waits (up to 20 s) for its "listening on
# ADDR" and sets NAME_pid and NAME_addr; exits with its log if it ends or never listens.
start() {
  local name=$1; shift
  "$@" >"$work/$name.log" 2>&1 &
  local pid=$!
  pids+=("$pid")
  for _ in $(seq 400); do
    grep -q "^listening on" "$work/$name.log" && break
    kill -0 "$pid" 2>/dev/null || { cat "$work/$name.log"; echo "$name exited" >&2; exit 1; }
    sleep 0.05
  done
  grep -q "^listening on" "$work/$name.log" || { cat "$work/$name.log"; echo "$name did not start" >&2; exit 1; }
  printf -v "${name}_pid" %s "$pid"
  printf -v "${name}_addr" %s "$(sed -n 's/^listening on //p' "$work/$name.log")"
}
