"""remote_dram as LMCache's remote KV-cache tier.

LMCache (``pip install lmcache``) loads this module as a remote storage plugin; nothing
in LMCache changes. A complete configuration is in ``examples/lmcache/remote_dram.yaml``::

    remote_url: "remote_dram://127.0.0.1:7000"      # or remote_dram://etcd://HOST:PORT/NAME
    remote_serde: "naive"
    remote_storage_plugins: ["remote_dram"]
    extra_config:
      remote_storage_plugin.remote_dram.module_path: remote_dram.lmcache
      remote_storage_plugin.remote_dram.class_name: RemoteDramConnectorAdapter

The plugin entry is what makes LMCache load this module; the tier itself is the one
``remote_url`` names. Without ``remote_url``, give the address as
``extra_config["remote_dram.url"]`` and the plugin entry is the tier.

Each chunk is one key, ``lmcache/<model>/<world size>/<worker>/<chunk hash>@<dtype>…``,
whose value is LMCache's ``RemoteMetadata`` of the chunk (its shapes, dtypes and format;
28 bytes for one KV group) followed by its bytes, so the two are stored, evicted and
deleted together: a lookup never finds half a chunk. A store sends the header and the
bytes, the latter straight out of LMCache's memory object, as parts the server joins
(``Client.put_parts``). A load is one round trip: the header and the bytes, the latter
straight into a memory object of LMCache's, are two byte ranges of the key read together.
``extra_config["save_chunk_meta"] = False`` stores the bytes alone (a partial chunk's
token count is then read from its length), in pipelined batches. :func:`key_prefix`
names every chunk of a model or worker for ``Client.list`` and ``Client.delete_range``.

A server that cannot be reached makes every call a miss at once (LMCache recomputes):
the connector says so once in the log, reconnects from a thread of its own every
``remote_dram.retry_interval`` seconds, and says once when it is back. A call never
returns before the transfer it started has ended, so LMCache may free or reuse a memory
object as soon as a call returns.

Settings, all in ``extra_config``:

``remote_dram.url``
    The servers, when ``remote_url`` does not name them.
``remote_dram.auth_token_file``
    A file whose first line is the servers' token (else ``RDRAM_AUTH_TOKEN``, if set).
``remote_dram.timeout``
    Seconds one call may take (default 5; keep it under LMCache's ``blocking_timeout_secs``).
``remote_dram.connect_timeout``
    Seconds a connection attempt may take (default 1).
``remote_dram.retry_interval``
    Seconds between reconnection attempts while the servers are unreachable (default 1).
``remote_dram.ttl``
    Seconds a stored chunk lives (default: until evicted or deleted).
``remote_dram.poll``
    ``adaptive`` (default) or ``busy``: how the connection waits for replies (busy polling
    takes a core per connection; for dedicated cores).
``remote_dram.ucx_tls``
    UCX transports for this process (``UCX_TLS``, e.g. ``tcp`` or ``shm,self``), unless
    the environment already sets it. Servers on libfabric are reached over libfabric.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import struct
import threading
import time
from typing import Callable, List, Optional, Sequence, TypeVar
from urllib.parse import quote, unquote

from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext, extract_plugin_type
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from . import Client
from .errors import AuthFailed, BufferTooSmall, Error, IoError, OutOfRange, Timeout, TransportError, Unavailable

logger = init_logger(__name__)

SCHEME = "remote_dram://"
PLUGIN_TYPE = "remote_dram"
KEY_ROOT = "lmcache/"
# Errors that say the servers cannot be reached, as opposed to a refused request.
LINK_ERRORS = (Unavailable, TransportError, Timeout, IoError)

T = TypeVar("T")


# ----------------------------------------------------------------------------- keys


def key_prefix(model: str, world_size: Optional[int] = None, worker_id: Optional[int] = None) -> str:
    """The prefix of every key of ``model`` (and of one ``world_size``/``worker_id``):
    ``client.list(key_prefix(m))`` lists them, ``client.delete_range(p, prefix_end(p))``
    deletes them."""
    prefix = KEY_ROOT + quote(model, safe="") + "/"
    if world_size is not None:
        prefix += f"{world_size}/"
        if worker_id is not None:
            prefix += f"{worker_id}/"
    elif worker_id is not None:
        raise ValueError("give world_size with worker_id")
    return prefix


def prefix_end(prefix: str) -> str:
    """The first key after every key that starts with ``prefix`` (which ends with ``/``)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def chunk_key(key: CacheEngineKey) -> str:
    """Where a chunk lives: ``lmcache/<model>/<world size>/<worker>/<hash>@<dtype>[@…]``,
    with the model name and the rest percent-encoded so that ``/`` only separates fields."""
    model, world_size, worker_id, rest = key.to_string().split("@", 3)
    return f"{KEY_ROOT}{quote(model, safe='')}/{world_size}/{worker_id}/{quote(rest, safe='@')}"


def engine_key_string(chunk: str) -> str:
    """LMCache's key string (``CacheEngineKey.to_string()``) of a :func:`chunk_key`."""
    model, world_size, worker_id, rest = chunk[len(KEY_ROOT) :].split("/")
    return "@".join([unquote(model), world_size, worker_id, unquote(rest)])


# ----------------------------------------------------------------------------- link


class _Link:
    """One client connection that fails fast while the servers are unreachable.

    Calls run on the caller's thread. A call that finds the servers unreachable drops
    the connection and starts one thread that tries again every ``retry_interval``;
    until it succeeds, every call raises ``Unavailable`` at once. Going down and coming
    back are logged once each, and so is the first refusal of each kind.

    A wrong or missing token is no outage: at the start it raises ``AuthFailed`` (the
    connector, and so LMCache's remote tier, does not start); later, each reconnection
    the servers refuse for it is logged as an error, and calls raise ``AuthFailed``,
    both saying how to fix it.
    """

    def __init__(
        self,
        name: str,
        address: str,
        token: Optional[str],
        timeout: float,
        connect_timeout: float,
        retry_interval: float,
        poll: str = "adaptive",
    ):
        self._name = name
        self._address = address
        self._token = token
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._retry_interval = retry_interval
        self._poll = poll
        self._lock = threading.Lock()
        self._client: Optional[Client] = None
        self._down_since: Optional[float] = None
        self._closed = threading.Event()
        self._retry_thread: Optional[threading.Thread] = None
        self._refusals_logged: set[type] = set()
        self._auth_failure: Optional[AuthFailed] = None
        try:
            self._client = self._connect()
        except AuthFailed as e:
            raise _auth_failed(address, token, e) from None
        except Error as e:
            self._went_down(e)

    @property
    def down(self) -> bool:
        """Whether this connection found the servers unreachable and is not back yet."""
        with self._lock:
            return self._down_since is not None

    def _connect(self) -> Client:
        return Client(
            self._address, auth_token=self._token, timeout=self._timeout, connect_timeout=self._connect_timeout, poll=self._poll
        )

    def call(self, f: Callable[[Client], T]) -> T:
        with self._lock:
            client, refused = self._client, self._auth_failure
        if client is None and refused is not None:
            raise refused
        if client is None:
            raise Unavailable(f"remote_dram at {self._address} is unreachable; retrying in the background")
        try:
            return f(client)
        except LINK_ERRORS as e:
            self._went_down(e, client)
            raise
        except Error as e:
            if type(e) not in self._refusals_logged:
                self._refusals_logged.add(type(e))
                logger.warning("remote_dram %s: %s (further %s errors are not logged)", self._name, e, type(e).__name__)
            raise

    def _went_down(self, error: Error, client: Optional[Client] = None) -> None:
        with self._lock:
            if client is not None and self._client is not client:
                return  # another call already saw it
            self._client = None
            if self._down_since is None:
                self._down_since = time.monotonic()
                logger.warning(
                    "remote_dram %s: %s is unreachable (%s); chunks are recomputed until it is back",
                    self._name, self._address, error,
                )
            if self._retry_thread is None and not self._closed.is_set():
                self._retry_thread = threading.Thread(target=self._reconnect, name=f"remote_dram-{self._name}-retry", daemon=True)
                self._retry_thread.start()
        if client is not None:
            client.close()

    def _reconnect(self) -> None:
        while not self._closed.wait(self._retry_interval):
            try:
                client = self._connect()
            except AuthFailed as e:
                refused = _auth_failed(self._address, self._token, e)
                logger.error("remote_dram %s: %s", self._name, refused)
                with self._lock:
                    self._auth_failure = refused
                continue
            except Error:
                continue
            with self._lock:
                if self._closed.is_set():
                    client.close()
                    return
                self._client = client
                self._auth_failure = None
                down_for = time.monotonic() - (self._down_since or time.monotonic())
                self._down_since = None
                self._retry_thread = None
                logger.warning("remote_dram %s: reconnected to %s after %.1f s", self._name, self._address, down_for)
                return
            client.close()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            client, self._client = self._client, None
            thread = self._retry_thread
        if thread is not None:
            thread.join()
        if client is not None:
            client.close()


# ----------------------------------------------------------------------------- connector


class RemoteDramConnector(RemoteConnector):
    """LMCache's ``RemoteConnector`` over remote_dram (see the module's documentation)."""

    def __init__(self, address: str, context: ConnectorContext, extra: dict):
        self.address = address
        backend = context.local_cpu_backend
        # As LMCache's own connectors: config and metadata from the CPU backend when the
        # context does not carry them.
        config = context.config if context.config is not None else getattr(backend, "config", None)
        metadata = context.metadata if context.metadata is not None else getattr(backend, "metadata", None)
        super().__init__(config, metadata)
        self.loop = context.loop
        self.local_cpu_backend = backend
        self._header_len = self.remote_metadata_bytes if self.save_chunk_meta else 0
        token = _token(extra)
        timeout = float(extra.get("remote_dram.timeout", 5.0))
        connect_timeout = float(extra.get("remote_dram.connect_timeout", 1.0))
        retry = float(extra.get("remote_dram.retry_interval", 1.0))
        poll = str(extra.get("remote_dram.poll", "adaptive"))
        ttl = extra.get("remote_dram.ttl")
        self._ttl = float(ttl) if ttl is not None else None
        _use_ucx_tls(extra.get("remote_dram.ucx_tls"))
        # Stores and loads each have a connection and a thread, so a load never waits
        # behind a store (one client runs one call at a time).
        self._store = _Link("store", address, token, timeout, connect_timeout, retry, poll)
        self._load = _Link("load", address, token, timeout, connect_timeout, retry, poll)
        self._store_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="remote_dram-store")
        self._load_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="remote_dram-load")
        logger.info("remote_dram: LMCache tier at %s (chunk metadata %s)", address, "stored" if self.save_chunk_meta else "not stored")

    def __repr__(self) -> str:
        return f"<RemoteDramConnector {getattr(self, 'address', '(not started)')}>"

    # -- existence

    def _whole(self, size: Optional[int]) -> bool:
        """Whether a value of ``size`` bytes can be a whole chunk of this connector's."""
        if size is None or size <= self._header_len:
            return False
        if self.save_chunk_meta:
            return True  # the header says the rest, read with the chunk
        return size <= self.full_chunk_size_bytes and size % self.single_token_size == 0

    def _present(self, keys: Sequence[CacheEngineKey]) -> List[bool]:
        """Which chunks are stored: their sizes, in one pipelined request per chunk that
        moves none of their bytes."""
        try:
            sizes = self._load.call(lambda c: c.sizes([chunk_key(k) for k in keys]))
        except Error:
            return [False] * len(keys)
        return [self._whole(size) for size in sizes]

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._present([key])[0]

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._run(self._load_thread, lambda: self.exists_sync(key))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        """How many of ``keys``, from the first, are stored."""
        present = self._present(keys)
        return present.index(False) if False in present else len(present)

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        return await self._run(self._load_thread, lambda: self.batched_contains(keys))

    # -- loads

    def support_batched_get(self) -> bool:
        return True

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return (await self.batched_get([key]))[0]

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        if not keys:
            return []
        return await self._run(self._load_thread, lambda: self._load_chunks(keys), release=_release_all)

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[CacheEngineKey]) -> List[MemoryObj]:
        """The chunks from the first up to the first one missing."""
        objs = await self.batched_get(keys)
        prefix: List[MemoryObj] = []
        for obj in objs:
            if obj is None:
                break
            prefix.append(obj)
        _release_all(objs[len(prefix) :])
        return prefix

    def _load_chunks(self, keys: Sequence[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        """Reads chunks straight into memory objects of LMCache's CPU allocator, each in
        one round trip (header and bytes together, the bytes into an object of a full
        chunk's shape); ``None`` where a chunk is missing, not whole, or cannot be allocated."""
        chunks = [chunk_key(k) for k in keys]
        objs: List[Optional[MemoryObj]] = [self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt) for _ in keys]
        wanted = [i for i, obj in enumerate(objs) if obj is not None]
        heads = [bytearray(self._header_len) for _ in wanted]
        names: List[str] = []
        outs: list = []
        ranges: list = []
        for j, i in enumerate(wanted):
            if self.save_chunk_meta:
                names.append(chunks[i])
                outs.append(heads[j])
                ranges.append((0, self._header_len))
            names.append(chunks[i])
            outs.append(objs[i].byte_array)
            ranges.append((self._header_len, None))
        try:
            read = self._load.call(lambda c: c.get_many_into(names, outs, byte_ranges=ranges)) if names else []
        except (BufferTooSmall, OutOfRange):
            # A chunk longer than a full one (only LMCache's tests store such), or a value
            # shorter than a header: each chunk on its own, in two steps.
            _release_all(objs)
            return [self._load_sized(chunk) for chunk in chunks]
        except Error:
            _release_all(objs)
            return [None] * len(keys)
        per_chunk = 2 if self.save_chunk_meta else 1
        for j, i in enumerate(wanted):
            body = read[j * per_chunk + per_chunk - 1]
            if not self.save_chunk_meta:
                objs[i] = self._loaded(chunks[i], objs[i], body)
                continue
            head = read[j * per_chunk]
            meta = self._metadata(heads[j]) if head == self._header_len else None
            if meta is None:
                objs[i] = self._not_a_chunk(chunks[i], objs[i], head)
            elif body is None or body != meta.length:
                # Missing (evicted between the two reads), or bytes its header does not describe.
                objs[i] = self._not_a_chunk(chunks[i], objs[i], body)
            else:
                objs[i] = self._as_described(chunks[i], objs[i], meta)
        return objs

    def _as_described(self, chunk: str, obj: MemoryObj, meta: RemoteMetadata) -> Optional[MemoryObj]:
        """The chunk read into ``obj`` (a full chunk's) in an object of the shapes, dtypes
        and format its header gives: ``obj`` itself for a full chunk, else a new object
        the bytes are copied into (a partial chunk, the last of a request's)."""
        if list(meta.shapes) == list(obj.get_shapes()) and list(meta.dtypes) == list(obj.get_dtypes()) and meta.fmt == obj.get_memory_format():
            return obj
        exact = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
        if exact is not None:
            if len(exact.byte_array) == meta.length:
                memoryview(exact.byte_array).cast("B")[:] = memoryview(obj.byte_array).cast("B")[: meta.length]
            else:
                exact.ref_count_down()
                exact = self._not_a_chunk(chunk, None, meta.length)
        obj.ref_count_down()
        return exact

    def _load_sized(self, chunk: str) -> Optional[MemoryObj]:
        """One chunk in two round trips: its header, then its bytes into an object
        allocated as the header says."""
        if not self.save_chunk_meta:
            return None  # longer than a full chunk: not one of this connector's
        head = bytearray(self._header_len)
        try:
            try:
                n = self._load.call(lambda c: c.get_into(chunk, head, byte_range=(0, self._header_len)))
            except OutOfRange:
                return self._not_a_chunk(chunk, None, 0)  # shorter than a header
            meta = self._metadata(head) if n == self._header_len else None
            if meta is None:
                return self._not_a_chunk(chunk, None, n)
            obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
            if obj is None:
                return None
            try:
                body = self._load.call(lambda c: c.get_into(chunk, obj.byte_array, byte_range=(self._header_len, None)))
            except Error:
                obj.ref_count_down()
                raise
        except Error:
            return None
        return obj if body == meta.length else self._not_a_chunk(chunk, obj, body)

    def _loaded(self, chunk: str, obj: MemoryObj, read: Optional[int]) -> Optional[MemoryObj]:
        """``obj`` after ``read`` bytes of a chunk stored without metadata landed in it,
        reshaped if the chunk is partial; ``None`` (and released) if it was missing or is
        not whole."""
        if read is None:
            obj.ref_count_down()
            return None
        try:
            return self.reshape_partial_chunk(obj, read)
        except ValueError:
            return self._not_a_chunk(chunk, obj, read)

    def _not_a_chunk(self, chunk: str, obj: Optional[MemoryObj], read: Optional[int]) -> None:
        """A miss: ``obj`` released and, if the key held something (``read`` is not
        ``None``) that is not a whole chunk, that value deleted, as LMCache's contract asks
        of orphaned metadata. Anyone with the token may have written the key."""
        if obj is not None:
            obj.ref_count_down()
        if read is not None:
            logger.warning("remote_dram: %s holds no whole chunk (%d bytes read); deleting it", chunk, read)
            try:
                self._store.call(lambda c: c.delete(chunk))
            except Error:
                pass
        return None

    @staticmethod
    def _metadata(raw: bytearray) -> Optional[RemoteMetadata]:
        """A chunk's header, or None when the bytes are not LMCache's."""
        try:
            return RemoteMetadata.deserialize(raw)
        except (ValueError, KeyError, struct.error):
            return None

    # -- stores

    def support_batched_put(self) -> bool:
        return True

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj):
        await self.batched_put([key], [memory_obj])

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]):
        """Stores chunks from their memory objects; a chunk that cannot be stored is left
        out (LMCache recomputes it), never an error per chunk in the log."""
        if keys:
            await self._run(self._store_thread, lambda: self._store_chunks(keys, memory_objs))

    def _store_chunks(self, keys: Sequence[CacheEngineKey], memory_objs: Sequence[MemoryObj]) -> None:
        """Each chunk as one value, its header before its bytes, the bytes sent straight
        from the memory object (``put_parts_many``: the server joins them, the chunks of a
        batch side by side); without chunk metadata, the bytes alone in one pipelined batch."""
        try:
            if not self.save_chunk_meta:
                items = [(chunk_key(k), obj.byte_array) for k, obj in zip(keys, memory_objs)]
                if self._ttl is None:
                    self._store.call(lambda c: c.put_many(items))
                else:
                    for key, data in items:
                        self._store.call(lambda c, k=key, d=data: c.put(k, d, ttl=self._ttl))
                return
            chunks = []
            for key, obj in zip(keys, memory_objs):
                data = obj.byte_array
                header = RemoteMetadata(len(data), obj.get_shapes(), obj.get_dtypes(), obj.get_memory_format()).serialize()
                chunks.append((chunk_key(key), [header, data]))
            self._store.call(lambda c: c.put_parts_many(chunks, ttl=self._ttl))
        except Error:
            pass  # logged once by the link; LMCache recomputes these chunks

    # -- the rest of LMCache's interface

    def remove_sync(self, key: CacheEngineKey) -> bool:
        try:
            return self._store.call(lambda c: c.delete(chunk_key(key)))
        except Error:
            return False

    async def list(self) -> List[str]:
        """LMCache's key strings of every stored chunk."""
        entries = await self._run(self._load_thread, lambda: self._load.call(lambda c: list(c.list(KEY_ROOT))))
        keys = []
        for name, size in entries:
            if self._whole(size):
                try:
                    keys.append(engine_key_string(name.decode()))
                except ValueError:
                    continue  # not a chunk of this connector's
        return keys

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        try:
            await self._run(self._load_thread, lambda: self._load.call(lambda c: c.get("lmcache/ping")))
        except Error as e:
            return int(e.status)
        return 0

    async def close(self):
        self._store_thread.shutdown(wait=True)
        self._load_thread.shutdown(wait=True)
        self._store.close()
        self._load.close()
        logger.info("remote_dram: closed the connection to %s", self.address)

    async def _run(self, thread: concurrent.futures.ThreadPoolExecutor, f: Callable[[], T], release: Optional[Callable[[T], None]] = None) -> T:
        """``f()`` on ``thread``. If the caller stops waiting (LMCache cancels a load that
        outlives ``blocking_timeout_secs``), the call still ends within its own timeout,
        and ``release`` then frees what it produced. Either way the coroutine ends only
        once ``f`` has returned."""
        future = asyncio.wrap_future(thread.submit(f))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # The caller's buffers stay in use until the transfer ends (within the
            # client's timeout), so this coroutine ends only then.
            while not future.done():
                try:
                    await asyncio.wait([future])
                except asyncio.CancelledError:
                    continue
            if release is not None and future.exception() is None:
                release(future.result())
            raise


class InertConnector(RemoteConnector):
    """The plugin entry's connector when ``remote_url`` already names the tier: it holds
    nothing, so chunks are stored and found once, through ``remote_url``'s backend."""

    def __init__(self, context: ConnectorContext):
        super().__init__(context.config, context.metadata)

    async def exists(self, key):
        return False

    def exists_sync(self, key):
        return False

    async def get(self, key):
        return None

    async def put(self, key, memory_obj):
        return None

    async def list(self):
        return []

    async def close(self):
        return None

    def __repr__(self) -> str:
        return "<remote_dram plugin entry (the tier is remote_url's)>"


class RemoteDramConnectorAdapter(ConnectorAdapter):
    """What LMCache's plugin loader instantiates: builds a :class:`RemoteDramConnector` for
    ``remote_dram://…`` URLs and for the ``remote_dram`` plugin entry."""

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def can_parse(self, url: str) -> bool:
        if url.startswith(SCHEME):
            return True
        return url.startswith("plugin://") and extract_plugin_type(url[len("plugin://") :]) == PLUGIN_TYPE

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        config = context.config
        extra = dict(config.extra_config or {}) if config is not None else {}
        if context.url.startswith(SCHEME):
            return RemoteDramConnector(_address(context.url), context, extra)
        if "remote_dram.url" in extra:
            return RemoteDramConnector(_address(extra["remote_dram.url"]), context, extra)
        remote_url = getattr(config, "remote_url", None) or ""
        if remote_url.startswith(SCHEME):
            logger.info("remote_dram: plugin entry loaded; the tier is remote_url (%s)", remote_url)
            return InertConnector(context)
        raise ValueError("remote_dram: give the servers as remote_url: remote_dram://HOST:PORT or extra_config remote_dram.url")


def _address(url: str) -> str:
    """The servers of ``remote_dram://HOST:PORT[,HOST:PORT…]`` or ``remote_dram://etcd://…/NAME``."""
    address = url[len(SCHEME) :] if url.startswith(SCHEME) else url
    if not address:
        raise ValueError(f"remote_dram: {url!r} names no server")
    return address


def _auth_failed(address: str, token: Optional[str], e: AuthFailed) -> AuthFailed:
    """``e`` with what to do about it."""
    given = "the token it was given is not theirs" if token else "it was given no token"
    return AuthFailed(
        f"remote_dram at {address} refused this LMCache tier: {given} ({e}). Put the servers' "
        "token (what `rdram serve` reads from --auth-token-file or RDRAM_AUTH_TOKEN) in a file "
        "and name it in extra_config as remote_dram.auth_token_file, or set RDRAM_AUTH_TOKEN"
    )


def _token(extra: dict) -> Optional[str]:
    path = extra.get("remote_dram.auth_token_file")
    if path:
        with open(os.path.expanduser(str(path))) as f:
            return f.readline().strip()
    return os.environ.get("RDRAM_AUTH_TOKEN") or None


def _use_ucx_tls(tls: Optional[str]) -> None:
    """UCX's transports for this process, unless its environment chose them."""
    if not tls:
        return
    if os.environ.get("UCX_TLS", tls) != tls:
        logger.warning("remote_dram: UCX_TLS=%s in the environment; remote_dram.ucx_tls=%s is not used", os.environ["UCX_TLS"], tls)
        return
    os.environ["UCX_TLS"] = tls


def _release_all(objs) -> None:
    for obj in objs:
        if obj is not None:
            obj.ref_count_down()
