#!/usr/bin/env bash
# Device visit: #62's prepared check, then UCX's own device-memory path (ucx_perftest with
# CUDA memory) beside it, same machine, same run.
set -uo pipefail
cd "$(dirname "$0")/.."
B=$PWD/.device-bundle
T0=$SECONDS; el() { echo "[$((SECONDS - T0)) s] $*"; }
timeout 330 $B/gpu-check $B /tmp/gpu > $OUT/gpu-check.log 2>&1; el "gpu-check rc $?" >> $OUT/gpu-check.log
cp /tmp/gpu/summary.txt $OUT/summary.txt 2>/dev/null
grep -h '^{' /tmp/gpu/shm-bench.txt > $OUT/bench.jsonl 2>/dev/null
export PATH=$B/bin:$PATH LD_LIBRARY_PATH=$B/lib UCX_MODULE_DIR=$B/lib/ucx UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n
{
ucx_info -d | grep -E 'Transport|Memory domain' ; 
port=13337
for t in ucp_am_bw ucp_put_bw ucp_get; do for m in cuda,host host,cuda host,host; do for s in 1048576 67108864; do
  n=2000; [ $s = 67108864 ] && n=40
  [ $((SECONDS - T0)) -gt 420 ] && { el "out of time"; break 3; }
  port=$((port + 1))
  taskset -c 0 ucx_perftest -p $port > /tmp/pt-server.log 2>&1 & sp=$!
  sleep 0.5
  el "== $t -m $m -s $s"
  taskset -c 8 timeout 30 ucx_perftest 127.0.0.1 -p $port -t $t -m $m -s $s -n $n -w 5 2>&1 | tail -3
  kill $sp 2>/dev/null; wait $sp 2>/dev/null
done; done; done
} > $OUT/ucx-device-path.txt 2>&1
(cd /tmp && tar czf $OUT/gpu.tgz gpu) 2>/dev/null
el "all done" >> $OUT/gpu-check.log
