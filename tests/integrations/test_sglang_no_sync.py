"""No device -> host sync on the scheduler thread (issue 25, point 1), shown on CPU.

SGLang's ``req_to_token`` and KV buffers live on the GPU; a scheduler-thread read of their values
(``.item()``, ``.tolist()``, ``.cpu()``, ``int()``, ``bool()``, ``torch.unique`` ...) waits for the
device and costs the overlap with the next forward. Here they are ``DeviceResident`` stand-ins
(``lifecycle_tools.testkit.sync_trap``) and every scheduler-facing call runs armed: any such read
raises ``HostSync``. SGLang's own code (its allocator's and tree cache's free paths) is not ours and
runs unarmed. With CUDA present the same loop runs on the GPU under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from lifecycle.integrations.sglang.install import _release_hook
from lifecycle_tools.testkit.sglang_doubles import release_kv_cache
from lifecycle_tools.testkit.sync_trap import HostSync, allowing, as_device_resident, no_host_sync
from tests.integrations.sglang_kit import Node, doubles_kit, hicache_file_get, hicache_file_suffix
from tests.integrations.test_sglang import MODEL, build, expected_pages, store_dir  # noqa: F401


def device_resident_node(mla: bool = False, **kw) -> Node:
    """SGLang-shaped pools whose slot table and KV buffers stand in for GPU memory."""
    node = Node(doubles_kit(), mla=mla, **kw)
    node.pool.req_to_token = as_device_resident(node.pool.req_to_token)
    kv = node.kv
    for name in ("k_buffer", "v_buffer", "kv_buffer"):
        if hasattr(kv, name):
            setattr(kv, name, [as_device_resident(b) for b in getattr(kv, name)])
    node.tree.free_kv_row = allowing(node.tree.free_kv_row)  # SGLang's own free path
    node.pool.free = allowing(node.pool.free)
    return node


def armed_decode(node: Node, mgr, specs) -> list:
    """``Node.decode_step``'s loop with every manager call armed (the KV writes are the model's)."""
    reqs = [node.admit(rid, prompt, max_new) for rid, prompt, max_new in specs]
    for r in reqs:
        r.prefix_indices = as_device_resident(r.prefix_indices)
    running = list(reqs)
    while running:
        for req in running:
            node._grow(req, req.kv.kv_committed_len + 1)
            req.output_ids.append(1000 + req.kv.kv_committed_len)
            if len(req.output_ids) >= req.max_new_tokens:
                req.finished_reason = "length"
        with no_host_sync():
            for req in running:
                if not req.finished():
                    mgr.offload_kv_cache(req)
                elif not mgr.offload_kv_cache(req):
                    mgr.finalize_release_on_finish(req)
            mgr.check_offload_progress()
        running = [r for r in running if not r.finished()]
    with no_host_sync():
        while not mgr.idle():
            mgr.check_offload_progress()
    return reqs


def test_the_trap_catches_every_host_read_on_the_armed_thread_only():
    t = as_device_resident(torch.arange(8))
    reads = [lambda: t[0].item(), lambda: t.tolist(), lambda: t.cpu(), lambda: t.to("cpu"), lambda: int(t[0]),
             lambda: bool(t[0]), lambda: t.numpy(), lambda: torch.unique(t), lambda: t[t > 2], lambda: f"{t}"]
    with no_host_sync():
        for read in reads:
            with pytest.raises(HostSync):
                read()
        assert (t[2:5].to(torch.int64) + 1).shape == (3,)  # device-side work is fine
        seen = []
        worker = threading.Thread(target=lambda: seen.append(t.tolist()))  # another thread: allowed
        worker.start()
        worker.join()
    assert seen == [list(range(8))] and t.tolist() == list(range(8))  # unarmed: allowed


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_decode_offload_and_release_never_read_device_slots_on_the_scheduler_thread(store_dir, mla):  # noqa: F811
    node = device_resident_node(mla=mla)
    full, rows = node.alloc.available_size(), node.pool.available_size()
    mgr = build(node)
    reqs = armed_decode(node, mgr, [("a", list(range(10, 23)), 11), ("b", list(range(50, 58)), 9)])
    stats = mgr.stats()
    assert (stats.released, stats.leaked, stats.copy_failures) == (2, 0, 0)
    assert node.alloc.available_size() == full and node.pool.available_size() == rows
    suffix = hicache_file_suffix(MODEL, 0, 1, mla)
    want = [page for r in reqs for page in expected_pages(node, r, mgr.offload_stride)]
    assert want and sorted(os.listdir(store_dir)) == sorted(f"{h}{suffix}.bin" for h, _ in want)
    for h, data in want:  # the device path stores the right bytes
        assert hicache_file_get(store_dir, h, suffix, mgr.decode_host_mem_pool.page_nbytes) == data
    mgr.release_host_resources()


def test_sglangs_release_hook_waits_without_reading_device_slots(store_dir):  # noqa: F811
    node = device_resident_node()
    full = node.alloc.available_size()
    mgr = build(node)
    req = node.admit("r", list(range(10)), 24)
    req.prefix_indices = as_device_resident(req.prefix_indices)
    for _ in range(6):
        node._grow(req, req.kv.kv_committed_len + 1)
        req.output_ids.append(2000 + req.kv.kv_committed_len)
    hook = _release_hook(allowing(release_kv_cache))  # SGLang's release_kv_cache itself runs unarmed
    with no_host_sync():
        assert mgr.offload_kv_cache(req)
        hook(req, node.tree, is_insert=False)  # retract_decode: waits for the copy, then SGLang frees
    assert req.kv.req_pool_idx is None and mgr.stats().released == 1
    req.reset_for_retract()
    req.prefix_indices = as_device_resident(req.prefix_indices)
    node.pool.alloc([req])  # resume_retracted_reqs: a new row, the KV restored
    node._grow(req, len(req.origin_input_ids) + len(req.output_ids) - 1)
    while not req.finished():
        node._grow(req, req.kv.kv_committed_len + 1)
        req.output_ids.append(3000 + req.kv.kv_committed_len)
        if len(req.output_ids) >= req.max_new_tokens:
            req.finished_reason = "length"
        with no_host_sync():  # the first call readmits the request into a new lifecycle
            if not mgr.offload_kv_cache(req) and req.finished():
                mgr.finalize_release_on_finish(req)
            mgr.check_offload_progress()
    with no_host_sync():
        while not mgr.idle():
            mgr.check_offload_progress()
        stats = mgr.stats()
        assert (stats.released, stats.leaked, stats.tracked) == (2, 0, 0)
        mgr.release_host_resources()
    assert node.alloc.available_size() == full


def test_bad_device_slot_ids_fail_their_copy_and_store_nothing(store_dir):  # noqa: F811
    """Values the scheduler thread cannot check without a sync are checked where the copy runs:
    a chunk whose row lists slots that are not whole aligned pages is a failed copy, never stored."""
    node = device_resident_node()
    mgr = build(node)
    req = node.admit("bad", list(range(4)), 30)
    for _ in range(4):
        node._grow(req, req.kv.kv_committed_len + 1)
        req.output_ids.append(9)
    row = req.kv.req_pool_idx
    node.pool.req_to_token[row, 5] = node.pool.req_to_token[row, 4]  # a corrupted row: slot repeated
    with no_host_sync():
        assert mgr.offload_kv_cache(req)
        while not mgr.idle():
            mgr.check_offload_progress()
    assert mgr.stats().copy_failures == 1 and mgr.offloader.stats().pages_stored == 0
    assert not os.path.isdir(store_dir) or os.listdir(store_dir) == []
    mgr.release_host_resources()


def _sync_debug(mode):
    """``fn`` wrapped to run with CUDA's sync debug mode at ``mode`` (restored to "error" after)."""
    def wrap(fn):
        def wrapped(*a, **k):
            torch.cuda.set_sync_debug_mode(mode)
            try:
                return fn(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode("error")
        return wrapped
    return wrap


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU stand-in runs above)")
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_on_cuda_under_sync_debug_mode_error(store_dir, mla):  # noqa: F811
    """The same decode on the GPU, SGLang's pools on CUDA: any synchronizing call made by the
    manager's calls raises (``set_sync_debug_mode("error")``); SGLang's own free paths and the
    model's KV writes run with it off. The stored pages are compared with the KV."""
    node = Node(doubles_kit(), mla=mla, device="cuda")
    full = node.alloc.available_size()
    mgr = build(node)
    node.tree.free_kv_row = _sync_debug(0)(node.tree.free_kv_row)
    node.pool.free = _sync_debug(0)(node.pool.free)
    reqs = [node.admit(rid, prompt, n) for rid, prompt, n in [("a", list(range(10, 23)), 11), ("b", [5] * 8, 9)]]
    running = list(reqs)
    try:
        while running:
            for req in running:
                node._grow(req, req.kv.kv_committed_len + 1)
                req.output_ids.append(1000 + req.kv.kv_committed_len)
                if len(req.output_ids) >= req.max_new_tokens:
                    req.finished_reason = "length"
            torch.cuda.set_sync_debug_mode("error")
            for req in running:
                if not req.finished():
                    mgr.offload_kv_cache(req)
                elif not mgr.offload_kv_cache(req):
                    mgr.finalize_release_on_finish(req)
            mgr.check_offload_progress()
            torch.cuda.set_sync_debug_mode(0)
            running = [r for r in running if not r.finished()]
        torch.cuda.set_sync_debug_mode("error")
        while not mgr.idle():
            mgr.check_offload_progress()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    stats = mgr.stats()
    assert (stats.released, stats.copy_failures) == (2, 0)
    assert node.alloc.available_size() == full
    suffix = hicache_file_suffix(MODEL, 0, 1, mla)
    for r in reqs:
        for h, data in expected_pages(node, r, mgr.offload_stride):
            assert hicache_file_get(store_dir, h, suffix, mgr.decode_host_mem_pool.page_nbytes) == data
    mgr.release_host_resources()

