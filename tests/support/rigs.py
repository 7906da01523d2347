"""The two rigs the lifecycle's rule and refusal tests run on, behind one interface.

* ``doubles``: the strict recording doubles of ``lifecycle_tools.testkit.doubles`` (row ``r`` maps
  position ``p`` to slot ``r * width + p``, every row and page starts held except page 0, the
  padding page, as in SGLang and ``transfer.PagedTokenAllocator``; requests get rows from 1 up).
* ``real-pools``: ``tests.support.real_rig.Rig``: ``transfer.ReqToTokenPool`` and
  ``transfer.PagedTokenAllocator``, whose rows hold the slot ids the allocator handed out.

Both run a real ``DecodeOffloadManager`` over an ``InMemoryOffloader`` whose copies land when told.
A test takes the ``rig`` fixture (``tests/lifecycle/conftest.py``: ids ``doubles`` and
``real-pools``) and builds variants of the same kind with ``rig.variant(...)``.
"""

from __future__ import annotations

import torch

from lifecycle import DecodeOffloadManager
from lifecycle_tools.testkit import doubles
from tests.support.real_rig import Clock, Rig
from lifecycle_tools.testkit.memory import InMemoryOffloader
from transfer import DoubleFree, NotAllocated, PagedTokenAllocator


class _Common:
    """What both rigs share: requests, decode steps, landings and everything observable."""

    kind: str
    mgr: DecodeOffloadManager
    off: InMemoryOffloader

    decode = Rig.decode        # the real rig's decode steps and progress check, for both kinds
    progress = Rig.progress

    def land_all(self):
        self.off.land()
        self.mgr.check_offload_progress()

    def slots_of(self, req, n=None):
        """The slot ids ``req``'s row lists at positions ``[0, n)`` (default: its allocated length), int64."""
        n = req.kv.kv_allocated_len if n is None else n
        return self.pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64).clone()

    def observe(self, req=None):
        """Everything a scheduler (or an operator) can observe: pools, rows, host pool, manager."""
        return (self.pools_view(), self.pool.req_to_token.clone().tolist(),
                None if req is None else req.kv.req_pool_idx, self.off.host_free_pages(),
                sorted(self.off.pending_writes), self.mgr.snapshot(), self.mgr.stats())

    def manager(self, offloader=None, **kw):
        """Another manager over this rig's pools (its own offloader unless given)."""
        off = offloader or InMemoryOffloader(page_size=self.page_size, host_pages=64, auto_land=False)
        return DecodeOffloadManager(self.pool, self.alloc, page_size=self.page_size, offloader=off, **kw)


class DoublesRig(_Common):
    """A manager over ``lifecycle_tools.testkit.doubles``' row pool and paged allocator."""

    kind = "doubles"

    def __init__(self, page_size=4, stride=None, host_pages=256, alloc_page=None, seed=None, offloader=None):
        self.page_size = page_size
        self.pool = doubles.ReqToTokenPool()
        self.alloc = doubles.PagedAllocator(page_size=alloc_page or page_size)
        self.alloc.held.discard(0)  # page 0 is padding: never handed out (as SGLang's allocators)
        self.off = offloader or InMemoryOffloader(page_size=page_size, host_pages=host_pages, auto_land=False)
        self.clock = Clock()
        self.mgr = DecodeOffloadManager(self.pool, self.alloc, page_size=page_size, offloader=self.off,
                                        offload_stride=stride, namespace_seed=seed, clock=self.clock)
        self._rows = iter(range(1, self.pool.req_to_token.shape[0]))

    def variant(self, **kw):
        return DoublesRig(**kw)

    def admit(self, rid, prompt, room=None, *, outputs=(7000,), spec=0, tokens=None, finished=False):
        """A request with ``prompt`` prompt tokens on a fresh row (``room`` is the real rig's: every
        slot of a doubles row is held already)."""
        tokens = [1000 + i for i in range(prompt)] if tokens is None else tokens
        return doubles.Req(rid, tokens, row=next(self._rows), outputs=outputs, spec=spec, finished=finished)

    def regrant(self, req):
        """The scheduler gives ``req`` (released) its row and pages again, as a retract-and-resume does."""
        row = self.pool.alloc()
        self.alloc.alloc_pages(sorted({int(s) // self.alloc.page_size for s in self.pool.req_to_token[row].tolist()}
                                      - self.alloc.held))
        req.kv.req_pool_idx = row

    def pools_view(self):
        return (sorted(self.alloc.held), list(self.alloc.freed_pages), list(self.pool.freed_rows),
                list(self.pool.free_rows))

    def free_slot_count(self) -> int:
        return (self.alloc.total_pages - len(self.alloc.held)) * self.alloc.page_size

    def free_row_count(self) -> int:
        return len(self.pool.free_rows)

    def is_free(self, slots) -> bool:
        """Every page of ``slots`` is free."""
        return not {int(s) // self.alloc.page_size for s in slots.tolist()} & self.alloc.held

    def is_held(self, slots) -> bool:
        """Every page of ``slots`` is held."""
        return {int(s) // self.alloc.page_size for s in slots.tolist()} <= self.alloc.held

    def stray_free_page(self):
        """The slots of one page the scheduler has just given back (of the pool's last row)."""
        last = self.pool.req_to_token.shape[0] - 1
        slots = torch.arange(last * self.pool.width, last * self.pool.width + self.page_size, dtype=torch.int64)
        self.alloc.free(slots)
        return slots

    def never_allocated_page(self):
        """The slots of a page outside the pool (the doubles' "never allocated")."""
        start = self.alloc.total_pages * self.alloc.page_size
        return torch.arange(start, start + self.page_size, dtype=torch.int64)

    def take_slots(self, n):
        """Another request takes ``n`` slots of freed pages (lowest first); returns them."""
        free = sorted(set(self.alloc.freed_pages) - self.alloc.held)
        pages = free[: -(-n // self.alloc.page_size)]
        self.alloc.alloc_pages(pages)
        ps = self.alloc.page_size
        return torch.tensor([p * ps + i for p in pages for i in range(ps)], dtype=torch.int64)

    def row_already_free(self, row) -> str:
        """How this row pool words freeing row ``row`` again."""
        return f"row {row} freed twice"

    def check_integrity(self):
        self.mgr.check_integrity()


class RealPoolsRig(Rig, _Common):
    """``tests.support.real_rig.Rig`` with the shared interface."""

    kind = "real-pools"

    def __init__(self, page_size=4, stride=None, host_pages=256, alloc_page=None, seed=None, offloader=None,
                 rows=4, width=64):
        alloc = PagedTokenAllocator(rows * width, alloc_page) if alloc_page else None
        super().__init__(page_size, stride=stride, host_pages=host_pages, rows=rows, width=width,
                         offloader=offloader, alloc=alloc, namespace_seed=seed)

    def variant(self, **kw):
        return RealPoolsRig(**kw)

    def admit(self, rid, prompt, room=None, *, outputs=(7000,), spec=0, tokens=None, finished=False):
        """A request with ``prompt`` prompt tokens on a fresh row holding ``room`` slots (default:
        its allocated length rounded up to a page, at least one page past the prompt)."""
        committed = prompt + max(len(outputs) - 1, 0)
        room = room or committed + spec + self.page_size
        req, _ = Rig.admit(self, rid, prompt, room, outputs=outputs, spec=spec)
        if tokens is not None:
            req.origin_input_ids = list(tokens)
        req._finished = finished
        return req

    def regrant(self, req):
        row = self.pool.alloc()
        slots = self.alloc.alloc(self.pool.req_to_token.shape[1])
        self.pool.req_to_token[row, : slots.numel()] = slots.to(torch.int32)
        req.kv.req_pool_idx = row

    def pools_view(self):
        return (self.alloc.available_size(), self.pool.available_size())

    def free_slot_count(self) -> int:
        return self.alloc.available_size()

    def free_row_count(self) -> int:
        return self.pool.available_size()

    def _page_free(self, first) -> bool:
        try:
            self.alloc.check_free(torch.tensor([first], dtype=torch.int64))
        except (DoubleFree, NotAllocated):
            return True
        return False

    def is_free(self, slots) -> bool:
        return all(self._page_free(int(s)) for s in slots.tolist())

    def is_held(self, slots) -> bool:
        return not any(self._page_free(int(s)) for s in slots.tolist())

    def stray_free_page(self):
        slots = self.alloc.alloc(self.page_size)
        self.alloc.free(slots)
        return slots

    def never_allocated_page(self):
        """The pool's last page: never handed out (pages are handed out lowest first)."""
        never = self.alloc.total_slots - self.page_size
        return torch.arange(never, never + self.page_size, dtype=torch.int64)

    def take_slots(self, n):
        return self.alloc.alloc(n)

    def row_already_free(self, row) -> str:
        return f"row {row} is already free"

    def check_integrity(self):
        self.alloc.check_integrity()
        self.mgr.check_integrity()


RIGS = {DoublesRig.kind: DoublesRig, RealPoolsRig.kind: RealPoolsRig}
