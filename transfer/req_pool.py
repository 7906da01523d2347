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

    def free(self, req: Any) -> None:
        """Return ``req.kv.req_pool_idx`` to the pool and set it to None.

        Raises:
            NotAllocated: the index is None/-1 or outside the pool (row never held by ``req``).
            DoubleFree: the row is already free. On any error nothing changes.
        """
        row = req.kv.req_pool_idx
        if row is None or isinstance(row, bool) or not 0 <= int(row) < self.size:
            raise NotAllocated(f"request holds no row (req_pool_idx={row!r})")
        row = int(row)
        if not self._held[row]:
            raise DoubleFree(f"row {row} is already free")
        self._held[row] = False
        self._free.append(row)
        req.kv.req_pool_idx = None
