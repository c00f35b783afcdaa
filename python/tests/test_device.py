"""CUDA device memory from Python, on machines without a GPU: host arrays pose as device
memory (``_native._pose_as_device``) and are offered the way CuPy (``__cuda_array_interface__``)
and JAX (a CUDA ``__dlpack__``) offer theirs. They have no buffer protocol, so every byte
moves through the client's staging, against a real server. Each case runs in a process of
its own: the posing device must be installed before the client first asks for a device.
``bench/gpu-check`` runs the same calls with torch and CuPy on the GPU machine."""

from __future__ import annotations

import os

import pytest
from conftest import run_python

PRELUDE = r"""
import sys
import numpy as np
import remote_dram as rd
from remote_dram import _native

CHUNK = 4 << 20  # remote_dram::client::DEVICE_CHUNK


class Posed:
    "Host memory posing as device memory."

    def __init__(self, n, fill=0):
        self.host = np.full(n, fill, np.uint8)
        assert _native._pose_as_device(self.host.ctypes.data, n), "too late to pose"


class CudaArray(Posed):
    "Offered as CuPy offers a CUDA array."

    @property
    def __cuda_array_interface__(self):
        return {"data": (self.host.ctypes.data, False), "shape": (len(self.host),), "typestr": "|u1", "strides": None, "version": 3, "stream": 1}


class DLPackArray(Posed):
    "Offered through DLPack with a CUDA device, as JAX offers one."

    def __dlpack__(self, stream=None):
        return self.host.__dlpack__()

    def __dlpack_device__(self):
        return (2, 0)


def pattern(seed, n):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


c = rd.Client(sys.argv[1])
"""


def run(server, body: str, device_path: str = "staged"):
    r = run_python(PRELUDE + body + "\nprint('done')\n", server.address, env={**os.environ, "RDRAM_DEVICE_PATH": device_path})
    assert r.returncode == 0 and r.stdout.strip().endswith("done"), r.stdout + r.stderr


# "transport": the device memory is handed to UCX itself (docs/gpu.md), which moves the
# posing memory as the host memory it is.
@pytest.mark.parametrize("device_path", ["staged", "transport"])
def test_cuda_array_interface_round_trips(server, prefix, device_path):
    prefix += device_path + "/"
    run(
        server,
        f"""
for i, n in enumerate([1, 1000, CHUNK + 5, 3 * CHUNK + 1]):
    key = "{prefix}" + str(n)
    value = pattern(i, n)
    src = CudaArray(n)
    src.host[:] = value
    g = c.put(key, src)
    assert c.get(key) == value.tobytes(), n             # device -> host
    dst = CudaArray(n, fill=7)
    assert c.get_into(key, dst) == n                     # host -> device, in chunks
    assert np.array_equal(dst.host, value), n
    assert c.get_entry(key).generation == g
c.put("{prefix}host", pattern(9, 100))
dst = CudaArray(100)
assert c.get_into("{prefix}host", dst, byte_range=(10, None)) == 90
assert np.array_equal(dst.host[:90], pattern(9, 100)[10:])
small = CudaArray(99, fill=3)
try:
    c.get_into("{prefix}host", small)
    raise AssertionError("a too-small device buffer took the value")
except rd.BufferTooSmall as e:
    assert e.needed == 100 and (small.host == 3).all()
""",
        device_path,
    )


def test_batches_and_dlpack(server, prefix):
    run(
        server,
        f"""
values = [pattern(i, n) for i, n in enumerate([10, CHUNK, 2 * CHUNK + 3])]
keys = ["{prefix}" + str(i) for i in range(len(values))]
srcs = []
for v in values:
    a = DLPackArray(len(v))
    a.host[:] = v
    srcs.append(a)
generations = c.put_many(list(zip(keys, srcs)))
assert len(generations) == 3 and all(generations)
assert c.get_many(keys) == [v.tobytes() for v in values]
dsts = [CudaArray(len(v)) for v in values]
assert c.get_many_into(keys, dsts) == [len(v) for v in values]
assert all(np.array_equal(d.host, v) for d, v in zip(dsts, values))
dl = DLPackArray(len(values[2]))
assert c.get_into(keys[2], dl) == len(values[2]) and np.array_equal(dl.host, values[2])
""",
    )
