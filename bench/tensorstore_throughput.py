"""zarr write and read throughput of one array through `rdram gateway`, next to
TensorStore's own `memory` driver and its `file` driver on /dev/shm, in the same run.

  python bench/tensorstore_throughput.py GATEWAY_ADDR [--mib 256] [--chunk-mib 4] [--repeat 3]

Uncompressed zarr v2 chunks, so the figures are the storage path's, not a codec's.
Prints a markdown table (median of --repeat runs for each figure).
"""

import argparse
import shutil
import statistics
import tempfile
import time

import numpy as np
import tensorstore as ts


def spec(kvstore, side, chunk_side):
    return {"driver": "zarr", "kvstore": kvstore,
            "metadata": {"shape": [side, side], "chunks": [chunk_side, chunk_side], "dtype": "<f4", "compressor": None}}


def measure(kvstore, data, chunk_side, repeat):
    writes, reads = [], []
    for _ in range(repeat):
        ctx = ts.Context()
        t = ts.open(spec(kvstore, data.shape[0], chunk_side), create=True, delete_existing=True, context=ctx).result()
        start = time.perf_counter()
        t.write(data).result()
        writes.append(time.perf_counter() - start)
        # Read through a fresh handle (same context: the memory driver lives in it).
        t = ts.open({"driver": "zarr", "kvstore": kvstore}, open=True, context=ctx).result()
        start = time.perf_counter()
        back = t.read().result()
        reads.append(time.perf_counter() - start)
        assert np.array_equal(back, data), "read back differs"
    mb = data.nbytes / 1e6
    return mb / statistics.median(writes), mb / statistics.median(reads)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gateway")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--chunk-mib", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    side = int((args.mib << 20) // 4) ** 0.5
    side = int(side)
    chunk_side = int(((args.chunk_mib << 20) // 4) ** 0.5)
    data = np.random.default_rng(1).random((side, side), dtype=np.float32)

    shm = tempfile.mkdtemp(prefix="ts-bench-", dir="/dev/shm")
    try:
        rows = [
            ("remote_dram via `rdram gateway` (tsgrpc_kvstore)", {"driver": "tsgrpc_kvstore", "address": args.gateway, "path": "bench/"}),
            ("TensorStore `memory`", {"driver": "memory", "path": "bench/"}),
            ("TensorStore `file` on /dev/shm", {"driver": "file", "path": shm + "/"}),
        ]
        print(f"zarr v2, {data.nbytes >> 20} MiB float32 {side}x{side}, {chunk_side}x{chunk_side} chunks "
              f"({chunk_side * chunk_side * 4 >> 20} MiB, uncompressed), median of {args.repeat}\n")
        print("| kvstore | write MB/s | read MB/s |\n|---|---|---|")
        for name, kv in rows:
            w, r = measure(kv, data, chunk_side, args.repeat)
            print(f"| {name} | {w:.0f} | {r:.0f} |")
    finally:
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
