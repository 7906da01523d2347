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

Each transition below names its guard (``conditions``/``unless``: callbacks returning bool) and the
work it does (``before``/``after`` callbacks); ``lifecycle.machine`` binds the names to functions.
An event with no transition from the current state, or whose guard fails, raises
``InvalidTransition`` and changes nothing.
"""

from __future__ import annotations

import enum


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
    dict(trigger="finish", source=[S.PREFILLED, S.INFLIGHT], dest=S.FINISHED),
    dict(trigger="release", source=S.FINISHED, dest=S.RELEASED,
         unless="copies_in_flight", before="free_memory"),
    dict(trigger="readmit", source=S.RELEASED, dest=S.PREFILLED,
         after="reset_progress"),
)

# Why each refusal exists: the bug it prevents (docs/states.md is generated from this).
REFUSALS: tuple[tuple[str, str, str], ...] = (
    ("release", "copies in flight",
     "slots freed while a D2H copy still reads them; a new request reuses them (SGLang #24226, #30899)"),
    ("release", "not finished and not finalized",
     "prefill slots freed mid-decode while the request still attends to them (SGLang #24226)"),
    ("release", "RELEASED",
     "double free of slots, row and host pages (SGLang #12774; LMCache ref-count reset)"),
    ("offload", "FINISHED or RELEASED",
     "a copy reading slots that are, or are about to be, freed and reused"),
    ("finish", "FINISHED or RELEASED", "a request finalized twice frees twice"),
    ("readmit", "any state but RELEASED", "a live request's progress overwritten (SGLang #37026)"),
)
