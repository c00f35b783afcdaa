#!/usr/bin/env bash
# A/B: spin with spin_loop (old) vs spin with yield (new). Adaptive polling, default spin.
set -u
export UCX_NET_DEVICES=lo UCX_TLS=posix,sysv,cma,self
one() { # bin label serve-extra bench-extra nservers sizes
  local B=$1 w=$(mktemp -d) pids=() addrs=()
  for n in $(seq $5); do
    $B/rdram serve --listen 127.0.0.1:0 --workers 1 --memory 256MiB --hugepages off $3 > $w/$n.log 2>&1 & pids+=($!)
  done
  for n in $(seq $5); do until grep -q "^listening on" $w/$n.log; do sleep 0.1; done; addrs+=($(sed -n 's/^listening on //p' $w/$n.log)); done
  local t=$(IFS=,; echo "${addrs[*]}")
  $B/rdram-bench --server $t --ops get,put --sizes $6 --seconds 2 --warmup 0.3 --poll adaptive $4 2>&1 | grep -E '^\| (get|put)' | sed "s/^/$2 /"
  kill ${pids[*]}; wait ${pids[*]} 2>/dev/null; rm -rf $w
}
for i in 1 2 3; do
  for v in old new; do
    one /tmp/$v-bin "$v 1srv-pinned" "--cores 0" "--client-cores 1" 1 8,1MiB
    one /tmp/$v-bin "$v 1srv-free  " "" "" 1 8
    one /tmp/$v-bin "$v 2srv-free  " "" "" 2 8
  done
done
