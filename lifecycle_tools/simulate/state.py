"""The scheduler's state: its requests and the state of one pass, as named fields."""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

import hashing
from lifecycle_tools.request import Request
from lifecycle_tools.simulate.report import PassReport
from lifecycle_tools.simulate.verify import PageSample
from lifecycle_tools.simulate.workload import Plan, kv_ids


class SimRequest(Request):
    """A decode request as SGLang's scheduler holds it, plus the simulator's plan for it.

    ``seed`` is the namespace its pages are named under, as the manager names them
    (``DecodeOffloadManager.namespace_of``, set on arrival): its prefix lookups, prompt backups
    and the verification sample chain from it."""

    __slots__ = ("plan", "seq", "kvids", "pages", "reserved", "retracted", "readmit", "ending", "seed")

    def __init__(self, plan: Plan, seed: str | None = None) -> None:
        super().__init__(plan.rid, plan.prompt, extra_key=plan.extra_key, cache_salt=plan.cache_salt)
        self.plan = plan
        self.seed = seed
        self.seq = plan.prompt + plan.output
        model = hashing.namespace_seed(plan.extra_key, plan.cache_salt)   # whose KV (adapter, tenant)
        self.kvids = torch.tensor(kv_ids(self.seq, model), dtype=torch.int64)   # kv id of every position
        self.pages = 0                # pages of the row backed by allocated slots
        self.reserved = 0             # pages reserved at admission
        self.retracted = False        # retracted once already
        self.readmit = False          # waiting to come back after a retraction
        self.ending = ""              # "finish" | "abort" | "retract" once handed to the manager

    def tokens_left(self) -> int:
        """Output tokens it may still sample before its plan ends, aborts or retracts it."""
        n_out = len(self.output_ids)
        left = len(self.plan.output) - n_out
        if self.plan.abort_at is not None:
            left = min(left, self.plan.abort_at - n_out)
        if not self.retracted and self.plan.retract_at is not None:
            left = min(left, self.plan.retract_at - n_out)
        return left


@dataclass
class PassState:
    """Everything one pass tracks; bounded by the requests live at a time, not by the workload."""

    rep: PassReport
    chats: Iterator[Plan]
    total: int
    sample: PageSample
    upcoming: Plan | None = None             # the next chat to arrive (taken from ``chats``)
    later: list = field(default_factory=list)   # heap of (step, seq, plan): next turns of chats
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    loading: dict = field(default_factory=dict)  # load id -> request whose prefix is loading
    draining: list = field(default_factory=list)  # handed to the manager, not yet RELEASED
    overhead_us: array = field(default_factory=lambda: array("d"))
    reserved: int = 0                        # device pages reserved by admitted requests
    prefill: int = 0                         # prompt tokens computed this step
    done: int = 0
    step: int = 0
    before: object = None                    # lifecycle.node_stats.NodeStats at the start of the pass
    max_waiting: int = 256                   # new chats are held upstream while this many wait
    _seq: Iterator[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.upcoming = next(self.chats, None)

    def schedule_turn(self, step: int, plan: Plan) -> None:
        heapq.heappush(self.later, (step, next(self._seq), plan))

    def arrivals(self) -> Iterator[Plan]:
        """Requests arriving by ``step``: new chats, then next turns, in order. While
        ``max_waiting`` requests wait, new chats are held upstream (not even generated yet), as a
        router holds requests a saturated node cannot queue: memory stays bounded when the
        workload arrives faster than the node serves it."""
        while (self.upcoming is not None and self.upcoming.arrival <= self.step
               and len(self.waiting) < self.max_waiting):
            plan, self.upcoming = self.upcoming, next(self.chats, None)
            yield plan
        while self.later and self.later[0][0] <= self.step:
            yield heapq.heappop(self.later)[2]

    def next_arrival(self) -> int | None:
        """The step of the next arrival of any kind (None: nothing more will arrive)."""
        steps = [s for s in ((self.upcoming.arrival if self.upcoming else None),
                             (self.later[0][0] if self.later else None)) if s is not None]
        return min(steps, default=None)

    def busy(self) -> bool:
        return bool(self.running or self.loading or self.draining or self.waiting)
