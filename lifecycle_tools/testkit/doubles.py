"""Strict, recording doubles of the scheduler's objects (SGLang-shaped) for lifecycle tests.

They are not mocks of the system under test: they stand in for the scheduler that *calls* the
manager, and they raise on any misuse (double free, freeing what was never allocated) so a test
fails loudly when the manager breaks a rule.
"""

from __future__ import annotations

import torch

from transfer import InMemoryOffloader

ROWS, WIDTH = 6, 64


class DoubleFree(AssertionError):
    pass


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


class ReqToTokenPool:
    """Row r maps position p to slot ``r * width + p`` (pages never straddle rows)."""

    def __init__(self, rows=8, width=256):
        self.req_to_token = (
            torch.arange(rows * width, dtype=torch.int32).reshape(rows, width)
        )
        self.width = width
        self.freed_rows: list[int] = []

    def free(self, req):
        row = req.kv.req_pool_idx
        if row in self.freed_rows:
            raise DoubleFree(f"row {row} freed twice")
        self.freed_rows.append(row)
        req.kv.req_pool_idx = None


class PagedAllocator:
    """Frees whole pages; raises on a page freed twice. Every slot starts allocated."""

    def __init__(self, page_size=1, total_slots=8 * 256):
        self.page_size = page_size
        self.held = set(range(total_slots // page_size))
        self.freed_pages: list[int] = []
        self.calls: list[torch.Tensor] = []

    def free(self, indices):
        assert indices.dtype == torch.int64
        pages = sorted(set((indices // self.page_size).tolist()))
        again = [p for p in pages if p not in self.held]
        if again:
            raise DoubleFree(f"pages {again} freed twice")
        self.held.difference_update(pages)
        self.freed_pages.extend(pages)
        self.calls.append(indices.clone())

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
    """Rows and pages that must be freed exactly once, never under a pending copy."""

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
        return row

    def free(self, arg):
        if isinstance(arg, torch.Tensor):
            slots = set(arg.tolist())
            for ack, reading in self.off.reading.items():
                assert not slots & reading, f"slots freed while copy {ack} reads them"
            pages = {s // self.page_size for s in slots}
            if not pages <= self.held_pages:
                raise DoubleFree(f"pages {sorted(pages - self.held_pages)} freed twice")
            self.held_pages -= pages
        else:
            row = arg.kv.req_pool_idx
            if row in self.free_rows:
                raise DoubleFree(f"row {row} freed twice")
            self.free_rows.append(row)
            arg.kv.req_pool_idx = None
