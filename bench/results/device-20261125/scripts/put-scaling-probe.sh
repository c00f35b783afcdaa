#!/usr/bin/env bash
# What PUT 1 MiB shares across 8 workers (UCX shm): threads vs processes, cold vs hot.
set -uo pipefail
B=$PWD/.device-bundle
export PATH=$B/bin:$PATH LD_LIBRARY_PATH=$B/lib UCX_MODULE_DIR=$B/lib/ucx UCX_NET_DEVICES=lo UCX_TLS=${UCX_TLS:-posix,sysv,cma,self} UCX_WARN_UNUSED_ENV_VARS=n
serve() { # workers cores -> sets ADDR, SPID
  local i log=$(mktemp); taskset -c $2 rdram serve --listen 127.0.0.1:0 --workers $1 --cores $2 --memory $((2*$1))GiB --poll busy "${@:3}" >$log 2>&1 & SPID=$!
  for i in $(seq 600); do grep -q "^listening on" $log && break; sleep 0.05; done
  ADDR=$(sed -n 's/^listening on //p' $log); head -2 $log
}
bench() { rdram-bench --server $ADDR --ops put,get --sizes 1MiB --seconds 1.5 --poll busy --json --out $(mktemp -d) "$@"; }
FMT="python3 $(dirname "$0")/fmt.py"
echo "== 1 worker, 1 thread, 64 keys"; serve 1 0; bench --threads 1 --client-cores 8 | $FMT; kill $SPID; wait $SPID 2>/dev/null
echo "== 1 worker, 1 thread, 1 key 1 buffer"; serve 1 0; bench --threads 1 --client-cores 8 --keys 1 --buffers 1 | $FMT; kill $SPID; wait $SPID 2>/dev/null
echo "== 8 workers, 1 process x 8 threads, 64 keys"; serve 8 0,1,2,3,4,5,6,7; bench --threads 8 --client-cores 8,9,10,11,12,13,14,15 | $FMT; kill $SPID; wait $SPID 2>/dev/null
echo "== 8 workers, 1 process x 8 threads, 8 keys 1 buffer"; serve 8 0,1,2,3,4,5,6,7; bench --threads 8 --client-cores 8,9,10,11,12,13,14,15 --keys 8 --buffers 1 | $FMT; kill $SPID; wait $SPID 2>/dev/null
echo "== 8 workers, 8 processes x 1 thread, 64 keys (each line one process)"; serve 8 0,1,2,3,4,5,6,7
bp=(); for c in 8 9 10 11 12 13 14 15; do bench --threads 1 --client-cores $c > /tmp/p$c.txt & bp+=($!); done; wait "${bp[@]}"
cat /tmp/p*.txt | $FMT --sum; kill $SPID; wait $SPID 2>/dev/null
echo "== 8 workers, 1 process x 8 threads, 64 keys, server UCX_RNDV_SCHEME=put_zcopy (experiment only)"; UCX_RNDV_SCHEME=put_zcopy serve 8 0,1,2,3,4,5,6,7; bench --threads 8 --client-cores 8,9,10,11,12,13,14,15 | $FMT; kill $SPID; wait $SPID 2>/dev/null
declare -a A P
echo "== 8 separate servers of 1 worker, 1 client process each"
for i in 0 1 2 3 4 5 6 7; do serve 1 $i >/dev/null; A[$i]=$ADDR; P[$i]=$SPID; done
bp=(); for i in 0 1 2 3 4 5 6 7; do ADDR=${A[$i]} bench --threads 1 --client-cores $((8+i)) > /tmp/q$i.txt & bp+=($!); done; wait "${bp[@]}"
cat /tmp/q*.txt | $FMT --sum; kill ${P[@]}; wait 2>/dev/null
