#!/usr/bin/env python3
"""The Python client next to the Rust client (rdram-bench) and redis-py, in one run.

One `rdram serve` (one worker pinned to --server-core, busy polling) serves both clients,
each pinned to --client-core and polling the same way:
  1. rdram-bench: GET and PUT of 8 B and 1 MiB, depth 1 (p50 per call, MB/s);
  2. this process through `remote_dram`: the same calls, timed one by one (p50), and
     1 MiB `get_into` a numpy array for throughput;
  3. redis-server on --server-core and redis-py: GET and SET of 8 B on one connection.
Prints a markdown table (and saves it under bench/results/) with the Python overhead
per call and the throughput ratio.

Run with the venv that has remote_dram, numpy and redis installed (`make bench-python`).
UCX_TLS picks the transport (default here: shared memory).
"""

import argparse
import datetime
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

import remote_dram as rd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = []


def run(cmd):
    COMMANDS.append(shlex.join(cmd))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit(f"failed ({out.returncode}): {shlex.join(cmd)}\n{out.stdout}\n{out.stderr}")
    return out.stdout


def start_server(args):
    cmd = ["taskset", "-c", str(args.server_core), os.path.join(ROOT, "target/release/rdram"), "serve", "--listen", "127.0.0.1:0",
           "--workers", "1", "--cores", str(args.server_core), "--memory", "1GiB", "--poll", "busy"]
    COMMANDS.append(shlex.join(cmd) + " &")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("listening on "):
            return proc, line.split()[-1]
    sys.exit(f"rdram serve exited with {proc.wait()}")


def rust_client(args, addr):
    cmd = [os.path.join(ROOT, "target/release/rdram-bench"), "--server", addr, "--client-cores", str(args.client_core),
           "--ops", "get,put", "--sizes", "8,1048576", "--keys", str(args.keys), "--seconds", str(args.seconds),
           "--poll", "busy", "--json", "--out", os.path.join(args.tmp, "hgrm")]
    results = {}
    for line in run(cmd).splitlines():
        r = json.loads(line)
        results[(r["op"], r["size"])] = r
    return results


def p50_us(call, n):
    """Median of n timed calls, in µs (after a warm-up of n/10)."""
    for _ in range(n // 10):
        call()
    times = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t = clock()
        call()
        times.append(clock() - t)
    return statistics.median(times) / 1000


def python_client(args, addr):
    os.sched_setaffinity(0, {args.client_core})
    out = {}
    with rd.Client(addr, poll="busy") as c:
        small = [f"py/small/{i}" for i in range(args.keys)]
        for k in small:
            c.put(k, b"12345678")
        it = iter(range(1 << 62))
        out[("get", 8)] = p50_us(lambda: c.get(small[next(it) % len(small)]), args.count)
        value = b"abcdefgh"
        out[("put", 8)] = p50_us(lambda: c.put(small[next(it) % len(small)], value), args.count)
        buf = bytearray(8)
        out[("get_into", 8)] = p50_us(lambda: c.get_into(small[next(it) % len(small)], buf), args.count)

        big = [f"py/big/{i}" for i in range(args.keys)]
        value = np.ones(1 << 20, np.uint8)
        for k in big:
            c.put(k, value)
        dest = np.empty(1 << 20, np.uint8)
        for label, call in (("get_into", lambda k: c.get_into(k, dest)), ("get", lambda k: c.get(k)), ("put", lambda k: c.put(k, value))):
            for k in big[:8]:
                call(k)  # warm-up
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < args.seconds:
                call(big[n % len(big)])
                n += 1
            elapsed = time.perf_counter() - t0
            out[(label, 1 << 20, "MB/s")] = n * (1 << 20) / elapsed / 1e6
    return out


def redis_py(args):
    import redis

    port = free_port()
    cmd = ["taskset", "-c", str(args.server_core), "redis-server", "--port", str(port), "--save", "", "--appendonly", "no"]
    COMMANDS.append(shlex.join(cmd) + " &")
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        r = redis.Redis(port=port)
        for _ in range(100):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        keys = [f"small/{i}" for i in range(args.keys)]
        for k in keys:
            r.set(k, b"12345678")
        it = iter(range(1 << 62))
        return {("get", 8): p50_us(lambda: r.get(keys[next(it) % len(keys)]), args.count),
                ("put", 8): p50_us(lambda: r.set(keys[next(it) % len(keys)], b"abcdefgh"), args.count)}
    finally:
        server.terminate()
        server.wait()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server-core", type=int, default=0)
    ap.add_argument("--client-core", type=int, default=1)
    ap.add_argument("--keys", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=3)
    ap.add_argument("--count", type=int, default=100_000, help="timed calls per small-value measurement")
    ap.add_argument("--tmp", default="/tmp")
    args = ap.parse_args()
    os.environ.setdefault("UCX_TLS", "posix,sysv,cma,self")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")

    server, addr = start_server(args)
    try:
        rust = rust_client(args, addr)
        py = python_client(args, addr)
    finally:
        server.terminate()
        assert server.wait() == 0, "rdram serve did not exit cleanly"
    redis_results = redis_py(args)

    rows = ["| call | Rust client (rdram-bench) | Python (remote_dram) | Python − Rust | redis-py |", "|---|---|---|---|---|"]
    for op in ("get", "put"):
        r, p, q = rust[(op, 8)]["p50_us"], py[(op, 8)], redis_results[(op, 8)]
        rows.append(f"| {op.upper()} 8 B p50 | {r:.2f} µs | {p:.2f} µs | {p - r:+.2f} µs | {q:.2f} µs ({q / p:.0f}× Python) |")
    rows.append(f"| get_into 8 B p50 | | {py[('get_into', 8)]:.2f} µs | {py[('get_into', 8)] - rust[('get', 8)]['p50_us']:+.2f} µs | |")
    rust_mb = rust[("get", 1 << 20)]["mb_per_s"]
    for label in ("get_into", "get"):
        p = py[(label, 1 << 20, "MB/s")]
        rows.append(f"| {label} 1 MiB | GET {rust_mb:,.0f} MB/s | {p:,.0f} MB/s | {100 * p / rust_mb:.0f} % of Rust | |")
    rust_put = rust[("put", 1 << 20)]["mb_per_s"]
    p = py[("put", 1 << 20, "MB/s")]
    rows.append(f"| put 1 MiB | {rust_put:,.0f} MB/s | {p:,.0f} MB/s | {100 * p / rust_put:.0f} % of Rust | |")
    table = "\n".join(rows)
    transport = os.environ["UCX_TLS"]
    report = (f"# Python client vs Rust client vs redis-py — {datetime.datetime.now():%Y-%m-%d %H:%M}\n\n"
              f"UCX_TLS={transport}; server core {args.server_core}, client core {args.client_core}; busy polling; {args.keys} keys.\n\n"
              f"{table}\n\nCommands:\n\n" + "\n".join(f"    {c}" for c in COMMANDS) + "\n")
    print(report)
    os.makedirs(os.path.join(ROOT, "bench/results"), exist_ok=True)
    with open(os.path.join(ROOT, f"bench/results/python-{datetime.datetime.now():%Y%m%d-%H%M}.md"), "w") as f:
        f.write(report)


if __name__ == "__main__":
    main()
