"""Prefix reuse: find a new request's leading pages in storage and load them into device slots.

``start`` hashes the request's tokens (``hashing.page_hashes``, from the request's namespace seed:
``DecodeOffloadManager.namespace_of(req)``, the seed its LoRA ``extra_key`` and ``cache_salt`` give
and the manager names its pages under; None for a plain request), asks storage how many leading
pages exist, allocates device slots and host pages for them, and
queues the load (storage -> host pages -> device slots) on a worker thread. ``finished`` reports
loads as they complete, frees the host staging pages and any device slots whose page could not be
read (a page evicted between lookup and read ends the prefix there).

Lookups run on the scheduler thread, so they never stall it nor raise for a storage outage: the
existence check runs on a helper thread and is waited for at most ``lookup_timeout_s``; a tier
that fails (``StorageError``, ``OSError``) or misses the deadline gives a miss (0 pages), counted
in ``stats()`` and reported to a ``CircuitBreaker`` (the store's own ``breaker`` when it has one,
e.g. ``RedisStorage``, so reads and writes share it). While the breaker is open, lookups are
misses at once without asking the tier; after its backoff one lookup probes the tier again. The
breaker logs one warning when the tier goes down and one line when it is back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import msgspec
import torch

import hashing
from transfer.allocator import PagedTokenAllocator
from transfer.errors import Closed, StorageError, UnknownId
from transfer.gather import ChunkCopy
from transfer.host_pool import HostPool
from transfer.host_offloader import check_compatible
from transfer.kv_pool import KVPool
from transfer.log import get_logger
from transfer.storage.base import Storage
from transfer.storage.breaker import CircuitBreaker
from transfer.storage.memory import MemoryStorage
from transfer.worker import BackgroundWorker

log = get_logger(__name__)


class PrefixStats(msgspec.Struct):
    """Lookups and loads since construction. ``lookups``: existence checks; ``hits``: those that
    found at least one page; ``pages_looked_up`` / ``pages_found``: pages asked for / found stored.
    ``failed``: the tier raised; ``timed_out``: it missed the deadline; ``skipped``: the breaker
    was open (the tier was not asked). All three are misses. ``loads``: loads reported by
    ``finished``; ``pages_loaded``: pages they put in device slots; ``loads_short``: loads that got
    fewer pages than found (a page vanished, was refused, or the read failed)."""

    lookups: int = 0
    hits: int = 0
    pages_looked_up: int = 0
    pages_found: int = 0
    failed: int = 0
    timed_out: int = 0
    skipped: int = 0
    loads: int = 0
    pages_loaded: int = 0
    loads_short: int = 0


class PrefixLoad(msgspec.Struct):
    """A finished load: ``pages`` leading pages now sit in ``device_indices`` (``pages * page_size``
    slots, owned by the caller); ``page_hashes`` names them; ``error`` says why a load fell short."""

    load_id: int
    pages: int
    device_indices: torch.Tensor
    page_hashes: list[str]
    error: str | None = None


class _Pending(msgspec.Struct):
    slots: torch.Tensor
    host: torch.Tensor
    hashes: list[str]


class PrefixLoader:
    """Loads stored prefixes into freshly allocated device slots.

    Args:
        kv_pool, allocator, host_pool, storage: the stack's parts (same page size).
        threads: loader worker threads.
        lookup_timeout_s: deadline of one existence check, in seconds (None: no helper thread,
            the check runs on the caller's thread). An in-process ``MemoryStorage`` is always
            asked directly.
        breaker: guards the tier (None: the store's ``breaker`` attribute, else a new one).
    Raises:
        ValueError: pools of different shape, allocator and host pool page sizes differ, or a
            deadline that is not > 0.
    """

    def __init__(self, kv_pool: KVPool, allocator: PagedTokenAllocator, host_pool: HostPool,
                 storage: Storage, threads: int = 1, lookup_timeout_s: float | None = 0.05,
                 breaker: CircuitBreaker | None = None) -> None:
        if lookup_timeout_s is not None and not lookup_timeout_s > 0:
            raise ValueError(f"lookup_timeout_s must be > 0 or None, got {lookup_timeout_s!r}")
        check_compatible(kv_pool, host_pool)
        if allocator.page_size != host_pool.page_size:
            raise ValueError(f"allocator page size {allocator.page_size} != host {host_pool.page_size}")
        self.kv, self.allocator, self.host, self.storage = kv_pool, allocator, host_pool, storage
        self.page_size = host_pool.page_size
        self._worker = BackgroundWorker("kv-prefix-load", threads)
        self._pending: dict[int, _Pending] = {}
        self._closed = False
        self.lookup_timeout_s = lookup_timeout_s
        self.breaker = breaker or getattr(storage, "breaker", None) or CircuitBreaker(type(storage).__name__)
        self._direct = lookup_timeout_s is None or isinstance(storage, MemoryStorage)
        self._lookups: ThreadPoolExecutor | None = None
        self._stats = PrefixStats()
        self._stats_lock = threading.Lock()
        self.observer = None  # ``storage_seconds(op, s)`` of each existence check and read (metrics)

    def lookup(self, tokens: Sequence[int], prior_hash: str | None = None) -> list[str]:
        """Hashes of the leading pages of ``tokens`` present in storage (no loading), named from
        ``prior_hash``: the request's namespace seed (see ``start``). Only pages stored under that
        namespace are found: a page's name depends on the seed, so no name of one namespace is a
        name of another.

        Never raises for the tier: down, hung past ``lookup_timeout_s`` or behind an open
        breaker, it is a miss (``[]``), counted in ``stats()``.
        Raises:
            hashing.TokenRangeError: a bad token id. ValueError: a malformed ``prior_hash``.
        """
        hashes = hashing.page_hashes(tokens, self.page_size, prior_hash)
        n = self._exists(hashes) if hashes else 0
        with self._stats_lock:
            self._stats.lookups += 1
            self._stats.pages_looked_up += len(hashes)
            self._stats.hits += n > 0
            self._stats.pages_found += n
        return hashes[:n]

    def _exists(self, hashes: list[str]) -> int:
        if not self.breaker.allow():
            self._count("skipped")
            return 0
        t = time.perf_counter()
        try:
            if self._direct:
                n = self.storage.batch_exists(hashes)
            else:
                n = self._lookup_pool().submit(self.storage.batch_exists, hashes).result(self.lookup_timeout_s)
        except FutureTimeout:
            self._count("timed_out")
            self.breaker.failure(f"lookup took longer than {self.lookup_timeout_s}s")
            return 0
        except (StorageError, OSError) as err:
            self._count("failed")
            self.breaker.failure(err)
            return 0
        finally:
            if self.observer is not None:
                self.observer.storage_seconds("exists", time.perf_counter() - t)
        self.breaker.success()
        return n

    def _lookup_pool(self) -> ThreadPoolExecutor:
        if self._lookups is None:
            self._lookups = ThreadPoolExecutor(1, thread_name_prefix="kv-prefix-lookup")
        return self._lookups

    def _count(self, field: str) -> None:
        with self._stats_lock:
            setattr(self._stats, field, getattr(self._stats, field) + 1)

    def stats(self) -> PrefixStats:
        """A snapshot of the lookup counters."""
        with self._stats_lock:
            return msgspec.structs.replace(self._stats)

    def start(self, load_id: int, tokens: Sequence[int], prior_hash: str | None = None,
              max_pages: int | None = None) -> int | None:
        """Queue the load of the stored prefix of ``tokens``.

        Args:
            load_id: caller-chosen id, reported once by ``finished`` when pages > 0.
            tokens: the request's token ids.
            prior_hash: the request's namespace seed or None (a plain request):
                ``DecodeOffloadManager.namespace_of(req)``, which is ``hashing.namespace_seed(
                req.extra_key, req.cache_salt)`` unless the manager has a seed of its own.
            max_pages: load at most this many pages.
        Returns:
            Pages queued (0: nothing stored, nothing queued, never reported); None when device
            slots or host pages are short (nothing allocated, nothing queued).
        Raises:
            Closed: after ``close``. UnknownId: ``load_id`` pending.
            hashing.TokenRangeError: a bad token id.
        """
        if self._closed:
            raise Closed("prefix loader is closed")
        if load_id in self._pending:
            raise UnknownId(f"load id {load_id} is already pending")
        hashes = self.lookup(tokens, prior_hash)[:max_pages]
        if not hashes:
            return 0
        n_tokens = len(hashes) * self.page_size
        slots = self.allocator.alloc(n_tokens)
        if slots is None:
            return None
        host = self.host.alloc(n_tokens)
        if host is None:
            self.allocator.free(slots)
            return None
        ready = None
        if self.kv.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.kv.device))
        host_pages = self.host.pages_of(host)
        self._pending[load_id] = _Pending(slots, host, hashes)
        self._worker.submit(load_id, lambda: self._load(hashes, slots, host_pages, ready))
        return len(hashes)

    def _load(self, hashes: list[str], slots: torch.Tensor, host_pages: torch.Tensor,
              ready: "torch.cuda.Event | None") -> tuple[int, "torch.cuda.Event | None"]:
        bufs = [self.host.page_bytes(p) for p in host_pages.tolist()]
        t = time.perf_counter()
        try:
            got = self.storage.batch_get(hashes, bufs)
        finally:
            if self.observer is not None:
                self.observer.storage_seconds("get", time.perf_counter() - t)
        n = got.index(False) if False in got else len(got)
        if n == 0:
            return 0, None
        if ready is None:
            ChunkCopy(self.kv, self.host, slots[: n * self.page_size], host_pages[:n]).to_device()
            return n, None
        # the stream rule (docs/architecture.md): the load stream waits for the scheduler's stream
        # as it was at start (the slots' previous reads), the plan's index is built and used on the
        # load stream (one stream: no unordered H2D), and the scheduler's stream waits for the
        # load's event before the model reads the slots (``finished``: the load fence)
        stream = torch.cuda.Stream(self.kv.device)
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            plan = ChunkCopy(self.kv, self.host, slots[: n * self.page_size], host_pages[:n])
            plan.to_device()
            loaded = torch.cuda.Event()
            loaded.record(stream)
        stream.synchronize()  # blocks this worker thread only: the host pages may be reused after
        return n, loaded

    def finished(self) -> list[PrefixLoad]:
        """Loads finished since the last call. Never blocks. On CUDA the caller's current stream is
        made to wait for each reported load (its event), so work queued on it afterwards (the model
        reading the loaded slots) is ordered after the load."""
        out = []
        for done in self._worker.poll():
            p = self._pending.pop(done.tag)
            n, loaded = (0, None) if done.error is not None else done.value
            if loaded is not None:  # the load fence: the scheduler's stream waits (no host sync)
                torch.cuda.current_stream(self.kv.device).wait_event(loaded)
            self.host.free(p.host)
            keep = n * self.page_size
            if keep < p.slots.numel():
                self.allocator.free(p.slots[keep:])
            error = repr(done.error) if done.error is not None else (
                None if n == len(p.hashes) else f"{len(p.hashes) - n} pages could not be read")
            out.append(PrefixLoad(done.tag, n, p.slots[:keep], p.hashes[:n], error))
            with self._stats_lock:
                self._stats.loads += 1
                self._stats.pages_loaded += n
                self._stats.loads_short += n < len(p.hashes)
        return out

    def idle(self) -> bool:
        """True when no load is in flight."""
        return not self._pending

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new loads and let queued ones finish (still reported by ``finished``), waiting
        at most ``timeout`` seconds (None: until they end). Returns True when none is left running."""
        self._closed = True
        ended = self._worker.close(timeout)
        if self._lookups is not None:  # a lookup stuck on a hung tier is abandoned, not waited for
            self._lookups.shutdown(wait=False, cancel_futures=True)
        return ended
