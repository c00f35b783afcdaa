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
for par in (2, 4, 8, 16, 64):
    for op in ("read", "write"):
        def go():
            for r in range(0, n, par):
                fs = [kv.read(f"k{i}") if op == "read" else kv.write(f"k{i}", val) for i in range(r, min(n, r + par))]
                for f in fs:
                    f.result()
        ts_ = [timed(go) for _ in range(3)]
        print(f"{op} 4 MiB, {par} at once: {n*size/statistics.median(ts_)/1e6:.0f} MB/s")

side, chunk = 16384, 1024
data = np.random.default_rng(1).random((side, side), dtype=np.float32)
zspec = {"driver": "zarr", "kvstore": {"driver": "tsgrpc_kvstore", "address": addr, "path": "diagz/"},
         "metadata": {"shape": [side, side], "chunks": [chunk, chunk], "dtype": "<f4", "compressor": None}}
t = ts.open(zspec, create=True, delete_existing=True).result()
t.write(data).result()
for lim in (4, 6, 16, 64):
    ctx = ts.Context({"data_copy_concurrency": {"limit": lim}})
    t = ts.open({"driver": "zarr", "kvstore": zspec["kvstore"]}, open=True, context=ctx).result()
    ts_ = [timed(lambda: t.read().result()) for _ in range(3)]
    tw = ts.open(zspec, create=True, delete_existing=True, context=ctx).result()
    ws = [timed(lambda: tw.write(data).result()) for _ in range(3)]
    print(f"zarr 1 GiB, data_copy_concurrency {lim}: read {data.nbytes/statistics.median(ts_)/1e6:.0f} MB/s, write {data.nbytes/statistics.median(ws)/1e6:.0f} MB/s")
