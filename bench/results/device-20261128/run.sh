#!/usr/bin/env bash
# One device visit: what replication costs on 16 cores (bench/replication.sh), R = 1 vs
# R = 2 vs a static list, 8 B and 1 MiB, three rounds with idle-sleeping servers
# (--spin-us 0) and one with the default adaptive spin (200 us).
set -u
d=$(cd "$(dirname "$0")" && pwd)
out=${1:?output folder}
mkdir -p "$out"
export PATH=$d/bin:$PATH LD_LIBRARY_PATH=$d/lib UCX_MODULE_DIR=$d/lib/ucx
{ git rev-parse --short HEAD 2>/dev/null; nproc; lscpu | grep -E 'Model name|^CPU\(s\)|NUMA node'; rdram --version; } > "$out/machine.txt" 2>&1
for i in 1 2 3; do
  echo "== round $i, --spin-us 0" >> "$out/replication.txt"
  BIN=$d/bin SECONDS_EACH=2 timeout 120 bench/replication.sh 8,1MiB >> "$out/replication.txt" 2>&1
  echo "rc=$?" >> "$out/replication.txt"
done
echo "== round 4, --spin-us 200 (the default)" >> "$out/replication.txt"
BIN=$d/bin SECONDS_EACH=2 SPIN_US=200 timeout 120 bench/replication.sh 8,1MiB >> "$out/replication.txt" 2>&1
echo "rc=$?" >> "$out/replication.txt"
cat "$out/replication.txt"
