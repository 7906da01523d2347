"""``decide`` with a refusal table that does not cover a case: the generic ``Refusal`` it returns.

``decide(trigger, facts, table, guards, refusals)`` is public (the replay and the diagrams call it
with their own tables); with no declared refusal it names the failing guard, or the state that has
no transition for the trigger.
"""

from __future__ import annotations

from lifecycle.states import Facts, Refusal, State, decide


def test_a_failing_guard_with_no_declared_refusal_is_named():
    verdict = decide("release", Facts(State.FINISHED, 2), refusals=())
    assert isinstance(verdict, Refusal)
    assert verdict == Refusal("release", f"guard {verdict.guard} failed", "", guard=verdict.guard)
    assert verdict.guard and "copies_in_flight" in verdict.guard and verdict.states == ()
    assert verdict.explain(Facts(State.FINISHED, 2)) == f"guard {verdict.guard} failed"


def test_a_state_without_the_transition_and_no_declared_refusal_is_named():
    facts = Facts(State.PREFILLED)
    verdict = decide("readmit", facts, refusals=())
    assert verdict == Refusal("readmit", "no 'readmit' transition from PREFILLED", "", states=(State.PREFILLED,))
    assert verdict.guard is None and verdict.explain(facts) == "no 'readmit' transition from PREFILLED"


def test_an_allowed_trigger_returns_its_destination():
    assert decide("readmit", Facts(State.RELEASED), refusals=()) is State.PREFILLED
