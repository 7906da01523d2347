"""Redis / Valkey page storage: one string value per page, shared by every node that can reach it.

Key: ``{key_prefix}{page_hash}{suffix}`` (the file store's naming without ``.bin``; the suffix comes
from ``hashing.storage_suffix``, so ranks and models never collide). Value: the page's 104-byte
seal (``transfer.storage.integrity``: magic, version, size, XXH3-128 digest over name + format +
bytes, name fingerprint, layout, dtype, shape) followed by the page's raw bytes. A batch's
``SET`` commands are packed into one reusable buffer (each page copied once, from its tensor) and
sent with one ``sendall`` (``wire``; replies parsed by hiredis). A batch's ``GET`` replies
are read from the socket straight into the caller's page tensors (``reader``: the page is
copied once, kernel to tensor) and each seal is verified there, over descriptor + the bytes in
place; a value of the wrong length is never written into the tensor, a refused page of the right
length is zeroed, and a connection that failed mid-reply is dropped, never reused.

A page and its seal are one value written by one ``SET ... NX`` (atomic on the server), so a
reader sees either no page or the whole page with its seal. ``NX`` gives the other backends'
skip-existing semantics across every node: the first write wins — but a skipped key is checked
(its seal, one ``GETRANGE``): a page another deployment sealed (another format or another name:
``integrity.written_by_another``) is left alone and reported stored ("already there", counted
``foreign_kept``); any other value that is not exactly our page (not a page, no seal, a torn one)
is overwritten (counted ``repaired``). Evictions and deletes read the seal first and remove a key
only if it is not another deployment's page and is unchanged since (one Lua compare-and-delete).
Reads verify the seal; a page that does not verify is a miss, counted
(``corrupt`` / ``foreign`` / ``wrong_size``) and logged, and a corrupt value is deleted so a
later write can repair it. ``batch_exists`` counts a key only if its seal matches (name, format,
size) and the value has the sealed length.

Batches are pipelined (one round trip per ``pipeline_bytes`` of pages). ``ttl_s`` sets an expiry
on every page, refreshed when it is read (``GETEX``). ``capacity_bytes`` / ``capacity_pages``
bound, by LRU, what *this client* has written or found (as ``FileStorage`` does per process); for
a server shared by many nodes prefer the server's own ``maxmemory`` + ``allkeys-lru`` and/or
``ttl_s``. ``stats().pages`` / ``bytes`` count that client-side index, not the whole server.

Failures. The server being unreachable (refused, reset, timed out) raises ``StorageUnavailable``
and reports a failure to the store's ``CircuitBreaker`` (``transfer/storage/breaker.py``); while
the breaker is open every operation raises ``StorageUnavailable`` at once without touching the
network (counted ``unavailable``), and after the backoff the next operation probes the server.
Short socket timeouts bound the wait of the first failing call; there is no retry loop. A
page-level refusal (e.g. ``OOM`` under ``maxmemory``) makes that page and the rest of the batch
``False``; ``delete`` refused by the server (a read-only replica) returns False. All are counted in
``stats().errors`` and logged.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import msgspec
import redis
import torch
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from transfer.errors import StorageConfigError, StorageUnavailable
from transfer.log import RateLimitedLog, get_logger
from transfer.storage.base import Storage, StorageStats
from transfer.storage.checks import check_batch, check_seconds, check_size, check_store, check_ttl
from transfer.storage.breaker import CircuitBreaker
from transfer.storage.integrity import (
    SEAL_NBYTES, PageFormat, Verdict, check_keys, check_seal, check_suffix, decode_seal, raw_format, seal,
    written_by_another,
)
from transfer.storage.lru import LruIndex
from transfer.storage.redis.conn import _client_from_url, check_url, redact  # noqa: F401 (re-exported)
from transfer.storage.redis.get import RedisReads, _raw
from transfer.storage.redis.reader import GetReader
from transfer.storage.redis.wire import SetBatch, send_and_read

log = get_logger("transfer.storage.redis")  # the package's logger, as get.py's

HEADER_NBYTES = SEAL_NBYTES  # the seal in front of every value (104 bytes)
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
# delete KEYS[1] only if its first SEAL_NBYTES bytes are still ARGV[1] (what the ownership check saw)
_DELETE_IF_SAME = ("if redis.call('GETRANGE', KEYS[1], 0, %d) == ARGV[1] then "
                   "return redis.call('DEL', KEYS[1]) end return 0" % (SEAL_NBYTES - 1))


class RedisStorageStats(StorageStats):
    """``StorageStats`` plus ``repaired``: skipped keys whose value was not our page nor another
    deployment's sealed page (not a page, no seal, torn), overwritten."""

    repaired: int = 0


class RedisStorage(RedisReads, Storage):
    """Pages in a Redis or Valkey server (redis-py client with hiredis, ``redis://`` / ``rediss://``
    / ``unix://``; reads use the client's pooled connections through ``reader``).

    Args:
        url: e.g. ``redis://127.0.0.1:6379/0``.
        suffix: deployment suffix (``hashing.storage_suffix``), appended to every key.
        page_nbytes: required page size in bytes (None: any).
        ttl_s: expire pages this many seconds after they were written or last read (None: never).
        capacity_bytes / capacity_pages: client-side LRU bounds (None: unbounded); see module doc.
        page_format: what a page holds, sealed with it and checked on read (a page of another
            layout/dtype/shape is a miss). None: each page's own dtype and shape, layout ``raw``.
        key_prefix: prepended to every key (default none).
        connect_timeout_s / socket_timeout_s: bounds on connecting and on one reply.
        pipeline_bytes: page bytes sent (or asked for) per round trip.
        check: PING the server now, raising ``StorageUnavailable`` when it does not answer.
        breaker: the circuit breaker guarding the server (None: a new one, 0.5 s first backoff).
        client: a ready ``redis.Redis`` (tests); ``url`` is then only used in messages.
    Raises:
        StorageConfigError (a ValueError): a bad URL or suffix; ``ttl_s`` not a finite number in
            ``[0.001 s, 10 years]``; a size that is not a positive int; a timeout not finite and
            positive; a ``page_format`` not byte-exact or not ``page_nbytes`` bytes
            (``transfer.storage.checks``). Raised before connecting.
        StorageUnavailable: ``check`` and the server is unreachable.
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
        page_format: PageFormat | None = None,
        key_prefix: str = "",
        connect_timeout_s: float = 0.5,
        socket_timeout_s: float = 5.0,
        pipeline_bytes: int = 8 << 20,
        check: bool = True,
        breaker: CircuitBreaker | None = None,
        client: redis.Redis | None = None,
    ) -> None:
        self.ttl_ms = check_ttl(ttl_s)
        check_store(page_nbytes, page_format, capacity_bytes=capacity_bytes, capacity_pages=capacity_pages,
                    pipeline_bytes=check_size("pipeline_bytes", pipeline_bytes, optional=False))
        check_seconds("connect_timeout_s", connect_timeout_s, low=1e-3, high=3600)
        check_seconds("socket_timeout_s", socket_timeout_s, low=1e-3, high=3600)
        if client is None:
            check_url(url)
        self.suffix, self.page_nbytes, self.key_prefix = check_suffix(suffix), page_nbytes, key_prefix
        self.url = redact(url)
        self._oplog = RateLimitedLog(log)   # per-op failures: one line per event per interval
        self.page_format = page_format
        self.pipeline_bytes = pipeline_bytes
        self.breaker = breaker if breaker is not None else CircuitBreaker(self.url)
        if client is None:
            try:
                client = _client_from_url(url, connect_timeout_s, socket_timeout_s)
            except ValueError as err:
                raise StorageConfigError(f"bad redis URL {self.url!r}: {err}") from None
        self._client = client
        self._index = LruIndex(capacity_bytes, capacity_pages)
        self._lock = threading.Lock()
        self._stats = RedisStorageStats()
        self._sets = SetBatch()  # per-thread reusable buffer of packed SET commands
        self._reader = GetReader(SEAL_NBYTES)  # per-thread buffers for reading replies into pages
        self._seal_fields: dict = {}  # (format, nbytes) -> the seal's bytes that depend only on them
        if check:
            self.ping()

    # -- plumbing -----------------------------------------------------------------------------
    def ping(self) -> None:
        """Raise ``StorageUnavailable`` unless the server answers PING (ignores the breaker)."""
        try:
            self._client.ping()
        except _UNREACHABLE as err:
            raise StorageUnavailable(f"redis storage at {self.url} is unreachable: {_reason(err)}") from err
        except RedisError as err:
            raise StorageUnavailable(f"redis storage at {self.url} refused PING: {err}") from err
        self.breaker.success()

    def _name(self, key: str) -> str:
        return self.key_prefix + key + self.suffix

    def _execute(self, pipe) -> list:
        """Run a pipeline; replies that are errors come back as exception objects."""
        return pipe.execute(raise_on_error=False)

    def _run(self, build, what: str) -> list:
        """Build and run one pipeline behind the breaker; unreachable raises ``StorageUnavailable``."""
        def go():
            pipe = self._client.pipeline(transaction=False)
            build(pipe)
            try:
                return self._execute(pipe)
            finally:
                pipe.reset()
        return self._guarded(go, what)

    def _write_wire(self, payload: memoryview, n: int) -> list:
        """Send ``n`` packed ``SET`` commands; per command its reply or the server's error."""
        return send_and_read(self._client, payload, n)

    def _guarded(self, call, what: str) -> list:
        """Run ``call`` (a round trip) behind the breaker: refused at once while it is open;
        unreachable (also as a reply) reports a failure and raises ``StorageUnavailable``."""
        if not self.breaker.allow():
            self._count("unavailable")
            raise StorageUnavailable(f"redis storage at {self.url} is unavailable ({what}): circuit open, "
                                     f"next probe in {self.breaker.retry_in():.1f}s")
        try:
            replies = call()
            bad = next((r for r in replies if isinstance(r, _UNREACHABLE)), None)
            if bad is not None:
                raise bad
        except _UNREACHABLE as err:
            self._count("errors")
            self._count("unavailable")
            self.breaker.failure(err)
            self._oplog.warning("redis_storage.unavailable", op=what, url=self.url, error=_reason(err))
            raise StorageUnavailable(f"redis storage at {self.url} is unreachable ({what}): {_reason(err)}") from err
        self.breaker.success()
        return replies

    def _count(self, field: str, n: int = 1) -> None:
        with self._lock:
            setattr(self._stats, field, getattr(self._stats, field) + n)

    def _batches(self, n: int, sizes: Sequence[int]):
        """Split ``range(n)`` into runs of at most ``pipeline_bytes`` page bytes (>= 1 page)."""
        if sum(sizes) <= self.pipeline_bytes:
            yield range(n)
            return
        start, total = 0, 0
        for i in range(n):
            if i > start and total + sizes[i] > self.pipeline_bytes:
                yield range(start, i)
                start, total = i, 0
            total += sizes[i]
        if start < n:
            yield range(start, n)

    def _remove_ours(self, names: list[str], what: str) -> list:
        """Delete each of ``names`` unless its value is another deployment's page
        (``integrity.written_by_another``: counted ``foreign_kept``, left alone). Per name: the
        server's count (0: absent, or changed since the check), its error, or None (kept)."""
        heads = self._run(lambda p: [(p.getrange(x, 0, SEAL_NBYTES - 1), p.strlen(x)) for x in names], what)
        out, todo, cut = [None] * len(names), [], len(self.key_prefix)
        for k, name in enumerate(names):
            head, length = heads[2 * k], heads[2 * k + 1]
            if (not isinstance(head, Exception) and not isinstance(length, Exception)
                    and written_by_another(head, length - SEAL_NBYTES, name[cut:], self.page_format)):
                self._count("foreign_kept")
                log.debug("storage.foreign_page_kept", store=type(self).__name__, name=name, op=what)
            else:
                todo.append(k)
        if todo:  # a value the check could not read (not a string) is not a page: deleted as it is
            replies = self._run(lambda p: [p.delete(names[k]) if isinstance(heads[2 * k], Exception)
                                           else p.execute_command("EVAL", _DELETE_IF_SAME, 1, names[k], heads[2 * k])
                                           for k in todo], what)
            for k, reply in zip(todo, replies):
                out[k] = reply
        return out

    def _evict(self, names: list[str]) -> None:
        if not names:
            return
        try:
            self._remove_ours(names, "evict")
        except StorageUnavailable as err:
            self._oplog.warning("redis_storage.evict_failed", names=len(names), error=str(err))
        else:
            if self.events is not None:
                cut = len(self.key_prefix)
                self.events.removed([x[cut:cut + 64] for x in names])
        self._count("evictions", len(names))

    def _format(self, page: torch.Tensor) -> PageFormat:
        return self.page_format if self.page_format is not None else raw_format(page)

    # -- Storage ------------------------------------------------------------------------------
    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """See ``Storage.batch_set``. Raises ``StorageUnavailable`` when the server is unreachable
        (pages of earlier round trips of the batch may be stored; the call reports none)."""
        check_batch(keys, pages, self.page_nbytes)
        n = len(keys)
        results = [False] * n
        sizes = [p.numel() * p.element_size() for p in pages]
        for run in self._batches(n, sizes):
            names = [self._name(keys[i]) for i in run]
            self._sets.start([x.encode() for x in names], [SEAL_NBYTES + sizes[i] for i in run], self.ttl_ms)
            values = []
            for j, i in enumerate(run):  # one copy of each page, next to its seal, in one buffer
                raw = _raw(pages[i])
                values.append(self._sets.add(j, seal(keys[i] + self.suffix, self._format(pages[i]), raw), raw))
            replies = self._guarded(lambda: self._write_wire(self._sets.payload(), len(names)), "set")
            skipped = [j for j, r in enumerate(replies) if r is None]
            if skipped:  # NX kept an older value: is it our page? if not, overwrite it
                self._repair([names[j] for j in skipped], [values[j] for j in skipped],
                             [pages[run[j]] for j in skipped], replies, skipped)
            if not self._settle(run, names, sizes, replies, results):
                break
        return results

    def _repair(self, names, values, pages, replies, where) -> None:
        """Overwrite skipped keys whose value is not exactly our page (``replies`` updated)."""
        heads = self._run(lambda p: [(p.getrange(x, 0, SEAL_NBYTES - 1), p.strlen(x)) for x in names],
                          "check existing")
        bad = []
        for k, (name, page) in enumerate(zip(names, pages)):
            head, length = heads[2 * k], heads[2 * k + 1]
            if self._seal_ok(name[len(self.key_prefix):], head, length, self._format(page),
                             len(values[k]) - SEAL_NBYTES):
                replies[where[k]] = "skipped"
            elif (not isinstance(head, Exception) and not isinstance(length, Exception)
                  and written_by_another(head, length - SEAL_NBYTES, name[len(self.key_prefix):], self._format(page))):
                replies[where[k]] = "foreign"  # another deployment's page: already there, left alone
                log.debug("storage.foreign_page_kept", store=type(self).__name__, name=name, op="set")
            else:
                bad.append(k)
        if not bad:
            return
        fixed = self._run(lambda p: [p.set(names[k], values[k], px=self.ttl_ms) for k in bad], "repair")
        for k, reply in zip(bad, fixed):
            replies[where[k]] = reply if isinstance(reply, Exception) else "repaired"
            if not isinstance(reply, Exception):
                self._oplog.warning("redis_storage.repaired", name=names[k])

    def _seal_ok(self, name: str, head, length, fmt: PageFormat | None, nbytes: int | None) -> bool:
        if isinstance(head, Exception) or isinstance(length, Exception) or not head:
            return False
        sealed = decode_seal(head)
        if sealed is None or length != SEAL_NBYTES + sealed.nbytes:
            return False
        fmt = fmt if fmt is not None else sealed.format
        return check_seal(sealed, name, fmt, nbytes if nbytes is not None else sealed.nbytes) is Verdict.OK

    def _settle(self, run, names, sizes, replies, results) -> bool:
        """Record a round trip's outcome; False when a page was refused (the batch stops)."""
        for i, name, reply in zip(run, names, replies):
            if isinstance(reply, Exception):
                self._count("errors")
                self._oplog.error("redis_storage.write_failed", name=name, error=str(reply))
                return False
            if reply == "foreign":  # not ours: not indexed (never evicted by us), not announced
                with self._lock:
                    self._stats.foreign_kept += 1
                    self._index.remove(name)
                results[i] = True
                continue
            with self._lock:
                if reply == "skipped":
                    self._stats.skipped += 1
                else:
                    self._stats.stored += 1
                    self._stats.repaired += reply == "repaired"
                evicted = self._index.add(name, sizes[i])
            if reply != "skipped" and self.events is not None:
                self.events.stored([name[len(self.key_prefix):len(self.key_prefix) + 64]])
            self._evict(evicted)
            results[i] = True
        return True

    def batch_exists(self, keys: Sequence[str]) -> int:
        """See ``Storage.batch_exists``: asks the server (pages other nodes wrote count), and
        counts a key only when its seal matches our name, format and size. Raises
        ``StorageUnavailable`` when the server is unreachable."""
        check_keys(keys)
        names = [self._name(k) for k in keys]
        n, step = 0, 1024
        for start in range(0, len(names), step):
            chunk = names[start:start + step]
            replies = self._run(
                lambda p, chunk=chunk: [(p.getrange(x, 0, SEAL_NBYTES - 1), p.strlen(x)) for x in chunk], "exists")
            for k, name in enumerate(chunk):
                head, length = replies[2 * k], replies[2 * k + 1]
                if not self._seal_ok(name[len(self.key_prefix):], head, length, self.page_format, self.page_nbytes):
                    return n
                with self._lock:
                    evicted = [] if self._index.touch(name) else self._index.add(name, length - SEAL_NBYTES)
                self._evict(evicted)
                n += 1
        return n

    def delete(self, key: str) -> bool:
        """See ``Storage.delete``: whether the server removed it (False when it refused, e.g. a
        read-only replica: counted in ``errors`` and logged; or when the value is another
        deployment's page: counted ``foreign_kept``, left alone). Raises ``StorageUnavailable``."""
        check_keys([key])
        name = self._name(key)
        (count,) = self._remove_ours([name], "delete")
        if count is None:  # another deployment's page: never ours to delete
            with self._lock:
                self._index.remove(name)
            return False
        if isinstance(count, Exception):
            self._count("errors")
            self._oplog.error("redis_storage.delete_failed", name=name, error=str(count))
            return False
        with self._lock:
            self._index.remove(name)
            if count:
                self._stats.deletes += 1
        if count and self.events is not None:
            self.events.removed([key])
        return bool(count)

    def stats(self) -> RedisStorageStats:
        with self._lock:
            s = msgspec.structs.replace(self._stats)
            s.pages, s.bytes = len(self._index), self._index.bytes
        return s

    def close(self, timeout: float | None = None) -> list[str]:
        """Close the client's connections (no wait: a write in flight holds its own connection,
        bounded by ``socket_timeout_s``). Idempotent. Returns ``[]`` (nothing abandoned here)."""
        self._oplog.flush()
        try:
            self._client.close()
        except RedisError:
            pass
        return []


def _reason(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return " ".join(text.split())
