"""SGLang's TP=1 release wait expiring under a copy still in flight (issue 25, point 7): SGLang then
frees (and may reuse) the request's slots, so whatever the copy lands is not the request's KV and
must never be stored under the request's page hashes."""

from __future__ import annotations

import os
import threading

import pytest
import structlog
import torch

from lifecycle.integrations.sglang.install import _release_hook
from lifecycle_tools.testkit.sglang_doubles import release_kv_cache
from tests.integrations.sglang_kit import Node, doubles_kit
from tests.integrations.test_sglang import build, stdlib_logging, store_dir  # noqa: F401  (fixtures)


def _hanging(mgr):
    """Copies that hang until the returned event is set."""
    engine, gate = mgr.offloader.engine, threading.Event()
    submit = engine.submit
    engine.submit = lambda tag, fn: submit(tag, lambda: (gate.wait(10), fn())[1])
    return gate


def test_a_copy_landing_after_the_release_wait_expired_stores_nothing_and_is_counted(store_dir):  # noqa: F811
    node = Node(doubles_kit())
    mgr = build(node)
    mgr.SGLANG_RELEASE_WAIT_S = 0.05
    gate = _hanging(mgr)  # a copy that hangs
    req = node.admit("late", list(range(4)), 30)
    node.decode_tokens(req, 4)
    row = req.kv.req_pool_idx
    slots = node.pool.req_to_token[row, 4:8].long().clone()
    assert mgr.offload_kv_cache(req)
    acks, state = mgr.manager.copies_of(req), mgr.manager.state_of(req)
    assert len(acks) == 1
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
    assert mgr.stats().copies_expired == 1 and mgr.stats().released == 1  # stopped waiting, ended as SGLang freed
    assert mgr.decode_host_mem_pool.available_size() == mgr.decode_host_mem_pool.size  # pages back
    expired = [e for e in logs if e["event"] == "sglang.release_under_copy"]   # one line, complete
    assert expired == [{"event": "sglang.release_under_copy", "log_level": "error", "rid": "late",
                        "state": state.name, "waited_s": 0.05, "copies_discarded": 1, "ack_ids": acks}]
    assert [e for e in logs if e["event"] == "sglang.released_by_sglang"] == [
        {"event": "sglang.released_by_sglang", "log_level": "debug", "rid": "late"}]
    mgr.release_host_resources()


def test_discard_write_of_an_unknown_ack_is_a_typed_error_and_changes_nothing(store_dir):  # noqa: F811

    from transfer.errors import UnknownId

    node = Node(doubles_kit())
    mgr = build(node)
    before = mgr.offloader.stats()
    with pytest.raises(UnknownId):
        mgr.offloader.discard_write(12345)
    assert mgr.offloader.stats() == before
    mgr.release_host_resources()


def test_an_aborted_request_whose_wait_expired_ends_without_a_refusal_or_a_second_free(
        store_dir, tmp_path, monkeypatch, stdlib_logging):  # noqa: F811
    from lifecycle_tools.replay import replay_file

    monkeypatch.setenv("KV_LIFECYCLE_AUDIT_DIR", str(tmp_path / "audit"))
    node = Node(doubles_kit())
    full, rows = node.alloc.available_size(), node.pool.available_size()
    mgr = build(node)
    mgr.SGLANG_RELEASE_WAIT_S = 0.05
    gate = _hanging(mgr)
    req = node.admit("aborted", list(range(4)), 30)
    node.decode_tokens(req, 4)
    assert mgr.offload_kv_cache(req)
    req.finished_reason = "abort"
    _release_hook(release_kv_cache)(req, node.tree, is_insert=False)  # SGLang frees after the wait
    assert mgr.manager.state_of(req).name == "RELEASED"
    gate.set()
    node.drain(mgr)  # the copy lands: no refusal raised into SGLang's loop, nothing freed again
    assert node.alloc.available_size() == full and node.pool.available_size() == rows
    assert mgr.offloader.stats().pages_stored == 0 and mgr.stats().quarantined_slots == 0
    mgr.check_integrity()
    path = mgr.audit_path
    mgr.release_host_resources()
    result = replay_file(path)  # the audit replay agrees: released once, nothing freed under a copy by us
    assert result.ok, result.violations


def test_a_retracted_request_resumes_on_a_new_row_while_its_discarded_copy_still_runs(store_dir):  # noqa: F811
    node = Node(doubles_kit())
    full = node.alloc.available_size()
    mgr = build(node)
    mgr.SGLANG_RELEASE_WAIT_S = 0.05
    gate = _hanging(mgr)
    req = node.admit("back", list(range(4)), 12)
    node.decode_tokens(req, 4)
    old_row = req.kv.req_pool_idx
    assert mgr.offload_kv_cache(req)
    _release_hook(release_kv_cache)(req, node.tree, is_insert=False)
    req.reset_for_retract()
    other = node.admit("other", list(range(8)), 30)  # takes the freed row and slots
    node.pool.alloc([req])
    assert req.kv.req_pool_idx != old_row
    node._grow(req, len(req.origin_input_ids) + len(req.output_ids) - 1)
    running = [req]
    while running:  # decoding goes on; the old copy is still stuck
        running = node.decode_step(mgr, running)
    gate.set()
    node.drain(mgr)
    stats = mgr.stats()
    assert (stats.released, stats.leaked) == (2, 0)
    other.finished_reason = "stop"
    mgr.finalize_release_on_finish(other)
    node.drain(mgr)
    assert node.alloc.available_size() == full  # every slot back once: the old copy's slots freed by SGLang only
    mgr.check_integrity()
    mgr.release_host_resources()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_copy_stuck_on_the_copy_stream_past_the_wait_stores_nothing(store_dir):  # noqa: F811
    """The same on the GPU: SGLang's pools on CUDA, the copy held back on the copy stream by a
    long kernel; the expired wait works out the quarantine of device slot ids (the documented host
    read) and frees nothing twice."""
    node = Node(doubles_kit(), device="cuda")
    full = node.alloc.available_size()
    mgr = build(node)
    mgr.SGLANG_RELEASE_WAIT_S = 0.05
    engine = mgr.offloader.engine
    submit = engine.submit
    engine.submit = lambda tag, fn: submit(tag, lambda: (torch.cuda._sleep(int(3e9)), fn())[1])  # ~1-2 s
    req = node.admit("late", list(range(4)), 30)
    node.decode_tokens(req, 4)
    assert mgr.offload_kv_cache(req)
    req.finished_reason = "abort"
    _release_hook(release_kv_cache)(req, node.tree, is_insert=False)
    node.drain(mgr)
    assert node.alloc.available_size() == full
    assert mgr.offloader.stats().copies_discarded == 1 and mgr.offloader.stats().pages_stored == 0
    assert not os.path.isdir(store_dir) or os.listdir(store_dir) == []
    mgr.release_host_resources()


def test_sglangs_release_answers_and_a_released_request_is_readmitted_only_with_a_row(store_dir):  # noqa: F811
    """``before_sglang_release`` returns True ("SGLang frees") for a request with no lifecycle, one
    already released, and after shutdown; a request SGLang released is neither offloaded nor
    finalized until it holds a row again, and the first call with a row starts its new lifecycle."""
    node = Node(doubles_kit(), page_size=4)
    mgr = build(node)
    stranger = node.admit("s", list(range(6)), 24)               # never offloaded: no lifecycle
    assert mgr.before_sglang_release(stranger) is True and mgr.manager.state_of(stranger) is None
    req = node.admit("r", list(range(10)), 24)
    node.decode_tokens(req, 6)
    assert mgr.offload_kv_cache(req)
    with structlog.testing.capture_logs() as logs:
        _release_hook(release_kv_cache)(req, node.tree, is_insert=False)   # retraction: copy waited for
    req.reset_for_retract()
    assert [e for e in logs if e["event"] == "sglang.released_by_sglang"] == [
        {"event": "sglang.released_by_sglang", "log_level": "debug", "rid": "r"}]
    released = mgr.stats()
    assert released.released == 1 and mgr.before_sglang_release(req) is True   # nothing left to wait for
    for row in (None, -1):                                        # not resumed yet: no row
        req.kv.req_pool_idx = row
        assert mgr.offload_kv_cache(req) is False
        mgr.finalize_release_on_finish(req)
        assert mgr.stats() == released
    req.kv.req_pool_idx = None
    node.pool.alloc([req])                                        # resume_retracted_reqs: a new row
    node._grow(req, len(req.origin_input_ids) + len(req.output_ids) - 1)
    assert mgr.offload_kv_cache(req) is True                      # readmitted, and offloaded at once
    assert mgr.stats().tracked == 1
    node.drain(mgr)
    mgr.release_host_resources()
    assert mgr.before_sglang_release(req) is True                 # after shutdown: SGLang frees


def test_with_tensor_parallelism_sglangs_release_waits_past_the_tp1_bound_for_the_copy(store_dir):  # noqa: F811
    """TP > 1: every rank must free the same slots at the same step, so the wait has no deadline
    (the TP=1 bound would let ranks diverge); the copy lands and the lifecycle ends as usual."""
    node = Node(doubles_kit())
    mgr = build(node)
    mgr.tp_world_size = 2
    mgr.SGLANG_RELEASE_WAIT_S = 0.05
    gate = _hanging(mgr)
    req = node.admit("tp", list(range(4)), 30)
    node.decode_tokens(req, 4)
    assert mgr.offload_kv_cache(req)
    timer = threading.Timer(0.5, gate.set)    # the copy lands ten bounds later
    timer.start()
    with structlog.testing.capture_logs() as logs:
        _release_hook(release_kv_cache)(req, node.tree, is_insert=False)
    timer.join()
    assert [e for e in logs if e["event"] == "sglang.release_under_copy"] == []
    assert mgr.stats().copies_expired == 0 and mgr.stats().released == 1
    assert mgr.offloader.stats().copies_discarded == 0
    node.drain(mgr)
    mgr.release_host_resources()


# --- SGLang 0.5.23's scheduler: drain_before_retraction() before it retracts (issue 36) ---------


def test_drain_before_retraction_settles_every_copy_reading_device_kv(store_dir):  # noqa: F811
    node = Node(doubles_kit())
    mgr = build(node)
    gate = _hanging(mgr)
    req = node.admit("r", list(range(4)), 30)
    node.decode_tokens(req, 4)
    assert mgr.offload_kv_cache(req)
    assert mgr.has_inflight_device_transfer() and len(mgr.ongoing_offload) == 1
    threading.Timer(0.2, gate.set).start()  # the copy lands while the drain waits
    mgr.drain_before_retraction()
    assert not mgr.has_inflight_device_transfer() and mgr.stats().inflight_writes == 0
    assert mgr.stats().chunks_landed == 1
    node.drain(mgr)
    mgr.release_host_resources()


def test_drain_before_retraction_with_tp_1_stops_at_the_bound_and_never_raises(store_dir):  # noqa: F811
    """Where SGLang 0.5.23's own manager raises RuntimeError, the drop-in waits at most
    ``SGLANG_RELEASE_WAIT_S`` (TP=1), warns once, and leaves the request to ``release_kv_cache``'s
    hook (which discards what the stuck copy reads, as tested above)."""
    node = Node(doubles_kit())
    mgr = build(node)
    mgr.SGLANG_RELEASE_WAIT_S = 0.05
    gate = _hanging(mgr)
    req = node.admit("stuck", list(range(4)), 30)
    node.decode_tokens(req, 4)
    assert mgr.offload_kv_cache(req)
    with structlog.testing.capture_logs() as logs:
        mgr.drain_before_retraction()
    assert mgr.has_inflight_device_transfer()
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["sglang.drain_before_retraction_bound"]
    _release_hook(release_kv_cache)(req, node.tree, is_insert=False)  # the retraction: SGLang frees
    assert req.kv.req_pool_idx is None and mgr.stats().copies_expired == 1
    gate.set()
    node.drain(mgr)
    mgr.release_host_resources()
    mgr.drain_before_retraction()  # after shutdown: nothing to do
