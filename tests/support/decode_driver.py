"""A decode scheduler driving ``DecodeOffloadManager`` over a real ``transfer`` stack, with real
(deterministic) KV: shared by the Redis fault test and the cross-node test."""

from __future__ import annotations

import time

import torch

import hashing
from lifecycle import DecodeOffloadManager
from lifecycle_tools.testkit.doubles import Req
from lifecycle_tools.testkit.kv_pattern import synthetic_kv

PS, LAYERS, HEADS, DIM, ROWS, MAX_LEN = 4, 2, 2, 8, 8, 64


def page_first(kv_vals: torch.Tensor) -> torch.Tensor:
    """Device-order KV ``[kinds, layers, ps, heads, dim]`` -> the host page's bytes."""
    return kv_vals.permute(0, 2, 1, 3, 4).contiguous().view(torch.uint8).reshape(-1)


class Scheduler:
    """SGLang's decode-scheduler call pattern over a real stack, with real KV in the device pool.

    Slots cover exactly the positions that have KV (``origin_input_ids + output_ids[:-1]``);
    KV at position p of request r is ``synthetic_kv(pool, r, p)``.
    """

    def __init__(self, stack):
        self.stack = stack
        self.mgr = DecodeOffloadManager.from_stack(stack)
        self.running: list[Req] = []
        self.done: list[Req] = []
        self.slots: dict[int, torch.Tensor] = {}
        self.tokens: dict[int, list[int]] = {}

    def _ensure_slots(self, req, n: int) -> None:
        have = self.slots[req.rid]
        while have.numel() < n:
            got = self.stack.allocator.alloc(PS)
            assert got is not None, "device pool exhausted"
            have = torch.cat([have, got])
        self.slots[req.rid] = have
        self.stack.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : have.numel()] = have.to(torch.int32)

    def _write_kv(self, req, start: int, end: int) -> None:
        slots = self.slots[req.rid][start:end]
        self.stack.kv_pool.write(slots, synthetic_kv(self.stack.kv_pool, req.rid, torch.arange(start, end)))

    def admit(self, rid: int, prompt: list[int], first_token: int) -> Req:
        row = self.stack.req_to_token_pool.alloc()
        req = Req(rid, prompt, row, outputs=(first_token,))
        self.slots[rid] = torch.empty(0, dtype=torch.int64)
        self._ensure_slots(req, len(prompt))
        self._write_kv(req, 0, len(prompt))  # the prefill node's KV, arrived with the request
        self.running.append(req)
        return req

    def step(self, token: int) -> None:
        """One decode step for every running request, then the offload calls."""
        for req in self.running:
            pos = req.kv.kv_committed_len  # the last sampled token gets its KV now
            self._ensure_slots(req, pos + 1)
            self._write_kv(req, pos, pos + 1)
            req.decode(token + req.rid)
        for req in self.running:
            self.mgr.offload_kv_cache(req)
        self.mgr.check_offload_progress()

    def finish(self, req: Req) -> None:
        req.finish()
        self.running.remove(req)
        self.done.append(req)
        if not self.mgr.offload_kv_cache(req):
            self.mgr.finalize_release_on_finish(req)
        self.mgr.check_offload_progress()

    def settle(self, timeout: float = 10.0) -> None:
        """Poll (bounded) until every copy and storage op has completed."""
        deadline = time.monotonic() + timeout
        while True:
            self.mgr.check_offload_progress()
            if self.mgr.idle() and self.stack.offloader.idle():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not idle after {timeout}s: {self.mgr.stats()}")
            time.sleep(0.002)

    def kv_pages(self, req) -> list[tuple[str, torch.Tensor]]:
        """(hash, expected host-page bytes) of every decode-side page the request can have stored."""
        tokens = req.origin_input_ids + req.output_ids[:-1]
        n = len(tokens) // PS
        hashes = hashing.page_hashes(tokens[: n * PS], PS)
        first = len(req.origin_input_ids) // PS
        pool = self.stack.kv_pool
        return [(hashes[i], page_first(synthetic_kv(pool, req.rid, torch.arange(i * PS, (i + 1) * PS))))
                for i in range(first, n)]

    def backup_prompt(self, req) -> int:
        """Stand in for the prefill node: store the request's whole prompt pages ``[0, P)``."""
        n = len(req.origin_input_ids) // PS
        if n == 0:
            return 0
        hashes = hashing.page_hashes(req.origin_input_ids[: n * PS], PS)
        pages = [page_first(self.stack.kv_pool.read(self.slots[req.rid][i * PS:(i + 1) * PS]))
                 for i in range(n)]
        assert all(self.stack.storage.batch_set(hashes, pages))
        return n
