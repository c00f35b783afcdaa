#!/usr/bin/env bash
# What clients that come and go leave in a server: its RSS, mappings and fds, before,
# every 50 clients, and WAIT seconds after the last one (recycled UCX workers go after 10 s).
#
#   bench/client_churn.sh [N] [MODE]
#     N      clients, one after the other (default 200)
#     MODE   cli:  one-shot `rdram get` (default; UCX shared memory on one host)
#            kill: `rdram-bench` GET+PUT 64 KiB over UCX shared memory, SIGKILLed after 0.3 s
#   env: LIMIT (--stranded-endpoint-limit, default the server's), WAIT (default 12), BIN
#
# Builds nothing: run `make build` first.
set -euo pipefail
N=${1:-200}
MODE=${2:-cli}
BIN=${BIN:-target/release}
WAIT=${WAIT:-12}
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
[ "$MODE" = kill ] && export UCX_TLS=posix,sysv,cma,self

log=$(mktemp)
args=(serve --listen 127.0.0.1:0 --memory 256MiB --workers 1 --hugepages off)
[ -n "${LIMIT:-}" ] && args+=(--stranded-endpoint-limit "$LIMIT")
"$BIN/rdram" "${args[@]}" >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; rm -f "$log"' EXIT
until grep -q "^listening on" "$log"; do sleep 0.1; done
addr=$(sed -n 's/^listening on //p' "$log" | head -1)

footprint() {
    echo "$1: RSS $(awk '/VmRSS/{print $2}' /proc/$server/status) KiB," \
        "$(wc -l </proc/$server/maps) mappings, $(ls /proc/$server/fd | wc -l) fds"
}

"$BIN/rdram" put --server "$addr" k v >/dev/null
footprint "before"
for i in $(seq 1 "$N"); do
    if [ "$MODE" = kill ]; then
        "$BIN/rdram-bench" --server "$addr" --ops get,put --sizes 65536 --keys 4 --seconds 30 >/dev/null 2>&1 &
        client=$!
        sleep 0.3
        kill -9 $client
        wait $client 2>/dev/null || true
    else
        "$BIN/rdram" get --server "$addr" k >/dev/null
    fi
    [ $((i % 50)) = 0 ] && footprint "after $i"
done
sleep "$WAIT"
footprint "${WAIT} s later"
echo "fresh workers: $(grep -c 'fresh worker' "$log" || true)"
kill $server
status=0
wait $server || status=$?
trap 'rm -f "$log"' EXIT
echo "server exit status $status"
