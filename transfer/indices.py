"""Index helpers shared by the pools: validation, token slots <-> pages."""

from __future__ import annotations

import torch

from transfer.errors import BadIndices


def as_index_tensor(indices: torch.Tensor, what: str = "indices") -> torch.Tensor:
    """Validate ``indices`` and return them as a 1-D int64 CPU tensor.

    Raises:
        BadIndices: not a tensor, not an integer dtype, or not 1-D.
    """
    if not isinstance(indices, torch.Tensor):
        raise BadIndices(f"{what} must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise BadIndices(f"{what} must have an integer dtype, got {indices.dtype}")
    if indices.dim() != 1:
        raise BadIndices(f"{what} must be 1-D, got shape {tuple(indices.shape)}")
    return indices.to(device="cpu", dtype=torch.int64)


def slots_of_pages(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Every token slot of ``pages`` (int64), page by page in order."""
    offsets = torch.arange(page_size, dtype=torch.int64)
    return (pages.view(-1, 1) * page_size + offsets).reshape(-1)


_SMALL = 1024  # slots: below this, validate in Python


def pages_of_aligned(indices: torch.Tensor, page_size: int, what: str = "indices") -> torch.Tensor:
    """The pages of ``indices``, which must be whole pages, each page's slots consecutive in order.

    Returns:
        int64 page ids, one per page, in order (may repeat if the caller repeated a page).
    Raises:
        BadIndices: length not a multiple of ``page_size`` or a page not laid out as
            ``[p*page_size, ..., p*page_size + page_size - 1]``.
    """
    idx = as_index_tensor(indices, what)
    if idx.numel() % page_size:
        raise BadIndices(f"{what}: {idx.numel()} slots is not a whole number of pages of {page_size}")
    if idx.numel() <= _SMALL:  # a chunk: plain Python beats a handful of tiny tensor ops
        slots = idx.tolist()
        pages = []
        for i in range(0, len(slots), page_size):
            first = slots[i]
            if first % page_size or slots[i : i + page_size] != list(range(first, first + page_size)):
                raise BadIndices(f"{what} are not whole, page-aligned pages of {page_size} slots")
            pages.append(first // page_size)
        return torch.tensor(pages, dtype=torch.int64)
    grid = idx.view(-1, page_size)
    pages = grid[:, 0] // page_size
    if not torch.equal(grid, slots_of_pages(pages, page_size).view(-1, page_size)):
        raise BadIndices(f"{what} are not whole, page-aligned pages of {page_size} slots")
    return pages
