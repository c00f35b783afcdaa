#!/usr/bin/env bash
# Device round (2026-11-26): gateway with/without TCP_NODELAY on accepted sockets, then compare.
set -uo pipefail
cd "$(dirname "$0")/.."
B=$PWD/.device-bundle
export PATH=$B/bin:$PATH LD_LIBRARY_PATH=$B/lib UCX_MODULE_DIR=$B/lib/ucx UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{ date; nproc; lscpu | head -16; cat $B/COMMIT; } > $OUT/machine.txt 2>&1
echo 4096 > /proc/sys/vm/nr_hugepages 2>/dev/null; grep HugePages_Total /proc/meminfo >> $OUT/machine.txt
# A: zarr 1 GiB through the gateway, old (HEAD d9059f6) and new (nodelay), interleaved, shm
for r in 1 2; do for b in old new; do R=$B/bin/rdram; [ $b = old ] && R=$B/bin/rdram-old; 
  el "== gateway rdram-$b round $r UCX shm" >> $OUT/gateway.txt
  UCX_TLS=posix,sysv,cma,self timeout 50 bench/tensorstore_gateway.sh $R >> $OUT/gateway.txt 2>&1; echo "rc $?" >> $OUT/gateway.txt
done; done
el "== gateway rdram-new UCX tcp" >> $OUT/gateway.txt
UCX_TLS=tcp timeout 50 bench/tensorstore_gateway.sh $B/bin/rdram >> $OUT/gateway.txt 2>&1; echo "rc $?" >> $OUT/gateway.txt
# kvstore-level 4 MiB reads/writes, one at a time and N at once
for b in old new; do R=$B/bin/rdram; [ $b = old ] && R=$B/bin/rdram-old; 
  el "== kv rdram-$b" >> $OUT/kv.txt
  log=$(mktemp -d)
  UCX_TLS=posix,sysv,cma,self taskset -c 0-3 $R serve --listen 127.0.0.1:0 --workers 4 --cores 0,1,2,3 --memory 8GiB --poll adaptive > $log/s 2>&1 & sp=$!
  for i in $(seq 400); do grep -q "^listening" $log/s && break; sleep 0.05; done
  UCX_TLS=posix,sysv,cma,self taskset -c 4-9 $R gateway --listen 127.0.0.1:0 --server $(sed -n 's/^listening on //p' $log/s) --engine-clients 16 > $log/g 2>&1 & gp=$!
  for i in $(seq 400); do grep -q "^listening" $log/g && break; sleep 0.05; done
  timeout 60 taskset -c 10-15 python3 .devscripts/ts_kv16.py $(sed -n 's/^listening on //p' $log/g) >> $OUT/kv.txt 2>&1; echo "rc $?" >> $OUT/kv.txt
  kill $sp $gp; wait
done
el "gateway done" >> $OUT/gateway.txt
# B: bench/compare, UCX shm, small and 1 MiB, with UCX's p99
timeout 240 bench/compare --device-bundle .device-bundle --server-core 0 --client-core 8 --transports shm --fabric '' \
  --sizes 8,4KiB,1MiB --seconds 1 --scaling '' --out /tmp/results > $OUT/compare.log 2>&1; el "compare rc $?" >> $OUT/compare.log
cp /tmp/results/compare-*/README.md $OUT/compare.md 2>/dev/null
# C: scaling, 1 and 8 workers
timeout 150 bench/compare --device-bundle .device-bundle --server-core 0 --client-core 8 --transports shm \
  --scaling-only --seconds 1 --scaling 1,8 --out /tmp/results-scaling > $OUT/scaling.log 2>&1; el "scaling rc $?" >> $OUT/scaling.log
cp /tmp/results-scaling/compare-*/README.md $OUT/scaling.md 2>/dev/null
(cd /tmp && tar czf $OUT/results.tgz results results-scaling) 2>/dev/null
echo 0 > /proc/sys/vm/nr_hugepages 2>/dev/null
el all done
