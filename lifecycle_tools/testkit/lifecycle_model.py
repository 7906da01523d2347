"""A bounded model check of the manager: every interleaving of scheduler-visible events, explored
by breadth-first search over abstract states, each state reached by replaying its trace on a fresh
manager (the real one, over strict doubles), with the invariants checked after every event.

Events per request: ``decode`` (a page of tokens, then ``offload_kv_cache``), ``finish`` (offload,
then finalize if nothing was enqueued), ``abort`` (finished mid-decode, finalized), ``retract``
(finalize without finishing), ``readmit`` (a released retracted request returns on a new row);
and, for the node: the landing of any outstanding copy and the completion of any outstanding
storage op (each followed by ``check_offload_progress``).

With ``Config(faults=True)`` a buggy or hostile scheduler acts too (issue 10), on every request the
manager tracks: its row moved without ``readmit`` (``move``), its row cleared (``clear``), a -1 or
an unallocated slot in what a release would free (``overalloc``), a second manager reaching for it
(``foreign``), a call made from inside a manager call (``reentrant``); and, for the node, a second
manager over the same offloader (``shared``) or over an allocator whose page is larger than the
manager's (``coarse``). Each must raise a ``LifecycleError`` and leave everything observable as it
was; the scheduler then repairs the cause, so a fault never changes the abstract state.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field

import pytest

from lifecycle import ConfigError, DecodeOffloadManager, InvalidTransition, LifecycleError, ReentrantCall, State
from lifecycle_tools.testkit.doubles import ROWS, PagedAllocator, Pools, Req, TrackingOffloader
from lifecycle_tools.testkit.model_copy import CopyableManager

RUNNING = (None, State.PREFILLED, State.INFLIGHT)


@dataclass
class Config:
    requests: int = 2
    chunks: int = 3
    page_size: int = 4
    spec: int = 0
    host_pages: int = 3
    prompt: int = 6
    aborts: bool = False
    faults: bool = False


@dataclass
class World:
    cfg: Config
    mgr: DecodeOffloadManager = None
    off: TrackingOffloader = None
    pools: Pools = None
    reqs: list = field(default_factory=list)
    chunks: list = field(default_factory=list)
    decodes: list = field(default_factory=list)
    retracted: list = field(default_factory=list)
    readmitted: list = field(default_factory=list)

    @classmethod
    def fresh(cls, cfg: Config) -> "World":
        w = cls(cfg)
        w.off = TrackingOffloader(page_size=cfg.page_size, host_pages=cfg.host_pages, auto_land=False)
        w.pools = Pools(cfg.page_size, w.off)
        w.mgr = CopyableManager(w.pools, w.pools, page_size=cfg.page_size, offloader=w.off)
        for i in range(cfg.requests):
            w.reqs.append(Req(f"r{i}", range(10 * i, 10 * i + cfg.prompt + i), w.pools.alloc_row(), spec=cfg.spec))
        w.chunks = [0] * cfg.requests
        w.decodes = [0] * cfg.requests
        w.retracted = [False] * cfg.requests
        w.readmitted = [False] * cfg.requests
        return w

    def clone(self) -> "World":
        """A deep copy that shares what the model never mutates (tensors) and copies int containers flat."""
        memo = {}
        m, off, pools = self.mgr, self.off, self.pools
        memo[id(pools.req_to_token)] = pools.req_to_token.clone()  # rows are poisoned when freed
        tensors = [*off.pending_writes.values(), *(h for h, _ in off.pending_storage.values()),
                   *(c.host for c in m._ledger.ongoing.values()), *(o.host for o in m._ledger.storage_ops.values())]
        for t in tensors:
            memo[id(t)] = t
        for flat in (pools.held_pages, pools.free_rows, off._free_pages, off._held_pages, off._landed,
                     off._stored_ops, m._ledger.landed, m._ledger.stored, m._ledger.by_state):
            memo[id(flat)] = flat.copy()
        memo[id(off.reading)] = {k: v.copy() for k, v in off.reading.items()}
        for r in self.reqs:
            memo[id(r.origin_input_ids)] = r.origin_input_ids
            memo[id(r.output_ids)] = r.output_ids.copy()
        for c in m._ledger.ongoing.values():
            memo[id(c.tokens)], memo[id(c.page_hashes)] = c.tokens, c.page_hashes
        return copy.deepcopy(self, memo)

    # --- abstract state (what dedupes interleavings that reach the same situation)
    def _ack_owner(self, ack):
        chunk = self.mgr._ledger.ongoing[ack]
        return (self.reqs.index(chunk.req), chunk.start)

    def _op_owner(self, op):
        return (self.mgr._ledger.storage_ops[op].rid, self.mgr._ledger.storage_ops[op].first_hash)

    def key(self):
        reqs = tuple(
            (str(self.mgr.state_of(r)), r.finished(), self.retracted[i], self.readmitted[i], self.decodes[i],
             len(r.output_ids), r.kv.req_pool_idx is None)
            for i, r in enumerate(self.reqs)
        )
        writes = tuple(sorted(self._ack_owner(a) for a in self.off.pending_writes))
        ops = tuple(sorted(self._op_owner(o) for o in self.off.pending_storage))
        return reqs, writes, ops, self.off.host_free_pages()

    # --- events
    def events(self):
        out = []
        for i, r in enumerate(self.reqs):
            state = self.mgr.state_of(r)
            running = state in RUNNING and not r.finished() and r.kv.req_pool_idx is not None
            if running and self.decodes[i] < self.cfg.chunks:
                out.append(("decode", i))
            if running:
                out += [("finish", i), ("retract", i)] + ([("abort", i)] if self.cfg.aborts else [])
            if state is State.RELEASED and self.retracted[i] and not self.readmitted[i] and self.pools.can_alloc():
                out.append(("readmit", i))
        if self.cfg.faults:
            out += self._fault_events()
        out += [("land", self._ack_owner(a)) for a in sorted(self.off.pending_writes)]
        out += [("store", self._op_owner(o)) for o in sorted(self.off.pending_storage)]
        return out

    def apply(self, event):
        kind, arg = event
        mgr = self.mgr
        if kind == "decode":
            req = self.reqs[arg]
            self.decodes[arg] += 1
            for _ in range(self.cfg.page_size):
                req.decode(100 + len(req.output_ids))
            if mgr.offload_kv_cache(req):
                self.chunks[arg] += 1
        elif kind in ("finish", "abort"):
            req = self.reqs[arg]
            if kind == "abort":
                req.finish()
                mgr.finalize_release_on_finish(req)
            else:
                req.finish()
                if not mgr.offload_kv_cache(req):
                    mgr.finalize_release_on_finish(req)
        elif kind == "retract":
            self.retracted[arg] = True
            mgr.finalize_release_on_finish(self.reqs[arg])
        elif kind == "readmit":
            req = self.reqs[arg]
            req.kv.req_pool_idx = self.pools.alloc_row()
            self.readmitted[arg] = True
            mgr.readmit(req)
        elif kind == "fault":
            self._apply_fault(*arg)
        elif kind == "land":
            ack = next(a for a in self.off.pending_writes if self._ack_owner(a) == arg)
            self.off.land([ack])
            mgr.check_offload_progress()
        elif kind == "store":
            op = next(o for o in self.off.pending_storage if self._op_owner(o) == arg)
            self.off.complete_storage([op])
            mgr.check_offload_progress()
        else:  # pragma: no cover
            raise AssertionError(event)

    # --- a buggy scheduler: every fault is refused with nothing changed, then repaired
    def _fault_events(self):
        out = [("fault", ("shared", None)), ("fault", ("coarse", None))]
        for i, r in enumerate(self.reqs):
            state = self.mgr.state_of(r)
            if state is not None and state is not State.RELEASED and r.kv.req_pool_idx is not None:
                out += [("fault", (kind, i)) for kind in ("move", "clear", "overalloc", "foreign", "reentrant")]
        return out

    def _apply_fault(self, kind, i):
        before = self.frozen()
        req = None if i is None else self.reqs[i]
        expected = ConfigError if kind in ("shared", "coarse") else LifecycleError
        with pytest.raises(expected):
            self._fault(kind, req)
        assert self.frozen() == before, (kind, i)

    def _fault(self, kind, req):
        mgr, pools, ps = self.mgr, self.pools, self.cfg.page_size
        if kind == "shared":
            DecodeOffloadManager(pools, pools, page_size=ps, offloader=self.off)
        elif kind == "coarse":
            DecodeOffloadManager(pools, PagedAllocator(page_size=2 * ps), page_size=ps,
                                 offloader=TrackingOffloader(page_size=ps, host_pages=1))
        elif kind == "foreign":
            other = DecodeOffloadManager(pools, pools, page_size=ps, offloader=TrackingOffloader(page_size=ps, host_pages=1))
            other.finalize_release_on_finish(req)
        elif kind == "move":
            row = req.kv.req_pool_idx
            req.kv.req_pool_idx = (row + 1) % ROWS
            try:
                mgr.finalize_release_on_finish(req)
            finally:
                req.kv.req_pool_idx = row
        elif kind == "reentrant":
            self._reentrant(req)
        else:
            self._corrupt_row(kind, req)

    def _corrupt_row(self, kind, req):
        """A release of ``req`` over a cleared row, or over a -1 / an unallocated tail slot."""
        row = self.pools.req_to_token[req.kv.req_pool_idx]
        saved = row.clone()
        if kind == "clear":
            row.zero_()
        else:
            committed, allocated = req.kv.kv_committed_len, req.kv.kv_allocated_len
            tail = -(-committed // self.cfg.page_size) * self.cfg.page_size
            free = [r for r in self.pools.free_rows if self.pools.held_pages.isdisjoint(self.pools._pages(r))]
            if tail < allocated and free:
                row[tail:allocated] = row.new_tensor(range(allocated - tail)) + free[0] * row.numel()
            else:
                row[0] = -1
        was_finished = req._finished
        req._finished = True
        try:
            self.mgr._release_finished_req(req)
        finally:
            req._finished = was_finished
            row.copy_(saved)

    def _reentrant(self, req):
        """A call into the manager from inside its own ``check_offload_progress`` is refused."""
        poll, inner = self.off.finished_writes, []

        def meddle():
            try:
                self.mgr.finalize_release_on_finish(req)
            except ReentrantCall as err:
                inner.append(err)
            return poll()

        self.off.finished_writes = meddle
        try:
            self.mgr.check_offload_progress()
        finally:
            del self.off.finished_writes
        assert len(inner) == 1
        raise inner[0]

    # --- invariants
    def frozen(self):
        m = self.mgr
        records = sorted((k, r.state.name, r.row, r.inflight, r.offload.inc_len, r.offload.last_hash)
                         for k, r in m._ledger.records.items())
        return (records, dict(m._ledger.by_state), m._ledger.released, m._ledger.leaked, m._ledger.chunks, sorted(m._ledger.ongoing),
                sorted(m._ledger.storage_ops), set(self.pools.held_pages), list(self.pools.free_rows))

    def check(self):
        """Invariants after every event; every refused call changes nothing."""
        self.mgr.check_integrity()
        for req in self.reqs:
            state = self.mgr.state_of(req)
            if req.finished():
                assert state in (State.INFLIGHT, State.FINISHED, State.RELEASED), (req.rid, state)
            rec = self.mgr._ledger.lookup(req)
            legal = (state is State.FINISHED or (state in RUNNING and req.finished())) and not (rec and rec.inflight)
            probes = []
            if not legal and state is not None:
                probes.append(self.mgr._release_finished_req)
            if state in (State.FINISHED, State.RELEASED):
                probes += [self.mgr.offload_kv_cache, self.mgr.finalize_release_on_finish]
            if state is not State.RELEASED and state is not None:
                probes.append(self.mgr.readmit)
            for probe in probes:
                before = self.frozen()
                with pytest.raises(InvalidTransition):
                    probe(req)
                assert self.frozen() == before, (probe.__name__, req.rid)
        if not self.off.pending_writes:
            for req in self.reqs:
                if req.finished() or self.mgr.state_of(req) is State.FINISHED:
                    assert self.mgr.state_of(req) is State.RELEASED, req.rid


def explore(cfg: Config, max_states: int = 200_000):
    """Breadth-first search; returns (distinct states, edges, maximal traces covered)."""
    start = World.fresh(cfg)
    start.check()
    root = start.key()
    traces = {root: ()}
    succ: dict = {}
    queue = deque([root])
    edges = 0
    live = {root: start}
    while queue:
        key = queue.popleft()
        world = live.pop(key)
        trace = traces[key]
        succ[key] = []
        for event in world.events():
            w = world.clone()
            w.apply(event)
            k = w.key()
            edges += 1
            if k != key:  # a refused fault loops back: not a step of a maximal trace
                succ[key].append(k)
            if k not in traces:
                w.check()
                traces[k] = trace + (event,)
                live[k] = w
                queue.append(k)
                assert len(traces) <= max_states, "state space larger than the bound"
        if not succ[key]:
            _final_checks(world)
    paths: dict = {}
    for key in reversed(list(traces)):
        nxt = succ[key]
        paths[key] = 1 if not nxt else sum(paths.get(k, 0) for k in nxt)
    return len(traces), edges, paths[root]


def _final_checks(world: World) -> None:
    """A quiescent state: nothing in flight, every finished request released, memory balanced."""
    assert world.mgr.idle() and world.off.host_free_pages() == world.cfg.host_pages
    for req in world.reqs:
        if req.finished() or world.mgr.state_of(req) in (State.FINISHED,):
            assert world.mgr.state_of(req) is State.RELEASED
