"""The load path through the connector itself (``LifecycleConnector``, loaded by module path), under
vLLM 0.32.0's real scheduler on CPU (``lifecycle_tools.testkit.vllm_engine.VllmRig``): a prefix one
vLLM engine stored through the connector's store path is loaded bit-exact by another engine sharing
the tier, in either attention layout, and that engine computes only the rest; a page gone from the
tier is recomputed; every block returns to vLLM's pool exactly once. Skipped without vLLM (run by
``.ci/vllm-env``), failed without it under ``KV_LIFECYCLE_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from tests.integrations.vllm.vllm_kit import require_vllm

pytestmark = pytest.mark.usefixtures("vllm_required")

BS = 16
DEADLINE_S = 60.0   # generous: reached only when something is broken


@pytest.fixture
def vllm_required():
    require_vllm()


def _rig(directory, store, **kw):
    from lifecycle_tools.testkit.vllm_engine import VllmRig

    return VllmRig(directory, block_size=BS, extra={"storage": f"file:{store}", "model_name": "org/M"}, **kw)


def _stored_by_a_first_engine(tmp_path, store):
    """Engine A decodes a request (prompt shorter than a page: every page is its decode page, stored
    by its connector) and stores it; its tokens with KV."""
    a = _rig(tmp_path / "a", store)
    try:
        a.add("a", list(range(100, 110)), 70)
        a.run()
        a.drain_storage()
        a.check_pool_clean()
        return list(a.requests["a"].all_token_ids)
    finally:
        a.close()


def _load(b, rid, prompt):
    """Step engine B until ``rid`` is done; the blocks vLLM allocated for its load and the tokens it
    computed in its first scheduled step."""
    from vllm.v1.request import RequestStatus

    b.add(rid, prompt, 2)
    blocks, first = None, None
    for _ in range(int(DEADLINE_S / 0.005)):
        req = b.scheduler.requests.get(rid)
        if req is None:
            break
        if blocks is None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            blocks = list(b.scheduler.kv_cache_manager.get_block_ids(rid)[0])
        out = b.step()
        if first is None and rid in out.num_scheduled_tokens:
            first = out.num_scheduled_tokens[rid]
        threading.Event().wait(0.005)   # the lookup and the load run on their own threads
    else:
        raise AssertionError(f"{rid} never finished")
    return blocks, first


def _kv_in(b, blocks):
    from lifecycle_tools.testkit.vllm_kv import read_kv

    slots = (torch.tensor(blocks).view(-1, 1) * BS + torch.arange(BS)).reshape(-1)
    return read_kv(b.kv[0], b.split, b.head_dim)[:, :, slots]


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"], ids=["cpu-head-major", "flash-attn-token-major"])
def test_a_prefix_one_vllm_engine_stored_is_loaded_bit_exact_by_another(tmp_path, layout):
    from lifecycle_tools.testkit.vllm_engine import kv_of

    store = tmp_path / "store"
    tokens = _stored_by_a_first_engine(tmp_path, store)
    assert len(os.listdir(store)) == 4                   # pages 0..3: the 5th holds the last token, no KV
    b = _rig(tmp_path / "b", store, layout=layout)
    try:
        blocks, first = _load(b, "b", tokens[:70])
        assert blocks is not None and first == 70 - 4 * BS   # loaded 4 pages, computed the rest only
        want = kv_of("a", torch.arange(4 * BS), b.layers, b.heads, b.head_dim)
        assert torch.equal(_kv_in(b, blocks[:4]), want)  # engine A's KV, where B's kernels read it
        b.run()
        b.check_pool_clean()
    finally:
        b.close()


def test_a_page_gone_from_the_tier_is_recomputed_by_the_loading_engine(tmp_path):
    from lifecycle_tools.testkit.vllm_engine import kv_of

    store = tmp_path / "store"
    tokens = _stored_by_a_first_engine(tmp_path, store)
    b = _rig(tmp_path / "b", store)
    try:
        names = __import__("hashing").page_hashes(tokens[:4 * BS], BS)
        worker = b.workers[0]
        original = worker.worker.storage.batch_get
        gone = []

        def evicted_after_the_lookup(keys, into):        # page 1 evicted between lookup and load
            if not gone:
                gone.append(worker.worker.storage.delete(names[1]))
            return original(keys, into)

        worker.worker.storage.batch_get = evicted_after_the_lookup
        blocks, first = _load(b, "b", tokens[:70])
        assert gone == [True] and first == 70 - BS       # recomputed from the first page that failed
        want = kv_of("a", torch.arange(BS), b.layers, b.heads, b.head_dim)
        assert torch.equal(_kv_in(b, blocks[:1]), want)
        b.run()
        b.check_pool_clean()
    finally:
        b.close()
