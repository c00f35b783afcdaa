#!/usr/bin/env python3
"""Stage KV-cache blocks in remote DRAM and fetch them back into preallocated memory.

    python kv_cache_staging.py                 # starts an embedded server
    python kv_cache_staging.py HOST:PORT       # or uses a running `rdram serve`

A producer writes one block per (layer, sequence) under a common prefix, in one pipelined
batch; a consumer lists what is there and reads every block straight into a preallocated
array (no intermediate bytes). A conditional put then shows how two writers of the same
block avoid overwriting each other.
"""

import sys

import numpy as np

import remote_dram as rd

LAYERS, SEQUENCES, BLOCK = 4, 8, (16, 128)  # 16 tokens x 128 channels of float16 per block


def block(layer: int, seq: int) -> np.ndarray:
    return np.full(BLOCK, layer * 100 + seq, dtype=np.float16)


def main(address: str) -> None:
    with rd.Client(address) as producer:
        keys = {f"kv/L{layer}/S{seq}": block(layer, seq) for layer in range(LAYERS) for seq in range(SEQUENCES)}
        generations = producer.put_many(keys)  # sent without a copy, pipelined
        print(f"staged {len(generations)} blocks of {block(0, 0).nbytes} bytes")

    with rd.Client(address) as consumer:
        listed = list(consumer.list("kv/"))
        print(f"{len(listed)} blocks listed under kv/")
        cache = np.empty((LAYERS, SEQUENCES, *BLOCK), dtype=np.float16)
        names = [f"kv/L{layer}/S{seq}" for layer in range(LAYERS) for seq in range(SEQUENCES)]
        outs = [cache[layer, seq] for layer in range(LAYERS) for seq in range(SEQUENCES)]
        lengths = consumer.get_many_into(names, outs)  # straight into `cache`
        assert all(n == block(0, 0).nbytes for n in lengths)
        assert all((cache[layer, seq] == block(layer, seq)).all() for layer in range(LAYERS) for seq in range(SEQUENCES))
        print("every block read back into the preallocated cache, byte-exact")

        # Two writers race for one block: only the one that saw the current generation wins.
        entry = consumer.get_entry("kv/L0/S0")
        first = consumer.put("kv/L0/S0", block(9, 9), if_equal=entry.generation)
        second = consumer.put("kv/L0/S0", block(7, 7), if_equal=entry.generation)
        print(f"conditional puts: first wrote generation {first}, second got {second} (condition failed)")
        assert first is not None and second is None

        removed = consumer.delete_range("kv/", "kv0")
        print(f"removed {removed} blocks")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with rd.Server(memory="256MiB", workers=2) as server:
            main(server.address)
