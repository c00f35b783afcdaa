"""Where TensorStore's reads through the gateway wait: kvstore-level 4 MiB reads and writes,
one at a time and N at once, and zarr reads at several data_copy_concurrency limits."""
import os, sys, time, statistics
import numpy as np
import tensorstore as ts

addr = sys.argv[1]
kvspec = {"driver": "tsgrpc_kvstore", "address": addr, "path": "diag/"}
kv = ts.KvStore.open(kvspec).result()
size = 4 << 20
val = os.urandom(size)
n = 64
for i in range(n):
    kv.write(f"k{i}", val).result()

def timed(f):
    t = time.perf_counter(); f(); return time.perf_counter() - t

lat = [timed(lambda i=i: kv.read(f"k{i}").result()) for i in range(n)]
print(f"read 4 MiB one at a time: p50 {statistics.median(lat)*1e3:.2f} ms, {size/statistics.median(lat)/1e6:.0f} MB/s")
lat = [timed(lambda i=i: kv.write(f"k{i}", val).result()) for i in range(n)]
print(f"write 4 MiB one at a time: p50 {statistics.median(lat)*1e3:.2f} ms, {size/statistics.median(lat)/1e6:.0f} MB/s")
for par in (2, 8, 16, 64):
    for op in ("read", "write"):
        def go():
            for r in range(0, n, par):
                fs = [kv.read(f"k{i}") if op == "read" else kv.write(f"k{i}", val) for i in range(r, min(n, r + par))]
                for f in fs:
                    f.result()
        ts_ = [timed(go) for _ in range(3)]
        print(f"{op} 4 MiB, {par} at once: {n*size/statistics.median(ts_)/1e6:.0f} MB/s")
