"""Every row of ``lifecycle.states.TRANSITIONS`` and every entry of ``REFUSALS``, driven through the
public calls of a real ``DecodeOffloadManager``, over both rigs (``doubles``, ``real-pools``).

The cases are generated from the table itself: one per (row, source state) and one per (refusal,
state it is selected in: its ``states``, and the sources of the rows whose guard it names). Each
case is looked up in a mapping to the scenario that drives a request into the source state and
fires the trigger through a public entry point (``offload_kv_cache``, ``check_offload_progress``,
``finalize_release_on_finish``, ``_release_finished_req``, ``readmit``):

* a row: the audit log records the row's transition (trigger, source, destination), the request
  ends where the row (and what the call does next) takes it, and the row's work is done;
* a refusal: the call raises ``InvalidTransition`` naming the request, the trigger, the state and
  the refusal's own explanation (``Refusal.explain`` of the facts the manager saw, which ``decide``
  maps to this very entry), and changes nothing: pools, rows, host pool, ``snapshot()``,
  ``stats()`` as they were; only ``refusals()`` counts it.

A row or refusal added to the table without a scenario fails its own case and
``test_the_scenarios_cover_the_table_exactly``; so does a scenario left for a row that is gone.

``OFFLOADING`` lasts only inside ``offload_kv_cache`` (while the offloader's ``write`` runs): the
only public call a scheduler can make then is a call from inside that call, which is refused with
``ReentrantCall`` before the table is asked (nothing changed). Those refusal cases check that; the
table's own wording for them is checked on the machine in ``test_machine.py``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import pytest
from structlog.testing import capture_logs

from lifecycle import InvalidTransition, ReentrantCall, State, audit
from lifecycle.states import REFUSALS, TRANSITIONS, Facts, Refusal, decide

PREFILLED, OFFLOADING, INFLIGHT = State.PREFILLED, State.OFFLOADING, State.INFLIGHT
FINISHED, RELEASED = State.FINISHED, State.RELEASED


def _list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


# --- the cases, generated from the table ---------------------------------------------------------


class RowCase(NamedTuple):
    """One source state of one row of ``TRANSITIONS``."""

    trigger: str
    source: str
    dest: str
    guard: str  # "if NAME" / "unless NAME" (space separated), "" for none

    def __str__(self) -> str:
        return f"{self.trigger}: {self.source} -> {self.dest}" + (f" {self.guard}" if self.guard else "")


class RefusalCase(NamedTuple):
    """One state in which one entry of ``REFUSALS`` is selected."""

    trigger: str
    when: str
    state: str

    def __str__(self) -> str:
        return f"{self.trigger} refused in {self.state}: {self.when}"


def row_cases() -> list[RowCase]:
    cases = []
    for row in TRANSITIONS:
        guard = " ".join([f"if {g}" for g in _list(row.get("conditions"))]
                         + [f"unless {g}" for g in _list(row.get("unless"))])
        cases += [RowCase(row["trigger"], src.name, row["dest"].name, guard) for src in _list(row["source"])]
    return cases


def refusal_states(refusal: Refusal) -> list[State]:
    """The states in which ``decide`` may select ``refusal``: its ``states``, then the sources of
    the rows of its trigger whose guard it names."""
    states = list(refusal.states)
    if refusal.guard is not None:
        name = refusal.guard.lstrip("!")
        for row in TRANSITIONS:
            guards = _list(row.get("unless") if refusal.guard.startswith("!") else row.get("conditions"))
            if row["trigger"] == refusal.trigger and name in guards:
                states += [s for s in _list(row["source"]) if s not in states]
    return states


def refusal_cases() -> list[RefusalCase]:
    return [RefusalCase(r.trigger, r.when, s.name) for r in REFUSALS for s in refusal_states(r)]


def refusal_of(case: RefusalCase) -> Refusal:
    (entry,) = [r for r in REFUSALS if (r.trigger, r.when) == (case.trigger, case.when)]
    return entry


# --- scenarios: drive a request into a state -------------------------------------------------------


def tracked(rig):
    """PREFILLED: seen once, no chunk due yet (prompt of 8 tokens, page 4: two prompt pages)."""
    req = rig.admit("r", 8, 32)
    assert rig.mgr.offload_kv_cache(req) is False
    return rig, req


def inflight(rig):
    """INFLIGHT: one chunk ([8, 12)) in flight."""
    rig, req = tracked(rig)
    assert rig.decode(req, 4) == [False, False, False, True]
    return rig, req


def finalized(rig):
    """FINISHED: finalized (retracted) with its chunk in flight."""
    rig, req = inflight(rig)
    rig.mgr.finalize_release_on_finish(req)
    return rig, req


def released(rig):
    """RELEASED: retracted with nothing in flight (released at once)."""
    rig, req = tracked(rig)
    rig.mgr.finalize_release_on_finish(req)
    return rig, req


def short_host(rig):
    """PREFILLED on a rig whose one host page is held by a stored chunk not yet finished: the next
    chunk finds the host pool short."""
    rig, req = inflight(rig.variant(host_pages=1))
    rig.land_all()                                     # landed: its storage op keeps the host page
    assert rig.off.host_free_pages() == 0
    return rig, req


def short_host_inflight(rig):
    """INFLIGHT on a rig whose one host page the chunk in flight holds."""
    return inflight(rig.variant(host_pages=1))


def next_chunk(rig, req):
    rig.decode(req, 4, first=7100)


def land(rig, req):
    rig.off.land()
    rig.mgr.check_offload_progress()


def finalize(rig, req):
    rig.mgr.finalize_release_on_finish(req)


def readmit(rig, req):
    rig.regrant(req)
    rig.mgr.readmit(req)


class RowScenario(NamedTuple):
    drive: Callable       # rig -> (rig, req) in the row's source state (OFFLOADING: about to offload)
    fire: Callable        # (rig, req): the public call that fires the row's trigger
    then: State           # where the request is when the call returns
    effect: Callable      # (rig, req, stats before) -> None: the row's work was done


def _enqueued(rig, req, before):
    after = rig.mgr.stats()
    assert (after.chunks_enqueued, after.inflight_writes) == (before.chunks_enqueued + 1, before.inflight_writes + 1)
    assert rig.mgr.progress_of(req).inc_len == 4 * after.chunks_enqueued


def _host_short(rig, req, before):
    after = rig.mgr.stats()
    assert (after.host_short, after.chunks_enqueued) == (before.host_short + 1, before.chunks_enqueued)
    assert rig.mgr.progress_of(req).inc_len == 4 * after.chunks_enqueued


def _landed(rig, req, before):
    after = rig.mgr.stats()
    assert (after.chunks_landed, after.inflight_writes, after.inflight_storage) == (1, 0, 1)


def _finished_frees_nothing(rig, req, before):
    assert rig.mgr.stats().released == 0 and rig.is_held(rig.slots_of(req)) and req.kv.req_pool_idx is not None


def _released(rig, req, before):
    assert rig.mgr.stats().released == before.released + 1 and req.kv.req_pool_idx is None


def _readmitted(rig, req, before):
    progress = rig.mgr.progress_of(req)
    assert progress.inc_len == 0 and rig.mgr.copies_of(req) == []
    assert rig.mgr.stats().tracked == before.tracked + 1


ROW_SCENARIOS: dict[RowCase, RowScenario] = {
    RowCase("offload", "PREFILLED", "OFFLOADING", ""): RowScenario(tracked, next_chunk, INFLIGHT, _enqueued),
    RowCase("offload", "INFLIGHT", "OFFLOADING", ""): RowScenario(inflight, next_chunk, INFLIGHT, _enqueued),
    RowCase("enqueued", "OFFLOADING", "INFLIGHT", ""): RowScenario(tracked, next_chunk, INFLIGHT, _enqueued),
    RowCase("host_short", "OFFLOADING", "PREFILLED", "unless copies_in_flight"):
        RowScenario(short_host, next_chunk, PREFILLED, _host_short),
    RowCase("host_short", "OFFLOADING", "INFLIGHT", "if copies_in_flight"):
        RowScenario(short_host_inflight, next_chunk, INFLIGHT, _host_short),
    RowCase("landed", "INFLIGHT", "PREFILLED", "unless copies_in_flight"):
        RowScenario(inflight, land, PREFILLED, _landed),
    # nothing in flight: the same call releases it at once
    RowCase("finish", "PREFILLED", "FINISHED", "if done"): RowScenario(tracked, finalize, RELEASED, _released),
    RowCase("finish", "INFLIGHT", "FINISHED", "if done"):
        RowScenario(inflight, finalize, FINISHED, _finished_frees_nothing),
    RowCase("release", "FINISHED", "RELEASED", "unless copies_in_flight"):
        RowScenario(finalized, land, RELEASED, _released),
    RowCase("readmit", "RELEASED", "PREFILLED", ""): RowScenario(released, readmit, PREFILLED, _readmitted),
}


class RefusalScenario(NamedTuple):
    drive: Callable   # rig -> (rig, req) in the case's state (OFFLOADING: about to offload)
    entry: str        # the public call refused


ENTRIES = {  # public call -> (the trigger its refusal names, the facts the manager decides on)
    "offload_kv_cache": ("offload", lambda state, n, req: Facts(state, n)),
    "finalize_release_on_finish": ("finish", lambda state, n, req: Facts(state, n, finalizing=True)),
    "_release_finished_req": ("release", lambda state, n, req: Facts(state, n, finished=bool(req.finished()))),
    "readmit": ("readmit", lambda state, n, req: Facts(state, n)),
}


def finished_inflight(rig):
    """INFLIGHT, and the request reports finished(): not finalized yet."""
    rig, req = inflight(rig)
    req.finish()
    return rig, req


REFUSAL_SCENARIOS: dict[RefusalCase, RefusalScenario] = {
    RefusalCase("release", "copies in flight", "INFLIGHT"): RefusalScenario(finished_inflight, "_release_finished_req"),
    RefusalCase("release", "copies in flight", "FINISHED"): RefusalScenario(finalized, "_release_finished_req"),
    RefusalCase("release", "not finished and not finalized", "PREFILLED"):
        RefusalScenario(tracked, "_release_finished_req"),
    RefusalCase("release", "an offload in progress", "OFFLOADING"): RefusalScenario(tracked, "_release_finished_req"),
    RefusalCase("release", "RELEASED", "RELEASED"): RefusalScenario(released, "_release_finished_req"),
    RefusalCase("offload", "FINISHED or RELEASED", "FINISHED"): RefusalScenario(finalized, "offload_kv_cache"),
    RefusalCase("offload", "FINISHED or RELEASED", "RELEASED"): RefusalScenario(released, "offload_kv_cache"),
    RefusalCase("offload", "FINISHED or RELEASED", "OFFLOADING"): RefusalScenario(tracked, "offload_kv_cache"),
    RefusalCase("finish", "FINISHED or RELEASED", "FINISHED"): RefusalScenario(finalized, "finalize_release_on_finish"),
    RefusalCase("finish", "FINISHED or RELEASED", "RELEASED"): RefusalScenario(released, "finalize_release_on_finish"),
    RefusalCase("finish", "FINISHED or RELEASED", "OFFLOADING"):
        RefusalScenario(tracked, "finalize_release_on_finish"),
    # "finish" without finalizing is fired only by the free path: its refusal is that call's ("release")
    RefusalCase("finish", "not finished and not finalized", "PREFILLED"):
        RefusalScenario(tracked, "_release_finished_req"),
    RefusalCase("finish", "not finished and not finalized", "INFLIGHT"):
        RefusalScenario(inflight, "_release_finished_req"),
    RefusalCase("readmit", "any state but RELEASED", "PREFILLED"): RefusalScenario(tracked, "readmit"),
    RefusalCase("readmit", "any state but RELEASED", "OFFLOADING"): RefusalScenario(tracked, "readmit"),
    RefusalCase("readmit", "any state but RELEASED", "INFLIGHT"): RefusalScenario(inflight, "readmit"),
    RefusalCase("readmit", "any state but RELEASED", "FINISHED"): RefusalScenario(finalized, "readmit"),
}


# --- the tests ----------------------------------------------------------------------------------------


def test_the_scenarios_cover_the_table_exactly():
    """One scenario per (row, source) and per (refusal, state): none missing, none left over, and
    every refusal of the table selected in some state."""
    rows, refusals = row_cases(), refusal_cases()
    assert len(set(rows)) == len(rows) and len(set(refusals)) == len(refusals)
    assert {str(c) for c in set(rows) - set(ROW_SCENARIOS)} == set(), "rows without a scenario"
    assert {str(c) for c in set(ROW_SCENARIOS) - set(rows)} == set(), "scenarios of rows no longer in the table"
    assert {str(c) for c in set(refusals) - set(REFUSAL_SCENARIOS)} == set(), "refusals without a scenario"
    assert {str(c) for c in set(REFUSAL_SCENARIOS) - set(refusals)} == set(), "scenarios of refusals not in the table"
    assert {(c.trigger, c.when) for c in refusals} == {(r.trigger, r.when) for r in REFUSALS}


def _spy_writes(rig, req, during=None):
    """Record the request's state at every offloader write (``during(state)`` runs there too)."""
    seen, write = [], rig.off.write

    def spy(indices, ack):
        state = rig.mgr.state_of(req)
        seen.append(state)
        if during is not None:
            during(state)
        return write(indices, ack)

    rig.off.write = spy
    return seen


@pytest.mark.parametrize("case", row_cases(), ids=str)
def test_each_row_fires_through_a_public_call(rig, case):
    scenario = ROW_SCENARIOS.get(case)
    if scenario is None:
        pytest.fail(f"no scenario for the row {case}: add one to ROW_SCENARIOS")
    rig, req = scenario.drive(rig)
    source, dest = State[case.source], State[case.dest]
    if source is not OFFLOADING:
        assert rig.mgr.state_of(req) is source
    writes = _spy_writes(rig, req)
    before = rig.mgr.stats()
    with capture_logs() as logs:
        scenario.fire(rig, req)
    moves = [(e["trigger"], e["src"], e["dst"]) for e in logs if e["event"] == audit.TRANSITION and e["rid"] == req.rid]
    assert (case.trigger, case.source, case.dest) in moves, moves
    if OFFLOADING in (source, dest):                            # OFFLOADING: what the offloader sees while it writes
        assert writes == [OFFLOADING]
    assert rig.mgr.state_of(req) is scenario.then
    after = rig.mgr.stats()
    fired = sum(1 for m in moves if m[0] == case.trigger)  # stats() counts what the audit log shows
    assert after.transitions[case.trigger] - before.transitions.get(case.trigger, 0) == fired
    scenario.effect(rig, req, before)
    rig.check_integrity()


@pytest.mark.parametrize("case", refusal_cases(), ids=str)
def test_each_refusal_refuses_through_a_public_call_and_changes_nothing(rig, case):
    scenario = REFUSAL_SCENARIOS.get(case)
    if scenario is None:
        pytest.fail(f"no scenario for the refusal {case}: add one to REFUSAL_SCENARIOS")
    refusal, state = refusal_of(case), State[case.state]
    rig, req = scenario.drive(rig)
    call = getattr(rig.mgr, scenario.entry)
    reported, facts_of = ENTRIES[scenario.entry]
    if state is OFFLOADING:
        _refused_inside_an_offload(rig, req, call, refusal, facts_of)
        return
    assert rig.mgr.state_of(req) is state
    facts = facts_of(state, len(rig.mgr.copies_of(req)), req)
    assert decide(case.trigger, facts) is refusal     # the manager's facts select this very entry
    before, counted = rig.observe(req), rig.mgr.refusals()
    with capture_logs() as logs, pytest.raises(InvalidTransition) as exc:
        call(req)
    err = exc.value
    assert (err.rid, err.trigger, err.state, err.reason) == (req.rid, reported, case.state, refusal.explain(facts))
    assert str(err) == f"request {req.rid!r}: cannot {reported!r} in state {case.state}: {err.reason}"
    assert rig.observe(req) == before                 # pools, rows, host pool, records, stats
    key = f"{reported} in {case.state}"
    assert rig.mgr.refusals() == {**counted, key: counted.get(key, 0) + 1}
    assert [(e["trigger"], e["state"], e["reason"]) for e in logs if e["event"] == audit.REFUSED] == [
        (reported, case.state, err.reason)]
    rig.check_integrity()


def _refused_inside_an_offload(rig, req, call, refusal, facts_of):
    """The call made from inside ``offload_kv_cache`` (the offloader's write) while the request is
    OFFLOADING: ``ReentrantCall``, nothing changed; the table refuses it too."""
    outcome = []

    def reenter(state):
        facts = facts_of(state, len(rig.mgr.copies_of(req)), req)
        before, counted = rig.observe(req), rig.mgr.refusals()
        with pytest.raises(ReentrantCall, match="nothing was changed"):
            call(req)
        outcome.append((state, decide(refusal.trigger, facts), rig.observe(req) == before,
                        rig.mgr.refusals() == counted))

    _spy_writes(rig, req, during=reenter)
    next_chunk(rig, req)
    assert outcome == [(OFFLOADING, refusal, True, True)]
    assert rig.mgr.state_of(req) is INFLIGHT and rig.mgr.stats().chunks_enqueued == 1
    rig.check_integrity()
