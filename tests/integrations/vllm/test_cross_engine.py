"""One fleet, two engines (issue 37, point 3): a prefix stored by one engine is loaded bit-exact by
the other, in the project's own environment (no vLLM, no SGLang needed).

SGLang -> vLLM: an SGLang decode node (our drop-in over SGLang-shaped pools, as SGLang 0.5.19 drives
it; ``test_sglang_versus_own`` proves it stores SGLang's own manager's pages name by name, byte by
byte) decodes a request and stores its pages in a HiCacheFile directory; a directory holding the
same pages as SGLang's own ``HiCacheFile`` writes them (raw page bytes, no seal) too. The vLLM
load path (``LoadPlanner`` on the scheduler side, ``LoadWorker`` on the worker side) looks the
request's tokens up by our chain, plans the pages into scattered vLLM blocks and loads them: vLLM's
kernels read back exactly the KV the SGLang node computed, in the CPU backend's head-major layout
and FlashAttention's token-major one.

vLLM -> SGLang: pages read out of vLLM blocks (``VllmKVLayout``, what the connector's store path
writes) into the tier the SGLang drop-in opens are found under the same names and bytes by SGLang's
``HiCacheFile`` read, and loaded bit-exact by the SGLang node's prefix loader (``transfer``).

Across virtual environments (vLLM 0.32.0's real classes and SGLang 0.5.19's real ones, one
directory between them): ``bench/cross_engine_check.py``.
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest
import torch

import hashing
from lifecycle.integrations.sglang import DecodeKVCacheOffloadManager, use_runtime
from lifecycle.integrations.vllm.layout import VllmKVLayout
from lifecycle.integrations.vllm.load import LoadWorker
from lifecycle.integrations.vllm.lookup import LoadPlanner
from lifecycle_tools.testkit.sglang_doubles import runtime_context
from lifecycle_tools.testkit.vllm_kv import make_kv_caches, read_kv, write_kv
from tests.integrations.sglang_kit import Node, doubles_kit, hicache_file_get, hicache_file_suffix
from transfer import build_stack
from transfer.stack import page_format
from transfer.storage.file import FileStorage

PS, LAYERS, HEADS, DIM = 4, 3, 2, 8
MODEL = "org/M"
SUFFIX = hicache_file_suffix(MODEL, 0, 1, False)
DEADLINE_S = 60.0


def _request(req_id, tokens):
    """The fields of vLLM's ``Request`` the planner reads (the real one: test_load_scheduler.py)."""
    return SimpleNamespace(request_id=req_id, all_token_ids=list(tokens), num_tokens=len(tokens), cache_salt=None,
                           lora_request=None, mm_features=[])


def _sglang_node_stores(store_dir, monkeypatch, rid="r", prompt=(100, 101, 102), max_new=18):
    """An SGLang decode node decodes ``rid`` and stores its pages (every page: the prompt is shorter
    than one). Returns the node and the request's tokens that have KV."""
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(store_dir))
    monkeypatch.delenv("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", raising=False)
    node = Node(doubles_kit(), page_size=PS, layers=LAYERS, heads=HEADS, dim=DIM)
    with use_runtime(runtime_context(page_size=PS, model=MODEL)):
        mgr = DecodeKVCacheOffloadManager(req_to_token_pool=node.pool, token_to_kv_pool_allocator=node.alloc,
                                          tp_group=None, tree_cache=node.tree)
    req = node.admit(rid, list(prompt), max_new)
    running = [req]
    while running:
        running = node.decode_step(mgr, running)
    node.drain(mgr)
    mgr.release_host_resources()
    return node, list(req.origin_input_ids) + list(req.output_ids[:-1])


def _load_into_vllm(store, split, tokens, blocks_for):
    """The vLLM load path over ``store``: lookup of ``tokens`` (plus one token vLLM would compute),
    the plan into blocks ``blocks_for(n_pages)``, the load. Returns the caches, blocks, pages."""
    caches = make_kv_caches(split, LAYERS, 24, HEADS, PS, DIM, torch.bfloat16)
    layout = VllmKVLayout.from_kv_caches(caches, PS)
    planner = LoadPlanner(store, PS)
    worker = LoadWorker(layout, store)
    try:
        req = _request("v", tokens + [7])
        for _ in range(int(DEADLINE_S / 0.01)):
            n, load_async = planner.matched_tokens(req, 0)
            if n is not None:
                break
            threading.Event().wait(0.01)
        assert n and load_async and n % PS == 0
        pages = n // PS
        blocks = blocks_for(pages)
        planner.after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks + [23],)), n)
        (job,) = planner.take_load_jobs()
        assert job.page_hashes == hashing.page_hashes(tokens, PS)[:pages]   # our chain: SGLang's names
        worker.start([job])
        done = set()
        for _ in range(int(DEADLINE_S / 0.01)):
            done |= worker.finished_recving()
            if done:
                break
            threading.Event().wait(0.01)
        assert done == {"v"} and worker.load_error_block_ids() == set()
        return caches, blocks, pages
    finally:
        planner.close()
        assert worker.close(DEADLINE_S)


def _slots(blocks):
    return (torch.tensor(blocks).view(-1, 1) * PS + torch.arange(PS)).reshape(-1)


def _scattered(n):
    return [(7 * i + 5) % 23 for i in range(n)]


@pytest.mark.parametrize("split", ["rows", "channels"], ids=["cpu-head-major", "flash-attn-token-major"])
def test_pages_an_sglang_node_stores_are_loaded_bit_exact_by_the_vllm_load_path(tmp_path, monkeypatch, split):
    node, tokens = _sglang_node_stores(tmp_path / "hicache", monkeypatch)
    files = os.listdir(tmp_path / "hicache")
    assert len(files) == len(tokens) // PS                               # every page, SGLang's names
    host = VllmKVLayout.from_kv_caches(make_kv_caches(split, LAYERS, 1, HEADS, PS, DIM, torch.bfloat16), PS)
    store = FileStorage(tmp_path / "hicache", SUFFIX, host.page_nbytes, page_format=page_format(host.host_pool(PS)))
    try:
        caches, blocks, pages = _load_into_vllm(store, split, tokens, _scattered)
    finally:
        store.close()
    assert pages == len(tokens) // PS
    want = node.expected["r"][: pages * PS].permute(1, 2, 0, 3, 4)         # [kinds, layers, positions, heads, dim]
    got = read_kv(caches, split, DIM)[:, :, _slots(blocks)]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert not read_kv(caches, split, DIM)[:, :, _slots(sorted(set(range(23)) - set(blocks)))].view(torch.int16).any()


def test_a_directory_as_sglangs_own_hicachefile_writes_it_is_loaded_bit_exact(tmp_path):
    """SGLang's own ``HiCacheFile.set`` writes each page's raw bytes to ``{hash}{suffix}.bin`` (no
    seal): served unverified (counted), bit-exact."""
    tokens = list(range(40, 40 + 5 * PS))
    gen = torch.Generator().manual_seed(11)
    kv = torch.randn((len(tokens), 2, LAYERS, HEADS, DIM), generator=gen).to(torch.bfloat16)   # per position
    directory = tmp_path / "own"
    directory.mkdir()
    for i, name in enumerate(hashing.page_hashes(tokens, PS)):
        page = kv[i * PS:(i + 1) * PS].permute(1, 0, 2, 3, 4).contiguous()   # SGLang page_first: [2, ps, L, H, D]
        (directory / f"{name}{SUFFIX}.bin").write_bytes(page.view(torch.uint8).numpy().tobytes())
    layout = VllmKVLayout.from_kv_caches(make_kv_caches("rows", LAYERS, 1, HEADS, PS, DIM, torch.bfloat16), PS)
    store = FileStorage(directory, SUFFIX, layout.page_nbytes, page_format=page_format(layout.host_pool(PS)))
    try:
        caches, blocks, pages = _load_into_vllm(store, "rows", tokens, _scattered)
        assert store.stats().unverified == pages
    finally:
        store.close()
    assert pages == 5                                                    # every page (vLLM computes the token after)
    got = read_kv(caches, "rows", DIM)[:, :, _slots(blocks)]
    assert torch.equal(got.view(torch.int16), kv[: pages * PS].permute(1, 2, 0, 3, 4).view(torch.int16))


@pytest.mark.parametrize("split", ["rows", "channels"], ids=["cpu-head-major", "flash-attn-token-major"])
def test_pages_read_out_of_vllm_blocks_are_found_and_loaded_by_the_sglang_path_under_the_same_names(tmp_path, split):
    tokens = list(range(900, 900 + 6 * PS))
    names = hashing.page_hashes(tokens, PS)
    gen = torch.Generator().manual_seed(5)
    kv = torch.randn((2, LAYERS, 16 * PS, HEADS, DIM), generator=gen).to(torch.bfloat16)
    caches = make_kv_caches(split, LAYERS, 16, HEADS, PS, DIM, torch.bfloat16)
    write_kv(caches, split, kv)
    layout = VllmKVLayout.from_kv_caches(caches, PS)
    blocks = [9, 2, 14, 0, 7, 11]                                        # where vLLM computed them
    # the SGLang node's own stack over the shared directory: its tier is the vLLM side's tier
    stack = build_stack(LAYERS, HEADS, DIM, torch.bfloat16, PS, 32 * PS, 16 * PS, 2, 64,
                        storage=f"file:{tmp_path / 'shared'}", model_name=MODEL)
    try:
        assert stack.storage.suffix == SUFFIX
        pages = layout.page_bytes_of(blocks)
        assert all(stack.storage.batch_set(names, [p.reshape(-1).view(torch.uint8) for p in pages]))
        want = kv[:, :, _slots(blocks)]                                  # [2, layers, positions, heads, dim]
        # SGLang's HiCacheFile read: the file under the chain name holds the page_first bytes
        for i, name in enumerate(names):
            data = hicache_file_get(str(tmp_path / "shared"), name, SUFFIX, layout.page_nbytes)
            page = want[:, :, i * PS:(i + 1) * PS].permute(0, 2, 1, 3, 4).contiguous()
            assert data == page.view(torch.uint8).numpy().tobytes()
        # the SGLang node's prefix loader finds the prefix by the same names and loads it bit-exact
        loader = stack.prefix_loader
        assert loader.start(1, tokens + [1]) == len(names)
        for _ in range(int(DEADLINE_S / 0.01)):
            loads = loader.finished()
            if loads:
                break
            threading.Event().wait(0.01)
        (load,) = loads
        assert load.error is None and load.page_hashes == names
        got = stack.kv_pool.buffer[:, :, load.device_indices]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    finally:
        stack.close()
