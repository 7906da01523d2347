"""One fleet, two engines, through the connector itself: pages an SGLang decode node stores (our
drop-in over SGLang-shaped pools, as SGLang 0.5.19 drives it: the same pages, name by name and byte by
byte, as SGLang's own manager, ``test_sglang_versus_own``) in a HiCacheFile directory are loaded
bit-exact by ``LifecycleConnector`` under vLLM 0.32.0's real scheduler, in either attention layout,
and vLLM computes only the rest. The other direction (pages the connector stores, read by SGLang's
path under the same names and bytes): ``test_layout`` and ``test_cross_engine``; across virtual
environments with SGLang's and vLLM's own classes: ``bench/cross_engine_check.py``. Skipped without
vLLM, failed without it under ``KV_LIFECYCLE_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.integrations.vllm.test_load_connector import _kv_in, _load, _rig, vllm_required  # noqa: F401
from tests.integrations.vllm.vllm_kit import require_vllm  # noqa: F401

pytestmark = pytest.mark.usefixtures("vllm_required")

BS, LAYERS, HEADS, DIM = 16, 2, 2, 32     # the rig's tiny Llama: its KV is what the SGLang node holds


def _sglang_node_stores(store, monkeypatch):
    from lifecycle.integrations.sglang import DecodeKVCacheOffloadManager, use_runtime
    from lifecycle_tools.testkit.sglang_doubles import runtime_context
    from tests.integrations.sglang_kit import Node, doubles_kit

    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(store))
    monkeypatch.delenv("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", raising=False)
    node = Node(doubles_kit(), page_size=BS, layers=LAYERS, heads=HEADS, dim=DIM, dtype=torch.float32)
    with use_runtime(runtime_context(page_size=BS, model="org/M")):
        mgr = DecodeKVCacheOffloadManager(req_to_token_pool=node.pool, token_to_kv_pool_allocator=node.alloc,
                                          tp_group=None, tree_cache=node.tree)
    req = node.admit("s", [100, 101, 102], 70)           # the prompt is shorter than a page: every page is stored
    running = [req]
    while running:
        running = node.decode_step(mgr, running)
    node.drain(mgr)
    mgr.release_host_resources()
    return node.expected["s"], list(req.origin_input_ids) + list(req.output_ids[:-1])


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"], ids=["cpu-head-major", "flash-attn-token-major"])
def test_pages_an_sglang_node_stored_are_loaded_bit_exact_by_the_vllm_connector(tmp_path, monkeypatch, layout):
    store = tmp_path / "hicache"
    expected, tokens = _sglang_node_stores(store, monkeypatch)
    assert len(os.listdir(store)) == len(tokens) // BS == 4
    b = _rig(tmp_path / "vllm", store, layout=layout)
    try:
        blocks, first = _load(b, "v", tokens[:70])
        assert blocks is not None and first == 70 - 4 * BS
        want = expected[: 4 * BS].permute(1, 2, 0, 3, 4)    # [kinds, layers, positions, heads, dim]
        assert torch.equal(_kv_in(b, blocks[:4]), want)
        b.run()
        b.check_pool_clean()
    finally:
        b.close()
