#!/usr/bin/env bash
# One client against two servers with adaptive polling: GET 8 B through a two-server static
# list, servers spinning SPIN us before sleeping, pinned or not.
set -u
d=$(cd "$(dirname "$0")" && pwd)
export PATH=$d/bin:$PATH LD_LIBRARY_PATH=$d/lib UCX_MODULE_DIR=$d/lib/ucx UCX_NET_DEVICES=lo UCX_TLS=posix,sysv,cma,self
echo "cpu.max: $(cat /sys/fs/cgroup/cpu.max 2>/dev/null) nproc $(nproc) affinity: $(taskset -pc $$)"
run() { # SPIN TARGETS CLIENT_POLL PIN(y/n)
  local w=$(mktemp -d) pa pb a b pre_a= pre_b= pre_c=
  [ "$4" = y ] && pre_a="taskset -c 2" pre_b="taskset -c 4" pre_c="taskset -c 6"
  $pre_a rdram serve --listen 127.0.0.1:0 --workers 1 --memory 256MiB --hugepages off --spin-us $1 > $w/a.log 2>&1 & pa=$!
  $pre_b rdram serve --listen 127.0.0.1:0 --workers 1 --memory 256MiB --hugepages off --spin-us $1 > $w/b.log 2>&1 & pb=$!
  until grep -q "^listening on" $w/a.log && grep -q "^listening on" $w/b.log; do sleep 0.1; done
  a=$(sed -n 's/^listening on //p' $w/a.log); b=$(sed -n 's/^listening on //p' $w/b.log)
  local t=$a; [ $2 = 2 ] && t="$a,$b"
  echo "spin $1 us, $2 server(s), client --poll $3, pinned $4: $($pre_c rdram-bench --server $t --ops get --sizes 8 --seconds 2 --warmup 0.3 --poll $3 2>&1 | grep '| get')"
  kill $pa $pb; wait $pa $pb 2>/dev/null; rm -rf $w
}
run 200 1 adaptive n
run 200 2 adaptive n
run 200 2 adaptive y
run 200 2 busy n
run 0 2 adaptive n
run 20 2 adaptive n
run 200 1 adaptive y
