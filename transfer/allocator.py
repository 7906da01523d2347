"""Paged token-slot allocator for the device KV pool (SGLang ``PagedTokenToKVPoolAllocator`` semantics).

Slots are handed out in whole pages. Page 0 (slots ``0 .. page_size-1``) is reserved as padding, as
SGLang does, so a KV pool serving this allocator needs ``size_tokens + page_size`` slots and valid
slots are ``page_size .. size_tokens + page_size - 1``. Freeing any slot of a page frees that page.
"""

from __future__ import annotations

import torch

from transfer.errors import BadIndices
from transfer.indices import as_index_tensor, slots_of_pages
from transfer.page_set import PageSet


class PagedTokenAllocator:
    """Allocates device token slots page by page.

    Args:
        size_tokens: usable slots, a positive multiple of ``page_size``.
        page_size: tokens per page, >= 1.
    Raises:
        ValueError: bad sizes.
    """

    def __init__(self, size_tokens: int, page_size: int) -> None:
        if page_size < 1 or size_tokens < page_size or size_tokens % page_size:
            raise ValueError(
                f"size_tokens ({size_tokens}) must be a positive multiple of page_size ({page_size})"
            )
        self.size = size_tokens
        self.page_size = page_size
        self.total_slots = size_tokens + page_size
        self._pages = PageSet(size_tokens // page_size + 1, first=1)

    def available_size(self) -> int:
        """Free token slots (a multiple of ``page_size``)."""
        return self._pages.free_count() * self.page_size

    def alloc(self, n_tokens: int) -> torch.Tensor | None:
        """Allocate ``ceil(n_tokens / page_size)`` whole pages.

        Returns:
            int64 slot indices, ``ceil(n_tokens / page_size) * page_size`` of them, page by page;
            None (nothing allocated) when too few pages are free.
        Raises:
            ValueError: ``n_tokens`` negative.
        """
        if n_tokens < 0:
            raise ValueError(f"cannot allocate {n_tokens} tokens")
        pages = self._pages.alloc(-(-n_tokens // self.page_size))
        return None if pages is None else slots_of_pages(pages, self.page_size, ascending=True)

    def check_free(self, indices: torch.Tensor) -> None:
        """Raise exactly what ``free(indices)`` would raise, and change nothing.

        A caller that frees more than this allocator in one step (a request's slots and its row)
        checks every part first, so a refusal leaves nothing half freed.

        Raises:
            BadIndices, NotAllocated, DoubleFree: see ``free``.
        """
        self._pages.check_free(self._page_ids(indices))

    def holds_slots(self, lo: int, hi: int) -> bool:
        """Whether every slot ``lo .. hi`` (ints) lies in range on a page this allocator holds.

        The cheap form of ``check_free`` for one run of consecutive slots (a decode chunk's usual
        row): a False asks the caller to call ``check_free`` for the reason. Changes nothing.
        """
        if lo < 0 or hi < lo or hi >= self.total_slots:
            return False
        return self._pages.holds_run(lo // self.page_size, hi // self.page_size)

    def free(self, indices: torch.Tensor) -> int:
        """Free every page any of ``indices`` lies on (each page once, however often it appears).

        Returns:
            Pages freed.
        Raises:
            BadIndices: not a 1-D integer tensor, or a slot outside ``0 .. total_slots-1``.
            NotAllocated: a page never allocated (the padding page included).
            DoubleFree: a page already free. On any error nothing changes.
        """
        return self._pages.free(self._page_ids(indices))

    def _page_ids(self, indices: torch.Tensor):
        """The page of each slot (numpy int64), after validating the tensor and the slot range."""
        idx = as_index_tensor(indices).numpy()
        if idx.shape[0] and (int(idx.min()) < 0 or int(idx.max()) >= self.total_slots):
            raise BadIndices(f"slot indices must lie in 0..{self.total_slots - 1}")
        return idx // self.page_size

    def check_integrity(self) -> None:
        """Raise IntegrityError unless free + held pages == total pages."""
        self._pages.check_integrity()
