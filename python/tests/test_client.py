"""The Python client against real `rdram serve` processes (see conftest.py)."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import remote_dram as rd
from conftest import EMBEDDED_ARGS, ServerProc, run_python

SIZES = [0, 1, 8, 4095, 4096, 65535, 65536, 65537, (1 << 20) + 3, 64 << 20]


def pattern(n: int, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed + n).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("size", SIZES)
def test_round_trips_byte_exact(client, prefix, size):
    value = pattern(size)
    gen = client.put(prefix + "v", value)
    assert isinstance(gen, int) and gen > 0
    assert client.get(prefix + "v") == value.tobytes()
    out = np.full(size, 0xAB, dtype=np.uint8)
    assert client.get_into(prefix + "v", out) == size
    assert np.array_equal(out, value)
    entry = client.get_entry(prefix + "v")
    assert (entry.generation, entry.size, entry.value) == (gen, size, value.tobytes())


def test_values_of_every_buffer_kind(client, prefix):
    data = b"0123456789abcdef"
    for i, v in enumerate([data, bytearray(data), memoryview(data), np.frombuffer(data, np.uint8).copy(), memoryview(bytearray(data))[:]]):
        client.put(f"{prefix}{i}", v)
        assert client.get(f"{prefix}{i}") == data
    # A float array goes as its raw bytes, in C order.
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    client.put(prefix + "f32", a)
    assert client.get(prefix + "f32") == a.tobytes()
    # str keys are UTF-8: the same key as its bytes.
    client.put("ключ-" + prefix, b"x")
    assert client.get(("ключ-" + prefix).encode()) == b"x"


def test_get_into_writes_into_the_arrays_own_memory(client, prefix):
    value = pattern(1 << 20)
    client.put(prefix + "v", value)
    big = np.zeros(3 << 20, dtype=np.uint8)
    window = big[1 << 20 : 2 << 20]  # a view: no memory of its own
    address = window.__array_interface__["data"][0]
    assert client.get_into(prefix + "v", window) == 1 << 20
    assert window.__array_interface__["data"][0] == address
    assert np.array_equal(big[1 << 20 : 2 << 20], value), "the bytes must land in the array's memory"
    assert not big[: 1 << 20].any() and not big[2 << 20 :].any(), "nothing outside the view was written"
    # A larger buffer: only the value's length is written.
    out = bytearray(b"\xee") * ((1 << 20) + 5)
    assert client.get_into(prefix + "v", out) == 1 << 20
    assert out[: 1 << 20] == value.tobytes() and out[1 << 20 :] == b"\xee" * 5


def test_buffer_too_small_writes_nothing_and_says_what_is_needed(client, prefix):
    client.put(prefix + "v", pattern(1000))
    out = bytearray(999)
    with pytest.raises(rd.BufferTooSmall) as e:
        client.get_into(prefix + "v", out)
    assert e.value.needed == 1000 and e.value.status == rd.Status.BUFFER_TOO_SMALL
    assert out == bytearray(999)
    assert client.get(prefix + "v") == pattern(1000).tobytes(), "the value is still stored"


def test_missing_keys_are_results(client, prefix):
    assert client.get(prefix + "none") is None
    assert client.get_entry(prefix + "none") is None
    assert client.get_into(prefix + "none", bytearray(8)) is None
    assert client.delete(prefix + "none") is False


def test_conditions_and_generations(client, prefix):
    k = prefix + "k"
    g1 = client.put(k, b"one", if_absent=True)
    assert g1 is not None
    assert client.put(k, b"two", if_absent=True) is None, "exists: if_absent fails"
    assert client.put(k, b"two", if_equal=g1 + 1000) is None, "wrong generation"
    assert client.get(k) == b"one"
    g2 = client.put(k, b"two", if_equal=g1)
    assert g2 is not None and g2 > g1
    unchanged = client.get_entry(k, if_not_equal=g2)
    assert unchanged.value is None and unchanged.generation == g2
    changed = client.get_entry(k, if_not_equal=g1)
    assert changed.value == b"two" and changed.generation == g2
    assert client.delete(k, if_equal=g1) is False and client.get(k) == b"two"
    assert client.delete(k, if_equal=g2) is True and client.get(k) is None
    with pytest.raises(rd.InvalidArgument):
        client.put(k, b"x", if_equal=1, if_absent=True)


def test_ttl_expires(client, prefix):
    client.put(prefix + "t", b"soon gone", ttl=0.2)
    client.put(prefix + "p", b"stays")
    assert client.get(prefix + "t") == b"soon gone"
    time.sleep(0.5)
    assert client.get(prefix + "t") is None
    assert client.get(prefix + "p") == b"stays"
    with pytest.raises(rd.InvalidArgument):
        client.put(prefix + "t", b"x", ttl=0)


def test_byte_ranges(client, prefix):
    k = prefix + "r"
    client.put(k, b"0123456789")
    assert client.get(k, byte_range=(2, 5)) == b"234"
    assert client.get(k, byte_range=(7, None)) == b"789"
    assert client.get(k, byte_range=(-3, None)) == b"789"
    assert client.get(k, byte_range=(0, 0)) == b""
    entry = client.get_entry(k, byte_range=(1, 3))
    assert (entry.value, entry.size) == (b"12", 10)
    out = bytearray(4)
    assert client.get_into(k, out, byte_range=(-4, None)) == 4 and out == b"6789"
    with pytest.raises(rd.OutOfRange):
        client.get(k, byte_range=(5, 11))
    with pytest.raises(rd.OutOfRange):
        client.get(k, byte_range=(6, 5))
    with pytest.raises(rd.InvalidArgument):
        client.get(k, byte_range=(0, -1))


def test_list_and_delete_range(client, prefix):
    keys = [f"{prefix}{name}" for name in ("b/2", "a/1", "b/1", "c", "b/3")]
    for i, k in enumerate(keys):
        client.put(k, b"x" * i)
    listed = list(client.list(prefix))
    assert listed == sorted((k.encode(), i) for i, k in enumerate(keys))
    assert [k for k, _ in client.list(prefix + "b/")] == [f"{prefix}b/{i}".encode() for i in (1, 2, 3)]
    assert [k for k, _ in client.list(prefix, start=prefix + "b/2", stop=prefix + "c")] == [f"{prefix}b/{i}".encode() for i in (2, 3)]
    assert client.delete_range(prefix + "b/", prefix + "b0") == 3
    assert [k for k, _ in client.list(prefix)] == [f"{prefix}a/1".encode(), f"{prefix}c".encode()]
    end = prefix[:-1] + "0"  # just past every key under prefix ("/" + 1)
    assert client.delete_range(prefix, end) == 2
    assert list(client.list(prefix)) == []
    assert client.get("zzz-after-every-test-key") is None


def test_batches(client, prefix):
    items = {f"{prefix}{i}": pattern(i * 1000) for i in range(50)}
    generations = client.put_many(items)
    assert len(generations) == 50 and all(isinstance(g, int) for g in generations)
    assert client.put_many([(prefix + "pair", b"p")])[0] > 0
    got = client.get_many(list(items) + [prefix + "missing"])
    assert got[:50] == [v.tobytes() for v in items.values()] and got[50] is None
    # More keys than one pipelined group, values on both sides of the 64 KiB slots.
    mixed = {f"{prefix}m{i}": pattern((i % 7) * 40000 + i) for i in range(150)}
    client.put_many(mixed)
    got = client.get_many([*mixed, prefix + "missing", *list(mixed)[:3]])
    assert got == [v.tobytes() for v in mixed.values()] + [None] + [v.tobytes() for v in list(mixed.values())[:3]]
    outs = [np.zeros(len(v) + 1, np.uint8) for v in items.values()]
    lengths = client.get_many_into(list(items), outs)
    assert lengths == [len(v) for v in items.values()]
    assert all(np.array_equal(o[: len(v)], v) for o, v in zip(outs, items.values()))
    # A failing item is named; the others were still done.
    with pytest.raises(rd.BufferTooSmall) as e:
        client.get_many_into([prefix + "1", prefix + "2"], [bytearray(1000), bytearray(10)])
    assert e.value.index == 1 and e.value.needed == 2000
    with pytest.raises(rd.InvalidArgument) as e:
        client.put_many([(prefix + "ok", b"1"), ("k" * 2000, b"2")])
    assert e.value.index == 1 and client.get(prefix + "ok") == b"1"
    shared = bytearray(100)
    with pytest.raises(rd.InvalidArgument, match="overlap"):
        client.get_many_into([prefix + "1", prefix + "2"], [shared, memoryview(shared)[50:]])


def test_put_parts_stores_the_parts_joined(client, prefix):
    """A header and a body stored as one value without joining them: small values joined
    here, large ones staged on the server in parts; conditions and TTL as put's."""
    header, body = b"H" * 28, pattern(3 << 20)
    g = client.put_parts(prefix + "big", [header, b"", body])
    assert client.get(prefix + "big") == header + body.tobytes()
    assert client.put_parts(prefix + "big", [header, body], if_absent=True) is None
    assert client.put_parts(prefix + "big", [body, header], if_equal=g) > g
    assert client.get(prefix + "big") == body.tobytes() + header
    assert client.put_parts(prefix + "small", [b"ab", memoryview(b"cd"), bytearray(b"ef")], ttl=60) > 0
    assert client.get(prefix + "small") == b"abcdef"
    assert client.put_parts(prefix + "none", []) > 0 and client.get(prefix + "none") == b""


def test_put_parts_many_stores_each_value_joined(client, prefix):
    """Many values of a header and a body, the large ones staged on the server side by
    side and the small ones joined here, in one call: each reads back whole, and nothing
    stays staged on the servers."""
    bodies = [pattern((i + 1) * 100_000) for i in range(20)]
    items = [(f"{prefix}many/{i}", [b"H%02d" % i, body]) for i, body in enumerate(bodies)]
    generations = client.put_parts_many(items, ttl=60)
    assert len(generations) == 20 and all(g > 0 for g in generations)
    for i, body in enumerate(bodies):
        assert client.get(f"{prefix}many/{i}") == b"H%02d" % i + body.tobytes(), i
    staged = [shard["staged_values"] for server in client.stats()["servers"] for shard in server["shards"]]
    assert sum(staged) == 0
    with pytest.raises(rd.InvalidArgument) as e:
        client.put_parts_many([(prefix + "fine", [b"a", bodies[5]]), ("k" * 70_000, [b"b", bodies[5]])])
    assert e.value.index == 1 and client.get(prefix + "fine") == b"a" + bodies[5].tobytes()


def test_byte_ranges_and_sizes_in_batches(client, prefix):
    """A header and a body of one key read in one batch, each into its own buffer; sizes
    without the bytes."""
    value = pattern(300_000)
    client.put(prefix + "v", value)
    head, body, tail = bytearray(28), np.zeros(len(value), np.uint8), bytearray(16)
    keys = [prefix + "v", prefix + "v", prefix + "v", prefix + "missing"]
    lengths = client.get_many_into(keys, [head, body, tail, bytearray(1)], byte_ranges=[(0, 28), (28, None), (-16, None), None])
    assert lengths == [28, len(value) - 28, 16, None]
    assert bytes(head) == value[:28].tobytes() and bytes(tail) == value[-16:].tobytes()
    assert np.array_equal(body[: len(value) - 28], value[28:])
    with pytest.raises(rd.OutOfRange) as e:
        client.get_many_into([prefix + "v", prefix + "v"], [bytearray(1), bytearray(8)], byte_ranges=[(0, 1), (len(value), len(value) + 8)])
    assert e.value.index == 1
    with pytest.raises(rd.InvalidArgument, match="byte ranges"):
        client.get_many_into([prefix + "v"], [bytearray(1)], byte_ranges=[])
    client.put(prefix + "empty", b"")
    assert client.sizes([prefix + "v", prefix + "missing", prefix + "empty"]) == [len(value), None, 0]
    assert client.sizes([]) == []


def test_stats(client, prefix):
    client.put(prefix + "s", b"x" * 100)
    stats = client.stats()
    assert stats["keys"] >= 1 and stats["used_bytes"] >= 100 and stats["capacity_bytes"] == 1 << 30
    assert len(stats["servers"]) == 1 and len(stats["servers"][0]["shards"]) == 2


def test_each_error_kind_raises_its_class(server, client, prefix):
    with pytest.raises(rd.Unavailable) as e:
        rd.Client("127.0.0.1:1")
    assert e.value.status == rd.Status.UNAVAILABLE and "127.0.0.1:1" in e.value.message
    with pytest.raises(rd.InvalidArgument):
        client.put("", b"x")
    with pytest.raises(rd.KeyTooLarge):
        client.put("k" * 70000, b"x")
    with pytest.raises(rd.ValueTooLarge):
        client.put(prefix + "huge", np.empty((1 << 30) + 1, np.uint8))  # never touched: no memory used
    with pytest.raises(TypeError):
        client.put(prefix + "s", "a str is not bytes")
    with pytest.raises(TypeError):
        client.put(123, b"x")
    with pytest.raises(BufferError):
        client.get_into(prefix + "s", b"read-only")
    with pytest.raises(BufferError):
        client.put(prefix + "s", np.arange(10)[::2])
    assert issubclass(rd.Timeout, rd.Error) and issubclass(rd.Timeout, TimeoutError)


def test_no_space_and_auth_failed():
    s = ServerProc(memory="64MiB", workers=1, env={"RDRAM_AUTH_TOKEN": "s3cret"})
    try:
        with pytest.raises(rd.AuthFailed):
            rd.Client(s.address)
        with pytest.raises(rd.AuthFailed):
            rd.Client(s.address, auth_token="wrong")
        with rd.Client(s.address, auth_token="s3cret") as c:
            c.put("a", np.zeros(40 << 20, np.uint8))
            with pytest.raises(rd.NoSpace) as e:
                c.put("b", np.zeros(40 << 20, np.uint8))
            assert e.value.status == rd.Status.NO_SPACE
            assert c.get("b") is None and c.delete("a")
            c.put("b", np.zeros(40 << 20, np.uint8))
    finally:
        assert s.stop() == 0


def test_timeout_when_the_server_stops_answering():
    s = ServerProc(memory="64MiB", workers=1)
    try:
        with rd.Client(s.address, timeout=0.5) as c:
            c.put("k", b"v")
            s.proc.send_signal(signal.SIGSTOP)
            wait_until_stopped(s.proc.pid)
            try:
                t = time.monotonic()
                with pytest.raises(rd.Timeout):
                    c.get("k")
                assert time.monotonic() - t < 5
            finally:
                s.proc.send_signal(signal.SIGCONT)
    finally:
        assert s.stop() == 0


def test_a_client_reconnects_to_a_restarted_server():
    s = ServerProc(memory="64MiB", workers=1)
    port = s.address.rsplit(":", 1)[1]
    try:
        with rd.Client(s.address, timeout=5) as c:
            c.put("k", b"before")
            s.proc.kill()
            s.proc.wait()
            with pytest.raises(rd.Unavailable):
                c.get("k")
            s = ServerProc("--listen", f"127.0.0.1:{port}", memory="64MiB", workers=1)
            # The next calls connect again (after a short backoff); the new server is empty.
            deadline = time.monotonic() + 10
            while True:
                try:
                    assert c.get("k") is None
                    break
                except rd.Unavailable:
                    assert time.monotonic() < deadline, "the client never reconnected"
                    time.sleep(0.05)
            assert c.put("k", b"after") and c.get("k") == b"after"
    finally:
        assert s.stop() == 0


def wait_until_stopped(pid: int) -> None:
    """SIGSTOP takes effect asynchronously; wait until the process state says stopped."""
    deadline = time.monotonic() + 5
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the server did not stop"
        time.sleep(0.001)


def test_closed_client(server):
    c = rd.Client(server.address)
    c.close()
    c.close()
    with pytest.raises(rd.InvalidArgument, match="closed"):
        c.get("k")
    with rd.Client(server.address) as c2:
        assert c2.get("never-written") is None
    with pytest.raises(rd.InvalidArgument):
        c2.get("k")


def in_threads(work, n: int = 4) -> list[BaseException]:
    """Runs work(0..n) on n threads; the exceptions they raised."""
    errors: list[BaseException] = []

    def run(t):
        try:
            work(t)
        except BaseException as e:  # noqa: BLE001 - returned to the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_threads_share_one_client(client, prefix):
    def work(t):
        for i in range(100):
            k = f"{prefix}{t}/{i}"
            v = pattern(i * 37 + t)
            client.put(k, v)
            assert client.get(k) == v.tobytes()

    assert in_threads(work) == []
    assert len(list(client.list(prefix))) == 400


def test_one_client_per_thread(server, prefix):
    def work(t):
        with rd.Client(server.address) as c:
            for i in range(100):
                k = f"{prefix}{t}/{i}"
                c.put(k, pattern(i + t))
                out = np.empty(i + t, np.uint8)
                assert c.get_into(k, out) == i + t and np.array_equal(out, pattern(i + t))

    assert in_threads(work) == []


def test_the_gil_is_released_during_a_transfer(client, prefix):
    value = np.ones(256 << 20, np.uint8)
    client.put(prefix + "big", value)
    out = np.zeros(256 << 20, np.uint8)
    ticks = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1

    counter = threading.Thread(target=count)
    counter.start()
    try:
        time.sleep(0.05)
        before = ticks[0]
        assert client.get_into(prefix + "big", out) == 256 << 20
        during = ticks[0] - before
    finally:
        stop.set()
        counter.join()
    assert out.all()
    # With the GIL held for the whole call the other thread could not count at all.
    assert during > 1000, f"the other thread counted only {during} times during a 256 MiB get"
    client.delete(prefix + "big")


def test_a_writer_process_and_a_reader_process_share_an_array(server, prefix):
    writer = """
import sys, numpy as np, remote_dram as rd
i, j, k = np.indices((8, 6, 4))
a = (i * 100 + j * 10 + k).astype(np.float32)
with rd.Client(sys.argv[1]) as c:
    print(c.put(sys.argv[2], a))
"""
    reader = """
import sys, numpy as np, remote_dram as rd
out = np.zeros((8, 6, 4), np.float32)
with rd.Client(sys.argv[1]) as c:
    assert c.get_into(sys.argv[2], out) == out.nbytes
for i in range(8):
    for j in range(6):
        for k in range(4):
            assert out[i, j, k] == i * 100 + j * 10 + k, (i, j, k, out[i, j, k])
print("ok", out[7, 5, 3])
"""
    w = run_python(writer, server.address, prefix + "array")
    assert w.returncode == 0, w.stderr
    r = run_python(reader, server.address, prefix + "array")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ok", "753.0"]


def test_embedded_server_is_reached_over_the_transport():
    with rd.Server(memory="128MiB", workers=2, **EMBEDDED_ARGS) as s:
        assert s.address.startswith("127.0.0.1:")
        assert s.transport.startswith(EMBEDDED_ARGS["transport"])
        with rd.Client(s.address) as c:
            c.put("from-here", b"embedded")
        # Another process reaches the same server through its address.
        r = run_python("import sys, remote_dram as rd\nc = rd.Client(sys.argv[1])\nprint(c.get('from-here').decode())\nc.put('from-there', b'x' * 5000000)", s.address)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "embedded"
        with rd.Client(s.address) as c:
            assert c.get("from-there") == b"x" * 5000000
        s.stop()
        s.stop()
    with pytest.raises(rd.Unavailable):
        rd.Client(s.address, connect_timeout=1)
    with pytest.raises(rd.InvalidArgument):
        rd.Server(mode="neither")


def test_the_python_example_runs_against_a_server(server):
    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "python" / "kv_cache_staging.py"
    r = subprocess.run([sys.executable, str(example), server.address], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every block read back into the preallocated cache, byte-exact" in r.stdout
    assert "removed 32 blocks" in r.stdout


def test_import_skips_ucx_grace_wait_only_while_other_threads_are_parked_and_leaves_no_trace():
    # The package sets UCX_MEM_BISTRO_GRACE_DURATION=0 only while UCX loads, and only while
    # every other thread sleeps until woken; child processes never see it, and a user's
    # value wins.
    code = (
        "import os, threading, time\n"
        "if os.environ.get('SPAWN_THREAD'):\n"
        "    threading.Thread(target=time.sleep, args=(0.5,), daemon=True).start()\n"
        "import remote_dram\n"
        "print(os.environ.get('UCX_MEM_BISTRO_GRACE_DURATION', 'unset'))\n"
    )
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "unset"
    import os

    env = dict(os.environ, UCX_MEM_BISTRO_GRACE_DURATION="50ms")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "50ms"
    env = dict(os.environ, SPAWN_THREAD="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "unset"

    # Which threads count as parked: one waiting on an event with no timeout does; one in a
    # timed sleep, or on an event with a timeout, may wake by itself and does not.
    code = (
        "import sys, threading, time, remote_dram\n"
        "target = {'wait': threading.Event().wait, 'sleep': time.sleep, 'timed-wait': threading.Event().wait}\n"
        "args = {'wait': (), 'sleep': (60,), 'timed-wait': (60,)}\n"
        "alone = remote_dram._others_parked()\n"
        "threading.Thread(target=target[sys.argv[1]], args=args[sys.argv[1]], daemon=True).start()\n"
        "time.sleep(0.2)\n"
        "print(alone, remote_dram._others_parked())\n"
    )
    for case, parked in (("wait", "True"), ("sleep", "False"), ("timed-wait", "False")):
        r = run_python(code, case)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["True", parked], case


def test_every_error_status_has_its_exception_class():
    """Each error status (the negative ones) raises a class of its own, which says so; a
    code that is no status raises InternalError. (tests/header.rs checks the numbers
    against the Rust and C tables.)"""
    from remote_dram.errors import _BY_STATUS, _from_status

    for status in rd.Status:
        if status < 0:
            cls = _BY_STATUS.get(status)
            assert cls is not None and cls.status == status, status
            raised = _from_status(int(status), "x")
            assert type(raised) is cls and raised.status == status
    assert len(set(_BY_STATUS.values())) == len(_BY_STATUS)
    assert isinstance(_from_status(-99, "x"), rd.InternalError)
    assert type(_from_status(int(rd.Status.MISSING), "x")) is rd.Error
