"""A manager over the real ``transfer`` row pool and paged allocator, with a clock the test sets.

Rows hold real allocated slot ids (not the doubles' arithmetic mapping), so a test can check
exactly which slots were freed, and when.
"""

from __future__ import annotations

import torch

from lifecycle import DecodeOffloadManager
from lifecycle_tools.testkit.doubles import Req
from transfer import PagedTokenAllocator, ReqToTokenPool
from lifecycle_tools.testkit.memory import InMemoryOffloader


class Clock:
    """``time.monotonic`` stand-in: returns ``t``, which the test moves."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Rig:
    """Pools, an ``InMemoryOffloader`` (copies land when told) and a manager on them."""

    def __init__(self, page_size=4, stride=None, host_pages=256, rows=4, width=64, offloader=None,
                 pool=None, alloc=None, **mgr_kw):
        self.page_size = page_size
        self.alloc = alloc or PagedTokenAllocator(rows * width, page_size)
        self.pool = pool or ReqToTokenPool(rows, width)
        self.off = offloader or InMemoryOffloader(page_size=page_size, host_pages=host_pages, auto_land=False)
        self.clock = Clock()
        self.mgr = DecodeOffloadManager(self.pool, self.alloc, page_size=page_size, offloader=self.off,
                                        offload_stride=stride, clock=self.clock, **mgr_kw)

    def admit(self, rid, prompt_len, room, outputs=(7000,), spec=0):
        """A request with ``prompt_len`` prompt tokens on a fresh row holding ``room`` slots."""
        row = self.pool.alloc()
        slots = self.alloc.alloc(room)
        self.pool.req_to_token[row, : slots.numel()] = slots.to(torch.int32)
        req = Req(rid, [1000 + i for i in range(prompt_len)], row=row, outputs=outputs, spec=spec)
        return req, slots

    def decode(self, req, steps, first=7001):
        """``steps`` decode steps, offloading after each; returns what ``offload_kv_cache`` said."""
        out = []
        for i in range(steps):
            req.decode(first + i)
            out.append(self.mgr.offload_kv_cache(req))
        return out

    def progress(self):
        self.mgr.check_offload_progress()
