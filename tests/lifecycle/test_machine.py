import itertools

import pytest
from transitions import Event, MachineError

from lifecycle.errors import InvalidTransition
from lifecycle import work
from lifecycle.machine import CALLBACKS, EVENTS, MACHINE, Fire, LeanEvent, _bind_guard, bound_table, build_machine
from lifecycle.states import GUARDS, INITIAL, TRANSITIONS, Facts, State, decide


class Rec:
    def __init__(self, state, inflight):
        self.state, self.inflight, self.rid = state, inflight, "r"


class Recorder:
    """Stands in for the manager: records which work the machine asked for."""

    def __init__(self):
        self.calls = []


def _recording(name):
    return lambda fire: fire.kwargs["mgr"].calls.append(name)


# the table's work names bound to recording stand-ins (the guards stay the real ones)
RECORDING = {name: _recording(name) for name in [*work.CALLBACKS, "record_transition"]}
LEAN = build_machine(callbacks=RECORDING)


def fire(machine, trigger, state, inflight):
    rec, mgr = Rec(state, inflight), Recorder()
    kwargs = dict(mgr=mgr, req=None, n=4, chunk=None, start=0, end=4, row=0, progress=None, finalizing=True)
    try:
        ok = machine.events[trigger].trigger(rec, **kwargs)
        outcome = rec.state if ok else "refused"
    except (InvalidTransition, MachineError):
        outcome = "refused"
    return outcome, sorted(mgr.calls)


def test_module_machine_is_model_less_and_lean():
    assert MACHINE.models == [] and all(isinstance(e, LeanEvent) for e in EVENTS.values())
    assert not hasattr(MACHINE, "to_PREFILLED")  # auto_transitions off


@pytest.mark.parametrize(
    "trigger,state,inflight",
    list(itertools.product(list(EVENTS), list(State), [0, 1])),
)
def test_lean_event_matches_stock_transitions_event(trigger, state, inflight):
    stock = build_machine(event_cls=Event, callbacks=RECORDING)
    assert fire(LEAN, trigger, state, inflight) == fire(stock, trigger, state, inflight)


def test_refusal_names_rid_trigger_and_state():
    with pytest.raises(InvalidTransition) as exc:
        EVENTS["release"].trigger(Rec(State.FINISHED, 2), mgr=Recorder(), req=None)
    assert str(exc.value) == "request 'r': cannot 'release' in state FINISHED: 2 copies still in flight"
    with pytest.raises(InvalidTransition, match="no 'offload' transition from RELEASED"):
        EVENTS["offload"].trigger(Rec(State.RELEASED, 0), mgr=Recorder(), req=None, n=4)


def test_a_refused_event_runs_no_callback_and_keeps_the_state():
    rec, mgr = Rec(State.FINISHED, 1), Recorder()
    with pytest.raises(InvalidTransition):
        EVENTS["release"].trigger(rec, mgr=mgr, req=None)
    assert rec.state is State.FINISHED and mgr.calls == []


def test_select_predicts_without_firing():
    rec = Rec(State.OFFLOADING, 1)
    assert EVENTS["host_short"].select(rec) is State.INFLIGHT
    rec.inflight = 0
    assert EVENTS["host_short"].select(rec) is State.PREFILLED
    assert EVENTS["release"].select(Rec(State.FINISHED, 1)) is None
    assert rec.state is State.OFFLOADING


# --- a machine built inside the test ----------------------------------------------------------
# The module-level machines (MACHINE, LEAN) compile their plans on first use and keep them; a
# machine built here runs construction, compilation, selection and refusal afresh, so what is
# asserted below is what this code does now, not what an earlier test left compiled.


class Facty(Rec):
    """A record with the Facts attributes a ``Record`` has (no call facts: both False)."""

    finished = finalizing = False


def _rows(trigger, state):
    """The declared rows of ``trigger`` from ``state``, in table order."""
    return [r for r in TRANSITIONS if r["trigger"] == trigger
            and state in (r["source"] if isinstance(r["source"], list) else [r["source"]])]


def _work_names(row):
    """The work a row runs when it fires, in order: before, the machine-wide record, after."""
    return [*([row["before"]] if "before" in row else []), "record_transition",
            *([row["after"]] if "after" in row else [])]


CALL_FACTS = [{}, {"finished": True}, {"finalizing": True}, {"finished": False, "finalizing": False}]


def test_a_machine_built_now_has_the_declared_shape():
    m = build_machine()
    # model-less, no auto transitions, starting in PREFILLED, one LeanEvent per declared trigger
    assert m.models == [] and m.initial == INITIAL.value == "PREFILLED"
    assert set(m.events) == {r["trigger"] for r in TRANSITIONS}
    assert all(isinstance(e, LeanEvent) and e.name == name and e.machine is m for name, e in m.events.items())
    assert not any(name.startswith("to_") for name in m.events) and not hasattr(m, "to_RELEASED")
    # every state change is recorded by lifecycle.work unless a test binds a stand-in
    assert m.before_state_change == [work.record_transition]
    stand_in = _recording("record_transition")
    assert build_machine(callbacks={"record_transition": stand_in}).before_state_change == [stand_in]
    # the stock Event is the parity tests' choice
    assert all(type(e) is Event for e in build_machine(event_cls=Event).events.values())


def test_bound_table_replaces_every_name_and_keeps_the_rest_of_each_row():
    table = bound_table()
    assert len(table) == len(TRANSITIONS)
    for declared, bound in zip(TRANSITIONS, table):
        assert {k: v for k, v in bound.items() if k not in ("conditions", "unless", "before", "after")} == \
            {k: v for k, v in declared.items() if k not in ("conditions", "unless", "before", "after")}
        for key in ("conditions", "unless", "before", "after"):
            if key in declared:
                assert bound[key] is CALLBACKS[declared[key]]
    stand_in = _recording("free_memory")
    release = next(r for r in bound_table(callbacks={"free_memory": stand_in}) if r["trigger"] == "release")
    assert release["before"] is stand_in and release["unless"] is CALLBACKS["copies_in_flight"]
    assert bound_table(callbacks={}) == table  # an empty override binds the defaults


def test_extra_machine_options_reach_the_machine_and_run_after_the_rows_work():
    mgr = Recorder()
    m = build_machine(callbacks=RECORDING, after_state_change=[_recording("after_state_change")])
    assert m.events["release"].trigger(Facty(State.FINISHED, 0), mgr=mgr, req=None)
    assert mgr.calls == ["free_memory", "record_transition", "after_state_change"]
    mgr.calls.clear()
    assert m.events["readmit"].trigger(Facty(State.RELEASED, 0), mgr=mgr, req=None)
    assert mgr.calls == ["record_transition", "reset_progress", "after_state_change"]


@pytest.mark.parametrize("trigger", sorted({r["trigger"] for r in TRANSITIONS}))
def test_select_and_trigger_on_a_new_machine_follow_the_declared_table(trigger):
    """Every (state, copies in flight, call facts) of one trigger, on a machine built for it: select
    names the table's destination (None when refused), firing lands there running the row's work in
    order, and a refused trigger raises naming the request, the trigger, the state and the table's
    explanation, with the record untouched and no work run."""
    m = build_machine(callbacks=RECORDING)
    for state, inflight, kw in itertools.product(State, (0, 2), CALL_FACTS):
        facts = Facts(state, inflight, kw.get("finished", False), kw.get("finalizing", False))
        verdict = decide(trigger, facts)
        allowed = isinstance(verdict, State)
        rec, mgr = Facty(state, inflight), Recorder()
        assert m.events[trigger].select(rec, **kw) is (verdict if allowed else None), (state, inflight, kw)
        # select from another state than the record's: the record's own state is not consulted
        other = Facty(State.RELEASED if state is not State.RELEASED else State.PREFILLED, inflight)
        assert m.events[trigger].select(other, src=state, **kw) is (verdict if allowed else None)
        assert rec.state is state and other.state is not state
        if allowed:
            assert m.events[trigger].trigger(rec, mgr=mgr, req=None, **kw) is True
            row = next(r for r in _rows(trigger, state) if decide(trigger, facts, table=(r,)) is verdict)
            assert rec.state is verdict and mgr.calls == _work_names(row)
            continue
        with pytest.raises(InvalidTransition) as exc:
            m.events[trigger].trigger(rec, mgr=mgr, req=None, **kw)
        err = exc.value
        reason = verdict.explain(facts) if _rows(trigger, state) else f"no {trigger!r} transition from {state.name}"
        assert (err.rid, err.trigger, err.state, err.reason) == ("r", trigger, state.name, reason)
        assert str(err) == f"request 'r': cannot {trigger!r} in state {state.name}: {reason}"
        assert rec.state is state and rec.inflight == inflight and mgr.calls == []


def test_the_refusal_explains_with_the_call_facts_when_a_bound_guard_disagrees_with_the_table():
    """A guard bound in place of the table's (a test stand-in) can refuse what the table allows:
    the reason then says which guard failed, computed from the call's own facts."""
    m = build_machine(callbacks={**RECORDING, "done": lambda fire: False,
                                 "copies_in_flight": lambda fire: True})
    finish = m.events["finish"]
    for kw in ({"finished": True}, {"finalizing": True}, {"finished": True, "finalizing": True}):
        with pytest.raises(InvalidTransition, match="cannot 'finish' in state PREFILLED: guard of 'finish' failed$"):
            finish.trigger(Facty(State.PREFILLED, 0), mgr=Recorder(), req=None, **kw)
    # without call facts the table refuses too, and its own explanation is given
    for kw in ({}, {"finished": False}, {"finalizing": False}):
        with pytest.raises(InvalidTransition, match="PREFILLED: the request is neither finished nor finalized$"):
            finish.trigger(Facty(State.PREFILLED, 0), mgr=Recorder(), req=None, **kw)
    with pytest.raises(InvalidTransition, match="in state FINISHED: guard of 'release' failed$"):
        m.events["release"].trigger(Facty(State.FINISHED, 0), mgr=Recorder(), req=None)
    with pytest.raises(InvalidTransition, match="in state INFLIGHT: guard of 'landed' failed$"):
        m.events["landed"].trigger(Facty(State.INFLIGHT, 0), mgr=Recorder(), req=None)


def test_a_bound_guard_sees_the_record_or_the_call_facts():
    seen = []

    def probe(facts):
        """The probe's doc."""
        seen.append(facts)
        return "verdict"

    check = _bind_guard(probe)
    assert (check.__name__, check.__qualname__, check.__doc__) == ("probe", "probe", "The probe's doc.")
    rec = Facty(State.INFLIGHT, 3)
    # no call facts: the guard reads the record itself (a Record has the Facts attributes)
    assert check(Fire(rec, {"mgr": None, "req": None}, None, None, State.INFLIGHT)) == "verdict"
    assert seen.pop() is rec
    # a call fact, alone or both: the guard gets the record's Facts with the call's values
    for kw, finished, finalizing in (({"finished": True}, True, False), ({"finalizing": True}, False, True),
                                     ({"finished": True, "finalizing": True}, True, True),
                                     ({"finished": False}, False, False)):
        assert check(Fire(rec, {"mgr": None, **kw}, None, None, State.INFLIGHT)) == "verdict"
        facts = seen.pop()
        assert type(facts) is Facts and facts == Facts(State.INFLIGHT, 3, finished, finalizing), kw
    # the real guards, bound: a record that reports finished is done without call facts
    done = _bind_guard(GUARDS["done"])
    assert done(Fire(Facty(State.PREFILLED, 0), {}, None, None, None)) is False
    finished_rec = Facty(State.PREFILLED, 0)
    finished_rec.finished = True
    assert done(Fire(finished_rec, {}, None, None, None)) is True
    assert done(Fire(Facty(State.PREFILLED, 0), {"finalizing": True}, None, None, None)) is True
    assert done(Fire(finished_rec, {"finalizing": False}, None, None, None)) is False  # the call's facts win
    in_flight = _bind_guard(GUARDS["copies_in_flight"])
    assert in_flight(Fire(Facty(State.FINISHED, 1), {}, None, None, None)) is True
    assert in_flight(Fire(Facty(State.FINISHED, 0), {"finished": True}, None, None, None)) is False


def test_guards_receive_the_event_data_in_select_and_in_trigger():
    seen = []

    def probe(fire):
        seen.append((fire.model, fire.event.name, fire.machine, fire.transition.dest, fire.state,
                     dict(fire.kwargs)))
        return True

    m = build_machine(callbacks={**RECORDING, "copies_in_flight": probe})
    rec = Facty(State.OFFLOADING, 1)
    # host_short's first row is `unless` the guard (refused: it holds), the second `conditions`
    assert m.events["host_short"].select(rec, mgr=None, why="probe") is State.INFLIGHT
    assert seen == [(rec, "host_short", m, "PREFILLED", State.OFFLOADING, {"mgr": None, "why": "probe"}),
                    (rec, "host_short", m, "INFLIGHT", State.OFFLOADING, {"mgr": None, "why": "probe"})]
    seen.clear()
    assert m.events["landed"].select(rec, src=State.INFLIGHT) is None
    assert seen == [(rec, "landed", m, "PREFILLED", State.INFLIGHT, {})]
    seen.clear()
    mgr = Recorder()
    assert m.events["host_short"].trigger(rec, mgr=mgr, req=None)
    assert rec.state is State.INFLIGHT
    assert [s[1:5] for s in seen] == [("host_short", m, "PREFILLED", State.OFFLOADING),
                                      ("host_short", m, "INFLIGHT", State.OFFLOADING)]


def test_adding_a_transition_recompiles_the_event():
    m = build_machine(callbacks=RECORDING)
    readmit = m.events["readmit"]
    rec = Facty(State.FINISHED, 0)
    assert readmit.select(rec) is None  # compiled: no readmit from FINISHED
    with pytest.raises(InvalidTransition, match="no 'readmit' transition from FINISHED"):
        readmit.trigger(rec, mgr=Recorder(), req=None)
    m.add_transition("readmit", State.FINISHED, State.PREFILLED, after=RECORDING["reset_progress"])
    assert readmit.select(rec) is State.PREFILLED
    mgr = Recorder()
    assert readmit.trigger(rec, mgr=mgr, req=None) and rec.state is State.PREFILLED
    assert mgr.calls == ["record_transition", "reset_progress"]
    assert EVENTS["readmit"].select(Facty(State.FINISHED, 0)) is None  # the module machine is untouched


def test_the_diagram_markup_says_there_are_no_auto_transitions():
    """The markup the diagrams are drawn from states the option as set (no ``to_<state>`` events)."""
    from transitions.extensions.markup import MarkupMachine

    assert build_machine(event_cls=Event, machine_cls=MarkupMachine).markup["auto_transitions"] is False
    assert not any(name.startswith("to_") for name in EVENTS)
