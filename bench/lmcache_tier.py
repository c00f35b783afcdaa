#!/usr/bin/env python3
"""LMCache's remote tier on remote_dram against the same tier on Redis, in one run.

Starts `rdram serve` (UCX shared memory, and UCX tcp), `redis-server` and LMCache's own
`lm` server on loopback ports, then, for each tier, one process with LMCache's own
RemoteBackend (the layer its StorageManager calls) that stores CHUNKS chunks of KV cache
(TOKENS tokens x LAYERS layers x 8 heads x 128 dims, bfloat16) one chunk a call (p50 and
p99 per chunk), then in one batch, and loads them back the same ways; ROUNDS rounds, each
running every tier in turn in a process of its own (so noise lands on all of them alike);
prints medians of the batches and percentiles of the one-chunk calls. Tiers: remote_dram
over UCX shm (with and without chunk metadata), UCX tcp and libfabric tcp;ofi_rxm,
LMCache's Redis connectors (redis://, redis-py; resp://, its native client) and its lm://
server.

    target/venv-python/bin/python bench/lmcache_tier.py [--chunks 16] [--tokens 256] [--layers 32] [--rounds 5]

Needs LMCache and remote_dram in the interpreter's environment (python/tests/run.sh puts
both in target/venv-python) and redis-server (`make redis`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def config_yaml(url: str, save_chunk_meta: bool, cpu_gb: float) -> str:
    extra = [f"  save_chunk_meta: {str(save_chunk_meta).lower()}"]
    lines = ["chunk_size: 256", "local_cpu: true", f"max_local_cpu_size: {cpu_gb}", f'remote_url: "{url}"', 'remote_serde: "naive"']
    if url.startswith("remote_dram://"):
        lines.append('remote_storage_plugins: ["remote_dram"]')
        extra += [
            "  remote_storage_plugin.remote_dram.module_path: remote_dram.lmcache",
            "  remote_storage_plugin.remote_dram.class_name: RemoteDramConnectorAdapter",
            "  remote_dram.timeout: 30",
        ]
    return "\n".join(lines + ["extra_config:"] + extra) + "\n"


def one_tier(args) -> dict:
    """Runs in a process of its own: LMCache's RemoteBackend for `args.url`."""
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    chunk_bytes = 2 * args.layers * args.tokens * 1024 * 2
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(config_yaml(args.url, args.save_chunk_meta, cpu_gb=max(1.0, 2.5 * args.chunks * chunk_bytes / 1e9)))
    config = LMCacheEngineConfig.from_file(f.name)
    metadata = LMCacheMetadata(
        model_name="bench/model", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=(args.layers, 2, args.tokens, 8, 128), chunk_size=args.tokens,
    )
    loop = asyncio.new_event_loop()
    import threading

    threading.Thread(target=loop.run_forever, daemon=True).start()
    cpu = LocalCPUBackend(config=config, metadata=metadata, dst_device="cpu")
    backend = RemoteBackend(config=config, metadata=metadata, loop=loop, local_cpu_backend=cpu, dst_device="cpu")
    shape = torch.Size([2, args.layers, args.tokens, 1024])
    keys = [CacheEngineKey("bench/model", 1, 0, 1000 + i, torch.bfloat16) for i in range(args.chunks)]
    objs = []
    for i in range(args.chunks):
        obj = cpu.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
        obj.tensor.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16))
        objs.append(obj)
    conn = backend.connection

    def put(ks, os_):
        for obj in os_:
            obj.ref_count_up()  # the connector's wrapper releases one reference a store
        if conn.support_batched_put():
            coro = conn.batched_put(ks, os_)
        else:
            async def each():
                await asyncio.gather(*(conn.put(k, o) for k, o in zip(ks, os_)))
            coro = each()
        asyncio.run_coroutine_threadsafe(coro, loop).result()

    # One chunk a call, one call at a time: latency per chunk.
    single_store, single_load = [], []
    for _ in range(args.rounds):
        for k, o in zip(keys, objs):
            start = time.perf_counter()
            put([k], [o])
            single_store.append(time.perf_counter() - start)
            start = time.perf_counter()
            got = backend.get_blocking(k)
            single_load.append(time.perf_counter() - start)
            assert got is not None, "a chunk just stored is missing"
            got.ref_count_down()
    store, load = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        put(keys, objs)
        store.append(time.perf_counter() - start)
        start = time.perf_counter()
        got = backend.batched_get_blocking(keys)
        load.append(time.perf_counter() - start)
        assert all(g is not None for g in got), f"{sum(g is None for g in got)} of {len(got)} chunks missing"
        assert torch.equal(got[0].tensor.view(torch.uint8), objs[0].tensor.view(torch.uint8))
        for g in got:
            g.ref_count_down()
    # LMCache 0.5.6's Redis connectors never finish close() (their executor waits on the
    # event loop that runs it): give it 5 s, the process exits regardless.
    closer = threading.Thread(target=backend.close, daemon=True)
    closer.start()
    closer.join(5)
    return {"single_store": single_store, "single_load": single_load, "store": store, "load": load}


def summary(runs: list[dict], chunks: int, chunk_bytes: int) -> dict:
    """Medians over rounds of the batches' times, percentiles of every one-chunk call."""
    joined = {k: [x for r in runs for x in r[k]] for k in runs[0]}
    total = chunks * chunk_bytes

    def p(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3

    store, load = statistics.median(joined["store"]), statistics.median(joined["load"])
    return {
        "store_gbps": total / store / 1e9, "load_gbps": total / load / 1e9,
        "store_cps": chunks / store, "load_cps": chunks / load,
        "one_store_p50": p(joined["single_store"], 0.5), "one_store_p99": p(joined["single_store"], 0.99),
        "one_load_p50": p(joined["single_load"], 0.5), "one_load_p99": p(joined["single_load"], 0.99),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rdram", default=str(ROOT / "target" / "release" / "rdram"))
    ap.add_argument("--serve-args", default="--workers 2 --hugepages off", help="more `rdram serve` arguments")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--label", help=argparse.SUPPRESS)
    ap.add_argument("--save-chunk-meta", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_tier(args)), flush=True)
        os._exit(0)  # past the Redis connectors' threads that never end

    chunk_bytes = 2 * args.layers * args.tokens * 1024 * 2
    memory = f"{max(1, (2 * args.chunks * chunk_bytes) >> 30) + 1}GiB"
    shm = {"UCX_TLS": "posix,sysv,cma,self", "UCX_NET_DEVICES": "lo"}
    tcp = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "RDRAM_UCX_TCP": "1"}
    ports = {name: free_port() for name in ("shm", "tcp", "fabric", "redis", "lm")}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    rdram = [args.rdram, "serve", "--memory", memory, *args.serve_args.split()]
    servers = [
        subprocess.Popen(rdram + ["--listen", f"127.0.0.1:{ports['shm']}"], env={**os.environ, **shm}, **quiet),
        subprocess.Popen(rdram + ["--listen", f"127.0.0.1:{ports['tcp']}", "--ucx-tcp"], env={**os.environ, **tcp}, **quiet),
        subprocess.Popen(rdram + ["--listen", f"127.0.0.1:{ports['fabric']}", "--transport", "fabric", "--provider", "tcp;ofi_rxm"],
                         **quiet),
        subprocess.Popen(["redis-server", "--port", str(ports["redis"]), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                          "--proto-max-bulk-len", "1gb"], **quiet),
        subprocess.Popen([sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(ports["lm"]), "cpu"], **quiet),
    ]
    try:
        for port in ports.values():
            wait_port(port)
        tiers = [
            ("remote_dram, UCX shm", f"remote_dram://127.0.0.1:{ports['shm']}", True, shm),
            ("remote_dram, UCX shm, no metadata", f"remote_dram://127.0.0.1:{ports['shm']}", False, shm),
            ("remote_dram, UCX tcp", f"remote_dram://127.0.0.1:{ports['tcp']}", True, tcp),
            ("remote_dram, libfabric tcp;ofi_rxm", f"remote_dram://127.0.0.1:{ports['fabric']}", True, {}),
            ("Redis, redis:// (redis-py)", f"redis://127.0.0.1:{ports['redis']}", True, {}),
            ("Redis, resp:// (LMCache's native client)", f"resp://127.0.0.1:{ports['redis']}", False, {}),
            ("LMCache's lm:// server", f"lm://127.0.0.1:{ports['lm']}", True, {}),
        ]
        print(f"{args.chunks} chunks of {chunk_bytes / 2**20:.0f} MiB ({args.tokens} tokens x {args.layers} layers x 8 x 128, bfloat16), "
              f"median of {args.rounds} rounds")
        print(f"{'':44} {'batch of ' + str(args.chunks) + ' chunks':^43} {'one chunk a call, ms':^31}")
        print(f"{'tier':44} {'store GB/s':>10} {'load GB/s':>10} {'store/s':>10} {'load/s':>10} "
              f"{'store p50':>10} {'p99':>6} {'load p50':>9} {'p99':>6}")
        # Round by round, every tier in turn (a process of its own each time), so that
        # the machine's noise lands on all of them alike.
        runs: dict[str, list[dict]] = {label: [] for label, *_ in tiers}
        failed: dict[str, str] = {}
        for _ in range(args.rounds):
            for label, url, meta, env in tiers:
                if label in failed:
                    continue
                cmd = [sys.executable, __file__, "--one", "--url", url, "--label", label, "--chunks", str(args.chunks),
                       "--tokens", str(args.tokens), "--layers", str(args.layers), "--rounds", "1"]
                if meta:
                    cmd.append("--save-chunk-meta")
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                                       env={**os.environ, **env, "LMCACHE_LOG_LEVEL": "WARNING"})
                except subprocess.TimeoutExpired:
                    failed[label] = "took more than 600 s"
                    continue
                if p.returncode != 0:
                    failed[label] = f"failed:\n{p.stderr[-2000:]}"
                    continue
                runs[label].append(json.loads(p.stdout.strip().splitlines()[-1]))
        for label, *_ in tiers:
            if label in failed:
                print(f"{label:44} {failed[label]}")
                continue
            r = summary(runs[label], args.chunks, chunk_bytes)
            print(f"{label:44} {r['store_gbps']:10.2f} {r['load_gbps']:10.2f} {r['store_cps']:10.0f} {r['load_cps']:10.0f} "
                  f"{r['one_store_p50']:10.2f} {r['one_store_p99']:6.2f} {r['one_load_p50']:9.2f} {r['one_load_p99']:6.2f}")
    finally:
        for s in servers:
            s.terminate()
            s.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
