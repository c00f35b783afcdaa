#!/usr/bin/env bash
# The original two-node scenario on one machine: a server holds DRAM, a writer process
# stores tensors and exits, a separate reader process fetches them and checks every byte.
set -euo pipefail
RDRAM=${1:-target/release/rdram}
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
work=$(mktemp -d)
trap 'kill $server_pid 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

echo "== starting a server: 2 workers, 512 MiB of DRAM, adaptive polling"
"$RDRAM" serve --listen 127.0.0.1:0 --workers 2 --memory 512MiB >"$work/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 100); do grep -q "listening on" "$work/server.log" && break; sleep 0.1; done
cat "$work/server.log"
export RDRAM_SERVER=$(sed -n 's/^listening on //p' "$work/server.log")

echo "== writer process: one value per size"
for size in 1 8192 1048576 67108864; do
  head -c $size /dev/urandom >"$work/tensor-$size"
  gen=$("$RDRAM" put "tensor/$size" --file "$work/tensor-$size")
  echo "put tensor/$size ($size bytes) -> generation $gen"
done
"$RDRAM" put greeting "hello from remote DRAM" >/dev/null

echo "== reader process: fetch and compare"
for size in 1 8192 1048576 67108864; do
  start=$(date +%s%N)
  "$RDRAM" get "tensor/$size" --out "$work/read-$size"
  end=$(date +%s%N)
  cmp -s "$work/tensor-$size" "$work/read-$size" && ok=identical || ok=DIFFERENT
  echo "get tensor/$size: $ok ($(( (end - start) / 1000000 )) ms including process start)"
done
echo "greeting: $("$RDRAM" get greeting)"
echo "== listing and stats"
"$RDRAM" ls
"$RDRAM" stats | python3 -c '
import json, sys
s = json.load(sys.stdin)
print("keys=%d, %d of %d bytes used" % (s["keys"], s["used_bytes"], s["capacity_bytes"]))'
"$RDRAM" get missing-key || echo "(missing key: exit code $?)"
