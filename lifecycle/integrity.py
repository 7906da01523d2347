"""Read-only views of a manager: counters (``stats``), a debugging snapshot, what is pending, and
the integrity check that its tables agree."""

from __future__ import annotations

import msgspec

from transfer.indices import on_host
from lifecycle.errors import IntegrityError
from lifecycle.records import RecordView, Stats
from lifecycle.states import State

_PREFILLED, _OFFLOADING, _INFLIGHT = State.PREFILLED, State.OFFLOADING, State.INFLIGHT
_FINISHED, _RELEASED = State.FINISHED, State.RELEASED


class Pending(msgspec.Struct):
    """What a manager still waits on (``DecodeOffloadManager.pending``).

    ``copies``: copies issued whose landing was not reported yet. ``unsettled``: completions
    (copies landed, storage ops finished) reported by the offloader but not settled yet — call
    ``check_offload_progress``. ``storage_ops``: storage ops in flight. ``quarantined_slots``: slots
    kept allocated for expired copies that may still read them. ``finished_waiting``: finished
    requests that still hold their slots because a copy of theirs is not settled;
    ``finished_waiting_on_settled``: those of them whose every copy has landed (only a progress
    check is missing).
    """

    copies: int
    unsettled: int
    storage_ops: int
    quarantined_slots: int
    finished_waiting: int
    finished_waiting_on_settled: int

    def describe(self) -> str:
        """One line naming what is pending, and what to do about unsettled completions."""
        parts = [f"{self.copies} copies in flight", f"{self.storage_ops} storage ops in flight"]
        if self.unsettled:
            parts.append(f"{self.unsettled} completions reported but never settled (call check_offload_progress)")
        if self.finished_waiting:
            parts.append(f"{self.finished_waiting} finished requests holding slots "
                         f"({self.finished_waiting_on_settled} only waiting for check_offload_progress)")
        if self.quarantined_slots:
            parts.append(f"{self.quarantined_slots} slots quarantined by expired copies")
        return ", ".join(parts)


def stats(mgr) -> Stats:
    """Counters. ``tracked`` counts live requests not yet RELEASED."""
    by_state = dict(mgr._by_name)
    return Stats(
        tracked=sum(by_state.values()) - by_state["RELEASED"],
        inflight_writes=len(mgr._ongoing),
        inflight_storage=len(mgr._storage_ops),
        released=mgr._released,
        leaked=mgr._leaked,
        by_state=by_state,
        chunks_enqueued=mgr._chunks,
        pages_enqueued=mgr._pages,
        chunks_landed=mgr._chunks_landed,
        storage_finished=mgr._storage_finished,
        host_short=mgr._host_short,
        copies_expired=mgr._copies_expired,
        copy_failures=mgr._copy_failures,
        quarantined_slots=sum(q.slots.numel() for q in list(mgr._expired.values())),
        unsettled=len(mgr._landed) + len(mgr._stored),
        transitions=dict(mgr._by_event),
        abandoned=mgr._abandoned,
        bad_release_rows=mgr._bad_release_rows,
    )


def pending(mgr) -> Pending:
    """What the manager waits on, from its tables (nothing is polled or settled)."""
    landed = mgr._landed
    waiting = [c.rec for c in mgr._ongoing.values() if c.rec.state is _FINISHED]
    by_rec: dict[int, list] = {}
    for ack, c in mgr._ongoing.items():
        by_rec.setdefault(id(c.rec), []).append(ack)
    finished = {id(r): r for r in waiting}
    on_settled = sum(1 for key in finished if all(a in landed for a in by_rec[key]))
    return Pending(
        copies=sum(1 for a in mgr._ongoing if a not in landed),
        unsettled=len(landed) + len(mgr._stored),
        storage_ops=len(mgr._storage_ops),
        quarantined_slots=sum(q.slots.numel() for q in mgr._expired.values()),
        finished_waiting=len(finished),
        finished_waiting_on_settled=on_settled,
    )


def snapshot(mgr) -> bytes:
    """All live records, msgpack-encoded (``RecordView`` list), for debugging."""
    views = [
        RecordView(str(r.rid), r.state.name, r.row, r.inflight, r.offload.inc_len, r.offload.last_hash, r.generation)
        for r in list(mgr._records.values())
        if r.ref() is not None
    ]
    return msgspec.msgpack.encode(views)


def _record_problems(rec, n: int) -> list[str]:
    problems = []
    if rec.inflight != n:
        problems.append(f"{rec.rid!r}: inflight {rec.inflight} but {n} chunks outstanding")
    if rec.state is _OFFLOADING:
        problems.append(f"{rec.rid!r}: left in OFFLOADING")
    if rec.state is _INFLIGHT and not rec.inflight:
        problems.append(f"{rec.rid!r}: INFLIGHT with nothing in flight")
    if rec.state in (_PREFILLED, _RELEASED) and rec.inflight:
        problems.append(f"{rec.rid!r}: {rec.state.name} with {rec.inflight} copies in flight")
    if rec.state is _FINISHED and not rec.inflight:
        problems.append(f"{rec.rid!r}: FINISHED with nothing in flight but not released")
    return problems


def check_integrity(mgr) -> None:
    """Verify the tables agree.

    Raises:
        IntegrityError: listing every disagreement found.
    """
    problems = []
    per_rec: dict[int, int] = {}
    for ack, chunk in mgr._ongoing.items():
        per_rec[id(chunk.rec)] = per_rec.get(id(chunk.rec), 0) + 1
        if chunk.rec.state not in (_INFLIGHT, _FINISHED):
            problems.append(f"ack {ack} in flight for {chunk.rec.rid!r} in {chunk.rec.state.name}")
    counts = dict.fromkeys(State.__members__, 0)
    for rec in list(mgr._records.values()):
        counts[rec.state.name] += 1
        problems += _record_problems(rec, per_rec.pop(id(rec), 0))
    if per_rec:
        problems.append(f"{sum(per_rec.values())} in-flight chunks belong to no live record")
    if counts != mgr._by_name:
        problems.append(f"state counters {mgr._by_name} disagree with records {counts}")
    reads = (sum(c.indices.numel() for c in mgr._ongoing.values() if on_host(c.indices))  # device ids: not counted
             + sum(q.slots.numel() for q in mgr._expired.values() if on_host(q.slots) and not q.disowned))
    if mgr._reading.total() != reads:
        problems.append(f"{mgr._reading.total()} slot reads counted, but copies in flight read {reads} slots")
    if problems:
        raise IntegrityError("; ".join(problems))
