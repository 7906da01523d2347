"""A circuit breaker for a storage tier: stop asking a dead tier, probe it again after a backoff.

States (``CircuitBreaker.state``)::

    CLOSED ──(failure_threshold consecutive failures)──> OPEN
    OPEN ──(now >= retry_at)──> HALF_OPEN          (the next allow() says True: callers probe)
    HALF_OPEN ──success──> CLOSED                  (backoff reset to base_backoff_s)
    HALF_OPEN ──failure──> OPEN                    (backoff doubled, capped at max_backoff_s)

Contract for a caller guarding one operation on the tier::

    if not breaker.allow():          # OPEN: do not touch the tier; treat as a miss / failure
        ...
    try:
        result = op()
    except <the tier is unreachable or timed out>:
        breaker.failure(err)         # the tier is down (or hung): counts towards opening
        ...
    else:
        breaker.success()            # the tier answered (a page-level refusal is still a success)

- ``allow()`` never blocks and never raises. While OPEN it returns False and counts a rejection.
  Once the backoff has elapsed it moves to HALF_OPEN and returns True; every caller is let through
  while HALF_OPEN (several probes at once are harmless for a storage tier, and a guarded call may
  itself call a guarded call on the same breaker — ``allow()`` is re-entrant).
- ``failure()`` in CLOSED counts consecutive failures and opens at ``failure_threshold``. In OPEN
  it is counted but does not move ``retry_at`` (a late failure of a call made before the breaker
  opened must not extend the outage). In HALF_OPEN it reopens with twice the previous backoff.
- ``success()`` in CLOSED resets the count of consecutive failures; in HALF_OPEN (a probe answered)
  it closes the breaker. In OPEN it is counted and changes nothing: no call is let through while
  OPEN, so it is the late answer of a call made before the breaker opened, and it must not end the
  outage (on a loaded node such a late success closed the breaker under a dead tier, and the next
  failures logged a second ``storage.tier_down`` for one outage).
- Logging: one ``warning`` (``storage.tier_down``) when the breaker opens after being closed, one
  ``info`` (``storage.tier_recovered``) when it closes after being open — one pair per outage,
  whatever the number of calls refused in between. ``stats()`` holds the counts.
- Thread-safe (one lock, held only for a few field updates). ``clock`` is injectable for tests.

Used by ``RedisStorage`` (every operation: reads and writes fail fast while OPEN) and by
``PrefixLoader`` (a lookup that misses its deadline counts as a failure), and meant for any other
remote tier (Mooncake, Redis Cluster).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable

import msgspec
from transfer.log import get_logger

log = get_logger(__name__)


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class BreakerStats(msgspec.Struct):
    """Counts since construction. ``outages``: times it opened from CLOSED; ``rejected``: calls
    refused while OPEN; ``failures`` / ``successes``: reported outcomes; ``probes``: HALF_OPEN
    entries (one per elapsed backoff)."""

    state: str = BreakerState.CLOSED.value
    outages: int = 0
    rejected: int = 0
    failures: int = 0
    successes: int = 0
    probes: int = 0
    backoff_s: float = 0.0


class CircuitBreaker:
    """Closed / open / half-open breaker with exponential backoff (see the module docstring).

    Args:
        name: the tier, in log lines (e.g. the redacted URL).
        failure_threshold: consecutive failures (while CLOSED) that open it, >= 1.
        base_backoff_s: first wait before probing an open tier, > 0.
        max_backoff_s: cap of the doubled backoff, >= base_backoff_s.
        clock: monotonic seconds (tests inject a fake).
    Raises:
        ValueError: a bad threshold or backoff.
    """

    def __init__(self, name: str = "storage", failure_threshold: int = 1, base_backoff_s: float = 0.5,
                 max_backoff_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(failure_threshold, int) or failure_threshold < 1:
            raise ValueError(f"failure_threshold must be an int >= 1, got {failure_threshold!r}")
        if not base_backoff_s > 0 or not max_backoff_s >= base_backoff_s:
            raise ValueError(f"need 0 < base_backoff_s <= max_backoff_s, got {base_backoff_s!r}, {max_backoff_s!r}")
        self.name, self.failure_threshold = name, failure_threshold
        self.base_backoff_s, self.max_backoff_s = float(base_backoff_s), float(max_backoff_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._backoff = self.base_backoff_s
        self._retry_at = 0.0
        self._stats = BreakerStats()

    @property
    def state(self) -> BreakerState:
        """The current state (OPEN turns HALF_OPEN only through ``allow``)."""
        return self._state

    def allow(self) -> bool:
        """Whether a call may go to the tier now (False only while OPEN and backing off)."""
        if self._state is BreakerState.CLOSED:  # the fast path: one attribute read
            return True
        with self._lock:
            if self._state is BreakerState.OPEN:
                if self._clock() < self._retry_at:
                    self._stats.rejected += 1
                    return False
                self._state = BreakerState.HALF_OPEN
                self._stats.probes += 1
            return True

    def success(self) -> None:
        """The tier answered: reset the failure count, or close after a probe (and log the recovery
        once); a late answer while OPEN changes nothing (see the module docstring)."""
        if self._state is BreakerState.CLOSED and not self._consecutive:
            self._stats.successes += 1  # racy increment on the fast path is fine for a counter
            return
        with self._lock:
            self._stats.successes += 1
            if self._state is BreakerState.OPEN:
                return
            recovered = self._state is not BreakerState.CLOSED
            self._state, self._consecutive, self._backoff = BreakerState.CLOSED, 0, self.base_backoff_s
        if recovered:
            log.info("storage.tier_recovered", tier=self.name)

    def failure(self, error: BaseException | str | None = None) -> None:
        """The tier did not answer (unreachable, timed out): count it, maybe open."""
        opened = False
        with self._lock:
            self._stats.failures += 1
            if self._state is BreakerState.CLOSED:
                self._consecutive += 1
                if self._consecutive >= self.failure_threshold:
                    self._open(self.base_backoff_s)
                    self._stats.outages += 1
                    opened = True
            elif self._state is BreakerState.HALF_OPEN:
                self._open(min(self._backoff * 2, self.max_backoff_s))
        if opened:
            log.warning("storage.tier_down", tier=self.name, retry_in_s=self.base_backoff_s,
                        error=None if error is None else " ".join(str(error).split()) or type(error).__name__)

    def _open(self, backoff: float) -> None:
        self._state, self._backoff = BreakerState.OPEN, backoff
        self._retry_at = self._clock() + backoff

    def retry_in(self) -> float:
        """Seconds until an OPEN breaker lets a probe through (0 when not OPEN)."""
        with self._lock:
            if self._state is not BreakerState.OPEN:
                return 0.0
            return max(0.0, self._retry_at - self._clock())

    def stats(self) -> BreakerStats:
        """A snapshot of the counts and the current state and backoff."""
        with self._lock:
            s = msgspec.structs.replace(self._stats)
            s.state, s.backoff_s = self._state.value, self._backoff
        return s
