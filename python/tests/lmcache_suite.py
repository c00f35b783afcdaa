"""LMCache's own connector tests against remote_dram.

Fetches LMCache 0.5.6's source distribution from PyPI (checked against its SHA-256), takes
its tests/v1/test_connector.py with the conftest and helpers it needs, applies
lmcache-0.5.6-test_connector.patch (the remote tests' URLs become a remote_dram server's,
their CreateConnector calls get the plugin entry that loads remote_dram.lmcache, and the
"metadata without kv bytes" test plants its header-only value through this connector
instead of a Redis cluster's), starts a real `rdram serve` and runs pytest on the file.
LMCache's fs and Redis-plugin tests in it run unchanged.

This module is also the pytest plugin of that run: each of LMCache's tests starts with no
chunk stored, as each starts with a fresh mock Redis there (their keys do not change).

Usage (from python/tests, with LMCache installed): python lmcache_suite.py [pytest args]
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import tarfile
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
SDIST = "lmcache-0.5.6.tar.gz"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/84/25/3ccd46844c94e08897aa8d72716a538c07e4583410d84dbc6cd12cb60dc1/"
    + SDIST
)
SDIST_SHA256 = "d6951e60ce8818a76aa42d0866a4ba85f1c95cd919355fff30ff24dcc3243f1e"
FILES = ["tests/__init__.py", "tests/conftest.py", "tests/v1/__init__.py", "tests/v1/utils.py", "tests/v1/test_connector.py"]
PATCH = HERE / "lmcache-0.5.6-test_connector.patch"


def sdist(cache: pathlib.Path) -> pathlib.Path:
    """LMCache's source distribution, downloaded once into `cache` and checked."""
    path = cache / SDIST
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        print(f"== downloading {SDIST_URL}", flush=True)
        with urllib.request.urlopen(SDIST_URL, timeout=120) as r:
            data = r.read()
        path.with_suffix(".part").write_bytes(data)
        path.with_suffix(".part").rename(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        path.unlink()
        sys.exit(f"{SDIST}: SHA-256 {digest}, expected {SDIST_SHA256}; removed it, run again")
    return path


def extract(archive: pathlib.Path, dest: pathlib.Path) -> None:
    """The test files, fresh, under `dest`, with the patch applied."""
    with tarfile.open(archive) as tar:
        for name in FILES:
            member = tar.getmember(f"lmcache-0.5.6/{name}")
            out = dest / name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(tar.extractfile(member).read())
    subprocess.run(["git", "apply", "-p1", str(PATCH)], cwd=dest, check=True)


try:
    import pytest
except ImportError:  # the runner itself needs no pytest
    pytest = None

if pytest is not None:

    @pytest.fixture(autouse=True)
    def no_chunk_stored():
        """Deletes every chunk the previous test left on the server."""
        server = os.environ.get("RDRAM_LMCACHE_SERVER")
        if server:
            import remote_dram

            with remote_dram.Client(server) as c:
                c.delete_range("lmcache/", "lmcache0")
        yield


def main() -> int:
    root = HERE.parents[1]
    work = root / "target" / "lmcache-suite"
    extract(sdist(root / "target" / "downloads"), work)
    os.environ.setdefault("RDRAM_TEST_TRANSPORT", "shm")
    sys.path.insert(0, str(HERE))
    from conftest import ServerProc  # noqa: E402  (sets the transport's environment first)

    server = ServerProc(memory="2GiB")
    try:
        path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "RDRAM_LMCACHE_SERVER": server.address, "PYTHONPATH": path}
        plugin = ["-p", "lmcache_suite", "-p", "no:cacheprovider"]
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", *plugin, "tests/v1/test_connector.py", *sys.argv[1:]]
        print(f"== LMCache 0.5.6's tests/v1/test_connector.py against {server.address}", flush=True)
        status = subprocess.run(cmd, cwd=work, env=env).returncode
    finally:
        stopped = server.stop()
    if stopped != 0:
        print("".join(server.log))
        print(f"rdram serve exited with {stopped}")
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
