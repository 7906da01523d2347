"""``DecodeOffloadManager``: the scheduler-facing lifecycle of a decode node's KV cache.

A drop-in for SGLang 0.5.19's ``DecodeKVCacheOffloadManager``. The scheduler calls it; it decides
and records; the ``Offloader`` it was given moves the bytes. Each call is read -> plan -> fire ->
ledger -> offloader / sink -> emit: it reads and checks the request once (``lifecycle.requests``),
asks the declared table once whether its trigger is allowed (``machine.FINISH.choose(facts)``: the
guards evaluated once, a refusal explained by that same evaluation), plans its whole effect (a
chunk, a ``ReleasePlan``) — all before the first side effect — and then applies the chosen
transition (``apply``), whose work (``lifecycle.work``) hands the plan to the offloader or the
release sink. Every datum of the bookkeeping is owned by one ``lifecycle.ledger.Ledger`` and
changed only through its methods; completions are settled one by one by ``lifecycle.settle``,
which hands back what moved, and the manager moves the requests on (nothing calls back up into
it). The per-step fast path fires nothing.
"""

from __future__ import annotations

import time
from logging import DEBUG

import msgspec

from lifecycle import audit, config, machine, settle, table
from lifecycle.calls import BUSY, CLOSED, CallGate, shutdown
from lifecycle.errors import LifecycleError, UnknownCompletion
from lifecycle.ledger import Ledger, Pending
from lifecycle.log import RateLimitedLog, get_logger
from lifecycle.records import OffloadedState, Record, Stats
from lifecycle.release import AllocatorReleaseSink, plan_release, slot_end
from lifecycle.pools import Pools
from lifecycle.requests import check_shape, initial_progress, namespace_of, plan_chunk, read_request
from lifecycle.states import Facts, Refusal, State

_PREFILLED, _INFLIGHT, _FINISHED = State.PREFILLED, State.INFLIGHT, State.FINISHED


class DecodeOffloadManager(CallGate):
    """Offload decode KV page by page, release every slot exactly once, never under a copy.

    Every scheduler call checks its whole plan before any effect: a refused call raises a
    ``LifecycleError`` and changes nothing (no record, no free, no counter); calls are not
    re-entrant (``ReentrantCall``). Audit events are emitted when the call's state is consistent.

    Args:
        req_to_token_pool: has ``.req_to_token`` (2-D int tensor ``[rows, max_len]``) and
            ``.free(req)`` which frees ``req``'s row.
        token_to_kv_pool_allocator: has ``.free(indices)``; a paged allocator frees the pages the
            slots lie on (its ``page_size`` attribute, when present, aligns the over-allocation and
            must divide ``page_size``).
        page_size: tokens per page (the hash chain's page).
        offloader: a ``transfer.Offloader``, used by this manager only.
        offload_stride: tokens per chunk; None means ``page_size``, else a positive page multiple.
        namespace_seed: optional prior hash of the first page of every request that names no
            namespace of its own: exactly 64 hex characters (case-insensitive; kept lowercase). A
            request's ``extra_key`` / ``cache_salt`` seed its chain as SGLang 0.5.23 does
            (``namespace_of``); one naming another namespace than this seed is refused.
        tp_group: optional ``torch.distributed`` group; ranks agree on completion counts.
        clock: time source for latencies in the audit log.
        release_sink: executes releases (``lifecycle.release.ReleaseSink``); default
            ``AllocatorReleaseSink(req_to_token_pool, token_to_kv_pool_allocator)``.
    Raises:
        ConfigError: bad page size, stride or seed; pools, offloader or sink missing required
            methods; an allocator page that does not divide ``page_size``; an offloader already
            serving another open manager.
    """

    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, page_size: int = 16, offloader=None,
                 offload_stride: int | None = None, namespace_seed: str | None = None, tp_group=None, *,
                 clock=time.monotonic, release_sink=None) -> None:
        self.page_size = config.positive_int(page_size, "page_size")
        self.offload_stride = config.stride(page_size, offload_stride)
        self.namespace_seed = config.namespace_seed(namespace_seed)
        alloc_page = config.pools(req_to_token_pool, token_to_kv_pool_allocator, page_size)
        config.offloader(offloader)
        if release_sink is None:
            release_sink = AllocatorReleaseSink(req_to_token_pool, token_to_kv_pool_allocator)
        config.release_sink(release_sink)
        self.req_to_token_pool = req_to_token_pool
        self._pool_shape = tuple(req_to_token_pool.req_to_token.shape)  # fixed for the pool's life
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.offloader, self.release_sink, self.tp_group = offloader, release_sink, tp_group
        self._clock = clock
        self._log = get_logger("lifecycle")  # routes per call: configuring logging later takes effect
        self._debug = False  # refreshed at the start of every call that may log (one level check)
        self._gate: str | None = None  # BUSY inside a call, CLOSED after shutdown
        self._logs: list = []  # audit events of the current call, emitted when it ends
        self._alerts = RateLimitedLog(self._log, demote=True)  # per-op warnings: bounded lines, all at DEBUG
        self._owners = table.OWNERS
        self._ledger = Ledger(self._owners, self._log)  # every datum of the bookkeeping, one owner
        # what the plans read (page sizes, the row table and its NumPy view, the allocator, the
        # device pool's slot count when the pools tell it): their explicit inputs, with the ledger
        self._pools = Pools(self.page_size, alloc_page, slot_end(offloader, token_to_kv_pool_allocator),
                            req_to_token_pool, token_to_kv_pool_allocator)
        table.OFFLOADERS.claim(offloader, self)

    @classmethod
    def from_stack(cls, stack, *, offload_stride: int | None = None, namespace_seed: str | None = None,
                   tp_group=None, release_sink=None) -> "DecodeOffloadManager":
        """A manager over a ``transfer.build_stack`` stack: its pools and its ``HostOffloader``."""
        return cls(
            stack.req_to_token_pool, stack.allocator, page_size=stack.host_pool.page_size,
            offloader=stack.offloader, offload_stride=offload_stride,
            namespace_seed=namespace_seed, tp_group=tp_group, release_sink=release_sink,
        )

    # --- the scheduler's calls -------------------------------------------------------------------

    def offload_kv_cache(self, req) -> bool:
        """Enqueue the request's next full chunk of KV, if any. Call after every decode step.

        Returns:
            True when a chunk was enqueued; False when there is no full chunk yet, the request has
            no row or no output, or host memory is short.
        Raises:
            InvalidTransition: the request was finalized or released.
            InvalidRequest: not SGLang-shaped, owned by another manager, a row changed without
                ``readmit``, a chunk with uncommitted KV or inconsistent lengths.
            InvalidToken: a token id of the chunk is not an int in 0..2**32-1.
            ManagerClosed / ReentrantCall: after ``shutdown`` / from inside another call.
        """
        if self._gate is not None:
            self._refuse_gate()
        rec = self._ledger.records.get(id(req))
        if rec is None or rec.ref() is not req:
            return self._offload_first(req)
        state = rec.state
        if state is not _PREFILLED and state is not _INFLIGHT:
            self._refuse(rec, "offload", Facts(state, rec.inflight))
        kv = req.kv
        if kv.req_pool_idx != rec.row:
            return self._offload_chunk(rec, req, 0)  # refused there, by the one request check
        n_out = len(req.output_ids)
        if n_out == 0:
            return False
        self._ledger.allocated(rec, kv.kv_allocated_len)  # for the leak report, should the request be dropped
        n_in = len(req.origin_input_ids)
        new = n_in + n_out - 1 - (n_in - n_in % self.page_size) - rec.offload.inc_len
        if new < self.offload_stride:
            return False
        return self._offload_chunk(rec, req, new - new % self.offload_stride)

    def check_offload_progress(self) -> None:
        """Settle landed copies and finished storage ops; release finished requests. Never blocks.

        First reads the device-side checks of device rows released before (``ReleasePlan.
        device_check``) whose verdict has landed, and reports a bad row (``stats().bad_release_rows``,
        ``lifecycle.bad_release_row`` at ERROR).

        With a ``tp_group``, ranks first agree (MIN across ranks) on how many completions to act
        on, counted as the prefix of work in issue order that has completed, and act on exactly
        those. Without one, every completion reported so far is settled.

        Raises:
            UnknownCompletion: the offloader reported an id never issued (after settling the rest).
            LifecycleError: a finished request's release was refused when its last copy landed
                (after settling the rest; it stays FINISHED until ``_release_finished_req``).
        """
        if self._gate is not None:  # _enter, inlined on the per-iteration path
            self._refuse_gate()
        self._gate = BUSY
        self._debug = self._log.is_enabled_for(DEBUG)
        try:
            ledger = self._ledger
            if ledger.dropped:
                self._drain_dropped()
            if ledger.release_checks:  # released device rows: their device-side checks, once landed
                settle.release_checks(self)
            self._progress()
        finally:
            self._leave()

    def finalize_release_on_finish(self, req) -> None:
        """The request is done (finished, aborted, retracted): release now, or when its copies land.

        Raises:
            InvalidTransition: the request was already finalized or released.
            InvalidRequest: see ``offload_kv_cache``; also a release plan the row cannot back
                (a -1 or repeated slot id, slots the allocator does not hold, a row not held).
        """
        self._enter()
        try:
            rec = self._ledger.lookup(req)
            fresh = rec is None
            facts = Facts(_PREFILLED) if fresh else Facts(rec.state, rec.inflight, finalizing=True)
            if not fresh:
                finish = machine.FINISH.choose(facts)  # the table, read once for this call
                if isinstance(finish, Refusal):
                    self._raise(rec.rid, "finish", rec.state.name, finish.explain(facts))
            view = read_request(self, req, rec)
            if fresh:
                rec = self._ledger.new_record(req, view, initial_progress(self, req))
                finish = machine.FINISH.choose(facts._replace(finalizing=True))
            # released now unless copies are in flight (then when the last one lands): the table says
            release = machine.RELEASE.choose(Facts(_FINISHED, rec.inflight, finalizing=True))
            plan = None if isinstance(release, Refusal) else self._plan_release(rec, req, view)
            if fresh:
                self._insert(rec, req)
            machine.FINISH.apply(rec, finish, mgr=self, req=req, finalizing=True)
            if plan is not None:
                machine.RELEASE.apply(rec, release, mgr=self, req=req, plan=plan)
        finally:
            self._leave()

    def _release_finished_req(self, req) -> None:
        """The one free path: free ``[0, committed)`` and the over-allocation, then the row.

        Allowed for a request that is FINISHED (finalized) or whose ``finished()`` is true, with
        no copy in flight; it is finished first when needed.

        Raises:
            InvalidTransition: copies in flight, not finished nor finalized, or already released.
            InvalidRequest: as ``finalize_release_on_finish``.
        """
        self._enter()
        try:
            rec = self._ledger.lookup(req)
            if rec is None:
                view = read_request(self, req)
                if not req.finished():
                    self._raise(req.rid, "release", "UNSEEN", "the request is neither finished nor finalized")
                rec = self._ledger.new_record(req, view, initial_progress(self, req))
                self._release(rec, req, view, fresh=True)
            else:
                self._release(rec, req)
        finally:
            self._leave()

    def readmit(self, req) -> None:
        """A RELEASED (e.g. retracted) request returns with a new row: start a new lifecycle.

        Raises:
            InvalidTransition: the request is not RELEASED (or was never seen).
            InvalidRequest: no valid row, inconsistent lengths, or held by another manager.
        """
        self._enter()
        try:
            rec = self._ledger.lookup(req)
            if rec is None:
                self._raise(getattr(req, "rid", None), "readmit", "UNSEEN", "the request was never seen")
            facts = Facts(rec.state, rec.inflight)
            readmit = machine.READMIT.choose(facts)
            if isinstance(readmit, Refusal):
                self._raise(rec.rid, "readmit", rec.state.name, readmit.explain(facts))
            view = read_request(self, req)
            progress = initial_progress(self, req)
            machine.READMIT.apply(rec, readmit, mgr=self, req=req, view=view, progress=progress)
            self._owners.claim(req, self, rec.ref)
        finally:
            self._leave()

    # --- queries -----------------------------------------------------------------------------------

    def state_of(self, req) -> State | None:
        """The request's state, or None for a request this manager has never seen."""
        rec = self._ledger.lookup(req)
        return None if rec is None else rec.state

    def copies_of(self, req) -> list[int]:
        """Ack ids of the request's copies in flight (issue order; one reported landed is not); [] for
        an unseen request."""
        rec = self._ledger.lookup(req)
        return [] if rec is None else self._ledger.copies_of(rec)

    def disown_expired_copies(self, acks) -> int:
        """The device slots these expired copies may still read were freed by their owner (SGLang
        frees a request under its copies once its TP=1 release wait runs out): they are not this
        manager's any more — not freed when the copies end (only their host pages come back), and
        not guarded against reuse by the slot check (the owner may hand them out again; what the
        copies land is discarded). Ack ids that are not expired copies are skipped.

        Returns:
            How many copies were disowned.
        """
        return self._ledger.disown(acks)

    def namespace_of(self, req) -> str | None:
        """The namespace seed this manager names ``req``'s pages under (the prior of its chain's
        first page; None: none), from ``req.extra_key`` / ``req.cache_salt`` and the manager's
        ``namespace_seed`` (rules: ``lifecycle.requests.namespace_of``). A scheduler looks up and
        loads a request's stored prefix under this seed (``PrefixLoader.start(..., prior_hash=)``),
        so it finds only pages of its own namespace. Reads only; the manager reads the same once,
        when it first sees the request.

        Raises:
            InvalidRequest: a namespace field that is not a str (or None), or not UTF-8 encodable, or
                a namespace other than the manager's ``namespace_seed``.
        """
        return namespace_of(self, req)

    def progress_of(self, req) -> OffloadedState | None:
        """A copy of the request's offload progress (``inc_len``, ``last_hash``), or None."""
        rec = self._ledger.lookup(req)
        return None if rec is None else msgspec.structs.replace(rec.offload)

    def stats(self) -> Stats:
        """Counters (``lifecycle.ledger.Ledger.stats``). ``unsettled`` counts completions reported but
        not settled: non-zero after a call means ``check_offload_progress`` is due."""
        if self._gate is None:
            self._drain_dropped()
        return self._ledger.stats()

    def refusals(self) -> dict[str, int]:
        """Calls refused with ``InvalidTransition`` so far, by ``"TRIGGER in STATE"`` (kept apart
        from ``stats()``, which a refused call leaves as it was)."""
        return dict(self._ledger.refusals)

    def pending(self) -> Pending:
        """What the manager waits on (``lifecycle.ledger.Pending``): the idle check. It collects
        what the offloader has reported (settling nothing), so ``finished_waiting_on_settled``
        names finished requests that hold slots only because ``check_offload_progress`` was not
        called since their copies landed.

        Raises:
            ManagerClosed / ReentrantCall: after ``shutdown`` / from inside another call.
        """
        self._enter()
        try:
            settle.collect(self)
            return self._ledger.pending()
        finally:
            self._leave()

    @property
    def closed(self) -> bool:
        """True after ``shutdown``."""
        return self._gate == CLOSED

    def idle(self) -> bool:
        """True when no copy and no storage op is in flight and nothing awaits settling."""
        return self._ledger.idle()

    def snapshot(self) -> bytes:
        """All live records, msgpack-encoded (``RecordView`` list), for debugging."""
        return self._ledger.snapshot()

    def check_integrity(self) -> None:
        """Verify the tables agree (``lifecycle.ledger.Ledger.check``). Raises IntegrityError."""
        self._ledger.check()

    def shutdown(self, force: bool = False, timeout_s: float = 5.0) -> Pending:
        """Stop accepting calls and release the offloader's resources, in bounded time: the whole
        call returns within about ``timeout_s`` (one deadline, set on entry, for the drain and the
        offloader's close together).

        Completions already reported are collected first (not settled), so the refusal says what
        is really pending. With ``force``, accepted work is drained first, for at most
        ``timeout_s``: landed copies are settled, their storage writes submitted and waited for,
        finished requests released (``calls.drain``; with a ``tp_group`` every rank drains in
        step). What is still pending then is abandoned: its slots stay allocated (never freed under
        a copy that may still read them), it is logged once (``lifecycle.abandoned``) and counted
        (``stats().abandoned``).

        Args:
            force: shut down even with work pending (after draining it for up to ``timeout_s``).
            timeout_s: the bound of the whole call (default 5 s): the drain runs until it, and the
                offloader's ``close``, when it takes a timeout, gets what is left of it.
        Returns:
            What was pending when the manager closed.
        Raises:
            InvalidArgument: ``timeout_s`` not a finite number >= 0 or ``force`` not a bool; raised
                before anything changes (the manager stays open, the offloader untouched).
            LifecycleError: work is pending (unless ``force``); names it. Nothing closed.
            ReentrantCall: called from inside another call.
        """
        return shutdown(self, force, timeout_s)

    # --- planned steps -----------------------------------------------------------------------------

    def _offload_first(self, req) -> bool:
        """First sight: track the request (and enqueue its first chunk) only if all of it checks."""
        self._enter()
        try:
            check_shape(req)
            row = req.kv.req_pool_idx
            if row is None or row == -1 or len(req.output_ids) == 0:
                return False
            view = read_request(self, req, shaped=True)
            rec = self._ledger.new_record(req, view, initial_progress(self, req))
            n = self._due(rec, req)
            chunk = plan_chunk(self._pools, self._ledger, rec, req, view, n) if n else None
            self._insert(rec, req)
            if chunk is None:
                return False
            machine.offload(rec, mgr=self, req=req, chunk=chunk)
            return rec.offload.inc_len != 0
        finally:
            self._leave()

    def _offload_chunk(self, rec: Record, req, n: int) -> bool:
        self._gate = BUSY  # _enter, inlined on the per-chunk path (the caller checked the gate)
        self._debug = self._log.is_enabled_for(DEBUG)
        try:
            view = read_request(self, req, rec)
            chunk = plan_chunk(self._pools, self._ledger, rec, req, view, n)
            before = rec.offload.inc_len
            machine.offload(rec, mgr=self, req=req, chunk=chunk)
            return rec.offload.inc_len != before
        finally:
            self._leave()

    def _due(self, rec: Record, req) -> int:
        """Tokens of whole strides with KV not yet submitted (0: no chunk due)."""
        n_in, n_out = len(req.origin_input_ids), len(req.output_ids)
        new = n_in + n_out - 1 - (n_in - n_in % self.page_size) - rec.offload.inc_len
        return max(new - new % self.offload_stride, 0) if n_out else 0

    def _plan_release(self, rec: Record, req, view):
        held = self._ledger.quarantined_of(rec)
        quarantined = None
        if held:
            import torch

            quarantined = torch.cat(held)
        return plan_release(self._pools, self._ledger, self.release_sink, rec, req, view, quarantined)

    def _release(self, rec: Record, req, view=None, fresh: bool = False) -> None:
        """Decide, plan and apply a release (inside a call). Refused: nothing changed."""
        facts = Facts(rec.state, rec.inflight, finished=bool(req.finished()))
        finish = None
        if rec.state is _PREFILLED or rec.state is _INFLIGHT:  # finished first, then released
            finish = verdict = machine.FINISH.choose(facts)
            if not isinstance(finish, Refusal):
                verdict = machine.RELEASE.choose(facts._replace(state=_FINISHED))
        else:
            verdict = machine.RELEASE.choose(facts)
        if isinstance(verdict, Refusal):
            self._raise(rec.rid, "release", "UNSEEN" if fresh else rec.state.name, verdict.explain(facts))
        if view is None:
            view = read_request(self, req, rec)
        plan = self._plan_release(rec, req, view)
        if fresh:
            self._insert(rec, req)
        if finish is not None:
            machine.FINISH.apply(rec, finish, mgr=self, req=req, finished=True)
        machine.RELEASE.apply(rec, verdict, mgr=self, req=req, plan=plan)

    # --- the record table and completions (bookkeeping in the ledger, work in settle) -------------

    def _insert(self, rec: Record, req) -> None:
        """Start tracking ``rec`` and claim ``req`` (a dropped request's record under the same id is
        retired, and reported when it leaked)."""
        leaked = self._ledger.insert(rec, req)
        if leaked is not None:
            self._emit(leaked.log.warning, audit.LEAKED, state=leaked.state.name, slots=leaked.slots)
        self._owners.claim(req, self, rec.ref)

    def _drain_dropped(self) -> None:
        """Retire the records of requests the scheduler dropped; report those that leaked."""
        for rec in self._ledger.drain_dropped():
            self._emit(rec.log.warning, audit.LEAKED, state=rec.state.name, slots=rec.slots)

    def _progress(self) -> None:
        """Settle every completion reported (with a TP group: the prefix all ranks agree on), in
        order: expired copies, expired copies that ended, landed copies (issue order: a chain's
        chunks reach storage in order), finished storage ops; a request whose last copy ended moves
        on (``_copies_ended``).

        A collaborator that raises while one completion is settled (the offloader's ``free_host``,
        the allocator freeing an expired copy's slots) stops nothing else: that completion is
        settled as far as the ledger goes (its slots no longer counted as read, its request moved
        on), the rest are settled, then the first such error is raised.

        Raises:
            UnknownCompletion: the offloader reported an id never issued (after settling the rest).
            Exception: the first error a collaborator raised while settling (after settling the rest).
            LifecycleError: the release of a finished request whose last copy landed was refused
                (after settling the rest; the request stays FINISHED for a retry).
        """
        refused, failed = [], []  # refused releases; collaborators' errors (settling went on)
        settle.collect(self)  # one finished_writes poll: landed / failed / expired
        if self._ledger.expiring:
            for ack in self._ledger.take_expiring():
                chunk = settle.expired(self, ack)
                if chunk is not None and not chunk.rec.inflight:
                    self._copies_ended(chunk.rec, chunk.req, refused)
        due = self._ledger.settleable(settle.agreement(self.tp_group))
        for q in due.ended:
            settle.expired_ended(self, q, failed)
        for ack in due.acks:
            chunk = settle.landed(self, ack, failed)
            if not chunk.rec.inflight:
                self._copies_ended(chunk.rec, chunk.req, refused)
        if due.ops:
            settle.stored(self, due.ops, failed)
        if due.unknown:
            raise UnknownCompletion(f"offloader reported ids never issued or already settled: {due.unknown}")
        if failed:
            raise failed[0]
        if refused:
            raise refused[0]

    def _copies_ended(self, rec: Record, req, refused: list) -> None:
        """No copy of ``rec`` is in flight any more: INFLIGHT returns to PREFILLED (``landed``); a
        finished request is released. A refused release is logged and kept in ``refused`` (the
        request then stays FINISHED until ``_release_finished_req``)."""
        if rec.state is _INFLIGHT:
            machine.landed(rec, mgr=self, req=req)
            if not req.finished():
                return
        elif rec.state is not _FINISHED:
            return
        try:
            self._release(rec, req)
        except LifecycleError as err:
            self._emit(rec.log.error, audit.REFUSED, trigger="release", state=rec.state.name, reason=str(err))
            refused.append(err)
