"""The call discipline of ``lifecycle.calls``: refusals raised, counted and logged alike, the gate's
two refusals (after ``shutdown``, from inside another call), and the host-short warning's pace.

Each refusal is a documented promise: the error and the audit event name the request, the trigger,
the state and the table's reason, and ``refusals()`` counts it by trigger and state. Driven through
the public calls on the real pools.
"""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from lifecycle import InvalidTransition, ManagerClosed, State, audit
from lifecycle.errors import ReentrantCall
from tests.support.real_rig import Rig

PS = 4


def refused(logs):
    return [{k: e[k] for k in ("rid", "trigger", "state", "reason", "log_level")}
            for e in logs if e["event"] == audit.REFUSED]


@pytest.mark.parametrize("state", ["FINISHED", "RELEASED"])
def test_an_offload_of_a_finalized_request_names_the_request_state_and_the_tables_reason(state):
    rig = Rig(PS)
    req, _ = rig.admit("late", 8, 16)
    rig.decode(req, 4)                                  # ack 1 in flight
    rig.mgr.finalize_release_on_finish(req)             # FINISHED: waits for ack 1
    if state == "RELEASED":
        rig.off.land()
        rig.progress()
    assert rig.mgr.state_of(req) is State[state] and rig.mgr.refusals() == {}
    stats = rig.mgr.stats()
    with capture_logs() as logs, pytest.raises(InvalidTransition) as exc:
        rig.mgr.offload_kv_cache(req)
    err = exc.value
    assert (err.rid, err.trigger, err.state, err.reason) == (
        "late", "offload", state, "the request was finalized or released")
    assert str(err) == f"request 'late': cannot 'offload' in state {state}: the request was finalized or released"
    assert refused(logs) == [dict(rid="late", trigger="offload", state=state,
                                  reason="the request was finalized or released", log_level="info")]
    assert rig.mgr.refusals() == {f"offload in {state}": 1}
    # a second refusal counts under the same key; nothing else moved
    with pytest.raises(InvalidTransition, match=f"'offload' in state {state}"):
        rig.mgr.offload_kv_cache(req)
    assert rig.mgr.refusals() == {f"offload in {state}": 2}
    assert rig.mgr.stats() == stats and rig.mgr.state_of(req) is State[state]


def test_a_call_after_shutdown_is_refused_as_closed():
    rig = Rig(PS)
    req, _ = rig.admit("c", 8, 16)
    rig.mgr.shutdown()
    for call in (rig.mgr.offload_kv_cache, rig.mgr.finalize_release_on_finish, rig.mgr.readmit):
        with pytest.raises(ManagerClosed, match="^the manager was shut down$"):
            call(req)
    with pytest.raises(ManagerClosed, match="^the manager was shut down$"):
        rig.mgr.check_offload_progress()
    assert rig.mgr.closed and rig.mgr.state_of(req) is None and rig.mgr.refusals() == {}


def test_a_call_from_inside_a_call_is_refused_as_reentrant_and_says_nothing_changed():
    rig = Rig(PS)
    req, _ = rig.admit("r", 8, 16)
    write, inner = rig.off.write, []

    def write_then_call_back(indices, ack):
        for call in (rig.mgr.check_offload_progress, lambda: rig.mgr.offload_kv_cache(req), rig.mgr.pending):
            with pytest.raises(ReentrantCall) as exc:
                call()
            inner.append(str(exc.value))
        return write(indices, ack)

    rig.off.write = write_then_call_back
    assert rig.decode(req, 4) == [False, False, False, True]
    assert len(inner) == 3 and len(set(inner)) == 1
    message = inner[0]
    assert message.startswith("a DecodeOffloadManager call was made while another call of the same manager is ")
    assert "manager is running (from a log processor or a callback?)" in message
    assert message.endswith("; nothing was changed")
    assert rig.mgr.state_of(req) is State.INFLIGHT and rig.mgr.stats().inflight_writes == 1


def test_host_short_warns_once_per_interval_counting_from_the_last_warning_inclusive():
    rig = Rig(PS, host_pages=0)
    req, _ = rig.admit("h", 8, 64)
    warnings = []
    with capture_logs() as logs:
        for t in (100.0, 159.999, 160.0, 219.0, 220.0):  # one refused offload at each time
            rig.clock.t = t
            rig.decode(req, 4 if t == 100.0 else 1, first=int(t * 10))
    for e in logs:
        if e["event"] == audit.HOST_SHORT_SUMMARY:
            warnings.append((e["refused"], e["total"], e["interval_s"], e["log_level"]))
    # at 100 (the first), at 160 (exactly 60 s later) and at 220 (exactly 60 s after that)
    assert warnings == [(1, 1, 60.0, "warning"), (2, 3, 60.0, "warning"), (2, 5, 60.0, "warning")]
    assert [e["start"] for e in logs if e["event"] == audit.HOST_SHORT] == [8] * 5
    assert rig.mgr.stats().host_short == 5 and rig.mgr.state_of(req) is State.PREFILLED


def test_a_release_sink_calling_back_into_the_manager_is_refused_as_reentrant():
    from lifecycle.release import AllocatorReleaseSink
    from transfer import PagedTokenAllocator, ReqToTokenPool

    seen = []

    class CallingBack(AllocatorReleaseSink):
        def free(self, plan):
            try:
                rig.mgr.pending()
            except ReentrantCall as err:
                seen.append(err)
            super().free(plan)

    alloc, pool = PagedTokenAllocator(4 * 64, 4), ReqToTokenPool(4, 64)
    rig = Rig(4, pool=pool, alloc=alloc, release_sink=CallingBack(pool, alloc))
    req, _ = rig.admit("r", 8, 8)
    req.finish()
    rig.mgr.finalize_release_on_finish(req)
    assert len(seen) == 1 and "while another call of the same manager is running" in str(seen[0])
    assert rig.mgr.pending().copies == 0                 # outside a call: allowed
