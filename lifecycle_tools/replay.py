"""Replay an audit log (JSON lines) and check it independently of the manager.

The manager's events (``lifecycle.audit``) are re-run against the *declared* transition table
(``lifecycle.states.TRANSITIONS``), not against the manager's code, with the replay's own count of
copies in flight standing in for the ``copies_in_flight`` guard. A violation names the line number
(1-based) of the event where the log stops making sense. Checked:

* every ``lifecycle.transition`` is in the table (trigger, src -> dst), starts from the state the
  replay has the request in, and respects the guards: ``release``/``landed`` only with nothing in
  flight, ``host_short`` to PREFILLED only with nothing in flight and to INFLIGHT only with copies in
  flight, ``enqueued`` only after its ``chunk_enqueued``;
* memory is freed exactly once per lifecycle: one ``lifecycle.released`` per lifecycle, in state
  FINISHED, with nothing in flight, followed by the ``release`` transition; its ranges start at 0,
  do not overlap, cover ``[0, committed)`` exactly once (when the event carries ``committed``) and
  contain every chunk offloaded;
* chunks: ``ack_id`` unique, ranges contiguous within a lifecycle, each ``chunk_enqueued`` landed
  (``chunk_landed``) and then stored (``lifecycle.stored`` with its ack id) or failed (a landed event
  with ``error``, no storage op, or ``copy_failed``); nothing lands twice or after a release; a copy
  past its deadline (``copy_expired``) stops counting as in flight (its slots are quarantined by the
  manager, so a release may follow) and must later end (``expired_copy_ended``);
* no ``lifecycle.leaked``; every lifecycle ends RELEASED (or readmitted).

Lifecycles are keyed by ``(rid, gen, row)``: ``gen`` (the lifecycle generation the manager binds,
0 then +1 per ``readmit``) and ``row`` (a request holds its row for a whole generation) separate a
readmitted request's generations and two live requests that share a rid. Limitation: a rid reused by
a new request object after the old one was RELEASED, on the same row, is recognised only by its first
event being a transition from PREFILLED; a log that lacks ``gen`` (older managers) cannot tell a
readmitted generation from a new request with the same rid (both are checked, as separate
lifecycles). ``lifecycle.stored`` carries no row: it is matched to its chunk by ``ack_id``.

Times: the ``t`` field (seconds, monotonic, written by the CLI's log configuration) when present,
else ``timestamp`` (ISO 8601 or epoch seconds), else the line number.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from lifecycle import audit
from lifecycle.states import INITIAL, TRANSITIONS, State

INITIAL_NAME = INITIAL.name
RELEASED_NAME = State.RELEASED.name
STATE_NAMES = [s.name for s in State]


def declared_table(table=TRANSITIONS) -> dict[tuple[str, str], set[str]]:
    """(trigger, src) -> allowed destinations, from the declared table."""
    out: dict[tuple[str, str], set[str]] = defaultdict(set)
    for row in table:
        sources = row["source"] if isinstance(row["source"], (list, tuple)) else [row["source"]]
        for src in sources:
            out[(row["trigger"], _name(src))].add(_name(row["dest"]))
    return dict(out)


def _name(state) -> str:
    return state.name if isinstance(state, State) else str(state)


@dataclass
class Violation:
    line: int
    rid: object
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: request {self.rid!r}: {self.message}"


@dataclass
class Chunk:
    ack_id: int
    rid: object
    life: "Lifecycle"
    start: int
    end: int
    pages: int
    enq_t: float
    enq_line: int
    landed_t: float | None = None
    landed_line: int | None = None
    op_id: int | None = None
    stored_t: float | None = None
    stored_line: int | None = None
    failed: bool = False
    expired_line: int | None = None      # copy past its deadline: slots quarantined until it ends
    ended_line: int | None = None


@dataclass
class Lifecycle:
    """One request generation as the log tells it."""

    rid: object
    gen: int | None
    row: int | None
    first_line: int
    start_t: float
    state: str = INITIAL_NAME
    state_line: int = 0
    entered_t: float = 0.0
    last_line: int = 0
    end_t: float | None = None
    inflight: dict = field(default_factory=dict)       # ack_id -> Chunk
    chunks: list = field(default_factory=list)
    released: int = 0
    released_line: int | None = None
    release_pending: bool = False
    ranges: list = field(default_factory=list)
    committed: int | None = None
    readmitted: bool = False
    history: list = field(default_factory=list)          # (t, state) entries
    enqueue_pending: bool = False

    @property
    def label(self) -> str:
        return f"{self.rid}" if not self.gen else f"{self.rid}#{self.gen}"


@dataclass
class Replay:
    """What a log says, and what is wrong with it."""

    events: int = 0
    lines: int = 0
    lifecycles: list = field(default_factory=list)
    chunks: dict = field(default_factory=dict)
    violations: list = field(default_factory=list)
    triggers: Counter = field(default_factory=Counter)
    event_counts: Counter = field(default_factory=Counter)
    durations: dict = field(default_factory=lambda: defaultdict(list))   # state -> [seconds]
    visits: Counter = field(default_factory=Counter)
    refusals: list = field(default_factory=list)
    t0: float | None = None
    t1: float | None = None

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def requests(self) -> int:
        return len({life.rid for life in self.lifecycles})


def _time(ev: dict, line: int) -> float:
    t = ev.get("t")
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        return float(t)
    ts = ev.get("timestamp")
    if isinstance(ts, (int, float)) and not isinstance(ts, bool):
        return float(ts)
    if isinstance(ts, str):
        try:
            return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    return float(line)


class _Replayer:
    def __init__(self) -> None:
        self.table = declared_table()
        self.r = Replay()
        self.live: dict[tuple, Lifecycle] = {}
        self.readmits: dict[tuple, int] = {}      # (rid, gen) -> line of its readmit

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
        starts = src == INITIAL_NAME and trig in ("offload", "finish")
        life = self.life_for(ev, line, t, starts=starts)
        rid = life.rid
        self.r.triggers[trig] += 1
        allowed = self.table.get((trig, src))
        if allowed is None or dst not in allowed:
            self.bad(line, rid, f"illegal transition {trig!r} {src} -> {dst} (not in the declared table)")
        if src != life.state:
            self.bad(line, rid, f"{trig!r} from {src}, but the request was {life.state} (since line {life.state_line})")
        n = len(life.inflight)
        held = ", ".join(f"ack {c.ack_id} (line {c.enq_line})" for c in list(life.inflight.values())[:3])
        if trig == "release":
            if n:
                self.bad(line, rid, f"released while {n} copies in flight: {held}")
            if not life.release_pending:
                self.bad(line, rid, "release transition without a lifecycle.released event (slots never freed)")
            life.release_pending = False
        elif trig == "landed" and n:
            self.bad(line, rid, f"'landed' to {dst} while {n} copies still in flight: {held}")
        elif trig == "host_short":
            if dst == INITIAL_NAME and n:
                self.bad(line, rid, f"host_short back to {dst} with {n} copies in flight")
            if dst == State.INFLIGHT.name and not n:
                self.bad(line, rid, "host_short to INFLIGHT with nothing in flight")
        elif trig == "enqueued":
            if not life.enqueue_pending:
                self.bad(line, rid, "'enqueued' without a chunk_enqueued event")
            life.enqueue_pending = False
        elif trig == "readmit":
            life.readmitted = True
            if isinstance(life.gen, int):
                self.readmits[(rid, life.gen)] = line
            if life.released != 1:
                self.bad(line, rid, f"readmitted after {life.released} releases (want exactly 1)")
        if trig == "offload":
            life.enqueue_pending = False
        self.enter(life, dst if isinstance(dst, str) else str(dst), t, line)

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

    def chunk_landed(self, ev: dict, line: int, t: float) -> None:
        ack = ev.get("ack_id")
        chunk = self.r.chunks.get(ack)
        if chunk is None:
            self.bad(line, ev.get("rid"), f"chunk ack {ack} landed but was never enqueued")
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
        ack = ev.get("ack_id")
        chunk = self.r.chunks.get(ack)
        if chunk is None:
            self.bad(line, ev.get("rid"), f"chunk ack {ack} {what} but was never enqueued")
            return None
        if chunk.landed_line is not None:
            self.bad(line, chunk.rid, f"chunk ack {ack} {what} after it landed (line {chunk.landed_line})")
            return None
        chunk.life.last_line = max(chunk.life.last_line, line)
        chunk.landed_t, chunk.landed_line = t, line
        chunk.life.inflight.pop(ack, None)
        return chunk

    def stored(self, ev: dict, line: int, t: float) -> None:
        ack = ev.get("ack_id")
        chunk = self.r.chunks.get(ack)
        if chunk is None:
            self.bad(line, ev.get("rid"), f"stored ack {ack} that was never enqueued")
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
        r = self.r
        handlers = {
            audit.TRANSITION: self.transition,
            audit.CHUNK_ENQUEUED: self.chunk_enqueued,
            audit.CHUNK_LANDED: self.chunk_landed,
            audit.STORED: self.stored,
            audit.RELEASED: self.released,
            audit.LEAKED: self.leaked,
            getattr(audit, "COPY_FAILED", "lifecycle.copy_failed"): self.copy_failed,
            getattr(audit, "COPY_EXPIRED", "lifecycle.copy_expired"): self.copy_expired,
            getattr(audit, "EXPIRED_COPY_ENDED", "lifecycle.expired_copy_ended"): self.expired_copy_ended,
        }
        for n, raw in enumerate(lines, 1):
            r.lines = n
            raw = raw.strip()
            if not raw:
                continue
            try:
                ev = json.loads(raw)
            except ValueError:
                self.bad(n, None, "not a JSON line")
                continue
            if not isinstance(ev, dict):
                self.bad(n, None, "not a JSON object")
                continue
            name = ev.get("event")
            r.events += 1
            r.event_counts[name] += 1
            t = _time(ev, n)
            r.t0 = t if r.t0 is None else min(r.t0, t)
            r.t1 = t if r.t1 is None else max(r.t1, t)
            if name == audit.REFUSED:
                r.refusals.append((n, ev.get("rid"), ev.get("trigger"), ev.get("reason")))
                continue
            handler = handlers.get(name)
            if handler is not None:
                handler(ev, n, t)
        for life in r.lifecycles:
            if life.readmitted:
                continue
            if life.state != RELEASED_NAME:
                self.bad(life.last_line, life.rid, f"never released (last state {life.state}, line {life.state_line})")
            elif life.released != 1:
                self.bad(life.last_line, life.rid, f"released {life.released} times (want exactly 1)")
        for chunk in r.chunks.values():
            if chunk.landed_line is None:
                self.bad(chunk.enq_line, chunk.rid, f"chunk ack {chunk.ack_id} never landed")
            elif chunk.stored_line is None and not chunk.failed:
                self.bad(chunk.landed_line, chunk.rid, f"chunk ack {chunk.ack_id} landed but was never stored")
            if chunk.expired_line is not None and chunk.ended_line is None:
                self.bad(chunk.expired_line, chunk.rid,
                         f"expired copy ack {chunk.ack_id} never ended (its quarantined slots stay held)")
        r.violations.sort(key=lambda v: v.line)
        return r


def replay(lines) -> Replay:
    """Replay an iterable of JSON lines."""
    return _Replayer().run(lines)


def replay_file(path) -> Replay:
    """Replay the audit log at ``path``. Raises OSError when it cannot be read."""
    with open(path, encoding="utf-8") as f:
        return replay(f)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return 0.0
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def format_report(r: Replay, path: str = "", max_violations: int = 50) -> str:
    """The human summary: counts, per-state durations, and every violation (capped)."""
    out = []
    span = (r.t1 - r.t0) * 1000 if r.t0 is not None else 0.0
    failed = sum(1 for c in r.chunks.values() if c.failed)
    stored = sum(1 for c in r.chunks.values() if c.stored_line is not None)
    out.append(f"audit log {path}: {r.events} events over {span:.1f} ms; {r.requests} requests, "
               f"{len(r.lifecycles)} lifecycles, {len(r.chunks)} chunks ({stored} stored, {failed} failed)")
    out.append(f"{'state':<12}{'entered':>9}{'left':>8}{'p50 ms':>11}{'p99 ms':>11}{'max ms':>11}{'total ms':>12}")
    for name in STATE_NAMES:
        d = r.durations.get(name, [])
        entered = r.visits[name] + (len(r.lifecycles) if name == INITIAL_NAME else 0)
        out.append(f"{name:<12}{entered:>9}{len(d):>8}{_pct(d, 50) * 1e3:>11.3f}{_pct(d, 99) * 1e3:>11.3f}"
                   f"{max(d, default=0.0) * 1e3:>11.3f}{sum(d) * 1e3:>12.1f}")
    final = Counter(life.state for life in r.lifecycles if not life.readmitted)
    out.append("final states: " + (", ".join(f"{k} {v}" for k, v in sorted(final.items())) or "none"))
    out.append("transitions: " + (", ".join(f"{k} {v}" for k, v in sorted(r.triggers.items())) or "none"))
    if r.refusals:
        out.append(f"refused calls (the manager said no; not violations): {len(r.refusals)}")
        for line, rid, trig, reason in r.refusals[:5]:
            out.append(f"  line {line}: request {rid!r}: {trig}: {reason}")
    if r.violations:
        out.append(f"VIOLATIONS: {len(r.violations)}")
        out += [f"  {v}" for v in r.violations[:max_violations]]
        if len(r.violations) > max_violations:
            out.append(f"  ... {len(r.violations) - max_violations} more")
    else:
        out.append("OK: every transition legal, every lifecycle released exactly once, never under a copy")
    return "\n".join(out)
