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


# -- tier names, collect's arguments, from_stack's parts -----------------------------------------------------------
# (each tier kind's name, a backend we do not know, several stores, a store's own breaker, an explicit offloader,
# a manager that has only stats(), and from_stack reading every part from the stack it is given)

import dataclasses  # noqa: E402
import types  # noqa: E402

from lifecycle.node_stats import TIER_NAMES, tier_name  # noqa: E402
from transfer.storage.breaker import CircuitBreaker  # noqa: E402
from transfer.storage.file import FileStorage  # noqa: E402
from transfer.storage.memory import MemoryStorage  # noqa: E402
from transfer.storage.mooncake.store import MooncakeStorage  # noqa: E402
from transfer.storage.redis.store import RedisStorage  # noqa: E402
from transfer.storage.redis.cluster import RedisClusterStorage  # noqa: E402


class ThirdPartyStorage(MemoryStorage):
    """A backend kv-lifecycle has no name for."""


def test_every_tier_kind_has_its_documented_name_and_others_their_class_name(node):
    kinds = {FileStorage: "file", MemoryStorage: "memory", RedisStorage: "redis",
             RedisClusterStorage: "redis_cluster", MooncakeStorage: "mooncake"}
    assert {cls.__name__: name for cls, name in kinds.items()} == TIER_NAMES
    for cls, name in kinds.items():
        assert tier_name(object.__new__(cls)) == name        # by class; nothing connected
    assert tier_name(ThirdPartyStorage()) == "ThirdPartyStorage"
    assert [t.tier for t in collect(node.mgr, storage=[ThirdPartyStorage()]).tiers] == ["ThirdPartyStorage"]


def test_collect_takes_several_stores_each_with_its_own_breaker_or_the_prefix_loaders():
    stack, mgr, _ = _run()
    try:
        own = CircuitBreaker("redis")
        own.failure("down")                                   # open: the redis tier's own breaker
        redis = RedisStorage("redis://127.0.0.1:1/0", check=False, breaker=own)   # never connects
        third = ThirdPartyStorage()
        for stores in ([redis, stack.storage, third], (redis, stack.storage, third)):
            s = collect(mgr, storage=stores, prefix_loader=stack.prefix_loader)
            shared = stack.prefix_loader.breaker.stats()
            assert shared.state == "closed" and own.stats().state == "open"
            assert s.tiers == [TierStats("redis", redis.stats(), own.stats()),
                               TierStats("memory", stack.storage.stats(), shared),
                               TierStats("ThirdPartyStorage", third.stats(), shared)]
        assert collect(mgr, storage=redis).tiers == [TierStats("redis", redis.stats(), own.stats())]
        assert collect(mgr, storage=third).tiers == [TierStats("ThirdPartyStorage", third.stats(), None)]
    finally:
        mgr.shutdown()
        stack.close()


def test_an_offloader_given_to_collect_is_the_one_counted(node):
    stack, mgr, _ = _run()
    try:
        s = collect(node.mgr, offloader=stack.offloader)      # not the manager's own (an InMemoryOffloader)
        assert s.offloader == stack.offloader.stats() and s.offloader.writes > 0
        assert s.tiers == [TierStats("memory", stack.storage.stats(), None)]
        assert s.page_nbytes == stack.host_pool.page_nbytes and s.manager == node.mgr.stats()
    finally:
        mgr.shutdown()
        stack.close()


def test_collect_needs_of_the_manager_only_its_stats(node):
    s = collect(types.SimpleNamespace(stats=node.mgr.stats))   # no offloader, no refusals
    assert s == NodeStats(node.mgr.stats())
    assert (s.offloader, s.tiers, s.prefix, s.page_nbytes, s.refusals) == (None, [], None, 0, {})


def test_from_stack_reads_every_part_from_the_stack_it_is_given(node):
    """The stack's offloader, storage, prefix loader and host pool, not the manager's offloader nor
    what the offloader points at: a stack put together from two."""
    a, mgr, _ = _run()
    b = build_stack(2, 2, 16, torch.float32, PS, 256, 64, 8, 64, storage="memory")
    try:
        mixed = dataclasses.replace(a, storage=b.storage, host_pool=b.host_pool)
        s = from_stack(node.mgr, mixed)
        assert s.manager == node.mgr.stats()
        assert s.offloader == a.offloader.stats() and s.offloader.writes > 0
        assert s.tiers == [TierStats("memory", b.storage.stats(), a.prefix_loader.breaker.stats())]
        assert b.storage.stats().stored == 0 < a.storage.stats().stored
        assert s.prefix == a.prefix_loader.stats()
        assert s.page_nbytes == b.host_pool.page_nbytes == 2 * a.host_pool.page_nbytes
    finally:
        mgr.shutdown()
        a.close()
        b.close()
