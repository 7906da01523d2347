"""The scheduler side's ``transfer.Offloader``: decides host pages and ids, moves no bytes.

vLLM's scheduler and its workers are different processes (and one worker per TP rank): the
``DecodeOffloadManager`` runs on the scheduler, the copies on the workers. ``ProxyOffloader`` is the
manager's offloader there: ``write`` allocates the host pages (a ``transfer.page_set.PageSet`` the
size of each worker's host pool) and records a ``jobs.Write``; ``write_storage`` a ``jobs.Store``;
``free_host`` a ``jobs.Free``; ``take_jobs`` hands the ordered list to ``build_connector_meta``.
Completions come back in the workers' ``jobs.Report`` (``absorb``): a copy has ended when every
rank saw it end (failed when any rank's failed), expired as soon as one rank stopped waiting for
it; a storage op has finished when every rank's has. ``finished_writes`` / ``finished_storage``
report them to the manager exactly once, as the ``Offloader`` contract says.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from lifecycle.integrations.vllm.jobs import Free, Report, Store, Write
from transfer.errors import BadIndices, Closed, UnknownId
from transfer.indices import as_index_array, as_index_tensor, pages_of_slots, slots_of_pages
from transfer.offloader import EMPTY_REPORT, WriteReport
from transfer.page_set import PageSet


class _Slots:
    """What the manager reads of a device pool (``lifecycle.release.slot_end``)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots


class ProxyOffloader:
    """See the module docstring.

    Args:
        page_size: tokens per page (vLLM's block size).
        host_pages: pages of each worker's host pool.
        device_slots: vLLM's KV slots (``num_blocks * block_size``).
        world: ranks that report (each copy and op must be reported by all of them).
    """

    def __init__(self, page_size: int, host_pages: int, device_slots: int, world: int = 1) -> None:
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        self.page_size, self.world = page_size, world
        self.kv = _Slots(device_slots)
        self.pages = PageSet(host_pages)
        self.num_pages = host_pages
        self.req_id: str | None = None  # the request whose chunk the manager is about to write
        self._ops: list = []
        self._ids = itertools.count(1)
        self._writes: dict[int, tuple[str, list[int]]] = {}  # ack -> (req id, host pages)
        self._ended: dict[int, int] = {}
        self._failed_any: set[int] = set()
        self._expired_told: set[int] = set()
        self._landed: list[int] = []
        self._failed: list[int] = []
        self._expired: list[int] = []
        self._ops_open: dict[int, int] = {}  # storage op -> ranks reported
        self._stored: list[int] = []
        self._store_failed: set[int] = set()
        self._closed = False
        self.rejected = 0

    # --- the Offloader protocol (the manager's calls) --------------------------------------------
    def write(self, device_indices: torch.Tensor | np.ndarray, ack_id: int) -> torch.Tensor | None:
        if self._closed:
            raise Closed("offloader is closed")
        if ack_id in self._writes:
            raise UnknownId(f"ack id {ack_id} is already pending")
        blocks = pages_of_slots(as_index_array(device_indices, "device indices"), self.page_size, "device indices",
                                self.kv.slots)
        if blocks.shape[0] == 0:
            raise BadIndices("a write needs at least one page")
        pages = self.pages.alloc(blocks.shape[0])
        if pages is None:
            self.rejected += 1
            return None
        plist = pages.tolist()
        self._writes[ack_id] = (self.req_id or "", plist)
        self._ops.append(Write(ack_id, self.req_id or "", blocks.tolist(), plist))
        return slots_of_pages(pages, self.page_size, ascending=True)

    def finished_writes(self) -> WriteReport:
        if not (self._landed or self._failed or self._expired):
            return EMPTY_REPORT
        report = WriteReport(self._landed, self._failed, self._expired)
        self._landed, self._failed, self._expired = [], [], []
        return report

    def write_storage(self, host_indices: torch.Tensor, tokens: Sequence[int], page_hashes: Sequence[str],
                      parent_hash: str | None = None) -> int:
        if self._closed:
            raise Closed("offloader is closed")
        pages = self._host_pages(host_indices)
        if len(page_hashes) != len(pages) or len(tokens) != len(pages) * self.page_size:
            raise BadIndices(f"{len(pages)} host pages, {len(page_hashes)} hashes, {len(tokens)} tokens")
        op = next(self._ids)
        self._ops_open[op] = 0
        self._ops.append(Store(op, pages, list(page_hashes), [int(t) for t in tokens], parent_hash))
        return op

    def finished_storage(self) -> list[int]:
        out, self._stored = self._stored, []
        return out

    def failed_storage(self) -> set[int]:
        """Ops reported (by ``finished_storage``) that failed on some rank."""
        out, self._store_failed = self._store_failed, set()
        return out

    def free_host(self, host_indices: torch.Tensor | list[torch.Tensor]) -> None:
        if type(host_indices) is list:  # several ops' pages in one call (``Offloader.free_host``)
            pages = [p for t in host_indices for p in self._host_pages(t)]
        else:
            pages = self._host_pages(host_indices)
        self.pages.free(np.asarray(pages, dtype=np.int64))
        self._ops.append(Free(pages))

    def expire(self, ack_ids: Sequence[int]) -> list[int]:
        """Nothing to discard here: the workers decide expiry (``write_timeout_s``)."""
        return []

    def close(self, timeout: float | None = None) -> None:
        self._closed = True

    # --- the connector's calls -------------------------------------------------------------------
    def take_jobs(self) -> list:
        """The ops recorded since the last call, in order."""
        ops, self._ops = self._ops, []
        return ops

    def absorb(self, report: Report) -> None:
        """The workers' completions (aggregated over ranks by vLLM, maybe over several steps)."""
        for ack, n in report.expired.items():
            if ack in self._writes and ack not in self._expired_told:
                self._expired_told.add(ack)
                self._expired.append(ack)
        for ack, n in report.failed.items():
            if ack in self._writes:
                self._failed_any.add(ack)
        for ack, n in report.ended.items():
            if ack not in self._writes or not self._every_rank(self._ended, ack, n):
                continue
            self._writes.pop(ack)
            self._expired_told.discard(ack)
            if ack in self._failed_any:
                self._failed_any.discard(ack)
                self._failed.append(ack)
            else:
                self._landed.append(ack)
        for op, n in report.store_failed.items():
            if op in self._ops_open:
                self._store_failed.add(op)
        for op, n in report.stored.items():
            if op in self._ops_open and self._every_rank(self._ops_open, op, n):
                self._stored.append(op)

    def _every_rank(self, counts: dict, key: int, n: int) -> bool:
        """Count ``n`` more ranks reporting ``key`` ended; True (and ``key`` dropped from ``counts``)
        once every rank has."""
        seen = counts.get(key, 0) + n
        if seen < self.world:
            counts[key] = seen
            return False
        counts.pop(key, None)
        return True

    def in_flight(self, req_id: str) -> list[int]:
        """Acks of ``req_id``'s copies not yet reported ended by every rank."""
        return [a for a, (r, _) in self._writes.items() if r == req_id]

    def idle(self) -> bool:
        return not self._writes and not self._ops_open

    def live_work(self) -> bool:
        """Work whose completion can still be waited for: copies not expired, storage ops open."""
        return bool(self._ops_open) or any(a not in self._expired_told for a in self._writes)

    def _host_pages(self, host_indices) -> list[int]:
        slots = as_index_tensor(host_indices, "host indices")
        return pages_of_slots(slots.numpy(), self.page_size, "host indices", self.num_pages * self.page_size).tolist()


__all__ = ["ProxyOffloader"]
