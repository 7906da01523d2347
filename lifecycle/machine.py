"""The one module-level ``transitions`` Machine that runs every request's lifecycle.

The table lives in ``lifecycle.states``; here its names are bound — guards to the pure predicates
of ``lifecycle.states.GUARDS`` (given the record's ``Facts``), work to the functions of
``lifecycle.work`` — and the machine is built once, with no models: events are fired on slim
per-request records with ``MACHINE.events[name].trigger(record, mgr=..., req=...)``. Callbacks
receive the event data (``send_event=True``) and do the work on the manager passed as ``mgr``.

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

from lifecycle import work
from lifecycle.errors import InvalidTransition
from lifecycle.states import GUARDS, INITIAL, REFUSALS, TRANSITIONS, Facts, Refusal, State, decide

logging.getLogger("transitions").setLevel(logging.WARNING)


class Fire:
    """Event data handed to callbacks: the same attribute names as transitions' ``EventData``."""

    __slots__ = ("model", "kwargs", "event", "transition", "state")
    args, result, error = (), True, None  # constant here: no positional args, a refusal raises

    def __init__(self, model, kwargs, event, transition, state):
        self.model, self.kwargs, self.event, self.transition, self.state = model, kwargs, event, transition, state

    @property
    def machine(self):
        """The machine the event belongs to."""
        return self.event.machine


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

    def choose(self, facts: Facts):
        """The one evaluation of this event's guards for a call: the transition it takes for
        ``facts`` (an opaque option for ``apply``), or the ``Refusal`` that explains why not (the
        catalogue entry for the guard that failed, or for the state with no transition). Every
        guard is evaluated once, on ``facts``; ``apply`` then runs the chosen row without
        evaluating them again."""
        plans = self._plans or self._compile()
        failed = None
        for option in plans.get(facts.state, ()):
            failed = _failing(option[0], facts)
            if failed is None:
                return option
        return refusal_of(self.name, facts, failed)

    def apply(self, model, option, **kwargs) -> None:
        """Run the transition ``choose`` picked on ``model``: its ``before`` work, the state change,
        its ``after`` work (kwargs reach the callbacks as ``fire.kwargs``)."""
        _, before, dest, after, t = option
        fire = Fire(model, kwargs, self, t, model.state)
        for cb in before:
            cb(fire)
        model.state = dest
        for cb in after:
            cb(fire)

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
        raise InvalidTransition(model.rid, self.name, src.name, _guard_reason(model, self.name, kwargs))


def _failing(conds, facts: Facts) -> str | None:
    """The table's name of the first guard of ``conds`` that fails on ``facts`` (``!name``: an
    ``unless`` guard that holds), or None when the row is allowed."""
    for func, target in conds:
        if func.guard(facts) != target:
            return func.__name__ if target else "!" + func.__name__
    return None


def refusal_of(trigger: str, facts: Facts, failed: str | None) -> Refusal:
    """The catalogue's ``Refusal`` for ``trigger`` refused on ``facts`` (``failed``: the failing
    guard's name, None when the state has no transition): the same selection as ``states.decide``."""
    for r in REFUSALS:
        if r.trigger == trigger and ((failed is not None and r.guard == failed)
                                     or (failed is None and facts.state in r.states)):
            return r
    if failed is not None:
        return Refusal(trigger, f"guard {failed} failed", "", guard=failed)
    return Refusal(trigger, f"no {trigger!r} transition from {facts.state.name}", "", states=(facts.state,))


def _passes(conds, fire) -> bool:
    for func, target in conds:
        if func(fire) != target:
            return False
    return True


def _guard_reason(record, trigger: str, kwargs: dict) -> str:
    facts = Facts(record.state, record.inflight, kwargs.get("finished", False), kwargs.get("finalizing", False))
    verdict = decide(trigger, facts)
    return verdict.explain(facts) if isinstance(verdict, Refusal) else f"guard of {trigger!r} failed"


# --- guards (lifecycle.states.GUARDS) and work (lifecycle.work), bound to the table's names ----


def _bind_guard(guard):
    def check(fire) -> bool:
        rec, kw = fire.model, fire.kwargs
        if "finished" in kw or "finalizing" in kw:
            return guard(Facts(rec.state, rec.inflight, kw.get("finished", False), kw.get("finalizing", False)))
        return guard(rec)  # a Record has the Facts attributes (finished/finalizing False)

    check.__name__ = check.__qualname__ = guard.__name__
    check.__doc__ = guard.__doc__
    check.guard = guard  # the pure predicate over Facts (``LeanEvent.choose``)
    return check


CALLBACKS = {name: _bind_guard(guard) for name, guard in GUARDS.items()}
CALLBACKS.update(work.CALLBACKS)


def bound_table(table=TRANSITIONS, *, callbacks=None) -> list[dict]:
    """The declared table with guard and work names replaced by their functions (``callbacks``:
    a mapping overriding some of ``CALLBACKS``, e.g. recording stand-ins in tests)."""
    callbacks = CALLBACKS if callbacks is None else {**CALLBACKS, **callbacks}
    out = []
    for row in table:
        row = dict(row)
        for key in ("conditions", "unless", "before", "after"):
            if key in row:
                row[key] = callbacks[row[key]]
        out.append(row)
    return out


def build_machine(event_cls=LeanEvent, machine_cls=Machine, callbacks=None, **extra) -> Machine:
    """Build a model-less machine from the declared table.

    Args:
        event_cls: transitions' event class (``LeanEvent`` at runtime; the stock ``Event`` for
            parity tests).
        machine_cls: ``Machine`` or a diagram class such as ``GraphMachine``.
        callbacks: names to bind to other functions than ``CALLBACKS`` (``record_transition``
            included), for tests.
    """
    cls = type(machine_cls.__name__, (machine_cls,), {"event_cls": event_cls})
    return cls(
        model=None,
        states=State,
        initial=INITIAL,
        transitions=bound_table(callbacks=callbacks),
        auto_transitions=False,
        send_event=True,
        before_state_change=[(callbacks or {}).get("record_transition", work.record_transition)],
        **extra,
    )


MACHINE = build_machine()
EVENTS = MACHINE.events

# The triggers, one name each (``trigger(record, mgr=..., req=..., **data)``): what the manager and
# ``lifecycle.work`` fire, greppable and followable from every call site.
offload = EVENTS["offload"].trigger
enqueued = EVENTS["enqueued"].trigger
host_short = EVENTS["host_short"].trigger
landed = EVENTS["landed"].trigger
finish = EVENTS["finish"].trigger
release = EVENTS["release"].trigger
readmit = EVENTS["readmit"].trigger
TRIGGERS = ("offload", "enqueued", "host_short", "landed", "finish", "release", "readmit")
# the events whose guards a call evaluates once (``choose``) before it plans, then ``apply``s
FINISH, RELEASE, READMIT = EVENTS["finish"], EVENTS["release"], EVENTS["readmit"]
