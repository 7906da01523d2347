"""Two reference implementations of the same offload algorithm, for bench_manager.py only.

``PlainDictManager``: the algorithm with plain dicts and counters: no state machine, no logging,
no checks beyond what the algorithm needs. ``AsWrittenManager``: the same, written the way SGLang
0.5.19 writes it (builds ``origin_input_ids + output_ids[:-1]`` on every call, hashes at landing).
"""

from __future__ import annotations

import itertools
from weakref import WeakKeyDictionary

import torch

from hashing import page_hashes


class _Progress:
    __slots__ = ("inc_len", "last_hash")

    def __init__(self, last_hash):
        self.inc_len, self.last_hash = 0, last_hash


class PlainDictManager:
    def __init__(self, req_to_token_pool, allocator, page_size, offloader):
        self.pool, self.alloc, self.page_size, self.off = req_to_token_pool, allocator, page_size, offloader
        self.stride = page_size
        self.state = WeakKeyDictionary()
        self.inflight = WeakKeyDictionary()
        self.ongoing, self.backup = {}, {}
        self.ids = itertools.count(1)

    def offload_kv_cache(self, req) -> bool:
        ps = self.page_size
        st = self.state.get(req)
        if st is None:
            origin = req.origin_input_ids
            p = len(origin) - len(origin) % ps
            names = page_hashes(origin[:p], ps)
            st = self.state[req] = _Progress(names[-1] if names else None)
        n_in, n_out = len(req.origin_input_ids), len(req.output_ids)
        if n_out == 0:
            return False
        new = n_in + n_out - 1 - (n_in - n_in % ps) - st.inc_len
        if new < self.stride:
            return False
        n = new - new % self.stride
        start = n_in - n_in % ps + st.inc_len
        end = start + n
        origin, out = req.origin_input_ids, req.output_ids
        if end <= n_in:
            tokens = origin[start:end]
        elif start >= n_in:
            tokens = out[start - n_in:end - n_in]
        else:
            tokens = origin[start:] + out[:end - n_in]
        hashes = page_hashes(tokens, ps, st.last_hash)
        indices = self.pool.req_to_token[req.kv.req_pool_idx, start:end].to(torch.int64, copy=True)
        ack = next(self.ids)
        host = self.off.write(indices, ack)
        if host is None:
            return False
        self.ongoing[ack] = (req, host, tokens, hashes)
        self.inflight[req] = self.inflight.get(req, 0) + 1
        st.inc_len += n
        st.last_hash = hashes[-1]
        return True

    def check_offload_progress(self):
        for ack in self.off.finished_writes().landed:
            req, host, tokens, hashes = self.ongoing.pop(ack)
            left = self.inflight[req] - 1
            if left:
                self.inflight[req] = left
            else:
                del self.inflight[req]
            self.backup[self.off.write_storage(host, tokens, hashes)] = host
            if req.finished() and not left:
                self._release_finished_req(req)
        for op in self.off.finished_storage():
            self.off.free_host(self.backup.pop(op))

    def finalize_release_on_finish(self, req):
        if self.inflight.get(req, 0):
            return
        self._release_finished_req(req)

    def _release_finished_req(self, req):
        kv = req.kv
        if kv.req_pool_idx is None:
            return
        committed, allocated = kv.kv_committed_len, kv.kv_allocated_len
        row = self.pool.req_to_token[kv.req_pool_idx]
        self.alloc.free(row[:committed].to(torch.int64))
        tail = -(-committed // self.page_size) * self.page_size
        if tail < allocated:
            self.alloc.free(row[tail:allocated].to(torch.int64))
        self.pool.free(req)
        self.state.pop(req, None)


class AsWrittenManager(PlainDictManager):
    """SGLang 0.5.19's shape: the token list rebuilt on every call, chain extended at landing."""

    def offload_kv_cache(self, req) -> bool:
        if req.kv.req_pool_idx == -1 or len(req.output_ids) == 0:
            return False
        token_indices = self.pool.req_to_token[req.kv.req_pool_idx]
        if token_indices.dim() == 0 or token_indices.numel() == 0:
            return False
        all_tokens = req.origin_input_ids + req.output_ids[:-1]
        ps = self.page_size
        prefill = len(req.origin_input_ids) // ps * ps
        st = self.state.get(req)
        if st is None:
            names = page_hashes(req.origin_input_ids[:prefill], ps)
            st = self.state[req] = _Progress(names[-1] if prefill > 0 else None)
        new = len(all_tokens) - prefill - st.inc_len
        aligned = new // self.stride * self.stride
        if aligned == 0:
            return False
        start = prefill + st.inc_len
        end = start + aligned
        tokens = all_tokens[start:end]
        indices = token_indices[start:end]
        ack = next(self.ids)
        host = self.off.write(indices.long(), ack)
        if host is None:
            return False
        self.inflight[req] = self.inflight.get(req, 0) + 1
        self.ongoing[ack] = (req, host, tokens, None)
        st.inc_len += aligned
        return True

    def check_offload_progress(self):
        for ack in self.off.finished_writes().landed:
            req, host, tokens, _ = self.ongoing.pop(ack)
            left = self.inflight[req] - 1
            if left:
                self.inflight[req] = left
            else:
                del self.inflight[req]
            st = self.state.get(req)
            prior = st.last_hash if st is not None else None
            hashes = page_hashes(tokens, self.page_size, prior)
            self.backup[self.off.write_storage(host, tokens, hashes)] = host
            if st is not None:
                st.last_hash = hashes[-1] if hashes else prior
            if req.finished() and not left:
                self._release_finished_req(req)
        for op in self.off.finished_storage():
            self.off.free_host(self.backup.pop(op))
