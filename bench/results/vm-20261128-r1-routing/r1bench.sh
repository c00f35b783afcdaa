#!/usr/bin/env bash
# R=1 cluster of one server vs a static server, one at a time, busy polling, pinned.
set -euo pipefail
BIN=target/release
export UCX_NET_DEVICES=lo UCX_TLS=posix,sysv,cma,self
work=$(mktemp -d); pids=()
trap 'kill ${pids[*]} 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
. scripts/etcd.sh
start_etcd
$BIN/rdram cluster create "etcd://$etcd/one" --replicas 1 >/dev/null
run() { # label, serve args..., target
  local label=$1 target=$2; shift 2
  $BIN/rdram serve --listen 127.0.0.1:0 --workers 1 --memory 256MiB --hugepages off --cores 0 --poll busy "$@" > $work/s.log 2>&1 & local p=$!
  until grep -q "^listening on" $work/s.log; do sleep 0.1; done
  local addr=$(sed -n 's/^listening on //p' $work/s.log)
  [ "$target" = static ] && target=$addr
  printf "%-8s " $label; $BIN/rdram-bench --server "$target" --poll busy --client-cores 1 --ops get,put --sizes 8 --seconds 3 --warmup 0.5 --json 2>/dev/null | python3 -c '
import json, sys
print("  ".join("%s p50 %.2f us" % (r["op"], r["p50_us"]) for r in map(json.loads, sys.stdin)))'
  kill $p; wait $p 2>/dev/null || true
}
for i in 1 2 3; do
  run static static
  run cluster "etcd://$etcd/one" --cluster "etcd://$etcd/one"
done
