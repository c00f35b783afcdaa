#!/usr/bin/env bash
# Device round 4 (2026-11-26): Read replies as one message per value (READ_CHUNK 4 MiB, rdram-c4m) against 1 MiB parts (rdram-head).
set -uo pipefail
cd "$(dirname "$0")/.."
B=$PWD/.device-bundle
export PATH=$B/bin:$PATH LD_LIBRARY_PATH=$B/lib UCX_MODULE_DIR=$B/lib/ucx UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n UCX_TLS=posix,sysv,cma,self
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
for r in 1 2; do for b in head c4m; do
  el "== zarr rdram-$b round $r" >> $OUT/chunk.txt
  timeout 40 bench/tensorstore_gateway.sh $B/bin/rdram-$b >> $OUT/chunk.txt 2>&1; echo "rc $?" >> $OUT/chunk.txt
done; done
for b in head c4m; do
  el "== kv rdram-$b" >> $OUT/chunk.txt
  log=$(mktemp -d)
  taskset -c 0-3 $B/bin/rdram-$b serve --listen 127.0.0.1:0 --workers 4 --cores 0,1,2,3 --memory 8GiB --poll adaptive > $log/s 2>&1 & sp=$!
  for i in $(seq 400); do grep -q "^listening" $log/s && break; sleep 0.05; done
  taskset -c 4-9 $B/bin/rdram-$b gateway --listen 127.0.0.1:0 --server $(sed -n 's/^listening on //p' $log/s) --engine-clients 16 > $log/g 2>&1 & gp=$!
  for i in $(seq 400); do grep -q "^listening" $log/g && break; sleep 0.05; done
  timeout 40 taskset -c 10-15 python3 .devscripts/ts_kv16.py $(sed -n 's/^listening on //p' $log/g) >> $OUT/chunk.txt 2>&1; echo "rc $?" >> $OUT/chunk.txt
  kill $sp $gp; wait
done
el done >> $OUT/chunk.txt
