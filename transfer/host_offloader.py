"""``HostOffloader``: the ``Offloader`` protocol over a real KV pool, host pool and storage.

``write`` plans a device -> host copy of whole pages and hands it to a copy engine; ``write_storage``
hands host pages to a storage worker thread that writes them under their page hashes. Both report
completions through non-blocking polls. Every method is called from the scheduler thread; workers
only run jobs and append to completion deques, so the caller is never blocked on a copy or on I/O.
Storage failures (ENOSPC, EACCES, EIO ...) are logged, counted and reported as finished ops; the
host pages stay the caller's, to be returned with ``free_host`` as the protocol says.

Copy faults. A copy that raises is still reported once by ``finished_writes`` and also listed by
``failed_writes`` (its host pages are poisoned: never stored). With ``write_timeout_s`` a copy still
running that long after submission is *expired*: listed once by ``expired_writes`` and poisoned, but
its device slots may still be read until ``finished_writes`` reports it (a copy cannot be
cancelled, on a worker thread or on a CUDA stream), so the caller keeps them until then.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

import msgspec
from transfer.log import get_logger
import torch

from transfer.copy_engine import CopyEngine, CpuCopyEngine, make_copy_engine
from transfer.errors import (
    BadIndices, Closed, HostPagesBusy, NotAllocated, StorageError, TransferError, UnknownId,
)
from transfer.host_pool import HostPool
from transfer.indices import pages_of_aligned
from transfer.kv_pool import KVPool
from transfer.storage.base import Storage
from transfer.worker import BackgroundWorker

log = get_logger(__name__)


class OffloaderStats(msgspec.Struct):
    """Counters since construction; ``host_free_pages`` and ``in_flight_*`` are current values."""

    writes: int = 0
    writes_rejected: int = 0
    writes_landed: int = 0
    copy_failures: int = 0
    copy_expired: int = 0
    storage_ops: int = 0
    storage_ok: int = 0
    storage_failed: int = 0
    pages_stored: int = 0
    in_flight_writes: int = 0
    in_flight_storage: int = 0
    host_free_pages: int = 0


def check_compatible(kv: KVPool, host: HostPool) -> None:
    """Raise ValueError unless ``kv`` and ``host`` hold the same KV shape and dtype."""
    a = (kv.kinds, kv.layers, kv.heads, kv.head_dim, kv.dtype)
    b = (host.kinds, host.layers, host.heads, host.head_dim, host.dtype)
    if a != b:
        raise ValueError(f"device pool (kinds, layers, heads, head_dim, dtype) {a} != host pool {b}")


class HostOffloader:
    """Device -> host -> storage offload of KV pages.

    Args:
        kv_pool: the device KV pool the written slots index.
        host_pool: host pages (its ``page_size`` is the page size).
        storage: where ``write_storage`` puts pages (keys = page hashes).
        copy_engine: default ``make_copy_engine(kv_pool.device)``.
        storage_threads: storage worker threads.
        write_timeout_s: a copy not finished this many seconds after ``write`` submitted it is
            reported by ``expired_writes`` (None: never).
        clock: monotonic seconds, for the deadline (tests inject a fake one).
    Raises:
        ValueError: pools of different shape or dtype, or ``write_timeout_s <= 0``.
    """

    def __init__(
        self,
        kv_pool: KVPool,
        host_pool: HostPool,
        storage: Storage,
        *,
        copy_engine: CopyEngine | None = None,
        storage_threads: int = 1,
        write_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_compatible(kv_pool, host_pool)
        if write_timeout_s is not None and not write_timeout_s > 0:
            raise ValueError(f"write_timeout_s must be > 0 or None, got {write_timeout_s}")
        self.write_timeout_s, self._clock = write_timeout_s, clock
        self.kv, self.host, self.storage = kv_pool, host_pool, storage
        self.page_size = host_pool.page_size
        self.engine = copy_engine if copy_engine is not None else make_copy_engine(kv_pool.device)
        self._storage_worker = BackgroundWorker("kv-storage", storage_threads)
        self._writes: dict[int, torch.Tensor] = {}
        self._deadlines: dict[int, float] = {}  # ack -> expiry time, for copies not yet expired
        self._expired_acks: set[int] = set()  # expired, copy not yet ended
        self._failed_writes: list[int] = []
        self._ops: dict[int, torch.Tensor] = {}
        self._op_ids = itertools.count(1)
        self._failed: list[int] = []
        self._landing = torch.zeros(host_pool.num_pages, dtype=torch.int32)
        self._busy = torch.zeros(host_pool.num_pages, dtype=torch.int32)
        self._poisoned = torch.zeros(host_pool.num_pages, dtype=torch.bool)
        self._stats = OffloaderStats()
        self._rejected_run = 0  # writes rejected since the last accepted one
        self._closed = False

    # -- device -> host -----------------------------------------------------------------------
    def write(self, device_indices: torch.Tensor, ack_id: int) -> torch.Tensor | None:
        """See ``Offloader.write``.

        Raises:
            Closed: after ``close``. UnknownId: ``ack_id`` already pending.
            BadIndices: empty, not whole page-aligned pages, or outside the device pool.
        """
        if self._closed:
            raise Closed("offloader is closed")
        if ack_id in self._writes:
            raise UnknownId(f"ack id {ack_id} is already pending")
        pages = pages_of_aligned(device_indices, self.page_size, "device indices")
        if pages.numel() == 0:
            raise BadIndices("a write needs at least one page")
        slots = device_indices.to(device="cpu", dtype=torch.int64)
        if int(slots.min()) < 0 or int(slots.max()) >= self.kv.slots:
            raise BadIndices(f"device slots must lie in 0..{self.kv.slots - 1}")
        host = self.host.alloc(slots.numel())
        if host is None:
            self._stats.writes_rejected += 1
            self._rejected_run += 1
            if self._rejected_run == 1:  # once per stretch of rejections, not once per poll
                log.warning("offloader.host_exhausted", ack_id=ack_id, pages=int(pages.numel()),
                            host_free_pages=self.host.available_size() // self.page_size)
            return None
        if self._rejected_run:
            log.info("offloader.host_recovered", rejected=self._rejected_run)
            self._rejected_run = 0
        host_pages = self.host.pages_of(host)
        try:
            self.engine.to_host(ack_id, self.kv, self.host, slots, host_pages)
        except BaseException:
            self.host.free(host)  # nothing was enqueued: the pages go back, the ack is never reported
            raise
        self._writes[ack_id] = host_pages
        if self.write_timeout_s is not None:
            self._deadlines[ack_id] = self._clock() + self.write_timeout_s
        self._landing[host_pages] += 1
        self._stats.writes += 1
        return host

    def finished_writes(self) -> list[int]:
        """See ``Offloader.finished_writes``. A copy that raised, or that had expired, is reported
        too, listed by ``failed_writes``, and its pages poisoned: a later ``write_storage`` of them
        fails without writing."""
        out = []
        for done in self.engine.poll():
            pages = self._writes.pop(done.tag)
            self._deadlines.pop(done.tag, None)
            expired = done.tag in self._expired_acks
            self._expired_acks.discard(done.tag)
            self._landing[pages] -= 1
            bad = done.error is not None or expired
            self._poisoned[pages] = bad
            if done.error is not None:
                self._stats.copy_failures += 1
                log.error("offloader.copy_failed", ack_id=done.tag, expired=expired, error=repr(done.error))
            elif expired:
                log.warning("offloader.expired_copy_ended", ack_id=done.tag)
            if bad:
                self._failed_writes.append(done.tag)
            self._stats.writes_landed += 1
            out.append(done.tag)
        return out

    def failed_writes(self) -> list[int]:
        """Optional extension (see ``transfer.offloader``): ack ids reported by ``finished_writes``
        since the last call whose host pages must not be stored, because the copy raised or had
        expired. Each is reported once; its host pages are the caller's to ``free_host``."""
        out, self._failed_writes = self._failed_writes, []
        return out

    def expired_writes(self) -> list[int]:
        """Optional extension (see ``transfer.offloader``): ack ids whose copy passed
        ``write_timeout_s`` since submission without finishing, since the last call; each once.

        The copy may still be reading its device slots: keep them until ``finished_writes``
        reports the same ack (then it is also in ``failed_writes``). Never blocks.
        """
        if not self._deadlines:
            return []
        now, out = self._clock(), []
        for ack, deadline in list(self._deadlines.items()):
            if now >= deadline:
                del self._deadlines[ack]
                self._expired_acks.add(ack)
                self._poisoned[self._writes[ack]] = True
                self._stats.copy_expired += 1
                log.error("offloader.copy_expired", ack_id=ack, timeout_s=self.write_timeout_s,
                          pages=int(self._writes[ack].numel()))
                out.append(ack)
        return out

    # -- host -> storage ----------------------------------------------------------------------
    def write_storage(
        self, host_indices: torch.Tensor, tokens: Sequence[int], page_hashes: Sequence[str]
    ) -> int:
        """See ``Offloader.write_storage``.

        Raises:
            Closed: after ``close``. BadIndices: host indices not whole pages of the pool, or a
            count mismatch among pages, tokens and hashes. NotAllocated: host pages not held.
            TransferError: a page's device -> host copy has not landed yet.
        """
        if self._closed:
            raise Closed("offloader is closed")
        pages = self.host.pages_of(host_indices)
        n = pages.numel()
        if len(page_hashes) != n or len(tokens) != n * self.page_size:
            raise BadIndices(
                f"{n} host pages, {len(page_hashes)} hashes, {len(tokens)} tokens (page size {self.page_size})"
            )
        if any(not isinstance(h, str) or not h for h in page_hashes):
            raise BadIndices("page hashes must be non-empty strings")
        if n and not self.host.is_held(pages):
            raise NotAllocated("host pages passed to write_storage are not allocated")
        if n and bool(self._landing[pages].any()):
            raise TransferError("write_storage of host pages whose copy has not landed")
        op = next(self._op_ids)
        keys = list(page_hashes)
        if n and bool(self._poisoned[pages].any()):
            log.error("offloader.store_refused", op_id=op, reason="host pages hold a failed or expired copy")

            def job() -> list[bool]:
                raise StorageError("source host pages hold a failed or expired copy")
        else:
            bufs = [self.host.page_bytes(p) for p in pages.tolist()]
            def job() -> list[bool]:
                return self.storage.batch_set(keys, bufs)
        self._busy.index_add_(0, pages, torch.ones_like(pages, dtype=torch.int32))
        self._ops[op] = pages
        self._storage_worker.submit(op, job)
        self._stats.storage_ops += 1
        return op

    def finished_storage(self) -> list[int]:
        """See ``Offloader.finished_storage``; failed ops are also listed by ``failed_storage``."""
        out = []
        for done in self._storage_worker.poll():
            pages = self._ops.pop(done.tag)
            self._busy.index_add_(0, pages, torch.full_like(pages, -1, dtype=torch.int32))
            ok = done.error is None and all(done.value)
            if ok:
                self._stats.storage_ok += 1
                self._stats.pages_stored += pages.numel()
            else:
                self._stats.storage_failed += 1
                self._failed.append(done.tag)
                log.warning("offloader.storage_failed", op_id=done.tag,
                            error=repr(done.error) if done.error else "page write failed")
            out.append(done.tag)
        return out

    def failed_storage(self) -> list[int]:
        """Op ids reported failed by ``finished_storage`` since the last call."""
        out, self._failed = self._failed, []
        return out

    def free_host(self, host_indices: torch.Tensor) -> None:
        """See ``Offloader.free_host``.

        Raises:
            BadIndices: not whole pages of the pool. HostPagesBusy: a copy or storage op still
            uses a page. DoubleFree / NotAllocated: pages not held. On any error nothing changes.
        """
        pages = self.host.pages_of(host_indices)
        if pages.numel() and bool((self._busy[pages] > 0).any() or (self._landing[pages] > 0).any()):
            raise HostPagesBusy("host pages are still used by an in-flight copy or storage op")
        self.host.free(host_indices)
        self._poisoned[pages] = False

    # -- lifecycle ----------------------------------------------------------------------------
    def idle(self) -> bool:
        """True when no copy or storage op is in flight (reported or not)."""
        return not self._writes and not self._ops

    def stats(self) -> OffloaderStats:
        """A snapshot of the counters."""
        s = msgspec.structs.replace(self._stats)
        s.in_flight_writes, s.in_flight_storage = len(self._writes), len(self._ops)
        s.host_free_pages = self.host.available_size() // self.page_size
        return s

    def close(self, timeout_s: float | None = None) -> None:
        """Refuse new work and drain: queued copies and storage ops run to completion (their ids
        remain pollable). ``timeout_s`` bounds the wait for each worker (a stuck copy thread is
        left behind, logged ``offloader.close_timed_out``); None waits. Idempotent."""
        self._closed = True
        cpu = isinstance(self.engine, CpuCopyEngine)
        self.engine.close(timeout_s) if cpu else self.engine.close()  # a CUDA stream is synchronized
        self._storage_worker.close(timeout_s)
        if (cpu and self.engine.alive()) or self._storage_worker.alive():
            log.error("offloader.close_timed_out", in_flight_writes=len(self._writes),
                      in_flight_storage=len(self._ops))
