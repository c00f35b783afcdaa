#!/usr/bin/env bash
# Device round 1: machine, bench/compare (UCX shm + scaling), the PUT probe, the gateway.
set -uo pipefail
cd "$(dirname "$0")/.."
B=$PWD/.device-bundle
{ date; nproc; lscpu; numactl -H 2>&1 | head -20; grep -i huge /proc/meminfo; cat /sys/kernel/mm/transparent_hugepage/enabled; uname -a; python3 -c 'import tensorstore, numpy; print("tensorstore", tensorstore.__version__, "numpy", numpy.__version__)'; } > $OUT/machine.txt 2>&1
echo 4096 > /proc/sys/vm/nr_hugepages 2>/dev/null; grep HugePages_Total /proc/meminfo >> $OUT/machine.txt
t0=$(date +%s)
timeout 320 bench/compare --device-bundle .device-bundle --server-core 0 --client-core 8 --transports shm --fabric '' \
  --sizes 8,4KiB,1MiB,16MiB --seconds 1 --scaling 1,2,4,8 --out /tmp/results > $OUT/compare-shm.log 2>&1; echo "compare rc $? in $(( $(date +%s) - t0 )) s" >> $OUT/compare-shm.log
cp /tmp/results/latest.md $OUT/compare-shm.md 2>/dev/null; (cd /tmp && tar czf $OUT/results-shm.tgz results) 2>/dev/null
t0=$(date +%s); timeout 120 .devscripts/put_probe.sh > $OUT/put_probe.txt 2>&1; echo "probe rc $? in $(( $(date +%s) - t0 )) s" >> $OUT/put_probe.txt
source $B/env.sh 2>/dev/null || export PATH=$B/bin:$PATH LD_LIBRARY_PATH=$B/lib UCX_MODULE_DIR=$B/lib/ucx UCX_NET_DEVICES=lo
for tls in posix,sysv,cma,self tcp; do
  t0=$(date +%s); UCX_TLS=$tls timeout 70 bench/tensorstore_gateway.sh $B/bin/rdram >> $OUT/gateway.txt 2>&1; echo "gateway $tls rc $? in $(( $(date +%s) - t0 )) s" >> $OUT/gateway.txt
done
