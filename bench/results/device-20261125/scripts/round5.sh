#!/usr/bin/env bash
set -uo pipefail
cd "$(dirname "$0")/.."
B=$PWD/.device-bundle; N=$PWD/.devscripts/new
export PATH=$B/bin:$PATH LD_LIBRARY_PATH=$B/lib UCX_MODULE_DIR=$B/lib/ucx UCX_NET_DEVICES=lo UCX_WARN_UNUSED_ENV_VARS=n
unset UCX_TLS
lat() { # label bin_dir
  local log=$(mktemp) i
  taskset -c 0 $2/rdram serve --listen 127.0.0.1:0 --workers 1 --cores 0 --memory 1GiB --poll busy > $log 2>&1 & local sp=$!
  for i in $(seq 200); do grep -q "^listening" $log && break; sleep 0.05; done
  $2/rdram-bench --server $(sed -n 's/^listening on //p' $log) --client-cores 8 --ops get,put --sizes 8,1MiB --keys 1 --buffers 1 --seconds 1 --poll busy --json --out /tmp/rb-$1 | python3 .devscripts/lat.py "$1"
  kill $sp; wait $sp 2>/dev/null
}
for r in 1 2 3; do lat old-3504f83-default-tls $B/bin; lat new-default-tls $N; done > $OUT/round5.txt 2>&1
