"""The release seam: what freeing a request means (``ReleasePlan``) and who does it (``ReleaseSink``).

The manager's one free path plans a release completely — the slot ids and the row — checks the
plan itself (``plan_release``) and through the sink (``ReleaseSink.check``), and only then hands it
to the sink (``ReleaseSink.free``), once. A refused plan changes nothing; a retry after the
scheduler repaired the cause frees everything exactly once.

``AllocatorReleaseSink`` (the default) frees through a ``token_to_kv_pool_allocator`` and a
``req_to_token_pool``; an integration with its own bookkeeping (SGLang's radix tree, for one)
passes its own sink: ``DecodeOffloadManager(..., release_sink=sink)``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import msgspec
import numpy as np
import torch

from lifecycle.errors import InvalidRequest, LifecycleError
from lifecycle.records import ReleaseCheck
from transfer.gather import check_ids_on_device
from transfer.indices import on_host
from lifecycle.slots import check_slots, probe_of


class ReleaseRefused(InvalidRequest):
    """A release sink cannot execute a plan (a slot not allocated, a row not held, ...)."""


class ReleasePlan(msgspec.Struct, frozen=True, gc=False):
    """Everything one release frees, validated before anything is freed.

    Attributes:
        req: the scheduler's request being released.
        rid: its id.
        row: its ``req_to_token`` row (freed after the slots).
        ranges: the token ranges of the row being freed: ``(0, committed)`` when ``committed > 0``
            and the speculative over-allocation ``(ceil_to_alloc_page(committed), allocated)``
            when non-empty, as ``(start, end)`` tuples.
        slots: int64 tensor of the slot ids those ranges hold, sorted and unique, minus slots held
            in quarantine by an expired copy (those are freed when the copy ends); for a row on a
            device, the ids as the row lists them, on that device (see ``plan_release``).
        committed: KV tokens committed (``effective_kv_committed_len()`` or ``kv_committed_len``).
        allocated: KV slots allocated (``kv.kv_allocated_len``).
        quarantined: how many of the ranges' slots were left out because a stuck copy may read them.
        device_check: for a row on a device (not read on the host), the device-side check of
            ``slots`` issued with the plan (``lifecycle.records.ReleaseCheck``), read at a later
            progress check; None for a row checked on the host.
    """

    req: object
    rid: object
    row: int
    ranges: tuple
    slots: object  # torch.Tensor (int64)
    committed: int
    allocated: int
    quarantined: int = 0
    device_check: object = None  # ReleaseCheck (device rows)


@runtime_checkable
class ReleaseSink(Protocol):
    """Executes release plans. Called from the scheduler thread, inside the manager's call.

    Contract:
        * ``check(plan)`` raises a ``LifecycleError`` subclass (``ReleaseRefused``) when the plan
          cannot be executed (a slot not allocated, the row not held, ...) and changes nothing.
        * ``free(plan)`` frees every slot of ``plan.slots`` and the row in one call (a page shared
          by the two ranges is freed once), then marks the request's row as gone the way the
          scheduler expects (``req.kv.req_pool_idx = None`` for SGLang's pool). The manager calls
          it only after ``check(plan)`` passed, at most once per plan.
    """

    def check(self, plan: ReleasePlan) -> None: ...

    def free(self, plan: ReleasePlan) -> bool | None: ...
    # returns False when it freed nothing because the scheduler frees this request's KV itself:
    # slots quarantined by an expired copy then stay the scheduler's (never freed by the manager)


class AllocatorReleaseSink:
    """Frees slots through ``token_to_kv_pool_allocator.free(indices)`` and the row through
    ``req_to_token_pool.free(req)``.

    ``check`` asks the pools when they can tell (optional methods ``allocator.check_free(indices)``
    and ``req_to_token_pool.check_free(req)``, which raise and change nothing when a free would
    fail; ``transfer.PagedTokenAllocator`` and ``transfer.ReqToTokenPool`` have them); pools
    without them are trusted.
    """

    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self._check_slots = probe_of(token_to_kv_pool_allocator, "check_free")
        self._check_row = probe_of(req_to_token_pool, "check_free")
        self._checks = self._check_slots is not None or self._check_row is not None

    def check(self, plan: ReleasePlan) -> None:
        """Raises ReleaseRefused when a pool says the plan's slots or row cannot be freed."""
        if not self._checks:
            return
        for probe, arg, what in ((self._check_slots, plan.slots, "slots"), (self._check_row, plan.req, "row")):
            if probe is None or (what == "slots" and not plan.slots.numel()):
                continue
            try:
                probe(arg)
            except LifecycleError:
                raise
            except Exception as err:
                raise ReleaseRefused(
                    f"request {plan.rid!r}: cannot free its {what} (row {plan.row}): {err}"
                ) from err

    def free(self, plan: ReleasePlan) -> None:
        """Free all slots in one allocator call, then the row."""
        if plan.slots.numel():
            self.allocator.free(plan.slots)
        self.req_to_token_pool.free(plan.req)


def release_ranges(committed: int, allocated: int, alloc_page: int) -> tuple:
    """``[0, committed)`` and the over-allocation past the page holding ``committed - 1``."""
    ranges = [(0, committed)] if committed else []
    tail = -(-committed // alloc_page) * alloc_page
    if tail < allocated:
        ranges.append((tail, allocated))
    return tuple(ranges)


def slot_end(offloader, allocator) -> int | None:
    """The device KV pool's slot count, when the pools tell it without reading device memory: the
    offloader's device pool (``offloader.kv.slots``: ``transfer.KVPool``, SGLang's buffers through
    ``LayeredKVPool``), else the allocator's ``total_slots`` (``transfer.PagedTokenAllocator``), else
    ``size + page_size`` of an allocator with both (SGLang's allocators: its KV buffers are that
    long, page 0 the padding). None: unknown (a device row's ids are checked for negatives and
    repeats only)."""
    for n in (getattr(getattr(offloader, "kv", None), "slots", None), getattr(allocator, "total_slots", None)):
        if _count(n):
            return n
    size, page = getattr(allocator, "size", None), getattr(allocator, "page_size", None)
    return size + page if _count(size) and _count(page) else None


def _count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def plan_release(pools, ledger, sink, rec, req, view, quarantined=None) -> ReleasePlan:
    """The validated plan for releasing ``req`` (read by ``lifecycle.requests.read_request``).

    Reads ``pools`` (``lifecycle.pools.Pools``: the row table, page sizes, the pool's slot count)
    and the ``ledger`` (copies in flight); asks the release ``sink`` to check the plan
    (``ReleaseSink.check``); changes nothing. ``view`` is ``(row, committed, allocated)``;
    ``quarantined``: the slot ids this request's expired copies may still read (None: none).

    A row in host memory goes through ``lifecycle.slots.check_slots``, the check every chunk plan
    makes too (the allocator is asked through the release sink). A row on a device
    (``req_to_token`` on CUDA) is never read on the host here: the plan's slots stay on the device as
    the row lists them (not sorted, not deduplicated), and their values are checked on the device
    (``transfer.gather.check_ids_on_device``: not negative, below the pool's slot count when the
    pools tell it, ``pools.slot_end``, distinct), issued here on the current stream. That verdict
    lands in host memory after this call returns, so it cannot refuse the release: a later
    ``check_offload_progress`` reads it once it has landed and reports a bad row (counted in
    ``stats().bad_release_rows``, logged as ``lifecycle.bad_release_row``). The one exception: a
    request one of whose copies expired (past ``write_timeout_s``, or discarded when SGLang's TP=1
    release wait ran out) reads its slots on the host, is checked, and leaves the quarantined ones
    out.

    Raises:
        InvalidSlots: the row lists a negative slot id (-1: never written), the same slot twice
            (a cleared or corrupted row), or a slot a copy in flight still reads (another request's,
            or an expired copy of another position) in the ranges to free.
        ReleaseRefused: the release sink refuses the plan.
    """
    row_id, committed, allocated = view
    ranges = release_ranges(committed, allocated, pools.alloc_page)
    table, rows = pools.table()
    n_quarantined, check = 0, None
    if rows is not None:  # a host row: its ids read once, as NumPy, checked, handed over as a tensor
        slots = _EMPTY
        if ranges:
            a = _host_ids(rows, row_id, ranges)
            if a.shape[0]:
                held = None if quarantined is None else _as_numpy(quarantined)
                ids, n_quarantined = check_slots(pools, ledger, rec.rid, row_id, ranges, a, "free", quarantined=held)
                slots = torch.from_numpy(ids) if ids.shape[0] else _EMPTY
            else:
                slots = torch.from_numpy(a)
        plan = ReleasePlan(req, rec.rid, row_id, ranges, slots, committed, allocated, n_quarantined, None)
        sink.check(plan)
        return plan
    slots = _row_slots(table, row_id, ranges)
    if slots.numel():
        if on_host(slots) or quarantined is not None:
            # host rows always; on a device row, the one exception: a stuck copy's quarantine
            held = None if quarantined is None else _as_numpy(quarantined)
            ids, n_quarantined = check_slots(pools, ledger, rec.rid, row_id, ranges, _as_numpy(slots), "free",
                                             quarantined=held)
            slots = torch.from_numpy(ids) if ids.shape[0] else _EMPTY
            if not on_host(table):
                slots = slots.to(table.device)
        else:  # a device row: checked where it lives, the verdict read by a later progress check
            verdict, event = check_ids_on_device(slots, pools.slot_end)
            check = ReleaseCheck(rec.rid, row_id, rec.generation, ranges, verdict, event)
    plan = ReleasePlan(req, rec.rid, row_id, ranges, slots, committed, allocated, n_quarantined, check)
    sink.check(plan)
    return plan


_EMPTY = torch.empty(0, dtype=torch.int64)


def _row_slots(table: torch.Tensor, row_id: int, ranges: tuple, rows=None) -> torch.Tensor:
    """The int64 slot ids of ``table[row_id]`` over ``ranges`` (a fresh tensor). On the CPU through
    NumPy (one copy-convert); elsewhere through torch on the table's device, nothing read on the host."""
    if not ranges:
        return _EMPTY
    if rows is None and not on_host(table):
        row = table[row_id]
        if len(ranges) == 1:  # a slice is a view of the row: copied, so a later write to the row is not seen
            return row[ranges[0][0]:ranges[0][1]].to(torch.int64, copy=True)
        return torch.cat([row[s:e] for s, e in ranges]).to(torch.int64)
    return torch.from_numpy(_host_ids(table.numpy() if rows is None else rows, row_id, ranges))


def _host_ids(rows: np.ndarray, row_id: int, ranges: tuple) -> np.ndarray:
    """The int64 slot ids of host table ``rows[row_id]`` over ``ranges`` (non-empty; a fresh array)."""
    row = rows[row_id]  # an integer table (config refuses others): never requires grad
    return (row[ranges[0][0]:ranges[0][1]] if len(ranges) == 1
            else np.concatenate([row[s:e] for s, e in ranges])).astype(np.int64)


def _as_numpy(slots: torch.Tensor) -> np.ndarray:
    return slots.numpy() if on_host(slots) else slots.cpu().numpy()
