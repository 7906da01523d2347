"""The declared lifecycle rules as the audit replay applies them.

Nothing here is a rule of its own: a logged transition is put to ``lifecycle.states.decide`` (the
pure decision over the table ``TRANSITIONS``, its guards ``GUARDS`` and refusals ``REFUSALS``, the
same the runtime machine follows) with the facts the replay reconstructed from the log. The table
is read at call time, so a guard added to it changes what the replay accepts.
"""

from __future__ import annotations

from collections import defaultdict

from lifecycle import states

STATE_NAMES = frozenset(s.name for s in states.State)


def declared_table(table=None) -> dict[tuple[str, str], set[str]]:
    """(trigger, src) -> allowed destinations, from the declared table (guards aside)."""
    out: dict[tuple[str, str], set[str]] = defaultdict(set)
    for row in states.TRANSITIONS if table is None else table:
        sources = row["source"] if isinstance(row["source"], (list, tuple)) else [row["source"]]
        for src in sources:
            out[(row["trigger"], _name(src))].add(_name(row["dest"]))
    return dict(out)


def _name(state) -> str:
    return state.name if isinstance(state, states.State) else str(state)


def facts_for(trigger: str, src: str, inflight: int):
    """The ``Facts`` a log supports: the state, the replay's count of copies in flight, and (for a
    logged ``finish`` or ``release``) that the scheduler declared the request done."""
    done = trigger in ("finish", "release")
    return states.Facts(state=states.State[src], inflight=inflight, finished=done, finalizing=done)


def verdict(trigger: str, src: str, dst: str, inflight: int) -> str | None:
    """Why the table does not allow ``trigger`` from ``src`` to ``dst`` with ``inflight`` copies in
    flight (None: it does)."""
    table = declared_table()
    if dst not in table.get((trigger, src), ()):
        return f"illegal transition {trigger!r} {src} -> {dst} (not in the declared table)"
    facts = facts_for(trigger, src, inflight)
    got = states.decide(trigger, facts, table=states.TRANSITIONS, guards=states.GUARDS, refusals=states.REFUSALS)
    if isinstance(got, states.State):
        return None if got.name == dst else _elsewhere(trigger, src, dst, inflight, got.name)
    guard = f" (guard {got.guard})" if got.guard else ""
    return f"{trigger!r} {src} -> {dst} refused by the declared table{guard}: {got.explain(facts)}"


def _elsewhere(trigger: str, src: str, dst: str, inflight: int, want: str) -> str:
    return (f"{trigger!r} from {src} with {inflight} copies in flight goes to {want} by the declared table, "
            f"not {dst}")
