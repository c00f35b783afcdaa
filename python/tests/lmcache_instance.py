"""One LMCache instance (its StorageManager, configured from YAML as a user would) with
remote_dram as its remote tier; test_lmcache.py runs it as a separate process.

    python lmcache_instance.py CONFIG ROLE [--dtype bfloat16] [--seed N]

Chunks are KV tensors of a realistic shape, 256 tokens x 32 layers x 8 heads x 128 dims
(KV_2LTD: [2, 32, tokens, 1024]), with contents drawn from ``--seed``, plus one partial
chunk of 100 tokens. Roles:

- ``store-reload``: store the chunks, drop them from the local CPU tier, read them back
  from remote_dram byte for byte, and miss a chunk never stored;
- ``store``: store the chunks and wait until remote_dram holds them;
- ``load``: a fresh instance reads chunks another process stored;
- ``outage``: the server is down at start; every lookup misses at once and every store is
  dropped without an error; after the line "up" on stdin (the server started), chunks
  round-trip again;
- ``restart``: chunks round-trip; after the line "killed" on stdin (the test SIGKILLed the
  server), as ``outage``.
- ``overfill``: stores more full chunks than the server (``--mode cache``) holds, through
  the tier's connector; every chunk a lookup finds reads back whole.

Prints one line per check; exits 0 only if every check held.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.remote_backend import RemoteBackend
from lmcache.v1.storage_backend.storage_manager import StorageManager
from remote_dram.lmcache import RemoteDramConnector

MODEL = "org/model-7b"  # a "/" in the name, as Hugging Face names have
LAYERS, HEADS, HEAD_DIM, CHUNK = 32, 8, 128, 256
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
FULL_CHUNKS = 3
PARTIAL_TOKENS = 100


def chunks(dtype: torch.dtype, seed: int) -> list[tuple[CacheEngineKey, torch.Tensor]]:
    """The chunks of this run: (key, contents), the last one partial."""
    out = []
    for i in range(FULL_CHUNKS + 1):
        tokens = CHUNK if i < FULL_CHUNKS else PARTIAL_TOKENS
        gen = torch.Generator().manual_seed(seed * 100 + i)
        data = torch.randn(2, LAYERS, tokens, HEADS * HEAD_DIM, generator=gen).to(dtype)
        key = CacheEngineKey(model_name=MODEL, world_size=1, worker_id=0, chunk_hash=seed * 1000 + i, dtype=dtype)
        out.append((key, data))
    return out


def storage_manager(config_path: str, dtype: torch.dtype) -> StorageManager:
    config = LMCacheEngineConfig.from_file(config_path)
    metadata = LMCacheMetadata(
        model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=dtype, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM), chunk_size=CHUNK,
    )
    return StorageManager(config, metadata, EventManager())


def remote_dram_backend(sm: StorageManager) -> RemoteBackend:
    """The remote backend that is the remote_dram tier (the example config has two: the
    plugin entry, which holds nothing, and remote_url's)."""
    tiers = [
        b for b in sm.storage_backends.values()
        if isinstance(b, RemoteBackend) and isinstance(b.connection.getWrappedConnector(), RemoteDramConnector)
    ]
    assert len(tiers) == 1, f"expected one remote_dram tier, found {tiers}"
    return tiers[0]


def store(sm: StorageManager, items, wait: bool = True) -> None:
    """Stores chunks through every tier; with ``wait``, until remote_dram holds them all
    (LMCache stores to remote tiers in the background)."""
    objs = []
    for _, data in items:
        obj = sm.allocate(data.shape, data.dtype, fmt=MemoryFormat.KV_2LTD)
        assert obj is not None, "LMCache's CPU allocator is full"
        obj.tensor.copy_(data)
        objs.append(obj)
    sm.batched_put([k for k, _ in items], objs)
    remote = remote_dram_backend(sm)
    deadline = time.monotonic() + 30
    while wait and not all(remote.contains(k) for k, _ in items):
        assert time.monotonic() < deadline, "remote_dram does not hold the chunks 30 s after they were stored"
        time.sleep(0.01)


class Checks:
    def __init__(self):
        self.failed = 0

    def __call__(self, ok: bool, what: str) -> None:
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        self.failed += not ok


def load_and_compare(sm: StorageManager, items, check: Checks) -> None:
    """Every chunk is found in remote_dram's tier (and nowhere else) and reads back."""
    where = next(name for name, b in sm.storage_backends.items() if b is remote_dram_backend(sm))
    for key, data in items:
        found = sm.contains(key)
        check(found == where, f"chunk {key.chunk_hash} ({data.shape[2]} tokens) is found in {where} (found in {found})")
        obj = sm.get(key)
        same = obj is not None and obj.tensor is not None and tuple(obj.tensor.shape) == tuple(data.shape) and torch.equal(obj.tensor.view(torch.uint8), data.view(torch.uint8))
        check(same, f"chunk {key.chunk_hash} reads back byte for byte, shape {tuple(data.shape)}")
        if obj is not None:
            obj.ref_count_down()


def miss(sm: StorageManager, dtype: torch.dtype, check: Checks) -> None:
    key = CacheEngineKey(model_name=MODEL, world_size=1, worker_id=0, chunk_hash=987654321, dtype=dtype)
    check(sm.contains(key) is None, "a chunk never stored is not found")
    check(sm.get(key) is None, "a chunk never stored reads as None")


def list_and_remove(sm: StorageManager, items, check: Checks) -> None:
    """The connector lists LMCache's key strings of what it holds, and removes a chunk
    (stored again after)."""
    remote = remote_dram_backend(sm)
    connector = remote.connection.getWrappedConnector()
    listed = asyncio.run_coroutine_threadsafe(connector.list(), remote.loop).result()
    expected = sorted(k.to_string() for k, _ in items)
    check(sorted(listed) == expected, f"list() gives LMCache's key strings of the {len(items)} chunks")
    gone = items[0][0]
    check(connector.remove_sync(gone), f"remove_sync removes chunk {gone.chunk_hash}")
    sm.remove(gone, locations=["LocalCPUBackend"])
    check(sm.contains(gone) is None and not connector.remove_sync(gone), "a removed chunk is found nowhere")
    store(sm, items[:1])  # back, for the callers that read every chunk after this


def down_then_up(sm: StorageManager, items, check: Checks) -> None:
    """With the server down: lookups and loads miss at once, stores are dropped without an
    error; after the line "up" on stdin (a server listens again), chunks round-trip."""
    start = time.monotonic()
    for key, _ in items:
        sm.remove(key, locations=["LocalCPUBackend"])
        check(sm.contains(key) is None, f"server down: chunk {key.chunk_hash} is a miss")
        check(sm.get(key) is None, f"server down: chunk {key.chunk_hash} reads as None")
    store(sm, items, wait=False)
    for key, _ in items:
        sm.remove(key, locations=["LocalCPUBackend"])
    # LMCache stores in the background: the server may only come back once the store
    # connection has met the outage (else it would reconnect at once, unlogged).
    store_link = remote_dram_backend(sm).connection.getWrappedConnector()._store
    deadline = time.monotonic() + 20
    while not store_link.down and time.monotonic() < deadline:
        time.sleep(0.01)
    check(store_link.down, "server down: the store connection found it unreachable")
    print(f"down: {time.monotonic() - start:.2f} s for every call", flush=True)
    print("waiting", flush=True)
    check(sys.stdin.readline().strip() == "up", "the test started the server")
    deadline = time.monotonic() + 20
    while sm.contains(items[0][0]) is None and time.monotonic() < deadline:
        store(sm, items[:1], wait=False)
        sm.remove(items[0][0], locations=["LocalCPUBackend"])
        time.sleep(0.2)
    print(f"up again after {20 - (deadline - time.monotonic()):.2f} s", flush=True)
    store(sm, items)
    for key, _ in items:
        sm.remove(key, locations=["LocalCPUBackend"])
    load_and_compare(sm, items, check)


def overfill(sm: StorageManager, dtype: torch.dtype, check: Checks, count: int = 24) -> None:
    """``count`` chunks stored in batches of 4, evicting older ones; then every chunk that
    ``exists`` says is there reads back byte for byte, and some were evicted."""
    remote = remote_dram_backend(sm)
    connector = remote.connection.getWrappedConnector()
    run = lambda coroutine: asyncio.run_coroutine_threadsafe(coroutine, remote.loop).result()  # noqa: E731
    items = [
        (CacheEngineKey(model_name=MODEL, world_size=1, worker_id=0, chunk_hash=5000 + i, dtype=dtype),
         torch.full((2, LAYERS, CHUNK, HEADS * HEAD_DIM), float(i), dtype=dtype))
        for i in range(count)
    ]
    for start in range(0, count, 4):
        batch = items[start : start + 4]
        objs = []
        for _, data in batch:
            obj = sm.allocate(data.shape, data.dtype, fmt=MemoryFormat.KV_2LTD)
            obj.tensor.copy_(data)
            objs.append(obj)
        run(connector.batched_put([k for k, _ in batch], objs))
        for obj in objs:
            obj.ref_count_down()
    found = 0
    for key, data in items:
        if not run(connector.exists(key)):
            continue
        found += 1
        obj = run(connector.get(key))
        check(obj is not None and torch.equal(obj.tensor, data), f"chunk {key.chunk_hash}, found, reads back whole")
        if obj is not None:
            obj.ref_count_down()
    check(0 < found < count, f"{found} of {count} chunks found: the server evicted some and kept some")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("role", choices=["store-reload", "store", "load", "outage", "restart", "overfill"])
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    items = chunks(dtype, args.seed)
    check = Checks()
    sm = storage_manager(args.config, dtype)
    try:
        if args.role == "store-reload":
            store(sm, items)
            for key, _ in items:
                sm.remove(key, locations=["LocalCPUBackend"])
            load_and_compare(sm, items, check)
            miss(sm, dtype, check)
            list_and_remove(sm, items, check)
        elif args.role == "store":
            store(sm, items)
            print("stored", flush=True)
        elif args.role == "load":
            load_and_compare(sm, items, check)
            miss(sm, dtype, check)
        elif args.role == "outage":
            down_then_up(sm, items, check)
        elif args.role == "overfill":
            overfill(sm, dtype, check)
        else:
            store(sm, items)
            for key, _ in items:
                sm.remove(key, locations=["LocalCPUBackend"])
            load_and_compare(sm, items, check)
            print("waiting", flush=True)
            check(sys.stdin.readline().strip() == "killed", "the test killed the server")
            down_then_up(sm, items, check)
    finally:
        sm.close()
    print(f"{check.failed} checks failed", flush=True)
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
