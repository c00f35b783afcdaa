#!/usr/bin/env bash
# Online rebalancing of a cluster on etcd: how fast a joining server receives its share of
# the keys (or, after a failure, how fast the survivors copy the keys that lost a
# replica), and what the move does to a foreground reader's latency.
#
#   bench/rebalance.sh [TRANSPORT] [CHANGE]
#     TRANSPORT  shm (UCX shared memory, default) | tcp (libfabric tcp;ofi_rxm)
#     CHANGE     join (default: as below) | failure (four servers with R = 2; one is
#                SIGKILLed, and the rate is that of the re-replication, from the placement
#                without it to the next epoch; the reader runs from the kill on)
#   env: KEYS (default 4096), SIZE (value bytes, default 65536), RATE (--rebalance-rate,
#        default 1GiB), READ_RATE (foreground GETs/s, default 2000), BIN, PY (a Python with
#        the remote_dram package; python/tests/run.sh makes target/venv-python), KEEP (keep logs)
#
# Three servers (R = 1) hold KEYS values of SIZE bytes; a reader runs rdram-bench GET
# 4 KiB at READ_RATE requests/s (open loop) for 8 s: with the cluster at rest; from the
# moment a fourth server is up and keys move to it (the server's own start, which on a
# 2-vCPU machine takes the CPUs for a while, is not in it; the reader's view names the new
# server from the start); and connected 1.5 s before a fifth server starts (it meets the
# new server through its watch, and the server's start is in it). Prints the bytes handed
# over to the fourth, the time from the placement naming it to the next epoch, the rate,
# and the reader's p50/p99/max each time (the reader's own keys move too). Builds nothing:
# run `make build` and python/tests/run.sh first.
set -euo pipefail
TRANSPORT=${1:-shm}
CHANGE=${2:-join}
BIN=${BIN:-target/release}
PY=${PY:-target/venv-python/bin/python}
KEYS=${KEYS:-4096}
SIZE=${SIZE:-65536}
RATE=${RATE:-1GiB}
READ_RATE=${READ_RATE:-2000}
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
work=$(mktemp -d)
[ -n "${KEEP:-}" ] && echo "logs in $work"
pids=()
trap 'kill ${pids[*]} 2>/dev/null; wait 2>/dev/null; [ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
. "$(dirname "$0")/../scripts/etcd.sh"
start_etcd
url=etcd://$etcd/bench
case $CHANGE in
  join) replicas=1 servers=3 ;;
  failure) replicas=2 servers=4 ;;
  *) echo "change: join or failure" >&2; exit 2 ;;
esac
"$BIN/rdram" cluster create "$url" --replicas $replicas >/dev/null
serve_args=(--workers 1 --memory 512MiB --hugepages off --cluster "$url" --rebalance-rate "$RATE")
case $TRANSPORT in
  shm) export UCX_TLS=posix,sysv,cma,self ;;
  tcp) serve_args+=(--transport fabric --provider "tcp;ofi_rxm") ;;
  *) echo "transport: shm or tcp" >&2; exit 2 ;;
esac
serve() {
  local log=$work/server-$1.log
  RUST_LOG=info "$BIN/rdram" serve --listen 127.0.0.1:0 "${serve_args[@]}" >"$log" 2>&1 &
  pids+=($!)
  until grep -qs "^listening on" "$log"; do sleep 0.1; done
}
placement() { "$BIN/rdram" cluster status "$url" | python3 -c 'import json,sys; p=json.load(sys.stdin)["placement"]; print(p["epoch"], int(p["next"] is not None))'; }
for n in $(seq "$servers"); do serve "$n"; done

# The data (rdram-bench deletes its keys when it ends): the Python client.
"$PY" - "$url" "$KEYS" "$SIZE" <<'PYEOF'
import sys, remote_dram
url, keys, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = remote_dram.Client(url)
value = bytes(range(256)) * (size // 256)
for i in range(keys):
    c.put(f"data/{i}".encode(), value)
PYEOF
read_p() {
  "$BIN/rdram-bench" --server "$url" --poll adaptive --ops get --sizes 4096 --keys 64 --rate "$READ_RATE" \
    --seconds "${READ_SECONDS:-8}" --warmup 0.5 --json --out "$work/$1" 2>"$work/$1.err" | python3 -c '
import json, sys
r = json.loads(sys.stdin.readline())
print("p50 %.1f us, p99 %.1f us, max %.1f us" % (r["p50_us"], r["p99_us"], r["max_us"]))'
}
echo "reader at rest:         $(read_p rest)"
read -r before _ < <(placement)
case $CHANGE in
  join) serve 4 ;;
  failure) kill -KILL "${pids[-1]}"; wait "${pids[-1]}" 2>/dev/null || true ;;
esac
read_p moving >"$work/moving.txt" &
reader=$!
# Waits for the next epoch at a pace that leaves the CPUs to the servers and the reader
# (the times come from the servers' logs).
settle() { until read -r e m < <(placement) && [ "$m" = 0 ] && [ "$e" -gt "$1" ]; do sleep 0.5; done; }
settle "$before"
wait $reader
echo "reader during the move: $(cat "$work/moving.txt")"
# When the first server logged the move and the next epoch (UTC seconds of the day).
logged() { grep -h "$1" "$work"/server-*.log | sed -E 's/^[0-9-]+T([0-9]+):([0-9]+):([0-9.]+)Z.*/\1 \2 \3/' | awk '{printf "%.6f\n", $1*3600 + $2*60 + $3}' | sort -n | head -1; }
started=$(logged "view $before: keys move")
settled=$(logged "view $((before + 1)) placed on")
moved=$("$BIN/rdram" stats --server "$url" | python3 -c '
import json, sys
print(sum(s["shards"][0].get("handed_over_bytes", 0) for s in json.load(sys.stdin)["servers"]))')
python3 -c "
moved, secs = $moved, $settled - $started
to = {'join': 'to the new server', 'failure': 'to the keys\' new replicas'}['$CHANGE']
print(f'$TRANSPORT: {moved / 2**20:.0f} MiB handed over {to} in {secs:.2f} s: {moved / secs / 1e6:.0f} MB/s')"
[ "$CHANGE" = join ] || exit 0

read_p connected >"$work/connected.txt" &
reader=$!
sleep 1.5
read -r joined _ < <(placement)
serve 5
settle "$joined"
wait $reader
echo "reader connected before a fifth server joined: $(cat "$work/connected.txt")"
