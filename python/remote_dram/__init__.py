"""remote_dram: a key-value store in other machines' DRAM, over UCX or libfabric.

    import numpy as np, remote_dram

    with remote_dram.Server(memory="1GiB") as server, remote_dram.Client(server.address) as c:
        c.put("weights/layer0", np.arange(1024, dtype=np.float32))   # no copy
        out = np.empty(1024, dtype=np.float32)
        c.get_into("weights/layer0", out)                              # straight into `out`

:class:`Client` talks to servers (``rdram serve`` processes or an embedded
:class:`Server`); failures raise :class:`Error` subclasses from
:mod:`remote_dram.errors`; :mod:`remote_dram.torch` saves and loads PyTorch state dicts.
"""

from __future__ import annotations


def _load_ucx() -> None:
    # The native module links libucp/libucs/libuct by soname; the libucx-cu13 wheel holds
    # them. Loading them first lets the dynamic loader resolve those names (set
    # RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true to prefer a system UCX).
    try:
        import libucx
    except ImportError:  # a system UCX on the loader's path
        return
    libucx.load_library()


def _threads() -> int:
    """Threads in this process (native ones too), or 0 when it cannot be told."""
    import os

    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _load_native() -> None:
    # UCX patches eight memory functions (mmap, munmap, ...) when it loads and waits 50 ms
    # after each, in case another thread is inside one: 0.4 s of every import. With a
    # single thread in the process nothing can be inside them, so the wait is skipped then
    # (a value the user set wins; with more threads, UCX's default stands). The variable
    # is only read while UCX loads, and is taken back out of the environment after, so
    # child processes do not inherit it.
    import os

    name = "UCX_MEM_BISTRO_GRACE_DURATION"
    skip_wait = name not in os.environ and _threads() == 1
    if skip_wait:
        os.environ[name] = "0"
    try:
        _load_ucx()
        from . import _native
    finally:
        if skip_wait:
            os.environ.pop(name, None)


_load_native()

from ._native import PROTOCOL_VERSION, Client, Entry, Server  # noqa: E402
from .errors import (  # noqa: E402
    AuthFailed,
    BufferTooSmall,
    Error,
    InternalError,
    InvalidArgument,
    IoError,
    KeyTooLarge,
    NoRoom,
    NoSpace,
    OutOfRange,
    Status,
    Timeout,
    TransportError,
    Unavailable,
    ValueTooLarge,
    VersionMismatch,
    WrongShard,
)

__version__ = "0.1.0"

__all__ = [
    "Client", "Entry", "Server", "PROTOCOL_VERSION", "Status", "Error", "AuthFailed", "BufferTooSmall",
    "InternalError", "InvalidArgument", "IoError", "KeyTooLarge", "NoRoom", "NoSpace", "OutOfRange", "Timeout",
    "TransportError", "Unavailable", "ValueTooLarge", "VersionMismatch", "WrongShard",
]
