"""Index helpers shared by the pools: validation, token slots <-> pages.

Validation of a chunk's indices is on the scheduler thread's hot path, so it runs on a zero-copy
numpy view of the CPU tensor (a few C calls, no per-slot Python loop, no small torch ops).
"""

from __future__ import annotations

import numpy as np
import torch

from transfer.errors import BadIndices

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)
_NO_PAGES = np.empty(0, dtype=np.int64)
_NO_PAGES.flags.writeable = False


def on_host(t: torch.Tensor | np.ndarray) -> bool:
    """Whether ``t``'s values can be read on the calling thread for free: host memory (a NumPy
    array always). A CUDA tensor's cannot (reading one waits for its stream: a device -> host
    sync), nor can a tensor that declares itself device-resident (``device_resident = True``: the
    test kit's stand-in for device memory on a machine without a GPU,
    ``lifecycle_tools.testkit.sync_trap``)."""
    if type(t) is np.ndarray:
        return True
    return t.is_cpu and not (type(t) is not torch.Tensor and getattr(t, "device_resident", False))


def as_tensor(ids) -> torch.Tensor:
    """``ids`` as a tensor: a NumPy array wrapped (no copy), a tensor as it is. A copy plan takes
    either, so the scheduler thread hands the copy worker NumPy ids and the wrapping is done there."""
    return torch.from_numpy(ids) if isinstance(ids, np.ndarray) else ids


def _check_int_1d(indices, what: str) -> None:
    """A 1-D tensor of an integer dtype, or ``BadIndices`` naming ``what`` (reads no values)."""
    if not isinstance(indices, torch.Tensor):
        raise BadIndices(f"{what} must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype not in _INT_DTYPES:
        raise BadIndices(f"{what} must have an integer dtype, got {indices.dtype}")
    if indices.dim() != 1:
        raise BadIndices(f"{what} must be 1-D, got shape {tuple(indices.shape)}")


def check_device_indices(indices: torch.Tensor, page_size: int, what: str = "indices") -> None:
    """What can be checked of device-resident slot ids without reading them: an integer dtype,
    1-D, a whole number of pages. Their values (aligned pages, range) are checked where the copy
    runs (``transfer.gather.ChunkCopy(check_end=...)``).

    Raises:
        BadIndices: not a tensor, not an integer dtype, not 1-D, or not a whole number of pages.
    """
    _check_int_1d(indices, what)
    if indices.shape[0] % page_size:
        raise BadIndices(f"{what}: {indices.shape[0]} slots is not a whole number of pages of {page_size}")


def as_index_array(indices: torch.Tensor | np.ndarray, what: str = "indices") -> np.ndarray:
    """Validate host-memory slot ids (a 1-D integer NumPy array or tensor) and return them as a
    1-D int64 NumPy array (itself or a view when already so; reads no values).

    Raises:
        BadIndices: neither a NumPy array nor a tensor, not an integer dtype, or not 1-D.
    """
    if type(indices) is np.ndarray:
        if indices.dtype.kind not in "iu":
            raise BadIndices(f"{what} must have an integer dtype, got {indices.dtype}")
        if indices.ndim != 1:
            raise BadIndices(f"{what} must be 1-D, got shape {indices.shape}")
        return indices if indices.dtype == np.int64 else indices.astype(np.int64)
    return as_index_tensor(indices, what).numpy()


def as_index_tensor(indices: torch.Tensor, what: str = "indices") -> torch.Tensor:
    """Validate ``indices`` and return them as a 1-D int64 CPU tensor (itself when already so).

    Raises:
        BadIndices: not a tensor, not an integer dtype, or not 1-D.
    """
    _check_int_1d(indices, what)
    if indices.dtype is torch.int64 and indices.device.type == "cpu":
        return indices  # already what we want: no ``.to`` call on the hot path
    return indices.to(device="cpu", dtype=torch.int64)


def one_run(ids: list[int]) -> bool:
    """Whether ``ids`` (a non-empty list of ints) are one run of consecutive ids, ascending."""
    first, n = ids[0], len(ids)
    return ids[-1] == first + n - 1 and ids == list(range(first, first + n))


def slots_of_pages(pages: torch.Tensor | np.ndarray | list[int], page_size: int,
                   ascending: bool = False) -> torch.Tensor:
    """Every token slot of ``pages`` (int64 tensor), page by page in order: ``slots_array`` wrapped."""
    return torch.from_numpy(slots_array(pages, page_size, ascending))


def slots_array(pages: torch.Tensor | np.ndarray | list[int], page_size: int,
                ascending: bool = False) -> np.ndarray:
    """Every token slot of ``pages`` (int64 NumPy), page by page in order.

    ``ascending=True`` promises the ids strictly increase (what ``PageSet.alloc`` returns), so one
    run of consecutive pages is recognised from its ends alone. A list of ints (pages a caller
    already holds as Python ints) is recognised as one run in Python, whatever it promises.
    """
    if type(pages) is list:
        if pages and one_run(pages):
            return _run_slots(pages[0], len(pages), page_size)
        pages = np.asarray(pages, dtype=np.int64)
    p = pages.numpy() if isinstance(pages, torch.Tensor) else pages
    n = p.shape[0]
    if n and int(p[-1]) - int(p[0]) == n - 1 and (ascending or n < 3 or bool((p[1:] > p[:-1]).all())):
        return _run_slots(int(p[0]), n, page_size)  # one run of consecutive pages (what the pools hand out)
    return (p.reshape(-1, 1) * page_size + np.arange(page_size)).reshape(-1)


def host_slots_array(pages: list[int], page_size: int) -> np.ndarray:
    """``slots_array`` of a non-empty list of pages, read-only (host indices the offloader hands
    out and trusts while they stay so)."""
    out = slots_array(pages, page_size)
    out.flags.writeable = False
    return out


def _run_slots(first_page: int, n: int, page_size: int) -> np.ndarray:
    """The slots of the ``n`` pages from ``first_page`` on."""
    first = first_page * page_size
    return np.arange(first, first + n * page_size, dtype=np.int64)


def page_ids(
    indices: torch.Tensor, page_size: int, what: str = "indices", end: int | None = None
) -> np.ndarray:
    """The page ids of ``indices``, which must be whole pages, each page's slots consecutive.

    Args:
        indices: 1-D integer tensor (or NumPy array) of token slots.
        page_size: slots per page.
        what: the argument's name, for error messages.
        end: when given, every slot must lie in ``0 .. end-1``.
    Returns:
        int64 page ids (numpy), one per page, in order (repeated if the caller repeated a page).
    Raises:
        BadIndices: not an integer 1-D tensor, length not a multiple of ``page_size``, a page not
            laid out as ``[p*page_size, ..., p*page_size + page_size - 1]``, or out of range.
    """
    return pages_of_slots(as_index_array(indices, what), page_size, what, end)


def pages_of_slots(a: np.ndarray, page_size: int, what: str = "indices", end: int | None = None) -> np.ndarray:
    """``page_ids`` of slots already as a 1-D int64 numpy array (see ``page_ids``)."""
    n = a.shape[0]
    if n % page_size:
        raise BadIndices(f"{what}: {n} slots is not a whole number of pages of {page_size}")
    if n == 0:
        return _NO_PAGES
    first = int(a[0])
    if first % page_size == 0 and a.tobytes() == np.arange(first, first + n, dtype=np.int64).tobytes():
        lo, hi = first, first + n - 1  # one run of consecutive pages (the common chunk)
        pages = np.arange(first // page_size, (first + n) // page_size, dtype=np.int64)
    else:
        grid = a.reshape(-1, page_size)
        starts = grid[:, 0]
        if (starts % page_size).any() or not np.array_equal(grid, starts[:, None] + np.arange(page_size)):
            raise BadIndices(f"{what} are not whole, page-aligned pages of {page_size} slots")
        pages = starts // page_size
        lo, hi = int(starts.min()), int(starts.max()) + page_size - 1
    if end is not None and (lo < 0 or hi >= end):
        raise BadIndices(f"{what} must lie in 0..{end - 1}")
    return pages


_LIST_CHECK = 512  # slots: a chunk this short is checked as one Python list (one C call)


def count_pages(a: np.ndarray, page_size: int, what: str = "indices", end: int | None = None) -> int:
    """How many pages the slots ``a`` (1-D int64 numpy) hold, checked as ``pages_of_slots`` checks
    them. A chunk of one run of consecutive slots up to ``_LIST_CHECK`` long (a decode chunk) is
    checked as a Python list: one C call on the scheduler thread instead of several small numpy
    ones, each of which costs more than the check itself when the caches are cold.

    Raises:
        BadIndices: as ``pages_of_slots``.
    """
    n = a.shape[0]
    if 0 < n <= _LIST_CHECK and not n % page_size:
        ids = a.tolist()
        first = ids[0]
        if not first % page_size and one_run(ids):
            if end is not None and (first < 0 or first + n > end):
                raise BadIndices(f"{what} must lie in 0..{end - 1}")
            return n // page_size
    return pages_of_slots(a, page_size, what, end).shape[0]


def page_list(a: np.ndarray, page_size: int, what: str = "indices", end: int | None = None) -> list[int]:
    """``pages_of_slots(a, ...).tolist()``: the page ids of the slots ``a`` (1-D int64 numpy), checked
    the same way. Up to ``_LIST_CHECK`` slots (several ops' host pages freed in one call) they are
    checked page by page on one Python list: one C call, where the NumPy check costs a dozen.

    Raises:
        BadIndices: as ``pages_of_slots``.
    """
    n = a.shape[0]
    if n > _LIST_CHECK or n % page_size or not n:
        return pages_of_slots(a, page_size, what, end).tolist()
    ids = a.tolist()
    pages = []
    last = page_size - 1
    for i in range(0, n, page_size):
        f = ids[i]
        if f % page_size or ids[i + last] != f + last or ids[i:i + page_size] != list(range(f, f + page_size)):
            raise BadIndices(f"{what} are not whole, page-aligned pages of {page_size} slots")
        pages.append(f // page_size)
    if end is not None and (min(pages) < 0 or (max(pages) + 1) * page_size > end):
        raise BadIndices(f"{what} must lie in 0..{end - 1}")
    return pages


def pages_of_aligned(indices: torch.Tensor, page_size: int, what: str = "indices") -> torch.Tensor:
    """``page_ids`` as an int64 tensor (no range check).

    Raises:
        BadIndices: as ``page_ids``.
    """
    return torch.from_numpy(page_ids(indices, page_size, what).copy())
