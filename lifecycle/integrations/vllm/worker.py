"""The worker side of the store path: the scheduler's ``jobs`` run on our transfer stack.

Each rank holds vLLM's KV (``layout.VllmKVLayout``), a page-first host pool and the storage tier,
and runs a ``transfer.HostOffloader`` over them, unchanged: its copy engine copies vLLM blocks into
host pages (``LayoutCpuCopyEngine`` on the CPU, ``LayoutCudaCopyEngine`` on a stream of its own
that waits for the forward on CUDA), its storage worker writes pages to the tier, and its
expiry (``write_timeout_s``) turns a stuck copy into a miss. The host pages are the scheduler's
choice (``PlacedHostPool``: the offloader's allocation takes exactly the pages the job names), so
every rank's pool holds what the scheduler's accounting says.

``StoreWorker.run(jobs)`` executes one step's ops in order; ``fence(requests)`` blocks until the
copies reading preempted requests' blocks have ended (bounded: past ``fence_timeout_s`` they are
discarded — their pages are never stored — and the wait ends); ``report()`` returns what ended
since the last report; ``finished_sending()`` the delayed requests whose copies have all ended (or
expired) on this rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from lifecycle.integrations.vllm.jobs import Free, Report, StepJobs, Store, Write
from lifecycle.integrations.vllm.layout import VllmKVLayout
from lifecycle.log import get_logger
from transfer.copy_engine import CpuCopyEngine, CudaCopyEngine
from transfer.errors import BadIndices, DoubleFree, NotAllocated
from transfer.host_offloader import HostOffloader
from transfer.host_pool import HostPool
from transfer.indices import slots_of_pages
from transfer.shutdown import CloseReport
from transfer.storage.base import Storage

log = get_logger("lifecycle.integrations.vllm.worker")


class _PlacedPages:
    """A host pool's page accounting where the pages to hand out are named by the caller
    (``place``), as the scheduler chose them; the ``PageSet`` calls ``HostPool`` makes."""

    def __init__(self, n: int) -> None:
        self.total = n
        self._held = np.zeros(n, dtype=bool)
        self.next: np.ndarray | None = None

    def free_count(self) -> int:
        return self.total - int(self._held.sum())

    def held_count(self) -> int:
        return int(self._held.sum())

    def alloc(self, n_pages: int) -> np.ndarray | None:
        pages, self.next = self.next, None
        if pages is None or pages.shape[0] != n_pages:
            raise BadIndices(f"{n_pages} host pages asked for, {None if pages is None else pages.shape[0]} placed")
        if (pages < 0).any() or (pages >= self.total).any():
            raise BadIndices(f"placed host pages outside 0..{self.total - 1}")
        if self._held[pages].any() or np.unique(pages).shape[0] != pages.shape[0]:
            raise DoubleFree(f"placed host pages {pages[self._held[pages]].tolist()[:8]} are held")
        self._held[pages] = True
        return pages

    def _checked(self, pages: np.ndarray) -> np.ndarray:
        pages = np.unique(np.asarray(pages, dtype=np.int64))
        if pages.shape[0] and (pages[0] < 0 or pages[-1] >= self.total):
            raise BadIndices(f"host pages outside 0..{self.total - 1}")
        if not self._held[pages].all():
            raise NotAllocated(f"host pages {pages[~self._held[pages]].tolist()[:8]} are not held")
        return pages

    def check_free(self, pages: np.ndarray) -> None:
        self._checked(pages)

    def free(self, pages: np.ndarray) -> int:
        pages = self._checked(pages)
        self._held[pages] = False
        return pages.shape[0]

    def is_held(self, pages: np.ndarray) -> bool:
        return bool(self._held[np.asarray(pages, dtype=np.int64)].all())

    def check_integrity(self) -> None:
        return None


class PlacedHostPool(HostPool):
    """A ``HostPool`` whose next allocation takes the pages given to ``place`` (the scheduler's)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pages = _PlacedPages(self.num_pages)

    def place(self, pages: list[int]) -> None:
        self._pages.next = np.asarray(pages, dtype=np.int64)

    @classmethod
    def for_layout(cls, layout: VllmKVLayout, pages: int, **kwargs) -> "PlacedHostPool":
        return cls(layout.layers, layout.heads, layout.head_dim, layout.dtype, layout.block_size,
                   pages * layout.block_size, **kwargs)


def _blocks(slots: torch.Tensor, page_size: int) -> list[int]:
    return (slots[::page_size] // page_size).tolist()


class LayoutCpuCopyEngine(CpuCopyEngine):
    """``CpuCopyEngine`` whose device pool is a ``VllmKVLayout`` (blocks copied whole, any layout)."""

    def to_host(self, tag, kv: VllmKVLayout, host: HostPool, slots: torch.Tensor, host_pages: torch.Tensor,
                check_end: int | None = None) -> None:
        self.check_pool(kv)
        blocks, pages = _blocks(slots, kv.block_size), host_pages.tolist()
        self.submit(tag, lambda: kv.to_host(blocks, host, pages))

    def to_device(self, tag, kv: VllmKVLayout, host: HostPool, slots: torch.Tensor, host_pages: torch.Tensor,
                  check_end: int | None = None) -> None:
        self.check_pool(kv)
        blocks, pages = _blocks(slots, kv.block_size), host_pages.tolist()
        self.submit(tag, lambda: kv.from_host(host, pages, blocks))


class LayoutCudaCopyEngine(CudaCopyEngine):
    """``CudaCopyEngine`` (its own stream, waiting on the forward's) over a ``VllmKVLayout``."""

    def to_host(self, tag, kv: VllmKVLayout, host: HostPool, slots: torch.Tensor, host_pages: torch.Tensor,
                check_end: int | None = None) -> None:
        self.check_pool(kv)
        blocks, pages = _blocks(slots, kv.block_size), host_pages.tolist()
        self.submit(tag, lambda: kv.to_host(blocks, host, pages, non_blocking=True))

    def to_device(self, tag, kv: VllmKVLayout, host: HostPool, slots: torch.Tensor, host_pages: torch.Tensor,
                  check_end: int | None = None) -> None:
        self.check_pool(kv)
        blocks, pages = _blocks(slots, kv.block_size), host_pages.tolist()
        self.submit(tag, lambda: kv.from_host(host, pages, blocks, non_blocking=True))


def make_copy_engine(layout: VllmKVLayout, threads: int = 2):
    """The stream engine for KV on CUDA, worker threads for KV in host memory."""
    if layout.device.type == "cuda" and torch.cuda.is_available():
        return LayoutCudaCopyEngine(layout.device)
    return LayoutCpuCopyEngine(threads)


class StoreWorker:
    """One rank's executor of the scheduler's store jobs (see the module docstring).

    Args:
        layout: vLLM's KV on this rank.
        host: this rank's host pool (a ``PlacedHostPool`` of the scheduler's page count).
        storage: this rank's storage tier.
        write_timeout_s: a copy not ended this long after submission is expired (a miss).
        fence_timeout_s: the most a preemption fence waits before discarding the copies.
        copy_engine: default ``make_copy_engine(layout)``.
        events: collect the tier's KV events into the reports (TP rank 0).
    """

    def __init__(self, layout: VllmKVLayout, host: PlacedHostPool, storage: Storage, *,
                 write_timeout_s: float | None = 30.0, fence_timeout_s: float = 30.0,
                 copy_engine=None, clock: Callable[[], float] = time.monotonic, events: bool = False) -> None:
        self.layout, self.host, self.storage = layout, host, storage
        self.page_size = layout.block_size
        self.offloader = HostOffloader(layout, host, storage, copy_engine=copy_engine or make_copy_engine(layout),
                                       write_timeout_s=write_timeout_s, clock=clock)
        self.fence_timeout_s = fence_timeout_s
        self._inflight: dict[int, str] = {}       # ack -> request, copies submitted and not ended here
        self._expired: set[int] = set()           # acks expired here, not yet ended
        self._ops: dict[int, int] = {}            # offloader op id -> scheduler op id
        self._waiting: dict[str, set[int]] = {}   # delayed request -> acks still reading its blocks
        self._ready: set[str] = set()             # delayed requests whose copies ended here
        self._report = Report()
        self.fences = 0
        self.fence_discarded = 0
        self.fencing = False   # a preemption fence is waiting (tests release held copies on it)
        self.events = None
        if events:  # rank 0 reports its tier's KV events (``events``)
            from lifecycle.integrations.vllm.events import attach

            self.events = attach(storage, self.page_size)

    # --- one step ---------------------------------------------------------------------------------
    def run(self, jobs: StepJobs) -> None:
        """Execute ``jobs.ops`` in order, then register ``jobs.delayed``. A write the offloader
        refuses is reported failed (never lost); a store it refuses, failed."""
        for op in jobs.ops:
            if type(op) is Write:
                self._write(op)
            elif type(op) is Store:
                self._store(op)
            elif type(op) is Free:
                self.offloader.free_host(slots_of_pages(np.asarray(op.host_pages, dtype=np.int64), self.page_size))
        for req_id, acks in jobs.delayed.items():
            left = {a for a in acks if a in self._inflight and a not in self._expired}
            if left:
                self._waiting[req_id] = left
            else:
                self._ready.add(req_id)

    def _write(self, op: Write) -> None:
        slots = self.layout.slots_of(op.blocks)
        self.host.place(op.host_pages)
        try:
            got = self.offloader.write(slots, op.ack)
        except Exception as err:  # noqa: BLE001 - a refused copy is a miss, reported failed
            self.host._pages.next = None
            log.error("vllm.copy_refused", ack_id=op.ack, rid=op.req_id, error=repr(err))
            self._count("ended", op.ack)
            self._count("failed", op.ack)
            if not self.host.is_held(np.asarray(op.host_pages, dtype=np.int64)):
                self.host.place(op.host_pages)  # the scheduler frees them when told: held until then
                self.host.alloc_pages(len(op.host_pages))
            return
        if got is None:  # cannot happen with placed pages; reported failed all the same
            self._count("ended", op.ack)
            self._count("failed", op.ack)
            return
        self._inflight[op.ack] = op.req_id

    def _store(self, op: Store) -> None:
        host = slots_of_pages(np.asarray(op.host_pages, dtype=np.int64), self.page_size)
        try:
            mine = self.offloader.write_storage(host, op.tokens, op.keys, op.parent)
        except Exception as err:  # noqa: BLE001 - a refused store is a miss
            log.error("vllm.store_refused", op_id=op.op, error=repr(err))
            self._count("stored", op.op)
            self._count("store_failed", op.op)
            return
        self._ops[mine] = op.op

    def fence(self, requests: dict[str, list[int]]) -> None:
        """Block until every copy in ``requests`` (preempted requests: vLLM has freed their blocks
        and the next forward may overwrite them) has ended on this rank; past ``fence_timeout_s``
        the rest are discarded (never stored) and the wait ends."""
        acks = {a for v in requests.values() for a in v}
        self.poll()
        left = [a for a in acks if a in self._inflight]
        if not left:
            return
        self.fences += 1
        deadline = time.monotonic() + self.fence_timeout_s
        self.fencing = True
        try:
            while left:
                if time.monotonic() >= deadline:
                    self.fence_discarded += len(left)
                    log.error("vllm.fence_timed_out", acks=sorted(left), waited_s=self.fence_timeout_s,
                              why="preempted request's blocks may be reused while these copies read them: discarded")
                    self.offloader.expire(left)
                    self.poll()
                    return
                time.sleep(0.0005)
                self.poll()
                left = [a for a in left if a in self._inflight]
        finally:
            self.fencing = False

    def poll(self) -> None:
        """Collect what the offloader reports into the next ``report``."""
        off = self.offloader
        wr = off.finished_writes()
        for ack in wr.expired:
            self._expired.add(ack)
            self._count("expired", ack)
            self._settle_delayed(ack)
        for ack in wr.failed:
            self._count("failed", ack)
        for ack in wr.landed + wr.failed:
            self._count("ended", ack)
            self._inflight.pop(ack, None)
            self._expired.discard(ack)
            self._settle_delayed(ack)
        done = off.finished_storage()
        if done:
            bad = set(off.failed_storage())
            for mine in done:
                op = self._ops.pop(mine)
                self._count("stored", op)
                if mine in bad:
                    self._count("store_failed", op)

    def _settle_delayed(self, ack: int) -> None:
        if not self._waiting:
            return
        for req_id in [r for r, acks in self._waiting.items() if ack in acks]:
            acks = self._waiting[req_id]
            acks.discard(ack)
            if not acks:
                del self._waiting[req_id]
                self._ready.add(req_id)

    def _count(self, what: str, key: int) -> None:
        d = getattr(self._report, what)
        d[key] = d.get(key, 0) + 1

    def report(self) -> Report | None:
        """Completions since the last report (None: nothing)."""
        self.poll()
        if self.events is not None:
            self._report.events.extend(self.events.take())
        if self._report.empty():
            return None
        out, self._report = self._report, Report()
        return out

    def finished_sending(self) -> set[str]:
        """Delayed requests whose copies all ended (or expired) on this rank since the last call."""
        self.poll()
        out, self._ready = self._ready, set()
        return out

    def idle(self) -> bool:
        return not self._inflight and not self._ops

    def close(self, timeout: float | None = 5.0) -> CloseReport:
        report = self.offloader.close(timeout)
        self.poll_closed()
        return report

    def poll_closed(self) -> None:
        try:
            self.poll()
        except Exception:  # noqa: BLE001 - after close, polling is best effort
            pass


__all__ = ["LayoutCpuCopyEngine", "LayoutCudaCopyEngine", "PlacedHostPool", "StoreWorker", "make_copy_engine"]
