"""Issue 10: every scheduler call checks its whole plan before any effect.

One regression test (or a few) per numbered case of the issue, each run over both rigs (the ``rig``
fixture, ``tests/support/rigs.py``): ``doubles`` (strict recording doubles that behave like real
pools) and ``real-pools`` (``transfer.PagedTokenAllocator`` and ``transfer.ReqToTokenPool``, whose
rows hold the slot ids the allocator handed out). Each drives the manager from outside, through
the public names; a refused call must raise a ``LifecycleError`` and leave everything observable —
allocator, row pool, rows, host pool, ``snapshot()``, ``stats()`` — exactly as it was; once the
scheduler repairs the cause, a retry frees everything exactly once.

Case 1 (release is atomic) runs through both entry points of the free path
(``finalize_release_on_finish`` and ``_release_finished_req``). A -1 or a repeated slot id (a
cleared row) is refused by the manager's own plan check (``plan_release``) whatever the pools;
slots or a row that the pools no longer hold are refused through the pools' ``check_free``, asked
by the default ``AllocatorReleaseSink`` before anything is freed.
"""

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import structlog
import torch

from hashing import TokenRangeError, page_hashes
from lifecycle import ConfigError, InvalidRequest, InvalidToken, LifecycleError, ReentrantCall, State
from lifecycle.release import AllocatorReleaseSink, ReleaseRefused, plan_release
from lifecycle_tools.testkit.doubles import Req
from transfer import DoubleFree, NotAllocated

P, R = State.PREFILLED, State.RELEASED
PS = 4  # tokens per page (manager and allocator)
ENTRIES = {"finalize": "finalize_release_on_finish", "release": "_release_finished_req"}


def refused(rig, req, call, match=None, error=LifecycleError):
    """``call`` raises ``error`` matching ``match`` and nothing observable changes. Returns the error."""
    before = rig.observe(req)
    with pytest.raises(error, match=match) as exc:
        call()
    assert rig.observe(req) == before
    rig.check_integrity()
    return exc.value


def finished(rig, prompt=10, spec=0):
    """A tracked request whose copies all landed, finished: releasing it frees at once."""
    req = rig.admit("r", prompt, prompt + spec, spec=spec)
    rig.mgr.offload_kv_cache(req)
    rig.land_all()
    req.finish()
    return req, rig.slots_of(req)


def page_slots(rig, slots) -> int:
    """How many slots freeing ``slots`` gives back (whole allocator pages)."""
    page = rig.alloc.page_size
    return len({int(s) // page for s in slots.tolist()}) * page


def retry_frees_once(rig, req, release, slots):
    """The retry frees every page of ``slots`` and the row, exactly once."""
    row, free_before, rows_before = req.kv.req_pool_idx, rig.free_slot_count(), rig.free_row_count()
    release(req)
    assert rig.mgr.state_of(req) is R and req.kv.req_pool_idx is None
    assert rig.free_slot_count() == free_before + page_slots(rig, slots)
    assert rig.free_row_count() == rows_before + 1
    assert rig.is_free(slots)                          # every page of the request is free now
    with pytest.raises(DoubleFree):
        rig.alloc.check_free(slots)
    with pytest.raises(DoubleFree):
        rig.pool.check_free(SimpleNamespace(kv=SimpleNamespace(req_pool_idx=row)))
    rig.check_integrity()


# --- 1. release is atomic ---------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ENTRIES)
def test_case1_overallocated_tail_listing_a_free_page_frees_nothing_then_retry_frees_once(rig, entry):
    release = getattr(rig.mgr, ENTRIES[entry])
    req, slots = finished(rig, prompt=10, spec=6)      # committed 10, allocated 16: tail [12, 16)
    row = req.kv.req_pool_idx
    stray = rig.stray_free_page()                      # a page the scheduler already gave back
    good_tail = rig.pool.req_to_token[row, 12:16].clone()
    rig.pool.req_to_token[row, 12:16] = stray.to(torch.int32)
    refused(rig, req, lambda: release(req), "cannot free its slots")
    assert rig.mgr.state_of(req) is P
    rig.pool.req_to_token[row, 12:16] = good_tail      # the scheduler repairs the row
    retry_frees_once(rig, req, release, slots)


@pytest.mark.parametrize("entry", ENTRIES)
def test_case1_overallocated_tail_listing_a_never_allocated_page_frees_nothing_then_retry_frees_once(rig, entry):
    release = getattr(rig.mgr, ENTRIES[entry])
    req, slots = finished(rig, prompt=10, spec=6)
    row = req.kv.req_pool_idx
    rig.pool.req_to_token[row, 12:16] = rig.never_allocated_page().to(torch.int32)
    err = refused(rig, req, lambda: release(req), "cannot free its slots")
    assert isinstance(err.__cause__, NotAllocated)     # the allocator's own verdict
    assert rig.mgr.state_of(req) is P
    rig.pool.req_to_token[row, 12:16] = slots[12:16].to(torch.int32)
    retry_frees_once(rig, req, release, slots)


@pytest.mark.parametrize("entry", ENTRIES)
def test_case1_tail_position_cleared_to_the_padding_slot_frees_nothing_then_retry_frees_once(rig, entry):
    release = getattr(rig.mgr, ENTRIES[entry])
    req, slots = finished(rig, prompt=10, spec=6)
    row = req.kv.req_pool_idx
    rig.pool.req_to_token[row, 15] = 0                 # one cleared position: padding page 0
    refused(rig, req, lambda: release(req), "cannot free its slots")
    assert rig.mgr.state_of(req) is P
    rig.pool.req_to_token[row, 15] = int(slots[15])
    retry_frees_once(rig, req, release, slots)


@pytest.mark.parametrize("entry", ENTRIES)
def test_case1_minus_one_inside_committed_frees_nothing_then_retry_frees_once(rig, entry):
    release = getattr(rig.mgr, ENTRIES[entry])
    req, slots = finished(rig)
    row = req.kv.req_pool_idx
    rig.pool.req_to_token[row, 3] = -1
    refused(rig, req, lambda: release(req), "lists slot -1")
    assert rig.mgr.state_of(req) is P
    rig.pool.req_to_token[row, 3] = int(slots[3])
    retry_frees_once(rig, req, release, slots)


@pytest.mark.parametrize("entry", ENTRIES)
def test_case1_row_freed_by_the_scheduler_frees_nothing(rig, entry):
    release = getattr(rig.mgr, ENTRIES[entry])
    req, slots = finished(rig)
    row = req.kv.req_pool_idx
    rig.pool.free(req)                                 # SGLang's way: req_pool_idx becomes None
    refused(rig, req, lambda: release(req), f"row changed from {row} to None")
    assert not rig.is_free(slots)


@pytest.mark.parametrize("entry", ENTRIES)
def test_case1_row_already_freed_through_another_handle_frees_nothing_then_retry_frees_once(rig, entry):
    release = getattr(rig.mgr, ENTRIES[entry])
    req, slots = finished(rig)
    row = req.kv.req_pool_idx
    rig.pool.free(SimpleNamespace(kv=SimpleNamespace(req_pool_idx=row)))  # a stale handle: req still names the row
    # the real pool says the row is free; the doubles' pool also poisons a freed row (-1), which the
    # manager's own plan check finds first
    match = {"doubles": "lists slot -1", "real-pools": f"row {row} is already free"}[rig.kind]
    refused(rig, req, lambda: release(req), match)
    assert rig.mgr.state_of(req) is P
    assert rig.pool.alloc() == row                     # the scheduler takes the row back
    retry_frees_once(rig, req, release, slots)


@pytest.mark.parametrize("entry", ENTRIES)
def test_case1_row_cleared_frees_nothing_then_retry_frees_once(rig, entry):
    release = getattr(rig.mgr, ENTRIES[entry])
    req, slots = finished(rig)
    row = req.kv.req_pool_idx
    rig.pool.req_to_token[row].zero_()                 # cleared: every position lists slot 0
    refused(rig, req, lambda: release(req), "more than once")
    assert rig.mgr.state_of(req) is P
    rig.pool.req_to_token[row, : slots.numel()] = slots.to(torch.int32)
    retry_frees_once(rig, req, release, slots)


def test_case1_the_default_sink_checks_the_row_pool_before_freeing(rig):
    """``AllocatorReleaseSink.check`` asks the row pool (its ``check_free``): a plan whose row
    cannot be freed is refused with nothing changed; ``free`` after a passing check frees every
    slot and the row. (The slots' refusal: the over-allocated tail tests above.)"""
    req, slots = finished(rig)
    row = req.kv.req_pool_idx
    mgr = rig.mgr
    plan = plan_release(mgr._pools, mgr._ledger, mgr.release_sink, SimpleNamespace(rid="r"), req, (row, 10, 10))
    sink = AllocatorReleaseSink(rig.pool, rig.alloc)
    stale = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=row))
    rig.pool.free(stale)
    free_before, rows_before = rig.free_slot_count(), rig.free_row_count()
    with pytest.raises(ReleaseRefused, match=f"cannot free its row .*{rig.row_already_free(row)}"):
        sink.check(plan)
    assert (rig.free_slot_count(), rig.free_row_count(), req.kv.req_pool_idx) == (free_before, rows_before, row)
    assert rig.pool.alloc() == row                     # the scheduler takes the row back
    sink.check(plan)
    sink.free(plan)
    assert rig.free_slot_count() == free_before + page_slots(rig, slots) and req.kv.req_pool_idx is None


# --- 2. a row change is caught by every entry point ------------------------------------------------


def moved(rig):
    """Request A decoding on its row, then moved to another row without readmit; B given A's row."""
    a = rig.admit("a", 8, 16)
    a.decode(1)
    rig.mgr.offload_kv_cache(a)
    old, new = a.kv.req_pool_idx, rig.admit("spare", 8, 16).kv.req_pool_idx
    a.kv.req_pool_idx = new
    b = Req("b", [1000 + i for i in range(8)], row=old)
    return a, b, old, new


@pytest.mark.parametrize("entry", ["offload_no_chunk_due", "offload_chunk_due", "finalize", "release"])
def test_case2_row_moved_without_readmit_is_refused_by_every_entry_point(rig, entry):
    a, b, old, new = moved(rig)
    rig.mgr.offload_kv_cache(b)
    if entry == "offload_chunk_due":
        for t in range(4):
            a.decode(t)
    if entry == "release":
        a.finish()
    call = {
        "offload_no_chunk_due": lambda: rig.mgr.offload_kv_cache(a),
        "offload_chunk_due": lambda: rig.mgr.offload_kv_cache(a),
        "finalize": lambda: rig.mgr.finalize_release_on_finish(a),
        "release": lambda: rig.mgr._release_finished_req(a),
    }[entry]
    refused(rig, a, call, f"row changed from {old} to {new} without readmit")
    assert rig.mgr.stats().released == 0


def test_case2_readmit_rereads_the_new_row(rig):
    req = rig.admit("r", 8, 16)
    req.decode(1)
    rig.mgr.offload_kv_cache(req)
    rig.mgr.finalize_release_on_finish(req)            # retracted: released
    rig.regrant(req)
    rig.mgr.readmit(req)
    row, other = req.kv.req_pool_idx, rig.admit("spare", 8, 16).kv.req_pool_idx
    req.kv.req_pool_idx = other                        # moved again, untold
    refused(rig, req, lambda: rig.mgr.offload_kv_cache(req), f"row changed from {row} to {other}")


# --- 3. ownership -----------------------------------------------------------------------------------


def test_case3_readmit_by_a_manager_that_no_longer_owns_the_request_is_refused(rig):
    mgr_a, mgr_b = rig.mgr, rig.manager()              # two managers over the same pools
    req = rig.admit("r", 8, 16)
    rows_at_start = rig.free_row_count()
    req.decode(1)
    mgr_a.offload_kv_cache(req)
    mgr_a.finalize_release_on_finish(req)              # released by A
    rig.regrant(req)                                   # the scheduler gives it a row and pages again
    mgr_b.offload_kv_cache(req)                        # picked up by B
    before = (mgr_a.snapshot(), mgr_a.stats(), mgr_b.snapshot(), mgr_b.stats(), rig.pools_view())
    with pytest.raises(InvalidRequest, match="belongs to another manager"):
        mgr_a.readmit(req)
    assert (mgr_a.snapshot(), mgr_a.stats(), mgr_b.snapshot(), mgr_b.stats(), rig.pools_view()) == before
    req.finish()
    mgr_b.finalize_release_on_finish(req)
    assert mgr_b.state_of(req) is R and req.kv.req_pool_idx is None
    assert (mgr_a.stats().released, mgr_b.stats().released) == (1, 1)   # freed once per lifecycle
    assert rig.free_row_count() == rows_at_start + 1


# --- 4. namespace seed --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [" " * 64, "ab" * 31 + " 0", "g" * 64, "ab" * 33, "ab" * 31, 7])
def test_case4_namespace_seed_must_be_exactly_64_hex(rig, seed):
    with pytest.raises(ConfigError, match="exactly 64 hex"):
        rig.variant(seed=seed)


def test_case4_namespace_seed_case_is_normalised(rig):
    upper, lower = rig.variant(seed="AB" * 32), rig.variant(seed="ab" * 32)
    assert upper.mgr.namespace_seed == "ab" * 32
    reqs = [r.admit("r", 8, 16, tokens=range(8)) for r in (upper, lower)]
    for r, req in zip((upper, lower), reqs):
        r.mgr.offload_kv_cache(req)
    assert upper.mgr.progress_of(reqs[0]) == lower.mgr.progress_of(reqs[1])
    assert upper.mgr.progress_of(reqs[0]).last_hash == page_hashes(list(range(8)), 4, "ab" * 32)[-1]


# --- 5. allocator page vs manager page --------------------------------------------------------------


def test_case5_an_allocator_page_larger_than_the_manager_page_is_refused(rig):
    with pytest.raises(ConfigError, match="does not divide"):
        rig.variant(alloc_page=8)


def test_case5_a_stuck_copy_never_lets_a_live_page_be_freed_with_a_finer_allocator(rig):
    rig = rig.variant(alloc_page=2)
    req = rig.admit("r", 4, 16)
    for t in range(5):
        req.decode(t)
        rig.mgr.offload_kv_cache(req)                  # chunk [4, 8) in flight
    slots = rig.slots_of(req)                          # positions [0, 9)
    rig.off.expire(list(rig.off.pending_writes))
    rig.mgr.check_offload_progress()                   # quarantined
    req.finish()
    rig.mgr.finalize_release_on_finish(req)
    assert rig.is_free(slots[0:4]) and rig.is_free(slots[8:9])
    assert rig.is_held(slots[4:8])                     # [4, 8): the stuck copy may still read them
    taken = rig.take_slots(4)                          # another request takes freed pages
    rig.off.land()
    rig.mgr.check_offload_progress()                   # the stuck copy ends: only its pages go back
    assert rig.is_free(slots[4:8]) and rig.is_held(taken)
    rig.check_integrity()


# --- 6. one offloader, one manager -------------------------------------------------------------------


def test_case6_a_second_manager_over_the_same_offloader_is_refused(rig):
    with pytest.raises(ConfigError, match="already serves another"):
        rig.variant(offloader=rig.off)
    rig.mgr.shutdown()
    rig.variant(offloader=rig.off)


# --- 7. re-entrant calls -----------------------------------------------------------------------------


def test_case7_a_log_processor_calling_back_into_the_manager_corrupts_nothing(rig):
    armed, seen = [], []

    def meddle(_logger, _name, event_dict):
        if armed and str(event_dict.get("event")).startswith("lifecycle."):
            rig.off.land()
            try:
                rig.mgr.check_offload_progress()
            except LifecycleError as err:
                seen.append(err)
        raise structlog.DropEvent

    reqs = [rig.admit(f"r{i}", 8, 32, tokens=range(8)) for i in range(3)]
    rows_before = rig.free_row_count()
    old = structlog.get_config()
    structlog.configure(processors=[meddle], wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    armed.append(True)
    try:
        for step in range(9):
            for req in reqs:
                req.decode(step)
                rig.mgr.offload_kv_cache(req)
                rig.mgr.check_integrity()              # after every call, not only at the end
        for req in reqs:
            req.finish()
            if not rig.mgr.offload_kv_cache(req):
                rig.mgr.finalize_release_on_finish(req)
        rig.land_all()
    finally:
        armed.clear()
        structlog.configure(**old)
    rig.check_integrity()
    assert all(rig.mgr.state_of(r) is R for r in reqs) and rig.free_row_count() == rows_before + 3
    assert rig.mgr.stats().released == 3 and not seen


def test_case7_a_call_from_inside_a_call_is_refused_and_changes_nothing(rig):
    write, inner = rig.off.write, []
    req = rig.admit("r", 4, 16)

    def write_then_poll(indices, ack):
        before = rig.observe(req)
        try:
            rig.mgr.check_offload_progress()
        except ReentrantCall as err:
            inner.append((err, rig.observe(req) == before))
        return write(indices, ack)

    rig.off.write = write_then_poll
    for t in range(5):
        req.decode(t)
        rig.mgr.offload_kv_cache(req)
    assert len(inner) == 1 and inner[0][1] is True
    assert rig.mgr.stats().chunks_enqueued == 1
    rig.check_integrity()


# --- 8. a refused first call leaves no trace ----------------------------------------------------------


def test_case8_a_refused_first_call_leaves_no_record(rig):
    req = rig.admit("r", 4, 16, outputs=range(9))
    req.kv.kv_committed_len = 5                        # a chunk is due, but its KV is not committed
    refused(rig, req, lambda: rig.mgr.offload_kv_cache(req), "not committed")
    assert rig.mgr.state_of(req) is None and rig.mgr.stats().tracked == 0
    del req
    assert rig.mgr.stats().leaked == 0


# --- 9. first-sight checks, token errors ---------------------------------------------------------------


def test_case9_allocated_beyond_the_row_is_refused_on_first_sight(rig):
    req = rig.admit("r", 4, 16)
    req.kv.kv_allocated_len = 10_000
    refused(rig, req, lambda: rig.mgr.offload_kv_cache(req), "exceeds the row width")
    assert rig.mgr.state_of(req) is None


def test_case9_numpy_prompt_tokens_are_tokens_and_a_bad_one_is_named_where_it_is(rig):
    good = rig.admit("np", 8, 16, tokens=np.arange(8, dtype=np.int64))
    rig.mgr.offload_kv_cache(good)
    assert rig.mgr.progress_of(good).last_hash == page_hashes(list(range(8)), 4)[-1]
    bad = rig.admit("bad", 8, 16, tokens=np.array([1, 2, 3, 4, 5, -7, 7, 8]))
    err = refused(rig, bad, lambda: rig.mgr.offload_kv_cache(bad), r"token id -7 at position 5", InvalidToken)
    assert isinstance(err, TokenRangeError) and isinstance(err, LifecycleError)
    assert rig.mgr.state_of(bad) is None
