"""A request with two expired copies (held-out semantic gap): what its record keeps, what its release
frees, what each late landing frees.

docs/reliability.md (stuck copies): an expired copy's slots are quarantined — left out of the
release — and freed only when that copy finally ends. With two expired copies the record must keep
both (not only the last), the release must leave out both copies' slots and free the rest once, and
each late landing must free exactly its own copy's slots and host pages, in either order.
"""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from lifecycle import State, audit
from lifecycle.release import AllocatorReleaseSink
from tests.support.real_rig import Rig
from transfer import PagedTokenAllocator, ReqToTokenPool
from transfer.errors import DoubleFree

PS = 4


class Sink(AllocatorReleaseSink):
    def __init__(self, pool, alloc):
        super().__init__(pool, alloc)
        self.plans = []

    def free(self, plan):
        self.plans.append(plan)
        super().free(plan)


def two_expired():
    alloc, pool = PagedTokenAllocator(4 * 64, PS), ReqToTokenPool(4, 64)
    sink = Sink(pool, alloc)
    rig = Rig(PS, pool=pool, alloc=alloc, release_sink=sink)
    start_free, host_free = alloc.available_size(), rig.off.host_free_pages()
    req, slots = rig.admit("q", 8, 16)
    rig.decode(req, 8)                                  # ack 1: [8, 12), ack 2: [12, 16)
    rig.off.expire([1, 2])
    rig.progress()
    return rig, sink, req, slots, start_free, host_free


def test_the_record_keeps_both_expired_copies():
    rig, _, req, _, _, _ = two_expired()
    rec = rig.mgr._ledger.records[id(req)]
    assert rec.expired == (1, 2) and rec.inflight == 0
    s = rig.mgr.stats()
    assert (s.copies_expired, s.quarantined_slots, s.inflight_writes) == (2, 8, 0)
    assert rig.mgr.state_of(req) is State.PREFILLED
    rig.mgr.check_integrity()


@pytest.mark.parametrize("order", [(1, 2), (2, 1)])
def test_the_release_leaves_out_both_and_each_late_landing_frees_its_own(order):
    rig, sink, req, slots, start_free, host_free = two_expired()
    req.finish()
    rig.mgr.finalize_release_on_finish(req)
    (plan,) = sink.plans
    assert plan.quarantined == 8 and plan.ranges == ((0, 16),)
    assert plan.slots.tolist() == sorted(int(s) for s in slots[:8])    # the prompt's slots, nothing else
    assert rig.mgr.state_of(req) is State.RELEASED and req.kv.req_pool_idx is None
    assert rig.alloc.available_size() == start_free - 8                 # both copies' pages still held
    copy_slots = {1: slots[8:12], 2: slots[12:16]}
    held = 8
    for ack in order:
        with capture_logs() as logs:
            rig.off.land([ack])
            rig.progress()
        held -= 4
        assert rig.alloc.available_size() == start_free - held
        ended = [e for e in logs if e["event"] == audit.EXPIRED_COPY_ENDED]
        assert [(e["ack_id"], e["slots_freed"]) for e in ended] == [(ack, 4)]
        assert rig.mgr.stats().quarantined_slots == held
        with pytest.raises(DoubleFree):                 # this copy's page went back ...
            rig.alloc.check_free(copy_slots[ack])
        if held:
            rig.alloc.check_free(copy_slots[3 - ack])   # ... the other copy's page is still held
    assert rig.off.host_free_pages() == host_free and rig.mgr.idle()
    rig.mgr.check_integrity()
    rig.alloc.check_integrity()


def test_a_copy_that_ends_before_the_release_is_freed_by_the_release_the_other_later():
    rig, sink, req, slots, start_free, host_free = two_expired()
    rig.off.land([1])
    rig.progress()                                      # ack 1 ended while the request is live
    rec = rig.mgr._ledger.records[id(req)]
    assert rig.alloc.available_size() == start_free - 16        # nothing freed: the request holds them
    assert rig.mgr.stats().quarantined_slots == 4
    req.finish()
    rig.mgr.finalize_release_on_finish(req)
    (plan,) = sink.plans
    assert plan.quarantined == 4 and plan.slots.tolist() == sorted(int(s) for s in slots[:12])
    assert rec.expired is None and rig.alloc.available_size() == start_free - 4
    rig.off.land([2])
    rig.progress()
    assert rig.alloc.available_size() == start_free and rig.off.host_free_pages() == host_free
    rig.mgr.check_integrity()
