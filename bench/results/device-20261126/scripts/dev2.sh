#!/usr/bin/env bash
# Device round 2 (2026-11-26): the gateway driven by rdram-gateway-load (tonic) against TensorStore, same binaries.
set -uo pipefail
cd "$(dirname "$0")/.."
B=$PWD/.device-bundle
export PATH=$B/bin:$PATH LD_LIBRARY_PATH=$B/lib UCX_MODULE_DIR=$B/lib/ucx UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
cpu() { awk '{print $14+$15}' /proc/$1/stat; }
cat $B/COMMIT > $OUT/load.txt
for tls in posix,sysv,cma,self tcp; do
  export UCX_TLS=$tls
  log=$(mktemp -d)
  taskset -c 0-3 $B/bin/rdram serve --listen 127.0.0.1:0 --workers 4 --cores 0,1,2,3 --memory 8GiB --poll adaptive > $log/s 2>&1 & sp=$!
  for i in $(seq 400); do grep -q "^listening" $log/s && break; sleep 0.05; done
  taskset -c 4-9 $B/bin/rdram gateway --listen 127.0.0.1:0 --server $(sed -n 's/^listening on //p' $log/s) --engine-clients 16 > $log/g 2>&1 & gp=$!
  for i in $(seq 400); do grep -q "^listening" $log/g && break; sleep 0.05; done
  ga=$(sed -n 's/^listening on //p' $log/g)
  for cfg in "4 16" "4 64" "8 32" "16 64" "1 1"; do
    set -- $cfg
    el "== UCX_TLS=$tls connections $1 in flight $2 (load on cores 10-15, 6 threads)" >> $OUT/load.txt
    c0=$(cpu $gp); s0=$(cpu $sp)
    timeout 30 taskset -c 10-15 $B/bin/rdram-gateway-load --gateway $ga --connections $1 --concurrency $2 --seconds 2 --threads 6 >> $OUT/load.txt 2>&1; echo "rc $? gateway cpu ticks $(( $(cpu $gp) - c0 )) server $(( $(cpu $sp) - s0 ))" >> $OUT/load.txt
  done
  kill $sp $gp; wait
done
el "== TensorStore, same binaries" >> $OUT/load.txt
UCX_TLS=posix,sysv,cma,self timeout 50 bench/tensorstore_gateway.sh $B/bin/rdram >> $OUT/load.txt 2>&1; echo "rc $?" >> $OUT/load.txt
el all done >> $OUT/load.txt
