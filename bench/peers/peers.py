#!/usr/bin/env python3
"""remote_dram next to Mooncake Store on this machine: same values, alternating rounds.

Starts one `rdram serve` per transport (UCX shared memory, UCX tcp under --ucx-tcp,
libfabric tcp;ofi_rxm) and Mooncake Store's master with one storage process (its "real
client", TCP transfer engine). Each round runs every (system, transport) pair in a
process of its own, in turn, the order flipped every round, so that the machine's noise
lands on all of them alike. Clients use each system's zero-copy calls:

  remote_dram  put / get_into, put_many / get_many_into, from and into numpy arrays
  Mooncake     register_buffer + put_from / get_into, batch_put_from / batch_get_into;
               over TCP from numpy arrays, over shared memory through its "dummy client"
               from buffers of its shared-memory pool (alloc_from_mem_pool)

First, start-up: servers started afresh per trial (systems alternating), a client that
puts as soon as it can, the time from spawn to its first put and the servers' resident
size then and with 1 GiB more stored. Then, per pair: PUT and GET latency (p50, p99; 8 B to 32 MiB, a fresh key per PUT)
and batched throughput (64 x 1 MiB and 16 x 4 MiB, one call per batch). Every value read
is compared byte for byte with what was written; a mismatch fails the run.

Run by bench/peers/run (`make bench-peers`, part of `make bench`), which makes the two
venvs: this script runs in remote_dram's; --mooncake-python is the other's interpreter.
"""

import argparse
import ctypes
import datetime
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
import uuid

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20
# Latency: value size -> calls per round (fewer for large values, whose time is long).
LATENCY_CALLS = {8: 400, 4096: 400, 65536: 300, MiB: 100, 4 * MiB: 40, 32 * MiB: 10}
BATCHES = {"64 x 1 MiB": (64, MiB), "16 x 4 MiB": (16, 4 * MiB)}
BATCH_REPEATS = 5
BUFFER = 80 * MiB  # the largest batch (64 MiB) plus room to shift values between keys

SHM_ENV = {"UCX_TLS": "posix,sysv,cma,self", "UCX_NET_DEVICES": "lo"}
TCP_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "RDRAM_UCX_TCP": "1"}


# ---------------------------------------------------------------- the two clients


class RemoteDram:
    def __init__(self, address: str, transport: str, buffer: int = BUFFER):
        import remote_dram

        self.client = remote_dram.Client(address)
        self.src = np.random.default_rng(1).integers(0, 256, buffer, dtype=np.uint8)
        self.dst = np.zeros(buffer, dtype=np.uint8)

    def put(self, key, offset, size):
        self.client.put(key, self.src[offset : offset + size])

    def get(self, key, size):
        assert self.client.get_into(key, self.dst[:size]) == size, key

    def put_batch(self, keys, offsets, size):
        self.client.put_many([(k, self.src[o : o + size]) for k, o in zip(keys, offsets)])

    def get_batch(self, keys, size):
        outs = [self.dst[i * size : (i + 1) * size] for i in range(len(keys))]
        assert self.client.get_many_into(keys, outs) == [size] * len(keys)

    def clean(self, prefix):
        self.client.delete_range(prefix, prefix + "\xff")
        self.client.close()


class Mooncake:
    def __init__(self, address: str, transport: str, buffer: int = BUFFER):
        from mooncake.store import MooncakeDistributedStore

        master, real_client = address.split(",")
        self.store = MooncakeDistributedStore()
        if transport == "shm":
            # The dummy client reaches the storage process over shared memory; buffers must
            # come from its pool and be registered whole.
            check(self.store.setup_dummy(3 * buffer, 16 * MiB, real_client), "setup_dummy")
            arrays = []
            for _ in range(2):
                addr = self.store.alloc_from_mem_pool(buffer)
                check(self.store.register_buffer(addr, buffer), "register_buffer")
                arrays.append(np.ctypeslib.as_array((ctypes.c_uint8 * buffer).from_address(addr)))
            self.src, self.dst = arrays
            self.src[:] = np.random.default_rng(1).integers(0, 256, buffer, dtype=np.uint8)
        else:
            check(self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "", master), "setup")
            self.src = np.random.default_rng(1).integers(0, 256, buffer, dtype=np.uint8)
            self.dst = np.zeros(buffer, dtype=np.uint8)
            for a in (self.src, self.dst):
                check(self.store.register_buffer(a.ctypes.data, buffer), "register_buffer")
        self.src_ptr, self.dst_ptr = self.src.ctypes.data, self.dst.ctypes.data

    def put(self, key, offset, size):
        check(self.store.put_from(key, self.src_ptr + offset, size), f"put_from {key}")

    def get(self, key, size):
        assert self.store.get_into(key, self.dst_ptr, size) == size, key

    def put_batch(self, keys, offsets, size):
        codes = self.store.batch_put_from(keys, [self.src_ptr + o for o in offsets], [size] * len(keys))
        assert codes == [0] * len(keys), codes

    def get_batch(self, keys, size):
        got = self.store.batch_get_into(keys, [self.dst_ptr + i * size for i in range(len(keys))], [size] * len(keys))
        assert got == [size] * len(keys), got

    def clean(self, prefix):
        self.store.remove_all(True)
        self.store.close()


def check(code, what):
    if code != 0:
        raise RuntimeError(f"{what} returned {code}")


# ---------------------------------------------------------------- one (system, transport) run


def one_run(system, transport: str) -> dict:
    prefix = f"peers-{uuid.uuid4().hex[:8]}/"
    out: dict = {"latency": {}, "batch": {}}
    clock = time.perf_counter_ns
    for size, calls in LATENCY_CALLS.items():
        puts, gets = [], []
        for i in range(calls + calls // 10):  # the first tenth warms up
            key, offset = f"{prefix}lat{size}-{i}", (i * 4099) % (BUFFER - size)
            t = clock()
            system.put(key, offset, size)
            puts.append(clock() - t)
            t = clock()
            system.get(key, size)
            gets.append(clock() - t)
            if not np.array_equal(system.dst[:size], system.src[offset : offset + size]):
                raise RuntimeError(f"{key}: the value read differs from the one written")
        out["latency"][size] = {op: percentiles(times[calls // 10 :]) for op, times in (("put", puts), ("get", gets))}
    for name, (count, size) in BATCHES.items():
        rates = {"put": [], "get": []}
        for r in range(BATCH_REPEATS + 1):  # the first repeat warms up
            keys = [f"{prefix}{name.replace(' ', '')}-{r}-{j}" for j in range(count)]
            offsets = [j * size + r * 4096 for j in range(count)]
            t = clock()
            system.put_batch(keys, offsets, size)
            put_ns = clock() - t
            t = clock()
            system.get_batch(keys, size)
            get_ns = clock() - t
            for j, offset in enumerate(offsets):
                if not np.array_equal(system.dst[j * size : (j + 1) * size], system.src[offset : offset + size]):
                    raise RuntimeError(f"{keys[j]}: the value read differs from the one written")
            if r:
                rates["put"].append(count * size / put_ns)  # bytes per ns = GB/s
                rates["get"].append(count * size / get_ns)
        out["batch"][name] = {op: statistics.median(v) for op, v in rates.items()}
    system.clean(prefix)
    return out


def cold_start(system: str, address: str, started: float, pids: list) -> dict:
    """From servers spawned at `started` (time.time()) to this client's first put, then
    the servers' resident size then and once 1 GiB more is stored."""
    make = {"remote_dram": RemoteDram, "mooncake": Mooncake}[system]
    deadline = started + 120
    while True:
        try:
            adapter = make(address, "tcp" if system == "mooncake" else "shm", 8 * MiB)
            adapter.put("cold/first", 0, 8)
            break
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(0.01)
    first_put = time.time() - started
    rss_first = resident_mib(pids)
    for i in range(256):  # 1 GiB in 4 MiB values
        adapter.put(f"cold/{i}", (i * 4096) % (4 * MiB), 4 * MiB)
    return {"first_put_s": first_put, "rss_first_mib": rss_first, "rss_1gib_mib": resident_mib(pids)}


def resident_mib(pids: list) -> float:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            total += int(f.read().split("VmRSS:")[1].split()[0])
    return total / 1024


def percentiles(ns: list) -> list:
    ns = sorted(ns)
    return [ns[len(ns) // 2] / 1000, ns[min(len(ns) - 1, int(len(ns) * 0.99))] / 1000]  # µs


# ---------------------------------------------------------------- the driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    sys.exit(f"{what} did not listen on {port} within {timeout} s")


def start(commands: list, what: str, cmd: list, port: int, env=None, log=None) -> subprocess.Popen:
    commands.append(shlex.join(cmd) + " &")
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT)
    wait_port(port, proc, what)
    return proc


def settle(procs: list, timeout: float = 180):
    """Waits until no server's resident size grew for three seconds: servers fault their
    memory in once they listen (remote_dram's at half a CPU per shard at most), and until
    then writes land on pages the kernel has yet to provide."""
    rss = lambda pid: int(open(f"/proc/{pid}/statm").read().split()[1])  # noqa: E731
    last, still, deadline = None, 0, time.monotonic() + timeout
    while time.monotonic() < deadline and still < 3:
        now = [rss(p.pid) for p in procs]
        still = still + 1 if now == last else 0
        last = now
        time.sleep(1)


def table(runs: dict, pairs: list) -> str:
    """Markdown: medians over rounds of each figure, remote_dram next to Mooncake."""
    med = lambda vals: statistics.median(vals)  # noqa: E731
    lines = []
    for transport, ours, theirs in pairs:
        a, b = runs[ours], runs[theirs]
        lines += [f"\n### {ours} against {theirs}\n", "| | remote_dram | Mooncake | ratio |", "|---|---|---|---|"]
        for name in BATCHES:
            for op in ("get", "put"):
                x = med([r["batch"][name][op] for r in a])
                y = med([r["batch"][name][op] for r in b])
                lines.append(f"| batched {name} {op}, GB/s | {x:.2f} | {y:.2f} | {x / y:.2f}x |")
        for size in LATENCY_CALLS:
            for op in ("get", "put"):
                x50, x99 = (med([r["latency"][str(size)][op][i] for r in a]) for i in (0, 1))
                y50, y99 = (med([r["latency"][str(size)][op][i] for r in b]) for i in (0, 1))
                lines.append(f"| {op.upper()} {human(size)} p50 / p99, µs | {x50:,.0f} / {x99:,.0f} | {y50:,.0f} / {y99:,.0f} "
                             f"| {y50 / x50:.2f}x faster |")
    return "\n".join(lines)


def human(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // 1024} KiB" if size >= 1024 else f"{size} B"


class Servers:
    """The servers of one run: started here, stopped (SIGTERM, then SIGKILL) on close."""

    EXTRA = {"shm": ([], SHM_ENV), "tcp": (["--ucx-tcp"], TCP_ENV), "fabric": (["--transport", "fabric", "--provider", "tcp;ofi_rxm"], {})}

    def __init__(self, args, log, commands: list):
        self.args, self.log, self.commands, self.procs = args, log, commands, []

    def rdram(self, transport: str) -> str:
        port = free_port()
        flags, env = self.EXTRA[transport]
        cmd = [self.args.rdram, "serve", *self.args.serve_args.split(), "--listen", f"127.0.0.1:{port}", *flags]
        self.procs.append(start(self.commands, f"rdram serve ({transport})", cmd, port, env, self.log))
        return f"127.0.0.1:{port}"

    def mooncake(self) -> str:
        """Mooncake's master and one storage process ("real client", TCP transfer engine)."""
        bindir = os.path.dirname(self.args.mooncake_python)
        master, real_client = free_port(), free_port()
        self.procs.append(start(self.commands, "mooncake_master", [
            os.path.join(bindir, "mooncake_master"), "--rpc_address", "127.0.0.1", "--rpc_port", str(master),
            "--metrics_host", "127.0.0.1", "--metrics_port", str(free_port()), "--enable_metric_reporting=false",
            "--http_metadata_server_host", "127.0.0.1", "--http_metadata_server_port", str(free_port())], master, log=self.log))
        self.procs.append(start(self.commands, "mooncake_client", [
            os.path.join(bindir, "mooncake_client"), "--host", "127.0.0.1", "--port", str(real_client),
            "--global_segment_size", "4 GB", "--protocol", "tcp", "--metadata_server", "P2PHANDSHAKE",
            "--master_server_address", f"127.0.0.1:{master}"], real_client, log=self.log))
        return f"127.0.0.1:{master},127.0.0.1:{real_client}"

    def close(self):
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs = []


def cold_starts(args, log, trials: int) -> dict:
    """Servers started afresh for each trial (alternating systems), a client in the
    system's venv putting as soon as it can."""
    out: dict = {"remote_dram": [], "mooncake": []}
    for trial in range(trials):
        for system in (("remote_dram", "mooncake") if trial % 2 == 0 else ("mooncake", "remote_dram")):
            servers = Servers(args, log, [])
            started = time.time()
            try:
                address = servers.rdram("shm") if system == "remote_dram" else servers.mooncake()
                python, env = (sys.executable, SHM_ENV) if system == "remote_dram" else (args.mooncake_python, {})
                pids = ",".join(str(p.pid) for p in servers.procs)
                p = subprocess.run([python, os.path.abspath(__file__), "--cold", system, address, repr(started), pids],
                                   capture_output=True, text=True, timeout=300, env={**os.environ, **env})
                if p.returncode != 0:
                    sys.exit(f"cold start of {system}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
                out[system].append(json.loads(p.stdout.strip().splitlines()[-1]))
            finally:
                servers.close()
    return out


def cold_table(cold: dict) -> str:
    med = lambda system, field: statistics.median(r[field] for r in cold[system])  # noqa: E731
    lines = ["\n### Start-up and resident size (servers started afresh each trial)\n", "| | remote_dram | Mooncake |", "|---|---|---|"]
    lines.append(f"| spawn to first put, s | {med('remote_dram', 'first_put_s'):.2f} | {med('mooncake', 'first_put_s'):.2f} |")
    lines.append(f"| servers' RSS at first put, MiB | {med('remote_dram', 'rss_first_mib'):,.0f} | {med('mooncake', 'rss_first_mib'):,.0f} |")
    lines.append(f"| servers' RSS with 1 GiB more stored, MiB | {med('remote_dram', 'rss_1gib_mib'):,.0f} | {med('mooncake', 'rss_1gib_mib'):,.0f} |")
    return "\n".join(lines)


def steady_rounds(args, log, commands: list, transports: list, labels: dict) -> dict:
    """One server per (system, transport) for all rounds; each round runs every pair in
    a process of its own, the order flipping every round."""
    servers = Servers(args, log, commands)
    try:
        addresses = {t: servers.rdram(t) for t in transports}
        mooncake_address = servers.mooncake()
        settle(servers.procs)
        runs_of = [(f"remote_dram, {labels[t]}", sys.executable, "remote_dram", t, addresses[t], Servers.EXTRA[t][1]) for t in transports]
        runs_of += [(f"Mooncake, {t}", args.mooncake_python, "mooncake", t, mooncake_address, {})
                    for t in ("shm", "tcp") if t in transports or (t == "tcp" and "fabric" in transports)]
        runs: dict = {label: [] for label, *_ in runs_of}
        for r in range(args.rounds):
            for label, python, system, t, address, env in (runs_of if r % 2 == 0 else runs_of[::-1]):
                cmd = [python, os.path.abspath(__file__), "--one", system, t, address]
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, **env})
                if p.returncode != 0:
                    sys.exit(f"round {r + 1}, {label}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
                runs[label].append(json.loads(p.stdout.strip().splitlines()[-1]))
                print(f"round {r + 1}: {label} done", flush=True)
        return runs
    finally:
        servers.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="steady-state rounds (0: start-up trials only)")
    ap.add_argument("--cold-trials", type=int, default=3, help="start-up trials per system")
    ap.add_argument("--rdram", default=os.path.join(ROOT, "target/release/rdram"))
    ap.add_argument("--serve-args", default="--workers 2 --memory 4GiB", help="more `rdram serve` arguments")
    ap.add_argument("--mooncake-python", default=os.path.join(ROOT, "target/venv-mooncake/bin/python"))
    ap.add_argument("--transports", default="shm,tcp,fabric")
    ap.add_argument("--one", nargs=3, metavar=("SYSTEM", "TRANSPORT", "ADDRESS"), help=argparse.SUPPRESS)
    ap.add_argument("--cold", nargs=4, metavar=("SYSTEM", "ADDRESS", "STARTED", "PIDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        system, transport, address = args.one
        adapter = {"remote_dram": RemoteDram, "mooncake": Mooncake}[system](address, transport)
        print(json.dumps(one_run(adapter, transport)), flush=True)
        os._exit(0)  # past Mooncake's client threads
    if args.cold:
        system, address, started, pids = args.cold
        print(json.dumps(cold_start(system, address, float(started), pids.split(","))), flush=True)
        os._exit(0)

    transports = args.transports.split(",")
    commands: list = []
    log = open(os.path.join(ROOT, "target", "peers-servers.log"), "w")
    cold = cold_starts(args, log, args.cold_trials)
    labels = {"shm": "UCX shm", "tcp": "UCX tcp", "fabric": "libfabric tcp;ofi_rxm"}
    runs = steady_rounds(args, log, commands, transports, labels) if args.rounds else {}
    pairs = [(t, f"remote_dram, {labels[t]}", "Mooncake, shm" if t == "shm" else "Mooncake, tcp") for t in transports]
    report = (f"# remote_dram next to Mooncake Store, {datetime.datetime.now():%Y-%m-%d %H:%M}\n\n"
              f"Medians of {args.rounds} alternating rounds; ratio > 1 means remote_dram is ahead.\n"
              f"Servers:\n\n```\n" + "\n".join(commands) + "\n```\n" + (table(runs, pairs) if args.rounds else "") + "\n"
              + (cold_table(cold) + "\n" if args.cold_trials else ""))
    print(report)
    out = os.path.join(ROOT, "bench", "results", f"peers-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    with open(out + ".md", "w") as f:
        f.write(report)
    with open(out + ".json", "w") as f:
        json.dump({"commands": commands, "runs": runs, "cold": cold}, f)
    print(f"saved {out}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
