"""A cluster whose membership lives in etcd, reached from Python by its etcd:// string:
a real etcd on loopback ports and real `rdram serve --cluster` processes."""

from __future__ import annotations

import subprocess

from conftest import RDRAM, ServerProc


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
