"""Construction and per-chunk reading edges (each case a mutant that survived the suite before it).

``from_stack`` passes every option through; the per-chunk path honours
``effective_kv_committed_len()`` like the first sight does; a request may allocate its whole row.
"""

from __future__ import annotations

import pytest
import torch

from lifecycle import DecodeOffloadManager, InvalidRequest, State
from lifecycle.release import AllocatorReleaseSink
from lifecycle_tools.testkit.doubles import CountingReq, EffectiveReq
from tests.conftest import Node
from tests.support.ranks import world  # noqa: F401 (fixture)
from tests.support.real_rig import Rig
from transfer import build_stack

PS = 4


def test_from_stack_passes_every_option_through(world):
    stack = build_stack(1, 1, 2, torch.float16, PS, 64, 64, 4, 32)
    sink = AllocatorReleaseSink(stack.req_to_token_pool, stack.allocator)
    seed = "ef" * 32
    try:
        mgr = DecodeOffloadManager.from_stack(stack, offload_stride=8, namespace_seed=seed,
                                              tp_group=world, release_sink=sink)
        assert (mgr.offload_stride, mgr.namespace_seed, mgr.release_sink, mgr.page_size) == (8, seed, sink, PS)
        assert mgr.offloader is stack.offloader and mgr.tp_group is world
        mgr.shutdown()
    finally:
        stack.close()


def test_the_per_chunk_path_honours_the_effective_committed_length():
    rig = Rig(PS)
    row = rig.pool.alloc()
    rig.pool.req_to_token[row, :32] = rig.alloc.alloc(32).to(torch.int32)
    req = EffectiveReq("e", [1000 + i for i in range(8)], row=row, effective=8)
    assert rig.mgr.offload_kv_cache(req) is False         # tracked
    for t in range(5):                                    # kv says 13 committed, effective 9
        req.decode(7000 + t)
    req.effective = 9
    with pytest.raises(InvalidRequest, match=r"chunk \[8, 12\) has tokens whose KV is not committed \(committed 9\)"):
        rig.mgr.offload_kv_cache(req)
    req.effective = 12
    assert rig.mgr.offload_kv_cache(req) is True


def test_a_request_may_allocate_its_whole_row():
    rig = Rig(PS, width=16)
    req, _ = rig.admit("w", 8, 16)
    rig.decode(req, 4)
    req.kv.kv_allocated_len = 16                          # the row's full width
    rig.decode(req, 1, first=7100)
    req.finish()
    rig.mgr.finalize_release_on_finish(req)
    rig.off.land()
    rig.progress()
    assert rig.mgr.state_of(req) is State.RELEASED


def test_the_default_page_size_is_16_and_the_device_pools_slot_count_comes_from_the_offloader():
    from types import SimpleNamespace

    from transfer import PagedTokenAllocator, ReqToTokenPool
    from lifecycle_tools.testkit.memory import InMemoryOffloader

    alloc, pool = PagedTokenAllocator(4 * 64, 16), ReqToTokenPool(4, 64)
    off = InMemoryOffloader(page_size=16, host_pages=8)
    off.kv = SimpleNamespace(slots=100)                  # the device KV pool, as transfer.KVPool tells it
    mgr = DecodeOffloadManager(pool, alloc, offloader=off)
    assert mgr.page_size == 16 and mgr._pools.slot_end == 100


def test_events_go_to_the_stdlib_logger_named_lifecycle_when_structlog_is_not_configured(caplog):
    import logging

    import structlog

    from lifecycle import InvalidTransition

    rig = Rig(4)
    req, _ = rig.admit("l", 8, 16)
    req.finish()
    rig.mgr.finalize_release_on_finish(req)
    saved = structlog.get_config()                       # the suite's configuration (tests/conftest.py)
    structlog.reset_defaults()                           # as in an application that never configured it
    try:
        with caplog.at_level(logging.INFO, logger="lifecycle"):
            with pytest.raises(InvalidTransition):
                rig.mgr.finalize_release_on_finish(req)  # refused: an INFO audit event
    finally:
        structlog.configure(**saved)
    assert [(r.name, r.event_dict["trigger"]) for r in caplog.records] == [("lifecycle", "finish")]


def test_a_dropped_request_is_reported_with_the_slots_it_held_at_its_last_call():
    import gc

    from structlog.testing import capture_logs

    rig = Rig(4)
    req, _ = rig.admit("d", 8, 16, outputs=(7000,))     # one output: nothing due yet
    assert not rig.mgr.offload_kv_cache(req)
    req.kv.kv_allocated_len = 12                         # speculative slots since
    assert not rig.mgr.offload_kv_cache(req)
    del req
    gc.collect()
    with capture_logs() as logs:
        assert rig.mgr.stats().leaked == 1
    (leak,) = [e for e in logs if e["event"] == "lifecycle.leaked"]
    assert leak["slots"] == 12 and leak["state"] == "PREFILLED"


@pytest.mark.parametrize("case", ["nothing committed", "committed == allocated", "allocated == row width",
                                  "strictly inside"])
def test_a_tracked_requests_call_reads_its_committed_length_once_at_every_bound(case):
    """The per-call check of a tracked request is one pass over its lengths, bounds included
    (0 <= committed <= allocated <= width): a bound taken for a doubt would send the call down the
    full check, which reads ``effective_kv_committed_len()`` a second time."""
    node = Node(page_size=PS)
    width = node.pool.width
    prompt = {"nothing committed": (), "allocated == row width": range(width)}.get(case, range(8))
    req = CountingReq("r", prompt, row=0)                # one output token: its KV not written yet
    if case == "strictly inside":
        req.kv.kv_allocated_len += 3                      # room allocated ahead (speculative)
    assert node.mgr.offload_kv_cache(req) is False        # first sight: tracked
    assert node.mgr.stats().tracked == 1
    req.finish()
    req.reads = 0
    node.mgr.finalize_release_on_finish(req)              # no copy in flight: released now
    assert req.reads == 1
    assert node.mgr.stats().tracked == 0 and node.mgr.refusals() == {}
