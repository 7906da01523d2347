"""Doubles of SGLang 0.5.19's scheduler-side objects, written from its source, for tests without
sglang installed. Same names, constructor signatures, attributes and behaviour as the originals
for everything the decode offload path touches; strict where SGLang only checks in debug mode
(a double free of a device page raises).

Sources (``sglang/srt/...`` in the 0.5.19 wheel): ``managers/schedule_batch.py`` (``ReqKvInfo``,
``Req``), ``mem_cache/memory_pool.py`` (``ReqToTokenPool``, ``MHATokenToKVPool``,
``MLATokenToKVPool``), ``mem_cache/allocator/{base,paged}.py`` (``PagedTokenToKVPoolAllocator``),
``mem_cache/base_prefix_cache.py`` + ``mem_cache/common.py`` (``free_kv_row``), ``mem_cache/
chunk_cache.py`` (``protected_size_``), ``runtime_context.py`` (the getters).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


class ReqKvInfo:
    """``schedule_batch.ReqKvInfo``: the device KV a request holds outside the prefix cache."""

    def __init__(self) -> None:
        self.req_pool_idx: int | None = None
        self.cache_protected_len = 0
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.swa_evict_floor = 0
        self.swa_evicted_seqlen = 0

    @property
    def holds_kv(self) -> bool:
        return self.req_pool_idx is not None

    @property
    def is_kv_released(self) -> bool:
        return self.kv_allocated_len == 0 and self.swa_evicted_seqlen == 0

    def mark_kv_released(self) -> None:
        self.kv_allocated_len = 0
        self.swa_evicted_seqlen = 0


class Req:
    """The part of ``schedule_batch.Req`` the decode offload path reads."""

    def __init__(self, rid: str, origin_input_ids: list[int], max_new_tokens: int = 16) -> None:
        self.rid = rid
        self.origin_input_ids = list(origin_input_ids)
        self.output_ids: list[int] = []
        self.kv = ReqKvInfo()
        self.prefix_indices = torch.empty((0,), dtype=torch.int64)
        self.finished_reason = None
        self.is_retracted = False
        self.max_new_tokens = max_new_tokens

    def finished(self) -> bool:
        return self.finished_reason is not None

    def reset_for_retract(self) -> None:
        """``Req.reset_for_retract`` (the KV parts): after ``release_kv_cache``."""
        self.prefix_indices = torch.empty((0,), dtype=torch.int64)
        self.kv.cache_protected_len = 0
        self.is_retracted = True
        assert not self.kv.holds_kv, "expect it is already released"
        self.kv.kv_committed_len = 0

    def effective_kv_committed_len(self) -> int:
        return self.kv.kv_committed_len


class ReqToTokenPool:
    """``memory_pool.ReqToTokenPool``: row 0 is padding; ``free(req)`` asserts a row, sets it None."""

    def __init__(self, size: int, max_context_len: int, device: str, enable_memory_saver: bool) -> None:
        self.size = size
        self._alloc_size = size + 1
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros((self._alloc_size, max_context_len), dtype=torch.int32, device=device)
        self.free_slots = list(range(1, self._alloc_size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, reqs: list) -> list[int] | None:
        fresh = [r for r in reqs if not r.kv.holds_kv]
        if len(fresh) > len(self.free_slots):
            return None
        for r in fresh:
            r.kv.req_pool_idx = self.free_slots.pop()
        return [r.kv.req_pool_idx for r in reqs]

    def free(self, req) -> None:
        assert req.kv.holds_kv, "request must have req_pool_idx"
        assert req.kv.req_pool_idx not in self.free_slots, "row freed twice"
        self.free_slots.append(req.kv.req_pool_idx)
        req.kv.req_pool_idx = None


class KVCache:
    """``memory_pool.KVCache``'s common attributes (fp8 is stored as uint8)."""

    layer_shard_enabled = False

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, layer_num: int, device: str,
                 enable_memory_saver: bool, start_layer: int | None = None, end_layer: int | None = None) -> None:
        self.size, self.page_size, self.dtype, self.device = size, page_size, dtype, device
        fp8 = (torch.float8_e5m2, torch.float8_e4m3fn, torch.float8_e4m3fnuz)
        self.store_dtype = torch.uint8 if dtype in fp8 else dtype
        self.layer_num = layer_num
        self.start_layer = start_layer or 0
        self.end_layer = end_layer or layer_num - 1


class MHATokenToKVPool(KVCache):
    """``memory_pool.MHATokenToKVPool`` (NHD layout): per-layer ``[size + page_size, heads, dim]``."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 layer_num: int, device: str, enable_memory_saver: bool, v_head_dim: int | None = None,
                 start_layer: int | None = None, end_layer: int | None = None) -> None:
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer)
        self.head_num, self.head_dim = head_num, head_dim
        self.v_head_dim = v_head_dim if v_head_dim is not None else head_dim
        self.kv_cache_layout, self.use_hnd = "nhd", False
        self.k_scale_buffer = self.v_scale_buffer = None
        rows = size + page_size
        self.k_buffer = [torch.zeros((rows, head_num, head_dim), dtype=self.store_dtype, device=device)
                         for _ in range(layer_num)]
        self.v_buffer = [torch.zeros((rows, head_num, self.v_head_dim), dtype=self.store_dtype, device=device)
                         for _ in range(layer_num)]


class MLATokenToKVPool(KVCache):
    """``memory_pool.MLATokenToKVPool``: per-layer ``[size + page_size, 1, kv_lora_rank + rope]``."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, kv_lora_rank: int, qk_rope_head_dim: int,
                 layer_num: int, device: str, enable_memory_saver: bool, start_layer: int | None = None,
                 end_layer: int | None = None) -> None:
        super().__init__(size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer)
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.kv_buffer = [torch.zeros((size + page_size, 1, self.kv_cache_dim), dtype=self.store_dtype, device=device)
                          for _ in range(layer_num)]


class PagedTokenToKVPoolAllocator:
    """``allocator.paged.PagedTokenToKVPoolAllocator`` (``need_sort=False`` path) with its debug
    check always on: freeing a page that is already free raises."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device: str, kvcache, need_sort: bool) -> None:
        self.size, self.page_size, self.dtype, self.device = size, page_size, dtype, device
        self._kvcache, self.need_sort = kvcache, need_sort
        self.num_pages = size // page_size
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=device)
        self.release_pages = torch.empty((0,), dtype=torch.int64, device=device)

    def get_kvcache(self):
        return self._kvcache

    def available_size(self) -> int:
        return (len(self.free_pages) + len(self.release_pages)) * self.page_size

    def alloc(self, need_size: int) -> torch.Tensor | None:
        assert need_size % self.page_size == 0, "The allocation size should be page-aligned"
        n = need_size // self.page_size
        if n > len(self.free_pages):
            return None
        out, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return (out[:, None] * self.page_size + torch.arange(self.page_size, device=self.device)).reshape(-1)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        pages = torch.unique(free_index // self.page_size)
        merged = torch.cat((pages, self.free_pages))
        assert len(torch.unique(merged)) == len(merged), "a page was freed twice"
        assert int(pages.min()) >= 1 and int(pages.max()) <= self.num_pages, "page outside the pool"
        self.free_pages = merged

    def free_full(self, free_index: torch.Tensor) -> None:
        self.free(free_index)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self.free(free_index)

    def free_segments(self, segments) -> None:
        """``BaseTokenToKVPoolAllocator.free_segments``: a boundary page shared by consecutive
        segments is freed once (the later segment's head is trimmed)."""
        ps, prev_end = self.page_size, None
        for free_index, start_pos in segments:
            n = free_index.numel()
            if n == 0:
                continue
            seg_end = start_pos + n
            if prev_end is not None and start_pos // ps == (prev_end - 1) // ps:
                boundary = (start_pos // ps + 1) * ps
                free_index = free_index[boundary - start_pos:]
                start_pos = boundary
            prev_end = seg_end
            self.free_segment(free_index, start_pos=start_pos)


class ChunkCache:
    """A prefix cache with SGLang's ``free_kv_row`` (``BasePrefixCache``) and ``protected_size_``.
    Records every ``free_kv_row`` call in ``freed_rows`` as ``(row, ranges)``."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool_allocator) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.protected_size_ = 0
        self.freed_rows: list[tuple[int, list[tuple[int, int]]]] = []

    def free_kv_row(self, kv: ReqKvInfo, ranges: list[tuple[int, int]]) -> None:
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        self.freed_rows.append((kv.req_pool_idx, list(ranges)))
        free_kv_row_segments(self.token_to_kv_pool_allocator, [(row[s:e], s) for s, e in ranges],
                             swa_evicted_seqlen=kv.swa_evicted_seqlen)


def release_kv_cache(req: Req, tree_cache: ChunkCache, is_insert: bool = True) -> None:
    """``mem_cache.common.release_kv_cache`` over a ``ChunkCache`` (no speculative decoding, no
    mamba): ``cache_finished_req`` frees ``[cache_protected_len, committed)``, then the row."""
    assert (not req.kv.holds_kv) == req.kv.is_kv_released
    assert req.kv.holds_kv, "Only MambaRadixCache allow freeing before alloc"
    committed = req.effective_kv_committed_len()
    tree_cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, committed)])
    assert committed == req.kv.kv_allocated_len, "Unexpected overallocated KV cache"
    tree_cache.req_to_token_pool.free(req)
    req.kv.mark_kv_released()


def free_kv_row_segments(allocator, segments, *, swa_evicted_seqlen: int) -> None:
    """``mem_cache.common.free_kv_row_segments``: split at the SWA eviction floor, then free."""
    dead, alive = [], []
    for kv_indices, start_pos in segments:
        n = kv_indices.numel()
        if n == 0:
            continue
        n_dead = min(max(swa_evicted_seqlen - start_pos, 0), n)
        if n_dead > 0:
            dead.append(kv_indices[:n_dead])
        if n_dead < n:
            alive.append((kv_indices[n_dead:], start_pos + n_dead))
    if dead:
        allocator.free_full(torch.cat(dead))
    if alive:
        allocator.free_segments(alive)


def runtime_context(*, page_size: int = 16, backend: str | None = "file", model: str = "org/model",
                    layout: str = "page_first", io_backend: str = "kernel", ratio: float | None = 2.0,
                    size_gb: float = 0, extra_config: str | None = None, pp_rank: int = 0, pp_size: int = 1,
                    dcp_enabled: bool = False) -> SimpleNamespace:
    """An object with ``runtime_context``'s four getters returning namespace bags of SGLang's
    field names (defaults: SGLang's, with the file backend and a 2.0 host ratio), declaring
    ``sglang_version`` 0.5.19: the release whose classes these doubles imitate."""
    schedule = SimpleNamespace(page_size=page_size)
    memory = SimpleNamespace(
        hicache_storage_backend=backend, hicache_storage_backend_extra_config=extra_config,
        hicache_io_backend=io_backend, hicache_mem_layout=layout, hicache_ratio=ratio, hicache_size=size_gb)
    serving = SimpleNamespace(served_model_name=model)
    parallel = SimpleNamespace(pp_rank=pp_rank, pp_size=pp_size, dcp_enabled=dcp_enabled)
    return SimpleNamespace(get_schedule=lambda: schedule, get_memory=lambda: memory,
                           get_serving=lambda: serving, get_parallel=lambda: parallel, sglang_version="0.5.19")


def grow_row(table, alloc, kv, n_tokens: int, page: int) -> None:
    """Slots for ``kv``'s row (``table[kv.req_pool_idx]``) at positions up to ``n_tokens``, as
    SGLang's paged allocator hands them out: a new page (``alloc.alloc(page)``) at each page
    boundary, else the next slot of the last page; ``kv.kv_allocated_len`` grows to ``n_tokens``
    (never shrinks). The KV and ``kv_committed_len`` are the caller's."""
    row = kv.req_pool_idx
    for pos in range(kv.kv_allocated_len, n_tokens):
        if pos % page == 0:
            slots = alloc.alloc(page)
            assert slots is not None, "device pool exhausted"
            table[row, pos] = int(slots[0])
        else:
            table[row, pos] = int(table[row, pos - 1]) + 1
    kv.kv_allocated_len = max(kv.kv_allocated_len, n_tokens)

