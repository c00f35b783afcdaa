#!/usr/bin/env bash
# Device round 3 (2026-11-26): bench/compare UCX shm at 16 MiB (large values, cache-hot one key and 16 buffers).
set -uo pipefail
cd "$(dirname "$0")/.."
echo 4096 > /proc/sys/vm/nr_hugepages 2>/dev/null
timeout 200 bench/compare --device-bundle .device-bundle --server-core 0 --client-core 8 --transports shm --fabric '' \
  --sizes 16MiB --seconds 1 --scaling '' --out /tmp/results > $OUT/compare16.log 2>&1; echo "compare rc $?" >> $OUT/compare16.log
cp /tmp/results/compare-*/README.md $OUT/compare16.md 2>/dev/null
echo 0 > /proc/sys/vm/nr_hugepages 2>/dev/null
