"""A release of a row in device memory: its slot ids checked on the device, the verdict read later.

``plan_release`` never reads a device row's ids on the host (a device -> host sync on the
scheduler thread); it issues ``transfer.gather.check_ids_on_device`` and keeps the verdict with the
plan. The release goes ahead (refusing would need the sync; SGLang's sink frees by ranges anyway);
the next ``check_offload_progress`` reads the verdict once its event has fired and reports a bad row:
``stats().bad_release_rows`` and one ``lifecycle.bad_release_row`` at ERROR. Here the row is a
``DeviceResident`` stand-in and every manager call runs armed (``no_host_sync``); a sink frees by
ranges, as SGLang's does. Host rows are unchanged: checked on the host, refused, nothing queued.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from structlog.testing import capture_logs

import lifecycle.release as release
from lifecycle import InvalidRequest, audit, settle
from lifecycle.release import slot_end
from lifecycle_tools.testkit.sync_trap import as_device_resident, no_host_sync
from tests.support.real_rig import Rig

PS = 4
END = 4 * 64 + PS  # the rig's PagedTokenAllocator: total_slots


class RangeSink:
    """Frees by ranges, never reading the plan's ids (as SGLang's release sink does)."""

    def __init__(self, pool):
        self.pool, self.freed = pool, []

    def check(self, plan):
        pass

    def free(self, plan):
        self.freed.append((plan.row, plan.ranges))
        self.pool.free(plan.req)


def device_rig(**kw):
    rig = Rig(PS, **kw)
    rig.mgr.release_sink = RangeSink(rig.pool)
    rig.pool.req_to_token = as_device_resident(rig.pool.req_to_token)
    return rig


def finished(rig, rid, bad=None, at=5):
    """A finished request: 8 tokens on two pages (ranges [(0, 8)]), ``bad`` written at ``at``."""
    req, slots = rig.admit(rid, 8, 8, outputs=(7000,))
    req.finish()
    if bad is not None:
        rig.pool.req_to_token[req.kv.req_pool_idx, at] = bad
    return req


def bad_rows(logs):
    return [e for e in logs if e["event"] == audit.BAD_RELEASE_ROW]


def test_the_pools_slot_count_comes_from_attributes_never_from_device_memory():
    kv = SimpleNamespace(kv=SimpleNamespace(slots=100))
    assert slot_end(kv, SimpleNamespace(total_slots=50, size=8, page_size=4)) == 100  # the device pool first
    assert slot_end(None, SimpleNamespace(total_slots=50, size=8, page_size=4)) == 50
    assert slot_end(SimpleNamespace(kv=torch.zeros(3)), SimpleNamespace(size=8, page_size=4)) == 12  # SGLang
    assert slot_end(None, SimpleNamespace(size=8)) is None
    assert slot_end(None, SimpleNamespace(size=8, page_size=True)) is None  # a bool is no count
    assert slot_end(SimpleNamespace(kv=SimpleNamespace(slots=0)), SimpleNamespace(total_slots=-1)) is None
    assert device_rig().mgr._pools.slot_end == END


@pytest.mark.parametrize("bad, field, words", [
    (-1, "negative", "1 negative slot ids (smallest -1; -1: KV never allocated there)"),
    (END, "out_of_range", f"1 slot ids at or past the pool's {END} slots (largest {END})"),
    ("repeat", "repeated", "1 slot ids listed more than once (e.g. {id}; a cleared or overwritten row)"),
], ids=["negative", "out-of-range", "repeated"])
def test_a_bad_device_row_is_released_then_reported_at_the_next_progress_check(bad, field, words):
    rig = device_rig()
    req = finished(rig, "r")
    row = req.kv.req_pool_idx
    table = rig.pool.req_to_token
    if bad == "repeat":
        bad = int(table[row, 2])
        words = words.format(id=bad)
    table[row, 5] = bad
    with capture_logs() as logs:
        with no_host_sync():
            rig.mgr.finalize_release_on_finish(req)
        assert rig.mgr.stats().released == 1 and rig.mgr.release_sink.freed == [(row, ((0, 8),))]  # not refused
        assert rig.mgr.stats().bad_release_rows == 0 and bad_rows(logs) == []  # not read by the release call
        with no_host_sync():
            rig.mgr.check_offload_progress()
        with no_host_sync():
            rig.mgr.check_offload_progress()
    assert rig.mgr.stats().bad_release_rows == 1
    (event,) = bad_rows(logs)
    assert (event["log_level"], event["rid"], event["row"], event["gen"]) == ("error", "r", row, 0)
    assert event["ranges"] == [(0, 8)] and event["problem"] == words and event["slots_end"] == END
    assert event[field] == 1 and sum(event[k] for k in ("negative", "out_of_range", "repeated")) == 1
    assert not rig.mgr._ledger.release_checks


def test_the_last_slot_of_the_pool_and_a_good_row_report_nothing():
    rig = device_rig()
    req = finished(rig, "edge", bad=END - 1)
    good = finished(rig, "good")
    with capture_logs() as logs, no_host_sync():
        rig.mgr.finalize_release_on_finish(req)
        rig.mgr.finalize_release_on_finish(good)
        assert len(rig.mgr._ledger.release_checks) == 2
        rig.mgr.check_offload_progress()
    assert rig.mgr.stats().bad_release_rows == 0 and bad_rows(logs) == [] and not rig.mgr._ledger.release_checks


def test_without_a_known_pool_size_only_negatives_and_repeats_are_checked():
    rig = device_rig()
    rig.mgr._pools.slot_end = None
    far, neg = finished(rig, "far", bad=10 ** 6), finished(rig, "neg", bad=-1)
    with capture_logs() as logs, no_host_sync():
        rig.mgr.finalize_release_on_finish(far)
        rig.mgr.finalize_release_on_finish(neg)
        rig.mgr.check_offload_progress()
    assert rig.mgr.stats().bad_release_rows == 1 and [e["rid"] for e in bad_rows(logs)] == ["neg"]


def test_each_bad_row_is_counted_and_logged_once_at_error_or_debug_within_the_interval():
    rig = device_rig()
    reqs = [finished(rig, f"b{i}", bad=-1) for i in range(3)]
    with capture_logs() as logs, no_host_sync():
        for req in reqs:
            rig.mgr.finalize_release_on_finish(req)
        rig.mgr.check_offload_progress()
    assert rig.mgr.stats().bad_release_rows == 3
    assert [(e["rid"], e["log_level"]) for e in bad_rows(logs)] == [("b0", "error"), ("b1", "debug"), ("b2", "debug")]


def test_host_rows_are_refused_on_the_host_and_queue_no_device_check():
    rig = Rig(PS)
    req = finished(rig, "h", bad=-1)
    with pytest.raises(InvalidRequest, match="lists slot -1"):
        rig.mgr.finalize_release_on_finish(req)
    ok = finished(rig, "ok")
    rig.mgr.finalize_release_on_finish(ok)
    assert not rig.mgr._ledger.release_checks and rig.mgr.stats().bad_release_rows == 0


def test_a_refused_device_release_queues_nothing():
    rig = device_rig()

    class Refusing(RangeSink):
        def check(self, plan):
            raise release.ReleaseRefused("no")

    rig.mgr.release_sink = Refusing(rig.pool)
    req = finished(rig, "x", bad=-1)
    with no_host_sync(), pytest.raises(release.ReleaseRefused):
        rig.mgr.finalize_release_on_finish(req)
    assert not rig.mgr._ledger.release_checks


class NotYet:
    """A CUDA event stand-in: not fired until ``fired`` is set."""

    def __init__(self):
        self.fired = False

    def query(self):
        return self.fired


@pytest.fixture
def events(monkeypatch):
    """Every device-side release check issued gets a ``NotYet`` event (in issue order)."""
    issued, check = [], release.check_ids_on_device

    def with_event(ids, end):
        verdict, _ = check(ids, end)
        issued.append(NotYet())
        return verdict, issued[-1]

    monkeypatch.setattr(release, "check_ids_on_device", with_event)
    return issued


def test_a_verdict_is_read_only_after_its_event_fired_and_in_order(events):
    rig = device_rig()
    a, b = finished(rig, "a", bad=-1), finished(rig, "b", bad=-1)
    with capture_logs() as logs, no_host_sync():
        rig.mgr.finalize_release_on_finish(a)
        rig.mgr.finalize_release_on_finish(b)
        rig.mgr.check_offload_progress()
        assert rig.mgr.stats().bad_release_rows == 0 and len(rig.mgr._ledger.release_checks) == 2
        events[1].fired = True
        rig.mgr.check_offload_progress()
        assert [c.rid for c in rig.mgr._ledger.release_checks] == ["a"] and rig.mgr.stats().bad_release_rows == 1
        events[0].fired = True
        rig.mgr.check_offload_progress()
    assert [e["rid"] for e in bad_rows(logs)] == ["b", "a"] and not rig.mgr._ledger.release_checks


def test_unread_verdicts_are_bounded_when_progress_checks_stop(events, monkeypatch):
    monkeypatch.setattr(settle, "MAX_RELEASE_CHECKS", 2)
    rig = device_rig()
    reqs = [finished(rig, f"r{i}", bad=-1) for i in range(4)]
    with capture_logs() as logs, no_host_sync():
        rig.mgr.finalize_release_on_finish(reqs[0])
        rig.mgr.finalize_release_on_finish(reqs[1])
        events[0].fired = True
        rig.mgr.finalize_release_on_finish(reqs[2])  # over the bound: the landed one is read first
        assert [c.rid for c in rig.mgr._ledger.release_checks] == ["r1", "r2"] and rig.mgr.stats().bad_release_rows == 1
        rig.mgr.finalize_release_on_finish(reqs[3])  # none landed: the oldest dropped unread
        assert [c.rid for c in rig.mgr._ledger.release_checks] == ["r2", "r3"]
    (dropped,) = [e for e in logs if e["event"] == audit.RELEASE_CHECKS_UNREAD]
    assert dropped["unread"] == 1 and dropped["log_level"] == "warning"
    assert rig.mgr.stats().released == 4


def test_shutdown_reads_the_landed_verdicts_and_drops_the_rest_without_waiting(events):
    rig = device_rig()
    a, b = finished(rig, "a", bad=-1), finished(rig, "b", bad=-1)
    with no_host_sync():
        rig.mgr.finalize_release_on_finish(a)
        rig.mgr.finalize_release_on_finish(b)
    events[0].fired = True
    with capture_logs() as logs:
        rig.mgr.shutdown()
    assert rig.mgr.stats().bad_release_rows == 1 and [e["rid"] for e in bad_rows(logs)] == ["a"]
    (dropped,) = [e for e in logs if e["event"] == audit.RELEASE_CHECKS_UNREAD]
    assert dropped["unread"] == 1 and not rig.mgr._ledger.release_checks


def test_a_refused_shutdown_keeps_the_unread_verdicts(events):
    rig = device_rig()
    a = finished(rig, "a", bad=-1)
    busy, _ = rig.admit("busy", 8, 16)
    with no_host_sync():
        rig.mgr.finalize_release_on_finish(a)
    for token in range(7001, 7005):
        busy.decode(token)
    assert rig.mgr.offload_kv_cache(busy)  # a copy in flight
    with pytest.raises(Exception, match="shutdown refused"):
        rig.mgr.shutdown()
    assert len(rig.mgr._ledger.release_checks) == 1


class PlanSink(RangeSink):
    """A ``RangeSink`` that keeps the plans it freed."""

    def __init__(self, pool):
        super().__init__(pool)
        self.plans = []

    def free(self, plan):
        self.plans.append(plan)
        super().free(plan)


def test_a_device_row_with_an_over_allocation_is_checked_over_both_ranges_as_int64():
    """committed 6, allocated 12 (page 4): ranges (0, 6) and (8, 12); a -1 in the second range is
    reported, and the plan's ids are the row's ids of both ranges, int64 (the row is int32)."""
    rig = device_rig()
    rig.mgr.release_sink = sink = PlanSink(rig.pool)
    req, slots = rig.admit("spec", 6, 12, spec=6)
    req.finish()
    row = req.kv.req_pool_idx
    table = rig.pool.req_to_token
    assert table.dtype == torch.int32
    table[row, 9] = -1
    want = [int(table[row, p]) for p in (*range(0, 6), *range(8, 12))]
    with capture_logs() as logs:
        with no_host_sync():
            rig.mgr.finalize_release_on_finish(req)
            rig.mgr.check_offload_progress()
    (plan,) = sink.plans
    assert plan.ranges == ((0, 6), (8, 12)) and plan.slots.dtype == torch.int64
    assert plan.slots.tolist() == want
    (event,) = bad_rows(logs)
    assert event["rid"] == "spec" and event["negative"] == 1 and event["ranges"] == [(0, 6), (8, 12)]


def test_a_device_row_with_a_stuck_copy_frees_through_the_allocator_around_the_quarantine():
    """The one host read of a device row: an expired copy's slots are left out, the rest freed
    by the default sink (through the allocator), the quarantined ones once the copy ends."""
    rig = Rig(PS)
    rig.pool.req_to_token = as_device_resident(rig.pool.req_to_token)
    req, slots = rig.admit("q", 8, 16)
    rig.decode(req, 4)                                # ack 1 reads positions 8..11
    rig.off.expire([1])
    req.finish()
    before = rig.alloc.available_size()
    rig.mgr.finalize_release_on_finish(req)
    rig.progress()
    assert rig.mgr.stats().released == 1 and req.kv.req_pool_idx is None
    assert rig.alloc.available_size() == before + 8  # 12 slots allocated, 4 read by the stuck copy
    rig.off.land([1])
    rig.progress()
    assert rig.alloc.available_size() == before + 12
    rig.alloc.check_integrity()


def test_a_row_with_two_kinds_of_bad_ids_reports_both_and_why_it_was_not_refused():
    rig = device_rig()
    req = finished(rig, "two", bad=-1, at=5)
    row = req.kv.req_pool_idx
    table = rig.pool.req_to_token
    table[row, 6] = table[row, 1]
    with capture_logs() as logs, no_host_sync():
        rig.mgr.finalize_release_on_finish(req)
        rig.mgr.check_offload_progress()
    (event,) = bad_rows(logs)
    assert event["problem"] == (
        "1 negative slot ids (smallest -1; -1: KV never allocated there); "
        f"1 slot ids listed more than once (e.g. {int(table[row, 1])}; a cleared or overwritten row)")
    assert event["why"] == "checked on the device after the release was issued: reported, not refused"


def test_verdicts_are_kept_unread_up_to_the_bound_and_read_when_it_is_passed(monkeypatch):
    monkeypatch.setattr(settle, "MAX_RELEASE_CHECKS", 2)
    rig = device_rig()
    reqs = [finished(rig, f"r{i}", bad=-1) for i in range(3)]
    with capture_logs() as logs, no_host_sync():
        rig.mgr.finalize_release_on_finish(reqs[0])
        rig.mgr.finalize_release_on_finish(reqs[1])
        assert len(rig.mgr._ledger.release_checks) == 2 and rig.mgr.stats().bad_release_rows == 0  # at the bound
        rig.mgr.finalize_release_on_finish(reqs[2])  # past it: the landed verdicts are read now
    assert rig.mgr.stats().bad_release_rows == 3 and not rig.mgr._ledger.release_checks
    assert [e for e in logs if e["event"] == audit.RELEASE_CHECKS_UNREAD] == []


def test_dropped_verdicts_say_why(events, monkeypatch):
    monkeypatch.setattr(settle, "MAX_RELEASE_CHECKS", 1)
    rig = device_rig()
    a, b = finished(rig, "a", bad=-1), finished(rig, "b", bad=-1)
    with capture_logs() as logs, no_host_sync():
        rig.mgr.finalize_release_on_finish(a)
        rig.mgr.finalize_release_on_finish(b)    # none landed: the oldest dropped unread
    (bound,) = [e for e in logs if e["event"] == audit.RELEASE_CHECKS_UNREAD]
    assert bound["why"] == "more than 1 released device rows not yet checked: is check_offload_progress called?"
    with capture_logs() as at_shutdown:
        rig.mgr.shutdown()
    (final,) = [e for e in at_shutdown if e["event"] == audit.RELEASE_CHECKS_UNREAD]
    assert final["unread"] == 1 and final["why"] == "shutdown: their verdict had not landed"
