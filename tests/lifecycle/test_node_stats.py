"""``NodeStats``: every part's counters in one struct, JSON both ways, the numbers of each part."""

from __future__ import annotations

import msgspec
import pytest
import torch

from lifecycle.node_stats import NodeStats, TierStats, collect, from_stack
from tests.support.decode_driver import PS, Scheduler
from transfer import build_stack


def _run(storage="memory"):
    stack = build_stack(2, 2, 8, torch.float32, PS, 256, 64, 8, 64, storage=storage)
    sched = Scheduler(stack)
    reqs = [sched.admit(r, list(range(50 * r, 50 * r + 6)), 3) for r in range(2)]
    for t in range(7):
        sched.step(500 + t)
    for req in list(sched.running):
        sched.finish(req)
    sched.settle()
    return stack, sched.mgr, reqs


def test_the_parts_are_each_parts_own_stats():
    stack, mgr, _ = _run()
    try:
        s = from_stack(mgr, stack)
        assert s.manager == mgr.stats()
        assert s.offloader == stack.offloader.stats()
        assert s.prefix == stack.prefix_loader.stats()
        assert [t.tier for t in s.tiers] == ["memory"] and s.tiers[0].storage == stack.storage.stats()
        assert s.page_nbytes == stack.host_pool.page_nbytes
        assert s.manager.released == 2 and s.manager.transitions["release"] == 2
        assert s.offloader.pages_stored == s.manager.pages_enqueued == s.tiers[0].storage.stored > 0
    finally:
        mgr.shutdown()
        stack.close()


def test_json_round_trip_and_builtins(tmp_path):
    stack, mgr, _ = _run(f"file:{tmp_path}")
    try:
        s = from_stack(mgr, stack)
        back = msgspec.json.decode(s.to_json(), type=NodeStats)
        assert back.manager == s.manager and back.offloader == s.offloader and back.prefix == s.prefix
        assert back.tiers[0].tier == "file" and back.tiers[0].storage.stored == s.tiers[0].storage.stored
        raw = s.to_builtins()
        assert raw["tiers"][0]["storage"]["stale_indexed"] == 0       # the backend's own extra field
        assert set(raw) == {"manager", "offloader", "tiers", "prefix", "page_nbytes", "refusals"}
    finally:
        mgr.shutdown()
        stack.close()


def test_collect_defaults_to_the_managers_offloader_and_its_storage():
    stack, mgr, _ = _run()
    try:
        s = collect(mgr)
        assert s.offloader == stack.offloader.stats() and s.prefix is None
        assert s.tiers == [TierStats("memory", stack.storage.stats(), None)]
        assert s.page_nbytes == stack.host_pool.page_nbytes
    finally:
        mgr.shutdown()
        stack.close()


def test_a_manager_over_another_offloader_has_no_offloader_or_tier(node):
    s = collect(node.mgr)
    assert s.offloader is None and s.tiers == [] and s.prefix is None and s.page_nbytes == 0
    assert msgspec.json.decode(s.to_json())["manager"]["tracked"] == 0


def test_refusals_are_counted_by_trigger_and_state(node):
    from lifecycle import InvalidTransition
    from lifecycle_tools.testkit.doubles import Req

    req = Req("r", range(8), row=1)
    node.mgr.offload_kv_cache(req)
    node.mgr.finalize_release_on_finish(req)           # retracted: released at once
    assert collect(node.mgr).refusals == {}
    before = node.mgr.stats()
    for _ in range(2):
        with pytest.raises(InvalidTransition):
            node.mgr.finalize_release_on_finish(req)   # released already
    assert collect(node.mgr).refusals == node.mgr.refusals() == {"finish in RELEASED": 2}
    assert node.mgr.stats() == before                  # a refused call leaves stats() as it was
