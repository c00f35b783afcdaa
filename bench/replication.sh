#!/usr/bin/env bash
# What replication costs: PUT and GET p50 through a cluster on etcd with R = 2 against the
# same two servers' worth of cluster with R = 1, and a static list, measured in one run.
#
#   bench/replication.sh [SIZES]      SIZES: rdram-bench --sizes (default 8,1MiB)
#
# Last, two clients measure at once, each against a server of its own: what this host can
# move for two writers, the bound for R = 2 (which moves every value twice).
#   env: BIN (default target/release), SECONDS_EACH (default 3), DEPTH (requests in flight,
#        default 1; throughput at depth pipelines each write's copy with the next one),
#        CLIENT_SPIN_US (the client's spin before it sleeps, rdram-bench --spin-us), KEEP (keep logs)
#
# UCX shared memory; two servers of one worker each per cluster; one rdram-bench client
# (adaptive polling). The servers sleep as soon as they are idle (--spin-us 0, SPIN_US to
# change): with R = 2 two servers take part in every put, and on a machine with fewer
# cores than spinning processes a request may wait for another process's spin to yield
# the CPU (tens of µs on 2 vCPUs). Builds nothing: run `make build` first.
set -euo pipefail
SIZES=${1:-8,1MiB}
BIN=${BIN:-target/release}
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} UCX_TLS=${UCX_TLS:-posix,sysv,cma,self}
work=$(mktemp -d)
[ -n "${KEEP:-}" ] && echo "logs in $work"
pids=()
trap 'kill ${pids[*]} 2>/dev/null; wait 2>/dev/null; [ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
. "$(dirname "$0")/../scripts/etcd.sh"
start_etcd
# serve NAME [ARGS...]: starts a server (in this shell, so that the trap stops it); its
# address in $addr.
serve() {
  local log=$work/server-$1.log
  shift
  "$BIN/rdram" serve --listen 127.0.0.1:0 --workers 1 --memory 1GiB --hugepages off --spin-us "${SPIN_US:-0}" "$@" >"$log" 2>&1 &
  pids+=($!)
  until grep -q "^listening on" "$log"; do sleep 0.1; done
  addr=$(sed -n 's/^listening on //p' "$log")
}
measure() {
  "$BIN/rdram-bench" --server "$1" --poll adaptive ${CLIENT_SPIN_US:+--spin-us "$CLIENT_SPIN_US"} --ops get,put --sizes "$SIZES" --depth "${DEPTH:-1}" \
    --seconds "${SECONDS_EACH:-3}" --warmup 0.5 --json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print("  %-3s %8s B  p50 %8.2f us  p99 %8.2f us  %8.1f MB/s" % (r["op"], r["size"], r["p50_us"], r["p99_us"], r.get("mb_per_s", 0)))'
}
serve s1; s1=$addr
serve s2; s2=$addr
static="$s1,$s2"
for r in 1 2; do
  "$BIN/rdram" cluster create "etcd://$etcd/r$r" --replicas $r >/dev/null
  serve "r$r-a" --cluster "etcd://$etcd/r$r"
  serve "r$r-b" --cluster "etcd://$etcd/r$r"
done
echo "static list of two servers:"; measure "$static"
echo "cluster, R = 1:"; measure "etcd://$etcd/r1"
echo "cluster, R = 2:"; measure "etcd://$etcd/r2"
# What R = 2 is up against on this host: two clients at once, each putting to a server of
# its own (the bytes a replicated put moves, with no replication protocol at all).
echo "two clients at once, one static server each (this host's ceiling for R = 2):"
measure "$s1" >"$work/one" & other=$!
measure "$s2"; wait $other; cat "$work/one"
