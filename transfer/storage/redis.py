"""Redis / Valkey page storage: one string value per page, shared by every node that can reach it.

Key: ``{key_prefix}{page_hash}{suffix}`` (the file store's naming without ``.bin``; the suffix comes
from ``hashing.storage_suffix``, so ranks and models never collide). Value: a 72-byte header
followed by the page's raw bytes (host page-first layout)::

    magic b"KVLP" | version u8 | ndim u8 | 2 pad | nbytes u64 | crc32 u32 | 4 pad |
    dtype name (16 bytes, ASCII, NUL padded) | shape (8 x u32)       -- little endian

A page and its header are one value written by one ``SET ... NX`` (atomic on the server), so a
reader sees either no page or the whole page with its header; it never sees one without the
other nor half a page. ``NX`` gives the other backends' skip-existing semantics across every
node: the first write wins. Reads verify magic, version, size, checksum (and the configured
dtype/shape); a page that does not verify is a miss, counted (``corrupt`` / ``mismatched``) and
logged, and a corrupt value is deleted so a later write can repair it. Never returned.

Batches are pipelined (one round trip per ``pipeline_bytes`` of pages). ``ttl_s`` sets an expiry
on every page, refreshed when it is read (``GETEX``). ``capacity_bytes`` / ``capacity_pages``
bound, by LRU, what *this client* has written or found (as ``FileStorage`` does per process); for
a server shared by many nodes prefer the server's own ``maxmemory`` + ``allkeys-lru`` and/or
``ttl_s``. ``stats().pages`` / ``bytes`` count that client-side index, not the whole server.

Failures. The server being unreachable (refused, reset, timed out) raises ``StorageUnavailable``
from every operation, after one immediate reconnect attempt; short socket timeouts bound the
wait, there is no retry loop. A page-level refusal (e.g. ``OOM`` under ``maxmemory``) makes that
page and the rest of the batch ``False``. Both are counted in ``stats().errors`` and logged. After
the server comes back, the next operation reconnects (redis-py's pool) and succeeds.
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections.abc import Sequence

import msgspec
import numpy as np
import redis
from transfer.log import get_logger
import torch
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from transfer.errors import StorageUnavailable
from transfer.storage.base import Storage, StorageStats, check_batch
from transfer.storage.lru import LruIndex

log = get_logger(__name__)

MAGIC = b"KVLP"
VERSION = 1
_HEADER = struct.Struct("<4sBB2xQI4x16s8I")
HEADER_NBYTES = _HEADER.size  # 72
_MAX_DIMS = 8
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)


class RedisStorageStats(StorageStats):
    """``StorageStats`` plus pages refused on read: bad header/checksum, or another dtype/shape."""

    corrupt: int = 0
    mismatched: int = 0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_header(nbytes: int, crc: int, dtype: torch.dtype, shape: Sequence[int]) -> bytes:
    """The header of a page of ``nbytes`` raw bytes with checksum ``crc`` (crc32)."""
    if len(shape) > _MAX_DIMS:
        raise ValueError(f"page shape {tuple(shape)} has more than {_MAX_DIMS} dims")
    dims = list(shape) + [0] * (_MAX_DIMS - len(shape))
    return _HEADER.pack(MAGIC, VERSION, len(shape), nbytes, crc, _dtype_name(dtype).encode("ascii"), *dims)


def decode_header(value: bytes) -> tuple[int, int, str, tuple[int, ...]] | None:
    """``(nbytes, crc, dtype name, shape)`` of a stored value, or None when it is not a page."""
    if len(value) < HEADER_NBYTES:
        return None
    magic, version, ndim, nbytes, crc, dtype, *dims = _HEADER.unpack_from(value)
    if magic != MAGIC or version != VERSION or ndim > _MAX_DIMS:
        return None
    return nbytes, crc, dtype.rstrip(b"\0").decode("ascii", "replace"), tuple(dims[:ndim])


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _redact(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


class RedisStorage(Storage):
    """Pages in a Redis or Valkey server (redis-py client, ``redis://`` / ``rediss://`` / ``unix://``).

    Args:
        url: e.g. ``redis://127.0.0.1:6379/0``.
        suffix: deployment suffix (``hashing.storage_suffix``), appended to every key.
        page_nbytes: required page size in bytes (None: any).
        ttl_s: expire pages this many seconds after they were written or last read (None: never).
        capacity_bytes / capacity_pages: client-side LRU bounds (None: unbounded); see module doc.
        page_dtype / page_shape: what a page holds, recorded in the header and checked on read
            (a page written with another dtype/shape is a miss). None: record the given tensor's.
        key_prefix: prepended to every key (default none).
        connect_timeout_s / socket_timeout_s: bounds on connecting and on one reply.
        pipeline_bytes: page bytes sent (or asked for) per round trip.
        check: PING the server now, raising ``StorageUnavailable`` when it does not answer.
        client: a ready ``redis.Redis`` (tests); ``url`` is then only used in messages.
    Raises:
        StorageUnavailable: ``check`` and the server is unreachable. ValueError: a bad URL or size.
    """

    def __init__(
        self,
        url: str,
        suffix: str = "",
        page_nbytes: int | None = None,
        ttl_s: float | None = None,
        *,
        capacity_bytes: int | None = None,
        capacity_pages: int | None = None,
        page_dtype: torch.dtype | None = None,
        page_shape: Sequence[int] | None = None,
        key_prefix: str = "",
        connect_timeout_s: float = 0.5,
        socket_timeout_s: float = 5.0,
        pipeline_bytes: int = 32 << 20,
        check: bool = True,
        client: redis.Redis | None = None,
    ) -> None:
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s!r}")
        if pipeline_bytes < 1:
            raise ValueError(f"pipeline_bytes must be >= 1, got {pipeline_bytes}")
        if page_shape is not None and len(page_shape) > _MAX_DIMS:
            raise ValueError(f"page_shape {tuple(page_shape)} has more than {_MAX_DIMS} dims")
        self.suffix, self.page_nbytes, self.key_prefix = suffix, page_nbytes, key_prefix
        self.url = _redact(url)
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.page_dtype = page_dtype
        self.page_shape = None if page_shape is None else tuple(int(d) for d in page_shape)
        self.pipeline_bytes = pipeline_bytes
        if client is None:
            try:
                client = redis.Redis.from_url(
                    url,
                    socket_connect_timeout=connect_timeout_s,
                    socket_timeout=socket_timeout_s,
                    retry=Retry(NoBackoff(), 1),
                    retry_on_error=[],
                    health_check_interval=0,
                )
            except ValueError as err:
                raise ValueError(f"bad redis URL {self.url!r}: {err}") from None
        self._client = client
        self._index = LruIndex(capacity_bytes, capacity_pages)
        self._lock = threading.Lock()
        self._stats = RedisStorageStats()
        if check:
            self.ping()

    # -- plumbing -----------------------------------------------------------------------------
    def ping(self) -> None:
        """Raise ``StorageUnavailable`` unless the server answers PING."""
        try:
            self._client.ping()
        except _UNREACHABLE as err:
            raise StorageUnavailable(f"redis storage at {self.url} is unreachable: {_reason(err)}") from err
        except RedisError as err:
            raise StorageUnavailable(f"redis storage at {self.url} refused PING: {err}") from err

    def _name(self, key: str) -> str:
        return self.key_prefix + key + self.suffix

    def _execute(self, pipe) -> list:
        """Run a pipeline; replies that are errors come back as exception objects."""
        return pipe.execute(raise_on_error=False)

    def _run(self, build, what: str) -> list:
        """Build and run one pipeline; connection failures raise ``StorageUnavailable``."""
        pipe = self._client.pipeline(transaction=False)
        build(pipe)
        try:
            replies = self._execute(pipe)
        except _UNREACHABLE as err:
            self._count_error()
            log.error("redis_storage.unavailable", op=what, url=self.url, error=_reason(err))
            raise StorageUnavailable(f"redis storage at {self.url} is unreachable ({what}): {_reason(err)}") from err
        finally:
            pipe.reset()
        for reply in replies:
            if isinstance(reply, _UNREACHABLE):
                self._count_error()
                raise StorageUnavailable(f"redis storage at {self.url} failed ({what}): {_reason(reply)}") from reply
        return replies

    def _count_error(self) -> None:
        with self._lock:
            self._stats.errors += 1

    def _batches(self, n: int, sizes: Sequence[int]):
        """Split ``range(n)`` into runs of at most ``pipeline_bytes`` page bytes (>= 1 page)."""
        start, total = 0, 0
        for i in range(n):
            if i > start and total + sizes[i] > self.pipeline_bytes:
                yield range(start, i)
                start, total = i, 0
            total += sizes[i]
        if start < n:
            yield range(start, n)

    def _evict(self, names: list[str]) -> None:
        if not names:
            return
        try:
            self._run(lambda p: p.delete(*names), "evict")
        except StorageUnavailable as err:
            log.warning("redis_storage.evict_failed", names=len(names), error=str(err))
        with self._lock:
            self._stats.evictions += len(names)

    # -- Storage ------------------------------------------------------------------------------
    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """See ``Storage.batch_set``. Raises ``StorageUnavailable`` when the server is unreachable
        (pages of earlier round trips of the batch may be stored; the call reports none)."""
        check_batch(keys, pages, self.page_nbytes)
        n = len(keys)
        results = [False] * n
        sizes = [p.numel() * p.element_size() for p in pages]
        for run in self._batches(n, sizes):
            names, values = [], []
            for i in run:
                page = pages[i]
                raw = _raw(page)
                dtype = self.page_dtype if self.page_dtype is not None else page.dtype
                shape = self.page_shape if self.page_shape is not None else tuple(page.shape)
                names.append(self._name(keys[i]))
                values.append(encode_header(sizes[i], zlib.crc32(raw), dtype, shape) + raw)

            def build(pipe, names=names, values=values):
                for name, value in zip(names, values):
                    pipe.set(name, value, nx=True, px=self.ttl_ms)

            replies = self._run(build, "set")
            failed = False
            for i, name, reply in zip(run, names, replies):
                if isinstance(reply, Exception):
                    self._count_error()
                    log.error("redis_storage.write_failed", name=name, error=str(reply))
                    failed = True
                    break
                with self._lock:
                    if reply:
                        self._stats.stored += 1
                    else:
                        self._stats.skipped += 1
                    evicted = self._index.add(name, sizes[i])
                self._evict(evicted)
                results[i] = True
            if failed:
                break
        return results

    def batch_get(self, keys: Sequence[str], into: Sequence[torch.Tensor]) -> list[bool]:
        """See ``Storage.batch_get``. A page failing its checks is a miss. Raises
        ``StorageUnavailable`` when the server is unreachable."""
        check_batch(keys, into, self.page_nbytes)
        n = len(keys)
        results = [False] * n
        sizes = [t.numel() * t.element_size() for t in into]
        for run in self._batches(n, sizes):
            names = [self._name(keys[i]) for i in run]

            def build(pipe, names=names):
                for name in names:
                    if self.ttl_ms is None:
                        pipe.get(name)
                    else:
                        pipe.getex(name, px=self.ttl_ms)

            replies = self._run(build, "get")
            corrupt = []
            for i, name, value in zip(run, names, replies):
                ok = False
                if isinstance(value, Exception):
                    self._count_error()
                    log.error("redis_storage.read_failed", name=name, error=str(value))
                elif value is not None:
                    ok = self._verify_into(name, value, into[i], corrupt)
                with self._lock:
                    if ok:
                        self._stats.hits += 1
                        self._index.touch(name) or self._index.add(name, sizes[i])
                    else:
                        self._stats.misses += 1
                        self._index.remove(name)
                results[i] = ok
            if corrupt:
                try:
                    self._run(lambda p: p.delete(*corrupt), "delete corrupt")
                except StorageUnavailable:
                    pass
        return results

    def _verify_into(self, name: str, value: bytes, into: torch.Tensor, corrupt: list[str]) -> bool:
        dst = into.reshape(-1).view(torch.uint8)
        header = decode_header(value)
        body = memoryview(value)[HEADER_NBYTES:]
        if header is None or header[0] != len(body) or zlib.crc32(body) != header[1]:
            with self._lock:
                self._stats.corrupt += 1
            corrupt.append(name)
            log.error("redis_storage.corrupt_page", name=name, size=len(value))
            return False
        nbytes, _, dtype, shape = header
        want_dtype = _dtype_name(self.page_dtype) if self.page_dtype is not None else None
        if nbytes != dst.numel() or (want_dtype is not None and dtype != want_dtype) or (
            self.page_shape is not None and shape != self.page_shape
        ):
            with self._lock:
                self._stats.mismatched += 1
            log.warning("redis_storage.page_mismatch", name=name, nbytes=nbytes, dtype=dtype, shape=shape)
            return False
        dst.numpy()[:] = np.frombuffer(body, dtype=np.uint8)  # one copy, into the caller's buffer
        return True

    def batch_exists(self, keys: Sequence[str]) -> int:
        """See ``Storage.batch_exists``: asks the server (pages other nodes wrote count). Raises
        ``StorageUnavailable`` when the server is unreachable."""
        names = [self._name(k) for k in keys]
        if not names:
            return 0
        want = None if self.page_nbytes is None else HEADER_NBYTES + self.page_nbytes
        n = 0
        step = 4096
        for start in range(0, len(names), step):
            chunk = names[start:start + step]
            lengths = self._run(lambda p, chunk=chunk: [p.strlen(x) for x in chunk], "exists")
            for name, length in zip(chunk, lengths):
                if isinstance(length, Exception) or not (
                    length == want if want is not None else length > HEADER_NBYTES
                ):
                    return n
                with self._lock:
                    evicted = [] if self._index.touch(name) else self._index.add(name, length - HEADER_NBYTES)
                self._evict(evicted)
                n += 1
        return n

    def delete(self, key: str) -> bool:
        """See ``Storage.delete``: whether the server held it. Raises ``StorageUnavailable``."""
        name = self._name(key)
        (count,) = self._run(lambda p: p.delete(name), "delete")
        with self._lock:
            self._index.remove(name)
            if count:
                self._stats.deletes += 1
        return bool(count)

    def stats(self) -> RedisStorageStats:
        with self._lock:
            s = msgspec.structs.replace(self._stats)
            s.pages, s.bytes = len(self._index), self._index.bytes
        return s

    def close(self) -> None:
        """Close the client's connections. Idempotent."""
        try:
            self._client.close()
        except RedisError:
            pass


def _reason(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return " ".join(text.split())
