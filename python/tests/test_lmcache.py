"""remote_dram as LMCache's remote tier (remote_dram.lmcache), against real `rdram serve`
processes, with LMCache 0.5.6 from PyPI on the CPU: LMCache's own check tool, its
StorageManager configured from YAML, two instances sharing chunks, and a server that is
down. Each LMCache instance runs in a process of its own (lmcache_instance.py)."""

from __future__ import annotations

import pathlib
import json
import os
import re
import subprocess
import sys
import time

import pytest

if os.environ.get("RDRAM_TEST_LMCACHE") == "0":
    pytest.skip("RDRAM_TEST_LMCACHE=0: LMCache left out", allow_module_level=True)
import lmcache  # noqa: E402,F401  (python/tests/run.sh installs it; missing, these tests fail)

from conftest import RDRAM, ROOT, ServerProc, free_port  # noqa: E402

EXAMPLE = ROOT / "examples" / "lmcache" / "remote_dram.yaml"
INSTANCE = pathlib.Path(__file__).with_name("lmcache_instance.py")


def config(tmp_path: pathlib.Path, address: str, *, plugin_only: bool = False, save_chunk_meta: bool = True) -> pathlib.Path:
    """The shipped example config, pointed at `address`. `plugin_only` names the servers in
    extra_config instead of remote_url (the plugin form)."""
    text = EXAMPLE.read_text()
    assert 'remote_url: "remote_dram://127.0.0.1:7000"' in text
    text = text.replace("127.0.0.1:7000", address)
    if plugin_only:
        text = text.replace(f'remote_url: "remote_dram://{address}"', "")
        text += f'  remote_dram.url: "remote_dram://{address}"\n'
    if not save_chunk_meta:
        text += "  save_chunk_meta: false\n"
    path = tmp_path / "lmcache.yaml"
    path.write_text(text)
    return path


def run(args: list[str], cfg: pathlib.Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {"LMCACHE_CONFIG_FILE": str(cfg), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})


def instance(cfg: pathlib.Path, role: str, *extra: str) -> subprocess.CompletedProcess:
    return run([str(INSTANCE), str(cfg), role, *extra], cfg)


def assert_checks_passed(p: subprocess.CompletedProcess, at_least: int) -> None:
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    passed = [line for line in p.stdout.splitlines() if line.startswith("ok ")]
    assert len(passed) >= at_least and "FAIL" not in p.stdout, out


@pytest.fixture
def server():
    s = ServerProc(memory="1GiB")
    yield s
    assert s.stop() == 0, "".join(s.log)


def key_count(address: str) -> int:
    import remote_dram

    with remote_dram.Client(address) as c:
        return sum(1 for _ in c.list("lmcache/"))


@pytest.mark.parametrize(
    "kv_dtype,obj_size,save_chunk_meta",
    [("bfloat16", 1024, True), ("float16", 262144, True), ("float32", 4096, True), ("bfloat16", 65536, False)],
)
def test_lmcache_basic_check_passes(server, tmp_path, kv_dtype, obj_size, save_chunk_meta):
    """`python -m lmcache.v1.basic_check --mode test_remote` with the example config:
    every validation passes (exists before and after, put, get byte for byte)."""
    cfg = config(tmp_path, server.address, save_chunk_meta=save_chunk_meta)
    p = run(["-m", "lmcache.v1.basic_check", "--mode", "test_remote", "--kv-dtype", kv_dtype, "--obj-size", str(obj_size), "--num-keys", "8"], cfg)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    validations = re.findall(r"Validation[^:]*: (\d+)/(\d+) passed", p.stdout)
    assert len(validations) == 5, out  # exists (missing), put, exists (stored), get not None, get content
    assert all(a == b == "8" for a, b in validations), out
    assert "Test Failed" not in out and "unreachable" not in out, out
    assert key_count(server.address) == 8  # one key a chunk


@pytest.mark.parametrize("dtype,plugin_only,save_chunk_meta", [("bfloat16", False, True), ("float16", True, True), ("bfloat16", False, False)])
def test_lmcache_storage_manager_reads_dropped_chunks_back_from_remote_dram(server, tmp_path, dtype, plugin_only, save_chunk_meta):
    """LMCache's StorageManager from YAML: chunks of 256 tokens x 32 layers x 8 heads x
    128 dims (and a partial one of 100 tokens) stored, dropped from the local CPU tier,
    found in and read back from remote_dram byte for byte; a chunk never stored misses.
    The example's plugin entry stores nothing of its own: one key a chunk, LMCache's
    28-byte metadata before the bytes (or the bytes alone), under the model's prefix."""
    cfg = config(tmp_path, server.address, plugin_only=plugin_only, save_chunk_meta=save_chunk_meta)
    p = instance(cfg, "store-reload", "--dtype", dtype)
    assert_checks_passed(p, at_least=10)
    import remote_dram
    from remote_dram.lmcache import key_prefix

    with remote_dram.Client(server.address) as c:
        names = [k.decode() for k, _ in c.list(key_prefix("org/model-7b", 1, 0))]
        sizes = {k.decode(): size for k, size in c.list("lmcache/")}
    assert len(names) == 4, names
    assert len(sizes) == len(names), sizes
    header = 28 if save_chunk_meta else 0
    assert sorted(sizes.values()) == [header + 2 * 32 * 100 * 1024 * 2] + [header + 2 * 32 * 256 * 1024 * 2] * 3


def test_a_lookup_on_a_full_cache_server_never_finds_half_a_chunk(tmp_path):
    """A server in cache mode, filled past its memory: what LMCache's lookup finds, its
    load reads whole (a chunk's metadata and bytes are one key, evicted together), and no
    key holds anything but a whole chunk."""
    s = ServerProc("--mode", "cache", memory="256MiB")
    try:
        p = instance(config(tmp_path, s.address), "overfill")
        assert_checks_passed(p, at_least=2)
        import remote_dram

        with remote_dram.Client(s.address) as c:
            sizes = [size for _, size in c.list("lmcache/")]
        assert sizes and all(size == 28 + 2 * 32 * 256 * 1024 * 2 for size in sizes), sizes
    finally:
        assert s.stop() == 0, "".join(s.log)


def test_two_lmcache_instances_share_chunks_through_one_server(server, tmp_path):
    """One LMCache process stores chunks; another, started after it exited, finds and reads
    them (cross-instance reuse, the reason for a remote tier)."""
    cfg = config(tmp_path, server.address)
    stored = instance(cfg, "store", "--seed", "7")
    assert stored.returncode == 0 and "stored" in stored.stdout, stored.stdout + stored.stderr
    loaded = instance(cfg, "load", "--seed", "7")
    assert_checks_passed(loaded, at_least=10)
    # A different model prefix deletes nothing; the model's prefix deletes every chunk.
    import remote_dram
    from remote_dram.lmcache import key_prefix, prefix_end

    with remote_dram.Client(server.address) as c:
        other = key_prefix("org/model")
        assert c.delete_range(other, prefix_end(other)) == 0
        mine = key_prefix("org/model-7b")
        assert c.delete_range(mine, prefix_end(mine)) == 4
        assert list(c.list("lmcache/")) == []


def serve_at(address: str, token: str | None = None) -> subprocess.Popen:
    env = {**os.environ, **({"RDRAM_AUTH_TOKEN": token} if token else {})}
    return subprocess.Popen([RDRAM, "serve", "--listen", address, "--workers", "1", "--memory", "512MiB", "--hugepages", "off"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def wait_for_line(p: subprocess.Popen, prefix: str, lines: list[str]) -> None:
    for line in p.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return
    raise AssertionError(f"the LMCache process ended before printing {prefix!r}:\n" + "".join(lines))


def lmcache_process(cfg: pathlib.Path, role: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(INSTANCE), str(cfg), role],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "LMCACHE_CONFIG_FILE": str(cfg), "PYTHONUNBUFFERED": "1"},
    )


def check_outage_log(p: subprocess.Popen, lines: list[str], out: str) -> None:
    log = "".join(lines) + out
    print(*(line for line in log.splitlines() if line.startswith(("down: ", "up again"))), sep="\n")
    assert p.returncode == 0 and "FAIL" not in log, log
    down = next(line for line in log.splitlines() if line.startswith("down: "))
    assert float(down.split()[1]) < 30, down  # bounded by nothing but the calls' own work
    assert log.count("is unreachable") == 2, log  # once for the store connection, once for the load one
    assert log.count("reconnected to") >= 1, log
    assert "Traceback" not in log, log


def test_lmcache_falls_back_while_the_server_is_down_and_reconnects(tmp_path):
    """With the server down LMCache's lookups miss and its stores are dropped at once, the
    outage is logged once per connection (not per chunk); once a server listens on the
    address, chunks round-trip again without a restart."""
    address = f"127.0.0.1:{free_port()}"
    p = lmcache_process(config(tmp_path, address), "outage")
    lines: list[str] = []
    wait_for_line(p, "waiting", lines)
    srv = serve_at(address)
    try:
        out, _ = p.communicate("up\n", timeout=180)
    finally:
        srv.terminate()
        assert srv.wait(timeout=30) == 0
    check_outage_log(p, lines, out)


def test_lmcache_survives_a_server_killed_and_restarted(tmp_path):
    """The server is SIGKILLed under LMCache and restarted on the same address: lookups
    degrade to misses, stores fail cleanly, nothing escapes into the engine or hangs, and
    after the restart new stores and loads work."""
    address = f"127.0.0.1:{free_port()}"
    srv = serve_at(address)
    p = lmcache_process(config(tmp_path, address), "restart")
    lines: list[str] = []
    try:
        wait_for_line(p, "waiting", lines)
        srv.kill()
        srv.wait()
        p.stdin.write("killed\n")
        p.stdin.flush()
        wait_for_line(p, "waiting", lines)
        srv = serve_at(address)
        out, _ = p.communicate("up\n", timeout=180)
    finally:
        p.kill()
        srv.terminate()
        assert srv.wait(timeout=30) in (0, -9)
    check_outage_log(p, lines, out)


def test_lmcache_over_a_cluster_keeps_chunks_when_a_replica_dies(etcd, tmp_path):
    """remote_url names a cluster on etcd with two replicas per key: chunks LMCache
    stored are read back by another LMCache process after one server was SIGKILLed."""
    url = f"etcd://{etcd}/lmcache"
    created = subprocess.run([RDRAM, "cluster", "create", url, "--replicas", "2"], capture_output=True, text=True)
    assert created.returncode == 0, created.stderr
    members = [ServerProc("--cluster", url, "--lease-ttl-ms", "2000", workers=1, memory="512MiB") for _ in range(2)]
    try:
        cfg = config(tmp_path, url)
        stored = instance(cfg, "store-reload", "--seed", "3")
        assert_checks_passed(stored, at_least=10)
        members[0].proc.kill()
        members[0].proc.wait()
        deadline = time.monotonic() + 30
        while len(json.loads(subprocess.run([RDRAM, "cluster", "status", url], capture_output=True, text=True).stdout)["members"]) != 1:
            assert time.monotonic() < deadline, "the killed server is still a member after 30 s"
            time.sleep(0.2)
        loaded = instance(cfg, "load", "--seed", "3")
        assert_checks_passed(loaded, at_least=10)
    finally:
        assert members[1].stop() == 0, "".join(members[1].log)


def test_a_wrong_token_fails_loudly_at_start_and_later():
    """A missing or wrong token is no outage: the tier's connection refuses to start with
    AuthFailed, saying how to fix it; one that worked and then meets a server with another
    token raises AuthFailed (not Unavailable) once its reconnections are refused."""
    import remote_dram
    from remote_dram.lmcache import _Link

    address = f"127.0.0.1:{free_port()}"
    srv = serve_at(address, token="the servers' token")
    try:
        wait_until_serving(address, "the servers' token")
        for token in (None, "not the servers' token"):
            with pytest.raises(remote_dram.AuthFailed, match="remote_dram.auth_token_file"):
                _Link("store", address, token, 5.0, 1.0, 0.2)
        link = _Link("store", address, "the servers' token", 5.0, 1.0, 0.2)
        assert link.call(lambda c: c.put("k", b"v"))
        srv.terminate()
        assert srv.wait(timeout=30) == 0
        srv = serve_at(address, token="a new token")
        wait_until_serving(address, "a new token")
        deadline = time.monotonic() + 30
        while True:
            try:
                link.call(lambda c: c.get("k"))
            except remote_dram.AuthFailed as e:
                assert "remote_dram.auth_token_file" in str(e), e
                break
            except remote_dram.Error:
                pass
            assert time.monotonic() < deadline, "the refused reconnections never surfaced as AuthFailed"
            time.sleep(0.1)
        link.close()
    finally:
        srv.terminate()
        assert srv.wait(timeout=30) == 0


def wait_until_serving(address: str, token: str) -> None:
    import remote_dram

    deadline = time.monotonic() + 30
    while True:
        try:
            remote_dram.Client(address, auth_token=token).close()
            return
        except remote_dram.Unavailable:
            assert time.monotonic() < deadline, f"no server at {address}"
            time.sleep(0.1)
