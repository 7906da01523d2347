"""``check_integrity`` (``lifecycle.integrity``): a consistent manager passes in every state it can
reach, and each way its tables can disagree is reported by name, every disagreement in one error.

The disagreements cannot be reached through the public calls (that is the point of the check), so
each scenario corrupts one table of a live manager by hand, the way a bug would, and asserts the
whole list of problems the error gives (``"; "``-separated, in check order).
"""

from __future__ import annotations

import pytest

from lifecycle import IntegrityError, State
from tests.support.real_rig import Rig

PS = 4


def problems(rig):
    with pytest.raises(IntegrityError) as exc:
        rig.mgr.check_integrity()
    return str(exc.value).split("; ")


def two_copies():
    """Request 'a' INFLIGHT with acks 1 and 2 (slots of [8, 12) and [12, 16)); 'b' PREFILLED."""
    rig = Rig(PS)
    a, _ = rig.admit("a", 8, 16)
    rig.decode(a, 8)
    b, _ = rig.admit("b", 8, 16)
    rig.mgr.offload_kv_cache(b)
    assert (rig.mgr.state_of(a), rig.mgr.state_of(b)) == (State.INFLIGHT, State.PREFILLED)
    return rig, a, b


def test_every_reachable_state_passes_the_check():
    rig, a, b = two_copies()
    rig.mgr.check_integrity()                            # two copies of one request in flight
    a.finish()
    rig.mgr.finalize_release_on_finish(a)                # FINISHED, waiting on both copies
    assert rig.mgr.state_of(a) is State.FINISHED
    rig.mgr.check_integrity()
    rig.off.expire([1])                                  # ack 1 expires: its slots quarantined
    rig.progress()
    rig.mgr.check_integrity()
    assert rig.mgr.disown_expired_copies([1]) == 1       # their owner freed them: not counted any more
    rig.mgr.check_integrity()
    rig.off.land([2])
    rig.progress()
    assert rig.mgr.state_of(a) is State.RELEASED
    rig.mgr.check_integrity()
    b.finish()
    rig.mgr.finalize_release_on_finish(b)
    rig.mgr.check_integrity()


def test_a_wrong_inflight_count_is_reported_with_what_the_state_then_contradicts():
    rig, a, _ = two_copies()
    rig.mgr._ledger.records[id(a)].inflight = 0
    assert problems(rig) == ["'a': inflight 0 but 2 chunks outstanding", "'a': INFLIGHT with nothing in flight"]


def force_state(rig, req, state: str) -> None:
    """Put ``req``'s record in ``state`` behind the machine's back, the state counters kept in step
    (so that only the contradiction under test is reported)."""
    rec = rig.mgr._ledger.records[id(req)]
    rig.mgr._ledger.by_state[rec.state.name] -= 1
    rig.mgr._ledger.by_state[state] += 1
    rec.state = State[state]


def test_a_record_left_in_offloading_is_reported():
    rig, _, b = two_copies()
    force_state(rig, b, "OFFLOADING")
    assert problems(rig) == ["'b': left in OFFLOADING"]


@pytest.mark.parametrize("state", ["PREFILLED", "RELEASED"])
def test_copies_in_flight_for_a_record_that_cannot_have_them_are_reported(state):
    rig, a, _ = two_copies()
    force_state(rig, a, state)
    assert problems(rig) == [f"ack 1 in flight for 'a' in {state}", f"ack 2 in flight for 'a' in {state}",
                             f"'a': {state} with 2 copies in flight"]


def test_a_finished_record_with_nothing_in_flight_is_reported_as_unreleased():
    rig, _, b = two_copies()
    force_state(rig, b, "FINISHED")
    assert problems(rig) == ["'b': FINISHED with nothing in flight but not released"]


def test_chunks_of_no_live_record_and_disagreeing_counters_are_reported():
    rig, a, _ = two_copies()
    del rig.mgr._ledger.records[id(a)]
    assert problems(rig) == [
        "2 in-flight chunks belong to no live record",
        "state counters {'PREFILLED': 1, 'OFFLOADING': 0, 'INFLIGHT': 1, 'FINISHED': 0, 'RELEASED': 0} "
        "disagree with records {'PREFILLED': 1, 'OFFLOADING': 0, 'INFLIGHT': 0, 'FINISHED': 0, 'RELEASED': 0}",
    ]


def test_slot_reads_that_disagree_with_the_copies_in_flight_are_reported():
    rig, _, _ = two_copies()
    rig.mgr._ledger.reading.remove(2)
    assert problems(rig) == ["4 slot reads counted, but copies in flight read 8 slots"]
    rig, _, _ = two_copies()
    rig.off.expire([1])
    rig.progress()
    rig.mgr.check_integrity()                            # the expired copy's 4 slots still count
    rig.mgr._ledger.expired[1].disowned = True                  # disowned without uncounting its reads
    assert problems(rig) == ["8 slot reads counted, but copies in flight read 4 slots"]


def test_pending_names_each_kind_of_pending_work_in_one_line():
    rig = Rig(PS)
    assert rig.mgr.pending().describe() == "0 copies in flight, 0 storage ops in flight"
    a, _ = rig.admit("a", 8, 16)
    rig.decode(a, 8)                                     # acks 1, 2
    b, _ = rig.admit("b", 8, 16)
    rig.decode(b, 4)                                     # ack 3
    rig.off.expire([3])
    rig.progress()                                       # b's copy expired: 4 slots quarantined
    a.finish()
    rig.mgr.finalize_release_on_finish(a)                # a waits for acks 1 and 2
    rig.off.land([1, 2])                                 # reported, not settled
    pending = rig.mgr.pending()
    assert (pending.copies, pending.unsettled, pending.storage_ops, pending.quarantined_slots,
            pending.finished_waiting, pending.finished_waiting_on_settled) == (0, 2, 0, 4, 1, 1)
    assert pending.describe().split(", ") == [
        "0 copies in flight", "0 storage ops in flight",
        "2 completions reported but never settled (call check_offload_progress)",
        "1 finished requests holding slots (1 only waiting for check_offload_progress)",
        "4 slots quarantined by expired copies",
    ]


def test_unsettled_counts_finished_storage_writes_not_yet_settled():
    rig = Rig(4)
    req, _ = rig.admit("s", 8, 16)
    rig.decode(req, 4)
    rig.off.land()
    rig.progress()                                   # landed: its storage write submitted
    rig.off.complete_storage()
    rig.mgr.pending()                                # collects the finished write, settles nothing
    assert rig.mgr.stats().unsettled == 1
    rig.progress()
    assert rig.mgr.stats().unsettled == 0
