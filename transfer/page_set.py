"""Page bookkeeping shared by the device allocator and the host pool.

A page is never-allocated, held, or free-after-release. Frees are validated in full before any
state changes, so a bad free (double free, never-allocated page, out of range) changes nothing.
State lives in numpy arrays: a chunk's alloc or free is a handful of C calls (no small torch ops,
no per-page Python loop).
"""

from __future__ import annotations

import numpy as np

from transfer.errors import BadIndices, DoubleFree, IntegrityError, NotAllocated

_NEVER, _HELD, _RELEASED = 0, 1, 2
_HELD_BYTES = bytes([_HELD]) * 4096  # a held run of up to this many pages compares as bytes
_LIST_PAGES = 256  # a Python list of up to this many pages is checked in Python (``_checked``)


class PageSet:
    """Allocatable pages ``first .. end-1``; pages below ``first`` are reserved (never handed out).

    Args:
        end: one past the last page id.
        first: the first allocatable page id (0, or 1 to reserve page 0 as padding).
    Raises:
        ValueError: ``end <= first`` or ``first < 0``.
    """

    def __init__(self, end: int, first: int = 0) -> None:
        if first < 0 or end <= first:
            raise ValueError(f"need 0 <= first < end, got first={first} end={end}")
        self.first, self.end = first, end
        self.total = end - first
        self._state = np.zeros(end, dtype=np.uint8)
        self._free = np.arange(first, end, dtype=np.int64)
        self._released: list[np.ndarray] = []
        self._released_count = 0

    def free_count(self) -> int:
        """Pages available to ``alloc``."""
        return self._free.shape[0] + self._released_count

    def held_count(self) -> int:
        """Pages currently handed out."""
        return self.total - self.free_count()

    def alloc(self, n_pages: int) -> np.ndarray | None:
        """Take ``n_pages`` pages (lowest ids first after a merge).

        Returns:
            int64 page ids, strictly increasing (numpy; the caller's to keep), or None (nothing taken) when fewer are free.
        Raises:
            ValueError: ``n_pages`` negative.
        """
        if n_pages < 0:
            raise ValueError(f"cannot allocate {n_pages} pages")
        if n_pages > self.free_count():
            return None
        if n_pages > self._free.shape[0]:
            self._free = np.sort(np.concatenate([self._free, *self._released]))
            self._released, self._released_count = [], 0
        got, self._free = self._free[:n_pages], self._free[n_pages:]
        if n_pages and int(got[-1]) - int(got[0]) == n_pages - 1:  # ids ascend: one run
            self._state[int(got[0]):int(got[-1]) + 1] = _HELD
        else:
            self._state[got] = _HELD
        return got

    def check_free(self, pages: np.ndarray) -> None:
        """Raise exactly what ``free(pages)`` would raise; change nothing.

        Raises:
            BadIndices, NotAllocated, DoubleFree: see ``free``.
        """
        self._checked(pages)

    def free(self, pages: np.ndarray | list[int]) -> int:
        """Release ``pages`` (numpy ids, or a list of ints; a page listed several times counts once).

        Returns:
            The number of distinct pages released.
        Raises:
            BadIndices: a page id outside ``0 .. end-1``.
            NotAllocated: a page never handed out (reserved pages included).
            DoubleFree: a page already released.
        """
        pages, lo, hi, run = self._checked(pages)
        if pages.shape[0] == 0:
            return 0
        if run:
            self._state[lo:hi + 1] = _RELEASED
        else:
            self._state[pages] = _RELEASED
        self._released.append(pages)
        self._released_count += pages.shape[0]
        return pages.shape[0]

    def _checked(self, pages) -> tuple[np.ndarray, int, int, bool]:
        """``free``'s validation: the distinct sorted pages, their lowest and highest id, and
        whether they form one run of consecutive ids; raises (see ``free``) changing nothing.
        A short Python list (several ops' host pages) is checked in Python, its states read in one
        NumPy call; any problem is then named by the NumPy check below."""
        if type(pages) is list and len(pages) <= _LIST_PAGES:
            s = sorted(set(pages))
            if s and type(s[0]) is int and type(s[-1]) is int and 0 <= s[0] and s[-1] < self.end:
                lo, hi = s[0], s[-1]
                run = hi - lo + 1 == len(s)
                state = self._state[lo:hi + 1] if run else self._state[s]
                if state.tobytes() == _HELD_BYTES[:len(s)]:
                    return np.array(s, dtype=np.int64), lo, hi, run
        pages = np.sort(np.asarray(pages, dtype=np.int64))
        if pages.shape[0] == 0:
            return pages, 0, -1, True
        if pages.shape[0] > 1 and (pages[1:] == pages[:-1]).any():
            pages = np.unique(pages)
        lo, hi = int(pages[0]), int(pages[-1])
        if lo < 0 or hi >= self.end:
            raise BadIndices(f"page ids {lo}..{hi} outside 0..{self.end - 1}")
        run = hi - lo + 1 == pages.shape[0]  # distinct and sorted: one run of consecutive ids
        state = self._state[lo:hi + 1] if run else self._state[pages]
        if (state != _HELD).any():
            never = pages[state == _NEVER]
            if never.shape[0]:
                raise NotAllocated(f"pages {never[:8].tolist()} were never allocated")
            raise DoubleFree(f"pages {pages[state == _RELEASED][:8].tolist()} are already free")
        return pages, lo, hi, run

    def holds_run(self, lo: int, hi: int) -> bool:
        """Whether every page ``lo .. hi`` (ints, ``lo <= hi``) is in range and held; changes nothing."""
        if lo < 0 or hi < lo or hi >= self.end:
            return False
        k = hi - lo + 1
        state = self._state[lo:hi + 1]
        return state.tobytes() == _HELD_BYTES[:k] if k <= len(_HELD_BYTES) else bool((state == _HELD).all())

    def is_held(self, pages: np.ndarray) -> bool:
        """Whether every page in ``pages`` (valid ids) is currently held."""
        return bool((self._state[pages] == _HELD).all())

    def check_integrity(self) -> None:
        """Raise IntegrityError unless free + held == total with no page both free and held."""
        free = np.concatenate([self._free, *self._released])
        if free.shape[0] != np.unique(free).shape[0]:
            raise IntegrityError("a page is on the free list twice")
        held = int((self._state == _HELD).sum())
        if free.shape[0] and (self._state[free] == _HELD).any():
            raise IntegrityError("a page is both free and held")
        if held + free.shape[0] != self.total:
            raise IntegrityError(f"held {held} + free {free.shape[0]} != total {self.total}")
