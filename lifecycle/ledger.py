"""The ledger: the one owner of a manager's bookkeeping.

Everything the manager knows about its requests and their work lives here, and only the methods
below change it: the records (one per live request, keyed by the request's identity, held weakly),
the copies in flight (issue order), the storage ops in flight, the completions reported but not
settled, the quarantine of expired copies, the per-slot read counts (``SlotsInFlight``), the
device-side release checks not yet read, and every counter. One request's truth is its ``Record``
plus the entries of these tables that point to it; the readers (``stats``, ``pending``, ``check``,
``snapshot``) read it from here.

The ledger does bookkeeping only: it never calls the offloader, the pools or the machine, and it
logs nothing. Its methods return what the caller must act on (the chunk that landed, the records
whose last copy ended, the leaked records); the manager and ``lifecycle.settle`` do the work and
emit the audit events.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque

import msgspec

from lifecycle.errors import IntegrityError
from lifecycle.records import Chunk, Quarantine, Record, RecordView, ReleaseCheck, Stats, StorageOp
from lifecycle.slots import PageNames, SlotsInFlight
from lifecycle.states import State
from transfer.gather import ids_verdict
from transfer.indices import as_tensor, on_host

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


class Settlement(msgspec.Struct, gc=False):
    """What one progress check settles, in order (``Ledger.settleable``): expired copies that
    finally ended, copies landed (issue order), storage ops finished, and ids never issued."""

    ended: list
    acks: list
    ops: list
    unknown: list


class Ledger:
    """A manager's bookkeeping (see the module docstring). Attributes are read by the manager's
    modules and by tests; they are written only by the methods of this class.

    Args:
        owners: the process's ownership registry (``lifecycle.table.OWNERS``): a dropped request's
            claim is forgotten by the records' weak-reference callback.
        logger: the manager's logger, kept by each record (``Record.log`` binds it).
    """

    def __init__(self, owners, logger) -> None:
        from lifecycle.table import drop_callback  # table imports records only; no cycle at use

        self.records: dict[int, Record] = {}
        self.dropped: deque = deque()
        self.on_drop = drop_callback(self.dropped, owners)  # every record's ref callback
        self.logger = logger
        self.ongoing: dict[int, Chunk] = {}  # ack id -> copy in flight, in issue order
        self.storage_ops: dict[int, StorageOp] = {}  # op id -> storage write in flight, in issue order
        self.landed: set[int] = set()   # reported by the offloader, not yet settled
        self.stored: set[int] = set()
        self.failed: set[int] = set()   # landed acks whose copy failed (never stored)
        self.expiring: list[int] = []   # reported expired by the offloader, not yet settled
        self.expired: dict[int, Quarantine] = {}  # copies past their deadline, maybe still reading
        self.reading = SlotsInFlight()  # per device slot: copies (expired ones too) still reading it
        self.names = PageNames()  # per device page: the page name a live request offloaded it under
        self.holders: dict[int, Record] = {}  # serial -> record, for the live (not RELEASED) lifecycles
        self._serials = itertools.count(1)
        self.release_checks: deque = deque()  # ReleaseCheck of released device rows, read by progress checks
        self._ack_ids = itertools.count(1)
        self.by_state = dict.fromkeys(State.__members__, 0)
        self.by_event: dict[str, int] = {}  # state changes by trigger
        self.refusals: dict[str, int] = {}  # refused calls by "TRIGGER in STATE"
        self.released = self.leaked = self.host_short = 0
        self.chunks = self.pages = self.chunks_landed = self.storage_finished = 0
        self.copies_expired = self.copy_failures = 0
        self.abandoned = 0  # copies + storage ops a forced shutdown's bound cut off
        self.bad_release_rows = 0
        self.host_short_warned_at, self.host_short_since_warning = None, 0

    # --- records -----------------------------------------------------------------------------------

    def lookup(self, req) -> Record | None:
        """The live record of ``req`` (None when never seen, or a dropped object whose id was reused)."""
        rec = self.records.get(id(req))
        return rec if rec is not None and rec.ref() is req else None

    def new_record(self, req, view, progress) -> Record:
        """A PREFILLED record for a request read by ``read_request``; not yet inserted."""
        ref = weakref.KeyedRef(req, self.on_drop, id(req))
        row, _, allocated = view
        return Record(ref, req.rid, row, _PREFILLED, progress, self.logger, slots=allocated,
                      serial=next(self._serials))

    def insert(self, rec: Record, req) -> Record | None:
        """Start tracking ``rec``. Returns the leaked record it replaced (a dropped request with the
        same id, not released), for the caller to report."""
        old = self.records.get(id(req))
        leaked = self.retire(old) if old is not None else None
        self.records[id(req)] = rec
        self.holders[rec.serial] = rec
        self.by_state["PREFILLED"] += 1
        return leaked

    def drain_dropped(self) -> list[Record]:
        """Retire the records of requests the scheduler dropped; returns those that leaked."""
        dropped, leaked = self.dropped, []
        while dropped:
            ref = dropped.popleft()
            rec = self.records.get(ref.key)
            if rec is not None and rec.ref is ref and self.retire(rec) is not None:
                leaked.append(rec)
        return leaked

    def retire(self, rec: Record) -> Record | None:
        """Forget a record whose request was dropped; returns it when it leaked (not released)."""
        del self.records[rec.ref.key]
        self.holders.pop(rec.serial, None)
        self.by_state[rec.state.name] -= 1
        if rec.state is _RELEASED:
            return None
        self.leaked += 1
        return rec

    def allocated(self, rec: Record, slots: int) -> None:
        """The request holds ``slots`` KV slots now (named by the leak report if it is dropped)."""
        rec.slots = slots

    def transition(self, source: str, dest: str, trigger: str) -> None:
        """A state change (the machine's ``before_state_change``): per-state and per-trigger counts."""
        by_state = self.by_state
        by_state[source] -= 1
        by_state[dest] += 1
        self.by_event[trigger] = self.by_event.get(trigger, 0) + 1

    def restart(self, rec: Record, view, progress) -> None:
        """``readmit``: a new lifecycle of ``rec`` on the new row, with fresh offload progress."""
        row, _, allocated = view
        rec.row, rec.offload, rec.slots = row, progress, allocated
        rec.generation += 1
        rec.serial = next(self._serials)  # the pages the old lifecycle held are not this one's
        self.holders[rec.serial] = rec

    def count_refusal(self, trigger: str, state: str) -> None:
        """A refused call (``InvalidTransition``), by ``"TRIGGER in STATE"`` (bounded keys)."""
        key = f"{trigger} in {state}"
        self.refusals[key] = self.refusals.get(key, 0) + 1

    def note_host_short(self, now: float, every_s: float) -> int | None:
        """Host memory was short for a chunk: counted. Returns the refusals since the last warning
        when one is due (at most one per ``every_s``), else None."""
        self.host_short += 1
        self.host_short_since_warning += 1
        last = self.host_short_warned_at
        if last is None or now - last >= every_s:
            n, self.host_short_warned_at, self.host_short_since_warning = self.host_short_since_warning, now, 0
            return n
        return None

    # --- copies ------------------------------------------------------------------------------------

    def next_ack(self) -> int:
        """The ack id of the next copy."""
        return next(self._ack_ids)

    def commit(self, rec: Record, chunk: Chunk) -> None:
        """A chunk was enqueued: in flight (its slots counted as read), the request's progress and
        chain tail advanced."""
        self.ongoing[chunk.ack_id] = chunk
        self.reading.add(chunk.ack_id, chunk.indices)
        if self.names.planned is not None:
            self.names.add(chunk.indices)
        rec.inflight += 1
        rec.offload.inc_len += chunk.end - chunk.start
        rec.offload.last_hash = chunk.page_hashes[-1]
        self.chunks += 1
        self.pages += len(chunk.page_hashes)

    def collect(self, landed, failed, stored, expired=()) -> None:
        """Completions the offloader reported (``failed``: a subset of ``landed``; ``expired``:
        copies past their deadline, settled first by the next progress check), not settled."""
        self.landed.update(landed)
        if failed:
            self.failed.update(failed)
        if expired:
            self.expiring.extend(expired)
        self.stored.update(stored)

    def take_expiring(self) -> list[int]:
        """The expiries collected and not yet settled, in report order (the list is emptied)."""
        out, self.expiring = self.expiring, []
        return out

    def expire(self, ack: int) -> Chunk | None:
        """The copy ``ack`` passed its deadline: no longer in flight, its slots quarantined (still
        counted as read) until it ends. Returns its chunk (None: not in flight)."""
        chunk = self.ongoing.pop(ack, None)
        if chunk is None:
            return None
        rec = chunk.rec
        rec.inflight -= 1
        self.copies_expired += 1
        self.expired[ack] = Quarantine(ack, rec.rid, chunk.host, as_tensor(chunk.indices))  # freed through the allocator: a tensor
        rec.expired = (rec.expired or ()) + (ack,)
        return chunk

    def settleable(self, agree=None) -> Settlement:
        """Take what a progress check settles: expired copies that ended, landed copies in issue
        order, finished storage ops, and the ids never issued (dropped from the unsettled sets).
        ``agree(n_acks, n_ops)``: with a TP group, the counts every rank acts on (then only the
        prefix of work in issue order that completed is taken)."""
        landed, stored = self.landed, self.stored
        ended = []
        if self.expired:
            for ack in [a for a in landed if a in self.expired]:
                landed.discard(ack)
                self.failed.discard(ack)
                ended.append(self.expired.pop(ack))
        unknown = []  # one C-level subset test each on the common path (every id known)
        if not self.ongoing.keys() >= landed or not self.storage_ops.keys() >= stored:
            unknown = [("ack", a) for a in landed if a not in self.ongoing]
            unknown += [("op", o) for o in stored if o not in self.storage_ops]
            for kind, i in unknown:
                (landed if kind == "ack" else stored).discard(i)
        if agree is None:  # landings in issue order, each after its request's earlier chunks: chain order
            acks, ops = _in_chain_order(self.ongoing, landed), list(stored)
        else:
            acks, ops = _done_prefix(self.ongoing, landed), _done_prefix(self.storage_ops, stored)
            n_acks, n_ops = agree(len(acks), len(ops))
            acks, ops = acks[:n_acks], ops[:n_ops]
        return Settlement(ended, acks, ops, unknown)

    def land(self, ack: int) -> tuple[Chunk, bool]:
        """The copy ``ack`` landed: no longer in flight, its slots no longer read by it. Returns its
        chunk and whether the copy failed (its pages must not be stored)."""
        self.landed.discard(ack)
        chunk = self.ongoing.pop(ack)
        chunk.rec.inflight -= 1
        self.reading.remove(ack)
        self.chunks_landed += 1
        failed = ack in self.failed
        if failed:
            self.failed.discard(ack)
            self.copy_failures += 1
        return chunk, failed

    def end_expired(self, q: Quarantine) -> None:
        """An expired copy finally ended (taken by ``settleable``): its slots are no longer read."""
        self.reading.remove(q.ack_id)

    def disown(self, acks) -> int:
        """``DecodeOffloadManager.disown_expired_copies``: these expired copies' slots are no longer
        the manager's (not freed when they end, not guarded). Returns how many were disowned."""
        n = 0
        for ack in acks:
            q = self.expired.get(ack)
            if q is not None and not q.disowned:
                q.released, q.disowned = False, True
                self.reading.remove(ack)
                n += 1
        return n

    def quarantined_of(self, rec: Record) -> list:
        """The slot tensors ``rec``'s expired copies may still read (not yet ended)."""
        return [self.expired[a].slots for a in rec.expired or () if a in self.expired]

    def released_rec(self, rec: Record, freed) -> None:
        """``rec`` was released (``freed``: what the release sink returned; False: it freed nothing,
        its owner frees). Its quarantined slots are freed when their copies end; the device pages
        it held are nobody's now."""
        self.holders.pop(rec.serial, None)  # the device pages it held are nobody's (PageNames)
        for ack in rec.expired or ():
            q = self.expired.get(ack)
            if q is not None and freed is not False and not q.disowned:
                q.released = True
        rec.expired = None
        self.released += 1

    # --- storage -----------------------------------------------------------------------------------

    def add_storage_op(self, op: StorageOp) -> None:
        """A landed chunk's storage write was submitted."""
        self.storage_ops[op.op_id] = op

    def finish_storage(self, op_id: int) -> StorageOp:
        """The storage op ``op_id`` finished (either way)."""
        self.stored.discard(op_id)
        self.storage_finished += 1
        return self.storage_ops.pop(op_id)

    def abandon(self, n: int) -> None:
        """``shutdown(force=True)`` abandoned ``n`` copies and storage ops."""
        self.abandoned += n

    # --- device-side release checks ----------------------------------------------------------------

    def queue_release_check(self, check: ReleaseCheck) -> int:
        """Keep a released device row's check until a progress check reads it. Returns how many
        are kept unread (the caller bounds them: ``read_release_checks``, ``drop_oldest_checks``)."""
        self.release_checks.append(check)
        return len(self.release_checks)

    def read_release_checks(self) -> list[tuple[ReleaseCheck, dict]]:
        """Take the checks whose verdict has landed (the event queried, never waited for; off CUDA at
        once); returns the bad ones with what was found (counted in ``bad_release_rows``). Checks
        not landed stay, in order."""
        checks, bad = self.release_checks, []
        for _ in range(len(checks)):
            c = checks.popleft()
            if c.event is not None and not c.event.query():
                checks.append(c)  # not landed yet: read by a later call (order kept)
                continue
            found = ids_verdict(c.verdict)
            if found is not None:
                self.bad_release_rows += 1
                bad.append((c, found))
        return bad

    def drop_oldest_checks(self, keep: int) -> int:
        """Drop unread checks beyond the newest ``keep``; returns how many were dropped."""
        drop = max(0, len(self.release_checks) - keep)
        for _ in range(drop):
            self.release_checks.popleft()
        return drop

    # --- readers -----------------------------------------------------------------------------------

    def copies_of(self, rec: Record) -> list[int]:
        """Ack ids of ``rec``'s copies in flight (issue order); a copy reported landed is not (one
        waiting for its predecessor to land, before its storage write, included)."""
        if not rec.inflight:
            return []
        landed = self.landed
        return [ack for ack, chunk in self.ongoing.items() if chunk.rec is rec and ack not in landed]

    def idle(self) -> bool:
        """No copy and no storage op in flight and nothing awaits settling."""
        return not (self.ongoing or self.storage_ops or self.landed or self.stored or self.expired)

    def quarantined_slots(self) -> int:
        return sum(q.slots.numel() for q in list(self.expired.values()))

    def stats(self) -> Stats:
        """Counters. ``tracked`` counts live requests not yet RELEASED."""
        by_state = dict(self.by_state)
        return Stats(
            tracked=sum(by_state.values()) - by_state["RELEASED"],
            inflight_writes=len(self.ongoing),
            inflight_storage=len(self.storage_ops),
            released=self.released,
            leaked=self.leaked,
            by_state=by_state,
            chunks_enqueued=self.chunks,
            pages_enqueued=self.pages,
            chunks_landed=self.chunks_landed,
            storage_finished=self.storage_finished,
            host_short=self.host_short,
            copies_expired=self.copies_expired,
            copy_failures=self.copy_failures,
            quarantined_slots=self.quarantined_slots(),
            unsettled=len(self.landed) + len(self.stored),
            transitions=dict(self.by_event),
            abandoned=self.abandoned,
            bad_release_rows=self.bad_release_rows,
        )

    def pending(self) -> Pending:
        """What the manager waits on, from the tables (nothing is polled or settled)."""
        landed = self.landed
        by_rec: dict[int, list] = {}
        for ack, c in self.ongoing.items():
            by_rec.setdefault(id(c.rec), []).append(ack)
        finished = {id(c.rec) for c in self.ongoing.values() if c.rec.state is _FINISHED}
        on_settled = sum(1 for key in finished if all(a in landed for a in by_rec[key]))
        return Pending(
            copies=sum(1 for a in self.ongoing if a not in landed),
            unsettled=len(landed) + len(self.stored),
            storage_ops=len(self.storage_ops),
            quarantined_slots=sum(q.slots.numel() for q in self.expired.values()),
            finished_waiting=len(finished),
            finished_waiting_on_settled=on_settled,
        )

    def snapshot(self) -> bytes:
        """All live records, msgpack-encoded (``RecordView`` list), for debugging."""
        views = [
            RecordView(str(r.rid), r.state.name, r.row, r.inflight, r.offload.inc_len, r.offload.last_hash,
                       r.generation)
            for r in list(self.records.values())
            if r.ref() is not None
        ]
        return msgspec.msgpack.encode(views)

    def check(self) -> None:
        """Verify the tables agree.

        Raises:
            IntegrityError: listing every disagreement found.
        """
        problems = []
        per_rec: dict[int, int] = {}
        for ack, chunk in self.ongoing.items():
            per_rec[id(chunk.rec)] = per_rec.get(id(chunk.rec), 0) + 1
            if chunk.rec.state not in (_INFLIGHT, _FINISHED):
                problems.append(f"ack {ack} in flight for {chunk.rec.rid!r} in {chunk.rec.state.name}")
        counts = dict.fromkeys(State.__members__, 0)
        for rec in list(self.records.values()):
            counts[rec.state.name] += 1
            problems += _record_problems(rec, per_rec.pop(id(rec), 0))
        if per_rec:
            problems.append(f"{sum(per_rec.values())} in-flight chunks belong to no live record")
        if counts != self.by_state:
            problems.append(f"state counters {self.by_state} disagree with records {counts}")
        reads = (sum(c.indices.shape[0] for c in self.ongoing.values() if on_host(c.indices))  # device ids: not counted
                 + sum(q.slots.numel() for q in self.expired.values() if on_host(q.slots) and not q.disowned))
        if self.reading.total() != reads:
            problems.append(f"{self.reading.total()} slot reads counted, but copies in flight read {reads} slots")
        if problems:
            raise IntegrityError("; ".join(problems))

    def reader_of(self, slot: int) -> str:
        """Who reads ``slot``: the copy in flight or the expired copy (rare path: a refusal)."""
        ack = self.reading.reader(slot)
        chunk = self.ongoing.get(ack)
        if chunk is not None:
            return f"a copy in flight of request {chunk.rec.rid!r} (ack {ack}, tokens [{chunk.start}, {chunk.end}))"
        q = self.expired.get(ack)
        if q is not None:
            return f"an expired copy of request {q.rid!r} (ack {ack}, slots quarantined)"
        return "a copy in flight"


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


def _in_chain_order(ongoing: dict, landed: set) -> list:
    """The landed acks of ``ongoing`` in issue order, leaving out each one an earlier chunk of the
    same request is still in flight before (it waits for that one to land, fail or expire: its
    pages are never stored, and announced, before their parent)."""
    if len(landed) == len(ongoing):
        return list(ongoing)  # all landed (the usual case): issue order is chain order
    acks, waiting = [], None
    for ack, chunk in ongoing.items():
        if ack in landed:
            if waiting is None or id(chunk.rec) not in waiting:
                acks.append(ack)
        else:
            if waiting is None:
                waiting = set()
            waiting.add(id(chunk.rec))
    return acks


def _done_prefix(table: dict, done: set) -> list:
    """Keys of ``table`` (in issue order) up to the first one not in ``done``."""
    prefix = []
    for key in table:
        if key not in done:
            break
        prefix.append(key)
    return prefix
