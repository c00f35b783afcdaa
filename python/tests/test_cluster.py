"""A cluster whose membership lives in etcd, reached from Python by its etcd:// string:
a real etcd on loopback ports and real `rdram serve --cluster` processes."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

import pytest

from conftest import RDRAM, ServerProc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def etcd():
    if shutil.which("etcd") is None:
        pytest.fail("etcd is not installed (make deps installs Debian's etcd-server)")
    client, peer = free_port(), free_port()
    with tempfile.TemporaryDirectory() as data:
        proc = subprocess.Popen(
            ["etcd", "--name", "t", "--data-dir", data,
             "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"t=http://127.0.0.1:{peer}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", client), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "etcd did not start"
                time.sleep(0.1)
        yield f"127.0.0.1:{client}"
        proc.kill()
        proc.wait()


def test_a_client_given_the_etcd_string_reaches_every_member(etcd):
    import remote_dram

    url = f"etcd://{etcd}/py"
    created = subprocess.run([RDRAM, "cluster", "create", url], capture_output=True, text=True)
    assert created.returncode == 0, created.stderr
    members = [ServerProc("--cluster", url, workers=1, memory="64MiB") for _ in range(2)]
    try:
        with remote_dram.Client(url) as c:
            for i in range(20):
                c.put(f"k{i}".encode(), f"v{i}".encode())
            assert all(c.get(f"k{i}".encode()) == f"v{i}".encode() for i in range(20))
            stats = c.stats()
            assert sorted(s["node"] for s in stats["servers"]) == sorted(m.address for m in members)
    finally:
        for m in members:
            assert m.stop() == 0, "".join(m.log)
