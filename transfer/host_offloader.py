"""``HostOffloader``: the ``Offloader`` protocol over a real KV pool, host pool and storage.

``write`` plans a device -> host copy of whole pages and hands it to a copy engine; ``write_storage``
hands host pages to a storage worker thread that writes them under their page hashes. Both report
completions through non-blocking polls. Every method is called from the scheduler thread; workers
only run jobs and append to completion deques, so the caller is never blocked on a copy or on I/O.
Storage failures (ENOSPC, EACCES, EIO ...) are logged, counted and reported as finished ops; the
host pages stay the caller's, to be returned with ``free_host`` as the protocol says.

Copy faults. A copy that raises is reported once by ``finished_writes`` as failed (its host pages
are poisoned: never stored). With ``write_timeout_s`` a copy still running that long after
submission is *expired*: reported once as expired and poisoned, but its device slots may still be
read until ``finished_writes`` reports it failed (a copy cannot be
cancelled, on a worker thread or on a CUDA stream), so the caller keeps them until then.

Scheduler-thread cost. ``write`` and the polls are on the decode loop's critical path: page
bookkeeping is plain Python sets and numpy, a decode chunk's slot ids are checked as one Python list
(``count_pages``), the copy plan is built (and its NumPy ids wrapped as tensors) on the copy worker,
and no torch op that releases the GIL runs on this thread (each one lets a waiting copy or storage
worker in, and this thread then waits: a thread switch). The host indices ``write`` returns are
remembered while their pages are held, so ``write_storage`` and ``free_host`` of that same tensor,
unchanged since (its version), read its pages from there instead of deriving them from its values
again; any other tensor is checked by value. What the version cannot show is trusted: a write
into the tensor through a NumPy view of it, or its pages freed through the host pool directly
instead of ``free_host`` (the pages stay the offloader's caller's until ``free_host``, as the
protocol says); an inference tensor has no version and is never remembered. Host-pool backpressure is counted
(``writes_rejected``) and logged at most once per ``backpressure_log_interval_s``.

Shutdown. ``close(timeout=...)`` waits at most ``timeout`` seconds (default
``DEFAULT_CLOSE_TIMEOUT_S``) and returns a ``CloseReport``: a stuck copy is abandoned, never
waited on forever, and the report names its ack, the device slots it may still read and the host
pages it may still write (both stay quarantined).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import torch

from transfer.copy_engine import CopyEngine, make_copy_engine
from transfer.errors import (
    BadIndices, Closed, HostPagesBusy, NotAllocated, StorageError, TransferError, UnknownId,
)
from transfer.host_pool import HostPool
from transfer.indices import as_index_array, check_device_indices, count_pages, host_slots_array, on_host, slots_of_pages
from transfer.kv_pool import KVPool
from transfer.log import RateLimitedLog, get_logger
from transfer.offloader import EMPTY_REPORT, WriteReport
from transfer.shutdown import DEFAULT_CLOSE_TIMEOUT_S, CloseReport, check_timeout
from transfer.storage.base import Storage
from transfer.worker import BackgroundWorker

log = get_logger(__name__)


class OffloaderStats(msgspec.Struct):
    """Counters since construction; ``host_free_pages`` and ``in_flight_*`` are current values.

    ``writes_rejected`` counts writes refused for want of host pages (backpressure);
    ``copies_discarded`` counts copies the caller discarded (``discard_write``) before they ended.
    """

    writes: int = 0
    writes_rejected: int = 0
    writes_landed: int = 0
    copy_failures: int = 0
    copy_expired: int = 0
    copies_discarded: int = 0
    storage_ops: int = 0
    storage_ok: int = 0
    storage_failed: int = 0
    pages_stored: int = 0
    in_flight_writes: int = 0
    in_flight_storage: int = 0
    host_free_pages: int = 0


_READ_ONLY = -1  # ``_Issued.version`` of NumPy host indices: handed out read-only, unchanged while they stay so


class _Issued(msgspec.Struct, gc=False):
    """Host indices ``write`` returned, while their pages are held: the tensor (or read-only NumPy
    array), its version then (``_READ_ONLY`` for an array), its pages. Off the collector's walk
    (``gc=False``): the tensor and the list are the copy's own, held elsewhere too, so an entry per
    chunk adds no tracked object."""

    tensor: object
    version: int
    pages: list


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
            reported expired by ``finished_writes`` (None: never).
        clock: monotonic seconds, for deadlines and log intervals (tests inject a fake one).
        backpressure_log_interval_s: at most one ``offloader.host_exhausted`` warning per this
            many seconds, carrying the count of writes rejected since the previous one.
    Raises:
        ValueError: pools of different shape or dtype, ``write_timeout_s <= 0`` or a negative
            log interval.
        DeviceMismatch (a ValueError): the copy engine cannot copy from ``kv_pool``'s device (the
            CPU engine and a CUDA pool).

    Observation hooks (attributes, None by default: then they cost one attribute test per call):
    ``observer`` (``lifecycle.metrics.Metrics`` or anything with ``copy_seconds(s)`` and
    ``storage_seconds(op, s)``) times each copy from ``write`` to ``finished_writes`` and each
    storage write; ``events`` (``transfer.kv_events.HostAnnouncer``) announces host pages handed
    to ``write_storage`` and removes them at ``free_host``. The storage tier's own hook is
    ``storage.events``; ``write_storage`` declares the pages' tokens and parent to it.
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
        backpressure_log_interval_s: float = 10.0,
    ) -> None:
        check_compatible(kv_pool, host_pool)
        if write_timeout_s is not None and not write_timeout_s > 0:
            raise ValueError(f"write_timeout_s must be > 0 or None, got {write_timeout_s}")
        if not backpressure_log_interval_s >= 0:
            raise ValueError(f"backpressure_log_interval_s must be >= 0, got {backpressure_log_interval_s}")
        self.write_timeout_s, self._clock = write_timeout_s, clock
        self.kv, self.host, self.storage = kv_pool, host_pool, storage
        self.page_size = host_pool.page_size
        engine = copy_engine if copy_engine is not None else make_copy_engine(kv_pool.device)
        check_pool = getattr(engine, "check_pool", None)
        if check_pool is not None:
            check_pool(kv_pool)  # DeviceMismatch before any worker starts
        self.engine = engine
        self._storage_worker = BackgroundWorker("kv-storage", storage_threads)
        self._writes: dict[int, tuple[list[int], torch.Tensor | np.ndarray]] = {}  # ack -> (host pages, slots)
        self._deadlines: dict[int, float] = {}  # ack -> expiry time, for copies not yet expired
        self._expired_acks: set[int] = set()  # expired (discarded ones included), copy not yet ended
        self._discarded: set[int] = set()  # discarded, not yet reported expired
        self._failed_writes: list[int] = []
        self._ops: dict[int, list[int]] = {}  # storage op -> host pages
        self._op_ids = itertools.count(1)
        self._failed: list[int] = []
        self._landing: set[int] = set()  # host pages a copy is writing
        self._busy: dict[int, int] = {}  # host page -> storage ops reading it
        self._poisoned: set[int] = set()  # host pages holding a failed or expired copy
        # the host indices ``write`` returned, while their pages are held: id -> (the tensor, its
        # version then, its pages), and host page -> that id. ``write_storage`` and ``free_host`` of
        # such a tensor, unchanged since, read its pages from here instead of from its values.
        self._issued: dict[int, _Issued] = {}
        self._issued_page: dict[int, int] = {}
        self._stats = OffloaderStats()
        self._bp_interval = backpressure_log_interval_s
        self._oplog = RateLimitedLog(log, clock=clock)   # per-op failures: one line per event per interval
        self._storage_failing = False   # the last storage op failed (a success then flushes the summary)
        self._bp_next_log = float("-inf")  # clock time after which a rejection may warn again
        self._bp_unlogged = 0  # rejections since the last warning
        self._rejected_run = 0  # writes rejected since the last accepted one
        self._closed = False
        self.observer = None
        self.events = None
        self._submitted: dict[int, float] = {}  # ack -> perf_counter at write (only with an observer)
        self._host_named: dict[int, str] = {}  # host page -> page hash announced (only with events)

    # -- device -> host -----------------------------------------------------------------------
    def write(self, device_indices: torch.Tensor, ack_id: int) -> torch.Tensor | None:
        """See ``Offloader.write``.

        Slot ids in host memory are checked here. Slot ids on a device (``req_to_token`` on CUDA)
        are never read on the calling thread: their shape is checked here, their values where the
        copy runs, and a chunk that is not whole aligned pages inside the pool is a failed copy
        (reported failed by ``finished_writes``), not a ``BadIndices`` (docs/architecture.md, "Streams").

        Raises:
            Closed: after ``close``. UnknownId: ``ack_id`` already pending.
            BadIndices: empty, not whole page-aligned pages, or outside the device pool (slot ids
                on a device: not a 1-D integer tensor of whole pages).
        """
        if self._closed:
            raise Closed("offloader is closed")
        if ack_id in self._writes:
            raise UnknownId(f"ack id {ack_id} is already pending")
        numpy_in = type(device_indices) is np.ndarray  # the manager's ids of a row in host memory
        on_device = not numpy_in and isinstance(device_indices, torch.Tensor) and not on_host(device_indices)
        if on_device:  # never read on the host (no device -> host sync on the scheduler thread)
            check_device_indices(device_indices, self.page_size, "device indices")
            n_pages = device_indices.shape[0] // self.page_size
        else:
            view = as_index_array(device_indices, "device indices")
            n_pages = count_pages(view, self.page_size, "device indices", self.kv.slots)
        if n_pages == 0:
            raise BadIndices("a write needs at least one page")
        pages = self.host.alloc_pages(n_pages)
        if pages is None:
            self._rejected(ack_id, n_pages)
            return None
        if self._rejected_run:
            log.info("offloader.host_recovered", rejected=self._rejected_run)
            self._rejected_run = 0
        # the copy runs later: never read the caller's own buffer then
        if on_device:  # a device-side copy; the values (whole aligned pages in the pool) are checked
            # where the copy runs: a bad chunk fails its copy (reported failed, nothing stored)
            slots, check = device_indices.to(torch.int64, copy=True), {"check_end": self.kv.slots}
        else:  # NumPy ids: the copy plan wraps them on the copy worker, not on this thread
            shared = view is device_indices if numpy_in else device_indices.dtype is torch.int64  # the caller's buffer
            slots, check = (view.copy() if shared else view), {}
        try:
            self.engine.to_host(ack_id, self.kv, self.host, slots, pages, **check)
        except BaseException:
            self.host.free_pages(pages)  # nothing was enqueued: the pages go back, the ack is never reported
            raise
        host_pages = pages.tolist()
        self._writes[ack_id] = (host_pages, slots)
        if self.write_timeout_s is not None:
            self._deadlines[ack_id] = self._clock() + self.write_timeout_s
        self._landing.update(host_pages)
        self._stats.writes += 1
        if self.observer is not None:
            self._submitted[ack_id] = time.perf_counter()
        # page by page in the order the chunk's pages land in them (a pool that places its pages may
        # hand a consecutive set out of order); one ascending run recognised on the Python list
        if numpy_in:  # NumPy in, NumPy out: read-only host indices, no tensor made on this thread
            out = host_slots_array(host_pages, self.page_size)
            version = _READ_ONLY
        else:
            out = slots_of_pages(host_pages, self.page_size)
            version = None if out.is_inference() else out._version  # an inference tensor (vLLM's worker) has none
        if version is not None:
            key = id(out)
            self._issued[key] = _Issued(out, version, host_pages)
            issued_page = self._issued_page
            for p in host_pages:
                issued_page[p] = key
        return out

    def _issued_pages(self, host_indices) -> list[int] | None:
        """The pages of host indices ``write`` returned and nobody changed since (their pages still
        held), or None: any other tensor, whose values are read and checked."""
        entry = self._issued.get(id(host_indices))
        if entry is not None and entry.tensor is host_indices:
            if entry.version == _READ_ONLY:  # NumPy host indices: unchanged while still read-only
                if not host_indices.flags.writeable:
                    return entry.pages
            elif host_indices._version == entry.version:
                return entry.pages
        return None

    def _rejected(self, ack_id: int, n_pages: int) -> None:
        """Count a write refused for want of host pages; warn at most once per interval."""
        self._stats.writes_rejected += 1
        self._rejected_run += 1
        self._bp_unlogged += 1
        now = self._clock()
        if now >= self._bp_next_log:
            log.warning("offloader.host_exhausted", ack_id=ack_id, pages=n_pages,
                        rejected=self._bp_unlogged, rejected_total=self._stats.writes_rejected,
                        host_free_pages=self.host.available_size() // self.page_size,
                        next_warning_after_s=self._bp_interval)
            self._bp_unlogged = 0
            self._bp_next_log = now + self._bp_interval

    def finished_writes(self) -> WriteReport:
        """See ``Offloader.finished_writes``. A copy that raised, or that had expired, is reported
        failed and its pages poisoned: a later ``write_storage`` of them fails without writing.
        Deadlines are checked first, then the copies that ended: an ack past its deadline (or
        discarded) and ended by this poll is in ``expired`` and ``failed`` of the same report."""
        expired = self._poll_expired() if self._deadlines else None
        ended = self._poll_ended()
        failed = self._failed_writes
        if failed:
            self._failed_writes = []
            bad = set(failed)
            ended = [a for a in ended if a not in bad]
        elif not ended and not expired:
            return EMPTY_REPORT
        else:
            failed = []  # never the live list: a report is not changed by later polls
        return WriteReport(ended, failed, expired or [])

    def _poll_ended(self) -> list[int]:
        """Acks whose copy ended since the last poll (the failed ones too)."""
        out = []
        for done in self.engine.poll():
            tag = done.tag
            pages = self._writes.pop(tag)[0]
            self._landing.difference_update(pages)
            if self._deadlines:
                self._deadlines.pop(tag, None)
            if done.error is not None or tag in self._expired_acks or (self._discarded and tag in self._discarded):
                self._landed_bad(tag, pages, done.error)
            if self._submitted:
                t = self._submitted.pop(tag, None)
                if t is not None and self.observer is not None:
                    self.observer.copy_seconds(time.perf_counter() - t)
            self._stats.writes_landed += 1
            out.append(tag)
        return out

    def _landed_bad(self, tag: int, pages: list[int], error: BaseException | None) -> None:
        expired = tag in self._expired_acks
        self._expired_acks.discard(tag)
        self._discarded.discard(tag)  # discarded and ended before a poll reported it expired
        self._poisoned.update(pages)
        if error is not None:
            self._stats.copy_failures += 1
            self._oplog.error("offloader.copy_failed", ack_id=tag, expired=expired, error=repr(error))
        else:
            self._oplog.warning("offloader.expired_copy_ended", ack_id=tag)
        self._failed_writes.append(tag)

    def _poll_expired(self) -> list[int]:
        """Acks whose copy passed ``write_timeout_s`` since submission without finishing (or was
        discarded), since the last poll; each once. The copy may still be reading its device
        slots: the same ack is reported failed when it ends."""
        out = []
        if not self._deadlines:
            return out
        now = self._clock()
        for ack, deadline in list(self._deadlines.items()):
            if now >= deadline:
                del self._deadlines[ack]
                self._expired_acks.add(ack)
                pages = self._writes[ack][0]
                self._poisoned.update(pages)
                if ack in self._discarded:  # counted and logged by discard_write
                    self._discarded.discard(ack)
                else:
                    self._stats.copy_expired += 1
                    self._oplog.error("offloader.copy_expired", ack_id=ack, timeout_s=self.write_timeout_s,
                              pages=len(pages))
                out.append(ack)
        return out

    def discard_write(self, ack_id: int) -> None:
        """The caller gave up on a copy still in flight (its device slots are being freed under it,
        by someone else): whatever it lands is worthless. The copy is not cancelled (it cannot be):
        it is expired at once — reported expired by the next ``finished_writes``, its host pages
        poisoned (never stored) — and when it ends it is reported failed, as an expired copy is. Counted in ``copies_discarded`` (not in
        ``copy_expired``); a second call for the same ack changes nothing.

        Raises:
            UnknownId: ``ack_id`` is not a copy in flight (never written, or already reported).
        """
        entry = self._writes.get(ack_id)
        if entry is None:
            raise UnknownId(f"ack id {ack_id} is not a copy in flight")
        if ack_id in self._expired_acks or ack_id in self._discarded:
            return
        self._deadlines[ack_id] = float("-inf")  # expired at the next finished_writes
        self._discarded.add(ack_id)
        self._poisoned.update(entry[0])
        self._stats.copies_discarded += 1
        log.warning("offloader.copy_discarded", ack_id=ack_id, pages=len(entry[0]))

    def expire(self, ack_ids: Sequence[int]) -> list[int]:
        """``discard_write`` for each of ``ack_ids`` still in flight and not yet expired or
        discarded (the others are skipped): the caller stops waiting for them now, before any
        deadline, because the device slots they read are being freed by someone else.

        Returns:
            The ids discarded by this call.
        """
        done = []
        for ack in ack_ids:
            if ack in self._writes and ack not in self._expired_acks and ack not in self._discarded:
                self.discard_write(ack)
                done.append(ack)
        return done

    # -- host -> storage ----------------------------------------------------------------------
    def write_storage(
        self, host_indices: torch.Tensor, tokens: Sequence[int], page_hashes: Sequence[str],
        parent_hash: str | None = None,
    ) -> int:
        """See ``Offloader.write_storage``. ``parent_hash``: the page before the first one (for KV
        events; None: the first page of a prompt, or unknown).

        Raises:
            Closed: after ``close``. BadIndices: host indices not whole pages of the pool, or a
            count mismatch among pages, tokens and hashes. NotAllocated: host pages not held.
            TransferError: a page's device -> host copy has not landed yet.
        """
        if self._closed:
            raise Closed("offloader is closed")
        plist = self._issued_pages(host_indices)
        if plist is None:
            pages = self.host.page_ids(host_indices)
            n = pages.shape[0]
        else:
            n = len(plist)
        if len(page_hashes) != n or len(tokens) != n * self.page_size:
            raise BadIndices(
                f"{n} host pages, {len(page_hashes)} hashes, {len(tokens)} tokens (page size {self.page_size})"
            )
        if any(not isinstance(h, str) or not h for h in page_hashes):
            raise BadIndices("page hashes must be non-empty strings")
        if plist is None:
            if n and not self.host.is_held(pages):
                raise NotAllocated("host pages passed to write_storage are not allocated")
            plist = pages.tolist()
        if not self._landing.isdisjoint(plist):
            raise TransferError("write_storage of host pages whose copy has not landed")
        op = next(self._op_ids)
        keys = list(page_hashes)
        if not self._poisoned.isdisjoint(plist):
            self._oplog.error("offloader.store_refused", op_id=op, reason="host pages hold a failed or expired copy")

            def job() -> list[bool]:
                raise StorageError("source host pages hold a failed or expired copy")
        else:
            job = self._storage_job(keys, plist, tokens, parent_hash)
            if self.events is not None:
                self.events.stored(keys, tokens, parent_hash)
                self._host_named.update(zip(plist, keys))
        busy = self._busy
        for p in plist:
            busy[p] = busy.get(p, 0) + 1
        self._ops[op] = plist
        self._storage_worker.submit(op, job)
        self._stats.storage_ops += 1
        return op

    def _storage_job(self, keys: list[str], plist: list[int], tokens: Sequence[int], parent_hash: str | None):
        """The storage worker's job: the page views are made there, not on the scheduler thread."""
        store, observer, tier, page_bytes = self.storage, self.observer, self.storage.events, self.host.page_bytes
        if observer is None and tier is None:
            return lambda: store.batch_set(keys, [page_bytes(p) for p in plist])
        tokens = list(tokens)

        def job() -> list[bool]:
            t = time.perf_counter()
            try:
                bufs = [page_bytes(p) for p in plist]
                if tier is None:
                    return store.batch_set(keys, bufs)
                with tier.writing(keys, tokens, parent_hash):
                    return store.batch_set(keys, bufs)
            finally:
                if observer is not None:
                    observer.storage_seconds("set", time.perf_counter() - t)
        return job

    def finished_storage(self) -> list[int]:
        """See ``Offloader.finished_storage``; failed ops are also listed by ``failed_storage``."""
        out = []
        busy = self._busy
        for done in self._storage_worker.poll():
            pages = self._ops.pop(done.tag)
            for p in pages:
                left = busy[p] - 1
                if left:
                    busy[p] = left
                else:
                    del busy[p]
            ok = done.error is None and all(done.value)
            if ok:
                self._stats.storage_ok += 1
                self._stats.pages_stored += len(pages)
                if self._storage_failing:   # the outage is over: its summary now
                    self._storage_failing = False
                    self._oplog.flush()
            else:
                self._stats.storage_failed += 1
                self._failed.append(done.tag)
                self._storage_failing = True
                self._oplog.warning("offloader.storage_failed", op_id=done.tag,
                            error=repr(done.error) if done.error else "page write failed")
            out.append(done.tag)
        return out

    def failed_storage(self) -> list[int]:
        """Op ids reported failed by ``finished_storage`` since the last call."""
        out, self._failed = self._failed, []
        return out

    def free_host(self, host_indices: torch.Tensor | list[torch.Tensor]) -> None:
        """See ``Offloader.free_host``: one tensor of host indices, or a list of them (several
        ops' pages in one call; a list with none frees nothing).

        Raises:
            BadIndices: not whole pages of the pool. HostPagesBusy: a copy or storage op still
            uses a page. DoubleFree / NotAllocated: pages not held. On any error nothing changes.
        """
        plist = []
        for t in host_indices if type(host_indices) is list else (host_indices,):
            pages = self._issued_pages(t)  # None: not what ``write`` returned, or changed since: checked by value
            plist += self.host.page_list(t) if pages is None else pages
        if not (self._landing.isdisjoint(plist) and self._busy.keys().isdisjoint(plist)):
            raise HostPagesBusy("host pages are still used by an in-flight copy or storage op")
        self.host.free_pages(plist)
        issued, issued_page = self._issued, self._issued_page
        for p in plist:
            key = issued_page.pop(p, None)
            if key is not None:
                issued.pop(key, None)
        if self._poisoned:
            self._poisoned.difference_update(plist)
        if self._host_named:
            named = self._host_named
            gone = [named.pop(p) for p in plist if p in named]
            if gone and self.events is not None:
                self.events.removed(gone)

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

    def close(self, timeout: float | None = DEFAULT_CLOSE_TIMEOUT_S) -> CloseReport:
        """Refuse new work and drain, waiting at most ``timeout`` seconds in all (default
        ``DEFAULT_CLOSE_TIMEOUT_S``; None waits without bound). Queued copies and storage ops run
        to completion if they can; their ids stay pollable. Idempotent.

        A copy or storage op still running at the deadline is abandoned (it cannot be
        cancelled): the report lists it with the device slots it may still read and the host
        pages it may still write, which stay quarantined, and ``offloader.close_timed_out`` is
        logged at ERROR.

        Returns:
            What was left behind (``clean`` when nothing).
        Raises:
            ValueError: ``timeout`` negative or not a number.
        """
        check_timeout(timeout)
        self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
        left = lambda: None if deadline is None else max(0.0, deadline - time.monotonic())  # noqa: E731
        self.engine.close(left())
        self._storage_worker.close(left())
        report = self._close_report(timeout)
        self._oplog.flush()
        if not report.clean:
            log.error("offloader.close_timed_out", timeout=timeout, in_flight_writes=len(report.abandoned_writes),
                      in_flight_storage=len(report.abandoned_storage), abandoned_writes=report.abandoned_writes,
                      host_pages=report.host_pages,
                      device_slots=len(report.device_slots) + report.device_slots_unread,
                      reason=report.reason)
        return report

    def _close_report(self, timeout: float | None) -> CloseReport:
        stuck = sorted(t for t in self.engine.unfinished() if t in self._writes)
        ops = sorted(t for t in self._storage_worker.unfinished() if t in self._ops)
        if not stuck and not ops:
            return CloseReport(clean=True, timeout=timeout)
        host = sorted(p for t in stuck for p in self._writes[t][0])
        ids = [self._writes[t][1] for t in stuck]
        # slot ids on a device are never read here (a read waits for the device, which may be what
        # is stuck, and can raise): counted, not listed
        dev = sorted({s for t in ids if isinstance(t, np.ndarray) or on_host(t) for s in t.tolist()})
        unread = sum(t.numel() for t in ids if not isinstance(t, np.ndarray) and not on_host(t))
        busy = sorted({p for t in ops for p in self._ops[t]})
        on_dev = f" (and {unread} slot ids on the device, not read)" if unread else ""
        reason = (f"close timed out after {timeout}s: {len(stuck)} device->host copies and {len(ops)} "
                  f"storage ops still running (cannot be cancelled); device slots {len(dev)}{on_dev} stay "
                  f"quarantined (a copy may still read them), host pages {host + busy} are never "
                  f"returned to the pool")
        return CloseReport(clean=False, timeout=timeout, abandoned_writes=stuck, device_slots=dev,
                           host_pages=host, abandoned_storage=ops, reason=reason, device_slots_unread=unread)
