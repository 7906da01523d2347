"""Issue 10, case 1 (release is atomic) over the REAL ``transfer`` pools.

``tests/lifecycle/test_refusals.py`` attacks the free path over the test doubles; this file runs
the same scenarios through ``DecodeOffloadManager`` over ``transfer.PagedTokenAllocator`` and
``transfer.ReqToTokenPool``, whose rows hold real allocated slot ids. A refused release must raise
a ``LifecycleError`` and free nothing (allocator, row pool, rows, host pool, ``snapshot()``,
``stats()`` unchanged); once the scheduler repairs the cause, a retry frees everything once.

A -1 or a repeated slot id (a cleared row) is refused by the manager's own plan check
(``plan_release``) whatever the pools; slots or a row that the pools no longer hold are refused
through the pools' ``check_free``, asked by the default ``AllocatorReleaseSink`` before anything
is freed (without it, the row's ``DoubleFree`` came after the slots were already freed).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lifecycle import LifecycleError, State
from lifecycle.release import AllocatorReleaseSink, ReleaseRefused, plan_release
from tests.support.real_rig import Rig
from transfer import DoubleFree

PS = 4  # tokens per page (manager and allocator)


def observe(rig, req):
    """Everything a scheduler (or an operator) can observe, pools first."""
    return (rig.alloc.available_size(), rig.pool.available_size(), rig.pool.req_to_token.clone().tolist(),
            req.kv.req_pool_idx, rig.off.host_free_pages(), sorted(rig.off.pending_writes),
            rig.mgr.snapshot(), rig.mgr.stats())


def refused(rig, req, call, match):
    """``call`` raises a LifecycleError naming ``match`` and nothing observable changes."""
    before = observe(rig, req)
    with pytest.raises(LifecycleError, match=match):
        call()
    assert observe(rig, req) == before
    rig.alloc.check_integrity()


def finished(rig, prompt=10, spec=0, room=None):
    """A tracked request whose copies all landed, finished: releasing it frees at once."""
    req, slots = rig.admit("r", prompt, room or prompt + spec, spec=spec)
    rig.mgr.offload_kv_cache(req)
    rig.off.land()
    rig.progress()
    req.finish()
    return req, slots


def assert_freed_once(rig, req, row, slots, free_before, rows_before):
    """The retry freed every page of ``slots`` and the row, exactly once."""
    assert rig.mgr.state_of(req) is State.RELEASED and req.kv.req_pool_idx is None
    assert rig.alloc.available_size() == free_before + slots.numel()
    assert rig.pool.available_size() == rows_before + 1
    with pytest.raises(DoubleFree):                    # every page of the request is free now
        rig.alloc.check_free(slots)
    for page in slots.view(-1, PS):
        with pytest.raises(DoubleFree):
            rig.alloc.check_free(page)
    with pytest.raises(DoubleFree):
        rig.pool.check_free(SimpleNamespace(kv=SimpleNamespace(req_pool_idx=row)))
    rig.alloc.check_integrity()
    rig.mgr.check_integrity()


def test_overallocated_tail_listing_a_free_page_frees_nothing_then_retry_frees_once():
    rig = Rig(PS)
    req, slots = finished(rig, prompt=10, spec=6)      # committed 10, allocated 16: tail [12, 16)
    row = req.kv.req_pool_idx
    stray = rig.alloc.alloc(PS)
    rig.alloc.free(stray)                              # a page the scheduler already gave back
    good_tail = rig.pool.req_to_token[row, 12:16].clone()
    rig.pool.req_to_token[row, 12:16] = stray.to(torch.int32)
    refused(rig, req, lambda: rig.mgr.finalize_release_on_finish(req), "cannot free its slots")
    assert rig.mgr.state_of(req) is State.PREFILLED
    rig.pool.req_to_token[row, 12:16] = good_tail      # the scheduler repairs the row
    free_before, rows_before = rig.alloc.available_size(), rig.pool.available_size()
    rig.mgr.finalize_release_on_finish(req)
    assert_freed_once(rig, req, row, slots, free_before, rows_before)


def test_overallocated_tail_listing_a_never_allocated_page_frees_nothing():
    rig = Rig(PS)
    req, slots = finished(rig, prompt=10, spec=6)
    row = req.kv.req_pool_idx
    never = rig.alloc.total_slots - PS                 # the last page: never handed out
    rig.pool.req_to_token[row, 12:16] = torch.arange(never, never + PS, dtype=torch.int32)
    refused(rig, req, lambda: rig.mgr.finalize_release_on_finish(req), "never allocated")
    rig.pool.req_to_token[row, 12:16] = slots[12:16].to(torch.int32)
    free_before, rows_before = rig.alloc.available_size(), rig.pool.available_size()
    rig.mgr.finalize_release_on_finish(req)
    assert_freed_once(rig, req, row, slots, free_before, rows_before)


def test_minus_one_inside_committed_frees_nothing_then_retry_frees_once():
    rig = Rig(PS)
    req, slots = finished(rig)
    row = req.kv.req_pool_idx
    rig.pool.req_to_token[row, 3] = -1
    refused(rig, req, lambda: rig.mgr.finalize_release_on_finish(req), "lists slot -1")
    rig.pool.req_to_token[row, 3] = int(slots[3])
    free_before, rows_before = rig.alloc.available_size(), rig.pool.available_size()
    rig.mgr.finalize_release_on_finish(req)
    assert_freed_once(rig, req, row, slots, free_before, rows_before)


def test_row_already_freed_through_another_handle_frees_nothing_then_retry_frees_once():
    rig = Rig(PS)
    req, slots = finished(rig)
    row = req.kv.req_pool_idx
    rig.pool.free(SimpleNamespace(kv=SimpleNamespace(req_pool_idx=row)))  # a stale handle: req still names the row
    refused(rig, req, lambda: rig.mgr.finalize_release_on_finish(req), f"row {row} is already free")
    assert rig.mgr.state_of(req) is State.PREFILLED
    assert rig.pool.alloc() == row                     # the scheduler takes the row back
    free_before, rows_before = rig.alloc.available_size(), rig.pool.available_size()
    rig.mgr.finalize_release_on_finish(req)
    assert_freed_once(rig, req, row, slots, free_before, rows_before)


def test_row_freed_by_the_scheduler_is_refused_and_frees_no_slot():
    rig = Rig(PS)
    req, _ = finished(rig)
    rig.pool.free(req)                                 # SGLang's way: req_pool_idx becomes None
    refused(rig, req, lambda: rig.mgr.finalize_release_on_finish(req), "row changed")


def test_cleared_row_frees_nothing_then_retry_frees_once():
    rig = Rig(PS)
    req, slots = finished(rig)
    row = req.kv.req_pool_idx
    rig.pool.req_to_token[row].zero_()                 # cleared: every position lists slot 0
    refused(rig, req, lambda: rig.mgr.finalize_release_on_finish(req), "more than once")
    rig.pool.req_to_token[row, : slots.numel()] = slots.to(torch.int32)
    free_before, rows_before = rig.alloc.available_size(), rig.pool.available_size()
    rig.mgr.finalize_release_on_finish(req)
    assert_freed_once(rig, req, row, slots, free_before, rows_before)


def test_tail_position_cleared_to_the_padding_slot_frees_nothing():
    rig = Rig(PS)
    req, slots = finished(rig, prompt=10, spec=6)
    row = req.kv.req_pool_idx
    rig.pool.req_to_token[row, 15] = 0                 # one cleared position: padding page 0
    refused(rig, req, lambda: rig.mgr.finalize_release_on_finish(req), "cannot free its slots")
    rig.pool.req_to_token[row, 15] = int(slots[15])
    free_before, rows_before = rig.alloc.available_size(), rig.pool.available_size()
    rig.mgr.finalize_release_on_finish(req)
    assert_freed_once(rig, req, row, slots, free_before, rows_before)


def test_the_default_sink_checks_the_real_row_pool_before_freeing():
    """``AllocatorReleaseSink.check`` asks the real row pool (its ``check_free``): a plan whose row
    cannot be freed is refused with nothing changed; ``free`` after a passing check frees every
    slot and the row. (The slots' refusal: the over-allocated tail tests above.)"""
    rig = Rig(PS)
    req, slots = finished(rig)
    row = req.kv.req_pool_idx
    plan = plan_release(rig.mgr, SimpleNamespace(rid="r"), req, (row, 10, 10))
    sink = AllocatorReleaseSink(rig.pool, rig.alloc)
    stale = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=row))
    rig.pool.free(stale)
    free_before, rows_before = rig.alloc.available_size(), rig.pool.available_size()
    with pytest.raises(ReleaseRefused, match=f"cannot free its row .*row {row} is already free"):
        sink.check(plan)
    assert (rig.alloc.available_size(), rig.pool.available_size(), req.kv.req_pool_idx) == (
        free_before, rows_before, row)
    assert rig.pool.alloc() == row                     # the scheduler takes the row back
    sink.check(plan)
    sink.free(plan)
    assert rig.alloc.available_size() == free_before + slots.numel() and req.kv.req_pool_idx is None
