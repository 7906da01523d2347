"""Issue 20, point 5: SGLang's own classes end to end, on CPU, in whichever tested release is
installed (0.5.19 or 0.5.23; run by ``.ci/sglang-env``; skipped without sglang, failed under
``KV_LIFECYCLE_REQUIRE_SGLANG=1``).

SGLang's ``ServerArgs`` (PD decode + decode offload, resolved by SGLang itself) published as the
scheduler's runtime context, its gloo model-parallel groups (world of one), its ``ReqToTokenPool``,
``MHATokenToKVPool`` / ``MLATokenToKVPool``, ``PagedTokenToKVPoolAllocator``, its decode tree
caches (0.5.19: ``ChunkCache`` and ``RadixCache``; 0.5.23: ``UnifiedRadixCache`` disabled and
enabled), real ``Req`` objects, and our manager switched in by ``KV_LIFECYCLE_SGLANG=1`` +
SGLang's own ``load_plugins()`` and constructed by the name ``sglang.srt.managers.scheduler``
holds. Checked: slots, rows, ``protected_size_``, ``ongoing_offload``, and SGLang's ``HiCacheFile``
reading every page bit-exact.
"""

from __future__ import annotations

from array import array

import pytest
import torch

from tests.integrations.sglang_kit import (
    Node, require_sglang, sglang_kit, sglang_version, start_scheduler_process, stop_scheduler_process, tiny_llama,
)
from tests.integrations.test_sglang import expected_pages

MODEL = "org/Tiny-Llama"


@pytest.fixture
def sglang_scheduler(tmp_path, monkeypatch):
    """SGLang's ServerArgs resolved and published as in a decode scheduler process, its model-parallel
    groups (gloo, one rank), and ours installed by SGLang's plugin loader."""
    require_sglang()
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    from lifecycle.integrations.sglang import uninstall

    model = tiny_llama(tmp_path)
    store = tmp_path / "hicache"
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(store))
    monkeypatch.delenv("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", raising=False)
    monkeypatch.setenv("KV_LIFECYCLE_SGLANG", "1")
    args = ServerArgs(model_path=model, skip_tokenizer_init=True, device="cpu", page_size=4,
                      served_model_name=MODEL, disaggregation_mode="decode",
                      disaggregation_decode_enable_offload_kvcache=True, hicache_storage_backend="file",
                      hicache_io_backend="kernel", hicache_mem_layout="page_first")
    start_scheduler_process(args)
    load_plugins()  # what run_scheduler_process does first
    from lifecycle.integrations.sglang import installed

    if not installed():  # SGLang loads plugins once per process: the earlier test's load ran ours already
        from importlib.metadata import entry_points

        (plugin,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kv_lifecycle"]
        plugin.load()()  # what load_plugins() does with each entry point
    import sglang.srt.managers.scheduler as scheduler

    try:
        yield scheduler, str(store)
    finally:
        uninstall()
        stop_scheduler_process()


def real_kit(tree: str):
    """SGLang's pools and allocator (``sglang_kit``), its Req and its tree caches: ``chunk`` is the
    cache a decode server without radix caching builds (0.5.19 ``ChunkCache``, 0.5.23 a disabled
    ``UnifiedRadixCache``), ``radix`` the radix cache (0.5.19 ``RadixCache``, 0.5.23 ``UnifiedRadixCache``)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.sampling.sampling_params import SamplingParams

    kit = sglang_kit()

    def make_req(rid, prompt, max_new):
        req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=max_new))
        req.max_new_tokens = max_new  # what the kit's decode step reads
        return req

    def make_tree(pool, alloc):
        params = dict(disable=tree == "chunk", req_to_token_pool=pool, token_to_kv_pool_allocator=alloc,
                      page_size=alloc.page_size)
        if sglang_version() == "0.5.23":
            from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

            tree_cache = UnifiedRadixCache(CacheInitParams(**params, tree_components=(ComponentType.FULL,)))
        else:
            from sglang.srt.mem_cache.chunk_cache import ChunkCache
            from sglang.srt.mem_cache.radix_cache import RadixCache

            tree_cache = (ChunkCache if tree == "chunk" else RadixCache)(CacheInitParams(**params))
        tree_cache.freed_rows = []
        return tree_cache

    kit.Req, kit.TreeCache, kit.name = make_req, make_tree, f"sglang-{tree}"
    return kit


def construct(scheduler, node):
    """``Scheduler.__init__``: the class the scheduler module names, keyword for keyword."""
    return scheduler.DecodeKVCacheOffloadManager(
        req_to_token_pool=node.pool, token_to_kv_pool_allocator=node.alloc,
        tp_group=None, tree_cache=node.tree)


def sglang_reads(store: str, mla: bool, node: Node, mgr, reqs) -> int:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    sglang_file = HiCacheFile(HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=MODEL))
    assert sglang_file.file_path == store
    nbytes, n = mgr.decode_host_mem_pool.page_nbytes, 0
    for req in reqs:
        for page_hash, data in expected_pages(node, req, mgr.offload_stride):
            target = torch.empty(nbytes, dtype=torch.uint8)
            assert sglang_file.get(page_hash, target) is not None, (req.rid, page_hash)
            assert target.numpy().tobytes() == data
            n += 1
    return n


@pytest.mark.parametrize("tree", ["chunk", "radix"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_a_mixed_run_inside_sglang_gives_every_slot_row_and_protected_token_back(sglang_scheduler, tree, mla):
    """Decode, a retraction (SGLang's release_kv_cache through our hook; on 0.5.23 after its
    scheduler's ``drain_before_retraction()``) and its resume with a new row, an abort, speculative
    over-allocation; with the radix cache a locked prefix keeps the tree's protected size non-zero
    until its request is released (0.5.19: ``protected_size_`` and ``prefix_indices``; 0.5.23: the
    prefix inserted into the tree, locked as ``req.lock`` with ``kv.cache_protected_len`` — released
    by unlocking, its slots the tree's)."""
    import sglang.srt.mem_cache.common as common
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from lifecycle.integrations.sglang import DecodeKVCacheOffloadManager

    scheduler, store = sglang_scheduler
    assert scheduler.DecodeKVCacheOffloadManager is DecodeKVCacheOffloadManager  # load_plugins switched it
    node = Node(real_kit(tree), mla=mla, page_size=4)
    free_pages, free_rows, protected = node.alloc.available_size(), node.pool.available_size(), 0
    mgr = construct(scheduler, node)
    assert mgr.config.mem_layout == "page_first" and mgr.config.host_ratio == 2.0  # as SGLang resolves decode
    a = node.admit("a", list(range(10, 23)), 11)
    b = node.admit("b", list(range(50, 58)), 14)
    c = node.admit("c", [7] * 5, 9)
    v23 = sglang_version() == "0.5.23"
    tree_owned = 0  # slots the tree holds at the end (0.5.23: a's inserted prefix page)
    if tree == "radix" and v23:  # a's first page inserted and locked, as the prealloc match locks it
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        first = node.pool.req_to_token[a.kv.req_pool_idx, :4].to(torch.int64)
        node.tree.insert(InsertParams(key=RadixKey(array("q", a.origin_input_ids[:4])), value=first))
        match = node.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", a.origin_input_ids[:4]))))
        assert match.device_prefix_len == 4
        a.lock, a.kv.cache_protected_len = node.tree.lock(match.last_device_node), 4
        protected = tree_owned = 4
    elif tree == "radix":  # a's first page locked in the radix tree, as a matched prefix is
        node.tree.protected_size_ += 4
        a.prefix_indices = torch.arange(4, dtype=torch.int64)
        protected = 4

    def protected_size():
        return node.tree.protected_size() if v23 else node.tree.protected_size_

    running = [a, b, c]
    for _ in range(5):
        running = node.decode_step(mgr, running)
    assert protected_size() == protected
    # retract b (retract_decode -> release_req -> release_kv_cache, through our hook), resume it
    if v23:
        mgr.drain_before_retraction()  # what 0.5.23's scheduler calls before retract_decode
        assert not mgr.has_inflight_device_transfer()
        common.release_kv_cache(b, node.tree, checkpoint=False)
    else:
        common.release_kv_cache(b, node.tree, is_insert=False)
    b.reset_for_retract()
    running.remove(b)
    assert b.kv.req_pool_idx is None
    node.pool.alloc([b])
    node._grow(b, len(b.origin_input_ids) + len(b.output_ids) - 1)
    running.append(b)
    # abort c with speculative over-allocation: two pages reserved past its committed page
    node._grow(c, c.kv.kv_committed_len + 1)
    c.output_ids.append(1)
    row, end = c.kv.req_pool_idx, (c.kv.kv_committed_len + 3) // 4 * 4
    node.pool.req_to_token[row, end:end + 8] = node.alloc.alloc(8).to(torch.int32)
    c.kv.kv_allocated_len = end + 8
    c.finished_reason = FINISH_ABORT()
    if not mgr.offload_kv_cache(c):
        mgr.finalize_release_on_finish(c)
    running.remove(c)
    while running:
        running = node.decode_step(mgr, running)
    node.drain(mgr)
    mgr.check_integrity()
    stats = mgr.stats()
    assert (stats.released, stats.leaked, stats.tracked) == (4, 0, 0)  # b twice: retracted, finished
    assert len(mgr.ongoing_offload) == 0
    assert node.alloc.available_size() + tree_owned == free_pages and node.pool.available_size() == free_rows
    assert protected_size() == 0
    if tree_owned:  # unlocked: the tree's page is evictable, nothing else is held
        assert node.tree.evictable_size() == tree_owned
    mgr.release_host_resources()
    assert sglang_reads(store, mla, node, mgr, [a, b]) > 0


def test_release_host_resources_inside_sglang_stores_what_it_accepted(sglang_scheduler):
    scheduler, store = sglang_scheduler
    node = Node(real_kit("chunk"), page_size=4)
    free_pages = node.alloc.available_size()
    mgr = construct(scheduler, node)
    req = node.admit("late", list(range(4)), 30)
    for _ in range(4):
        node._grow(req, req.kv.kv_committed_len + 1)
        req.output_ids.append(7)
    assert mgr.offload_kv_cache(req)
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req.finished_reason = FINISH_ABORT()
    mgr.finalize_release_on_finish(req)
    mgr.release_host_resources()  # SGLang's shutdown path, at once
    assert len(mgr.ongoing_offload) == 0 and mgr.stats().abandoned == 0
    assert node.alloc.available_size() == free_pages
    assert sglang_reads(store, False, node, mgr, [req]) == 1

