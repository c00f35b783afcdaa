"""zarr write and read throughput of one array through `rdram gateway`, next to
TensorStore's own `memory` driver and its `file` driver on /dev/shm, in the same run.

  python bench/tensorstore_throughput.py GATEWAY_ADDR [--mib 256] [--chunk-mib 4] [--repeat 3]
      [--cpu-of gateway=PID --cpu-of server=PID]

Uncompressed zarr v2 chunks, so the figures are the storage path's, not a codec's.
Prints a markdown table (median of --repeat runs for each figure), then the CPU time each
process spent per GB: TensorStore's (this process) with each kvstore, and, through the
gateway, that of each --cpu-of process. On a machine with C cores, C / (the sum) bounds the
gateway's throughput, and C / (TensorStore's alone) bounds it whatever the gateway and the
server cost; TensorStore's figure with the `memory` driver is its cost without gRPC.
"""

import os

import argparse
import shutil
import statistics
import tempfile
import time

import numpy as np
import tensorstore as ts


TS = "TensorStore (this process)"


def spec(kvstore, side, chunk_side):
    return {"driver": "zarr", "kvstore": kvstore,
            "metadata": {"shape": [side, side], "chunks": [chunk_side, chunk_side], "dtype": "<f4", "compressor": None}}


def cpu_seconds(pid):
    """User + system CPU time of a process, its exited threads included."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(kvstore, data, chunk_side, repeat, pids):
    """Median write and read MB/s, and the CPU seconds each of `pids` spent in all the
    writes and in all the reads."""
    writes, reads = [], []
    cpu = {phase: dict.fromkeys(pids, 0.0) for phase in ("write", "read")}

    def timed(phase, times, work):
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        start = time.perf_counter()
        result = work()
        times.append(time.perf_counter() - start)
        for name, pid in pids.items():
            cpu[phase][name] += cpu_seconds(pid) - before[name]
        return result

    for _ in range(repeat):
        ctx = ts.Context()
        t = ts.open(spec(kvstore, data.shape[0], chunk_side), create=True, delete_existing=True, context=ctx).result()
        timed("write", writes, lambda: t.write(data).result())
        # Read through a fresh handle (same context: the memory driver lives in it).
        t = ts.open({"driver": "zarr", "kvstore": kvstore}, open=True, context=ctx).result()
        back = timed("read", reads, lambda: t.read().result())
        assert np.array_equal(back, data), "read back differs"
    mb = data.nbytes / 1e6
    return mb / statistics.median(writes), mb / statistics.median(reads), cpu


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gateway")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--chunk-mib", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cpu-of", action="append", default=[], metavar="NAME=PID",
                   help="also report this process's CPU time per GB through the gateway (e.g. gateway=PID)")
    args = p.parse_args()
    pids = {TS: os.getpid()}
    pids.update(entry.split("=", 1) for entry in args.cpu_of)
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
        cpu = {}
        for name, kv in rows:
            w, r, cpu[name] = measure(kv, data, chunk_side, args.repeat, pids if kv is rows[0][1] else {TS: os.getpid()})
            print(f"| {name} | {w:.0f} | {r:.0f} |")
        gb = args.repeat * data.nbytes / 1e9
        via = cpu[rows[0][0]]
        print("\nCPU seconds per GB\n\n| process | write | read |\n|---|---|---|")
        for name, kv in rows[1:]:
            print(f"| {TS}, {name} | {cpu[name]['write'][TS] / gb:.2f} | {cpu[name]['read'][TS] / gb:.2f} |")
        for name in pids:
            print(f"| {name}{', via the gateway' if name == TS else ''} | {via['write'][name] / gb:.2f} | {via['read'][name] / gb:.2f} |")
        cores = len(os.sched_getaffinity(0))
        for phase in ("write", "read"):
            total, own = sum(via[phase].values()) / gb, via[phase][TS] / gb
            print(f"\n{phase} through the gateway on {cores} cores: at most {cores / total:.2f} GB/s for the CPU "
                  f"all the processes above use, at most {cores / own:.2f} GB/s for TensorStore's alone", end="")
        print()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
