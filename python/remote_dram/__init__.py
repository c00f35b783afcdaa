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


# Linux x86-64 system call numbers and futex operations, for _others_parked().
_SYS_FUTEX = 202
_FUTEX_WAIT, _FUTEX_WAIT_BITSET, _FUTEX_CMD_MASK = 0, 9, 0x7F
# How long an import waits for the process's other threads to park: an OpenBLAS pool spins
# for 2^28 cycles (OPENBLAS_THREAD_TIMEOUT's default) after it starts before it sleeps,
# 40-65 ms after `import numpy` on a 2-vCPU VM, so a wait of 60 ms missed it half the time
# and the import then paid UCX's 0.4 s.
_PARK_WAIT_S = 0.2


def _others_parked() -> bool:
    """Whether every other thread of this process sleeps in a futex wait without a timeout.

    Such a thread is inside none of the memory functions UCX rewrites as it loads, and it
    wakes only when another thread wakes it. False when it cannot be told."""
    import os

    me = str(os.getpid())
    try:
        for tid in os.listdir("/proc/self/task"):
            if tid == me:
                continue
            # "nr arg1 ... arg6 sp pc" while blocked in a call; "running" otherwise.
            fields = open(f"/proc/self/task/{tid}/syscall").read().split()
            if len(fields) < 5 or int(fields[0]) != _SYS_FUTEX:
                return False
            op, timeout = int(fields[2], 16) & _FUTEX_CMD_MASK, int(fields[4], 16)
            if op not in (_FUTEX_WAIT, _FUTEX_WAIT_BITSET) or timeout != 0:
                return False
    except (OSError, ValueError):  # a thread that ended meanwhile, or no /proc
        return False
    return True


def _may_skip_grace() -> bool:
    """Whether UCX's wait for threads inside the functions it patches can be skipped: every
    other thread parked (see _others_parked), waiting up to _PARK_WAIT_S for that."""
    import time

    deadline = time.monotonic() + _PARK_WAIT_S
    while not _others_parked():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


def _load_native() -> None:
    # UCX rewrites eight memory functions (mmap, munmap, ...) when it loads and, after each,
    # waits 50 ms in case another thread is inside one: 0.4 s of every import. When every
    # other thread is parked (none, or all asleep until someone wakes them, as a numpy's
    # BLAS pool is once idle) nothing can be inside them, so the wait is skipped then (a
    # value the user set wins; otherwise UCX's default stands). The variable is only read
    # while UCX loads, and is taken back out of the environment after, so child processes
    # do not inherit it.
    import os

    name = "UCX_MEM_BISTRO_GRACE_DURATION"
    skip_wait = name not in os.environ and _may_skip_grace()
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
