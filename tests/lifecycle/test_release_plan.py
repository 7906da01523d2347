"""The release seam: the plan a release sink receives, rows the plan refuses, pools that refuse.

``ReleasePlan`` and ``ReleaseSink`` are public (an integration passes its own sink), so the plan's
every field is checked; a row listing a never-written (-1) or repeated slot is refused naming it;
pools that can tell in advance (``check_free``) refuse a release before anything is freed.
"""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from lifecycle import InvalidRequest, State, audit
from lifecycle.release import AllocatorReleaseSink, ReleasePlan, ReleaseRefused
from lifecycle_tools.testkit.doubles import Req
from tests.support.real_rig import Rig
from transfer import PagedTokenAllocator, ReqToTokenPool


class RecordingSink(AllocatorReleaseSink):
    def __init__(self, pool, alloc):
        super().__init__(pool, alloc)
        self.checked, self.freed = [], []

    def check(self, plan):
        self.checked.append(plan)
        super().check(plan)

    def free(self, plan):
        self.freed.append(plan)
        super().free(plan)


def rig_with_sink(page_size=4):
    alloc = PagedTokenAllocator(4 * 64, page_size)
    pool = ReqToTokenPool(4, 64)
    sink = RecordingSink(pool, alloc)
    return Rig(page_size, pool=pool, alloc=alloc, release_sink=sink), sink


def place(rig, rid, committed, allocated, prompt=None):
    """A finished request whose row holds ``ceil(allocated / page)`` pages of real slots."""
    req, slots = rig.admit(rid, committed if prompt is None else prompt, max(allocated, 1))
    req.kv.kv_committed_len, req.kv.kv_allocated_len = committed, allocated
    req.finish()
    return req, slots


@pytest.mark.parametrize(
    "committed,allocated,ranges",
    [(10, 28, ((0, 10), (12, 28))), (12, 20, ((0, 12), (12, 20))), (10, 12, ((0, 10),)),
     (0, 8, ((0, 8),)), (0, 0, ())],
)
def test_the_sink_gets_one_complete_plan(committed, allocated, ranges):
    rig, sink = rig_with_sink()
    req, slots = place(rig, "p", committed, allocated, prompt=8)
    row = req.kv.req_pool_idx
    free_before = rig.alloc.available_size()
    with capture_logs() as logs:
        rig.mgr.finalize_release_on_finish(req)
    (plan,) = sink.freed
    assert sink.checked == [plan]
    want = sorted({int(slots[p]) for s, e in ranges for p in range(s, e)})
    assert (plan.req, plan.rid, plan.row, plan.ranges, plan.committed, plan.allocated, plan.quarantined) == (
        req, "p", row, ranges, committed, allocated, 0)
    assert plan.slots.dtype == torch.int64 and plan.slots.tolist() == want
    (rel,) = [e for e in logs if e["event"] == audit.RELEASED]
    assert (rel["ranges"], rel["slots"], rel["committed"], rel["allocated"]) == (
        list(ranges), sum(e - s for s, e in ranges), committed, allocated)
    assert rig.alloc.available_size() == free_before + (-(-allocated // 4) * 4 if allocated else 0)
    assert req.kv.req_pool_idx is None and rig.mgr.state_of(req) is State.RELEASED


def released_with_an_expired_copy(rig, capacity: int):
    """Request "q" (8 prompt tokens, ``capacity`` slots) decodes 4 tokens, whose copy (ack 1, positions
    8..11) expires; it finishes and is released. Returns ``rig.admit``'s (req, slots)."""
    req, slots = rig.admit("q", 8, capacity)
    rig.decode(req, 4)
    rig.off.expire([1])
    req.finish()
    rig.mgr.finalize_release_on_finish(req)
    rig.progress()
    return req, slots


def test_the_plan_leaves_out_quarantined_slots_and_counts_them():
    rig, sink = rig_with_sink()
    req, slots = released_with_an_expired_copy(rig, 16)
    (plan,) = sink.freed
    assert plan.quarantined == 4 and plan.ranges == ((0, 12),)
    assert plan.slots.tolist() == sorted(int(s) for s in slots[:8])


def make_bare(page_size=1):
    """Pools without ``check_free`` (trusted): the plan's own checks are all that stands."""
    return Rig(page_size)


@pytest.mark.parametrize("page_size,hole", [(1, 5), (4, 5), (4, 0)])
def test_a_row_listing_a_never_written_slot_is_refused_naming_it(page_size, hole):
    rig = make_bare(page_size)
    req, _ = place(rig, "n", 8, 8)
    row = req.kv.req_pool_idx
    if hole:
        rig.pool.req_to_token[row, 0] = 0             # a slot id 0 before the hole
    rig.pool.req_to_token[row, hole] = -1             # hole 0: the row is still ascending
    free_before = rig.alloc.available_size()
    with pytest.raises(InvalidRequest, match=r"lists slot -1 at a position to free \(ranges \[\(0, 8\)\]\)"):
        rig.mgr.finalize_release_on_finish(req)
    assert rig.alloc.available_size() == free_before and req.kv.req_pool_idx == row
    assert rig.mgr.stats().released == 0


def test_a_row_listing_a_slot_twice_is_refused_with_the_count():
    rig = make_bare()
    req, _ = place(rig, "d", 8, 8)
    row = req.kv.req_pool_idx
    rig.pool.req_to_token[row, 6] = rig.pool.req_to_token[row, 2]
    rig.pool.req_to_token[row, 7] = rig.pool.req_to_token[row, 3]
    free_before = rig.alloc.available_size()
    with pytest.raises(InvalidRequest, match=r"lists 2 slot ids more than once in \[\(0, 8\)\]"):
        rig.mgr.finalize_release_on_finish(req)
    assert rig.alloc.available_size() == free_before and req.kv.req_pool_idx == row


class CheckingAllocator(PagedTokenAllocator):
    """The real allocator plus ``check_free``: raises (changing nothing) when a free would fail."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.checks = 0

    def check_free(self, indices):
        self.checks += 1
        pages = torch.unique(indices // self.page_size)
        if not self._pages.is_held(pages):
            raise ValueError(f"pages {pages.tolist()} are not all held")


class CheckingRowPool(ReqToTokenPool):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.checks = 0

    def check_free(self, req):
        self.checks += 1
        row = req.kv.req_pool_idx
        if row is None or not self._held[row]:
            raise ValueError(f"row {row} is not held")


def checking_rig():
    alloc, pool = CheckingAllocator(4 * 64, 4), CheckingRowPool(4, 64)
    return Rig(4, pool=pool, alloc=alloc, release_sink=AllocatorReleaseSink(pool, alloc))


def test_pools_that_can_tell_are_asked_before_anything_is_freed():
    rig = checking_rig()
    req, _ = place(rig, "c", 8, 8)
    rig.mgr.finalize_release_on_finish(req)
    assert (rig.alloc.checks, rig.pool.checks) == (1, 1)
    assert rig.mgr.state_of(req) is State.RELEASED


def test_an_allocator_that_can_tell_is_asked_once_per_release_beside_a_plain_row_pool():
    alloc, pool = CheckingAllocator(4 * 64, 4), ReqToTokenPool(4, 64)
    rig = Rig(4, pool=pool, alloc=alloc, release_sink=AllocatorReleaseSink(pool, alloc))
    req, _ = place(rig, "a", 8, 8)
    rig.mgr.finalize_release_on_finish(req)
    assert alloc.checks == 1 and rig.mgr.state_of(req) is State.RELEASED


def test_no_slots_to_free_means_no_slot_check():
    rig = checking_rig()
    req, _ = place(rig, "e", 0, 0, prompt=8)
    rig.mgr.finalize_release_on_finish(req)
    assert (rig.alloc.checks, rig.pool.checks) == (0, 1)


def test_a_row_freed_behind_the_managers_back_refuses_the_release_and_frees_no_slot():
    rig = checking_rig()
    req, _ = place(rig, "r", 8, 8)
    row = req.kv.req_pool_idx
    rig.pool.free(req)                                # someone else freed the row ...
    req.kv.req_pool_idx = row                         # ... and the request still names it
    free_before = rig.alloc.available_size()
    with pytest.raises(ReleaseRefused, match=rf"request 'r': cannot free its row \(row {row}\): row {row} is not"):
        rig.mgr.finalize_release_on_finish(req)
    assert rig.alloc.available_size() == free_before and rig.mgr.stats().released == 0


def test_slots_freed_behind_the_managers_back_refuse_the_release_and_keep_the_row():
    rig = checking_rig()
    req, slots = place(rig, "s", 8, 8)
    rig.alloc.free(slots[:4])                         # someone else freed a page of it
    row = req.kv.req_pool_idx
    with pytest.raises(ReleaseRefused, match=rf"request 's': cannot free its slots \(row {row}\): pages"):
        rig.mgr.finalize_release_on_finish(req)
    assert req.kv.req_pool_idx == row and rig.pool._held[row]


def test_a_refusal_names_the_row_it_read():
    rig = make_bare(4)
    req, _ = place(rig, "w", 8, 8)
    row = req.kv.req_pool_idx
    rig.pool.req_to_token[row, 6] = rig.pool.req_to_token[row, 2]
    with pytest.raises(InvalidRequest, match=rf"request 'w': row {row} lists 1 slot ids more than once"):
        rig.mgr.finalize_release_on_finish(req)
    rig.pool.req_to_token[row, 3] = -1
    with pytest.raises(InvalidRequest, match=rf"request 'w': row {row} lists slot -1 at a position to free"):
        rig.mgr.finalize_release_on_finish(req)


@pytest.mark.parametrize("says, returned", [(None, 4), (True, 4), (False, 0)])
def test_quarantined_slots_come_back_when_the_copy_ends_unless_the_sink_said_it_freed_nothing(says, returned):
    """``ReleaseSink.free`` returning False: the scheduler frees this request's KV itself, so the
    slots a stuck copy still reads stay the scheduler's; None or True: the manager frees them once
    the copy ends."""

    class Saying(AllocatorReleaseSink):
        def free(self, plan):
            super().free(plan)
            return says

    alloc, pool = PagedTokenAllocator(4 * 64, 4), ReqToTokenPool(4, 64)
    rig = Rig(4, pool=pool, alloc=alloc, release_sink=Saying(pool, alloc))
    req, _ = released_with_an_expired_copy(rig, 12)
    assert rig.mgr.state_of(req) is State.RELEASED
    before = alloc.available_size()
    rig.off.land([1])
    rig.progress()                                   # the stuck copy ends
    assert alloc.available_size() == before + returned


class NoRowCheck(ReqToTokenPool):
    check_free = None                                # not a method: the row pool cannot tell


class NoSlotCheck(PagedTokenAllocator):
    check_free = None


@pytest.mark.parametrize("which", ["slots", "row"])
def test_one_pool_that_can_tell_is_enough_for_the_sink_to_ask_it(which):
    """Only the allocator, or only the row pool, has ``check_free``: that one is still asked, and
    its refusal refuses the release."""
    pool = ReqToTokenPool(4, 64) if which == "row" else NoRowCheck(4, 64)
    alloc = PagedTokenAllocator(4 * 64, 4) if which == "slots" else NoSlotCheck(4 * 64, 4)
    sink = AllocatorReleaseSink(pool, alloc)
    rig = Rig(4, pool=pool, alloc=alloc, release_sink=sink)
    req, slots = place(rig, "o", 8, 8)
    plan = _plan(rig, req)
    sink.check(plan)                                 # all held: no refusal
    if which == "slots":
        alloc.free(slots[:4])                        # freed behind the manager's back
    else:
        row = req.kv.req_pool_idx
        pool.free(req)                               # the row freed behind the manager's back
        req.kv.req_pool_idx = row
    with pytest.raises(ReleaseRefused, match=rf"request 'o': cannot free its {which}"):
        sink.check(plan)


def _plan(rig, req):
    from lifecycle.release import ReleasePlan

    row = req.kv.req_pool_idx
    slots = rig.pool.req_to_token[row, :8].to(torch.int64)
    return ReleasePlan(req, req.rid, row, ((0, 8),), slots, 8, 8)


def test_pools_without_check_free_are_trusted():
    pool, alloc = NoRowCheck(4, 64), NoSlotCheck(4 * 64, 4)
    sink = AllocatorReleaseSink(pool, alloc)
    rig = Rig(4, pool=pool, alloc=alloc, release_sink=sink)
    req, _ = place(rig, "t", 8, 8)
    sink.check(_plan(rig, req))                      # nothing to ask: no refusal
    before = alloc.available_size()
    rig.mgr.finalize_release_on_finish(req)
    assert alloc.available_size() == before + 8 and req.kv.req_pool_idx is None


def test_a_one_slot_pool_is_a_known_slot_count():
    from types import SimpleNamespace

    from lifecycle.release import slot_end

    assert slot_end(SimpleNamespace(kv=SimpleNamespace(slots=1)), None) == 1
    assert slot_end(None, SimpleNamespace(total_slots=1)) == 1
    assert slot_end(None, SimpleNamespace(size=1, page_size=1)) == 2


def test_pools_with_no_check_free_attribute_at_all_are_trusted():
    from types import SimpleNamespace

    freed = []
    pool = SimpleNamespace(free=lambda req: freed.append(("row", req)))
    alloc = SimpleNamespace(free=lambda slots: freed.append(("slots", slots.tolist())))
    sink = AllocatorReleaseSink(pool, alloc)
    plan = ReleasePlan("req", "r", 0, ((0, 2),), torch.tensor([5, 6]), 2, 2)
    sink.check(plan)
    sink.free(plan)
    assert freed == [("slots", [5, 6]), ("row", "req")]


class NoCheckAttribute(PagedTokenAllocator):
    """An allocator without any ``check_free`` attribute (SGLang's allocators have none)."""

    def __getattribute__(self, name):
        if name == "check_free":
            raise AttributeError(name)
        return super().__getattribute__(name)


class CheckFlag(PagedTokenAllocator):
    check_free = True                                # a flag of that name, not a method


def _offload_then_release(alloc_cls):
    """One request offloads a chunk, finishes and is released; returns (manager stats, state,
    free slots afterwards)."""
    alloc, pool = alloc_cls(4 * 64, 4), ReqToTokenPool(4, 64)
    rig = Rig(4, pool=pool, alloc=alloc, release_sink=AllocatorReleaseSink(pool, alloc))
    req, _ = rig.admit("n", 8, 16)
    rig.decode(req, 4)                               # a chunk planned through the slot check
    rig.off.land()                                   # every copy lands
    rig.progress()
    req.finish()
    rig.mgr.finalize_release_on_finish(req)
    return rig.mgr.stats(), rig.mgr.state_of(req), alloc.available_size()


@pytest.mark.parametrize("alloc_cls", [NoCheckAttribute, CheckFlag])
def test_an_allocator_without_a_check_free_method_is_never_asked_and_chunks_and_releases_go_ahead(alloc_cls):
    """``check_free`` is asked only when it is a method: an allocator without one (no such
    attribute, or an attribute of that name that is not callable) is not asked by the chunk
    plan's slot check nor by the default release sink; its request offloads and is released
    exactly as one on an allocator that can tell."""
    stats, state, free = _offload_then_release(alloc_cls)
    base_stats, base_state, base_free = _offload_then_release(PagedTokenAllocator)
    assert stats.chunks_enqueued == base_stats.chunks_enqueued >= 1
    assert state is base_state is State.RELEASED and free == base_free


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("ranges", [((0, 4),), ((0, 4), (8, 12))], ids=["one range", "two ranges"])
def test_a_plans_slots_are_its_own_copy_of_the_row(device, dtype, ranges):
    """The plan's slot ids are read once: a sink that keeps them sees what was planned even after
    the row is reused or poisoned (an int64 row on a device was once handed out as a view)."""
    from lifecycle.release import _row_slots
    from lifecycle_tools.testkit.sync_trap import as_device_resident

    table = torch.arange(32, dtype=dtype).reshape(2, 16)
    if device:
        table = as_device_resident(table)
    slots = _row_slots(table, 1, ranges)
    want = [16 + p for s, e in ranges for p in range(s, e)]
    assert slots.dtype == torch.int64 and slots.tolist() == want
    table[1] = -1                                      # the row poisoned after the plan
    assert slots.tolist() == want
