"""The SGLang drop-in refuses a chunk whose ``req_to_token`` slots cannot be right, as the manager does.

SGLang's scheduler calls ``offload_kv_cache`` on the drop-in; the chunk it plans goes through the
same slot check as every plan (``lifecycle.slots``): a -1, a repeated slot or a slot another
request's copy still reads is refused with ``InvalidSlots`` before anything is recorded or copied.
"""

from __future__ import annotations

import pytest

from lifecycle import LifecycleError, State
from lifecycle.errors import InvalidSlots
from lifecycle.integrations.sglang import DecodeKVCacheOffloadManager, use_runtime
from lifecycle_tools.testkit.sglang_doubles import runtime_context
from tests.integrations.sglang_kit import Node, doubles_kit


@pytest.fixture
def node(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "hicache"))
    monkeypatch.delenv("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", raising=False)
    return Node(doubles_kit())


def build(node):
    with use_runtime(runtime_context(page_size=node.ps, model="org/Model-7B")):
        return DecodeKVCacheOffloadManager(req_to_token_pool=node.pool, token_to_kv_pool_allocator=node.alloc,
                                           tp_group=None, tree_cache=node.tree)


def due(node, rid, steps=4):
    """A request decoded ``steps`` tokens past its prompt: one chunk of ``steps`` tokens due."""
    req = node.admit(rid, list(range(8)), 12)
    for _ in range(steps):
        node._grow(req, req.kv.kv_committed_len + 1)
        req.output_ids.append(1000 + req.kv.kv_committed_len)
    return req


@pytest.mark.parametrize("bad", ["minus_one", "repeated"])
def test_the_drop_in_refuses_a_bad_chunk_row_on_first_sight_and_records_nothing(node, bad):
    mgr = build(node)
    try:
        req = due(node, "s")
        table, row = node.pool.req_to_token, req.kv.req_pool_idx
        good = table[row, 8:12].clone()
        table[row, 10] = -1 if bad == "minus_one" else table[row, 9]
        with pytest.raises(InvalidSlots, match=r"request 's': row \d+ lists .* \[\(8, 12\)\]") as err:
            mgr.offload_kv_cache(req)
        assert isinstance(err.value, LifecycleError)
        assert mgr.manager.state_of(req) is None and mgr.stats().chunks_enqueued == 0
        table[row, 8:12] = good
        assert mgr.offload_kv_cache(req) is True
        node.drain(mgr)
        assert mgr.manager.state_of(req) is State.PREFILLED
    finally:
        mgr.release_host_resources()


def test_the_drop_in_refuses_a_slot_another_requests_copy_reads(node):
    mgr = build(node)
    try:
        a = due(node, "a")
        assert mgr.offload_kv_cache(a) is True              # a's [8, 12) in flight (not polled yet)
        b = due(node, "b")
        table = node.pool.req_to_token
        table[b.kv.req_pool_idx, 8:12] = table[a.kv.req_pool_idx, 8:12]
        with pytest.raises(InvalidSlots, match="which a copy in flight of request 'a'"):
            mgr.offload_kv_cache(b)
        assert mgr.manager.state_of(b) is None and mgr.stats().chunks_enqueued == 1
        node.drain(mgr)
    finally:
        mgr.release_host_resources()
