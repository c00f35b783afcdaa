"""Exceptions raised by remote_dram.

Every failure raises :class:`Error` or one of its subclasses, carrying the server's or
client's :class:`Status` and message. Results that are not failures (a missing key, an
unchanged generation, a condition that did not hold) are return values, never
exceptions.
"""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
    """Status codes, the same numbers as the C ABI's ``rdram_status`` (``RDRAM_*``)."""

    OK = 0
    MISSING = 1
    UNCHANGED = 2
    CONDITION_FAILED = 3
    INVALID_ARGUMENT = -1
    KEY_TOO_LARGE = -2
    VALUE_TOO_LARGE = -3
    NO_SPACE = -4
    OUT_OF_RANGE = -5
    AUTH_FAILED = -6
    VERSION_MISMATCH = -7
    UNAVAILABLE = -8
    TIMEOUT = -9
    TRANSPORT = -10
    IO = -11
    INTERNAL = -12
    WRONG_SHARD = -13
    BUFFER_TOO_SMALL = -14
    NO_ROOM = -20


class Error(Exception):
    """A remote_dram call failed. ``.status`` says how (a :class:`Status`), ``.message``
    gives the details."""

    status: Status = Status.INTERNAL

    def __init__(self, message: str, status: Status | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class InvalidArgument(Error, ValueError):
    """An argument was refused (empty key, bad range, wrong type of option...)."""

    status = Status.INVALID_ARGUMENT


class KeyTooLarge(InvalidArgument):
    """The key is longer than the protocol allows."""

    status = Status.KEY_TOO_LARGE


class ValueTooLarge(InvalidArgument):
    """The value is larger than the largest value a server stores."""

    status = Status.VALUE_TOO_LARGE


class OutOfRange(InvalidArgument):
    """The byte range does not lie within the stored value."""

    status = Status.OUT_OF_RANGE


class NoSpace(Error):
    """The shard's arena has no room for the value (store mode), even after expiring
    entries."""

    status = Status.NO_SPACE


class AuthFailed(Error):
    """The server refused the auth token."""

    status = Status.AUTH_FAILED


class VersionMismatch(Error):
    """Client and server speak different protocol versions."""

    status = Status.VERSION_MISMATCH


class Unavailable(Error, ConnectionError):
    """A server could not be reached or was lost; the next call connects again."""

    status = Status.UNAVAILABLE


class Timeout(Error, TimeoutError):
    """The call did not finish in time. A timed-out put may or may not have been applied;
    if it was, it was applied with the bytes the value held during the call."""

    status = Status.TIMEOUT


class TransportError(Error):
    """The transport (UCX or libfabric) reported an error."""

    status = Status.TRANSPORT


class IoError(Error, OSError):
    """An operating-system call failed."""

    status = Status.IO


class InternalError(Error):
    """A bug: please report it with the message."""

    status = Status.INTERNAL


class WrongShard(Error):
    """A request reached a shard that does not own its key (a client or server bug)."""

    status = Status.WRONG_SHARD


class BufferTooSmall(Error, ValueError):
    """The output buffer cannot hold the value; ``.needed`` is the size it must have.
    Nothing was written and the value is still stored."""

    status = Status.BUFFER_TOO_SMALL

    def __init__(self, message: str, status: Status | None = None, needed: int = 0):
        super().__init__(message, status)
        self.needed = needed


class NoRoom(Error):
    """A server holds as many values staged in parts as it takes at once: a bound, not an
    outage (the client sends such values whole then)."""

    status = Status.NO_ROOM


_BY_STATUS = {
    cls.status: cls
    for cls in (
        InvalidArgument, KeyTooLarge, ValueTooLarge, OutOfRange, NoSpace, AuthFailed, VersionMismatch,
        Unavailable, Timeout, TransportError, IoError, InternalError, WrongShard, BufferTooSmall, NoRoom,
    )
}


def _from_status(code: int, message: str) -> Error:
    """The exception for a status code (called by the native module)."""
    try:
        status = Status(code)
    except ValueError:
        status = Status.INTERNAL
    return _BY_STATUS.get(status, Error)(message, status)
