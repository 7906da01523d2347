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

A device row's ids (``req_to_token`` on CUDA) are never read on the host. A chunk's are checked on
the device by ``check_device_chunk`` (issued on the caller's stream, no sync): pages distinct, none
read by a copy in flight (``DeviceReads``: per device page, counted on the device), every one held
by the allocator when it keeps its free lists on the device (SGLang's ``free_pages`` /
``release_pages``); a chunk that fails has its ids set to -1 on the device, so its copy fails
(the copy's own check: whole aligned pages inside the pool) and nothing of it is stored. A
release's are checked on the device by ``release.plan_release``.
"""

from __future__ import annotations

import numpy as np
import torch

from lifecycle.errors import InvalidSlots, LifecycleError
from transfer.gather import check_chunk_on_device
from transfer.indices import on_host, one_run


_SMALL = 256  # ids: at most this many take the byte-compare paths (cheaper than a NumPy reduction)
_ZEROS = bytes(4 * _SMALL)
_ONES = np.ones(_SMALL, dtype=np.int32).tobytes()


class SlotsInFlight:
    """How many copies in flight (expired ones included, until they end) read each device slot.

    The chunk plan's check leaves the ids it checked here (``planned``); the chunk's commit counts
    them under its ack id (``add``), and its copy landing, failing or, after expiring, finally
    ending uncounts them (``remove``). Sized on demand by the highest slot id seen.
    """

    __slots__ = ("_n", "_by_ack", "planned", "device")

    def __init__(self) -> None:
        self._n = np.zeros(1024, dtype=np.int32)
        self._by_ack: dict = {}  # ack id -> (ids, lo, hi, run) as counted
        # (indices tensor, ids, lo, hi, run, unread) of the chunk being planned; ``unread``: the
        # check saw every id's count at 0 (a run), so ``add`` sets them to 1 instead of adding
        self.planned = None
        self.device: DeviceReads | None = None  # device rows' counts (made by their first chunk)

    def plan(self, planned: tuple) -> None:
        """Leave the ids ``check_slots`` checked for the chunk's commit (``add``)."""
        self.planned = planned

    def device_reads(self, like: torch.Tensor, page_size: int, end: int) -> "DeviceReads":
        """The device rows' counts (made by their first chunk)."""
        if self.device is None:
            self.device = DeviceReads(like, page_size, end)
        return self.device

    def add(self, ack: int, indices) -> None:
        """Count the copy ``ack`` reading ``indices`` (the tensor its plan checked)."""
        p = self.planned
        self.planned = None
        if p is None or p[0] is not indices:  # not planned through check_slots: derive (never on the fast path)
            if not on_host(indices):  # device-resident ids are never read on the host (no sync): counted there
                if self.device is not None:
                    self.device.add(ack, indices)
                return
            a = indices if type(indices) is np.ndarray else indices.numpy()
            if not a.shape[0]:
                return
            a = np.unique(a)
            p = (indices, a, int(a[0]), int(a[-1]), int(a[-1]) - int(a[0]) + 1 == a.shape[0], False)
        _, a, lo, hi, run, unread = p
        if hi >= self._n.shape[0]:
            grown = np.zeros(max(2 * self._n.shape[0], hi + 1), dtype=np.int32)
            grown[: self._n.shape[0]] = self._n
            self._n = grown
        if unread:
            self._n[lo:hi + 1] = 1
        elif run:
            self._n[lo:hi + 1] += 1
        else:
            self._n[a] += 1
        self._by_ack[ack] = (a, lo, hi, run)  # the ids, not the tensor: a tuple of untracked parts leaves the collector

    def remove(self, ack: int) -> None:
        """The copy ``ack`` ended: its slots are no longer read by it."""
        p = self._by_ack.pop(ack, None)
        if p is None:
            if self.device is not None:
                self.device.remove(ack)
            return
        a, lo, hi, run = p
        if run:
            window = self._n[lo:hi + 1]
            k = window.shape[0]
            if k <= _SMALL and window.tobytes() == _ONES[: 4 * k]:  # read by this copy only (the usual case)
                window[:] = 0
            else:
                window -= 1
        else:
            self._n[a] -= 1

    def read(self, s: np.ndarray, lo: int, hi: int, run: bool) -> np.ndarray | None:
        """The ids of ``s`` (sorted, distinct, in ``lo..hi``) some copy reads, or None when none is."""
        n = self._n
        if lo >= n.shape[0]:
            return None
        if run:  # one run of consecutive ids: a slice, no gather; a byte compare, no reduction
            window = n[lo:hi + 1]
            k = window.shape[0]
            if (window.tobytes() == _ZEROS[: 4 * k]) if k <= _SMALL else not window.any():
                return None
            return s[: window.shape[0]][window > 0]
        inside = s[s < n.shape[0]] if hi >= n.shape[0] else s
        busy = n[inside] > 0
        return inside[busy] if busy.any() else None

    def reader(self, slot: int):
        """The ack id of a copy counted as reading ``slot`` (None: none)."""
        for ack, (a, lo, hi, run) in self._by_ack.items():
            if lo <= slot <= hi and (run or (a == slot).any()):
                return ack
        return None

    def total(self) -> int:
        """Slot reads counted (for integrity checks and tests)."""
        return int(self._n.sum())


class PageNames:
    """Under which page name each device page (a manager page, keyed by its first slot id //
    ``page_size``) was offloaded, and by which lifecycle (its record's ``serial``): a chunk whose
    row lists, at one of its pages, a device page that another live request holds under a
    different name would store that request's KV under this one's name, and is refused
    (``check_slots``). The same name in both (a prefix page shared through SGLang's radix cache)
    is allowed. Host rows only (a device row's ids are never read on the host).

    Entries are set when a chunk is committed (``add``) and overwritten by the page's next holder;
    an entry of a lifecycle that is no longer live (not in the ledger's ``holders``: released,
    dropped, readmitted) is ignored, so a release clears nothing. Two flat dicts (no object per
    entry): bounded by the device pool's pages.
    """

    __slots__ = ("owner", "name", "planned")

    def __init__(self) -> None:
        self.owner: dict[int, int] = {}  # device page -> serial of the lifecycle that offloaded it
        self.name: dict[int, str] = {}   # device page -> its page name there
        self.planned = None  # (indices, keys, serial, names) of the chunk just checked

    def conflict(self, keys, serial: int, names, holders: dict):
        """The first chunk page whose device page another live request holds under another name:
        ``(i, holder record)``, or None."""
        owner = self.owner
        if len(keys) == 1:  # a one-page chunk (stride = page): one lookup
            held = owner.get(keys[0])
            if held is None or held == serial or held not in holders or self.name[keys[0]] == names[0]:
                return None
            return 0, holders[held]
        for i, key in enumerate(keys):
            held = owner.get(key)
            if held is not None and held != serial and held in holders and self.name[key] != names[i]:
                return i, holders[held]
        return None

    def plan(self, planned: tuple) -> None:
        """Leave the chunk ``check_slots`` checked (indices, keys, serial, names) for its commit."""
        self.planned = planned

    def add(self, indices) -> None:
        """The chunk checked last (its ``indices``) was committed: its pages are held under its names."""
        p, self.planned = self.planned, None
        if p is None or p[0] is not indices:
            return
        _, keys, serial, names = p
        if len(keys) == 1:
            self.owner[keys[0]] = serial
            self.name[keys[0]] = names[0]
            return
        owner, name = self.owner, self.name
        for key, n in zip(keys, names):
            owner[key] = serial
            name[key] = n


class DeviceReads:
    """``SlotsInFlight`` for slot ids that live on a device: per page of the device pool, how many
    copies in flight (expired ones included, until they end) read it, as an int32 tensor on that
    device. Counted (``add``, at the chunk's commit) and uncounted (``remove``, when its copy lands,
    fails or finally ends) by device ops issued on the caller's stream, in call order; never read
    on the host. A chunk its check refused is counted on a spare last entry (never asked), so its
    pages are not counted as read: its copy fails. Holds the allocator's held-page mask too
    (``held``), rebuilt on the device when the allocator's free lists change.

    Args:
        like: a tensor on the device (the chunk's ids).
        page_size: the manager's page (slots per counted page).
        end: the device pool's slot count.
    """

    __slots__ = ("counts", "page_size", "end", "pages", "planned", "_by_ack", "_ones", "_held_of", "_held")

    def __init__(self, like: torch.Tensor, page_size: int, end: int) -> None:
        self.page_size, self.end = page_size, end
        self.pages = (end - 1) // page_size + 1
        self.counts = torch.zeros(self.pages + 1, dtype=torch.int32, device=like.device)  # + the spare
        self.planned = None  # (indices, pages to count) of the chunk just checked
        self._by_ack: dict = {}  # ack id -> pages as counted
        self._ones: dict = {}  # page count -> int32 ones on the device
        self._held_of: tuple = ()  # the free-list tensors (and versions) the mask was built from
        self._held = None

    def plan(self, indices: torch.Tensor, bad: torch.Tensor, pages: torch.Tensor) -> None:
        """Leave the checked chunk for ``add``: its pages, or the spare entry for each when ``bad``."""
        self.planned = (indices, torch.where(bad, self.pages, pages))

    def _ones_of(self, n: int) -> torch.Tensor:
        ones = self._ones.get(n)
        if ones is None:
            ones = self._ones[n] = torch.ones(n, dtype=torch.int32, device=self.counts.device)
        return ones

    def add(self, ack: int, indices) -> None:
        """Count the copy ``ack`` reading ``indices`` (checked by ``check_device_chunk``)."""
        p, self.planned = self.planned, None
        if p is None or p[0] is not indices:
            return
        self.counts.index_add_(0, p[1], self._ones_of(p[1].shape[0]))
        self._by_ack[ack] = p[1]

    def remove(self, ack: int) -> None:
        """The copy ``ack`` ended: uncount its pages."""
        pages = self._by_ack.pop(ack, None)
        if pages is not None:
            self.counts.index_add_(0, pages, self._ones_of(pages.shape[0]), alpha=-1)

    def held(self, allocator, device: torch.device, alloc_page: int) -> torch.Tensor | None:
        """Per allocator page, whether ``allocator`` holds it (bool, on ``device``; page 0 is SGLang's
        padding page, never handed out), from its free lists on the device (``free_pages`` and
        ``release_pages``, page ids). None when it keeps none there (then not checked). Built on
        the device when the lists changed (another tensor, or written in place), else reused."""
        free = getattr(allocator, "free_pages", None)
        if not isinstance(free, torch.Tensor) or free.device != device or free.dim() != 1:
            return None
        rel = getattr(allocator, "release_pages", None)
        if not isinstance(rel, torch.Tensor) or rel.device != device or rel.dim() != 1:
            rel = None
        key = (free, free._version, rel, None if rel is None else rel._version)
        if len(self._held_of) == 4 and all(a is b for a, b in zip(key[::2], self._held_of[::2])) \
                and key[1::2] == self._held_of[1::2]:
            return self._held
        n = (self.end - 1) // alloc_page + 1
        mask = torch.ones(n + 1, dtype=torch.bool, device=device)  # entry n: where a stray id lands
        mask[0] = False
        for lst in (free, rel):
            if lst is not None and lst.numel():
                mask.index_fill_(0, lst.to(torch.int64).clamp(0, n), False)
        self._held_of, self._held = key, mask
        return mask


def check_device_chunk(pools, ledger, indices: torch.Tensor) -> None:
    """Check a chunk's slot ids that live on a device (``indices``: the plan's own int64 copy of
    the row) as ``check_slots`` checks a host row's — pages distinct, none read by a copy in flight,
    every one held by the allocator when it can tell — on the device, on the caller's stream,
    without reading them (``transfer.gather.check_chunk_on_device``). A chunk that fails has its
    ids set to -1 in place, on the device: its copy then fails (whole aligned pages inside the pool
    is the copy's check) and nothing of it is stored. The chunk's pages are left in
    ``ledger.reading.device.planned`` for the chunk's commit (``SlotsInFlight.add``).

    Without the pool's slot count (``pools.slot_end`` None) only the pages' distinctness is checked.
    """
    ps, end = pools.page_size, pools.slot_end
    if end is None:
        bad, _ = check_chunk_on_device(indices, ps, None)
        indices.masked_fill_(bad, -1)
        return
    reading = ledger.reading
    dev = reading.device_reads(indices, ps, end)
    held = dev.held(pools.allocator, indices.device, pools.alloc_page)
    bad, pages = check_chunk_on_device(indices, ps, end, dev.counts, held, pools.alloc_page)
    indices.masked_fill_(bad, -1)
    dev.plan(indices, bad, pages)


def check_slots(pools, ledger, rid, row: int, ranges, a: np.ndarray, verb: str, quarantined=None, indices=None,
                names=None, serial: int = 0):
    """Check the slot ids ``a`` (int64, row order) a plan will ``verb``; return them sorted and distinct.

    Args:
        pools: the pools (``lifecycle.pools.Pools``: page sizes, the allocator).
        ledger: the manager's ledger (its ``reading`` counts, copies in flight and page names).
        rid, row, ranges: the request, its row and the token ranges ``a`` comes from (for messages).
        verb: ``"offload"`` or ``"free"``.
        quarantined: numpy ids this request's own expired copies may still read (a release leaves
            them out instead of refusing); None for none.
        indices: the chunk plan's slot tensor: the allocator is asked too (``check_free``; a
            release asks its sink instead) and the checked ids are left in ``ledger.reading.planned``
            for the chunk's commit.
        names, serial: the chunk plan's page names and its record's ``serial``: a device page
            another live request holds under another name is refused (``PageNames``).
    Returns:
        ``(ids, left_out)``: the sorted distinct ids (``a`` itself when it ascends), minus
        ``quarantined``, and how many were left out for it.
    Raises:
        InvalidSlots: a negative id, a repeated id, an id a copy in flight reads, or (chunk plan)
            an id the allocator does not hold or has never had, or a device page another live
            request holds under another page name.
    """
    n = a.shape[0]
    if n == 0:
        return a, 0
    ids = a.tolist() if n <= _SMALL else None  # a chunk's few ids: checked as one Python list
    if ids is not None:
        lo, hi = ids[0], ids[-1]
    else:
        lo, hi = int(a[0]), int(a[-1])
    if ids is not None and lo >= 0 and one_run(ids):
        s = a  # one run of consecutive ids, ascending (a decode chunk's usual row): no sort, no reduction
    else:
        s = a if n == 1 or (a[1:] > a[:-1]).all() else _sorted_distinct(a)
        lo, hi = int(s[0]), int(s[-1])
    if lo < 0:
        bad = int(a[int(np.flatnonzero(a < 0)[0])])
        raise InvalidSlots(f"request {rid!r}: row {row} lists slot {bad} at a position to {verb} {_span(ranges)}: "
                           f"KV never allocated there")
    if s.shape[0] != n:
        raise InvalidSlots(f"request {rid!r}: row {row} lists {n - s.shape[0]} slot ids more than once in "
                           f"{list(ranges)} (cleared or overwritten?): refused to {verb}")
    left_out = 0
    if quarantined is not None and quarantined.shape[0]:
        keep = ~np.isin(s, quarantined)
        left_out = n - int(keep.sum())
        s = s[keep]
        if not s.shape[0]:
            return s, left_out
        lo, hi = int(s[0]), int(s[-1])
    run = hi - lo + 1 == s.shape[0]
    busy = ledger.reading.read(s, lo, hi, run)
    if busy is not None:
        slot = int(busy[0])
        raise InvalidSlots(f"request {rid!r}: row {row} lists slot {slot} at a position to {verb} {_span(ranges)}, "
                           f"which {ledger.reader_of(slot)} still reads")
    if indices is not None:
        alloc = pools.allocator
        holds = getattr(alloc, "holds_slots", None) if run else None
        probe = None if holds is not None and holds(lo, hi) else probe_of(alloc, "check_free")
        if probe is not None:
            page = pools.alloc_page
            firsts = (np.arange(lo // page, hi // page + 1, dtype=np.int64) if run else np.unique(s // page)) * page
            try:
                probe(torch.from_numpy(firsts))
            except LifecycleError:
                raise
            except Exception as err:
                raise InvalidSlots(f"request {rid!r}: row {row} lists slots the allocator does not hold at positions "
                                   f"to {verb} {_span(ranges)}: {err}") from err
        if names is not None:
            ps = pools.page_size  # each chunk page's device page: its first slot's
            if ids is None:
                keys = (a[::ps] // ps).tolist()
            else:
                keys = (ids[0] // ps,) if n == ps else [i // ps for i in ids[::ps]]
            hit = ledger.names.conflict(keys, serial, names, ledger.holders)
            if hit is not None:
                i, holder = hit
                raise InvalidSlots(
                    f"request {rid!r}: row {row} lists slot {int(a[i * ps])} at a position to {verb} "
                    f"{_span(ranges)}, on a device page request {holder.rid!r} holds under another page name "
                    f"({ledger.names.name[keys[i]]} there, {names[i]} here): its KV would be stored "
                    f"under this request's name")
            ledger.names.plan((indices, keys, serial, names))
        ledger.reading.plan((indices, s, lo, hi, run, run))  # a run: read() saw every count at 0
    return s, left_out


def _sorted_distinct(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)`` for a chunk's or a row's few hundred ids: one sort and one neighbour compare
    (``np.unique``'s hash path costs several times that on arrays this small)."""
    s = np.sort(a, kind="stable")  # a row's pages are runs of ascending ids: a merge of runs
    new = s[1:] != s[:-1]
    return s if new.all() else s[np.concatenate(([True], new))]


def probe_of(obj, name: str):
    """``obj``'s method ``name`` (an allocator's or row pool's ``check_free``), or None when it has
    none: a pool that cannot tell is not asked."""
    probe = getattr(obj, name, None)
    return probe if callable(probe) else None


def _span(ranges) -> str:
    return f"(ranges {[tuple(r) for r in ranges]})"

