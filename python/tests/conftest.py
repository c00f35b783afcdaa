"""Real `rdram serve` processes on ephemeral loopback ports, over the transport named by
RDRAM_TEST_TRANSPORT: "tcp" or "shm" (UCX) or "fabric:PROVIDER" (libfabric, e.g.
"fabric:tcp;ofi_rxm"). The environment is set before any UCX context exists and is
inherited by the processes the tests start."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RDRAM = os.environ.get("RDRAM_BIN", str(ROOT / "target" / "release" / "rdram"))
TRANSPORT = os.environ.get("RDRAM_TEST_TRANSPORT", "tcp")
UCX_TLS = {"tcp": "tcp", "shm": "posix,sysv,cma,self"}

os.environ["UCX_NET_DEVICES"] = "lo"
# Cluster members (`--cluster`) read the secret they share from here.
_SECRET = pathlib.Path(tempfile.gettempdir()) / f"rdram-test-cluster-secret-{os.getpid()}"
_SECRET.write_text("a cluster secret for these tests\n")
_SECRET.chmod(0o600)
os.environ["RDRAM_CLUSTER_SECRET_FILE"] = str(_SECRET)
if TRANSPORT.startswith("fabric:"):
    PROVIDER = TRANSPORT.removeprefix("fabric:")
    SERVE_ARGS = ["--transport", "fabric", "--provider", PROVIDER]
    EMBEDDED_ARGS = {"transport": "fabric", "provider": PROVIDER}
else:
    os.environ["UCX_TLS"] = UCX_TLS[TRANSPORT]
    if TRANSPORT == "tcp":
        # UCX's tcp transport is a trusted-network opt-in (docs/security.md).
        os.environ["RDRAM_UCX_TCP"] = "1"
    SERVE_ARGS = ["--transport", "ucx"]
    EMBEDDED_ARGS = {"transport": "ucx"}


class ServerProc:
    """`rdram serve --listen 127.0.0.1:0` plus `args`; `.address` once it listens."""

    def __init__(self, *args: str, memory: str = "1GiB", workers: int = 2, env: dict[str, str] | None = None):
        cmd = [RDRAM, "serve", "--listen", "127.0.0.1:0", "--workers", str(workers), "--memory", memory, "--hugepages", "off", *SERVE_ARGS, *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
        self.log: list[str] = []
        self.address = None
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith("listening on "):
                self.address = line.split()[-1]
                break
        if self.address is None:
            raise RuntimeError(f"rdram serve exited with {self.proc.wait()}:\n{''.join(self.log)}")
        # Keep draining its output so that it never blocks on a full pipe.
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()

    def stop(self) -> int:
        """SIGTERM; the server must exit 0."""
        self.proc.terminate()
        return self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server():
    s = ServerProc()
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture
def client(server):
    import remote_dram

    with remote_dram.Client(server.address) as c:
        yield c


@pytest.fixture
def prefix(request):
    """A key prefix of this test's own."""
    return f"{request.node.name}/"


def run_python(code: str, *args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs `code` in a separate Python process (same interpreter; this environment, or `env`)."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def etcd():
    """A real etcd on two free loopback ports, for clusters; yields its HOST:PORT."""
    if shutil.which("etcd") is None:
        pytest.fail("etcd is not installed (make deps installs Debian's etcd-server)")
    with tempfile.TemporaryDirectory() as data:
        # Ports are found free and then handed to etcd, so another process may take one
        # in between (or both picks be the same port): etcd then exits, and starts again
        # on new ports.
        for attempt in range(3):
            client = free_port()
            peer = free_port()
            while peer == client:
                peer = free_port()
            proc = subprocess.Popen(
                ["etcd", "--name", "t", "--data-dir", f"{data}/{attempt}",
                 "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
                 "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-cluster", f"t=http://127.0.0.1:{peer}", "--log-level", "error"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 20
            while proc.poll() is None:
                try:
                    socket.create_connection(("127.0.0.1", client), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "etcd did not start"
                    time.sleep(0.1)
            if proc.poll() is None:
                break
        else:
            pytest.fail(f"etcd exited at start three times (last status {proc.returncode})")
        yield f"127.0.0.1:{client}"
        proc.kill()
        proc.wait()
