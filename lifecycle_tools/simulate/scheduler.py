"""The reference decode scheduler loop: the example of embedding ``DecodeOffloadManager``.

How a scheduler embeds the manager (the calls this loop makes, in this order)::

    mgr = DecodeOffloadManager.from_stack(stack, offload_stride=stride)
    while serving:
        mgr.check_offload_progress()            # every iteration: settle copies, release finished
        admit waiting requests                  # a row + slots for prompt (+ speculative slots);
                                                #   a readmitted (retracted) request: mgr.readmit(req)
        one decode step for the running batch   # write the new tokens' KV, append sampled tokens
        for req in batch:
            if req.finished():                  # finished, or aborted: the one release path
                if not mgr.offload_kv_cache(req):
                    mgr.finalize_release_on_finish(req)
            elif retracted:                     # memory pressure: give the KV back, re-prefill later
                mgr.finalize_release_on_finish(req)
            else:
                mgr.offload_kv_cache(req)       # enqueue the next full chunk, if any
    wait (bounded) until mgr.idle(); mgr.shutdown(); stack.close()

The scheduler never frees a request's slots or row itself: the manager does, exactly once, and
never while a copy still reads them. The loop only learns of a release by ``mgr.state_of(req)``
becoming ``RELEASED`` (then it returns the request's page reservation, or re-queues a retracted
request for readmission). Requests are ``lifecycle_tools.request.Request``s; with ``spec_tokens = N``
every step keeps ``kv_allocated_len = committed + N`` and accepts 1..N+1 tokens.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Iterable

import torch

from lifecycle.node_stats import from_stack
from lifecycle.states import State
from lifecycle_tools import interrupt
from lifecycle_tools.simulate.admission import Admission
from lifecycle_tools.simulate.calls import EnqueueTimer, ManagerCalls
from lifecycle_tools.simulate.kvdata import SyntheticKV
from lifecycle_tools.simulate.report import PassReport, Progress
from lifecycle_tools.simulate.state import PassState, SimRequest
from lifecycle_tools.simulate.tally import tally_pass
from lifecycle_tools.simulate.verify import PageSample, integrity_of_pass, verify_sample
from lifecycle_tools.simulate.workload import Plan, all_plans


class Simulator:
    """Owns a stack and a manager; ``run_pass`` serves one workload through them.

    Args:
        cfg: the configuration (validated).
        stack: a ``transfer.TransferStack``.
        mgr: the ``DecodeOffloadManager`` over ``stack``.
        progress: optional callback taking a ``Progress`` (about every 0.1 s).
        enqueue_timer: the ``EnqueueTimer`` installed on the stack's offloader, if any.
        on_step: optional callback taking the manager's time in each step, in seconds (metrics).
        on_wait: optional callback (no arguments) called in every iteration of a pass's drain and
            between the steps after it (leak count, verification): metrics refresh there too.
    """

    def __init__(self, cfg, stack, mgr, progress=None, enqueue_timer: EnqueueTimer | None = None,
                 on_step=None, on_wait=None) -> None:
        self.cfg, self.stack, self.mgr, self.progress = cfg, stack, mgr, progress
        self.on_step = on_step  # called after each step with the manager's time in it (seconds)
        self.on_wait = on_wait or (lambda: None)
        self.ps, self.spec = cfg.page_size, cfg.spec_tokens
        self.rows = stack.req_to_token_pool
        self.kv = SyntheticKV(stack.kv_pool, self.rows, self.ps)
        self.calls = ManagerCalls()
        self.admission = Admission(cfg, stack, mgr, self.kv, self.calls)
        self.enqueue_timer = enqueue_timer or EnqueueTimer()
        self.max_running = cfg.max_running or self.rows.available_size()
        self.baseline = (stack.allocator.available_size(), self.rows.available_size(),
                         stack.host_pool.available_size())
        self._rng = random.Random()
        self._last_progress = 0.0

    def run_pass(self, chats: Iterable[Plan], name: str = "run", total: int | None = None) -> PassReport:
        """Serve ``chats`` (first turns, in arrival order; taken lazily) until every request is
        done and released; then drain, count leaks and verify a sample of the stored pages.

        Args:
            chats: e.g. ``workload.iter_chats(cfg)``.
            name: the pass's column in the summary.
            total: requests in ``chats`` (default: counted when ``chats`` is a list, else
                ``cfg.requests``).
        """
        if total is None:
            total = sum(1 for _ in all_plans(chats)) if isinstance(chats, list) else self.cfg.requests
        rep = PassReport(name=name, requests=total)
        self.calls.rep = rep
        self.enqueue_timer.reset()
        self._rng.seed(self.cfg.seed * 7919 + 17)
        ps = PassState(rep, iter(chats), total, PageSample(self.cfg.verify, self.cfg.seed, self.ps),
                       max_waiting=max(64, 4 * self.max_running))
        ps.before = from_stack(self.mgr, self.stack)
        t0 = time.perf_counter()
        while ps.done < total:
            interrupt.check()
            self._step(ps)
        self._drain(rep)
        rep.wall_s = time.perf_counter() - t0
        rep.steps = ps.step
        tally_pass(rep, ps, self.mgr, self.stack, self.enqueue_timer)
        self.on_wait()
        self._count_leaks(ps)
        self.on_wait()
        verify_sample(ps.sample, self.stack.storage, self.stack.host_pool, self.kv, rep)
        self.on_wait()
        integrity_of_pass(rep, ps.before.tiers[0].storage, self.stack.storage.stats())
        return rep

    # -- one iteration of the loop --------------------------------------------------------------
    def _step(self, ps: PassState) -> None:
        ps.step += 1
        self.calls.step_ns = 0
        ps.waiting.extend(self._arrived(plan) for plan in ps.arrivals())
        self.calls(self.mgr.check_offload_progress)
        self.admission.poll_backups(ps.rep)
        self._settle_released(ps)
        self.admission.finish_loads(ps)
        self._admit(ps)
        batch = ps.running
        if batch:
            self._decode(ps)
            ps.running = [req for req in batch if self._after_decode(req, ps)]
        ps.overhead_us.append(self.calls.step_ns / 1000.0)
        if self.on_step is not None:
            self.on_step(self.calls.step_ns / 1e9)
        if not ps.busy():
            nxt = ps.next_arrival()          # idle: jump the clock to the next arrival
            if nxt is not None:
                ps.step = max(ps.step, nxt - 1)
        elif not batch:
            time.sleep(0.0002)               # only waiting on copies or loads
        self._report_progress(ps)

    def _arrived(self, plan) -> SimRequest:
        """A new request; its pages' namespace is the manager's (read once, as the manager does)."""
        req = SimRequest(plan)
        req.seed = self.mgr.namespace_of(req)
        return req

    def _settle_released(self, ps: PassState) -> None:
        """Requests the manager has RELEASED: return their reservation; requeue a retracted one."""
        still = []
        for req in ps.draining:
            if self.mgr.state_of(req) is not State.RELEASED:
                still.append(req)
                continue
            ps.reserved -= req.reserved
            req.reserved = 0
            if req.kv.req_pool_idx is None:
                ps.rep.rows_freed += 1
            prog = self.mgr.progress_of(req)
            if prog is not None and prog.inc_len:
                first = len(req.origin_input_ids) // self.ps
                ps.sample.offer(req.seq, req.kvids, first, first + prog.inc_len // self.ps, req.seed)
            if req.ending == "retract":
                req.readmit, req.ending = True, ""
                ps.waiting.appendleft(req)
            else:
                ps.done += 1
                if req.plan.next is not None:
                    ps.schedule_turn(ps.step + self.cfg.think_steps, req.plan.next)
        ps.draining = still

    def _admit(self, ps: PassState) -> None:
        ps.prefill = 0
        while (ps.waiting and len(ps.running) + len(ps.loading) < self.max_running
               and ps.prefill < self.cfg.prefill_budget):
            if not self.admission.try_admit(ps.waiting[0], ps):
                break
            ps.waiting.popleft()

    def _decode(self, ps: PassState) -> None:
        """One decode step: accept 1..spec+1 tokens per request, write their KV in one batch."""
        rows, positions, ids = [], [], []
        for req in ps.running:
            c = req.kv.kv_committed_len
            a = min(1 + (self._rng.randint(0, self.spec) if self.spec else 0), req.tokens_left())
            if a <= 0:
                continue
            self.admission.ensure_slots(req, c + a + self.spec)
            rows += [req.kv.req_pool_idx] * a
            positions += range(c, c + a)
            ids.append(req.kvids[c:c + a])
            base = len(req.origin_input_ids) + len(req.output_ids)
            req.output_ids.extend(req.seq[base:base + a])
            req.kv.kv_committed_len = c + a
            ps.rep.tokens_decoded += a
        if rows:
            pos = torch.tensor(positions, dtype=torch.int64)
            slots = self.rows.req_to_token[torch.tensor(rows, dtype=torch.int64), pos].to(torch.int64)
            self.kv.write_slots(slots, torch.cat(ids), pos)

    def _after_decode(self, req: SimRequest, ps: PassState) -> bool:
        """Hand a finished, aborted or retracted request to the manager; offload the others.
        Returns whether ``req`` keeps decoding."""
        rep, mgr, plan = ps.rep, self.mgr, req.plan
        n_out = len(req.output_ids)
        if n_out >= len(plan.output):
            req.finish()
            if plan.abort_at is not None:
                req.ending = "abort"
                rep.aborted += 1
                self.calls(mgr.finalize_release_on_finish, req)
            else:
                req.ending = "finish"
                rep.finished += 1
                if not self.calls(mgr.offload_kv_cache, req):
                    self.calls(mgr.finalize_release_on_finish, req)
        elif not req.retracted and plan.retract_at is not None and n_out >= plan.retract_at:
            req.retracted, req.ending = True, "retract"
            rep.retracted += 1
            self.calls(mgr.finalize_release_on_finish, req)
        else:
            self.calls(mgr.offload_kv_cache, req)
            return True
        ps.draining.append(req)
        return False

    # -- around the loop ---------------------------------------------------------------------
    def _report_progress(self, ps: PassState) -> None:
        now = time.perf_counter()
        if self.progress is None or now - self._last_progress < 0.1:
            return
        self._last_progress = now
        self.progress(Progress(ps.rep.name, ps.step, ps.done, ps.total, len(ps.running), len(ps.waiting),
                               self.mgr.stats().inflight_writes, self.stack.offloader.stats().pages_stored))

    def _drain(self, rep: PassReport) -> None:
        """Wait (bounded) until every copy landed, every storage op, backup and load finished.

        Copies (device -> host) are waited for up to ``drain_timeout_s``: their slots are freed only
        once they land. Storage work (storage ops, prompt backups, prefix loads) is waited for only
        while the tier works, by the deadline machinery the lookups use: once the tier's circuit
        breaker is not closed (down, or a probe hanging) or nothing of it finished for
        ``drain_stall_s``, what is still pending is cut off — counted in the report
        (``storage_ops_cut_off`` ...), abandoned by the bounded shutdown — instead of waited out.
        """
        t0 = time.perf_counter()
        deadline = t0 + self.cfg.drain_timeout_s
        breaker = getattr(self.stack.prefix_loader, "breaker", None)
        seen, stall_at = None, t0 + self.cfg.drain_stall_s
        while True:
            interrupt.check()
            self.calls.step_ns = 0
            self.calls(self.mgr.check_offload_progress)
            self.admission.poll_backups(rep)
            self.on_wait()
            now = time.perf_counter()
            pending = self.mgr.pending()
            copies = pending.copies or pending.finished_waiting or pending.unsettled
            storage = (pending.storage_ops, self.admission.backups_pending, self.admission.loader.idle())
            if not copies and self.mgr.idle() and self.admission.idle():
                rep.drain_end = "done"
                break
            if storage != seen:
                seen, stall_at = storage, now + self.cfg.drain_stall_s
            if now > deadline:
                rep.drained = not copies
                rep.drain_end = "timeout"
                if not self.admission.idle():
                    rep.error(f"{self.admission.backups_pending} prompt backups still running after the drain timeout")
                break
            if not copies:
                down = breaker is not None and breaker.state.value != "closed"
                if down or now > stall_at:
                    rep.drain_end = "tier down" if down else "tier stalled"
                    self._cut_off(rep)
                    break
            time.sleep(0.001)
        rep.drain_s = time.perf_counter() - t0

    def _cut_off(self, rep: PassReport) -> None:
        """Count the storage work the drain stops waiting for (it is abandoned at shutdown)."""
        ops = list(self.mgr._ledger.storage_ops.values())
        rep.storage_ops_cut_off = len(ops)
        rep.storage_pages_cut_off = sum(op.pages for op in ops)
        rep.backups_cut_off = self.admission.backups_pending
        rep.loads_cut_off = 0 if self.admission.loader.idle() else 1

    def _count_leaks(self, ps: PassState) -> None:
        """Every slot, row and host page back; the manager holds nothing unreleased."""
        rep = ps.rep
        free0, rows0, host0 = self.baseline
        rep.slots_leaked = free0 - self.stack.allocator.available_size()
        rep.rows_leaked = rows0 - self.rows.available_size()
        missing = (host0 - self.stack.host_pool.available_size()) // self.ps
        if rep.storage_ops_cut_off:  # pages the cut-off writes still hold now (freed if they ever end)
            rep.host_pages_cut_off = sum(op.host.shape[0] for op in self.mgr._ledger.storage_ops.values()) // self.ps
        rep.host_pages_leaked = missing - rep.host_pages_cut_off
        ps.waiting.clear()
        ps.running.clear()
        ps.draining.clear()
        gc.collect()
        s = self.mgr.stats()
        rep.manager_leaked = s.leaked - ps.before.manager.leaked
        rep.manager_unreleased = s.tracked
        try:
            self.stack.allocator.check_integrity()
        except Exception as err:  # noqa: BLE001 - reported, not raised
            rep.error(f"allocator integrity: {err}")
            rep.lifecycle_errors += 1

    def close(self, timeout: float | None = None) -> None:
        """Stop the prompt-backup worker (waiting at most ``timeout`` seconds)."""
        self.admission.close(timeout)
