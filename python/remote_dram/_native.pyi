"""Type stubs of the native module (the docstrings live in the extension: help(Client))."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Optional, Tuple, Union

from typing_extensions import Buffer as _Buffer  # bytes, bytearray, memoryview, numpy arrays...

Key = Union[bytes, str]
#: Anything with the buffer protocol, a torch tensor on the CPU or a CUDA device, or a CUDA
#: array offered through ``__cuda_array_interface__`` (CuPy) or ``__dlpack__`` (JAX).
Value = Union[_Buffer, Any]
ByteRange = Tuple[int, Optional[int]]

PROTOCOL_VERSION: int

def _pose_as_device(addr: int, length: int) -> bool:
    """For tests without a GPU: host memory the client then takes for CUDA device memory."""

class Entry:
    value: Optional[bytes]
    generation: int
    size: int

class Client:
    def __init__(
        self,
        addresses: str,
        *,
        auth_token: Optional[str] = None,
        timeout: Optional[float] = None,
        connect_timeout: Optional[float] = None,
        poll: str = "adaptive",
    ) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> Client: ...
    def __exit__(
        self, ty: Optional[type[BaseException]], value: Optional[BaseException], tb: Optional[TracebackType]
    ) -> bool: ...
    def put(
        self, key: Key, value: Value, *, if_equal: Optional[int] = None, if_absent: bool = False, ttl: Optional[float] = None
    ) -> Optional[int]: ...
    def put_parts(
        self, key: Key, parts: Sequence[_Buffer], *, if_equal: Optional[int] = None, if_absent: bool = False, ttl: Optional[float] = None
    ) -> Optional[int]: ...
    def get(self, key: Key, *, byte_range: Optional[ByteRange] = None) -> Optional[bytes]: ...
    def get_entry(
        self, key: Key, *, if_not_equal: Optional[int] = None, byte_range: Optional[ByteRange] = None
    ) -> Optional[Entry]: ...
    def get_into(self, key: Key, out: Value, *, byte_range: Optional[ByteRange] = None) -> Optional[int]: ...
    def delete(self, key: Key, *, if_equal: Optional[int] = None) -> bool: ...
    def delete_range(self, start: Key, stop: Optional[Key] = None) -> int: ...
    def list(
        self, prefix: Optional[Key] = None, *, start: Optional[Key] = None, stop: Optional[Key] = None
    ) -> Iterator[Tuple[bytes, int]]: ...
    def stats(self) -> dict[str, Any]: ...
    def put_many(self, items: Union[Mapping[Key, Value], Iterable[Tuple[Key, Value]]]) -> list[int]: ...
    def put_parts_many(self, items: Iterable[Tuple[Key, Sequence[_Buffer]]], *, ttl: Optional[float] = None) -> list[int]: ...
    def get_many(self, keys: Sequence[Key]) -> list[Optional[bytes]]: ...
    def get_many_into(
        self, keys: Sequence[Key], outs: Sequence[Value], *, byte_ranges: Optional[Sequence[Optional[ByteRange]]] = None
    ) -> list[Optional[int]]: ...
    def sizes(self, keys: Sequence[Key]) -> list[Optional[int]]: ...

class Server:
    address: str
    transport: str
    def __init__(
        self,
        listen: str = "127.0.0.1:0",
        *,
        memory: Union[int, str] = "1GiB",
        workers: int = 1,
        mode: str = "store",
        transport: str = "auto",
        provider: Optional[str] = None,
        auth_token: Optional[str] = None,
        cluster: Optional[str] = None,
        cluster_secret_file: Optional[str] = None,
        lease_ttl: Optional[float] = None,
        rebalance_rate: Union[int, str] = "1GiB",
    ) -> None: ...
    def drain(self, timeout: float = 30.0) -> float: ...
    def stop(self) -> None: ...
    def __enter__(self) -> Server: ...
    def __exit__(
        self, ty: Optional[type[BaseException]], value: Optional[BaseException], tb: Optional[TracebackType]
    ) -> bool: ...
