import itertools

import pytest
from transitions import Event, MachineError

from lifecycle.errors import InvalidTransition
from lifecycle import work
from lifecycle.machine import EVENTS, MACHINE, LeanEvent, build_machine
from lifecycle.states import State


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
