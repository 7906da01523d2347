"""Strict, recording doubles of the scheduler's objects (SGLang-shaped) for lifecycle tests.

They are not mocks of the system under test: they stand in for the scheduler that *calls* the
manager, and they behave like the real pools (``transfer.ReqToTokenPool``,
``transfer.PagedTokenAllocator``, SGLang's): a freed slot or row is really free (and can be handed
out again), a freed row is poisoned (-1) until it is reused, and any misuse raises the real typed
errors (``transfer.DoubleFree``, ``transfer.NotAllocated``) with nothing changed. Each pool also
offers ``check_free`` (raise as ``free`` would, change nothing), which the manager's default release
sink calls before it frees anything.
"""

from __future__ import annotations

import torch

from lifecycle_tools.testkit.memory import InMemoryOffloader
from transfer.errors import DoubleFree, NotAllocated

ROWS, WIDTH = 6, 64
POISON = -1  # what a freed row's entries read until the row is handed out again

__all__ = ["DoubleFree", "NotAllocated", "POISON", "KV", "Req", "EffectiveReq", "ReqToTokenPool",
           "PagedAllocator", "TrackingOffloader", "Pools"]


class KV:
    def __init__(self, row, committed, allocated):
        self.req_pool_idx = row
        self.kv_committed_len = committed
        self.kv_allocated_len = allocated


class Req:
    """A decode request: KV exists for ``origin_input_ids + output_ids[:-1]``."""

    def __init__(self, rid, prompt, row, *, outputs=(9000,), spec=0, finished=False):
        self.rid = rid
        self.origin_input_ids = list(prompt)
        self.output_ids = list(outputs)
        committed = len(self.origin_input_ids) + max(len(self.output_ids) - 1, 0)
        self.kv = KV(row, committed, committed + spec)
        self.spec = spec
        self._finished = finished

    def finished(self):
        return self._finished

    def decode(self, token):
        """One decode step: the last token's KV is written, a new token is sampled."""
        self.kv.kv_committed_len += 1
        self.kv.kv_allocated_len = self.kv.kv_committed_len + self.spec
        self.output_ids.append(token)

    def finish(self):
        self._finished = True


class EffectiveReq(Req):
    """A request whose effective committed length differs from ``kv.kv_committed_len``."""

    def __init__(self, *args, effective, **kwargs):
        super().__init__(*args, **kwargs)
        self.effective = effective

    def effective_kv_committed_len(self):
        return self.effective


class CountingReq(Req):
    """Counts how often the manager reads the effective committed length (``reads``)."""

    reads = 0

    def effective_kv_committed_len(self):
        self.reads += 1
        return self.kv.kv_committed_len


class ReqToTokenPool:
    """Row r maps position p to slot ``r * width + p`` (pages never straddle rows).

    Every row starts held (tests place requests on rows directly); ``free(req)`` returns the row,
    poisons it and sets ``req.kv.req_pool_idx = None`` like SGLang's pool; ``alloc()`` hands a
    freed row out again with its slots restored.
    """

    def __init__(self, rows=8, width=256):
        self.req_to_token = (
            torch.arange(rows * width, dtype=torch.int32).reshape(rows, width)
        )
        self.width = width
        self.freed_rows: list[int] = []
        self.free_rows: list[int] = []

    def _row(self, req) -> int:
        row = getattr(getattr(req, "kv", None), "req_pool_idx", None)
        if not isinstance(row, int) or isinstance(row, bool) or not 0 <= row < self.req_to_token.shape[0]:
            raise NotAllocated(f"request holds no row (req_pool_idx={row!r})")
        if row in self.free_rows:
            raise DoubleFree(f"row {row} freed twice")
        return row

    def check_free(self, req) -> None:
        """Raise as ``free(req)`` would; change nothing."""
        self._row(req)

    def free(self, req):
        row = self._row(req)
        self.freed_rows.append(row)
        self.free_rows.append(row)
        self.req_to_token[row].fill_(POISON)
        req.kv.req_pool_idx = None

    def alloc(self) -> int | None:
        """A freed row, its slots restored (None when no row was freed)."""
        if not self.free_rows:
            return None
        row = self.free_rows.pop(0)
        self.req_to_token[row] = torch.arange(row * self.width, (row + 1) * self.width, dtype=torch.int32)
        return row


class PagedAllocator:
    """Frees whole pages. Every slot starts allocated; ``alloc_pages`` hands freed pages out again.

    ``free`` raises (nothing freed) on a page already free (``DoubleFree``) or outside the pool
    (``NotAllocated``, negative slots included).
    """

    def __init__(self, page_size=1, total_slots=8 * 256):
        self.page_size = page_size
        self.total_pages = total_slots // page_size
        self.held = set(range(self.total_pages))
        self.freed_pages: list[int] = []
        self.calls: list[torch.Tensor] = []

    def _pages(self, indices) -> list[int]:
        assert indices.dtype == torch.int64
        pages = sorted(set((indices // self.page_size).tolist()))
        outside = [p for p in pages if not 0 <= p < self.total_pages]
        if outside:
            raise NotAllocated(f"pages {outside} are outside the pool")
        again = [p for p in pages if p not in self.held]
        if again:
            raise DoubleFree(f"pages {again} freed twice")
        return pages

    def check_free(self, indices) -> None:
        """Raise as ``free(indices)`` would; change nothing."""
        self._pages(indices)

    def free(self, indices):
        pages = self._pages(indices)
        self.held.difference_update(pages)
        self.freed_pages.extend(pages)
        self.calls.append(indices.clone())

    def alloc_pages(self, pages) -> None:
        """Hand the given free pages out again (a later request now holds them)."""
        taken = [p for p in pages if p in self.held]
        assert not taken, f"pages {taken} are not free"
        self.held.update(pages)

    def slots_freed(self):
        return sorted(s for p in self.freed_pages for s in range(p * self.page_size, (p + 1) * self.page_size))


class TrackingOffloader(InMemoryOffloader):
    """Remembers which device slots each pending copy reads."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.reading: dict[int, set[int]] = {}

    def write(self, device_indices, ack_id):
        host = super().write(device_indices, ack_id)
        if host is not None:
            self.reading[ack_id] = set(device_indices.tolist())
        return host

    def land(self, ack_ids=None):
        ids = list(self.pending_writes) if ack_ids is None else list(ack_ids)
        super().land(ids)
        for ack in ids:
            del self.reading[ack]


class Pools:
    """Rows and pages that must be freed exactly once, never under a pending copy.

    Serves as both the ``req_to_token_pool`` and the allocator of the model check. A freed row is
    poisoned until ``alloc_row`` hands it out again; freeing a page twice, a page not held, a row
    not held, or a slot a pending copy reads raises (the last as an AssertionError: the manager
    broke its central rule) with nothing changed.
    """

    def __init__(self, page_size, offloader):
        self.page_size = page_size
        self.off = offloader
        self.req_to_token = torch.arange(ROWS * WIDTH, dtype=torch.int32).reshape(ROWS, WIDTH)
        self.free_rows = list(range(ROWS))
        self.held_pages: set[int] = set()

    def _pages(self, row):
        return range(row * WIDTH // self.page_size, (row + 1) * WIDTH // self.page_size)

    def can_alloc(self):
        """A row maps to fixed slots here, so a row is free only when none of its pages is held
        (a quarantined page stays held after its row is freed, until the stuck copy ends)."""
        return any(self.held_pages.isdisjoint(self._pages(r)) for r in self.free_rows)

    def alloc_row(self):
        row = next(r for r in reversed(self.free_rows) if self.held_pages.isdisjoint(self._pages(r)))
        self.free_rows.remove(row)
        self.held_pages.update(self._pages(row))
        self.req_to_token[row] = torch.arange(row * WIDTH, (row + 1) * WIDTH, dtype=torch.int32)
        return row

    def _check_slots(self, arg) -> set[int]:
        slots = set(arg.tolist())
        for ack, reading in self.off.reading.items():
            assert not slots & reading, f"slots freed while copy {ack} reads them"
        if any(s < 0 for s in slots):
            raise NotAllocated(f"negative slot ids {sorted(s for s in slots if s < 0)}")
        pages = {s // self.page_size for s in slots}
        if not pages <= self.held_pages:
            raise DoubleFree(f"pages {sorted(pages - self.held_pages)} freed twice")
        return pages

    def _check_row(self, req) -> int:
        row = req.kv.req_pool_idx
        if not isinstance(row, int) or not 0 <= row < ROWS:
            raise NotAllocated(f"request holds no row ({row!r})")
        if row in self.free_rows:
            raise DoubleFree(f"row {row} freed twice")
        return row

    def check_free(self, arg) -> None:
        """Raise as ``free(arg)`` would; change nothing."""
        if isinstance(arg, torch.Tensor):
            self._check_slots(arg)
        else:
            self._check_row(arg)

    def free(self, arg):
        if isinstance(arg, torch.Tensor):
            self.held_pages -= self._check_slots(arg)
        else:
            row = self._check_row(arg)
            self.free_rows.append(row)
            self.req_to_token[row].fill_(POISON)
            arg.kv.req_pool_idx = None
