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


_load_ucx()

from ._native import PROTOCOL_VERSION, Client, Entry, Server  # noqa: E402
from .errors import (  # noqa: E402
    AuthFailed,
    BufferTooSmall,
    Error,
    InternalError,
    InvalidArgument,
    IoError,
    KeyTooLarge,
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
    "InternalError", "InvalidArgument", "IoError", "KeyTooLarge", "NoSpace", "OutOfRange", "Timeout",
    "TransportError", "Unavailable", "ValueTooLarge", "VersionMismatch", "WrongShard",
]
