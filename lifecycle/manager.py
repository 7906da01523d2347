"""``DecodeOffloadManager``: the scheduler-facing lifecycle of a decode node's KV cache.

A drop-in for SGLang 0.5.19's ``DecodeKVCacheOffloadManager``. The scheduler calls it; it decides
and records; the ``Offloader`` it was given moves the bytes. Every state change goes through the
module-level machine (``lifecycle.machine``); the per-step fast path fires nothing.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
import weakref
from collections import deque

import msgspec
import torch

from hashing import page_hashes
from lifecycle import audit
from lifecycle.errors import (
    ConfigError,
    IntegrityError,
    InvalidRequest,
    InvalidTransition,
    LifecycleError,
    ManagerClosed,
    UnknownCompletion,
)
from lifecycle.log import get_logger
from lifecycle.machine import EVENTS
from lifecycle.records import (
    Chunk,
    OffloadedState,
    Quarantine,
    Record,
    RecordView,
    Stats,
    StorageOp,
)
from lifecycle.states import State

_PREFILLED, _OFFLOADING, _INFLIGHT = State.PREFILLED, State.OFFLOADING, State.INFLIGHT
_FINISHED, _RELEASED = State.FINISHED, State.RELEASED
_OFFLOADER_METHODS = ("write", "finished_writes", "write_storage", "finished_storage", "free_host")


def _positive_int(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{what} must be a positive int, got {value!r}")
    return value


class DecodeOffloadManager:
    """Offload decode KV page by page, release every slot exactly once, never under a copy.

    Args:
        req_to_token_pool: has ``.req_to_token`` (2-D int tensor ``[rows, max_len]``) and
            ``.free(req)`` which frees ``req``'s row.
        token_to_kv_pool_allocator: has ``.free(indices)``; a paged allocator frees the pages the
            slots lie on (its ``page_size`` attribute, when present, aligns the over-allocation).
        page_size: tokens per page (the hash chain's page).
        offloader: a ``transfer.Offloader``.
        offload_stride: tokens per chunk; None means ``page_size``, else a positive page multiple.
        namespace_seed: optional prior hash (64 hex) of every request's first page.
        tp_group: optional ``torch.distributed`` group; ranks agree on completion counts.
        clock: time source for latencies in the audit log.
    Raises:
        ConfigError: bad page size, stride, seed, or pools/offloader missing required methods.
    """

    def __init__(
        self,
        req_to_token_pool,
        token_to_kv_pool_allocator,
        page_size: int = 16,
        offloader=None,
        offload_stride: int | None = None,
        namespace_seed: str | None = None,
        tp_group=None,
        *,
        clock=time.monotonic,
    ) -> None:
        self.page_size = _positive_int(page_size, "page_size")
        stride = page_size if offload_stride is None else _positive_int(offload_stride, "offload_stride")
        if stride % page_size:
            raise ConfigError(f"offload_stride {stride} is not a multiple of page_size {page_size}")
        self.offload_stride = stride
        if namespace_seed is not None:
            try:
                page_hashes([], 1, namespace_seed)
            except ValueError as err:
                raise ConfigError(f"namespace_seed: {err}") from None
        self.namespace_seed = namespace_seed
        rows = getattr(req_to_token_pool, "req_to_token", None)
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
            raise ConfigError("req_to_token_pool.req_to_token must be a 2-D tensor")
        if rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool:
            raise ConfigError(f"req_to_token_pool.req_to_token must hold integer slots, not {rows.dtype}")
        if not callable(getattr(req_to_token_pool, "free", None)):
            raise ConfigError("req_to_token_pool has no free(req)")
        if not callable(getattr(token_to_kv_pool_allocator, "free", None)):
            raise ConfigError("token_to_kv_pool_allocator has no free(indices)")
        if offloader is None:
            raise ConfigError("no offloader: pass offloader=, or use DecodeOffloadManager.from_stack(build_stack(...))")
        missing = [m for m in _OFFLOADER_METHODS if not callable(getattr(offloader, m, None))]
        if missing:
            raise ConfigError(f"offloader lacks {', '.join(missing)}")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.offloader = offloader
        self.tp_group = tp_group
        self._alloc_page = getattr(token_to_kv_pool_allocator, "page_size", None) or 1
        self._clock = clock
        self._log = get_logger("lifecycle")  # routes per call: configuring logging later takes effect
        self._debug = False  # refreshed at the start of every call that may log (one level check)

        self._records: dict[int, Record] = {}
        self._dropped: deque = deque()
        self._ongoing: dict[int, Chunk] = {}
        self._storage_ops: dict[int, StorageOp] = {}
        self._landed: set[int] = set()   # reported by the offloader, not yet settled
        self._stored: set[int] = set()
        self._failed: set[int] = set()   # landed acks whose copy failed (never stored)
        self._expired: dict[int, Quarantine] = {}  # copies past their deadline, maybe still reading
        self._poll_expired = getattr(offloader, "expired_writes", None)
        self._poll_failed = getattr(offloader, "failed_writes", None)
        self._ack_ids = itertools.count(1)
        self._by_name = dict.fromkeys(State.__members__, 0)
        self._released = self._leaked = self._host_short = 0
        self._chunks = self._pages = self._chunks_landed = self._storage_finished = 0
        self._copies_expired = self._copy_failures = 0
        self._closed = False
        self._fire = {name: event.trigger for name, event in EVENTS.items()}

    @classmethod
    def from_stack(cls, stack, *, offload_stride: int | None = None, namespace_seed: str | None = None,
                   tp_group=None) -> "DecodeOffloadManager":
        """A manager over a ``transfer.build_stack`` stack: its pools and its ``HostOffloader``."""
        return cls(
            stack.req_to_token_pool, stack.allocator, page_size=stack.host_pool.page_size,
            offloader=stack.offloader, offload_stride=offload_stride,
            namespace_seed=namespace_seed, tp_group=tp_group,
        )

    # --- the scheduler's calls -------------------------------------------------------------------

    def offload_kv_cache(self, req) -> bool:
        """Enqueue the request's next full chunk of KV, if any. Call after every decode step.

        Returns:
            True when a chunk was enqueued; False when there is no full chunk yet, the request has
            no row or no output, or host memory is short.
        Raises:
            InvalidTransition: the request was finalized or released.
            InvalidRequest: not SGLang-shaped, or a chunk with uncommitted KV, inconsistent lengths
                or a row changed without ``readmit`` (checked before anything changes).
            TokenRangeError: a token id of the chunk is not an int in 0..2**32-1.
            ManagerClosed: after ``shutdown``.
        """
        rec = self._records.get(id(req))
        if rec is None or rec.ref() is not req:
            rec = self._first_sight(req)
            if rec is None:
                return False
        state = rec.state
        if state is not _PREFILLED and state is not _INFLIGHT:
            self._refuse(rec, "offload", "the request was finalized or released")
        n_out = len(req.output_ids)
        if n_out == 0:
            return False
        rec.slots = req.kv.kv_allocated_len  # for the leak report, should the request be dropped
        n_in = len(req.origin_input_ids)
        prefill = n_in - n_in % self.page_size          # derived, never stored
        new = n_in + n_out - 1 - prefill - rec.offload.inc_len
        if new < self.offload_stride:
            return False
        self._debug = self._log.is_enabled_for(logging.DEBUG)
        chunk = self._plan_chunk(rec, req, new - new % self.offload_stride)
        before = rec.offload.inc_len
        self._fire["offload"](rec, mgr=self, req=req, chunk=chunk)
        return rec.offload.inc_len != before

    def check_offload_progress(self) -> None:
        """Settle landed copies and finished storage ops; release finished requests. Never blocks.

        With a ``tp_group``, ranks first agree (MIN across ranks) on how many completions to act
        on, counted as the prefix of work in issue order that has completed, and act on exactly
        those: every rank settles the same copies in the same order, whatever order they landed
        in locally. Without one, every completion reported so far is settled.

        Raises:
            UnknownCompletion: the offloader reported an id never issued (after settling the rest).
        """
        self._check_open()
        self._debug = self._log.is_enabled_for(logging.DEBUG)
        self._drain_dropped()
        landed, stored = self._landed, self._stored
        if self._poll_expired is not None:
            for ack in self._poll_expired():
                chunk = self._ongoing.pop(ack, None)
                if chunk is not None:
                    self._on_expired(chunk)
        landed.update(self.offloader.finished_writes())
        if self._poll_failed is not None:   # a subset of what finished_writes just reported
            self._failed.update(self._poll_failed())
        stored.update(self.offloader.finished_storage())
        for ack in [a for a in landed if a in self._expired]:
            landed.discard(ack)
            self._failed.discard(ack)
            self._on_expired_ended(self._expired.pop(ack))
        unknown = [("ack", a) for a in landed if a not in self._ongoing]
        unknown += [("op", o) for o in stored if o not in self._storage_ops]
        for kind, i in unknown:
            (landed if kind == "ack" else stored).discard(i)
        if self.tp_group is None:
            acks, ops = list(landed), list(stored)
        else:
            acks, ops = _done_prefix(self._ongoing, landed), _done_prefix(self._storage_ops, stored)
            n_writes, n_stored = self._agree(len(acks), len(ops))
            acks, ops = acks[:n_writes], ops[:n_stored]
        for ack in acks:
            landed.discard(ack)
            self._on_landed(self._ongoing.pop(ack))
        for op_id in ops:
            stored.discard(op_id)
            self._on_stored(self._storage_ops.pop(op_id))
        if unknown:
            raise UnknownCompletion(f"offloader reported ids never issued or already settled: {unknown}")

    def finalize_release_on_finish(self, req) -> None:
        """The request is done (finished, aborted, retracted): release now, or when its copies land.

        Raises:
            InvalidTransition: the request was already finalized or released.
            InvalidRequest: it has no row, or inconsistent lengths.
        """
        self._check_open()
        self._debug = self._log.is_enabled_for(logging.DEBUG)
        rec = self._lookup(req)
        fresh = rec is None
        if fresh:
            _check_shape(req)
            rec = self._new_record(req)
        elif rec.state is not _PREFILLED and rec.state is not _INFLIGHT:
            self._refuse(rec, "finish", "the request was already finalized or released")
        self._release_ranges(req)
        if fresh:
            self._insert(rec, req)
        self._fire["finish"](rec, mgr=self, req=req)
        if rec.inflight == 0:
            self._release_finished_req(req)

    def _release_finished_req(self, req) -> None:
        """The one free path: free ``[0, committed)``, the over-allocation, then the row.

        Allowed for a request that is FINISHED (finalized) or whose ``finished()`` is true, with
        no copy in flight; it is finished first when needed.

        Raises:
            InvalidTransition: copies in flight, not finished nor finalized, or already released.
            InvalidRequest: no row, or inconsistent lengths.
        """
        self._check_open()
        self._debug = self._log.is_enabled_for(logging.DEBUG)
        rec = self._lookup(req)
        fresh = rec is None
        if fresh:
            _check_shape(req)
            if not req.finished():
                raise self._refusal(
                    getattr(req, "rid", None), "release", "UNSEEN",
                    "the request is neither finished nor finalized",
                )
            rec = self._new_record(req)
        state = rec.state
        if state is _RELEASED:
            self._refuse(rec, "release", "already released")
        if state is _OFFLOADING:
            self._refuse(rec, "release", "an offload of this request is in progress")
        if rec.inflight:
            self._refuse(rec, "release", f"{rec.inflight} copies still in flight")
        if state is not _FINISHED and not req.finished():
            self._refuse(rec, "release", "the request is neither finished nor finalized")
        self._release_ranges(req)
        if fresh:
            self._insert(rec, req)
        if state is not _FINISHED:
            self._fire["finish"](rec, mgr=self, req=req)
        self._fire["release"](rec, mgr=self, req=req)

    def readmit(self, req) -> None:
        """A RELEASED (e.g. retracted) request returns with a new row: start a new lifecycle.

        Raises:
            InvalidTransition: the request is not RELEASED (or was never seen).
            InvalidRequest: it has no valid row.
        """
        self._check_open()
        self._debug = self._log.is_enabled_for(logging.DEBUG)
        rec = self._lookup(req)
        if rec is None:
            raise self._refusal(getattr(req, "rid", None), "readmit", "UNSEEN", "the request was never seen")
        if rec.state is not _RELEASED:
            self._refuse(rec, "readmit", "only a RELEASED request can be readmitted")
        row = self._row_of(req)
        progress = self._initial_progress(req)
        self._fire["readmit"](rec, mgr=self, req=req, row=row, progress=progress)

    def state_of(self, req) -> State | None:
        """The request's state, or None for a request this manager has never seen."""
        rec = self._lookup(req)
        return None if rec is None else rec.state

    def progress_of(self, req) -> OffloadedState | None:
        """A copy of the request's offload progress (``inc_len``, ``last_hash``), or None."""
        rec = self._lookup(req)
        return None if rec is None else msgspec.structs.replace(rec.offload)

    def stats(self) -> Stats:
        """Counters. ``tracked`` counts live requests not yet RELEASED."""
        self._drain_dropped()
        by_state = dict(self._by_name)
        return Stats(
            tracked=sum(by_state.values()) - by_state["RELEASED"],
            inflight_writes=len(self._ongoing),
            inflight_storage=len(self._storage_ops),
            released=self._released,
            leaked=self._leaked,
            by_state=by_state,
            chunks_enqueued=self._chunks,
            pages_enqueued=self._pages,
            chunks_landed=self._chunks_landed,
            storage_finished=self._storage_finished,
            host_short=self._host_short,
            copies_expired=self._copies_expired,
            copy_failures=self._copy_failures,
            quarantined_slots=sum(q.slots.numel() for q in self._expired.values()),
        )

    def idle(self) -> bool:
        """True when no copy and no storage op is in flight."""
        return not (self._ongoing or self._storage_ops or self._landed or self._stored or self._expired)

    def snapshot(self) -> bytes:
        """All live records, msgpack-encoded (``RecordView`` list), for debugging."""
        views = [
            RecordView(str(r.rid), r.state.name, r.row, r.inflight, r.offload.inc_len,
                       r.offload.last_hash, r.generation)
            for r in list(self._records.values())
            if r.ref() is not None
        ]
        return msgspec.msgpack.encode(views)

    def check_integrity(self) -> None:
        """Verify the tables agree. Call from tests and idle paths.

        Raises:
            IntegrityError: listing every disagreement found.
        """
        problems = []
        per_rec: dict[int, int] = {}
        for ack, chunk in self._ongoing.items():
            per_rec[id(chunk.rec)] = per_rec.get(id(chunk.rec), 0) + 1
            if chunk.rec.state not in (_INFLIGHT, _FINISHED):
                problems.append(f"ack {ack} in flight for {chunk.rec.rid!r} in {chunk.rec.state.name}")
        counts = dict.fromkeys(State.__members__, 0)
        for rec in list(self._records.values()):
            counts[rec.state.name] += 1
            n = per_rec.pop(id(rec), 0)
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
        if per_rec:
            problems.append(f"{len(per_rec)} in-flight chunks belong to no live record")
        if counts != self._by_name:
            problems.append(f"state counters {self._by_name} disagree with records {counts}")
        if problems:
            raise IntegrityError("; ".join(problems))

    def shutdown(self, force: bool = False) -> None:
        """Stop accepting calls and release the offloader's resources.

        Raises:
            LifecycleError: copies or storage ops are still in flight (unless ``force``).
        """
        if self._closed:
            return
        if not force and not self.idle():
            raise LifecycleError(
                f"shutdown with {len(self._ongoing)} copies and {len(self._storage_ops)} storage ops in flight"
            )
        self._closed = True
        self.offload_kv_cache = self._closed_call  # shadows the method: no check on the fast path
        close = getattr(self.offloader, "close", None)
        if callable(close):
            close()

    def __deepcopy__(self, memo) -> "DecodeOffloadManager":
        """An independent copy of the manager and everything it refers to, requests included.

        Records are re-keyed to the copied requests (they are keyed by identity, weakly), so a copy
        can be driven on its own: used to explore what-if orderings (lifecycle_tools/testkit/lifecycle_model.py).
        The logger, clock, TP group and machine are shared.
        """
        new = object.__new__(type(self))
        memo[id(self)] = new
        shared = {"_log", "_clock", "tp_group", "_fire", "_records", "_dropped"}
        new._log, new._clock, new.tp_group, new._fire = self._log, self._clock, self.tp_group, self._fire
        new._dropped = deque()
        new._records = {}
        for rec in list(self._records.values()):
            req = rec.ref()
            if req is None:
                continue
            twin = copy.deepcopy(req, memo)
            clone = msgspec.structs.replace(
                rec, ref=weakref.KeyedRef(twin, new._dropped.append, id(twin)),
                offload=msgspec.structs.replace(rec.offload),
            )
            memo[id(rec)] = clone
            new._records[id(twin)] = clone
        for key, value in self.__dict__.items():
            if key not in shared:
                new.__dict__[key] = copy.deepcopy(value, memo)
        return new

    # --- records -----------------------------------------------------------------------------------

    def _lookup(self, req) -> Record | None:
        rec = self._records.get(id(req))
        return rec if rec is not None and rec.ref() is req else None

    def _first_sight(self, req) -> Record | None:
        _check_shape(req)
        row = req.kv.req_pool_idx
        if row is None or row == -1 or len(req.output_ids) == 0:
            return None
        rec = self._new_record(req)
        self._insert(rec, req)
        return rec

    def _row_of(self, req) -> int:
        row = getattr(getattr(req, "kv", None), "req_pool_idx", None)
        if not isinstance(row, int) or isinstance(row, bool) or row < 0:
            raise InvalidRequest(f"request {getattr(req, 'rid', None)!r} has no req_to_token row ({row!r})")
        n_rows = self.req_to_token_pool.req_to_token.shape[0]
        if row >= n_rows:
            raise InvalidRequest(f"request {req.rid!r}: row {row} is outside the pool's {n_rows} rows")
        return row

    def _initial_progress(self, req) -> OffloadedState:
        tokens = req.origin_input_ids
        prefill = len(tokens) - len(tokens) % self.page_size
        names = page_hashes(tokens[:prefill], self.page_size, self.namespace_seed)
        return OffloadedState(0, names[-1] if names else self.namespace_seed)

    def _new_record(self, req) -> Record:
        """A PREFILLED record for a request already checked by ``_check_shape``; not yet inserted."""
        row = self._row_of(req)
        _claims.check(req, self)
        progress = self._initial_progress(req)
        ref = weakref.KeyedRef(req, self._dropped.append, id(req))
        return Record(ref, req.rid, row, _PREFILLED, progress, self._log.bind(rid=req.rid, row=row, gen=0),
                      slots=req.kv.kv_allocated_len)

    def _insert(self, rec: Record, req) -> None:
        old = self._records.get(id(req))
        if old is not None:
            self._retire(old)
        self._records[id(req)] = rec
        self._by_name["PREFILLED"] += 1
        _claims.claim(req, self)

    def _drain_dropped(self) -> None:
        dropped = self._dropped
        while dropped:
            ref = dropped.popleft()
            rec = self._records.get(ref.key)
            if rec is not None and rec.ref is ref:
                self._retire(rec)

    def _retire(self, rec: Record) -> None:
        """Forget a record whose request was dropped; report a leak unless it was released."""
        del self._records[rec.ref.key]
        self._by_name[rec.state.name] -= 1
        if rec.state is not _RELEASED:
            self._leaked += 1
            rec.log.warning(audit.LEAKED, state=rec.state.name, slots=rec.slots)

    # --- work done by the machine's callbacks ------------------------------------------------------

    def _plan_chunk(self, rec: Record, req, n: int) -> Chunk:
        """The next chunk, fully checked before any state changes (slow path, once per chunk)."""
        ps = self.page_size
        kv = req.kv
        if kv.req_pool_idx != rec.row:
            raise InvalidRequest(
                f"request {rec.rid!r}: row changed from {rec.row} to {kv.req_pool_idx!r} without readmit"
            )
        origin, out = req.origin_input_ids, req.output_ids
        n_in = len(origin)
        start = n_in - n_in % ps + rec.offload.inc_len
        end = start + n
        committed = _committed(req)
        if not isinstance(committed, int) or end > committed:
            raise InvalidRequest(
                f"request {rec.rid!r}: chunk [{start}, {end}) has tokens whose KV is not committed "
                f"(committed {committed!r})"
            )
        width = self.req_to_token_pool.req_to_token.shape[1]
        allocated = kv.kv_allocated_len
        if not isinstance(allocated, int) or allocated < committed:
            raise InvalidRequest(f"request {rec.rid!r}: committed {committed} > allocated {allocated!r}")
        if allocated > width:
            raise InvalidRequest(f"request {rec.rid!r}: allocated {allocated} exceeds the row width {width}")
        if end <= n_in:
            tokens = list(origin[start:end])
        elif start >= n_in:
            tokens = list(out[start - n_in : end - n_in])
        else:
            tokens = list(origin[start:]) + list(out[: end - n_in])
        hashes = page_hashes(tokens, ps, rec.offload.last_hash)
        rec.slots = kv.kv_allocated_len
        return Chunk(0, req, rec, start, end, None, tokens, hashes, 0.0)

    def _enqueue_chunk(self, rec: Record, req, chunk: Chunk) -> None:
        try:
            indices = self.req_to_token_pool.req_to_token[rec.row, chunk.start : chunk.end].to(torch.int64, copy=True)
            ack = next(self._ack_ids)
            host = self.offloader.write(indices, ack)
        except BaseException as err:
            self._fire["host_short"](rec, mgr=self, req=req, start=chunk.start, end=chunk.end, error=err)
            raise
        if host is None:
            self._fire["host_short"](rec, mgr=self, req=req, start=chunk.start, end=chunk.end)
            return
        chunk.ack_id, chunk.host, chunk.enqueued_at = ack, host, self._clock()
        self._fire["enqueued"](rec, mgr=self, req=req, chunk=chunk)

    def _commit_chunk(self, rec: Record, chunk: Chunk) -> None:
        self._ongoing[chunk.ack_id] = chunk
        rec.inflight += 1
        rec.offload.inc_len += chunk.end - chunk.start
        rec.offload.last_hash = chunk.page_hashes[-1]
        self._chunks += 1
        self._pages += len(chunk.page_hashes)
        if self._debug:
            rec.log.debug(
                audit.CHUNK_ENQUEUED, ack_id=chunk.ack_id, start=chunk.start, end=chunk.end,
                pages=len(chunk.page_hashes), first_hash=chunk.page_hashes[0], last_hash=chunk.page_hashes[-1],
            )

    def _count_host_short(self, rec: Record, kwargs: dict) -> None:
        error = kwargs.get("error")
        if error is None:
            self._host_short += 1
            rec.log.warning(audit.HOST_SHORT, start=kwargs["start"], end=kwargs["end"])
        else:
            rec.log.error(audit.HOST_SHORT, start=kwargs["start"], end=kwargs["end"], error=repr(error))

    def _release_ranges(self, req) -> list[tuple[int, int]]:
        kv = req.kv
        committed = _committed(req)
        allocated = kv.kv_allocated_len
        width = self.req_to_token_pool.req_to_token.shape[1]
        for name, value in (("committed", committed), ("allocated", allocated)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidRequest(f"request {req.rid!r}: kv {name} length {value!r} is not a non-negative int")
        if committed > allocated:
            raise InvalidRequest(f"request {req.rid!r}: committed {committed} > allocated {allocated}")
        if allocated > width:
            raise InvalidRequest(f"request {req.rid!r}: allocated {allocated} exceeds the row width {width}")
        ranges = [(0, committed)] if committed else []
        tail = -(-committed // self._alloc_page) * self._alloc_page
        if tail < allocated:
            ranges.append((tail, allocated))
        return ranges

    def _free_memory(self, rec: Record, req) -> None:
        ranges = self._release_ranges(req)
        slots = self.req_to_token_pool.req_to_token[rec.row]
        held = [self._expired[a] for a in rec.expired or () if a in self._expired]
        quarantined = torch.cat([q.slots for q in held]) if held else None
        for start, end in ranges:
            part = slots[start:end].to(torch.int64, copy=True)
            if quarantined is not None:
                part = part[~torch.isin(part, quarantined)]
            if part.numel():
                self.token_to_kv_pool_allocator.free(part)
        for q in held:
            q.released = True
        rec.expired = None
        self.req_to_token_pool.free(req)
        self._released += 1
        committed = _committed(req)
        rec.log.info(audit.RELEASED, ranges=ranges, slots=sum(e - s for s, e in ranges),
                     committed=committed, allocated=req.kv.kv_allocated_len,
                     quarantined=0 if quarantined is None else quarantined.numel())

    def _reset_progress(self, rec: Record, req, row: int, progress: OffloadedState) -> None:
        rec.row, rec.offload, rec.slots = row, progress, req.kv.kv_allocated_len
        rec.generation += 1
        rec.log = self._log.bind(rid=rec.rid, row=row, gen=rec.generation)

    def _on_transition(self, rec: Record, trigger: str, src: str, dst: str) -> None:
        by_state = self._by_name
        by_state[src] -= 1
        by_state[dst] += 1
        if self._debug:
            rec.log.debug(audit.TRANSITION, trigger=trigger, src=src, dst=dst)

    # --- completions -------------------------------------------------------------------------------

    def _on_landed(self, chunk: Chunk) -> None:
        rec, req = chunk.rec, chunk.req
        rec.inflight -= 1
        self._chunks_landed += 1
        op_id = None
        if chunk.ack_id in self._failed:
            self._failed.discard(chunk.ack_id)
            self._copy_failures += 1
            rec.log.error(audit.COPY_FAILED, ack_id=chunk.ack_id, start=chunk.start, end=chunk.end)
            self.offloader.free_host(chunk.host)
            self._after_copy(rec, req)
            return
        try:
            op_id = self.offloader.write_storage(chunk.host, chunk.tokens, chunk.page_hashes)
        except Exception as err:
            rec.log.error(audit.CHUNK_LANDED, ack_id=chunk.ack_id, error=repr(err))
            self.offloader.free_host(chunk.host)
        else:
            self._storage_ops[op_id] = StorageOp(
                op_id, rec.rid, chunk.ack_id, chunk.host, len(chunk.page_hashes),
                chunk.page_hashes[0], chunk.page_hashes[-1],
            )
        if self._debug:
            rec.log.debug(
                audit.CHUNK_LANDED, ack_id=chunk.ack_id, start=chunk.start, end=chunk.end, op_id=op_id,
                latency_s=round(self._clock() - chunk.enqueued_at, 6),
            )
        self._after_copy(rec, req)

    def _after_copy(self, rec: Record, req) -> None:
        """A copy of the request is no longer counted in flight: move on when it was the last."""
        if rec.inflight:
            return
        if rec.state is _INFLIGHT:
            self._fire["landed"](rec, mgr=self, req=req)
            if req.finished():
                self._release_finished_req(req)
        elif rec.state is _FINISHED:
            self._release_finished_req(req)

    def _on_expired(self, chunk: Chunk) -> None:
        """A copy passed its deadline: stop waiting for it, but quarantine the slots it may read."""
        rec, req = chunk.rec, chunk.req
        rec.inflight -= 1
        self._copies_expired += 1
        slots = self.req_to_token_pool.req_to_token[rec.row, chunk.start : chunk.end].to(torch.int64, copy=True)
        self._expired[chunk.ack_id] = Quarantine(chunk.ack_id, rec.rid, chunk.host, slots)
        rec.expired = (rec.expired or ()) + (chunk.ack_id,)
        rec.log.error(audit.COPY_EXPIRED, ack_id=chunk.ack_id, start=chunk.start, end=chunk.end,
                      slots=slots.numel())
        self._after_copy(rec, req)

    def _on_expired_ended(self, q: Quarantine) -> None:
        """An expired copy finally ended: its host pages, and its slots if already released, go back."""
        self.offloader.free_host(q.host)
        if q.released:
            self.token_to_kv_pool_allocator.free(q.slots)
        self._log.warning(audit.EXPIRED_COPY_ENDED, rid=q.rid, ack_id=q.ack_id, slots_freed=q.slots.numel()
                          if q.released else 0)

    def _on_stored(self, op: StorageOp) -> None:
        self.offloader.free_host(op.host)
        self._storage_finished += 1
        if self._debug:
            self._log.debug(
                audit.STORED, rid=op.rid, op_id=op.op_id, ack_id=op.ack_id, pages=op.pages,
                first_hash=op.first_hash, last_hash=op.last_hash,
            )

    def _agree(self, n_writes: int, n_stored: int) -> tuple[int, int]:
        import torch.distributed as dist

        counts = torch.tensor([n_writes, n_stored], dtype=torch.int64)
        dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=self.tp_group)
        return int(counts[0]), int(counts[1])

    # --- refusals ------------------------------------------------------------------------------------

    def _refusal(self, rid, trigger: str, state: str, reason: str) -> InvalidTransition:
        self._log.info(audit.REFUSED, rid=rid, trigger=trigger, state=state, reason=reason)
        return InvalidTransition(rid, trigger, state, reason)

    def _refuse(self, rec: Record, trigger: str, reason: str):
        raise self._refusal(rec.rid, trigger, rec.state.name, reason)

    def _closed_call(self, *args, **kwargs):
        raise ManagerClosed("the manager was shut down")

    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosed("the manager was shut down")


def _committed(req) -> int:
    effective = getattr(req, "effective_kv_committed_len", None)
    return effective() if callable(effective) else req.kv.kv_committed_len


def _done_prefix(table: dict, done: set) -> list:
    """Keys of ``table`` (in issue order) up to the first one not in ``done``."""
    prefix = []
    for key in table:
        if key not in done:
            break
        prefix.append(key)
    return prefix


_SHAPE = ("rid", "origin_input_ids", "output_ids", "kv", "finished")
_KV_SHAPE = ("req_pool_idx", "kv_committed_len", "kv_allocated_len")


def _check_shape(req) -> None:
    """First sight of a request: it must be SGLang-shaped."""
    missing = [a for a in _SHAPE if not hasattr(req, a)]
    kv = getattr(req, "kv", None)
    missing += [f"kv.{a}" for a in _KV_SHAPE if kv is not None and not hasattr(kv, a)]
    if missing:
        raise InvalidRequest(f"{type(req).__name__} is not a request: it lacks {', '.join(missing)}")
    if not callable(req.finished):
        raise InvalidRequest(f"request {req.rid!r}: finished is not callable")


class _Claims:
    """Which manager holds each live request, so a request cannot be driven by two managers."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple] = {}

    def check(self, req, mgr) -> None:
        claim = self._by_id.get(id(req))
        if claim is None or claim[0]() is not req:
            return
        owner = claim[1]()
        if owner is None or owner is mgr:
            return
        rec = owner._lookup(req)
        if rec is not None and rec.state is not _RELEASED:
            raise InvalidRequest(
                f"request {req.rid!r} belongs to another manager (state {rec.state.name} there)"
            )

    def claim(self, req, mgr) -> None:
        self._by_id[id(req)] = (weakref.KeyedRef(req, self._forget, id(req)), weakref.ref(mgr))

    def _forget(self, ref) -> None:
        claim = self._by_id.get(ref.key)
        if claim is not None and claim[0] is ref:
            del self._by_id[ref.key]


_claims = _Claims()
