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
import structlog
import torch

from lifecycle.integrations.sglang.install import _release_hook
from lifecycle_tools.testkit.sglang_doubles import release_kv_cache
from lifecycle_tools.testkit.sync_trap import HostSync, allowing, as_device_resident, no_host_sync
from transfer.gather import check_ids_on_device
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
    with no_host_sync():
        mgr.check_offload_progress()  # reads the device-side checks of the releases in the last one
    stats = mgr.stats()
    assert (stats.released, stats.leaked, stats.copy_failures, stats.bad_release_rows) == (2, 0, 0, 0)
    assert not mgr.manager._ledger.release_checks
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
    node.decode_tokens(req, 4)
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
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()  # (unarmed) every device-side release check has landed
        torch.cuda.set_sync_debug_mode("error")
        mgr.check_offload_progress()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    stats = mgr.stats()
    assert (stats.released, stats.copy_failures, stats.bad_release_rows) == (2, 0, 0)
    assert not mgr.manager._ledger.release_checks
    assert node.alloc.available_size() == full
    suffix = hicache_file_suffix(MODEL, 0, 1, mla)
    for r in reqs:
        for h, data in expected_pages(node, r, mgr.offload_stride):
            assert hicache_file_get(store_dir, h, suffix, mgr.decode_host_mem_pool.page_nbytes) == data
    mgr.release_host_resources()



# --- a release of a device row: its slot ids checked on the device, the verdict read later ---------

def _finished_request(node: Node, corrupt: str | None):
    """A request finished after its prompt (6 tokens, pages of 4: ranges [(0, 6)]), its row
    corrupted at position 5 as ``corrupt`` says. SGLang's own free path (``free_kv_row``, which
    reads the row itself) is given the row as it was: SGLang's allocator would take the bad ids
    silently (its double-free check is a debug option), the double here would assert."""
    req = node.admit("bad", list(range(6)), 1)
    req.prefix_indices = as_device_resident(req.prefix_indices)
    req.finished_reason = "length"
    row = req.kv.req_pool_idx
    table = node.pool.req_to_token
    good = table[row].clone()
    bad = {None: None, "negative": -1, "repeated": int(table[row, 4]), "out_of_range": 10 ** 6}[corrupt]
    if bad is not None:
        table[row, 5] = bad
    free_kv_row = node.tree.free_kv_row

    def as_it_was(kv, ranges):
        table[row] = good
        free_kv_row(kv, ranges)

    node.tree.free_kv_row = allowing(as_it_was)
    return req, row


def _bad_rows(logs) -> list:
    return [e for e in logs if e["event"] == "lifecycle.bad_release_row"]


@pytest.mark.parametrize("corrupt", ["negative", "repeated", "out_of_range"])
def test_a_bad_device_release_row_is_reported_at_the_next_progress_check(store_dir, corrupt):  # noqa: F811
    """-1, a repeated id or an id past the pool in the ranges a release frees: the release is not
    refused (the ids are never read on the scheduler thread, and SGLang frees by ranges), but the
    device-side check's verdict is read at the next progress check: counted, one ERROR naming it."""
    node = device_resident_node()
    full = node.alloc.available_size()
    mgr = build(node)
    assert mgr.manager._pools.slot_end == node.kv.k_buffer[0].shape[0]  # the pool's slots, known without a read
    req, row = _finished_request(node, corrupt)
    with structlog.testing.capture_logs() as logs:
        with no_host_sync():
            assert not mgr.offload_kv_cache(req)
            mgr.finalize_release_on_finish(req)
        assert req.kv.req_pool_idx is None and mgr.stats().released == 1  # released, not refused
        assert mgr.stats().bad_release_rows == 0 and _bad_rows(logs) == []  # not read on the release call
        assert len(mgr.manager._ledger.release_checks) == 1
        with no_host_sync():
            mgr.check_offload_progress()
    assert mgr.stats().bad_release_rows == 1
    (report,) = _bad_rows(logs)
    assert report["log_level"] == "error" and report["rid"] == "bad" and report["row"] == row
    assert report["ranges"] == [(0, 6)] and report[corrupt] == 1
    assert {"negative": "negative", "repeated": "more than once", "out_of_range": "past the pool"}[corrupt] \
        in report["problem"]
    assert not mgr.manager._ledger.release_checks  # nothing left pending
    with no_host_sync():
        mgr.check_offload_progress()
    assert mgr.stats().bad_release_rows == 1 and len(_bad_rows(logs)) == 1  # reported once
    assert node.alloc.available_size() == full
    mgr.release_host_resources()


def test_a_good_device_release_row_reports_nothing(store_dir):  # noqa: F811
    node = device_resident_node()
    mgr = build(node)
    req, _ = _finished_request(node, None)
    with structlog.testing.capture_logs() as logs:
        with no_host_sync():
            mgr.finalize_release_on_finish(req)
            mgr.check_offload_progress()
    assert mgr.stats().released == 1 and mgr.stats().bad_release_rows == 0
    assert _bad_rows(logs) == [] and not mgr.manager._ledger.release_checks
    mgr.release_host_resources()


class _NotYet:
    """A CUDA event stand-in that has not fired until ``fire``."""

    def __init__(self):
        self.fired = False

    def query(self) -> bool:
        return self.fired

    def fire(self):
        self.fired = True


def _unfired_events(monkeypatch) -> list:
    """Every device-side release check issued from now on gets an event that fires when told."""
    import lifecycle.release as release

    events, check = [], release.check_ids_on_device

    def issued(ids, end):
        verdict, _ = check(ids, end)
        events.append(_NotYet())
        return verdict, events[-1]

    monkeypatch.setattr(release, "check_ids_on_device", issued)
    return events


def test_a_verdict_is_read_only_once_its_event_has_fired(store_dir, monkeypatch):  # noqa: F811
    events = _unfired_events(monkeypatch)
    node = device_resident_node()
    mgr = build(node)
    req, _ = _finished_request(node, "repeated")
    with no_host_sync():
        mgr.finalize_release_on_finish(req)
        mgr.check_offload_progress()
        mgr.check_offload_progress()
    assert mgr.stats().bad_release_rows == 0 and len(mgr.manager._ledger.release_checks) == 1  # kept, unread
    events[0].fire()
    with no_host_sync():
        mgr.check_offload_progress()
    assert mgr.stats().bad_release_rows == 1 and not mgr.manager._ledger.release_checks


def test_shutdown_does_not_wait_for_a_verdict_that_never_lands(store_dir, monkeypatch):  # noqa: F811
    _unfired_events(monkeypatch)
    node = device_resident_node()
    mgr = build(node)
    req, _ = _finished_request(node, "negative")
    with no_host_sync():
        mgr.finalize_release_on_finish(req)
    with structlog.testing.capture_logs() as logs:
        mgr.release_host_resources()  # shutdown(force=True): bounded; the unread check dropped
    assert not mgr.manager._ledger.release_checks and mgr.stats().bad_release_rows == 0
    (unread,) = [e for e in logs if e["event"] == "lifecycle.release_checks_unread"]
    assert unread["unread"] == 1 and unread["log_level"] == "warning"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU stand-in runs above)")
@pytest.mark.parametrize("corrupt", ["negative", "repeated", "out_of_range"])
def test_on_cuda_a_bad_release_row_is_reported_without_a_sync(store_dir, corrupt):  # noqa: F811
    """The release and every progress check run under ``set_sync_debug_mode("error")``; the
    stream is held busy (``torch.cuda._sleep``) so the verdict has not landed at the first progress
    check: it is not read then, and is reported once the device got there."""
    node = Node(doubles_kit(), device="cuda")
    full = node.alloc.available_size()
    mgr = build(node)
    req, _ = _finished_request(node, corrupt)
    freed, free_kv_row = [], node.tree.free_kv_row.__wrapped__
    node.tree.free_kv_row = lambda kv, ranges: freed.append((kv, ranges))  # SGLang's free (it syncs): after
    check_ids_on_device(torch.arange(8, device="cuda"), 8)  # its kernels loaded (lazy loading) before the clock
    with structlog.testing.capture_logs() as logs:
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # the current stream busy for a while (~0.5 s)
        torch.cuda.set_sync_debug_mode("error")
        try:
            mgr.finalize_release_on_finish(req)
            mgr.check_offload_progress()
            pending = len(mgr.manager._ledger.release_checks)
            seen = mgr.manager._ledger.bad_release_rows
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert (pending, seen, len(freed)) == (1, 0, 1)  # released; the verdict not landed yet: not read
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            mgr.check_offload_progress()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert mgr.stats().bad_release_rows == 1 and len(_bad_rows(logs)) == 1
    assert not mgr.manager._ledger.release_checks
    free_kv_row(*freed[0])
    assert node.alloc.available_size() == full
    mgr.release_host_resources()


def test_shutdown_with_an_abandoned_copy_reads_no_device_slot_and_never_raises(store_dir):  # noqa: F811
    """Issue 34, point 5: ``release_host_resources`` promises not to raise for work still in
    flight; a copy held back (it never reports) is abandoned at ``timeout_s=0.01`` without a read
    of its device slot ids (the close report counts them), and the host pool is left as it is."""
    node = device_resident_node()
    mgr = build(node)
    req = node.admit("held", list(range(4)), 30)
    node.decode_tokens(req, 4, 7)
    engine, gate = mgr.offloader.engine, threading.Event()
    submit = engine.submit
    engine.submit = lambda tag, fn: submit(tag, lambda: (gate.wait(), fn())[1])  # held back until the end
    try:
        with no_host_sync():
            assert mgr.offload_kv_cache(req)
            req.finished_reason = "abort"
            mgr.finalize_release_on_finish(req)
            with structlog.testing.capture_logs() as logs:
                mgr.release_host_resources(timeout_s=0.01)
        assert mgr.stats().abandoned == 1 and len(mgr.ongoing_offload) == 0
        assert mgr.decode_host_mem_pool.kept  # not closed under the copy
        (closed,) = [e for e in logs if e["event"] == "offloader.close_timed_out"]
        assert closed["device_slots"] == 4 and "4 slot ids on the device, not read" in closed["reason"]
    finally:
        gate.set()


# --- a device row's chunk checked on the device as strongly as a host row's (issue 34, point 3) -----

def _corrupt(node, req, case):
    """Row positions ``[4, 12)`` hold two pages; corrupt them as ``case`` says (after their KV was
    written, as a wrong row would be)."""
    table, row = node.pool.req_to_token, req.kv.req_pool_idx
    if case == "repeated-page":  # the second page lists the first page's slots again
        table[row, 8:12] = table[row, 4:8].clone()
    elif case == "page-another-copy-reads":  # the same, in a later chunk: the first chunk's copy reads it
        table[row, 8:12] = table[row, 4:8].clone()
    elif case == "page-the-allocator-does-not-hold":  # a free page's slots
        free = int(node.alloc.free_pages[-1]) * node.ps
        table[row, 8:12] = torch.arange(free, free + node.ps, dtype=table.dtype)


@pytest.mark.parametrize("case", ["repeated-page", "page-another-copy-reads", "page-the-allocator-does-not-hold"])
def test_a_device_chunk_the_host_check_would_refuse_is_a_failed_copy_never_stored(store_dir, monkeypatch, case):  # noqa: F811
    """A host row's chunk with a page listed twice, a page a copy in flight reads, or a page the
    allocator does not hold is refused (``InvalidSlots``); a device row's cannot be read on the
    scheduler thread, so the same checks run on the device (``check_device_chunk``) and such a
    chunk's copy fails: counted, nothing of it stored. Its pages are never counted as read."""
    if case == "repeated-page":
        monkeypatch.setenv("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", "8")  # one chunk of both pages
    node = device_resident_node()
    mgr = build(node)
    req = node.admit("bad", list(range(4)), 40)
    if case == "page-another-copy-reads":
        node.decode_tokens(req, 4)
        with no_host_sync():
            assert mgr.offload_kv_cache(req)  # [4, 8): good, its copy in flight (not yet settled)
        node.decode_tokens(req, 4)
        _corrupt(node, req, case)
    else:
        node.decode_tokens(req, 8)
        _corrupt(node, req, case)
    with no_host_sync():
        assert mgr.offload_kv_cache(req)  # accepted: the verdict is the device's, read after the copy
        node.drain(mgr)
    stored = 1 if case == "page-another-copy-reads" else 0  # the first chunk's page
    assert mgr.stats().copy_failures == 1 and mgr.offloader.stats().pages_stored == stored
    assert len(os.listdir(store_dir) if os.path.isdir(store_dir) else []) == stored
    assert int(mgr.manager._ledger.reading.device.counts.sum()) == 0  # every count taken back (the spare's too)
    mgr.release_host_resources()


def test_device_read_counts_follow_chunks_in_flight_and_come_back_to_zero(store_dir):  # noqa: F811
    node = device_resident_node()
    mgr = build(node)
    req = node.admit("r", list(range(4)), 40)
    node.decode_tokens(req, 8)
    row = req.kv.req_pool_idx
    with no_host_sync():
        assert mgr.offload_kv_cache(req)
    counts = mgr.manager._ledger.reading.device.counts
    pages = (node.pool.req_to_token[row, 4:12:4] // node.ps).tolist()
    assert counts[pages].tolist() == [1, 1] and int(counts.sum()) == 2
    with no_host_sync():
        node.drain(mgr)
    assert int(counts.sum()) == 0 and mgr.stats().copy_failures == 0 and mgr.offloader.stats().pages_stored == 2
    mgr.release_host_resources()
