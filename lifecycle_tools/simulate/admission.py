"""Admission: a row and a page reservation for each waiting request, its stored prefix loaded,
the rest of its prompt computed, and (standing in for the prefill node) its prompt backed up.

Admission reserves a request's worst-case pages (prompt + output + speculative slots) and waits
while rows or pages are short, so the allocator never runs dry mid-decode. Before computing a
prompt it looks up the prompt's leading full pages with the stack's ``PrefixLoader``; a lookup the
storage tier cannot answer (down, hung past the loader's deadline, behind an open breaker, or a loader that raises ``StorageError``) is a miss,
counted in ``prefix_lookups_failed``, never an error of the run. A load stages through free host
pages: stored pages beyond them (or all, when device slots or host pages are short) are not loaded
but computed, counted in ``prefix_pages_unstaged``. Lookups, loads and backups name pages under the
request's namespace (``SimRequest.seed``, the manager's ``namespace_of``), as the manager names the
pages it offloads: a LoRA or salted request finds only pages of its own namespace.
"""

from __future__ import annotations

import itertools

import torch

import hashing
from lifecycle_tools.simulate.calls import ManagerCalls
from lifecycle_tools.simulate.kvdata import SyntheticKV
from lifecycle_tools.simulate.report import PassReport
from lifecycle_tools.simulate.state import PassState, SimRequest
from transfer.errors import StorageError
from transfer.worker import BackgroundWorker

MAX_BACKUPS = 64   # prompt backups queued at most; beyond, a backup is skipped (storage too slow)


class Admission:
    """Admits requests into the running batch. Owns the prompt-backup worker (``close`` it)."""

    def __init__(self, cfg, stack, mgr, kv: SyntheticKV, calls: ManagerCalls) -> None:
        self.cfg, self.mgr, self.kv, self.calls = cfg, mgr, kv, calls
        self.ps, self.spec = cfg.page_size, cfg.spec_tokens
        self.alloc, self.rows, self.host = stack.allocator, stack.req_to_token_pool, stack.host_pool
        self.loader, self.storage = stack.prefix_loader, stack.storage
        self.total_pages = self.alloc.available_size() // self.ps
        self._backup = BackgroundWorker("prefill-backup", 1)
        self.backups_pending = 0
        self._load_ids = itertools.count(1)

    def ensure_slots(self, req: SimRequest, allocated: int) -> None:
        """Back ``[0, allocated)`` of the request's row with slots (from its reservation)."""
        need = -(-allocated // self.ps)
        if need > req.pages:
            slots = self.alloc.alloc((need - req.pages) * self.ps)
            if slots is None:  # the reservation makes this impossible
                raise RuntimeError(f"allocator ran dry for {req.rid} despite its reservation")
            row = req.kv.req_pool_idx
            self.rows.req_to_token[row, req.pages * self.ps: need * self.ps] = slots.to(torch.int32)
            req.pages = need
        req.kv.kv_allocated_len = allocated

    def try_admit(self, req: SimRequest, ps: PassState) -> bool:
        """Admit ``req`` if a row and its worst-case pages are free; False leaves it waiting."""
        need = -(-(req.plan.max_slots + self.spec) // self.ps)
        if ps.reserved + need > self.total_pages or self.rows.available_size() == 0:
            return False
        ps.reserved += need
        req.reserved, req.pages = need, 0
        req.kv.req_pool_idx = self.rows.alloc()
        ps.rep.rows_admitted += 1
        if not req.readmit:
            req.output_ids = [req.seq[len(req.origin_input_ids)]]  # the prefill node's first token
        req.kv.kv_committed_len = len(req.origin_input_ids) + len(req.output_ids) - 1
        if not (self.cfg.reuse and self._start_load(req, ps)):
            self.prefill(req, 0, ps)
        return True

    def _start_load(self, req: SimRequest, ps: PassState) -> bool:
        """Queue the load of the request's stored prefix; False when there is nothing to load."""
        rep = ps.rep
        full = req.kv.kv_committed_len // self.ps
        rep.prefix_lookups += 1
        rep.prefix_pages_looked_up += full
        staging = min(full, self.host.available_size() // self.ps)  # host pages to stage through
        load_id = next(self._load_ids)
        found = self.loader.stats().pages_found  # lookups run on this thread: the delta is this one's
        try:  # under the request's namespace: only pages stored under it are found
            got = self.loader.start(load_id, req.seq[: full * self.ps], req.seed, staging)
        except StorageError as err:
            rep.prefix_lookups_failed += 1
            if rep.prefix_lookups_failed == 1:
                rep.error(f"prefix lookup: {type(err).__name__}: {err} (counted as misses)")
            return False
        # stored pages beyond the free host pages, or all of them when slots are short (got None)
        rep.prefix_pages_unstaged += self.loader.stats().pages_found - found - (got or 0)
        if got is None:
            rep.prefix_loads_short += 1
        if not got:
            return False
        ps.loading[load_id] = req
        return True

    def finish_loads(self, ps: PassState) -> None:
        """Map each finished prefix load into its request's row, check it, and prefill the rest."""
        rep = ps.rep
        for done in self.loader.finished():
            req = ps.loading.pop(done.load_id)
            n = done.pages
            if n:
                self.rows.req_to_token[req.kv.req_pool_idx, : n * self.ps] = done.device_indices.to(torch.int32)
                req.pages = n
                rep.prefix_pages_hit += n
                rep.prefix_bytes_loaded += n * self.host.page_nbytes
                rep.prefix_pages_verified += n
                rep.prefix_mismatches += self.kv.mismatched_pages(done.device_indices, req.kvids, n)
            self.prefill(req, n * self.ps, ps)

    def prefill(self, req: SimRequest, loaded: int, ps: PassState) -> None:
        """Compute the KV not loaded, back up the prompt's pages, and start decoding (or readmit)."""
        committed = req.kv.kv_committed_len
        self.ensure_slots(req, committed + self.spec)
        self.kv.write_rows(req.kv.req_pool_idx, req.kvids, loaded, committed)
        ps.rep.prompt_tokens_computed += committed - loaded
        ps.prefill += committed - loaded
        if req.readmit:
            req.readmit = False
            ps.rep.readmitted += 1
            self.calls(self.mgr.readmit, req)
        else:
            first, last = loaded // self.ps, len(req.origin_input_ids) // self.ps
            if last > first:
                self._start_backup(req, first, last, ps)
        ps.running.append(req)

    def _start_backup(self, req: SimRequest, first: int, last: int, ps: PassState) -> None:
        if self.backups_pending >= MAX_BACKUPS:
            ps.rep.prefill_backup_failures += 1
            return
        tokens = req.seq[: last * self.ps]
        keys = hashing.page_hashes(tokens, self.ps, req.seed)   # the chain the manager continues
        kvids, storage, kv, ps_ = req.kvids, self.storage, self.kv, self.ps
        # the prefill node's pages: announced with their tokens and chain parent (KV events), and
        # declared now, before a decode chunk continuing them is announced (parents first)
        declared = None if storage.events is None else storage.events.writing(
            keys[first:last], tokens[first * ps_:last * ps_], keys[first - 1] if first else None)

        def job() -> int:
            try:
                start = max(first, storage.batch_exists(keys))
                if start >= last:
                    return 0
                pages = kv.page_bytes(kvids, start * ps_, last - start)
                return sum(storage.batch_set(keys[start:last], [pages[i] for i in range(last - start)]))
            finally:
                if declared is not None:
                    declared.end()

        self.backups_pending += 1
        try:
            self._backup.submit(req.rid, job)
        except BaseException:
            if declared is not None:
                declared.end()
            raise

    def poll_backups(self, rep: PassReport) -> None:
        """Count the prompt backups that finished."""
        for done in self._backup.poll():
            self.backups_pending -= 1
            if done.error is None:
                rep.prefill_backup_pages += done.value
            else:
                rep.prefill_backup_failures += 1
                rep.error(f"prefill backup of {done.tag}: {type(done.error).__name__}: {done.error}")

    def idle(self) -> bool:
        return self.backups_pending == 0 and self.loader.idle()

    def close(self, timeout: float | None = None) -> None:
        """Stop the prompt-backup worker, waiting at most ``timeout`` seconds (a backup stuck in a
        hung tier is left behind; the drain has counted it as cut off)."""
        self._backup.close(timeout)
