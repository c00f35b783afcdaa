#!/usr/bin/env bash
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=$PWD/.device-bundle
export PATH=$bundle/bin:$PATH LD_LIBRARY_PATH=$bundle/lib UCX_MODULE_DIR=$bundle/lib/ucx
export PYTHONPATH=$bundle/python UCX_NET_DEVICES=lo
pylib=/tmp/pylib; mkdir -p $pylib
for f in "$bundle"/lib/*.so*; do ln -sf "$f" "$pylib/"; done
py() { LD_LIBRARY_PATH=$pylib timeout 60 python3 "$@"; }
RUST_LOG=debug rdram serve --listen 127.0.0.1:0 --workers 1 --cores 0 --memory 12GiB --hugepages off --transport fabric --provider "tcp;ofi_rxm" > $OUT/server.log 2>&1 &
sp=$!
for i in $(seq 200); do addr=$(sed -n 's/^listening on //p' $OUT/server.log | head -1); [ -n "$addr" ] && break; sleep 0.1; done
echo "addr $addr"
{
echo "== C first"; device_check $addr put c 0 1 4095 1048576 4194307 67108864 1073741824 2>&1 | tail -2; device_check $addr get c 0 1 4095 1048576 4194307 67108864 1073741824 2>&1 | tail -2; echo "== python"; RUST_LOG=debug py $bundle/gpu/torch_check.py $addr put py1 2>&1 | tail -8
echo "== C"; timeout 60 device_check $addr put c 0 1 4095 1048576 4194307 67108864 2>&1 | tail -3
echo "== python after C"; RUST_LOG=debug py $bundle/gpu/torch_check.py $addr put py2 2>&1 | tail -8
echo "== python, host tensors 64 MiB"; py -c "
import sys, torch, remote_dram as rd
c = rd.Client('$addr')
t = torch.randint(0, 256, (64<<20,), dtype=torch.uint8)
print(c.put('h64', t)); print(c.put('d64', t.cuda()))
" 2>&1 | tail -5
} > $OUT/client.txt 2>&1
kill $sp; wait $sp
grep -v "TRACE" $OUT/server.log | tail -300 > $OUT/server-tail.log
gzip -f $OUT/server.log
