#!/usr/bin/env bash
set -uo pipefail
cd "$(dirname "$0")/.."
B=$PWD/.device-bundle
echo 4096 > /proc/sys/vm/nr_hugepages 2>/dev/null
export PATH=$B/bin:$PATH LD_LIBRARY_PATH=$B/lib UCX_MODULE_DIR=$B/lib/ucx UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n
t0=$(date +%s); UCX_TLS=posix,sysv,cma,self timeout 110 .devscripts/ts_diag.sh $B/bin/rdram > $OUT/ts_diag.txt 2>&1; echo "rc $? in $(( $(date +%s) - t0 )) s" >> $OUT/ts_diag.txt
t0=$(date +%s); timeout 200 bench/compare --device-bundle .device-bundle --server-core 0 --client-core 8 --transports shm --scaling-only \
  --seconds 1 --scaling 1,2,4,8 --out /tmp/rs > $OUT/scaling.log 2>&1; echo "rc $? in $(( $(date +%s) - t0 )) s" >> $OUT/scaling.log
cp /tmp/rs/latest.md $OUT/scaling.md 2>/dev/null
t0=$(date +%s); timeout 250 bench/compare --device-bundle .device-bundle --server-core 0 --client-core 8 --transports shm --fabric '' --scaling '' \
  --sizes 8,4KiB,1MiB,16MiB --seconds 1 --out /tmp/rc > $OUT/compare.log 2>&1; echo "rc $? in $(( $(date +%s) - t0 )) s" >> $OUT/compare.log
cp /tmp/rc/latest.md $OUT/compare-shm.md 2>/dev/null
(cd /tmp && tar czf $OUT/results.tgz rs rc) 2>/dev/null
