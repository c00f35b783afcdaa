#!/usr/bin/env python3
"""One large value over UCX tcp on loopback: put and get_into p50, with UCX's defaults or
with the UCX variables given on the command line, for both the server and this client.

    target/venv-python/bin/python bench/ucx_tcp_segments.py [UCX_TCP_TX_SEG_SIZE=8k UCX_TCP_RX_SEG_SIZE=8k ...]

Alternate runs with and without the variables to compare (see bench/README.md).
"""

from __future__ import annotations

import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIZE = 32 << 20
CALLS = 15


def main() -> int:
    settings = dict(arg.split("=", 1) for arg in sys.argv[1:])
    os.environ.update({"UCX_TLS": "tcp", "RDRAM_UCX_TCP": "1", "UCX_NET_DEVICES": "lo", **settings})
    import numpy as np
    import remote_dram

    server = subprocess.Popen(
        [str(ROOT / "target/release/rdram"), "serve", "--listen", "127.0.0.1:0", "--memory", "1GiB", "--workers", "1", "--ucx-tcp"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    address = next(line.split()[-1] for line in server.stdout if line.startswith("listening on"))
    try:
        with remote_dram.Client(address) as c:
            value = np.random.randint(0, 255, SIZE, dtype=np.uint8)
            out = np.empty_like(value)
            c.put("k", value)
            gets, puts = [], []
            for _ in range(CALLS):
                t = time.perf_counter()
                c.get_into("k", out)
                gets.append(time.perf_counter() - t)
                t = time.perf_counter()
                c.put("k", value)
                puts.append(time.perf_counter() - t)
            assert np.array_equal(out, value), "the value read back differs"
    finally:
        server.terminate()
        assert server.wait() == 0
    get, put = statistics.median(gets), statistics.median(puts)
    print(f"{settings or 'UCX defaults'}: {SIZE >> 20} MiB get p50 {get * 1e3:.1f} ms ({SIZE / get / 1e9:.2f} GB/s), "
          f"put p50 {put * 1e3:.1f} ms ({SIZE / put / 1e9:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
