"""Host KV pool in SGLang's ``page_first`` page byte layout, one page contiguous.

Buffer: ``[pages, kinds, page_size, layers, heads, head_dim]`` (MHA: kinds = 2, K then V; MLA:
kinds = 1, heads = 1). One page's bytes are ``[kinds, page_size, layers, heads, head_dim]``: the
same bytes SGLang's ``MHATokenToKVPoolHost.get_data_page(index, flat=True)`` yields for layout
``page_first`` (``kv_buffer[:, index:index+page_size]`` of a ``(2, size, layers, heads, dim)``
buffer) and ``MLATokenToKVPoolHost`` yields for ``(size, layers, 1, dim)``. Pinned when CUDA is
available: the exact buffer registered with ``cudaHostRegister`` (as SGLang does), unregistered on
``close`` or when the pool is collected unclosed, never at interpreter exit nor after
``keep_pinned`` (a copy abandoned at shutdown may still write into it); a pool that cannot be
pinned raises ``PinningFailed`` unless the caller allows pageable memory
(``allow_pageable=True``: then a warning, and pageable memory).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from transfer.errors import BadIndices, PinningFailed
from transfer.indices import as_index_array, page_ids, page_list, slots_of_pages
from transfer.log import get_logger
from transfer.page_set import PageSet

log = get_logger(__name__)

#: host pools kept pinned under an abandoned copy (``HostPool.keep_pinned``): alive until exit
_KEPT: list = []


def _cudart():
    """The CUDA runtime bindings torch ships (``cudaHostRegister`` / ``cudaHostUnregister``); None
    without a usable CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.cudart()


def _register(buffer: torch.Tensor) -> str | None:
    """Page-lock ``buffer``'s exact bytes for the GPU (``cudaHostRegister``, as SGLang's host pool
    does: torch's ``pin_memory=True`` goes through the caching host allocator, which rounds one big
    buffer up to a power of two). Returns None when registered, else why not."""
    cudart = _cudart()
    if cudart is None:
        return "CUDA is not available"
    nbytes = buffer.numel() * buffer.element_size()
    rc = int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0))
    if rc != 0:
        return f"cudaHostRegister of {nbytes} bytes failed (rc={rc}, {cudart.cudaGetErrorString(rc)})"
    return None


def _unregister(buffer: torch.Tensor) -> None:
    """``cudaHostUnregister`` of ``buffer`` (kept alive until then by the finalizer holding it); a
    failure is logged (at shutdown there is nothing else to do)."""
    cudart = _cudart()
    if cudart is None:
        return
    rc = int(cudart.cudaHostUnregister(buffer.data_ptr()))
    if rc != 0:
        log.warning("host_pool.unregister_failed", rc=rc, error=str(cudart.cudaGetErrorString(rc)))


def _host_buffer(shape: tuple[int, ...], dtype: torch.dtype, pin: bool | None,
                 allow_pageable: bool) -> tuple[torch.Tensor, bool]:
    """The zeroed host buffer and whether it is registered (pinned)."""
    want_pin = torch.cuda.is_available() if pin is None else pin
    buffer = torch.zeros(shape, dtype=dtype)
    if not want_pin:
        return buffer, False
    why = _register(buffer)
    if why is None:
        return buffer, True
    nbytes = buffer.numel() * buffer.element_size()
    if not allow_pageable:
        del buffer
        raise PinningFailed(
            f"cannot pin the {nbytes}-byte host pool ({why}); pass allow_pageable=True to run on pageable "
            f"memory, where every device->host copy blocks the scheduler thread")
    log.warning("host_pool.pin_failed", error=why, bytes=nbytes, fallback="pageable")
    return buffer, False


class HostPool:
    """Host token slots in whole pages; host token index ``i`` lies on page ``i // page_size``.

    Args:
        layers, heads, head_dim, dtype: as the device ``KVPool``.
        page_size: tokens per page.
        tokens: capacity, a positive multiple of ``page_size``.
        mla: latent-only layout.
        pin: pin the buffer (None: when CUDA is available), at its exact size.
        allow_pageable: when pinning fails, warn and use pageable memory instead of raising.
    Raises:
        ValueError: bad sizes.
        PinningFailed: pinning was asked for (or CUDA is available) and failed, and
            ``allow_pageable`` is False; nothing stays allocated.
    """

    def __init__(
        self,
        layers: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        page_size: int,
        tokens: int,
        mla: bool = False,
        pin: bool | None = None,
        allow_pageable: bool = False,
    ) -> None:
        if page_size < 1 or tokens < page_size or tokens % page_size:
            raise ValueError(f"tokens ({tokens}) must be a positive multiple of page_size ({page_size})")
        if mla and heads != 1:
            raise ValueError(f"an MLA pool has one latent head, got heads={heads}")
        self.layers, self.heads, self.head_dim, self.dtype = layers, heads, head_dim, dtype
        self.page_size, self.size, self.mla = page_size, tokens, mla
        self.kinds = 1 if mla else 2
        self.num_pages = tokens // page_size
        self.buffer, self.pinned = _host_buffer(
            (self.num_pages, self.kinds, page_size, layers, heads, head_dim), dtype, pin, allow_pageable
        )
        # unregistered on close, or when the pool is collected (before its buffer is freed); never
        # at interpreter exit: a copy abandoned at shutdown may still write into it then, and the
        # process's end releases the registration anyway
        self._unpin = (weakref.finalize(self, _unregister, self.buffer) if self.pinned else None)
        if self._unpin is not None:
            self._unpin.atexit = False
        self.kept = False  # keep_pinned(): pinned and alive until the process ends
        self.page_nbytes = self.buffer[0].numel() * self.buffer.element_size()
        self.row_bytes = heads * head_dim * self.buffer.element_size()
        self._pages = PageSet(self.num_pages)

    def available_size(self) -> int:
        """Free host token slots."""
        return self._pages.free_count() * self.page_size

    def alloc(self, n_tokens: int) -> torch.Tensor | None:
        """Allocate ``ceil(n_tokens / page_size)`` pages.

        Returns:
            int64 host token indices, page by page; None (nothing allocated) when short.
        """
        if n_tokens < 0:
            raise ValueError(f"cannot allocate {n_tokens} tokens")
        pages = self._pages.alloc(-(-n_tokens // self.page_size))
        return None if pages is None else slots_of_pages(pages, self.page_size, ascending=True)

    def alloc_pages(self, n_pages: int) -> np.ndarray | None:
        """Allocate ``n_pages`` pages. Returns their ids (int64 numpy, strictly increasing), or None
        when short."""
        return self._pages.alloc(n_pages)

    def page_ids(self, indices: torch.Tensor) -> np.ndarray:
        """Page ids (int64 numpy) of host token ``indices`` (whole, aligned pages within the pool).

        Raises:
            BadIndices: not whole aligned pages, or outside the pool.
        """
        return page_ids(indices, self.page_size, "host indices", self.size)

    def page_list(self, indices: torch.Tensor) -> list[int]:
        """``page_ids`` as a list of ints (short ones checked in Python: ``indices.page_list``).

        Raises:
            BadIndices: not whole aligned pages, or outside the pool.
        """
        return page_list(as_index_array(indices, "host indices"), self.page_size, "host indices", self.size)

    def pages_of(self, indices: torch.Tensor) -> torch.Tensor:
        """``page_ids`` as an int64 tensor.

        Raises:
            BadIndices: not whole aligned pages, or outside the pool.
        """
        return torch.from_numpy(self.page_ids(indices).copy())

    def is_held(self, pages: torch.Tensor | np.ndarray) -> bool:
        """Whether every page id in ``pages`` is allocated."""
        return self._pages.is_held(pages.numpy() if isinstance(pages, torch.Tensor) else pages)

    def free(self, indices: torch.Tensor) -> int:
        """Free the pages of host token ``indices`` (as returned by ``alloc``).

        Returns:
            Pages freed.
        Raises:
            BadIndices: not whole aligned pages. NotAllocated / DoubleFree: see ``PageSet.free``.
            On any error nothing changes.
        """
        return self._pages.free(self.page_ids(indices))

    def free_pages(self, pages: np.ndarray | list[int]) -> int:
        """Free page ids (as returned by ``alloc_pages``, or a list of ints); errors as ``free``,
        nothing changes."""
        return self._pages.free(pages)

    def page_view(self, page: int) -> torch.Tensor:
        """Page ``page`` as ``[kinds, page_size, layers, heads, head_dim]`` (a view)."""
        if not 0 <= page < self.num_pages:
            raise BadIndices(f"host page {page} outside 0..{self.num_pages - 1}")
        return self.buffer[page]

    def page_bytes(self, page: int) -> torch.Tensor:
        """Page ``page``'s raw bytes (a contiguous uint8 view, ``page_nbytes`` long)."""
        return self.page_view(page).reshape(-1).view(torch.uint8)

    def check_integrity(self) -> None:
        """Raise IntegrityError unless free + held pages == total pages."""
        self._pages.check_integrity()

    def close(self) -> None:
        """Unpin the buffer (``cudaHostUnregister``) once nothing copies into it any more (the
        offloader and prefix loader are closed). Idempotent; the pool's memory stays readable,
        pageable from now on. After ``keep_pinned`` it does nothing."""
        if self._unpin is not None and not self.kept:
            self._unpin()
            self.pinned = False

    def keep_pinned(self) -> None:
        """A copy abandoned at shutdown may still write into the buffer (one cannot be cancelled):
        keep it pinned and allocated until the process ends. ``close`` does nothing from now on,
        the pool is never unpinned when collected nor at interpreter exit, and the pool is held
        by this module so its memory is never freed under the copy. Idempotent; a pageable pool is
        held too (its memory may be the copy's destination all the same)."""
        if self.kept:
            return
        self.kept = True
        if self._unpin is not None:
            self._unpin.detach()
        _KEPT.append(self)
