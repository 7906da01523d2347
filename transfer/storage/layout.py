"""Pages written in SGLang's host layouts: the byte order a tier stores for each layout.

Our host pool is page-first (``HostPool.buffer[pages, kinds, page_size, layers, heads, head_dim]``),
so a host page is SGLang's ``page_first`` page. SGLang 0.5.19's other host layouts order a page's
bytes differently (``sglang/srt/mem_cache/pool_host/mha.py`` / ``mla.py``: ``init_kv_buffer``,
``get_data_page``, ``set_from_flat_data_page``, ``get_page_buffer_meta``); a stored page is the
K block then the V block of one page, each block in the layout's order:

============================  ==============================  =================================
layout                        MHA page (K block, V block)     MLA page
============================  ==============================  =================================
``page_first``                ``[2, page_size, L, H, D]``     ``[page_size, L, 1, W]``
``page_first_direct``         ``[2, L, page_size, H, D]``     ``[L, page_size, 1, W]``
``page_head``                 ``[2, H, page_size, L, D]``     (none in SGLang)
============================  ==============================  =================================

For Mooncake each block is one object (``_k``, ``_v``); for HiCacheFile the file is both blocks.
``LayoutStorage`` wraps a tier opened with the layout's ``wire_format``: it reorders each page
into a staging buffer before a write and back after a read, so the bytes in the tier are the
layout's, and the seal records the layout (``seal_layout``), so a reader of another layout
refuses the page as ``foreign``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from transfer.errors import StorageConfigError
from transfer.storage.base import Storage, StorageStats, check_batch
from transfer.storage.identity import LAYOUTS, MLA_LAYOUTS, PAGE_FIRST, PAGE_FIRST_DIRECT, PAGE_HEAD
from transfer.storage.integrity import PageFormat, check_keys

# host page dims -> layout page dims (a permutation; the last dim, head_dim / width, never moves)
_MHA_ORDER = {PAGE_FIRST: (0, 1, 2, 3, 4), PAGE_FIRST_DIRECT: (0, 2, 1, 3, 4), PAGE_HEAD: (0, 3, 1, 2, 4)}
_MLA_ORDER = {PAGE_FIRST: (0, 1, 2, 3), PAGE_FIRST_DIRECT: (1, 0, 2, 3)}
# the seal's layout field holds 16 ASCII bytes; page_first_direct is 17
SEAL_LAYOUT = {PAGE_FIRST: "page_first", PAGE_FIRST_DIRECT: "page_first_dir", PAGE_HEAD: "page_head"}


def _order(layout: str, host_shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(host_shape) == 5:
        table = _MHA_ORDER
    elif len(host_shape) == 4:
        table = _MLA_ORDER
    else:
        raise StorageConfigError(f"a host page is [2, page_size, layers, heads, head_dim] (MHA) or "
                                 f"[page_size, layers, 1, width] (MLA), got shape {host_shape}")
    if layout not in table:
        supported = LAYOUTS if table is _MHA_ORDER else MLA_LAYOUTS
        raise StorageConfigError(f"host layout {layout!r} is not supported for this page; supported: "
                                 f"{', '.join(supported)}")
    return table[layout]


def seal_layout(layout: str) -> str:
    """The layout name recorded in a page's seal (at most 16 characters)."""
    if layout not in SEAL_LAYOUT:
        raise StorageConfigError(f"unknown host layout {layout!r}; supported: {', '.join(LAYOUTS)}")
    return SEAL_LAYOUT[layout]


def wire_format(host_format: PageFormat, layout: str) -> PageFormat:
    """The format of a host page (``page_first``, our host pool) once written in ``layout``.

    Raises:
        StorageConfigError: ``host_format`` is not a page-first host page, or the layout has no
            form for it (MLA in ``page_head``).
    """
    if host_format.layout != SEAL_LAYOUT[PAGE_FIRST]:
        raise StorageConfigError(f"pages to reorder must be page_first host pages, got layout {host_format.layout!r}")
    order = _order(layout, host_format.shape)
    return PageFormat(seal_layout(layout), host_format.dtype, tuple(host_format.shape[i] for i in order))


class PageOrder:
    """Reorders one page's bytes between the host (page-first) order and ``layout``'s order.

    Args:
        layout: the stored layout. host_shape: the host page shape. itemsize: bytes per element.
    """

    def __init__(self, layout: str, host_shape: Sequence[int], itemsize: int) -> None:
        host_shape = tuple(int(d) for d in host_shape)
        self.layout, self.order = layout, _order(layout, host_shape)
        self.inverse = tuple(self.order.index(i) for i in range(len(self.order)))
        # in bytes: the innermost dim times the element size, so any dtype (fp8 too) moves bit-exact
        self.host_bytes = host_shape[:-1] + (host_shape[-1] * itemsize,)
        self.wire_bytes = tuple(self.host_bytes[i] for i in self.order)
        self.nbytes = 1
        for d in host_shape:
            self.nbytes *= d
        self.nbytes *= itemsize

    def to_layout(self, host_page: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``host_page`` (page-first bytes) into ``out`` in the layout's order."""
        src = host_page.reshape(-1).view(torch.uint8).view(self.host_bytes)
        out.reshape(-1).view(torch.uint8).view(self.wire_bytes).copy_(src.permute(self.order))

    def to_host(self, stored: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``stored`` (the layout's bytes) into ``out`` in page-first order."""
        src = stored.reshape(-1).view(torch.uint8).view(self.wire_bytes)
        out.reshape(-1).view(torch.uint8).view(self.host_bytes).copy_(src.permute(self.inverse))


class LayoutStorage(Storage):
    """A tier whose pages are stored in ``layout``'s byte order while callers hand it page-first
    host pages (see the module docstring).

    Args:
        inner: the tier, opened with ``wire_format(host_format, layout)`` as its page format.
        layout: ``page_first_direct`` or ``page_head`` (``page_first`` needs no wrapper).
        host_format: the format of the pages callers pass (page-first host pages).
        staging_bytes: per calling thread, the staging buffer's size; a batch larger than it
            is written or read in several inner calls (at least one page at a time).
    Raises:
        StorageConfigError: ``inner``'s page format is not the wire format of ``host_format``.
    """

    def __init__(self, inner: Storage, layout: str, host_format: PageFormat, staging_bytes: int = 16 << 20) -> None:
        expected = wire_format(host_format, layout)
        if inner.page_format != expected:
            raise StorageConfigError(f"the inner tier's format {inner.page_format} is not {expected}")
        itemsize = torch.empty((), dtype=getattr(torch, host_format.dtype)).element_size()
        self.inner, self.layout, self.host_format = inner, layout, host_format
        self.order = PageOrder(layout, host_format.shape, itemsize)
        self.suffix, self.page_nbytes = inner.suffix, inner.page_nbytes
        self.page_format = host_format
        self._chunk = max(1, staging_bytes // self.order.nbytes)
        self._local = threading.local()
        self._staged: list[torch.Tensor] = []  # every thread's buffer: a tier may keep them registered
        self._lock = threading.Lock()

    @property
    def breaker(self):
        """The inner tier's circuit breaker (None when it has none)."""
        return getattr(self.inner, "breaker", None)

    @property
    def events(self):
        """The inner tier's KV-event hook: it writes and evicts, so it announces (see ``Storage``)."""
        return self.inner.events

    @events.setter
    def events(self, hook) -> None:
        self.inner.events = hook

    def _staging(self) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = torch.empty((self._chunk, self.order.nbytes), dtype=torch.uint8)
            self._local.buf = buf
            with self._lock:
                self._staged.append(buf)
        return buf

    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """See ``Storage.batch_set``: each page is reordered into the layout, then written."""
        check_batch(keys, pages, self.page_nbytes)
        buf, out = self._staging(), []
        for start in range(0, len(keys), self._chunk):
            part = list(range(start, min(start + self._chunk, len(keys))))
            for j, i in enumerate(part):
                self.order.to_layout(pages[i], buf[j])
            out += self.inner.batch_set([keys[i] for i in part], [buf[j] for j in range(len(part))])
        return out

    def batch_get(self, keys: Sequence[str], into: Sequence[torch.Tensor]) -> list[bool]:
        """See ``Storage.batch_get``: a served page is reordered back into ``into[i]``; a missed or
        refused page leaves ``into[i]`` untouched."""
        check_batch(keys, into, self.page_nbytes)
        buf, out = self._staging(), []
        for start in range(0, len(keys), self._chunk):
            part = list(range(start, min(start + self._chunk, len(keys))))
            got = self.inner.batch_get([keys[i] for i in part], [buf[j] for j in range(len(part))])
            for j, i in enumerate(part):
                if got[j]:
                    self.order.to_host(buf[j], into[i])
            out += got
        return out

    def batch_exists(self, keys: Sequence[str]) -> int:
        """See ``Storage.batch_exists`` (the inner tier's answer)."""
        check_keys(keys)
        return self.inner.batch_exists(keys)

    def delete(self, key: str) -> bool:
        """See ``Storage.delete``."""
        return self.inner.delete(key)

    def stats(self) -> StorageStats:
        """The inner tier's counters."""
        return self.inner.stats()

    def close(self) -> None:
        """Close the inner tier (which may hold the staging buffers registered until then)."""
        self.inner.close()

    def __repr__(self) -> str:
        return f"LayoutStorage({self.layout}, {self.inner!r})"



def stored_in_layout(open_tier: Callable[[PageFormat], Storage], layout: str, host_format: PageFormat) -> Storage:
    """A tier that stores page-first host pages of ``host_format`` in ``layout``'s byte order.

    Args:
        open_tier: opens the tier with the page format it is to seal (the layout's
            ``wire_format``; ``host_format`` itself for ``page_first``).
        layout: the deployment identity's host layout.
        host_format: the format of the pages callers pass.
    Returns:
        The tier itself for ``page_first``, else a ``LayoutStorage`` around it.
    Raises:
        StorageConfigError: the layout has no form for these pages; whatever ``open_tier`` raises.
    """
    if layout == PAGE_FIRST:
        return open_tier(host_format)
    return LayoutStorage(open_tier(wire_format(host_format, layout)), layout, host_format)
