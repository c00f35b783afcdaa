"""CUDA tensors and arrays through the Python client, on a machine with a GPU (bench/gpu-check).

    python3 torch_check.py ADDR put PREFIX    # CUDA tensors, a CuPy array and a CUDA state_dict in
    python3 torch_check.py ADDR get PREFIX    # ...read back by another process, and checked

`get` reads each value into CUDA memory with get_into, into host memory, and back (a value
put from host memory into CUDA memory); every check prints one line, and the exit status
is 0 only when all passed. Values are made from seeds, so the reader knows what to expect.
"""

from __future__ import annotations

import sys

import torch

import remote_dram as rd
from remote_dram.torch import load_state_dict, save_state_dict

SIZES = [0, 1, 4095, 1 << 20, (4 << 20) + 3, 64 << 20, 1 << 30]
JAX_LEN = (48 << 20) + 5


def expected(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 16))
    return m.to(torch.bfloat16).cuda()


failures = 0


def check(what: str, ok: bool) -> None:
    global failures
    failures += not ok
    print(f"{what}: {'ok' if ok else 'FAILED'}", flush=True)


def put(c: rd.Client, prefix: str) -> None:
    for i, n in enumerate(SIZES):
        c.put(f"{prefix}/t{n}", expected(i, n).cuda())
        check(f"put {n} B from a CUDA tensor", True)
    try:
        import cupy

        c.put(f"{prefix}/cupy", cupy.asarray(expected(100, 3 << 20).numpy()))
        check("put a CuPy array", True)
    except ImportError:
        print("CuPy: not installed, skipped")
    save_state_dict(c, f"{prefix}/model", model(7).state_dict())
    check("save a CUDA state_dict", True)
    try:
        import jax
        import jax.numpy as jnp

        # Computed asynchronously on JAX's own stream, and put at once: offered through
        # DLPack, which must make the bytes ready before the client reads them.
        x = (jnp.arange(JAX_LEN, dtype=jnp.uint32) * 7 % 251).astype(jnp.uint8)
        c.put(f"{prefix}/jax", x)
        check(f"put a JAX array from {x.devices()} through DLPack", True)
    except ImportError:
        print("JAX: not installed, skipped")


def get(c: rd.Client, prefix: str) -> None:
    for i, n in enumerate(SIZES):
        want = expected(i, n)
        out = torch.full((n,), 0xEE, dtype=torch.uint8, device="cuda")
        got = c.get_into(f"{prefix}/t{n}", out)
        check(f"get {n} B into a CUDA tensor of another process", got == n and torch.equal(out.cpu(), want))
        if n <= 64 << 20:
            check(f"get {n} B put from device into host memory", c.get(f"{prefix}/t{n}") == want.numpy().tobytes())
    # Host memory in, device memory out.
    host = expected(200, 5 << 20)
    c.put(f"{prefix}/host", host.numpy())
    out = torch.empty(host.numel(), dtype=torch.uint8, device="cuda")
    check("put from host memory, get into a CUDA tensor", c.get_into(f"{prefix}/host", out) == host.numel() and torch.equal(out.cpu(), host))
    try:
        import cupy

        arr = cupy.zeros(3 << 20, dtype=cupy.uint8)
        check("get into a CuPy array", c.get_into(f"{prefix}/cupy", arr) == arr.size and bytes(arr.get()) == expected(100, 3 << 20).numpy().tobytes())
    except ImportError:
        print("CuPy: not installed, skipped")
    try:
        import jax  # noqa: F401

        out = torch.zeros(JAX_LEN, dtype=torch.uint8, device="cuda")
        want = (torch.arange(JAX_LEN, dtype=torch.int64) * 7 % 251).to(torch.uint8)
        check("get a JAX array's bytes into a CUDA tensor", c.get_into(f"{prefix}/jax", out) == JAX_LEN and torch.equal(out.cpu(), want))
    except ImportError:
        print("JAX: not installed, skipped")
    want_state = model(7).state_dict()
    like = {k: torch.zeros_like(v) for k, v in want_state.items()}
    loaded = load_state_dict(c, f"{prefix}/model", like=like)
    same = all(loaded[k].device.type == "cuda" and loaded[k].data_ptr() == like[k].data_ptr() and torch.equal(loaded[k], v) for k, v in want_state.items())
    check("load a CUDA state_dict in place (no host copy by the caller)", same)


if __name__ == "__main__":
    addr, role, prefix = sys.argv[1:4]
    with rd.Client(addr) as client:
        {"put": put, "get": get}[role](client, prefix)
    sys.exit(1 if failures else 0)
