"""Every audit event carries the fields ``lifecycle.audit`` documents, with the right values.

The audit log is an interface (``kv-lifecycle replay`` and operators read it), so each event is
checked field by field, at its level, in one scenario per event, and each counter of ``stats()``
is checked after more than one occurrence. Driven through the public calls on the real pools.
"""

from __future__ import annotations

import gc

import pytest
from structlog.testing import capture_logs

from hashing import page_hashes
from lifecycle import InvalidTransition, LifecycleError, State, audit
from tests.support.real_rig import Rig
from lifecycle_tools.testkit.memory import InMemoryOffloader

PS = 4


def events(logs, name):
    return [e for e in logs if e["event"] == name]


def pick(event, *keys):
    """The documented fields (a missing one fails the test with a KeyError naming it)."""
    return {k: event[k] for k in keys}


def chain_of(req, n_tokens):
    return page_hashes((req.origin_input_ids + req.output_ids)[:n_tokens], PS)


def test_happy_path_events_and_counters():
    rig = Rig(PS)
    req, _ = rig.admit("a", 8, 16)
    row = req.kv.req_pool_idx
    with capture_logs() as logs:
        rig.clock.t = 100.0
        rig.decode(req, 4)                       # KV 12: ack 1 = [8, 12)
        rig.clock.t = 101.0
        rig.decode(req, 4, first=7100)           # KV 16: ack 2 = [12, 16)
        rig.clock.t = 103.5
        rig.off.land()
        rig.progress()
        rig.off.complete_storage()
        rig.progress()
        req.finish()
        rig.mgr.finalize_release_on_finish(req)
    chain = chain_of(req, 16)
    enq = events(logs, audit.CHUNK_ENQUEUED)
    assert [pick(e, "rid", "row", "gen", "ack_id", "start", "end", "pages", "first_hash", "last_hash", "log_level")
            for e in enq] == [
        dict(rid="a", row=row, gen=0, ack_id=1, start=8, end=12, pages=1, first_hash=chain[2],
             last_hash=chain[2], log_level="debug"),
        dict(rid="a", row=row, gen=0, ack_id=2, start=12, end=16, pages=1, first_hash=chain[3],
             last_hash=chain[3], log_level="debug"),
    ]
    landed = sorted(events(logs, audit.CHUNK_LANDED), key=lambda e: e["ack_id"])
    assert [pick(e, "rid", "row", "gen", "ack_id", "start", "end", "op_id", "latency_s") for e in landed] == [
        dict(rid="a", row=row, gen=0, ack_id=1, start=8, end=12, op_id=landed[0]["op_id"], latency_s=3.5),
        dict(rid="a", row=row, gen=0, ack_id=2, start=12, end=16, op_id=landed[1]["op_id"], latency_s=2.5),
    ]
    assert sorted(e["op_id"] for e in landed) == [1, 2]
    stored = sorted(events(logs, audit.STORED), key=lambda e: e["ack_id"])
    assert [pick(e, "rid", "op_id", "ack_id", "pages", "first_hash", "last_hash") for e in stored] == [
        dict(rid="a", op_id=landed[0]["op_id"], ack_id=1, pages=1, first_hash=chain[2], last_hash=chain[2]),
        dict(rid="a", op_id=landed[1]["op_id"], ack_id=2, pages=1, first_hash=chain[3], last_hash=chain[3]),
    ]
    (rel,) = events(logs, audit.RELEASED)
    assert pick(rel, "rid", "row", "gen", "ranges", "slots", "committed", "allocated", "quarantined",
                "log_level") == dict(rid="a", row=row, gen=0, ranges=[(0, 16)], slots=16, committed=16,
                                     allocated=16, quarantined=0, log_level="debug")
    trans = [pick(e, "rid", "row", "gen", "trigger", "src", "dst") for e in events(logs, audit.TRANSITION)]
    assert {(t["rid"], t["row"], t["gen"]) for t in trans} == {("a", row, 0)}
    assert [(t["trigger"], t["src"], t["dst"]) for t in trans] == [
        ("offload", "PREFILLED", "OFFLOADING"), ("enqueued", "OFFLOADING", "INFLIGHT"),
        ("offload", "INFLIGHT", "OFFLOADING"), ("enqueued", "OFFLOADING", "INFLIGHT"),
        ("landed", "INFLIGHT", "PREFILLED"), ("finish", "PREFILLED", "FINISHED"),
        ("release", "FINISHED", "RELEASED"),
    ]
    s = rig.mgr.stats()
    assert (s.chunks_enqueued, s.pages_enqueued, s.chunks_landed, s.storage_finished, s.released) == (2, 2, 2, 2, 1)
    assert rig.off.host_free_pages() == 256


def test_failed_copies_are_logged_counted_and_never_stored():
    rig = Rig(PS)
    req, _ = rig.admit("f", 8, 16)
    with capture_logs() as logs:
        rig.decode(req, 8)
        rig.off.fail([1, 2])
        rig.progress()
    failed = sorted(events(logs, audit.COPY_FAILED), key=lambda e: e["ack_id"])
    assert [pick(e, "rid", "row", "gen", "ack_id", "start", "end", "log_level") for e in failed] == [
        dict(rid="f", row=req.kv.req_pool_idx, gen=0, ack_id=1, start=8, end=12, log_level="error"),
        # issue 21: a repeat within the rate limiter's interval is at DEBUG (the audit trail keeps it)
        dict(rid="f", row=req.kv.req_pool_idx, gen=0, ack_id=2, start=12, end=16, log_level="debug"),
    ]
    s = rig.mgr.stats()
    assert (s.copy_failures, s.chunks_landed, s.inflight_storage) == (2, 2, 0)
    assert not rig.off.pending_storage and rig.off.host_free_pages() == 256
    assert rig.mgr.state_of(req) is State.PREFILLED


class StorageRefusingOffloader(InMemoryOffloader):
    def write_storage(self, host_indices, tokens, page_hashes, parent_hash=None):
        raise OSError(28, "No space left on device")


def test_a_storage_write_that_raises_is_logged_and_frees_the_host_pages():
    rig = Rig(PS, offloader=StorageRefusingOffloader(page_size=PS, host_pages=64, auto_land=False))
    req, _ = rig.admit("s", 8, 16)
    with capture_logs() as logs:
        rig.decode(req, 4)
        rig.off.land()
        rig.progress()
    errors = [e for e in events(logs, audit.CHUNK_LANDED) if e["log_level"] == "error"]
    assert [pick(e, "rid", "ack_id", "error") for e in errors] == [
        dict(rid="s", ack_id=1, error=repr(OSError(28, "No space left on device")))]
    debug = [e for e in events(logs, audit.CHUNK_LANDED) if e["log_level"] == "debug"]
    assert [pick(e, "ack_id", "op_id") for e in debug] == [dict(ack_id=1, op_id=None)]
    assert rig.off.host_free_pages() == 64 and rig.mgr.stats().inflight_storage == 0


def test_expired_copies_quarantine_then_end_with_the_right_counts():
    rig = Rig(PS)
    done, _ = rig.admit("x", 8, 16)
    live, _ = rig.admit("y", 8, 16)
    with capture_logs() as logs:
        rig.decode(done, 4)                      # ack 1
        rig.decode(live, 4)                      # ack 2
        rig.off.expire([1, 2])
        done.finish()
        rig.mgr.finalize_release_on_finish(done)
        rig.progress()                           # both expire; `done` is released around its slots
        rig.off.land([1, 2])
        rig.progress()                           # both stuck copies end
    expired = sorted(events(logs, audit.COPY_EXPIRED), key=lambda e: e["ack_id"])
    assert [pick(e, "rid", "ack_id", "start", "end", "slots", "log_level") for e in expired] == [
        dict(rid="x", ack_id=1, start=8, end=12, slots=4, log_level="error"),
        dict(rid="y", ack_id=2, start=8, end=12, slots=4, log_level="debug"),   # a repeat: DEBUG (issue 21)
    ]
    (rel,) = events(logs, audit.RELEASED)
    assert pick(rel, "rid", "ranges", "slots", "quarantined") == dict(rid="x", ranges=[(0, 12)], slots=12,
                                                                      quarantined=4)
    ended = sorted(events(logs, audit.EXPIRED_COPY_ENDED), key=lambda e: e["ack_id"])
    assert [pick(e, "rid", "ack_id", "slots_freed", "log_level") for e in ended] == [
        dict(rid="x", ack_id=1, slots_freed=4, log_level="warning"),   # released: its slots come back
        dict(rid="y", ack_id=2, slots_freed=0, log_level="debug"),     # still live: the request keeps them
        #                                                                (a repeat: DEBUG, issue 21)
    ]
    s = rig.mgr.stats()
    assert (s.copies_expired, s.quarantined_slots) == (2, 0)
    assert rig.off.host_free_pages() == 256


def test_host_short_is_logged_per_refusal_and_summarised_at_most_once_a_minute():
    rig = Rig(PS, host_pages=0)
    req, _ = rig.admit("h", 8, 32)
    with capture_logs() as logs:
        for t, steps in ((100.0, 4), (110.0, 1), (171.0, 1)):  # one refused offload each time
            rig.clock.t = t
            rig.decode(req, steps, first=int(t) * 10)
    shorts = events(logs, audit.HOST_SHORT)
    assert [pick(e, "rid", "start", "end", "log_level") for e in shorts] == [
        dict(rid="h", start=8, end=12, log_level="info")] * 3
    summaries = events(logs, audit.HOST_SHORT_SUMMARY)
    assert [pick(e, "refused", "total", "interval_s", "log_level") for e in summaries] == [
        dict(refused=1, total=1, interval_s=60.0, log_level="warning"),
        dict(refused=2, total=3, interval_s=60.0, log_level="warning"),
    ]
    assert rig.mgr.stats().host_short == 3


class RaisingOffloader(InMemoryOffloader):
    def write(self, device_indices, ack_id):
        raise RuntimeError("device lost")


def test_an_offloader_that_raises_is_logged_as_an_error_and_not_counted_short():
    rig = Rig(PS, offloader=RaisingOffloader(page_size=PS, host_pages=8, auto_land=False))
    req, _ = rig.admit("e", 8, 16)
    with capture_logs() as logs, pytest.raises(RuntimeError, match="device lost"):
        rig.decode(req, 4)
    (err,) = events(logs, audit.HOST_SHORT)
    assert pick(err, "rid", "start", "end", "error", "log_level") == dict(
        rid="e", start=8, end=12, error=repr(RuntimeError("device lost")), log_level="error")
    assert rig.mgr.stats().host_short == 0 and rig.mgr.state_of(req) is State.PREFILLED


@pytest.mark.parametrize("case", ["readmit_unseen", "readmit_live", "release_twice", "offload_released"])
def test_refusals_name_the_request_trigger_state_and_reason_in_error_and_log(case):
    rig = Rig(PS)
    req, _ = rig.admit("r", 8, 16)
    expected = {
        "readmit_unseen": ("readmit", "UNSEEN", "never seen"),
        "readmit_live": ("readmit", "PREFILLED", "RELEASED"),
        "release_twice": ("finish", "RELEASED", ""),
        "offload_released": ("offload", "RELEASED", ""),
    }[case]
    if case != "readmit_unseen":
        rig.decode(req, 1)
    if case in ("release_twice", "offload_released"):
        req.finish()
        rig.mgr.finalize_release_on_finish(req)
    with capture_logs() as logs, pytest.raises(InvalidTransition) as info:
        if case.startswith("readmit"):
            rig.mgr.readmit(req)
        elif case == "release_twice":
            rig.mgr.finalize_release_on_finish(req)
        else:
            rig.mgr.offload_kv_cache(req)
    err = info.value
    trigger, state, reason = expected
    assert (err.rid, err.trigger, err.state) == ("r", trigger, state) and reason in err.reason
    (log,) = events(logs, audit.REFUSED)
    assert pick(log, "rid", "trigger", "state", "reason", "log_level") == dict(
        rid="r", trigger=trigger, state=state, reason=err.reason, log_level="info")
    assert f"'{trigger}'" in str(err) and state in str(err) and err.reason in str(err)


def test_a_readmitted_request_logs_its_new_row_and_generation():
    rig = Rig(PS)
    req, _ = rig.admit("g", 8, 16)
    old_row = req.kv.req_pool_idx
    rig.decode(req, 1)
    rig.mgr.finalize_release_on_finish(req)          # retracted: released, not finished
    rig.pool.alloc()                                 # the old row went to someone else
    new_row = rig.pool.alloc()
    slots = rig.alloc.alloc(16)
    rig.pool.req_to_token[new_row, :16] = slots.to(rig.pool.req_to_token.dtype)
    req.kv.req_pool_idx = new_row
    with capture_logs() as logs:
        rig.mgr.readmit(req)
        rig.decode(req, 3, first=7200)               # KV 12: a chunk on the new row
    assert new_row != old_row
    trans = events(logs, audit.TRANSITION)
    assert pick(trans[0], "trigger", "src", "dst") == dict(trigger="readmit", src="RELEASED", dst="PREFILLED")
    (enq,) = events(logs, audit.CHUNK_ENQUEUED)
    assert pick(enq, "rid", "row", "gen", "start", "end") == dict(rid="g", row=new_row, gen=1, start=8, end=12)
    assert rig.mgr.progress_of(req).inc_len == 4


def test_a_dropped_live_request_is_logged_as_leaked_with_its_state_and_slots():
    rig = Rig(PS)
    req, _ = rig.admit("l", 8, 16, spec=3)
    rig.decode(req, 1)
    row = req.kv.req_pool_idx
    with capture_logs() as logs:
        del req
        gc.collect()
        assert rig.mgr.stats().leaked == 1
    (leak,) = events(logs, audit.LEAKED)
    assert pick(leak, "rid", "row", "gen", "state", "slots", "log_level") == dict(
        rid="l", row=row, gen=0, state="PREFILLED", slots=12, log_level="warning")


class ClosingOffloader(InMemoryOffloader):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.closed_with = []

    def close(self, timeout_s=None):
        self.closed_with.append(timeout_s)


def test_shutdown_refuses_with_work_pending_then_force_abandons_it_and_closes_the_offloader():
    rig = Rig(PS, offloader=ClosingOffloader(page_size=PS, host_pages=64, auto_land=False))
    req, _ = rig.admit("z", 8, 16)
    rig.decode(req, 8)                                  # acks 1, 2 in flight
    with pytest.raises(LifecycleError, match="shutdown refused"):
        rig.mgr.shutdown()
    assert rig.off.closed_with == []
    rig.mgr.offload_kv_cache(req)                       # still open
    with capture_logs() as logs:
        pending = rig.mgr.shutdown(force=True, timeout_s=2.5)
    assert pending.copies == 2
    (ab,) = events(logs, audit.ABANDONED)
    assert pick(ab, "held_slots", "copies", "quarantined_slots", "log_level") == dict(
        held_slots=8, copies=[("z", 1, 8, 12), ("z", 2, 12, 16)], quarantined_slots=0, log_level="error")
    assert ab["pending"] == pending.describe()
    (closed_with,) = rig.off.closed_with                # one deadline: the close gets what the drain left
    assert 0.0 <= closed_with <= 2.5
    rig.mgr.shutdown()                                  # idempotent: no second close
    assert rig.off.closed_with == [closed_with]


def test_idle_shutdown_closes_without_abandoning():
    rig = Rig(PS, offloader=ClosingOffloader(page_size=PS, host_pages=64, auto_land=False))
    with capture_logs() as logs:
        rig.mgr.shutdown()
    (closed_with,) = rig.off.closed_with                # the default bound, less the (empty) drain
    assert events(logs, audit.ABANDONED) == [] and 4.0 < closed_with <= 5.0


def test_a_failing_copy_engine_is_bounded_lines_and_a_complete_audit_trail():
    """Issue 21: every chunk's copy failing is one ERROR line per interval on a console, while the
    audit trail (DEBUG and above) still has one ``lifecycle.copy_failed`` per chunk, in order."""
    rig = Rig(PS)
    req, _ = rig.admit("f", 8, 64)
    with capture_logs() as logs:
        rig.decode(req, 40)                      # ten chunks
        rig.off.fail(list(range(1, 11)))
        rig.progress()
    failed = events(logs, audit.COPY_FAILED)
    assert sorted(e["ack_id"] for e in failed) == list(range(1, 11))    # the audit trail: every one
    loud = [e for e in failed if e["log_level"] == "error"]
    assert len(loud) == 1 and all(e["log_level"] == "debug" for e in failed if e not in loud)
    assert rig.mgr.stats().copy_failures == 10
