"""A CPU decode loop over SGLang-shaped pools, driving the integration the way SGLang 0.5.19's
scheduler does (``batch_result_processor._handle_finish_state_updated_req`` and
``process_decode_queue``). Classes come from a ``kit``: the doubles, or SGLang's own."""

from __future__ import annotations

import hashlib
import os
import time
from types import SimpleNamespace

import torch

from lifecycle_tools.testkit import sglang_doubles


def doubles_kit() -> SimpleNamespace:
    d = sglang_doubles
    return SimpleNamespace(
        name="doubles", Req=d.Req, ReqToTokenPool=d.ReqToTokenPool, MHATokenToKVPool=d.MHATokenToKVPool,
        MLATokenToKVPool=d.MLATokenToKVPool, Allocator=d.PagedTokenToKVPoolAllocator, TreeCache=d.ChunkCache)


def sglang_kit() -> SimpleNamespace:
    """SGLang's own pools, allocator, ``ReqKvInfo`` and ``free_kv_row_segments`` (raises ImportError
    without sglang). The request and tree cache stay doubles: SGLang's need a whole server."""
    from sglang.srt.managers.schedule_batch import ReqKvInfo
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.common import free_kv_row_segments
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool

    class Req(sglang_doubles.Req):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.kv = ReqKvInfo()

    class TreeCache(sglang_doubles.ChunkCache):
        def free_kv_row(self, kv, ranges):
            row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
            self.freed_rows.append((kv.req_pool_idx, list(ranges)))
            free_kv_row_segments(self.token_to_kv_pool_allocator, [(row[s:e], s) for s, e in ranges],
                                 swa_evicted_seqlen=swa_evicted_seqlen(kv))

    return SimpleNamespace(
        name="sglang", Req=Req, ReqToTokenPool=ReqToTokenPool, MHATokenToKVPool=MHATokenToKVPool,
        MLATokenToKVPool=MLATokenToKVPool, Allocator=PagedTokenToKVPoolAllocator, TreeCache=TreeCache)


def sglang_version() -> str | None:
    """The installed sglang's release (None without sglang)."""
    from lifecycle.integrations.sglang.versions import installed_version

    return installed_version()


def swa_evicted_seqlen(kv) -> int:
    """SGLang's SWA eviction cursor of a ``ReqKvInfo``: 0.5.19's ``swa_evicted_seqlen``, 0.5.23's
    ``get_evicted_seqlen(ComponentType.SWA)``."""
    if hasattr(kv, "swa_evicted_seqlen"):
        return kv.swa_evicted_seqlen
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return kv.get_evicted_seqlen(ComponentType.SWA)


def expected_kv(rid: str, positions: int, kinds: int, layers: int, heads: int, dim: int, dtype) -> torch.Tensor:
    """The KV a request's tokens get, deterministic per request: ``[positions, kinds, layers, heads, dim]``."""
    seed = int.from_bytes(hashlib.sha256(rid.encode()).digest()[:8], "little") & ((1 << 62) - 1)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((positions, kinds, layers, heads, dim), generator=gen).to(dtype)


class Node:
    """One decode node: SGLang's pools, a tree cache, and a manager built by ``make_manager``."""

    def __init__(self, kit, *, mla: bool = False, page_size: int = 4, layers: int = 3, heads: int = 2,
                 dim: int = 8, dtype=torch.bfloat16, tokens: int = 512, rows: int = 8, max_len: int = 160,
                 device: str = "cpu"):
        self.kit, self.mla, self.ps = kit, mla, page_size
        if mla:
            self.kv = kit.MLATokenToKVPool(tokens, page_size, dtype, dim - 2, 2, layers, device, False)
            self.kinds, self.heads = 1, 1
        else:
            self.kv = kit.MHATokenToKVPool(tokens, page_size, dtype, heads, dim, layers, device, False)
            self.kinds, self.heads = 2, heads
        self.layers, self.dim, self.dtype = layers, dim, dtype
        self.alloc = kit.Allocator(tokens, page_size, dtype, device, self.kv, False)
        self.pool = kit.ReqToTokenPool(rows, max_len, device, False)
        self.tree = kit.TreeCache(self.pool, self.alloc)
        self.expected: dict[str, torch.Tensor] = {}

    def admit(self, rid: str, prompt: list[int], max_new: int, prefix: int = 0):
        """Prefill on this node (as the transfer from the prefill node leaves it): a row, whole
        pages for the prompt, its KV written, the first token sampled."""
        req = self.kit.Req(rid, prompt, max_new)
        req.prefix_indices = torch.arange(prefix, dtype=torch.int64)
        if prefix:  # 0.5.19's accounting of a matched prefix (0.5.23's trees lock it instead)
            self.tree.protected_size_ += prefix
        assert self.pool.alloc([req]) is not None
        self.expected[rid] = expected_kv(rid, len(prompt) + max_new + 1, self.kinds, self.layers, self.heads,
                                         self.dim, self.dtype)
        self._grow(req, len(prompt))
        req.output_ids.append(1000 + len(prompt))
        return req

    def decode_tokens(self, req, n: int, token: int = 9) -> None:
        """``n`` decode steps of ``req`` without SGLang's offload calls: each a slot and its KV for
        the next position, then ``token`` sampled."""
        for _ in range(n):
            self._grow(req, req.kv.kv_committed_len + 1)
            req.output_ids.append(token)

    def _grow(self, req, n_tokens: int) -> None:
        """Slots for positions up to ``n_tokens`` as SGLang's paged allocator hands them out (a
        new page at each page boundary, else the next slot of the last page; ``kv_allocated_len``
        counts tokens), then their KV."""
        kv, table = req.kv, self.pool.req_to_token
        row = kv.req_pool_idx
        sglang_doubles.grow_row(table, self.alloc, kv, n_tokens, self.ps)
        loc = table[row, kv.kv_committed_len:n_tokens].long()
        values = self.expected[req.rid][kv.kv_committed_len:n_tokens].to(loc.device)
        store = self.kv.store_dtype  # fp8 is stored as uint8: set_kv_buffer writes a bit view
        values = values if store == self.dtype else values.view(store)
        for layer in range(self.layers):  # what set_kv_buffer stores for an unquantized pool
            if self.mla:
                self.kv.kv_buffer[layer][loc] = values[:, 0, layer]
            else:
                self.kv.k_buffer[layer][loc] = values[:, 0, layer]
                self.kv.v_buffer[layer][loc] = values[:, 1, layer]
        kv.kv_committed_len = n_tokens

    def decode_step(self, mgr, running: list) -> list:
        """One decode step for ``running``, then SGLang's offload calls; the still-running ones."""
        for req in running:
            self._grow(req, req.kv.kv_committed_len + 1)
            req.output_ids.append(1000 + req.kv.kv_committed_len)
            if len(req.output_ids) >= req.max_new_tokens:
                req.finished_reason = "length"
        for req in running:  # _handle_finish_state_updated_req
            if not req.finished():
                mgr.offload_kv_cache(req)
            elif not mgr.offload_kv_cache(req):
                mgr.finalize_release_on_finish(req)
        mgr.check_offload_progress()  # process_decode_queue, next iteration
        return [r for r in running if not r.finished()]

    def drain(self, mgr, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not mgr.idle():
            assert time.monotonic() < deadline, "offload did not drain"
            mgr.check_offload_progress()
            time.sleep(0.001)
        mgr.check_offload_progress()

    def page_bytes(self, rid: str, start: int) -> bytes:
        """The stored bytes SGLang's page-first host page holds for positions ``[start, start + ps)``."""
        kv = self.expected[rid][start:start + self.ps]          # [ps, kinds, layers, heads, dim]
        return kv.permute(1, 0, 2, 3, 4).contiguous().view(torch.uint8).numpy().tobytes()


def hicache_file_suffix(model: str, tp_rank: int, tp_size: int, mla: bool) -> str:
    """``HiCacheFile.__init__``'s ``config_suffix`` (no pipeline or attention-CP parallelism)."""
    suffix = "_" + "-".join(model.split("/"))
    return suffix if mla else suffix + f"_{tp_rank}_{tp_size}"


def hicache_file_get(directory: str, key: str, suffix: str, nbytes: int) -> bytes | None:
    """What ``HiCacheFile.get`` reads for ``key``: ``{key}{suffix}.bin``, raw bytes, exact size."""
    path = os.path.join(directory, f"{key}{suffix}.bin")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return data if len(data) == nbytes else None


REQUIRE_ENV = "KV_LIFECYCLE_REQUIRE_SGLANG"


def tiny_llama(directory) -> str:
    """A tiny Llama ``config.json`` in ``directory/model`` (3 layers, 2 heads of 32, bf16): enough for
    SGLang's ``ServerArgs`` to resolve a model; its path."""
    import json
    from pathlib import Path

    model = Path(directory) / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 2, "num_hidden_layers": 3, "intermediate_size": 128, "vocab_size": 1000,
        "max_position_embeddings": 512, "head_dim": 32, "torch_dtype": "bfloat16"}))
    return str(model)


def start_scheduler_process(args) -> None:
    """What a decode scheduler process sets up before building its managers: ``args`` published as
    the runtime context (0.5.23 also with this process's rank placement) and gloo model-parallel
    groups of one rank. Undo with ``stop_scheduler_process``."""
    import inspect

    from sglang.srt import runtime_context
    from sglang.srt.distributed import parallel_state as ps

    from lifecycle_tools.testkit.redis_server import free_port

    if "ranks" in inspect.signature(runtime_context.publish).parameters:  # 0.5.23: this process's place
        runtime_context.publish(args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=0))
    else:
        runtime_context.publish(args, role="scheduler")
    ps.init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                    distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    ps.initialize_model_parallel(backend="gloo")


def stop_scheduler_process() -> None:
    """Undo ``start_scheduler_process``."""
    from sglang.srt import runtime_context
    from sglang.srt.distributed import parallel_state as ps

    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()
    runtime_context.reset_context()


def require_sglang() -> None:
    """Skip the calling test when sglang does not import here, unless ``KV_LIFECYCLE_REQUIRE_SGLANG=1``
    (set by ``.ci/sglang-env``): then a missing sglang fails the test instead of skipping it."""
    import pytest

    try:
        import sglang.srt.mem_cache.memory_pool  # noqa: F401
    except ImportError as err:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but sglang does not import: {err}")
        pytest.skip(f"sglang is not importable here ({err})")
