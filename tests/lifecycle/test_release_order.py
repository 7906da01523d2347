"""Release order: a request's slots are freed, and read from its row, *before* the row goes back.

A real ``ReqToTokenPool`` hands a freed row to the next request, which writes its own slots into
it (SGLang's scheduler admits from the waiting queue right after a release; a debug pool poisons
the row instead). A release that frees the row first and then reads the slots from it frees the
new owner's KV, or garbage, instead of its own. The spec (and ``ReleaseSink.free``) frees the
slots, then the row; the pool below checks that order when the row comes back. The strict
doubles cannot see any of this (their ``free(req)`` leaves the row intact), so these tests use the
real ``transfer`` pool and allocator with a row pool that really recycles (or poisons) its rows.
"""

from __future__ import annotations

import pytest
import torch

from lifecycle import DecodeOffloadManager, State
from lifecycle_tools.testkit.doubles import Req
from transfer import PagedTokenAllocator, ReqToTokenPool
from lifecycle_tools.testkit.memory import InMemoryOffloader

ROWS, WIDTH = 4, 64


class RecyclingRowPool(ReqToTokenPool):
    """The real row pool, plus what happens to a row right after it is freed.

    ``mode="reuse"``: the row is immediately taken by the next waiting request, whose freshly
    allocated slots overwrite it. ``mode="poison"``: the row is filled with -1.
    """

    def __init__(self, allocator: PagedTokenAllocator, mode: str) -> None:
        super().__init__(ROWS, WIDTH)
        self.allocator, self.mode = allocator, mode
        self.successors: list[tuple[int, torch.Tensor]] = []  # (row, slots) of the next owners
        self.available_at_row_free: int | None = None

    def admit(self, n_tokens: int) -> tuple[int, torch.Tensor]:
        row = self.alloc()
        slots = self.allocator.alloc(n_tokens)
        assert row is not None and slots is not None
        self.req_to_token[row, : slots.numel()] = slots.to(torch.int32)
        return row, slots

    def free(self, req) -> None:
        row = req.kv.req_pool_idx
        self.available_at_row_free = self.allocator.available_size()  # slots must be free by now
        super().free(req)
        if self.mode == "poison":
            self.req_to_token[row].fill_(-1)
        else:
            self.successors.append(self.admit(WIDTH // 2))


def make(page_size: int, mode: str):
    alloc = PagedTokenAllocator(ROWS * WIDTH, page_size)
    pool = RecyclingRowPool(alloc, mode)
    off = InMemoryOffloader(page_size=page_size, host_pages=256, auto_land=False)
    mgr = DecodeOffloadManager(pool, alloc, page_size=page_size, offloader=off)
    return alloc, pool, off, mgr


def admit_request(pool: RecyclingRowPool, prompt: int, spec: int, page_size: int, steps: int = 0):
    """A request with ``prompt`` tokens of KV plus ``spec`` over-allocated slots on a real row,
    with room for ``steps`` decode steps (its slots after them are exactly what it holds)."""
    row, slots = pool.admit(-(-(prompt + steps + spec) // page_size) * page_size)
    req = Req("r", range(prompt), row=row, outputs=(), spec=spec)
    return req, slots


def assert_released_exactly(alloc, pool, own_slots, free_before):
    """The request's own pages are free again; the next owner's pages are still held."""
    ps = alloc.page_size
    own_pages = torch.unique(own_slots // ps)
    assert not alloc._pages.is_held(own_pages), "the released request's pages are still held"
    for _, slots in pool.successors:
        assert alloc._pages.is_held(torch.unique(slots // ps)), "the next owner's KV was freed"
    assert pool.available_at_row_free == free_before + own_pages.numel() * ps, "row freed before its slots"
    successor_slots = sum(s.numel() for _, s in pool.successors)
    assert alloc.available_size() == free_before + own_pages.numel() * ps - successor_slots
    alloc.check_integrity()


@pytest.mark.parametrize("mode", ["reuse", "poison"])
@pytest.mark.parametrize("page_size,prompt,spec", [(1, 21, 3), (4, 22, 6)])
def test_finalize_frees_own_slots_before_the_row_is_reused(mode, page_size, prompt, spec):
    alloc, pool, off, mgr = make(page_size, mode)
    req, own = admit_request(pool, prompt, spec, page_size)
    free_before = alloc.available_size()
    req.finish()
    mgr.finalize_release_on_finish(req)
    assert mgr.state_of(req) is State.RELEASED
    assert_released_exactly(alloc, pool, own, free_before)


@pytest.mark.parametrize("mode", ["reuse", "poison"])
def test_release_deferred_to_the_last_landing_reads_the_row_first(mode):
    page_size = 4
    alloc, pool, off, mgr = make(page_size, mode)
    req, own = admit_request(pool, 8, 4, page_size, steps=5)
    req.output_ids = [500]
    for step in range(5):                      # 12 tokens with KV: one decode chunk enqueued
        req.decode(600 + step)
        mgr.offload_kv_cache(req)
    assert mgr.stats().inflight_writes == 1
    free_before = alloc.available_size()
    req.finish()
    assert mgr.offload_kv_cache(req) is False
    mgr.finalize_release_on_finish(req)
    assert mgr.state_of(req) is State.FINISHED and not pool.successors
    off.land()
    mgr.check_offload_progress()                # the landing releases the request
    assert mgr.state_of(req) is State.RELEASED
    assert_released_exactly(alloc, pool, own, free_before)


def test_quarantined_release_frees_only_own_unquarantined_slots():
    page_size = 4
    alloc, pool, off, mgr = make(page_size, "reuse")
    req, own = admit_request(pool, 8, 0, page_size, steps=5)
    req.output_ids = [500]
    for step in range(5):
        req.decode(600 + step)
        mgr.offload_kv_cache(req)
    row = req.kv.req_pool_idx
    reading = pool.req_to_token[row, 8:12].to(torch.int64)
    free_before = alloc.available_size()
    off.expire([1])
    req.finish()
    mgr.finalize_release_on_finish(req)
    mgr.check_offload_progress()
    assert mgr.state_of(req) is State.RELEASED
    (_, successor), = pool.successors
    assert alloc._pages.is_held(torch.unique(successor // page_size))
    assert alloc._pages.is_held(torch.unique(reading // page_size))  # quarantined, not freed
    unquarantined = own[~torch.isin(own, reading)]
    assert not alloc._pages.is_held(torch.unique(unquarantined // page_size))
    assert pool.available_at_row_free == free_before + unquarantined.numel(), "row freed before its slots"
    assert alloc.available_size() == free_before + unquarantined.numel() - successor.numel()
    off.land([1])                                # the stuck copy ends: its slots come back
    mgr.check_offload_progress()
    assert not alloc._pages.is_held(torch.unique(reading // page_size))
    alloc.check_integrity()
