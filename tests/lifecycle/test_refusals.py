"""Issue 10: every scheduler call checks its whole plan before any effect.

One regression test (or a few) per numbered case of the issue. Each drives the manager from
outside, through the public names, over doubles that behave like real pools; a refused call must
raise a ``LifecycleError`` and leave everything observable — allocator, row pool, host pool,
``snapshot()``, ``stats()`` — exactly as it was; once the scheduler repairs the cause, a retry
frees everything exactly once.
"""

import logging

import numpy as np
import pytest
import structlog
import torch

from hashing import TokenRangeError, page_hashes
from lifecycle import (
    ConfigError,
    DecodeOffloadManager,
    InvalidRequest,
    InvalidToken,
    LifecycleError,
    ReentrantCall,
    State,
)
from lifecycle_tools.testkit.doubles import PagedAllocator, Req, ReqToTokenPool
from tests.conftest import Node
from lifecycle_tools.testkit.memory import InMemoryOffloader

P, F, R = State.PREFILLED, State.FINISHED, State.RELEASED


def observe(node):
    """Everything a scheduler (or an operator) can observe."""
    return (sorted(node.alloc.held), list(node.alloc.freed_pages), list(node.pool.freed_rows),
            node.pool.req_to_token.clone().tolist(), node.off.host_free_pages(), sorted(node.off.pending_writes),
            node.mgr.snapshot(), node.mgr.stats())


def refused(node, call, match=None):
    """``call`` raises a LifecycleError and nothing observable changes."""
    before = observe(node)
    with pytest.raises(LifecycleError, match=match):
        call()
    assert observe(node) == before


def finished_req(node, rid="r", row=1, prompt=10, spec=0):
    req = Req(rid, range(prompt), row=row, spec=spec, finished=True)
    node.mgr.offload_kv_cache(req)
    return req


# --- 1. release is atomic ---------------------------------------------------------------------------


def test_case1_overallocated_tail_not_allocated_frees_nothing_then_retry_frees_once():
    node = Node(page_size=4)
    req = Req("r", range(10), row=1, spec=6)           # committed 10, allocated 16: tail [12, 16)
    node.mgr.offload_kv_cache(req)
    row = node.pool.req_to_token[1]
    good_tail = row[12:16].clone()
    row[12:16] = torch.arange(0, 4, dtype=torch.int32)  # the tail lists slots of page 0...
    node.alloc.free(torch.arange(0, 4, dtype=torch.int64))  # ...which is not allocated
    req.finish()
    refused(node, lambda: node.mgr.finalize_release_on_finish(req), "cannot free its slots")
    assert node.mgr.state_of(req) is P
    row[12:16] = good_tail                             # the scheduler repairs the row
    node.mgr.finalize_release_on_finish(req)
    base = 1 * node.pool.width // 4
    assert node.alloc.freed_pages == [0] + [base + i for i in range(4)]
    assert node.pool.freed_rows == [1] and node.mgr.state_of(req) is R


def test_case1_minus_one_inside_committed_frees_nothing():
    node = Node(page_size=4)
    req = finished_req(node)
    node.pool.req_to_token[1, 3] = -1
    refused(node, lambda: node.mgr._release_finished_req(req), "lists slot -1")
    node.pool.req_to_token[1, 3] = 1 * node.pool.width + 3
    node.mgr._release_finished_req(req)
    assert node.pool.freed_rows == [1] and len(node.alloc.freed_pages) == 3


def test_case1_row_already_freed_by_the_scheduler_frees_nothing():
    node = Node(page_size=4)
    req = finished_req(node)
    row = req.kv.req_pool_idx
    node.pool.free(req)                                # freed behind the manager's back
    refused(node, lambda: node.mgr._release_finished_req(req), "row changed from 1 to None")
    assert node.alloc.freed_pages == []


def test_case1_row_cleared_frees_nothing():
    node = Node(page_size=4)
    req = finished_req(node)
    node.pool.req_to_token[1].zero_()                  # cleared: every position lists slot 0
    refused(node, lambda: node.mgr._release_finished_req(req), "more than once")


# --- 2. a row change is caught by every entry point ------------------------------------------------


def moved(node):
    """Request A decoding on row 0, then moved to row 2 without readmit; B given row 0."""
    a = Req("a", range(8), row=0)
    a.decode(1)
    node.mgr.offload_kv_cache(a)
    a.kv.req_pool_idx = 2
    b = Req("b", range(8), row=0)
    return a, b


@pytest.mark.parametrize("entry", ["offload_no_chunk_due", "offload_chunk_due", "finalize", "release"])
def test_case2_row_moved_without_readmit_is_refused_by_every_entry_point(entry):
    node = Node(page_size=4)
    a, b = moved(node)
    node.mgr.offload_kv_cache(b)
    if entry == "offload_chunk_due":
        for t in range(4):
            a.decode(t)
    if entry == "release":
        a.finish()
    call = {
        "offload_no_chunk_due": lambda: node.mgr.offload_kv_cache(a),
        "offload_chunk_due": lambda: node.mgr.offload_kv_cache(a),
        "finalize": lambda: node.mgr.finalize_release_on_finish(a),
        "release": lambda: node.mgr._release_finished_req(a),
    }[entry]
    refused(node, call, "row changed from 0 to 2 without readmit")
    assert node.alloc.freed_pages == [] and node.pool.freed_rows == []


def test_case2_readmit_rereads_the_new_row():
    node = Node(page_size=4)
    req = Req("r", range(8), row=0)
    req.decode(1)
    node.mgr.offload_kv_cache(req)
    node.mgr.finalize_release_on_finish(req)           # retracted: released
    req.kv.req_pool_idx = 3
    node.mgr.readmit(req)
    req.kv.req_pool_idx = 4                            # moved again, untold
    refused(node, lambda: node.mgr.offload_kv_cache(req), "row changed from 3 to 4")


# --- 3. ownership -----------------------------------------------------------------------------------


def test_case3_readmit_by_a_manager_that_no_longer_owns_the_request_is_refused():
    pool, alloc = ReqToTokenPool(), PagedAllocator(page_size=4)
    mgr_a = DecodeOffloadManager(pool, alloc, page_size=4, offloader=InMemoryOffloader(page_size=4, host_pages=64))
    mgr_b = DecodeOffloadManager(pool, alloc, page_size=4, offloader=InMemoryOffloader(page_size=4, host_pages=64))
    req = Req("r", range(8), row=0)
    req.decode(1)
    mgr_a.offload_kv_cache(req)
    mgr_a.finalize_release_on_finish(req)              # released by A
    req.kv.req_pool_idx = pool.alloc()                 # the scheduler gives it its row and pages again
    alloc.alloc_pages(list(alloc.freed_pages))
    mgr_b.offload_kv_cache(req)                         # picked up by B
    before = (mgr_a.snapshot(), mgr_a.stats(), mgr_b.snapshot(), mgr_b.stats(), list(pool.freed_rows))
    with pytest.raises(InvalidRequest, match="belongs to another manager"):
        mgr_a.readmit(req)
    assert (mgr_a.snapshot(), mgr_a.stats(), mgr_b.snapshot(), mgr_b.stats(), list(pool.freed_rows)) == before
    req.finish()
    mgr_b.finalize_release_on_finish(req)
    assert pool.freed_rows == [0, 0] and mgr_b.state_of(req) is R   # freed once per lifecycle


# --- 4. namespace seed --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [" " * 64, "ab" * 31 + " 0", "g" * 64, "ab" * 33, "ab" * 31, 7])
def test_case4_namespace_seed_must_be_exactly_64_hex(seed):
    with pytest.raises(ConfigError, match="exactly 64 hex"):
        Node(page_size=4, seed=seed)


def test_case4_namespace_seed_case_is_normalised():
    upper, lower = Node(page_size=4, seed="AB" * 32), Node(page_size=4, seed="ab" * 32)
    assert upper.mgr.namespace_seed == "ab" * 32
    reqs = [Req("r", range(8), row=0) for _ in range(2)]
    for node, req in zip((upper, lower), reqs):
        node.mgr.offload_kv_cache(req)
    assert upper.mgr.progress_of(reqs[0]) == lower.mgr.progress_of(reqs[1])
    assert upper.mgr.progress_of(reqs[0]).last_hash == page_hashes(list(range(8)), 4, "ab" * 32)[-1]


# --- 5. allocator page vs manager page --------------------------------------------------------------


def test_case5_an_allocator_page_larger_than_the_manager_page_is_refused():
    with pytest.raises(ConfigError, match="does not divide"):
        Node(page_size=4, alloc_page=8)


def test_case5_a_stuck_copy_never_lets_a_live_page_be_freed_with_a_finer_allocator():
    node = Node(page_size=4, alloc_page=2)
    req = Req("r", range(4), row=1)
    for t in range(5):
        req.decode(t)
        node.mgr.offload_kv_cache(req)                 # chunk [4, 8) in flight
    node.off.expire(list(node.off.pending_writes))
    node.mgr.check_offload_progress()                  # quarantined
    req.finish()
    node.mgr.finalize_release_on_finish(req)
    base = node.pool.width // 2
    assert sorted(node.alloc.freed_pages) == [base, base + 1, base + 4]  # not [4, 8): pages base+2, base+3
    node.alloc.alloc_pages([base, base + 1])           # another request takes the freed pages
    node.off.land()
    node.mgr.check_offload_progress()                  # the stuck copy ends: only its pages go back
    assert sorted(node.alloc.freed_pages) == [base, base + 1, base + 2, base + 3, base + 4]
    assert {base, base + 1} <= node.alloc.held


# --- 6. one offloader, one manager -------------------------------------------------------------------


def test_case6_a_second_manager_over_the_same_offloader_is_refused():
    node = Node(page_size=4)
    with pytest.raises(ConfigError, match="already serves another"):
        DecodeOffloadManager(ReqToTokenPool(), PagedAllocator(page_size=4), page_size=4, offloader=node.off)
    node.mgr.shutdown()
    DecodeOffloadManager(ReqToTokenPool(), PagedAllocator(page_size=4), page_size=4, offloader=node.off)


# --- 7. re-entrant calls -----------------------------------------------------------------------------


def test_case7_a_log_processor_calling_back_into_the_manager_corrupts_nothing():
    node, seen = None, []

    def meddle(_logger, _name, event_dict):
        if node is not None and str(event_dict.get("event")).startswith("lifecycle."):
            node.off.land()
            try:
                node.mgr.check_offload_progress()
            except LifecycleError as err:
                seen.append(err)
        raise structlog.DropEvent

    old = structlog.get_config()
    structlog.configure(processors=[meddle], wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        node = Node(page_size=4)
        reqs = [Req(f"r{i}", range(8), row=i) for i in range(3)]
        for step in range(9):
            for req in reqs:
                req.decode(step)
                node.mgr.offload_kv_cache(req)
                node.mgr.check_integrity()             # after every call, not only at the end
        for req in reqs:
            req.finish()
            if not node.mgr.offload_kv_cache(req):
                node.mgr.finalize_release_on_finish(req)
        node.off.land()
        node.mgr.check_offload_progress()
    finally:
        structlog.configure(**old)
    node.mgr.check_integrity()
    assert all(node.mgr.state_of(r) is R for r in reqs) and sorted(node.pool.freed_rows) == [0, 1, 2]
    assert node.mgr.stats().released == 3 and not seen


def test_case7_a_call_from_inside_a_call_is_refused_and_changes_nothing():
    node = Node(page_size=4)
    write, inner = node.off.write, []

    def write_then_poll(indices, ack):
        before = observe(node)
        try:
            node.mgr.check_offload_progress()
        except ReentrantCall as err:
            inner.append((err, observe(node) == before))
        return write(indices, ack)

    node.off.write = write_then_poll
    req = Req("r", range(4), row=0)
    for t in range(5):
        req.decode(t)
        node.mgr.offload_kv_cache(req)
    assert len(inner) == 1 and inner[0][1] is True
    assert node.mgr.stats().chunks_enqueued == 1
    node.mgr.check_integrity()


# --- 8. a refused first call leaves no trace ----------------------------------------------------------


def test_case8_a_refused_first_call_leaves_no_record():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0, outputs=range(9))
    req.kv.kv_committed_len = 5                        # a chunk is due, but its KV is not committed
    refused(node, lambda: node.mgr.offload_kv_cache(req), "not committed")
    assert node.mgr.state_of(req) is None and node.mgr.stats().tracked == 0
    del req
    assert node.mgr.stats().leaked == 0


# --- 9. first-sight checks, token errors ---------------------------------------------------------------


def test_case9_allocated_beyond_the_row_is_refused_on_first_sight():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0)
    req.kv.kv_allocated_len = 10_000
    refused(node, lambda: node.mgr.offload_kv_cache(req), "exceeds the row width")
    assert node.mgr.state_of(req) is None


def test_case9_numpy_prompt_tokens_are_tokens_and_a_bad_one_is_named_where_it_is():
    node = Node(page_size=4)
    good = Req("np", np.arange(8, dtype=np.int64), row=0)
    node.mgr.offload_kv_cache(good)
    assert node.mgr.progress_of(good).last_hash == page_hashes(list(range(8)), 4)[-1]
    bad = Req("bad", np.array([1, 2, 3, 4, 5, -7, 7, 8]), row=1)
    with pytest.raises(InvalidToken, match=r"token id -7 at position 5") as exc:
        node.mgr.offload_kv_cache(bad)
    assert isinstance(exc.value, TokenRangeError) and isinstance(exc.value, LifecycleError)
    assert node.mgr.state_of(bad) is None
