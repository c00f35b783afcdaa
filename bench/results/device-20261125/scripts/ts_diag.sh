#!/usr/bin/env bash
# server + gateway pinned as bench/tensorstore_gateway.sh, then ts_reads.py on TS_CORES
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
RDRAM=$1; PY=${PY:-python3}
export UCX_NET_DEVICES=lo
log=$(mktemp -d)
taskset -c ${SC:-0,1,2,3} $RDRAM serve --listen 127.0.0.1:0 --workers ${SW:-4} --cores ${SC:-0,1,2,3} --memory 8GiB --poll adaptive > $log/s 2>&1 & sp=$!
for i in $(seq 400); do grep -q "^listening" $log/s && break; sleep 0.05; done
taskset -c ${GC:-4-9} $RDRAM gateway --listen 127.0.0.1:0 --server $(sed -n 's/^listening on //p' $log/s) --engine-clients 16 > $log/g 2>&1 & gp=$!
for i in $(seq 400); do grep -q "^listening" $log/g && break; sleep 0.05; done
taskset -c ${TC:-10-15} $PY $root/.devscripts/ts_reads.py $(sed -n 's/^listening on //p' $log/g)
kill $sp $gp; wait
