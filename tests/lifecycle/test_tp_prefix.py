"""With a TP group, completions are settled as the prefix, in issue order, that has completed.

A one-rank gloo group in this process (MIN over one rank is the rank's own count), so the prefix
rule itself is visible without child processes: a later copy that landed first waits for the
earlier one; storage ops likewise. ``tests/lifecycle/test_tp.py`` checks agreement across ranks.
"""

from __future__ import annotations

from lifecycle import State
from tests.support.ranks import world  # noqa: F401 (fixture)
from tests.support.real_rig import Rig

PS = 4


def test_a_later_copy_waits_for_the_earlier_one_then_both_settle_in_order(world):
    rig = Rig(PS, tp_group=world)
    req, _ = rig.admit("t", 8, 24)
    rig.decode(req, 12)                               # acks 1, 2, 3
    rig.off.land([3, 2])
    rig.progress()
    s = rig.mgr.stats()
    assert (s.chunks_landed, s.inflight_writes, s.inflight_storage) == (0, 3, 0)
    rig.off.land([1])
    rig.progress()
    s = rig.mgr.stats()
    assert (s.chunks_landed, s.inflight_writes, s.inflight_storage) == (3, 0, 3)
    assert sorted(rig.off.pending_storage) == [1, 2, 3]
    assert rig.mgr.state_of(req) is State.PREFILLED


def test_storage_ops_settle_as_a_prefix_too(world):
    rig = Rig(PS, tp_group=world)
    req, _ = rig.admit("u", 8, 16)
    rig.decode(req, 8)                                # acks 1, 2
    rig.off.land()
    rig.progress()                                    # ops 1, 2
    rig.off.complete_storage([2])
    rig.progress()
    assert rig.mgr.stats().storage_finished == 0 and rig.off.host_free_pages() == 254
    rig.off.complete_storage([1])
    rig.progress()
    assert rig.mgr.stats().storage_finished == 2 and rig.off.host_free_pages() == 256


def test_without_a_group_whatever_completed_settles_at_once():
    rig = Rig(PS)
    req, _ = rig.admit("v", 8, 16)
    rig.decode(req, 8)
    rig.off.land([2])
    rig.progress()
    assert rig.mgr.stats().chunks_landed == 1
