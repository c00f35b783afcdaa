"""Per-thread CPU of TensorStore (this process) and the gateway during zarr writes and reads:
whether one thread (a connection's) is saturated."""
import os, sys, time
import numpy as np
import tensorstore as ts

addr, gw_pid = sys.argv[1], int(sys.argv[2])
tck = os.sysconf("SC_CLK_TCK")

def threads(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                s = f.read()
            name = s[s.index("(") + 1:s.rindex(")")]
            fl = s.rsplit(")", 1)[1].split()
            out[tid] = (name, (int(fl[11]) + int(fl[12])) / tck)
        except (OSError, ValueError):
            pass
    return out

def report(label, before, after, secs):
    rows = []
    for tid, (name, cpu) in after.items():
        d = cpu - before.get(tid, (name, 0.0))[1]
        if d > 0.02 * secs:
            rows.append((d / secs, name))
    rows.sort(reverse=True)
    print(f"  {label}: total {sum(r[0] for r in rows):.2f} cores; top threads " + ", ".join(f"{n} {c:.0%}" for c, n in rows[:8]))

side, chunk = 16384, 1024
data = np.random.default_rng(1).random((side, side), dtype=np.float32)
kv = {"driver": "tsgrpc_kvstore", "address": addr, "path": "thr/"}
spec = {"driver": "zarr", "kvstore": kv, "metadata": {"shape": [side, side], "chunks": [chunk, chunk], "dtype": "<f4", "compressor": None}}
for phase in ("write", "read"):
    t = ts.open(spec, create=True, delete_existing=True).result() if phase == "write" else ts.open({"driver": "zarr", "kvstore": kv}, open=True).result()
    b_ts, b_gw = threads(os.getpid()), threads(gw_pid)
    start = time.perf_counter()
    for _ in range(3):
        (t.write(data) if phase == "write" else t.read()).result()
    secs = time.perf_counter() - start
    a_ts, a_gw = threads(os.getpid()), threads(gw_pid)
    print(f"{phase}: {3 * data.nbytes / secs / 1e6:.0f} MB/s")
    report("TensorStore", b_ts, a_ts, secs)
    report("gateway", b_gw, a_gw, secs)
