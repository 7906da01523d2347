"""The request lifecycle, as data.

Theory of operation
-------------------
A decode request's KV lives in GPU slots listed in its ``req_to_token`` row. While it decodes,
every ``stride`` tokens of newly filled KV are copied GPU -> host (``offload``), and once a copy
lands its pages go on to shared storage under the request's page hash chain. The slots must stay
allocated while any copy still reads them, and every slot and the row must be freed exactly once
when the request is done.

So a request is in exactly one of five states:

* ``PREFILLED``  - holds GPU slots, nothing in flight. Where every request starts (after prefill)
                   and where it returns when its copies have landed.
* ``OFFLOADING`` - a chunk is being handed to the offloader (transient, inside ``offload``).
* ``INFLIGHT``   - one or more GPU -> host copies still read its slots.
* ``FINISHED``   - done (finished, aborted or retracted); release waits for copies in flight.
* ``RELEASED``   - slots and row freed. Only ``readmit`` (a retracted request coming back with a
                   new row) leaves it.

Each transition below names its guard (``conditions``/``unless``: names of predicates in
``GUARDS``) and the work it does (``before``/``after``: names that ``lifecycle.machine`` binds to
the functions in ``lifecycle.work``). An event with no transition from the current state, or whose
guard fails, raises ``InvalidTransition`` and changes nothing.

Guards and decisions (read by the runtime, the audit replay and the diagrams)
---------------------------------------------------------------------------
Every rule that decides whether a trigger is allowed is a guard here: a pure predicate over a
``Facts`` value, which both a live record and a replayed audit log can supply:

* ``Facts.state``      - the request's ``State`` before the trigger.
* ``Facts.inflight``   - how many GPU -> host copies of the request are still in flight (issued and
                         not yet settled as landed, failed or expired).
* ``Facts.finished``   - the request itself reports ``finished()`` (the scheduler is done with it).
* ``Facts.finalizing`` - the trigger comes from ``finalize_release_on_finish`` (the scheduler
                         declares the request done: finished, aborted or retracted). A replay
                         treats every logged ``finish`` as finalizing or finished.

``decide(trigger, facts)`` walks the table exactly as the runtime machine does and returns the
destination ``State`` or the ``Refusal`` (an entry of ``REFUSALS``) that explains why the trigger is
not allowed. Adding a guard name to a row of ``TRANSITIONS`` (and its predicate to ``GUARDS``)
changes the runtime, the replay and the generated docs together.

"""

from __future__ import annotations

import enum
from typing import NamedTuple


class State(enum.Enum):
    """A request's lifecycle state (see the theory of operation above)."""

    PREFILLED = "PREFILLED"
    OFFLOADING = "OFFLOADING"
    INFLIGHT = "INFLIGHT"
    FINISHED = "FINISHED"
    RELEASED = "RELEASED"

    __hash__ = object.__hash__  # members are singletons; skip Enum's Python-level hash


INITIAL = State.PREFILLED
TERMINAL = State.RELEASED



class Facts(NamedTuple):
    """What the guards may look at (see the module docstring)."""

    state: State
    inflight: int = 0
    finished: bool = False
    finalizing: bool = False


def copies_in_flight(facts: Facts) -> bool:
    """Copies of the request still read its GPU slots."""
    return facts.inflight > 0


def done(facts: Facts) -> bool:
    """The request is done: it reports ``finished()``, or the scheduler finalizes it."""
    return facts.finished or facts.finalizing


GUARDS = {g.__name__: g for g in (copies_in_flight, done)}


S = State
TRANSITIONS: tuple[dict, ...] = (
    # trigger       source                      dest           guard / work
    dict(trigger="offload", source=[S.PREFILLED, S.INFLIGHT], dest=S.OFFLOADING,
         after="enqueue_chunk"),
    dict(trigger="enqueued", source=S.OFFLOADING, dest=S.INFLIGHT,
         before="commit_chunk"),
    dict(trigger="host_short", source=S.OFFLOADING, dest=S.PREFILLED,
         unless="copies_in_flight", after="count_host_short"),
    dict(trigger="host_short", source=S.OFFLOADING, dest=S.INFLIGHT,
         conditions="copies_in_flight", after="count_host_short"),
    dict(trigger="landed", source=S.INFLIGHT, dest=S.PREFILLED,
         unless="copies_in_flight"),
    dict(trigger="finish", source=[S.PREFILLED, S.INFLIGHT], dest=S.FINISHED,
         conditions="done"),
    dict(trigger="release", source=S.FINISHED, dest=S.RELEASED,
         unless="copies_in_flight", before="free_memory"),
    dict(trigger="readmit", source=S.RELEASED, dest=S.PREFILLED,
         after="reset_progress"),
)


class Refusal(NamedTuple):
    """Why a trigger is refused, and the bug the refusal prevents.

    Selected by ``decide``: ``guard`` names the guard whose verdict refused the trigger (``"!"``
    prefix: the guard held and the row says ``unless``), or ``states`` lists the states with no
    transition for ``trigger``.
    """

    trigger: str
    when: str
    bug: str
    guard: str | None = None
    states: tuple = ()
    reason: str = ""  # the error's wording, formatted with the Facts' fields; default ``when``

    def explain(self, facts: Facts) -> str:
        """The reason an ``InvalidTransition`` states for this refusal."""
        return (self.reason or self.when).format(**facts._asdict())


REFUSALS: tuple[Refusal, ...] = (
    Refusal("release", "copies in flight",
            "slots freed while a D2H copy still reads them; a new request reuses them (SGLang #24226, #30899)",
            guard="!copies_in_flight", states=(S.INFLIGHT,),
            reason="{inflight} copies still in flight"),
    Refusal("release", "not finished and not finalized",
            "prefill slots freed mid-decode while the request still attends to them (SGLang #24226)",
            guard="done", states=(S.PREFILLED,),
            reason="the request is neither finished nor finalized"),
    Refusal("release", "an offload in progress",
            "slots freed while the chunk being enqueued is handed to the offloader",
            states=(S.OFFLOADING,),
            reason="an offload of this request is in progress"),
    Refusal("release", "RELEASED",
            "double free of slots, row and host pages (SGLang #12774; LMCache ref-count reset)",
            states=(S.RELEASED,),
            reason="already released"),
    Refusal("offload", "FINISHED or RELEASED",
            "a copy reading slots that are, or are about to be, freed and reused",
            states=(S.FINISHED, S.RELEASED, S.OFFLOADING),
            reason="the request was finalized or released"),
    Refusal("finish", "FINISHED or RELEASED", "a request finalized twice frees twice",
            states=(S.FINISHED, S.RELEASED, S.OFFLOADING),
            reason="the request was already finalized or released"),
    Refusal("finish", "not finished and not finalized",
            "a running request released by the free path while it still decodes (SGLang #24226)",
            guard="done",
            reason="the request is neither finished nor finalized"),
    Refusal("readmit", "any state but RELEASED", "a live request's progress overwritten (SGLang #37026)",
            states=(S.PREFILLED, S.OFFLOADING, S.INFLIGHT, S.FINISHED),
            reason="only a RELEASED request can be readmitted"),
)


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


_COMPILED: dict = {}  # id(tuple table) -> (table, {(trigger, state): [(conditions, unless, dest), ...]})


def _compiled(table) -> dict:
    """The table indexed by (trigger, source state), its guard names as tuples (once per table).

    A tuple table is taken as frozen: compiled on its first use and never again, so its rows must
    not be edited in place afterwards (a list is compiled afresh on every use)."""
    hit = _COMPILED.get(id(table))
    if hit is not None and hit[0] is table and isinstance(table, tuple):
        return hit[1]
    index: dict = {}
    for row in table:
        entry = (tuple(_as_list(row.get("conditions"))), tuple(_as_list(row.get("unless"))), row["dest"])
        for src in _as_list(row["source"]):
            index.setdefault((row["trigger"], src), []).append(entry)
    if isinstance(table, tuple):  # a list may change in place: compiled afresh every time
        _COMPILED[id(table)] = (table, index)
    return index


def _failing_guard(conditions, unless, facts: Facts, guards: dict) -> str | None:
    """None when the guards allow the row, else the failing guard (``!name`` for ``unless``)."""
    for name in conditions:
        if not guards[name](facts):
            return name
    for name in unless:
        if guards[name](facts):
            return "!" + name
    return None


def decide(trigger: str, facts: Facts, table=TRANSITIONS, guards=GUARDS, refusals=REFUSALS):
    """Where ``trigger`` takes a request with ``facts``, or why it is refused.

    Args:
        trigger: an event name of ``table``.
        facts: the request's ``Facts``.
    Returns:
        The destination ``State`` of the first row whose source matches and whose guards pass;
        otherwise the ``Refusal`` of ``refusals`` for this trigger and failing guard or state (a
        generic ``Refusal`` naming the guard or state when none is declared).
    """
    failed = None
    for conditions, unless, dest in _compiled(table).get((trigger, facts.state), ()):
        failed = _failing_guard(conditions, unless, facts, guards)
        if failed is None:
            return dest
    for r in refusals:
        if r.trigger == trigger and (
            (failed is not None and r.guard == failed) or (failed is None and facts.state in r.states)
        ):
            return r
    if failed is not None:
        return Refusal(trigger, f"guard {failed} failed", "", guard=failed)
    return Refusal(trigger, f"no {trigger!r} transition from {facts.state.name}", "", states=(facts.state,))
