"""The one check of a plan's device slot ids, shared by the chunk plan and the release plan.

A ``req_to_token`` row is the scheduler's word for which device slots hold a request's KV; a row
that is wrong (a -1 never written, a slot listed twice, a slot the allocator does not hold, a slot a
copy of another position or request still reads) makes a copy store someone else's KV under a
valid page hash, or a release free memory still in use. Every plan reads its slot ids through
``check_slots`` before anything changes:

* not negative (-1: never written),
* distinct,
* not read by a copy in flight (another request's, or this request's at another position) nor by
  an expired copy whose slots are quarantined — ``SlotsInFlight`` counts them per slot id,
* in range and allocated, when the allocator can tell (``check_free``, the same probe the default
  release sink asks; a release asks it through its sink instead, so a custom sink decides).

A refusal raises ``InvalidSlots`` (a ``LifecycleError``) naming the request, its row, the slot, the
verb (``offload`` / ``free``) and the token ranges, and changes nothing.
"""

from __future__ import annotations

import numpy as np

from lifecycle.errors import InvalidSlots, LifecycleError


class SlotsInFlight:
    """How many copies in flight (expired ones included, until they end) read each device slot.

    Updated when a chunk is enqueued (``add``) and when its copy lands, fails or, after expiring,
    finally ends (``remove``). Sized on demand by the highest slot id seen.
    """

    __slots__ = ("_n",)

    def __init__(self) -> None:
        self._n = np.zeros(1024, dtype=np.int32)

    def add(self, indices) -> None:
        """Count a copy reading the distinct slot ids ``indices`` (an int64 tensor the plan checked)."""
        a = _numpy(indices)
        if a.shape[0]:
            hi = int(a.max())
            if hi >= self._n.shape[0]:
                grown = np.zeros(max(2 * self._n.shape[0], hi + 1), dtype=np.int32)
                grown[: self._n.shape[0]] = self._n
                self._n = grown
            self._n[a] += 1

    def remove(self, indices) -> None:
        """A copy reading ``indices`` (as added) ended."""
        a = _numpy(indices)
        if a.shape[0]:
            self._n[a] -= 1

    def read(self, s: np.ndarray, lo: int, hi: int) -> np.ndarray | None:
        """The ids of ``s`` (sorted, distinct, in ``lo..hi``) some copy reads, or None when none is."""
        n = self._n
        if lo >= n.shape[0]:
            return None
        if hi - lo + 1 == s.shape[0]:  # one run of consecutive ids: a slice, no gather
            window = n[lo:hi + 1]
            if not window.any():
                return None
            return s[: window.shape[0]][window > 0]
        inside = s[s < n.shape[0]] if hi >= n.shape[0] else s
        busy = n[inside] > 0
        return inside[busy] if busy.any() else None

    def total(self) -> int:
        """Slot reads counted (for integrity checks and tests)."""
        return int(self._n.sum())


def _numpy(indices) -> np.ndarray:
    """The ids of an int64 slot tensor as NumPy (a view on the CPU; a copy from another device)."""
    return indices.numpy() if indices.device.type == "cpu" else indices.cpu().numpy()


def check_slots(mgr, rid, row: int, ranges, a: np.ndarray, verb: str, quarantined=None, allocator: bool = False):
    """Check the slot ids ``a`` (int64, row order) a plan will ``verb``; return them sorted and distinct.

    Args:
        mgr: the manager (its ``_reading`` counts, copies in flight, allocator).
        rid, row, ranges: the request, its row and the token ranges ``a`` comes from (for messages).
        verb: ``"offload"`` or ``"free"``.
        quarantined: numpy ids this request's own expired copies may still read (a release leaves
            them out instead of refusing); None for none.
        allocator: also ask the allocator's ``check_free`` (the chunk plan; a release asks its sink).
    Returns:
        ``(ids, left_out)``: the sorted distinct ids (``a`` itself when it ascends), minus
        ``quarantined``, and how many were left out for it.
    Raises:
        InvalidSlots: a negative id, a repeated id, an id a copy in flight reads, or (``allocator``)
            an id the allocator does not hold or has never had.
    """
    n = a.shape[0]
    if n == 0:
        return a, 0
    s = a if n == 1 or (a[1:] > a[:-1]).all() else np.unique(a)
    lo, hi = int(s[0]), int(s[-1])
    where = f"row {row} lists"
    span = f"(ranges {[tuple(r) for r in ranges]})"
    if lo < 0:
        bad = int(a[int(np.flatnonzero(a < 0)[0])])
        raise InvalidSlots(f"request {rid!r}: {where} slot {bad} at a position to {verb} {span}: KV never allocated there")
    if s.shape[0] != n:
        raise InvalidSlots(f"request {rid!r}: {where} {n - s.shape[0]} slot ids more than once in {list(ranges)} "
                           f"(cleared or overwritten?): refused to {verb}")
    left_out = 0
    if quarantined is not None and quarantined.shape[0]:
        keep = ~np.isin(s, quarantined)
        left_out = n - int(keep.sum())
        s = s[keep]
        if not s.shape[0]:
            return s, left_out
        lo, hi = int(s[0]), int(s[-1])
    busy = mgr._reading.read(s, lo, hi)
    if busy is not None:
        slot = int(busy[0])
        raise InvalidSlots(f"request {rid!r}: {where} slot {slot} at a position to {verb} {span}, "
                           f"which {_reader(mgr, slot)} still reads")
    if allocator:
        probe = getattr(mgr.token_to_kv_pool_allocator, "check_free", None)
        if probe is not None:
            import torch

            try:
                probe(torch.from_numpy(s))
            except LifecycleError:
                raise
            except Exception as err:
                raise InvalidSlots(f"request {rid!r}: {where} slots the allocator does not hold at positions "
                                   f"to {verb} {span}: {err}") from err
    return s, left_out


def _reader(mgr, slot: int) -> str:
    """Who reads ``slot``: the copy in flight or the expired copy (rare path: a refusal)."""
    for ack, chunk in mgr._ongoing.items():
        if (_numpy(chunk.indices) == slot).any():
            return f"a copy in flight of request {chunk.rec.rid!r} (ack {ack}, tokens [{chunk.start}, {chunk.end}))"
    for ack, q in mgr._expired.items():
        if (_numpy(q.slots) == slot).any():
            return f"an expired copy of request {q.rid!r} (ack {ack}, slots quarantined)"
    return "a copy in flight"
