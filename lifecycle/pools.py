"""What a plan reads of the engine's pools: the explicit inputs of the chunk and release plans.

The manager builds one ``Pools`` when it is constructed and hands it, with its ledger, to the plans
(``requests.plan_chunk``, ``release.plan_release``) and to the one slot check they share
(``slots.check_slots``, ``slots.check_device_chunk``). A plan reads the pools and the ledger and
writes neither: it returns a plan or raises a typed refusal; the manager then applies it.
"""

from __future__ import annotations

import numpy as np
import torch

from transfer.indices import on_host


class HostRows:
    """The NumPy view of a ``req_to_token`` table in host memory, made once per table (a view
    shares the table's memory, so a write to a row is seen): the chunk and release plans slice a
    row there instead of building a view per call. ``of`` returns None for a table on a device."""

    __slots__ = ("table", "rows")

    def __init__(self) -> None:
        self.table, self.rows = None, None

    def __reduce__(self):  # a cache, not state: a copy (copy.deepcopy, pickle) starts empty and views its own table
        return HostRows, ()

    def of(self, table: torch.Tensor) -> np.ndarray | None:
        if table is not self.table:  # a pool replaced its table: view the new one
            self.rows = table.numpy() if on_host(table) else None  # an integer table: never requires grad
            self.table = table
        return self.rows


class Pools:
    """The pools and sizes every plan reads (set at construction; the pools are the engine's).

    Attributes:
        page_size: tokens per page of the hash chain (the manager's page).
        alloc_page: the allocator's page (divides ``page_size``): a release's over-allocation is
            aligned to it and the allocator is probed per page of it.
        slot_end: the device KV pool's slot count when the pools tell it without reading device
            memory (``release.slot_end``), else None.
        req_to_token_pool: the row pool (``.req_to_token``, the ``[rows, width]`` table).
        allocator: the device slot allocator (``check_free`` / ``holds_slots`` asked when it has them).
        host_rows: the table's NumPy view when it lives in host memory (``HostRows``).
    """

    __slots__ = ("page_size", "alloc_page", "slot_end", "req_to_token_pool", "allocator", "host_rows")

    def __init__(self, page_size: int, alloc_page: int, slot_end: int | None, req_to_token_pool, allocator) -> None:
        self.page_size, self.alloc_page, self.slot_end = page_size, alloc_page, slot_end
        self.req_to_token_pool, self.allocator = req_to_token_pool, allocator
        self.host_rows = HostRows()

    def table(self) -> tuple[torch.Tensor, np.ndarray | None]:
        """The ``req_to_token`` table and its NumPy view (None: the table is on a device)."""
        table = self.req_to_token_pool.req_to_token
        return table, self.host_rows.of(table)
