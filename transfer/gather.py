"""Batched KV movement between the device pool's slot layout and host pages (page-first).

Both pools are viewed as "rows" of one (kind, layer, token) each, ``heads * head_dim`` values
wide, reinterpreted as the widest integer type that divides a row (dtype-agnostic, fp8 included).

* CUDA: one device ``index_select`` (a flat row index in host order ``(page, kind, token, layer)``)
  into the copy stream's staging buffer (``Staging``: never allocated per chunk, never larger than
  its budget, or one page when a page is larger), then one async D2H copy per run of consecutive
  host pages (and the reverse for loads): one gather launch per chunk, or per piece of a chunk
  larger than the budget (split into whole pages that fit, through the same buffer).
* CPU, device -> host: one ``index_select`` of whole device pages (``[kind, layer, page, token]``
  blocks) per run of consecutive host pages, written straight into the host pages through a
  permuted view: one op per chunk when its host pages are consecutive (the host pool hands out
  lowest ids first). Host -> device: one strided ``copy_`` per run of pages consecutive on both
  sides.
* The word views of a (device pool, host pool) pair are built once and reused (``pair_views``).
"""

from __future__ import annotations

import weakref

import torch

from transfer.errors import BadIndices
from transfer.host_pool import HostPool
from transfer.indices import as_index_tensor, as_tensor, pages_of_slots
from transfer.kv_pool import KVPool

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def row_word(row_bytes: int, *buffers: torch.Tensor) -> torch.dtype:
    """The widest int dtype that divides ``row_bytes`` and every buffer's start address."""
    for word in _WORDS:
        size = torch.empty((), dtype=word).element_size()
        if row_bytes % size == 0 and all(b.data_ptr() % size == 0 for b in buffers):
            return word
    raise AssertionError("unreachable: uint8 divides every row")


def word_rows(buffer: torch.Tensor, row_bytes: int, word: torch.dtype) -> torch.Tensor:
    """View a contiguous buffer as ``[-1, row_bytes / sizeof(word)]`` rows of ``word``."""
    return buffer.view(-1).view(torch.uint8).view(word).view(-1, row_bytes // torch.empty((), dtype=word).element_size())


def check_on_device(index: torch.Tensor, page_size: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Check device slot ids (whole aligned pages inside ``0 .. end-1``) without reading them on
    the host: the verdict is a pinned host flag the device writes asynchronously, to be read once
    the copy's event has fired (``landed_error``). Returns the ids clamped into the pool, so a bad
    chunk gathers harmless rows (never an out-of-bounds device access), and the flag.

    Issued on the current stream (the copy stream): allocations and reads stay on that stream.
    """
    grid = index.view(-1, page_size)
    first = grid[:, :1]
    ok = ((grid - first) == torch.arange(page_size, device=index.device)).all()
    ok &= ((first % page_size) == 0).all() & (first >= 0).all() & (first <= end - page_size).all()
    flag = torch.zeros((), dtype=torch.bool, pin_memory=torch.cuda.is_available())
    flag.copy_(ok, non_blocking=True)
    return index.clamp(0, end - 1), flag


def landed_error(flag: torch.Tensor | None, end: int):
    """After the copy's event fired: ``BadIndices`` when ``check_on_device`` found the ids bad, else
    None. Reads host memory only."""
    if flag is None or bool(flag):
        return None
    return BadIndices(f"device indices are not whole, page-aligned pages inside 0..{end - 1}: "
                      f"the copy moved nothing worth keeping")


def check_chunk_on_device(ids: torch.Tensor, page_size: int, end: int | None, reads: torch.Tensor | None = None,
                          held: torch.Tensor | None = None, held_page: int | None = None):
    """What ``lifecycle.slots.check_slots`` checks of a host row's chunk, for a chunk whose slot ids
    live on the device, without reading them on the host: its pages are distinct, none is read by
    a copy in flight (``reads``), and the allocator holds every one (``held``). That the ids are
    whole aligned pages inside the pool is the copy's own check (``check_on_device``), so a page is
    named here by its first slot.

    Every shape is static (a sort and neighbour compares, gathers, reductions to one element; no
    ``.item()``, no boolean indexing): nothing waits for the device. Issued on the current stream.

    Args:
        ids: the chunk's int64 slot ids on the device, a whole number of pages.
        page_size: slots per page (of the copy, and of ``reads``).
        end: the pool's slot count; a page is clamped into ``0 .. end-1`` before any gather
            (None: unknown; then neither ``reads`` nor ``held`` may be given).
        reads: per page of the pool (``(end - 1) // page_size + 1`` counts), the copies in flight
            reading it; None: not checked.
        held: per allocator page (``held_page`` slots each; at least ``(end - 1) // held_page + 1``
            entries), True when the allocator holds it; None: not checked.
        held_page: the allocator's page (divides ``page_size``); required with ``held``.
    Returns:
        ``(bad, pages)``: a 0-dim bool tensor on the device (True: refuse the chunk) and the chunk's
        page ids (int64, clamped into the pool), one per page in order.
    """
    first = ids[::page_size]
    if end is not None:
        first = first.clamp(0, end - 1)
    pages = first // page_size if page_size > 1 else first
    bad = None
    if pages.shape[0] > 1:  # one page cannot be listed twice (a decode chunk's usual size)
        ordered = torch.sort(pages).values
        bad = (ordered[1:] == ordered[:-1]).any()  # a page listed twice
    if reads is not None:
        busy = reads.index_select(0, pages).any()  # a page another copy in flight reads
        bad = busy if bad is None else bad | busy
    if held is not None:
        if held_page == page_size:
            owned = pages
        else:  # every allocator page of each page
            owned = ((first // held_page).view(-1, 1)
                     + torch.arange(page_size // held_page, device=ids.device)).reshape(-1).clamp(max=held.shape[0] - 1)
        owns = held.index_select(0, owned).all()  # False: a page the allocator does not hold
        bad = torch.where(owns, bad, True) if bad is not None else ~owns
    if bad is None:
        bad = torch.zeros((), dtype=torch.bool, device=ids.device)
    return bad, pages


#: what ``check_ids_on_device`` writes, in order: counts of negative, out-of-range (at or past
#: ``end``; 0 when no ``end`` is given) and repeated non-negative ids, then the smallest id, the
#: largest id, and the largest repeated non-negative id (-1: none)
ID_VERDICT = ("negative", "out_of_range", "repeated", "min", "max", "repeated_id")


def check_ids_on_device(ids: torch.Tensor, end: int | None = None):
    """Check slot ids where they live (a release plan's ids from ``req_to_token`` on the device)
    without reading them on the host: not negative, below ``end`` (when given), distinct.

    Sorted on the device and compared with their neighbours: every shape is static (no
    ``torch.unique``, no boolean indexing, no ``.item()``), so nothing waits for the device. The
    verdict (``ID_VERDICT``, int64) is copied into host memory with ``non_blocking=True`` (pinned on
    CUDA) and, on CUDA, an event is recorded after that copy: read the verdict (``ids_verdict``) only
    once ``event.query()`` is True. Off CUDA the event is None and the verdict is there at once.

    Issued on the current stream (the one that wrote the ids): allocations and reads stay on it.

    Args:
        ids: 1-D int64 slot ids, at least one, on the device.
        end: the pool's slot count (ids must be ``< end``); None: not checked.
    Returns:
        ``(verdict, event)``.
    """
    s = torch.sort(ids).values
    zero = s.new_zeros(())
    neg = (s < 0).sum()
    over = (s >= end).sum() if end is not None else zero
    same = (s[1:] == s[:-1]) & (s[1:] >= 0)
    rep = same.sum()
    rep_id = torch.cat((torch.where(same, s[1:], -1), s.new_full((1,), -1))).max()
    out = torch.stack((neg, over, rep, s[0], s[-1], rep_id))
    verdict = torch.empty(len(ID_VERDICT), dtype=torch.int64, pin_memory=ids.is_cuda)
    verdict.copy_(out, non_blocking=True)
    event = None
    if ids.is_cuda:
        event = torch.cuda.Event()
        event.record()
    return verdict, event


def ids_verdict(verdict: torch.Tensor) -> dict | None:
    """What ``check_ids_on_device`` found (read once its event fired: host memory only): None when
    every id was good, else ``ID_VERDICT`` as a dict."""
    values = verdict.tolist()
    if not (values[0] or values[1] or values[2]):
        return None
    return dict(zip(ID_VERDICT, values))


def host_order_rows(kv: KVPool, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat device row ids of ``slots`` (whole pages) in host page-first order.

    The row of (kind, layer, slot) is ``(kind * layers + layer) * kv.slots + slot``; the result is
    ordered ``[page, kind, token-in-page, layer]``, matching a host page ``[kinds, page_size,
    layers, ...]``.
    """
    dev = slots.device
    plane = (torch.arange(kv.kinds, device=dev).view(1, -1, 1, 1) * kv.layers
             + torch.arange(kv.layers, device=dev).view(1, 1, 1, -1)) * kv.slots
    return (plane + slots.view(-1, 1, page_size, 1)).reshape(-1)


def page_runs(pages: torch.Tensor | list[int]) -> list[tuple[int, int, int]]:
    """Split page ids into runs of consecutive ids: ``(position in pages, first page, length)``."""
    ids = pages.tolist() if isinstance(pages, torch.Tensor) else pages
    runs: list[tuple[int, int, int]] = []
    pos = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((pos, ids[pos], i - pos))
            pos = i
    return runs


class _Views:
    """Word views of one (device pool, host pool) pair, built once and reused by every plan."""

    def __init__(self, kv: KVPool, host: HostPool) -> None:
        self.word = row_word(kv.row_bytes, kv.buffer, host.buffer)
        self.dev_rows = word_rows(kv.buffer, kv.row_bytes, self.word)
        self.host_rows = word_rows(host.buffer, host.row_bytes, self.word)
        ps, w = host.page_size, self.dev_rows.shape[1]
        planes = self.dev_rows.view(kv.kinds, kv.layers, kv.slots, w)
        whole = kv.slots // ps * ps
        #: device pages ``[kind, layer, page, token, word]`` (slots past the last whole page unused)
        self.dev_pages = planes[:, :, :whole].view(kv.kinds, kv.layers, whole // ps, ps, w)
        #: host pages ``[page, kind, token, layer, word]``
        self.host_blocks = self.host_rows.view(host.num_pages, kv.kinds, ps, kv.layers, w)


_VIEWS: "weakref.WeakKeyDictionary[KVPool, weakref.WeakKeyDictionary[HostPool, _Views]]" = (
    weakref.WeakKeyDictionary())


def pair_views(kv: KVPool, host: HostPool) -> _Views:
    """The cached word views of ``kv`` and ``host`` (built on first use; dropped with the pools)."""
    per_kv = _VIEWS.get(kv)
    if per_kv is None:
        per_kv = _VIEWS.setdefault(kv, weakref.WeakKeyDictionary())
    views = per_kv.get(host)
    if views is None:
        views = per_kv.setdefault(host, _Views(kv, host))
    return views


#: default bytes of a copy stream's device staging buffer (``Staging``); ``KV_LIFECYCLE_SGLANG_STAGING_MIB``
#: sets it for SGLang, ``staging_bytes=`` for the engines
DEFAULT_STAGING_BYTES = 16 << 20


def check_staging_bytes(budget_bytes) -> int:
    """``budget_bytes`` if it is a positive int, else ``ValueError``."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
        raise ValueError(f"staging budget must be a positive number of bytes, got {budget_bytes!r}")
    return budget_bytes


class Staging:
    """One device staging buffer per copy stream, reused by every chunk copy on that stream: no
    allocation per chunk, and never more than ``budget_bytes`` (or one page, when one page is
    larger): a chunk that does not fit is copied in pieces of whole pages (``pieces``) through the
    same buffer. Allocated on first use and grown (never shrunk) up to the largest piece seen.
    Reuse is safe because every use is on the one stream: a piece's gather into the buffer is
    queued after the previous piece's device -> host copy out of it; a plan keeps the buffer it
    used alive until its copy's event fired, so a grown buffer never frees one still in flight.

    Args:
        device: where the buffer lives (the KV pool's device).
        budget_bytes: the most bytes the buffer holds (at least one page is always allowed).
    Raises:
        ValueError: ``budget_bytes`` is not a positive int (nothing allocated).
    """

    def __init__(self, device: torch.device | str, budget_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.budget_bytes = check_staging_bytes(budget_bytes)
        self.device = torch.device(device)
        self._buf: torch.Tensor | None = None
        self._views: dict = {}  # views of the current buffer built once (``cached``)
        self.grown = 0  # times a larger buffer was allocated
        self.peak_bytes = 0  # the largest buffer ever allocated

    def pages_per_copy(self, page_bytes: int) -> int:
        """Whole pages of ``page_bytes`` that one piece holds: ``budget // page_bytes``, at least 1."""
        return max(1, self.budget_bytes // page_bytes)

    def pieces(self, n_pages: int, page_bytes: int) -> list[tuple[int, int]]:
        """A chunk of ``n_pages`` split into pieces that fit: ``(first position, pages)``."""
        step = self.pages_per_copy(page_bytes)
        return [(pos, min(step, n_pages - pos)) for pos in range(0, n_pages, step)]

    def take(self, rows: int, width: int, word: torch.dtype, page_bytes: int | None = None) -> torch.Tensor:
        """A ``[rows, width]`` view of the buffer as ``word`` (contents undefined).

        Raises:
            ValueError: more bytes than the budget (or than one ``page_bytes`` page, when larger);
                use ``pieces``.
        """
        nbytes = rows * width * torch.empty((), dtype=word).element_size()
        if nbytes > max(self.budget_bytes, page_bytes or 0):
            raise ValueError(f"{nbytes} staging bytes asked for, over the {self.budget_bytes}-byte budget "
                             f"(split the copy: Staging.pieces)")
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._views.clear()
            self.grown += 1
            self.peak_bytes = max(self.peak_bytes, nbytes)
        return self._buf[:nbytes].view(word).view(rows, width)

    def cached(self, key, build):
        """``build()`` once per ``key`` while the buffer stays the same (views of it reused by every
        chunk of the same shape); a grown buffer drops them."""
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 64:  # piece shapes are few (the stride, the remainders): bound it anyway
                self._views.clear()
            views = self._views[key] = build()
        return views


def piece_runs(runs: list[tuple[int, int, int]], pos: int, n: int) -> list[tuple[int, int, int]]:
    """The parts of host-page ``runs`` (``page_runs``) inside chunk positions ``pos .. pos+n-1``:
    ``(position in the piece, first host page, length)``."""
    out = []
    for r_pos, first, length in runs:
        lo, hi = max(r_pos, pos), min(r_pos + length, pos + n)
        if lo < hi:
            out.append((lo - pos, first + lo - r_pos, hi - lo))
    return out


class ChunkCopy:
    """A planned copy between ``slots`` (device, whole page-aligned pages) and ``host_pages``
    (host), same page count.

    Two ways. *Direct* (CPU pools, copy worker): the page ids and runs are worked out by
    ``to_host`` / ``to_device`` and the data moves through permuted views, no staging. *Staged*
    (CUDA; on the CPU when a ``Staging`` is given, which tests use to run the CUDA path's logic): a
    device row index in host order is built here, on the current stream (the copy stream), then per
    piece of the chunk that fits the staging budget (``Staging.pieces``; one piece for a chunk
    within it) one gather into the staging buffer and one async copy per run of consecutive host
    pages. The plan holds every tensor it launched with until the caller drops it after the copy's
    event.

    Args:
        check_end: when given, the slot ids must be whole aligned pages inside ``0 .. check_end-1``;
            direct: checked here (``BadIndices``); staged: checked on the device, the verdict read
            by ``landed_error`` after the copy's event (a bad chunk moves harmless clamped rows).
        staging: the engine's ``Staging`` (None on CUDA: one of the default budget for this plan).
    """

    def __init__(self, kv: KVPool, host: HostPool, slots: torch.Tensor, host_pages: torch.Tensor,
                 check_end: int | None = None, staging: Staging | None = None):
        self.kv, self.host = kv, host
        slots, host_pages = as_tensor(slots), as_tensor(host_pages)  # NumPy ids from the scheduler thread
        self.slots, self.host_pages = slots, host_pages
        self.views = pair_views(kv, host)
        self.rows_per_page = kv.kinds * host.page_size * kv.layers
        self.staging: torch.Tensor | None = None
        self.cuda = kv.device.type == "cuda" or staging is not None  # the staged path
        self.pool = staging if staging is not None or not self.cuda else Staging(kv.device)
        self.check_end, self.ok = check_end, None
        if self.cuda:
            index = slots.to(kv.device, dtype=torch.int64, non_blocking=True)
            if check_end is not None:
                index, self.ok = check_on_device(index, host.page_size, check_end)
            self.index = host_order_rows(kv, index, host.page_size)
            self.runs = page_runs(host_pages)
        elif check_end is not None:  # on the copy worker: the ids may be read here
            self.slots = as_index_tensor(slots, "device indices")
            pages_of_slots(self.slots.numpy(), host.page_size, "device indices", check_end)

    def _pieces(self):
        """Per piece of the chunk within the staging budget: its staging rows (a view of the one
        buffer), its slice of the row index, and its host-page runs as row slices (staging, host)."""
        rpp, width, word = self.rows_per_page, self.views.dev_rows.shape[1], self.views.dev_rows.dtype
        page_bytes = rpp * width * self.views.dev_rows.element_size()
        for pos, n in self.pool.pieces(self.index.numel() // rpp, page_bytes):
            buf = self.pool.take(n * rpp, width, word, page_bytes)
            runs = [(slice(at * rpp, (at + length) * rpp), slice(first * rpp, (first + length) * rpp))
                    for at, first, length in piece_runs(self.runs, pos, n)]
            yield buf, self.index[pos * rpp:(pos + n) * rpp], runs

    def landed_error(self):
        """Once the copy's event has fired: the ``BadIndices`` its device-side check found, or None."""
        return landed_error(self.ok, self.check_end)

    def _dev_page_ids(self) -> torch.Tensor:
        ps = self.host.page_size
        return self.slots.to(dtype=torch.int64)[::ps] // ps

    def to_host(self) -> None:
        """Device -> host. CPU: one ``index_select`` of whole device pages per run of consecutive
        host pages (usually one per chunk), written straight into the host pages through a
        permuted view. CUDA: per piece within the staging budget, one device gather, then async D2H
        per run (current stream)."""
        v = self.views
        if self.cuda:
            for buf, index, runs in self._pieces():
                torch.index_select(v.dev_rows, 0, index, out=buf)  # one gather launch
                for src, dst in runs:
                    v.host_rows[dst].copy_(buf[src], non_blocking=True)
                self.staging = buf  # the buffer stays alive until the copy's event fired
            return
        dev = self._dev_page_ids()
        for pos, first, n in page_runs(self.host_pages):
            out = v.host_blocks[first:first + n].permute(1, 3, 0, 2, 4)
            torch.index_select(v.dev_pages, 2, dev[pos:pos + n], out=out)

    def to_device(self) -> None:
        """Host -> device. CPU: one strided copy per run of pages consecutive on both sides.
        CUDA: per piece within the staging budget, async H2D per run into staging, then one device
        scatter."""
        v = self.views
        if self.cuda:
            for buf, index, runs in self._pieces():
                for src, dst in runs:
                    buf[src].copy_(v.host_rows[dst], non_blocking=True)
                v.dev_rows.index_copy_(0, index, buf)
                self.staging = buf
            return
        dev, host = self._dev_page_ids().tolist(), self.host_pages.tolist()
        for pos, first, n in page_runs(host):
            for d_pos, d_first, d_n in page_runs(dev[pos:pos + n]):
                h = first + d_pos
                v.dev_pages[:, :, d_first:d_first + d_n].copy_(
                    v.host_blocks[h:h + d_n].permute(1, 3, 0, 2, 4))
