"""SGLang's TP=1 release wait expiring under a copy still in flight (issue 25, point 7): SGLang then
frees (and may reuse) the request's slots, so whatever the copy lands is not the request's KV and
must never be stored under the request's page hashes."""

from __future__ import annotations

import os
import threading

import structlog
import torch

from lifecycle.integrations.sglang.install import _release_hook
from lifecycle_tools.testkit.sglang_doubles import release_kv_cache
from tests.integrations.sglang_kit import Node, doubles_kit
from tests.integrations.test_sglang import build, store_dir  # noqa: F401  (fixture)


def test_a_copy_landing_after_the_release_wait_expired_stores_nothing_and_is_counted(store_dir):  # noqa: F811
    node = Node(doubles_kit())
    mgr = build(node)
    mgr.SGLANG_RELEASE_WAIT_S = 0.05
    engine = mgr.offloader.engine
    gate = threading.Event()
    submit = engine.submit
    engine.submit = lambda tag, fn: submit(tag, lambda: (gate.wait(10), fn())[1])  # a copy that hangs
    req = node.admit("late", list(range(4)), 30)
    for _ in range(4):
        node._grow(req, req.kv.kv_committed_len + 1)
        req.output_ids.append(9)
    row = req.kv.req_pool_idx
    slots = node.pool.req_to_token[row, 4:8].long().clone()
    assert mgr.offload_kv_cache(req)
    with structlog.testing.capture_logs() as logs:
        _release_hook(release_kv_cache)(req, node.tree, is_insert=False)  # wait expires, SGLang frees
    assert req.kv.req_pool_idx is None
    for layer in range(node.layers):  # the freed slots reused by another request: other KV there
        node.kv.k_buffer[layer][slots] = 7
        node.kv.v_buffer[layer][slots] = 7
    gate.set()  # the copy lands now, reading the reused slots
    node.drain(mgr)
    assert not os.path.isdir(store_dir) or os.listdir(store_dir) == []  # nothing stored
    assert mgr.offloader.stats().copies_discarded == 1
    assert mgr.offloader.stats().pages_stored == 0
    assert mgr.stats().copy_failures == 1
    assert mgr.decode_host_mem_pool.available_size() == mgr.decode_host_mem_pool.size  # pages back
    expired = [e for e in logs if e["event"] == "sglang.release_under_copy"]
    assert len(expired) == 1 and expired[0]["copies_discarded"] == 1
    mgr.release_host_resources()


def test_discard_write_of_an_unknown_ack_is_a_typed_error_and_changes_nothing(store_dir):  # noqa: F811
    import pytest

    from transfer.errors import UnknownId

    node = Node(doubles_kit())
    mgr = build(node)
    before = mgr.offloader.stats()
    with pytest.raises(UnknownId):
        mgr.offloader.discard_write(12345)
    assert mgr.offloader.stats() == before
    mgr.release_host_resources()
