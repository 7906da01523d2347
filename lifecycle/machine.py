"""The one module-level ``transitions`` Machine that runs every request's lifecycle.

The table lives in ``lifecycle.states``; here its callback names are bound to functions and the
machine is built once, with no models: events are fired on slim per-request records with
``MACHINE.events[name].trigger(record, mgr=..., req=...)``. Callbacks receive the event data
(``send_event=True``) and do the work through the manager passed as ``mgr``.

``LeanEvent`` is transitions' ``event_cls`` extension point: it runs the machine's own
``Transition`` objects (guards, before/after callbacks, ``before_state_change``) without the
per-trigger queueing and ``EventData`` bookkeeping of the stock ``Event``, and turns a refused
event into ``InvalidTransition`` instead of a silent ``False``. One ordering differs from the stock
event: a transition's own ``before`` callbacks run before the machine-wide ``before_state_change``
(which records the transition), so a transition whose work raises is neither applied nor logged.
"""

from __future__ import annotations

import logging

from transitions import Event, Machine

from lifecycle.errors import InvalidTransition
from lifecycle.states import INITIAL, TRANSITIONS, State

logging.getLogger("transitions").setLevel(logging.WARNING)


class Fire:
    """Event data handed to callbacks: the same attribute names as transitions' ``EventData``."""

    __slots__ = ("model", "kwargs", "event", "machine", "transition", "state", "args", "result", "error")

    def __init__(self, model, kwargs, event, transition, state):
        self.model, self.kwargs, self.event = model, kwargs, event
        self.machine, self.transition, self.state = event.machine, transition, state
        self.args, self.result, self.error = (), True, None


class LeanEvent(Event):
    """A transitions ``Event`` that fires the declared transitions directly on a record."""

    def __init__(self, name, machine):
        super().__init__(name, machine)
        self._plans = None

    def add_transition(self, transition):
        """transitions' hook; invalidates the compiled plans."""
        super().add_transition(transition)
        self._plans = None

    def _compile(self):
        m = self.machine
        plans = {}
        for src, transitions in self.transitions.items():
            plans[m.get_state(src).value] = tuple(
                (
                    tuple((c.func, c.target) for c in t.conditions),
                    tuple(t.before) + tuple(m.before_state_change),
                    m.get_state(t.dest).value,
                    tuple(t.after) + tuple(m.after_state_change),
                    t,
                )
                for t in transitions
            )
        self._plans = plans
        return plans

    def select(self, model, src=None, **kwargs):
        """The transition this event would take from ``src`` (default: the model's state), or None."""
        plans = self._plans or self._compile()
        src = model.state if src is None else src
        for conds, _, dest, _, t in plans.get(src, ()):
            if _passes(conds, Fire(model, kwargs, self, t, src)):
                return dest
        return None

    def trigger(self, model, *args, **kwargs):
        """Fire this event on ``model`` (a record); kwargs reach the callbacks as ``fire.kwargs``.

        Returns:
            True (a refused event raises instead of returning False).
        Raises:
            InvalidTransition: no transition from the record's state, or every guard failed;
                nothing ran and the state is unchanged.
        """
        plans = self._plans or self._compile()
        src = model.state
        options = plans.get(src)
        if options is None:
            raise InvalidTransition(
                model.rid, self.name, src.name, f"no {self.name!r} transition from {src.name}"
            )
        for conds, before, dest, after, t in options:
            fire = Fire(model, kwargs, self, t, src)
            if not conds or _passes(conds, fire):
                for cb in before:
                    cb(fire)
                model.state = dest
                for cb in after:
                    cb(fire)
                return True
        raise InvalidTransition(model.rid, self.name, src.name, _guard_reason(model, self.name))


def _passes(conds, fire) -> bool:
    for func, target in conds:
        if func(fire) != target:
            return False
    return True


def _guard_reason(record, trigger: str) -> str:
    if record.inflight:
        return f"{record.inflight} copies still in flight"
    return f"guard of {trigger!r} failed"


# --- guards and work, bound to the names in lifecycle.states.TRANSITIONS -------------------------


def copies_in_flight(fire) -> bool:
    """Guard: the request has GPU -> host copies still in flight."""
    return fire.model.inflight > 0


def enqueue_chunk(fire) -> None:
    """After ``offload``: hand the planned chunk to the offloader; fire ``enqueued`` or ``host_short``."""
    fire.kwargs["mgr"]._enqueue_chunk(fire.model, fire.kwargs["req"], fire.kwargs["chunk"])


def commit_chunk(fire) -> None:
    """Before ``enqueued``: record the chunk in flight and advance ``inc_len`` and ``last_hash``."""
    fire.kwargs["mgr"]._commit_chunk(fire.model, fire.kwargs["chunk"])


def count_host_short(fire) -> None:
    """After ``host_short``: count and log the refused (or failed) enqueue; nothing advanced."""
    fire.kwargs["mgr"]._count_host_short(fire.model, fire.kwargs)


def free_memory(fire) -> None:
    """Before ``release``: free the request's slots (minus quarantined ones) and its row."""
    fire.kwargs["mgr"]._free_memory(fire.model, fire.kwargs["req"])


def reset_progress(fire) -> None:
    """After ``readmit``: a new lifecycle on the new row, with fresh offload progress."""
    kw = fire.kwargs
    kw["mgr"]._reset_progress(fire.model, kw["req"], kw["row"], kw["progress"])


_BY_NAME = {s.name: s for s in State}


def record_transition(fire) -> None:
    """Machine-wide, before every state change: per-state counters and the audit event."""
    t = fire.transition
    fire.kwargs["mgr"]._on_transition(fire.model, fire.event.name, t.source, t.dest)


CALLBACKS = {
    f.__name__: f
    for f in (copies_in_flight, enqueue_chunk, commit_chunk, count_host_short, free_memory, reset_progress)
}


def bound_table(table=TRANSITIONS) -> list[dict]:
    """The declared table with callback names replaced by the functions above."""
    out = []
    for row in table:
        row = dict(row)
        for key in ("conditions", "unless", "before", "after"):
            if key in row:
                row[key] = CALLBACKS[row[key]]
        out.append(row)
    return out


def build_machine(event_cls=LeanEvent, machine_cls=Machine, **extra) -> Machine:
    """Build a model-less machine from the declared table.

    Args:
        event_cls: transitions' event class (``LeanEvent`` at runtime; the stock ``Event`` for
            parity tests).
        machine_cls: ``Machine`` or a diagram class such as ``GraphMachine``.
    """
    cls = type(machine_cls.__name__, (machine_cls,), {"event_cls": event_cls})
    return cls(
        model=None,
        states=State,
        initial=INITIAL,
        transitions=bound_table(),
        auto_transitions=False,
        send_event=True,
        before_state_change=[record_transition],
        **extra,
    )


MACHINE = build_machine()
EVENTS = MACHINE.events
