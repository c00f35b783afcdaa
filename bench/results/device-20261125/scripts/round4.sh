#!/usr/bin/env bash
set -uo pipefail
cd "$(dirname "$0")/.."
B=$PWD/.device-bundle; N=$PWD/.devscripts/new
export PATH=$B/bin:$PATH LD_LIBRARY_PATH=$B/lib UCX_MODULE_DIR=$B/lib/ucx UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n
lat() { # label bin_dir client_core
  local log=$(mktemp) i
  taskset -c 0 $2/rdram serve --listen 127.0.0.1:0 --workers 1 --cores 0 --memory 256MiB --poll busy > $log 2>&1 & local sp=$!
  for i in $(seq 200); do grep -q "^listening" $log && break; sleep 0.05; done
  $2/rdram-bench --server $(sed -n 's/^listening on //p' $log) --client-cores $3 --ops get,put --sizes 8 --keys 1 --buffers 1 --seconds 1 --poll busy --json --out /tmp/rb-$1 | python3 .devscripts/lat.py "$1 client-core $3"
  kill $sp; wait $sp 2>/dev/null
}
amlat() { # label client_core
  local port=$((20000 + RANDOM % 20000))
  taskset -c 0 ucx_perftest -p $port > /dev/null 2>&1 & local sp=$!; sleep 0.3
  echo "$1 client-core $2 $(taskset -c $2 ucx_perftest 127.0.0.1 -p $port -t ucp_am_lat -s 8 -n 100000 -w 10000 | grep -E '^ *Final|^ +[0-9]+ ' | tail -1)"
  wait $sp 2>/dev/null
}
{ echo "# UCX_TLS unset (all transports, CUDA modules present)"
for r in 1 2 3; do amlat am_lat-default-tls 8; lat old-default-tls $B/bin 8; lat new-default-tls $N 8; done
echo "# UCX_TLS=posix,sysv,cma,self, client core placement"
export UCX_TLS=posix,sysv,cma,self
for r in 1 2; do for c in 1 8 15; do amlat am_lat $c; lat new $N $c; done; done
} > $OUT/round4.txt 2>&1
