#!/usr/bin/env bash
# Online rebalancing of a cluster on etcd: how fast a joining server receives its share of
# the keys, and what the move does to a foreground reader's latency.
#
#   bench/rebalance.sh [TRANSPORT]
#     TRANSPORT  shm (UCX shared memory, default) | tcp (libfabric tcp;ofi_rxm)
#   env: KEYS (per writer thread, default 2048), SIZE (value bytes, default 65536),
#        RATE (--rebalance-rate, default 1GiB), READ_RATE (foreground GETs/s, default 2000), BIN
#
# Three servers (R = 1) hold KEYS x 2 values of SIZE bytes; a reader runs rdram-bench GET
# 4 KiB at READ_RATE requests/s (open loop) for 8 s, once with the cluster at rest and once
# while a fourth server joins 2 s in. Prints the bytes handed over, the time from the
# join to the placement's next epoch, the rate, and the reader's p50/p99/max both times.
# Builds nothing: run `make build` first.
set -euo pipefail
TRANSPORT=${1:-shm}
BIN=${BIN:-target/release}
KEYS=${KEYS:-2048}
SIZE=${SIZE:-65536}
RATE=${RATE:-1GiB}
READ_RATE=${READ_RATE:-2000}
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
work=$(mktemp -d)
pids=()
trap 'kill ${pids[*]} 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
. "$(dirname "$0")/../scripts/etcd.sh"
start_etcd
url=etcd://$etcd/bench
"$BIN/rdram" cluster create "$url" >/dev/null
serve_args=(--workers 1 --memory 1GiB --hugepages off --cluster "$url" --rebalance-rate "$RATE")
case $TRANSPORT in
  shm) export UCX_TLS=posix,sysv,cma,self ;;
  tcp) serve_args+=(--transport fabric --provider "tcp;ofi_rxm") ;;
  *) echo "transport: shm or tcp" >&2; exit 2 ;;
esac
serve() {
  local log=$work/server-$1.log
  "$BIN/rdram" serve --listen 127.0.0.1:0 "${serve_args[@]}" >"$log" 2>&1 &
  pids+=($!)
  until grep -q "^listening on" "$log"; do sleep 0.1; done
}
for n in 1 2 3; do serve $n; done
epoch() { "$BIN/rdram" cluster status "$url" | python3 -c 'import json,sys; p=json.load(sys.stdin)["placement"]; print(p["epoch"] if p["next"] is None else -1)'; }

# The data: KEYS values per writer thread, two threads.
"$BIN/rdram-bench" --server "$url" --poll adaptive --ops put --sizes "$SIZE" --threads 2 --keys "$KEYS" \
  --count "$KEYS" --warmup 0 --out "$work/fill" >/dev/null
read_p() {
  "$BIN/rdram-bench" --server "$url" --poll adaptive --ops get --sizes 4096 --keys 64 --rate "$READ_RATE" \
    --seconds 8 --warmup 0.5 --json --out "$work/$1" | python3 -c '
import json, sys
r = json.loads(sys.stdin.readline())
print(f"p50 {r[\"p50_us\"]:.1f} us, p99 {r[\"p99_us\"]:.1f} us, max {r[\"max_us\"]:.1f} us")'
}
echo "reader at rest:        $(read_p rest)"
before=$(epoch)
read_p moving >"$work/moving.txt" &
reader=$!
sleep 2
joined=$(date +%s.%N)
serve 4
until e=$(epoch) && [ "$e" -gt "$before" ]; do sleep 0.02; done
settled=$(date +%s.%N)
wait $reader
echo "reader during the move: $(cat "$work/moving.txt")"
moved=$("$BIN/rdram" stats --server "$url" | python3 -c '
import json, sys
d = json.load(sys.stdin)
print(sum(s["shards"][0].get("handed_over_bytes", 0) for s in d["servers"]))')
python3 -c "
moved, secs = $moved, $settled - $joined
print(f'$TRANSPORT: {moved / 2**20:.0f} MiB handed over to the new server in {secs:.2f} s from its start: {moved / secs / 1e6:.0f} MB/s')"
