"""A cluster whose membership lives in etcd, reached from Python by its etcd:// string:
a real etcd on loopback ports, real `rdram serve --cluster` processes, and a server
embedded in this Python process that joins the cluster, serves and drains."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from conftest import EMBEDDED_ARGS, RDRAM, ServerProc


def placed(url: str) -> list[str]:
    """The members of the cluster's placement once no keys move (else an empty list)."""
    out = subprocess.run([RDRAM, "cluster", "status", url], capture_output=True, text=True, check=True).stdout
    p = json.loads(out)["placement"]
    return p["members"] if p["next"] is None else []


def wait_placed(url: str, n: int) -> list[str]:
    deadline = time.monotonic() + 30
    while len(members := placed(url)) != n:
        assert time.monotonic() < deadline, f"{n} members were not placed: {members}"
        time.sleep(0.1)
    return members


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


def test_an_embedded_server_joins_serves_and_drains(etcd):
    import remote_dram

    url = f"etcd://{etcd}/py-member"
    created = subprocess.run([RDRAM, "cluster", "create", url], capture_output=True, text=True)
    assert created.returncode == 0, created.stderr
    other = ServerProc("--cluster", url, workers=1, memory="64MiB")
    try:
        with pytest.raises(remote_dram.InvalidArgument):
            remote_dram.Server(memory="16MiB", cluster="etcd://nowhere", **EMBEDDED_ARGS)
        with remote_dram.Server(memory="64MiB", cluster=url, lease_ttl=3, **EMBEDDED_ARGS) as embedded:
            assert sorted(wait_placed(url, 2)) == sorted([other.address, embedded.address])
            with remote_dram.Client(url) as c:
                for i in range(30):
                    c.put(f"member/{i}", f"value {i}".encode())
            with remote_dram.Client(embedded.address) as direct:
                held = direct.stats()["keys"]
            assert held > 0, "the embedded member holds none of 30 keys"
            assert embedded.drain(timeout=30) >= 0
            assert placed(url) == [other.address]
        with pytest.raises(remote_dram.InvalidArgument):
            embedded.drain()  # stopped
        with remote_dram.Server(memory="16MiB", **EMBEDDED_ARGS) as alone, pytest.raises(remote_dram.InvalidArgument):
            alone.drain()
        with remote_dram.Client(url) as c:
            assert [c.get(f"member/{i}") for i in range(30)] == [f"value {i}".encode() for i in range(30)]
    finally:
        assert other.stop() == 0, "".join(other.log)
