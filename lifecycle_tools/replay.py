"""Replay an audit log (JSON lines) and check it independently of the manager.

The manager's events (``lifecycle.audit``) are re-run against the *declared* lifecycle: each
logged transition goes to ``lifecycle.states.decide`` (the table, its guards and refusals; see
``lifecycle_tools.rules``) with the facts the replay reconstructs, above all its own count of the
request's copies in flight. Nothing about which trigger is allowed when is coded here. A violation
names the line number (1-based) of the event where the log stops making sense. Checked besides:

* events pair up: a ``release`` transition follows its ``lifecycle.released`` event, ``enqueued``
  follows its ``chunk_enqueued``, a readmitted generation follows one release;
* memory is freed exactly once per lifecycle: one ``lifecycle.released`` per lifecycle, in state
  FINISHED, with nothing in flight; its ranges start at 0, do not overlap, cover
  ``[0, committed)`` exactly once (when the event carries ``committed``) and contain every chunk;
* chunks: ``ack_id`` unique, ranges contiguous within a lifecycle, each ``chunk_enqueued`` landed
  (``chunk_landed``) and then stored (``lifecycle.stored`` with its ack id) or failed (a landed event
  with ``error``, no storage op, or ``copy_failed``); nothing lands twice or after a release; a copy
  past its deadline (``copy_expired``) stops counting as in flight and must later end;
* no ``lifecycle.leaked``; every lifecycle ends RELEASED (or readmitted);
* every event is a JSON object whose known fields have the types the manager writes (a ``rid``
  that is a list is a violation on its line, never a crash); a log with no lifecycle event fails.

Lifecycles are keyed by ``(rid, gen, row)``: ``gen`` (0, then +1 per ``readmit``) and ``row``
separate a readmitted request's generations and two live requests that share a rid. A rid reused by
a new request after the old one was RELEASED, on the same row, is recognised by its first event
being a transition from PREFILLED; a log without ``gen`` cannot tell a readmitted generation from a
new request with the same rid (both are checked, as separate lifecycles).

Times: the ``t`` field (seconds, monotonic, written by the CLI's log configuration) when present,
else ``timestamp`` (ISO 8601 or epoch seconds), else the line number. A time that is not finite or
not in 0..1e11 s (``audit_log.event_time``) is a violation on its line; the event is not replayed.
"""

from __future__ import annotations

import json

from lifecycle import audit
from lifecycle.states import State
from lifecycle_tools import interrupt
from lifecycle_tools.audit_log import event_time, field_problem, read_lines
from lifecycle_tools.audit_report import format_report
from lifecycle_tools.replay_model import (
    INITIAL_NAME, RELEASED_NAME, STATE_NAMES, Chunk, Lifecycle, Replay, Violation)
from lifecycle_tools.rules import STATE_NAMES as _KNOWN_STATES, declared_table, verdict

__all__ = ["INITIAL_NAME", "RELEASED_NAME", "STATE_NAMES", "Chunk", "Lifecycle", "Replay", "Violation",
           "declared_table", "format_report", "replay", "replay_file"]


class _Replayer:
    def __init__(self) -> None:
        self.r = Replay()
        self.live: dict[tuple, Lifecycle] = {}
        self.readmits: dict[tuple, int] = {}      # (rid, gen) -> line of its readmit
        self._t = 0.0                             # the time of the event being replayed (``_parse``)

    # -- helpers -------------------------------------------------------------------------------
    def bad(self, line: int, rid, msg: str) -> None:
        self.r.violations.append(Violation(line, rid, msg))

    def life_for(self, ev: dict, line: int, t: float, *, starts: bool) -> Lifecycle:
        rid, gen, row = ev.get("rid"), ev.get("gen"), ev.get("row")
        key = (rid, gen, row)
        life = self.live.get(key)
        if life is not None and (life.readmitted or (life.state == RELEASED_NAME and starts)):
            life = None  # a new lifecycle under the same key: a reused rid
        if life is None:
            life = Lifecycle(rid, gen, row, line, t, state_line=line, entered_t=t)
            life.history.append((t, INITIAL_NAME))
            self.live[key] = life
            self.r.lifecycles.append(life)
            if isinstance(gen, int) and gen > 0 and (rid, gen - 1) not in self.readmits:
                self.bad(line, rid, f"generation {gen} begins without a readmit of generation {gen - 1}")
        life.last_line = line
        return life

    def enter(self, life: Lifecycle, state: str, t: float, line: int) -> None:
        self.r.durations[life.state].append(max(0.0, t - life.entered_t))
        self.r.visits[state] += 1
        life.state, life.entered_t, life.state_line = state, t, line
        life.history.append((t, state))
        if state == RELEASED_NAME:
            life.end_t = t

    # -- events --------------------------------------------------------------------------------
    def transition(self, ev: dict, line: int, t: float) -> None:
        trig, src, dst = ev.get("trigger"), ev.get("src"), ev.get("dst")
        if src not in _KNOWN_STATES or dst not in _KNOWN_STATES:
            self.bad(line, ev.get("rid"), f"transition {trig!r} names an unknown state ({src!r} -> {dst!r})")
            return
        life = self.life_for(ev, line, t, starts=src == INITIAL_NAME and trig in ("offload", "finish"))
        rid = life.rid
        self.r.triggers[trig] += 1
        problem = verdict(trig, src, dst, len(life.inflight))
        if problem:
            held = ", ".join(f"ack {c.ack_id} (line {c.enq_line})" for c in list(life.inflight.values())[:3])
            self.bad(line, rid, problem + (f"; in flight: {held}" if held else ""))
        if src != life.state:
            self.bad(line, rid, f"{trig!r} from {src}, but the request was {life.state} (since line {life.state_line})")
        self._pairing(trig, life, line)
        self.enter(life, dst, t, line)

    def _pairing(self, trig: str, life: Lifecycle, line: int) -> None:
        """Transitions that must follow (or be followed by) an event of their own."""
        if trig == "release":
            if not life.release_pending:
                self.bad(line, life.rid, "release transition without a lifecycle.released event (slots never freed)")
            life.release_pending = False
        elif trig == "enqueued":
            if not life.enqueue_pending:
                self.bad(line, life.rid, "'enqueued' without a chunk_enqueued event")
            life.enqueue_pending = False
        elif trig == "offload":
            life.enqueue_pending = False
        elif trig == "readmit":
            life.readmitted = True
            if isinstance(life.gen, int):
                self.readmits[(life.rid, life.gen)] = line
            if life.released != 1:
                self.bad(line, life.rid, f"readmitted after {life.released} releases (want exactly 1)")

    def chunk_enqueued(self, ev: dict, line: int, t: float) -> None:
        life = self.life_for(ev, line, t, starts=False)
        ack, start, end = ev.get("ack_id"), ev.get("start"), ev.get("end")
        if life.state != State.OFFLOADING.name:
            self.bad(line, life.rid, f"chunk ack {ack} enqueued in state {life.state} (want OFFLOADING)")
        if ack in self.r.chunks:
            self.bad(line, life.rid, f"ack id {ack} reused (first enqueued on line {self.r.chunks[ack].enq_line})")
            return
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end):
            self.bad(line, life.rid, f"chunk ack {ack} has a bad range [{start}, {end})")
            start, end = (start if isinstance(start, int) else 0), (end if isinstance(end, int) else 0)
        elif life.chunks and life.chunks[-1].end != start:
            prev = life.chunks[-1]
            self.bad(line, life.rid, f"chunk ack {ack} starts at {start}, not where ack {prev.ack_id} ended ({prev.end})")
        chunk = Chunk(ack, life.rid, life, start, end, ev.get("pages") or 0, t, line)
        self.r.chunks[ack] = chunk
        life.chunks.append(chunk)
        life.inflight[ack] = chunk
        life.enqueue_pending = True

    def _chunk_of(self, ev: dict, line: int, missing: str):
        """(ack id, its Chunk); the Chunk is None, with a violation, when it was never enqueued."""
        ack = ev.get("ack_id")
        chunk = self.r.chunks.get(ack)
        if chunk is None:
            self.bad(line, ev.get("rid"), f"chunk ack {ack} {missing}")
        return ack, chunk

    def chunk_landed(self, ev: dict, line: int, t: float) -> None:
        ack, chunk = self._chunk_of(ev, line, "landed but was never enqueued")
        if chunk is None:
            return
        life = chunk.life
        life.last_line = max(life.last_line, line)
        if "error" in ev:   # storage hand-off failed; the plain landed event follows
            chunk.failed = True
            return
        if chunk.landed_line is not None:
            self.bad(line, chunk.rid, f"chunk ack {ack} landed twice (first on line {chunk.landed_line})")
            return
        if life.state == RELEASED_NAME:
            self.bad(line, chunk.rid, f"chunk ack {ack} landed after the request was released (line {life.released_line})")
        chunk.landed_t, chunk.landed_line, chunk.op_id = t, line, ev.get("op_id")
        if chunk.op_id is None:
            chunk.failed = True
        life.inflight.pop(ack, None)

    def copy_failed(self, ev: dict, line: int, t: float) -> None:
        """The copy ended in failure: no longer in flight, never stored."""
        chunk = self._settle(ev, line, t, "failed")
        if chunk is not None:
            chunk.failed = True

    def copy_expired(self, ev: dict, line: int, t: float) -> None:
        """Past its deadline: no longer counted in flight; its slots stay quarantined until it ends."""
        chunk = self._settle(ev, line, t, "expired")
        if chunk is not None:
            chunk.failed, chunk.expired_line = True, line

    def expired_copy_ended(self, ev: dict, line: int, t: float) -> None:
        ack = ev.get("ack_id")
        chunk = self.r.chunks.get(ack)
        if chunk is None or chunk.expired_line is None:
            self.bad(line, ev.get("rid"), f"expired copy ack {ack} ended but never expired")
            return
        if chunk.ended_line is not None:
            self.bad(line, chunk.rid, f"expired copy ack {ack} ended twice (first on line {chunk.ended_line})")
        chunk.ended_line = line

    def _settle(self, ev: dict, line: int, t: float, what: str):
        ack, chunk = self._chunk_of(ev, line, f"{what} but was never enqueued")
        if chunk is None:
            return None
        if chunk.landed_line is not None:
            self.bad(line, chunk.rid, f"chunk ack {ack} {what} after it landed (line {chunk.landed_line})")
            return None
        chunk.life.last_line = max(chunk.life.last_line, line)
        chunk.landed_t, chunk.landed_line = t, line
        chunk.life.inflight.pop(ack, None)
        return chunk

    def stored(self, ev: dict, line: int, t: float) -> None:
        ack, chunk = self._chunk_of(ev, line, "stored but was never enqueued")
        if chunk is None:
            return
        if chunk.landed_line is None:
            self.bad(line, chunk.rid, f"chunk ack {ack} stored before it landed")
        if chunk.stored_line is not None:
            self.bad(line, chunk.rid, f"chunk ack {ack} stored twice (first on line {chunk.stored_line})")
        if chunk.op_id is not None and ev.get("op_id") is not None and ev.get("op_id") != chunk.op_id:
            self.bad(line, chunk.rid, f"chunk ack {ack} stored by op {ev.get('op_id')}, landed as op {chunk.op_id}")
        chunk.stored_t, chunk.stored_line = t, line

    def released(self, ev: dict, line: int, t: float) -> None:
        life = self.life_for(ev, line, t, starts=False)
        rid = life.rid
        life.released += 1
        if life.released > 1:
            self.bad(line, rid, f"released {life.released} times in one lifecycle (first on line {life.released_line})")
        else:
            life.released_line = line
        if life.state != State.FINISHED.name:
            self.bad(line, rid, f"slots freed in state {life.state} (want FINISHED)")
        if life.inflight:
            held = ", ".join(f"ack {c.ack_id} (line {c.enq_line})" for c in list(life.inflight.values())[:3])
            self.bad(line, rid, f"slots freed while {len(life.inflight)} copies in flight: {held}")
        life.release_pending = True
        ranges = ev.get("ranges") or []
        try:
            ranges = sorted((int(a), int(b)) for a, b in ranges)
        except (TypeError, ValueError):
            self.bad(line, rid, f"unreadable ranges {ev.get('ranges')!r}")
            return
        life.ranges, life.committed = ranges, ev.get("committed")
        for (a, b), (c, d) in zip(ranges, ranges[1:]):
            if c < b:
                self.bad(line, rid, f"freed ranges overlap: [{a}, {b}) and [{c}, {d})")
        if any(b <= a for a, b in ranges):
            self.bad(line, rid, f"empty or reversed freed range in {ranges}")
        committed = life.committed
        if isinstance(committed, int) and committed > 0:
            if not ranges or ranges[0] != (0, committed):
                self.bad(line, rid, f"freed ranges {ranges} do not cover [0, {committed}) exactly once")
        elif ranges and ranges[0][0] != 0:
            self.bad(line, rid, f"freed ranges {ranges} do not start at 0")
        for c in life.chunks:
            if not any(a <= c.start and c.end <= b for a, b in ranges):
                self.bad(line, rid, f"chunk ack {c.ack_id} [{c.start}, {c.end}) lies outside the freed ranges {ranges}")
                break

    def leaked(self, ev: dict, line: int, t: float) -> None:
        self.bad(line, ev.get("rid"), f"leaked in state {ev.get('state')} ({ev.get('slots')} slots)")

    # -- the whole log ---------------------------------------------------------------------------
    def run(self, lines) -> Replay:
        handlers = {
            audit.TRANSITION: self.transition, audit.CHUNK_ENQUEUED: self.chunk_enqueued,
            audit.CHUNK_LANDED: self.chunk_landed, audit.STORED: self.stored, audit.RELEASED: self.released,
            audit.LEAKED: self.leaked, audit.COPY_FAILED: self.copy_failed, audit.COPY_EXPIRED: self.copy_expired,
            audit.EXPIRED_COPY_ENDED: self.expired_copy_ended,
        }
        for n, raw in enumerate(lines, 1):
            if n % 4096 == 0:
                interrupt.check()
            self.r.lines = n
            ev = self._parse(n, raw)
            if ev is None:
                continue
            name = ev["event"]
            if name == audit.REFUSED:
                self.r.refusals.append((n, ev.get("rid"), ev.get("trigger"), ev.get("reason")))
            elif name in handlers:
                handlers[name](ev, n, self._t)
        self._finish()
        self.r.violations.sort(key=lambda v: v.line)
        return self.r

    def _parse(self, n: int, raw: str) -> dict | None:
        """The event on line ``n``, counted; None (with a violation where due) when it cannot be replayed."""
        r = self.r
        raw = raw.strip()
        if not raw:
            return None
        try:
            ev = json.loads(raw)
        except (ValueError, RecursionError):
            self.bad(n, None, "not a JSON line")
            return None
        if not isinstance(ev, dict):
            self.bad(n, None, "not a JSON object")
            return None
        name = ev.get("event")
        if not isinstance(name, str):
            self.bad(n, None, f"'event' is {type(name).__name__}, want text")
            return None
        r.events += 1
        r.event_counts[name] += 1
        t, problem = event_time(ev, n)
        if problem:
            rid = ev.get("rid")
            self.bad(n, rid if isinstance(rid, (str, int)) else None, f"{name}: {problem}")
            return None
        self._t = t
        r.t0 = t if r.t0 is None else min(r.t0, t)
        r.t1 = t if r.t1 is None else max(r.t1, t)
        if not name.startswith("lifecycle."):
            return None
        r.lifecycle_events += 1
        problem = field_problem(ev)
        if problem:
            rid = ev.get("rid")
            self.bad(n, rid if isinstance(rid, (str, int)) else None, f"{name}: {problem}")
            return None
        return ev

    def _finish(self) -> None:
        """End-of-log checks: every lifecycle released once, every chunk landed and settled."""
        for life in self.r.lifecycles:
            if life.readmitted:
                continue
            if life.state != RELEASED_NAME:
                self.bad(life.last_line, life.rid, f"never released (last state {life.state}, line {life.state_line})")
            elif life.released != 1:
                self.bad(life.last_line, life.rid, f"released {life.released} times (want exactly 1)")
        for chunk in self.r.chunks.values():
            if chunk.landed_line is None:
                self.bad(chunk.enq_line, chunk.rid, f"chunk ack {chunk.ack_id} never landed")
            elif chunk.stored_line is None and not chunk.failed:
                self.bad(chunk.landed_line, chunk.rid, f"chunk ack {chunk.ack_id} landed but was never stored")
            if chunk.expired_line is not None and chunk.ended_line is None:
                self.bad(chunk.expired_line, chunk.rid,
                         f"expired copy ack {chunk.ack_id} never ended (its quarantined slots stay held)")


def replay(lines) -> Replay:
    """Replay an iterable of JSON lines."""
    return _Replayer().run(lines)


def replay_file(path) -> Replay:
    """Replay the audit log at ``path``, streamed.

    Raises:
        LogUnreadable: it cannot be read, or is not a text log (see ``audit_log.read_lines``).
    """
    return replay(read_lines(path))
