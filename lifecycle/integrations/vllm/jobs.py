"""What the scheduler side sends the workers each step, and what they send back (plain msgspec
structs: they cross process boundaries inside vLLM's connector metadata, and pickle).

Scheduler -> workers (``StepJobs``, in ``build_connector_meta``): one ordered list of ``ops`` —
``Write`` (copy device blocks into the host pages the scheduler chose), ``Store`` (write host pages
to the storage tier under their chain names), ``Free`` (host pages back to the pool) — executed in
that order by every rank, so every rank's host pool holds the same pages as the scheduler's
accounting; ``fence``: requests vLLM preempted this step and the copies of theirs each rank must see
ended before the next forward (``handle_preemptions``); ``delayed``: requests whose blocks vLLM
keeps (``request_finished`` returned True) and the copies each rank must see ended before it
reports the request in ``finished_sending``.

Workers -> scheduler (``Report``, in ``build_connector_worker_meta``): per copy and per storage op,
how many ranks saw it end; ``aggregate`` adds two ranks' reports (vLLM's ``KVOutputAggregator``).
"""

from __future__ import annotations

import msgspec


class Write(msgspec.Struct, frozen=True, tag="w", array_like=True):
    """Copy device blocks ``blocks`` into host pages ``host_pages`` (same count), as copy ``ack``
    of request ``req_id``."""

    ack: int
    req_id: str
    blocks: list[int]
    host_pages: list[int]


class Store(msgspec.Struct, frozen=True, tag="s", array_like=True):
    """Write host pages ``host_pages`` to storage under ``keys`` (chain names), as storage op ``op``."""

    op: int
    host_pages: list[int]
    keys: list[str]
    tokens: list[int]
    parent: str | None


class Free(msgspec.Struct, frozen=True, tag="f", array_like=True):
    """Host pages back to the pool."""

    host_pages: list[int]


Op = Write | Store | Free


class StepJobs(msgspec.Struct):
    """One step's work for every worker (see the module docstring)."""

    ops: list[Op] = msgspec.field(default_factory=list)
    fence: dict[str, list[int]] = msgspec.field(default_factory=dict)
    delayed: dict[str, list[int]] = msgspec.field(default_factory=dict)

    def empty(self) -> bool:
        return not (self.ops or self.fence or self.delayed)


class Report(msgspec.Struct):
    """Completions one or more ranks saw since their last report: per copy ack / storage op id, the
    number of ranks. ``failed`` copies are also counted in ``ended``; ``expired``: copies a rank
    stopped waiting for (still maybe reading); ``store_failed`` ops are also in ``stored``;
    ``events``: the KV events of rank 0's tier (``events.EventCollector``)."""

    ended: dict[int, int] = msgspec.field(default_factory=dict)
    failed: dict[int, int] = msgspec.field(default_factory=dict)
    expired: dict[int, int] = msgspec.field(default_factory=dict)
    stored: dict[int, int] = msgspec.field(default_factory=dict)
    store_failed: dict[int, int] = msgspec.field(default_factory=dict)
    events: list = msgspec.field(default_factory=list)
    ranks: int = 1

    def empty(self) -> bool:
        return not (self.ended or self.expired or self.stored or self.events)

    def merged(self, other: "Report") -> "Report":
        """The sum of two reports (a new one)."""
        out = Report(ranks=self.ranks + other.ranks)
        for name in ("ended", "failed", "expired", "stored", "store_failed"):
            acc = dict(getattr(self, name))
            for k, n in getattr(other, name).items():
                acc[k] = acc.get(k, 0) + n
            setattr(out, name, acc)
        out.events = self.events + other.events
        return out


__all__ = ["Free", "Op", "Report", "StepJobs", "Store", "Write"]
