"""Request -> token-slot map (SGLang ``ReqToTokenPool``): one row of slot indices per live request.

SGLang's ``ReqToTokenPool.free(req)`` asserts ``req.req_pool_idx is not None``, returns the row and
sets ``req.req_pool_idx = None``. This pool does the same for ``req.kv.req_pool_idx`` but raises a
typed error instead of asserting.
"""

from __future__ import annotations

from typing import Any

import torch

from transfer.errors import DoubleFree, NotAllocated


class ReqToTokenPool:
    """Rows of ``max_len`` token-slot indices.

    Args:
        rows: number of rows (concurrent requests), >= 1.
        max_len: slots per row, >= 1.
        device: where ``req_to_token`` lives.
    Attributes:
        req_to_token: int32 tensor ``[rows, max_len]``.
    """

    def __init__(self, rows: int, max_len: int, device: str | torch.device = "cpu") -> None:
        if rows < 1 or max_len < 1:
            raise ValueError(f"rows ({rows}) and max_len ({max_len}) must be >= 1")
        self.size, self.max_len = rows, max_len
        self.req_to_token = torch.zeros((rows, max_len), dtype=torch.int32, device=device)
        self._free = list(range(rows - 1, -1, -1))
        self._held = [False] * rows

    def available_size(self) -> int:
        """Free rows."""
        return len(self._free)

    def alloc(self) -> int | None:
        """Take a row. Returns its index, or None when none is free."""
        if not self._free:
            return None
        row = self._free.pop()
        self._held[row] = True
        return row

    def check_free(self, req: Any) -> None:
        """Raise exactly what ``free(req)`` would raise, and change nothing (``req`` included).

        A caller that frees more than this pool in one step (a request's slots and its row)
        checks every part first, so a refusal leaves nothing half freed.

        Raises:
            NotAllocated, DoubleFree: see ``free``.
        """
        self._held_row(req)

    def free(self, req: Any) -> None:
        """Return ``req.kv.req_pool_idx`` to the pool and set it to None.

        Raises:
            NotAllocated: the index is None/-1 or outside the pool (row never held by ``req``).
            DoubleFree: the row is already free. On any error nothing changes.
        """
        row = self._held_row(req)
        self._held[row] = False
        self._free.append(row)
        req.kv.req_pool_idx = None

    def _held_row(self, req: Any) -> int:
        """``req``'s row as an int, if this pool holds it (see ``free`` for what is raised)."""
        row = req.kv.req_pool_idx
        try:
            index = None if row is None or isinstance(row, bool) else int(row)
        except (TypeError, ValueError):
            index = None
        if index is None or not 0 <= index < self.size:
            raise NotAllocated(f"request holds no row (req_pool_idx={row!r})")
        row = index
        if not self._held[row]:
            raise DoubleFree(f"row {row} is already free")
        return row
