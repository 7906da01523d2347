"""What the audit replay reconstructs from a log: lifecycles, chunks, violations, totals."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from lifecycle.states import INITIAL, State

INITIAL_NAME = INITIAL.name
RELEASED_NAME = State.RELEASED.name
STATE_NAMES = [s.name for s in State]


@dataclass
class Violation:
    line: int
    rid: object
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: request {self.rid!r}: {self.message}"


@dataclass
class Chunk:
    """One offloaded chunk, from ``chunk_enqueued`` to its landing and storage (or failure)."""

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

    @property
    def outcome(self) -> str:
        """stored, failed (landed without a storage write, or the copy failed), expired, landed
        (and not yet stored), or in flight (never landed)."""
        if self.expired_line is not None:
            return "expired"
        if self.landed_line is None:
            return "in flight"
        if self.stored_line is not None:
            return "stored"
        return "failed" if self.failed else "landed"


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
    """What a log says, and what is wrong with it. ``ok`` needs at least one lifecycle event."""

    events: int = 0
    lifecycle_events: int = 0
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
    def empty(self) -> bool:
        """No lifecycle event at all: not a log of a run (or the run logged nothing)."""
        return self.lifecycle_events == 0

    @property
    def ok(self) -> bool:
        return not self.violations and not self.empty

    @property
    def requests(self) -> int:
        return len({life.rid for life in self.lifecycles})
