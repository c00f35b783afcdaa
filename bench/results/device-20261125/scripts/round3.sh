#!/usr/bin/env bash
set -uo pipefail
cd "$(dirname "$0")/.."
B=$PWD/.device-bundle; N=$PWD/.devscripts/new
echo 4096 > /proc/sys/vm/nr_hugepages 2>/dev/null
export PATH=$B/bin:$PATH LD_LIBRARY_PATH=$B/lib UCX_MODULE_DIR=$B/lib/ucx UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n UCX_TLS=posix,sysv,cma,self
mkdir -p /tmp/nocuda && cp $B/lib/ucx/* /tmp/nocuda/ && rm -f /tmp/nocuda/*cuda*; ls /tmp/nocuda > $OUT/nocuda-modules.txt
lat() { # label modules_dir bin_dir
  local log=$(mktemp) i
  UCX_MODULE_DIR=$2 taskset -c 0 $3/rdram serve --listen 127.0.0.1:0 --workers 1 --cores 0 --memory 256MiB --poll busy > $log 2>&1 & local sp=$!
  for i in $(seq 200); do grep -q "^listening" $log && break; sleep 0.05; done
  UCX_MODULE_DIR=$2 $3/rdram-bench --server $(sed -n 's/^listening on //p' $log) --client-cores 8 --ops get,put --sizes 8 --keys 1 --buffers 1 --seconds 1 --poll busy --json --out /tmp/rb-$1 \
   | python3 .devscripts/lat.py $1
  kill $sp; wait $sp 2>/dev/null
}
amlat() { # label modules_dir
  local port=$((20000 + RANDOM % 20000))
  UCX_MODULE_DIR=$2 taskset -c 0 ucx_perftest -p $port > /dev/null 2>&1 & local sp=$!; sleep 0.3
  echo "$1 $(UCX_MODULE_DIR=$2 taskset -c 8 ucx_perftest 127.0.0.1 -p $port -t ucp_am_lat -s 8 -n 200000 -w 20000 | grep -E '^ *Final|^ +[0-9]+ ' | tail -1)"
  wait $sp 2>/dev/null
}
{ for r in 1 2 3; do
  amlat am_lat-cuda-modules $B/lib/ucx; amlat am_lat-no-cuda-modules /tmp/nocuda
  lat old-cuda-modules $B/lib/ucx $B/bin; lat new-cuda-modules $B/lib/ucx $N; lat old-no-cuda-modules /tmp/nocuda $B/bin; lat new-no-cuda-modules /tmp/nocuda $N
done; } > $OUT/latency-ab.txt 2>&1
t0=$(date +%s); log=$(mktemp -d)
taskset -c 0,1,2,3 $N/rdram serve --listen 127.0.0.1:0 --workers 4 --cores 0,1,2,3 --memory 8GiB > $log/s 2>&1 & sp=$!
for i in $(seq 400); do grep -q "^listening" $log/s && break; sleep 0.05; done
taskset -c 4-9 $N/rdram gateway --listen 127.0.0.1:0 --server $(sed -n 's/^listening on //p' $log/s) --engine-clients 16 > $log/g 2>&1 & gp=$!
for i in $(seq 400); do grep -q "^listening" $log/g && break; sleep 0.05; done
timeout 90 taskset -c 10-15 python3 .devscripts/ts_threads.py $(sed -n 's/^listening on //p' $log/g) $gp > $OUT/ts_threads.txt 2>&1
kill $sp $gp; wait $sp $gp 2>/dev/null; echo "rc in $(( $(date +%s) - t0 )) s" >> $OUT/ts_threads.txt
UCX_TLS=posix,sysv,cma,self timeout 60 bench/tensorstore_gateway.sh $N/rdram > $OUT/gateway-new.txt 2>&1
cp $N/* $B/bin/; echo "new" > $B/COMMIT
t0=$(date +%s); timeout 240 bench/compare --device-bundle .device-bundle --server-core 0 --client-core 8 --transports tcp --fabric 'shm,tcp;ofi_rxm' --scaling '' \
  --sizes 8,1MiB --seconds 1 --out /tmp/rc > $OUT/compare.log 2>&1; echo "rc $? in $(( $(date +%s) - t0 )) s" >> $OUT/compare.log
cp /tmp/rc/latest.md $OUT/compare-tcp-fabric.md 2>/dev/null
