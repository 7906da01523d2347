"""Batched KV movement between the device pool's slot layout and host pages (page-first).

Both pools are viewed as "rows" of one (kind, layer, token) each, ``heads * head_dim`` values
wide, reinterpreted as the widest integer type that divides a row (dtype-agnostic, fp8 included).

* CUDA: one device ``index_select`` (a flat row index in host order ``(page, kind, token, layer)``)
  into the copy stream's staging buffer (``Staging``: allocated once, grown to the largest chunk,
  never per chunk), then one async D2H copy per run of consecutive host pages (and the reverse for
  loads): one gather launch per chunk.
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
from transfer.indices import as_index_tensor, pages_of_slots
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


class Staging:
    """One device staging buffer per copy stream, reused by every chunk copy on that stream and
    grown (never shrunk) to the largest chunk seen: no allocation per chunk. Reuse is safe because
    every use is on the one stream: a chunk's gather into the buffer is queued after the previous
    chunk's device -> host copy out of it.

    Args:
        device: where the buffer lives (the KV pool's device).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._buf: torch.Tensor | None = None
        self.grown = 0  # times a larger buffer was allocated

    def take(self, rows: int, width: int, word: torch.dtype) -> torch.Tensor:
        """A ``[rows, width]`` view of the buffer as ``word`` (contents undefined)."""
        nbytes = rows * width * torch.empty((), dtype=word).element_size()
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.grown += 1
        return self._buf[:nbytes].view(word).view(rows, width)


class ChunkCopy:
    """A planned copy between ``slots`` (device, whole page-aligned pages) and ``host_pages``
    (host), same page count.

    Two ways. *Direct* (CPU pools, copy worker): the page ids and runs are worked out by
    ``to_host`` / ``to_device`` and the data moves through permuted views, no staging. *Staged*
    (CUDA; on the CPU when a ``Staging`` is given, which tests use to run the CUDA path's logic): a
    device row index in host order is built here, on the current stream (the copy stream), then one
    gather into the staging buffer and one async copy per run of consecutive host pages. The plan
    holds every tensor it launched with until the caller drops it after the copy's event.

    Args:
        check_end: when given, the slot ids must be whole aligned pages inside ``0 .. check_end-1``;
            direct: checked here (``BadIndices``); staged: checked on the device, the verdict read
            by ``landed_error`` after the copy's event (a bad chunk moves harmless clamped rows).
        staging: the engine's ``Staging`` (None on CUDA: a buffer allocated for this plan).
    """

    def __init__(self, kv: KVPool, host: HostPool, slots: torch.Tensor, host_pages: torch.Tensor,
                 check_end: int | None = None, staging: Staging | None = None):
        self.kv, self.host = kv, host
        self.slots, self.host_pages = slots, host_pages
        self.views = pair_views(kv, host)
        self.rows_per_page = kv.kinds * host.page_size * kv.layers
        self.staging: torch.Tensor | None = None
        self.pool = staging
        self.cuda = kv.device.type == "cuda" or staging is not None  # the staged path
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

    def _stage(self) -> torch.Tensor:
        rows, width, word = self.index.numel(), self.views.dev_rows.shape[1], self.views.dev_rows.dtype
        if self.pool is not None:
            return self.pool.take(rows, width, word)
        return torch.empty((rows, width), dtype=word, device=self.kv.device)

    def landed_error(self):
        """Once the copy's event has fired: the ``BadIndices`` its device-side check found, or None."""
        return landed_error(self.ok, self.check_end)

    def _run_slices(self):
        rpp = self.rows_per_page
        for pos, first, length in self.runs:
            yield slice(pos * rpp, (pos + length) * rpp), slice(first * rpp, (first + length) * rpp)

    def _dev_page_ids(self) -> torch.Tensor:
        ps = self.host.page_size
        return self.slots.to(dtype=torch.int64)[::ps] // ps

    def to_host(self) -> None:
        """Device -> host. CPU: one ``index_select`` of whole device pages per run of consecutive
        host pages (usually one per chunk), written straight into the host pages through a
        permuted view. CUDA: one device gather, then async D2H per run (current stream)."""
        v = self.views
        if self.cuda:
            self.staging = self._stage()
            torch.index_select(v.dev_rows, 0, self.index, out=self.staging)  # one gather launch
            for src, dst in self._run_slices():
                v.host_rows[dst].copy_(self.staging[src], non_blocking=True)
            return
        dev = self._dev_page_ids()
        for pos, first, n in page_runs(self.host_pages):
            out = v.host_blocks[first:first + n].permute(1, 3, 0, 2, 4)
            torch.index_select(v.dev_pages, 2, dev[pos:pos + n], out=out)

    def to_device(self) -> None:
        """Host -> device. CPU: one strided copy per run of pages consecutive on both sides.
        CUDA: async H2D per run into staging, then one device scatter."""
        v = self.views
        if self.cuda:
            self.staging = self._stage()
            for src, dst in self._run_slices():
                self.staging[src].copy_(v.host_rows[dst], non_blocking=True)
            v.dev_rows.index_copy_(0, self.index, self.staging)
            return
        dev, host = self._dev_page_ids().tolist(), self.host_pages.tolist()
        for pos, first, n in page_runs(host):
            for d_pos, d_first, d_n in page_runs(dev[pos:pos + n]):
                h = first + d_pos
                v.dev_pages[:, :, d_first:d_first + d_n].copy_(
                    v.host_blocks[h:h + d_n].permute(1, 3, 0, 2, 4))
