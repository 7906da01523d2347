"""The scheduler side of the store path: vLLM requests driven through our ``DecodeOffloadManager``.

The manager (the same checked lifecycle the SGLang drop-in runs) sees each vLLM request through a
``VllmRequest`` — SGLang's shape: ``origin_input_ids`` (the prompt), ``output_ids`` (the tokens
after it, up to and including the first one whose KV is not written), ``kv`` (a row of our own
``req_to_token`` table, ``VllmRows``, listing vLLM's slots ``block * block_size + i``) — and copies
through the ``proxy.ProxyOffloader``; names come from our chain over ``request.all_token_ids``
(seeded by the request's ``cache_salt`` as SGLang 0.5.23 seeds it, never vLLM's block hashes).

Which KV is written: ``num_computed_tokens - num_in_flight_tokens`` — tokens whose forward's output
vLLM has processed (under async scheduling ``num_computed_tokens`` runs ahead; rejected draft tokens
are rolled back before), and never the last sampled token (``num_tokens - 1`` at most). Pages are
planned only when whole (``offload_stride = block_size``).

Releases are *permissions* (``PermissionSink``): vLLM frees blocks, the manager decides when it may.
``finished`` (``request_finished``) plans the last pages and finalizes: released at once -> vLLM may
free now; copies in flight -> the request is *delayed* and every rank reports it in
``finished_sending`` once its copies ended there. ``preempted``: vLLM has already freed the blocks;
the request's copies are fenced on the workers before the next forward and its lifecycle ends
without a free; a resumed request starts a new lifecycle (a new ``VllmRequest``).

The prompt's page-aligned part is the prefill side's (and may be blocks shared through vLLM's
prefix cache): the row lists private ids there (past the device's slots, never copied, never freed),
so a shared block never makes a release plan refuse.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from lifecycle.errors import LifecycleError
from lifecycle.integrations.vllm.jobs import Report, StepJobs
from lifecycle.integrations.vllm.proxy import ProxyOffloader
from lifecycle.log import get_logger
from lifecycle.manager import DecodeOffloadManager
from lifecycle.states import State

log = get_logger("lifecycle.integrations.vllm.store")


class _Outputs(Sequence):
    """``all_token_ids[start:end]`` without a copy (what the manager reads of ``output_ids``)."""

    __slots__ = ("_all", "_start", "_end")

    def __init__(self, all_ids, start: int, end: int) -> None:
        self._all, self._start, self._end = all_ids, start, max(end, start)

    def __len__(self) -> int:
        return self._end - self._start

    def __getitem__(self, i):
        if isinstance(i, slice):
            lo, hi, step = i.indices(len(self))
            return list(self._all[self._start + lo:self._start + hi:step])
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._all[self._start + i]


class _KV:
    __slots__ = ("req_pool_idx", "kv_committed_len", "kv_allocated_len")

    def __init__(self, row: int) -> None:
        self.req_pool_idx, self.kv_committed_len, self.kv_allocated_len = row, 0, 0


class VllmRequest:
    """One lifecycle of a vLLM request, SGLang-shaped for the manager (module docstring)."""

    __slots__ = ("rid", "request", "origin_input_ids", "n_in", "output_ids", "kv", "cache_salt", "extra_key",
                 "_finished", "preempted", "blocks", "__weakref__")

    def __init__(self, request, row: int) -> None:
        self.rid = request.request_id
        self.request = request
        self.origin_input_ids = list(request.prompt_token_ids)
        self.n_in = len(self.origin_input_ids)
        self.output_ids = _Outputs(request.all_token_ids, self.n_in, 0)
        self.kv = _KV(row)
        self.cache_salt = getattr(request, "cache_salt", None)
        self.extra_key = None
        self._finished = False
        self.preempted = False
        self.blocks: list[int] = []

    def finished(self) -> bool:
        return self._finished

    def written(self) -> int:
        """Tokens whose KV a completed forward wrote (module docstring)."""
        r = self.request
        return max(0, min(r.num_computed_tokens - getattr(r, "num_in_flight_tokens", 0), r.num_tokens - 1))


class VllmRows:
    """``req_to_token`` for the manager: one row per live lifecycle, vLLM's slots from the first page
    the decode side copies, private ids before it (module docstring)."""

    def __init__(self, rows: int, width: int, page_size: int, device_slots: int) -> None:
        self.req_to_token = torch.full((rows, width), -1, dtype=torch.int64)
        self._rows = self.req_to_token.numpy()  # the same memory: rows written through NumPy
        self._ramp = np.arange(page_size, dtype=np.int64)
        self.page_size, self.width, self.device_slots = page_size, width, device_slots
        self._free = list(range(rows))
        self.freed = 0

    def alloc(self) -> int | None:
        return self._free.pop(0) if self._free else None

    def available_size(self) -> int:
        return len(self._free)

    def fill(self, req: VllmRequest, blocks) -> None:
        """List ``blocks`` (the request's block ids, in order; any sequence) on its row."""
        row, ps = req.kv.req_pool_idx, self.page_size
        n = min(len(blocks) * ps, self.width)
        new = len(req.blocks)
        if new and list(blocks[:new]) != req.blocks:   # never happens while running (blocks only grow): rebuild
            new = 0
        rows = self._rows
        if new * ps < n:
            ids = np.asarray(blocks[new:], dtype=np.int64)
            rows[row, new * ps:n] = (ids[:, None] * ps + self._ramp).reshape(-1)[: n - new * ps]
        aligned = req.n_in // ps * ps
        if new * ps < aligned:   # the prefill side's pages: private ids (never copied, never freed)
            lo = new * ps
            hi = min(aligned, self.width)
            rows[row, lo:hi] = np.arange(self.device_slots + row * self.width + lo,
                                         self.device_slots + row * self.width + hi, dtype=np.int64)
        req.blocks = list(blocks)
        req.kv.kv_allocated_len = n

    def free(self, req) -> None:
        row = req.kv.req_pool_idx
        self.req_to_token[row].fill_(-1)
        self._free.append(row)
        req.kv.req_pool_idx = None
        self.freed += 1


class _Blocks:
    """The manager's allocator: vLLM frees blocks, never us (``free`` only counts; a quarantined
    copy's slots are vLLM's as well)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.frees = 0

    def free(self, indices) -> None:
        self.frees += 1


class PermissionSink:
    """The manager's release sink: a release is vLLM's permission to free (module docstring).
    Frees our row; returns False: vLLM frees the blocks (and those an expired copy may still read)."""

    def __init__(self, rows: VllmRows) -> None:
        self.rows = rows
        self.released: set[str] = set()

    def check(self, plan) -> None:
        return None

    def free(self, plan) -> bool:
        self.rows.free(plan.req)
        if not plan.req.preempted:
            self.released.add(plan.rid)
        return False


class StoreScheduler:
    """The scheduler side's state (see the module docstring).

    Args:
        block_size, num_blocks: vLLM's.
        host_pages: each worker's host pool, in pages.
        world: ranks reporting completions.
        max_rows: lifecycles tracked at once (running, delayed and preempted-with-copies).
        max_len: the longest request (``max_model_len``).
        namespace_seed: the manager's seed (None: requests' own ``cache_salt``, SGLang 0.5.23's names).
        clock: monotonic seconds (``pending_work``'s stall bound).
    """

    def __init__(self, block_size: int, num_blocks: int, host_pages: int, *, world: int = 1, max_rows: int = 1024,
                 max_len: int = 8192, namespace_seed: str | None = None, clock=time.monotonic) -> None:
        self.block_size = block_size
        width = -(-max_len // block_size) * block_size
        self.rows = VllmRows(max_rows, width, block_size, num_blocks * block_size)
        self.proxy = ProxyOffloader(block_size, host_pages, num_blocks * block_size, world)
        self.sink = PermissionSink(self.rows)
        self.manager = DecodeOffloadManager(self.rows, _Blocks(block_size), page_size=block_size,
                                            offloader=self.proxy, namespace_seed=namespace_seed,
                                            release_sink=self.sink)
        self.live: dict[str, VllmRequest] = {}
        self.retired: list[VllmRequest] = []      # lifecycles that ended in vLLM, not yet released here
        self.delayed: dict[str, VllmRequest] = {}  # request_finished returned True: waiting for finished_sending
        self._fence: dict[str, list[int]] = {}
        self._delay: dict[str, list[int]] = {}
        self._clock = clock
        self.last_progress = clock()   # when the workers last reported a completion
        self.skipped = 0      # requests never stored (prompt embeds, multimodal, LoRA, no row)
        self.refused = 0      # chunks the manager refused (a miss, logged)

    # --- vLLM's scheduler calls ------------------------------------------------------------------
    def admitted(self, request, block_ids: list[int]) -> None:
        """``update_state_after_alloc``: a request left the waiting queue with ``block_ids``."""
        rid = request.request_id
        cur = self.live.get(rid)
        if cur is not None and cur.request is request and not cur.preempted:
            self.rows.fill(cur, block_ids)   # the second call of an async load
            return
        if not _storable(request):
            self.skipped += 1
            return
        row = self.rows.alloc()
        if row is None:
            self.skipped += 1
            log.warning("vllm.no_row", rid=rid, rows=self.rows.req_to_token.shape[0])
            return
        req = VllmRequest(request, row)
        self.rows.fill(req, block_ids)
        self.live[rid] = req

    def plan(self, scheduler_output) -> StepJobs:
        """``build_connector_meta``: fence preempted requests, plan every scheduled request's
        written pages, hand the step's jobs over."""
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._preempted(rid)
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        live, ps = self.live, self.block_size
        for rid in scheduler_output.num_scheduled_tokens:
            req = live.get(rid)
            if req is None:
                continue
            n = req.written()
            if n < req.n_in:
                continue  # the prompt is the prefill side's: nothing to plan yet
            # vLLM appends blocks to a running request's table and never replaces them: the row is read
            # again only when the written KV runs past the blocks it lists
            if n > len(req.blocks) * ps and state is not None:
                blocks = state.get_block_ids(rid)
                if blocks:
                    self.rows.fill(req, blocks[0])
            self._offload(req, n)
        jobs = StepJobs(self.proxy.take_jobs(), self._fence, self._delay)
        self._fence, self._delay = {}, {}
        return jobs

    def finished(self, request, block_ids: list[int]) -> bool:
        """``request_finished``: the last pages, then the release. Returns ``delay_free``."""
        req = self.live.pop(request.request_id, None)
        if req is None or req.request is not request:
            return False
        if block_ids:
            self.rows.fill(req, block_ids)
        self._offload(req, req.written())
        req._finished = True
        try:
            self.manager.finalize_release_on_finish(req)
        except LifecycleError as err:   # never the engine: vLLM frees, the manager keeps the record
            log.error("vllm.release_refused", rid=req.rid, error=str(err))
            self.refused += 1
        if self.manager.state_of(req) is State.RELEASED:
            return False
        acks = self.manager.copies_of(req)
        self.delayed[req.rid] = req
        self._delay[req.rid] = acks
        return True

    def forget(self, request) -> None:
        """A request vLLM finishes through the load path (aborted while its async load runs): it
        never ran a forward, so nothing of it is stored; its row goes back."""
        req = self.live.pop(request.request_id, None)
        if req is None or req.request is not request:
            return
        req._finished = True
        if self.manager.state_of(req) is None:
            self.rows.free(req)
        else:
            self.manager.finalize_release_on_finish(req)

    def completed(self, report: Report | None, finished_sending: set[str] | None) -> None:
        """``update_connector_output``: the workers' completions, then the manager settles them;
        requests in ``finished_sending`` are vLLM's to free now."""
        if report is not None or finished_sending:
            self.last_progress = self._clock()
        if report is not None:
            self.proxy.absorb(report)
        self.progress()
        for rid in finished_sending or ():
            req = self.delayed.pop(rid, None)
            if req is None:
                continue
            state = self.manager.state_of(req)
            if state is not State.RELEASED:   # expired copies: vLLM frees their blocks now
                self.manager.disown_expired_copies(self.manager.copies_of(req))
                log.error("vllm.freed_under_expired_copy", rid=rid, state=state.name if state else None)
        if self.retired:
            self.retired = [r for r in self.retired if self.manager.state_of(r) is not State.RELEASED]

    def progress(self) -> None:
        try:
            self.manager.check_offload_progress()
        except LifecycleError as err:
            log.error("vllm.progress_refused", error=str(err))

    # --- the store path -----------------------------------------------------------------------------
    def _offload(self, req: VllmRequest, n: int) -> None:
        """Offer the manager ``req``'s pages up to ``n`` written tokens (``req.written()``)."""
        if n < req.n_in:
            return
        req.kv.kv_committed_len = n
        out = req.output_ids  # the view moved on in place: no object per request per step
        out._all, out._end = req.request.all_token_ids, n + 1
        self.proxy.req_id = req.rid
        try:
            self.manager.offload_kv_cache(req)
        except LifecycleError as err:   # a miss, never the engine
            self.refused += 1
            log.error("vllm.chunk_refused", rid=req.rid, error=str(err))
        finally:
            self.proxy.req_id = None

    def _preempted(self, rid: str) -> None:
        """vLLM freed the request's blocks (no ``request_finished``): fence its copies, end its
        lifecycle without a free."""
        req = self.live.pop(rid, None)
        if req is None:
            return
        req.preempted = True
        req._finished = True
        acks = self.manager.copies_of(req)
        if acks:
            self._fence[rid] = acks
        if self.manager.state_of(req) is None:   # never offloaded: nothing tracked, only our row
            self.rows.free(req)
            return
        try:
            self.manager.finalize_release_on_finish(req)
        except LifecycleError as err:
            log.error("vllm.preempt_release_refused", rid=rid, error=str(err))
        if self.manager.state_of(req) is not State.RELEASED:
            self.retired.append(req)

    # --- inspection ---------------------------------------------------------------------------------
    def pending_work(self, stall_s: float) -> bool:
        """Whether vLLM should keep stepping for us: copies not expired, storage ops or delayed frees
        unsettled, and some completion came back in the last ``stall_s`` seconds (a tier hung for
        longer does not keep an idle engine spinning: the next request's steps settle it)."""
        if not (self.delayed or self.proxy.live_work()):
            return False
        return self._clock() - self.last_progress < stall_s

    def idle(self) -> bool:
        return self.proxy.idle() and not self.delayed and not self.retired

    def stats(self):
        return self.manager.stats()


def _storable(request) -> bool:
    """Whether the request's pages mean what their chain names say: token-id prompts only (no
    prompt embeddings, no multimodal inputs, no LoRA)."""
    return (request.prompt_token_ids is not None and getattr(request, "prompt_embeds", None) is None
            and getattr(request, "prompt_is_token_ids", None) is None and not getattr(request, "mm_features", None)
            and getattr(request, "lora_request", None) is None)


__all__ = ["PermissionSink", "StoreScheduler", "VllmRequest", "VllmRows"]
