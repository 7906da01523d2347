"""The SGLang integration end to end on CPU: constructed exactly as SGLang 0.5.19's scheduler does,
driven by its decode loop over SGLang-shaped pools (the doubles, and SGLang's own classes where
sglang is importable), checked against SGLang's accounting, our invariants and the stored files."""

from __future__ import annotations

import os

import pytest
import torch

from hashing import page_hashes
from lifecycle import ConfigError, InvalidTransition
from lifecycle.release import ReleaseRefused
from lifecycle.integrations.sglang import DecodeKVCacheOffloadManager, use_runtime
from lifecycle_tools.testkit.sglang_doubles import runtime_context
from tests.integrations.sglang_kit import (
    Node, doubles_kit, hicache_file_get, hicache_file_suffix, require_sglang, sglang_kit,
)

MODEL = "org/Model-7B"


def _kit(name):
    if name == "doubles":
        return doubles_kit()
    require_sglang()  # skips without sglang (the doubles run instead), fails under KV_LIFECYCLE_REQUIRE_SGLANG=1
    return sglang_kit()


@pytest.fixture(params=["doubles", "sglang"])
def kit(request):
    return _kit(request.param)


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    path = tmp_path / "hicache"
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(path))
    monkeypatch.delenv("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", raising=False)
    return str(path)


def build(node: Node, **ctx):
    """The construction in ``Scheduler.__init__`` (sglang/srt/managers/scheduler.py), keyword for keyword."""
    with use_runtime(runtime_context(page_size=node.ps, model=MODEL, **ctx)):
        return DecodeKVCacheOffloadManager(
            req_to_token_pool=node.pool,
            token_to_kv_pool_allocator=node.alloc,
            tp_group=None,
            tree_cache=node.tree,
        )


def run_decode(node: Node, mgr, specs):
    reqs = [node.admit(rid, prompt, max_new, prefix) for rid, prompt, max_new, prefix in specs]
    running = list(reqs)
    while running:
        running = node.decode_step(mgr, running)
    node.drain(mgr)
    return reqs


def expected_pages(node: Node, req, stride: int):
    """(page hash, bytes) of every page the decode side offloads: whole strides after the prompt's
    page-aligned part, over prompt + outputs whose KV was committed."""
    ps = node.ps
    tokens = list(req.origin_input_ids) + list(req.output_ids[:-1])  # SGLang's Req: an array of outputs
    prefill = len(req.origin_input_ids) // ps * ps
    n = (len(tokens) - prefill) // stride * stride
    prior = page_hashes(tokens[:prefill], ps)
    hashes = page_hashes(tokens[prefill:prefill + n], ps, prior[-1] if prior else None)
    return [(h, node.page_bytes(req.rid, prefill + i * ps)) for i, h in enumerate(hashes)]


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_decode_loop_offloads_stores_and_releases_through_sglang_accounting(kit, store_dir, mla):
    node = Node(kit, mla=mla)
    free_pages, free_rows = node.alloc.available_size(), node.pool.available_size()
    mgr = build(node)
    specs = [("a", list(range(10, 23)), 11, 4), ("b", list(range(50, 58)), 9, 0), ("c", [7] * 5, 14, 0)]
    reqs = run_decode(node, mgr, specs)

    mgr.check_integrity()
    stats = mgr.stats()
    assert (stats.released, stats.leaked, stats.tracked) == (3, 0, 0)
    assert len(mgr.ongoing_offload) == 0
    # SGLang's accounting: one free_kv_row per request, row freed, kv released, protected size back
    assert sorted(row for row, _ in node.tree.freed_rows) == sorted({row for row, _ in node.tree.freed_rows})
    assert len(node.tree.freed_rows) == 3
    assert node.tree.protected_size_ == 0
    for req in reqs:
        assert req.kv.req_pool_idx is None and req.kv.is_kv_released
    assert node.alloc.available_size() == free_pages
    assert node.pool.available_size() == free_rows
    # the stored files: HiCacheFile's names, exactly the device KV's bytes
    suffix = hicache_file_suffix(MODEL, 0, 1, mla)
    nbytes = mgr.decode_host_mem_pool.page_nbytes
    names = sorted(os.listdir(store_dir))
    want = [p for req in reqs for p in expected_pages(node, req, mgr.offload_stride)]
    assert len(want) == stats.pages_enqueued > 0
    assert names == sorted(f"{h}{suffix}.bin" for h, _ in want)
    for h, data in want:
        assert hicache_file_get(store_dir, h, suffix, nbytes) == data
    mgr.release_host_resources()
    mgr.release_host_resources()  # idempotent, as SGLang's shutdown path may call it again


def test_release_ranges_match_sglangs_own_release(store_dir):
    node = Node(doubles_kit(), page_size=4)
    mgr = build(node)
    req = node.admit("r", list(range(13)), 6)
    row = req.kv.req_pool_idx
    running = [req]
    while running:
        running = node.decode_step(mgr, running)
    node.drain(mgr)
    # committed = allocated = 13 + 6 - 1 = 18 tokens: SGLang's manager passes (0, 12), (12, 18);
    # ours (0, 18): the same slots, in one free_kv_row call
    assert node.tree.freed_rows == [(row, [(0, 18)])]
    mgr.release_host_resources()


def test_stride_from_sglangs_env_var(kit, store_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", "10")  # SGLang rounds down to pages: 8
    node = Node(kit, page_size=4)
    mgr = build(node)
    assert mgr.offload_stride == 8
    reqs = run_decode(node, mgr, [("s", list(range(9)), 20, 0)])
    want = expected_pages(node, reqs[0], 8)
    assert mgr.stats().chunks_enqueued == len(want) // 2
    assert sorted(os.listdir(store_dir)) == sorted(f"{h}{hicache_file_suffix(MODEL, 0, 1, False)}.bin"
                                                   for h, _ in want)
    mgr.release_host_resources()


def test_ongoing_offload_counts_copies_until_settled(store_dir):
    node = Node(doubles_kit(), page_size=4)
    mgr = build(node)
    req = node.admit("o", list(range(4)), 30)
    node.decode_tokens(req, 4, 5)
    assert len(mgr.ongoing_offload) == 0 and not mgr.ongoing_offload
    assert mgr.offload_kv_cache(req) is True
    assert len(mgr.ongoing_offload) == 1  # SGLang's scheduler is not idle until it is settled
    node.drain(mgr)
    assert len(mgr.ongoing_offload) == 0
    req.finished_reason = "abort"
    mgr.finalize_release_on_finish(req)
    assert req.kv.req_pool_idx is None
    mgr.release_host_resources()


def test_device_buffers_are_read_in_place(store_dir):
    node = Node(doubles_kit())
    mgr = build(node)
    pool = mgr.device_pool
    assert all(pool.k_buffer(i) is node.kv.k_buffer[i] for i in range(node.layers))
    assert all(pool.v_buffer(i) is node.kv.v_buffer[i] for i in range(node.layers))
    host = mgr.decode_host_mem_pool
    # SGLang's sizing: hicache_ratio 2.0 x device size 512, in whole pages, plus one page
    assert host.size == (int(512 * 2.0) // 4 + 1) * 4
    assert tuple(host.buffer.shape[1:]) == (2, 4, node.layers, node.heads, node.dim)
    mgr.release_host_resources()


def test_a_refused_release_changes_nothing(store_dir):
    node = Node(doubles_kit())
    mgr = build(node)
    req = node.admit("p", list(range(8)), 3, prefix=4)
    node.tree.protected_size_ = 0  # the radix cache lost track: releasing would drive it negative
    req.finished_reason = "abort"
    row, free_pages = req.kv.req_pool_idx, node.alloc.available_size()
    with pytest.raises(ReleaseRefused, match="protects only 0"):
        mgr.finalize_release_on_finish(req)
    assert req.kv.req_pool_idx == row and req.kv.kv_allocated_len > 0
    assert node.alloc.available_size() == free_pages and node.tree.freed_rows == []
    node.tree.protected_size_ = 4
    mgr.finalize_release_on_finish(req)
    assert req.kv.req_pool_idx is None and node.tree.protected_size_ == 0
    mgr.check_integrity()
    mgr.release_host_resources()


def test_config_errors_are_lifecycle_config_errors(store_dir):
    node = Node(doubles_kit())
    with pytest.raises(ConfigError, match="backend sim cannot be used.*supported: file"):
        build(node, backend="sim")
    assert not os.path.exists(store_dir)
    torch.testing.assert_close(node.kv.k_buffer[0], torch.zeros_like(node.kv.k_buffer[0]))


def test_speculative_over_allocation_is_freed_past_the_committed_page(store_dir):
    node = Node(doubles_kit(), page_size=4)
    mgr = build(node)
    full = node.alloc.available_size()
    req = node.admit("spec", list(range(6)), 3)
    node._grow(req, 7)
    req.output_ids.append(1)
    slots_ahead = node.alloc.alloc(8)  # spec v2 reserves two more pages past the committed one
    row = req.kv.req_pool_idx
    node.pool.req_to_token[row, 8:16] = slots_ahead.to(torch.int32)
    req.kv.kv_allocated_len = 16
    req.finished_reason = "abort"
    if not mgr.offload_kv_cache(req):
        mgr.finalize_release_on_finish(req)
    node.drain(mgr)
    assert node.tree.freed_rows == [(row, [(0, 7), (8, 16)])]
    assert node.alloc.available_size() == full  # the prompt's two pages and the two reserved ahead
    mgr.release_host_resources()


def test_sglang_retraction_waits_for_copies_then_the_request_resumes_in_a_new_lifecycle(
        store_dir, tmp_path, monkeypatch, stdlib_logging):
    from lifecycle.integrations.sglang.install import _release_hook
    from lifecycle_tools.replay import replay_file
    from lifecycle_tools.testkit.sglang_doubles import release_kv_cache

    monkeypatch.setenv("KV_LIFECYCLE_AUDIT_DIR", str(tmp_path / "audit"))
    node = Node(doubles_kit(), page_size=4)
    free_pages, free_rows = node.alloc.available_size(), node.pool.available_size()
    mgr = build(node)
    seen = []

    def sglangs_release(req, tree_cache, is_insert=True):
        seen.append((len(mgr.ongoing_offload), mgr.stats().by_state["RELEASED"]))
        release_kv_cache(req, tree_cache, is_insert)

    hook = _release_hook(sglangs_release)  # what install() binds as release_kv_cache
    req = node.admit("r", list(range(10)), 24)
    for _ in range(6):
        node._grow(req, req.kv.kv_committed_len + 1)
        req.output_ids.append(2000 + req.kv.kv_committed_len)
    assert mgr.offload_kv_cache(req) and len(mgr.ongoing_offload) == 1
    hook(req, node.tree, is_insert=False)  # retract_decode -> release_req -> release_kv_cache
    req.reset_for_retract()
    assert seen == [(0, 1)]  # SGLang freed only after the copy settled and the lifecycle ended
    assert node.alloc.available_size() == free_pages and node.pool.available_size() == free_rows
    mgr.check_integrity()
    # resume_retracted_reqs: a new row, the KV restored, decoding goes on
    node.pool.alloc([req])
    node._grow(req, len(req.origin_input_ids) + len(req.output_ids) - 1)
    running = [req]
    while running:
        running = node.decode_step(mgr, running)
    node.drain(mgr)
    mgr.check_integrity()
    stats = mgr.stats()
    assert (stats.released, stats.leaked, stats.tracked) == (2, 0, 0)
    assert node.alloc.available_size() == free_pages and node.pool.available_size() == free_rows
    want = expected_pages(node, req, mgr.offload_stride)
    suffix = hicache_file_suffix(MODEL, 0, 1, False)
    assert sorted(os.listdir(store_dir)) == sorted(f"{h}{suffix}.bin" for h, _ in want)
    for h, data in want:
        assert hicache_file_get(store_dir, h, suffix, mgr.decode_host_mem_pool.page_nbytes) == data
    assert mgr.storage.stats().skipped > 0  # the pages offloaded before the retraction, offered again
    path = mgr.audit_path
    mgr.release_host_resources()
    result = replay_file(path)  # two generations of one request, each released exactly once
    assert result.ok, result.violations
    assert result.event_counts["lifecycle.released"] == 2 and result.event_counts["sglang.released_by_sglang"] == 1


@pytest.fixture
def stdlib_logging():
    """As in SGLang's scheduler process: structlog not configured (the test suite configures it)."""
    import structlog

    saved = structlog.get_config()
    structlog.reset_defaults()
    yield
    structlog.configure(**saved)


def test_the_audit_trail_inside_sglang_replays_clean(store_dir, tmp_path, monkeypatch, stdlib_logging):
    from lifecycle_tools.replay import replay_file

    monkeypatch.setenv("KV_LIFECYCLE_AUDIT_DIR", str(tmp_path / "audit"))
    node = Node(doubles_kit())
    mgr = build(node)
    run_decode(node, mgr, [("a", list(range(10, 23)), 11, 0), ("b", list(range(50, 58)), 9, 0)])
    path = mgr.audit_path
    mgr.release_host_resources()
    assert os.path.dirname(path) == str(tmp_path / "audit")
    assert os.path.basename(path) == f"lifecycle-tp0-pp0-{os.getpid()}.jsonl"
    result = replay_file(path)
    assert result.ok, result.violations
    assert len(result.lifecycles) == 2 and result.event_counts["lifecycle.released"] == 2
    assert result.event_counts["sglang.decode_offload_enabled"] == 1
    import logging
    assert logging.getLogger("lifecycle").propagate and not logging.getLogger("lifecycle").handlers


def test_an_out_of_order_call_is_refused_where_sglangs_manager_returns_silently(store_dir):
    node = Node(doubles_kit())
    mgr = build(node)
    req = node.admit("x", list(range(8)), 3)
    req.finished_reason = "stop"
    mgr.finalize_release_on_finish(req)
    with pytest.raises(InvalidTransition, match="already finalized or released"):
        mgr.finalize_release_on_finish(req)
    mgr.check_integrity()
    mgr.release_host_resources()


def test_with_tp_1_a_release_waits_at_most_the_bound_then_sglang_frees(store_dir):
    import structlog

    from lifecycle.integrations.sglang.install import _release_hook
    from lifecycle_tools.testkit.sglang_doubles import release_kv_cache

    node = Node(doubles_kit())
    mgr = build(node)
    mgr.SGLANG_RELEASE_WAIT_S = 0.05
    req = node.admit("stuck", list(range(4)), 30)
    node.decode_tokens(req, 4)
    poll = mgr.offloader.engine.poll
    mgr.offloader.engine.poll = lambda: []  # the copy never reports: a stuck copy
    assert mgr.offload_kv_cache(req)
    with structlog.testing.capture_logs() as logs:
        _release_hook(release_kv_cache)(req, node.tree, is_insert=False)
    errors = [e["event"] for e in logs if e["log_level"] == "error"]
    assert errors[0] == "sglang.release_under_copy" and errors.count("lifecycle.copy_expired") == 1
    assert req.kv.req_pool_idx is None  # SGLang freed, as it would without us
    assert mgr.manager.state_of(req).name == "RELEASED"
    mgr.offloader.engine.poll = poll
    node.drain(mgr)
    assert os.listdir(store_dir) == []  # the expired copy read slots SGLang freed: never stored
    mgr.release_host_resources()


def test_audit_trail_keeps_sglangs_console_at_info(store_dir, tmp_path, monkeypatch, stdlib_logging):
    import logging

    monkeypatch.setenv("KV_LIFECYCLE_AUDIT_DIR", str(tmp_path / "audit"))
    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append((record.name, record.levelno))

    root = logging.getLogger()
    catch = Catch(logging.DEBUG)
    root.addHandler(catch)
    try:
        node = Node(doubles_kit())
        mgr = build(node)
        run_decode(node, mgr, [("a", list(range(9)), 9, 0)])
        mgr.release_host_resources()
    finally:
        root.removeHandler(catch)
    mine = [lv for name, lv in seen if name.startswith("lifecycle")]
    assert mine and min(mine) >= logging.INFO
    with open(mgr.audit_path) as f:
        assert any('"level": "debug"' in line for line in f)


def test_host_pool_from_hicache_size_in_gb(store_dir):
    node = Node(doubles_kit())
    mgr = build(node, size_gb=0.001, ratio=None)
    per_token = 2 * node.layers * node.heads * node.dim * 2
    assert mgr.decode_host_mem_pool.size == (int(0.001 * 1e9 // per_token) // 4 + 1) * 4
    mgr.release_host_resources()


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_sglangs_own_file_backend_finds_and_reads_the_pages(store_dir, mla):
    """Where sglang is importable: SGLang's HiCacheFile (in the directory from its env var, with its
    own suffix) and its own hash chain (``get_hash_str``, as ``_compute_prefix_hash`` chains it)
    find every page the integration stored, byte for byte."""
    require_sglang()
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    from sglang.srt.mem_cache.utils import get_hash_str
    node = Node(sglang_kit(), mla=mla)
    mgr = build(node)
    reqs = run_decode(node, mgr, [("a", list(range(10, 23)), 11, 0), ("b", [3] * 9, 10, 0)])
    mgr.release_host_resources()
    sglang_file = HiCacheFile(HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=MODEL))
    assert sglang_file.file_path == store_dir
    nbytes = mgr.decode_host_mem_pool.page_nbytes
    for req in reqs:
        ps, tokens = node.ps, req.origin_input_ids + req.output_ids[:-1]
        prefill = len(req.origin_input_ids) // ps * ps
        last = ""
        for start in range(0, prefill, ps):  # the prefill side's chain, as SGLang computes it
            last = get_hash_str(tokens[start:start + ps], last)
        for start in range(prefill, len(tokens) - ps + 1, ps):
            last = get_hash_str(tokens[start:start + ps], last)
            target = torch.empty(nbytes, dtype=torch.uint8)
            assert sglang_file.get(last, target) is not None, f"{req.rid} page at {start}"
            assert target.numpy().tobytes() == node.page_bytes(req.rid, start)


def test_with_structlog_configured_events_follow_it_and_the_file_stays_empty(store_dir, tmp_path, monkeypatch):
    import structlog

    assert structlog.is_configured()  # the test suite's configuration (events dropped)
    monkeypatch.setenv("KV_LIFECYCLE_AUDIT_DIR", str(tmp_path / "audit"))
    node = Node(doubles_kit())
    mgr = build(node)
    with structlog.testing.capture_logs() as logs:
        run_decode(node, mgr, [("a", list(range(9)), 9, 0)])
    path = mgr.audit_path
    mgr.release_host_resources()
    assert any(e["event"] == "lifecycle.released" for e in logs)
    assert os.path.getsize(path) == 0


def test_sglang_releasing_a_finished_request_with_a_copy_in_flight_frees_it_once(store_dir):
    from lifecycle.integrations.sglang.install import _release_hook

    node = Node(doubles_kit())
    full = node.alloc.available_size()
    mgr = build(node)
    called = []
    hook = _release_hook(lambda req, tree, is_insert=True: called.append(req))
    req = node.admit("f", list(range(4)), 5)
    node.decode_tokens(req, 4, 3)
    req.finished_reason = "length"
    assert mgr.offload_kv_cache(req)  # the last chunk: released when it lands
    assert hook(req, node.tree) is None
    assert called == []  # the lifecycle released it after the copy: SGLang must not free it again
    assert req.kv.req_pool_idx is None and node.alloc.available_size() == full
    assert len(node.tree.freed_rows) == 1
    mgr.check_integrity()
    mgr.release_host_resources()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float16, torch.float32], ids=str)
def test_stored_pages_are_bit_exact_for_every_kv_dtype(store_dir, dtype):
    """fp8 KV lives in uint8 buffers (SGLang's store_dtype); every dtype reaches the file unchanged."""
    node = Node(doubles_kit(), dtype=dtype)
    mgr = build(node)
    assert mgr.decode_host_mem_pool.dtype == node.kv.store_dtype
    reqs = run_decode(node, mgr, [("d", list(range(6)), 12, 0)])
    suffix = hicache_file_suffix(MODEL, 0, 1, False)
    want = expected_pages(node, reqs[0], mgr.offload_stride)
    assert want and sorted(os.listdir(store_dir)) == sorted(f"{h}{suffix}.bin" for h, _ in want)
    for h, data in want:
        assert hicache_file_get(store_dir, h, suffix, mgr.decode_host_mem_pool.page_nbytes) == data
    mgr.release_host_resources()


def test_sglangs_console_at_info_gets_no_line_per_request(store_dir, stdlib_logging):
    """Issue 21: SGLang's default ``--log-level info`` shows nothing per request (the per-request
    events, ``lifecycle.released`` and ``sglang.released_by_sglang`` included, are DEBUG); a
    handful of lines per process at most, whatever the number of requests."""
    import logging

    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record)

    root = logging.getLogger()
    catch, level = Catch(logging.INFO), root.level
    root.addHandler(catch)
    root.setLevel(logging.INFO)      # SGLang's default console
    try:
        node = Node(doubles_kit())
        mgr = build(node)
        run_decode(node, mgr, [(f"r{i}", list(range(7 * i, 7 * i + 9)), 9, 0) for i in range(6)])
        mgr.release_host_resources()
    finally:
        root.removeHandler(catch)
        root.setLevel(level)
    ours = [r for r in seen if r.name.startswith("lifecycle")]
    assert mgr.manager.stats().released == 6
    assert [r.getMessage() for r in ours if "rid" in getattr(r, "event_dict", {})] == []
    assert len(ours) <= 2, [r.getMessage() for r in ours]   # enabled, host resources released


def _a_finished_request_with_a_copy_accepted(node, mgr, rid="late"):
    req = node.admit(rid, list(range(4)), 30)
    node.decode_tokens(req, 4, 7)
    assert mgr.offload_kv_cache(req)  # accepted: one page, prompt boundary 4 .. 8
    req.finished_reason = "abort"
    mgr.finalize_release_on_finish(req)  # released when the copy lands
    return req


def test_release_host_resources_stores_what_it_accepted_and_empties_ongoing_offload(kit, store_dir):
    """Issue 20, point 3: a copy accepted just before shutdown lands, is written to storage and its
    request released through SGLang's tree cache; nothing is cut off."""
    node = Node(kit, page_size=4)
    free_pages, free_rows = node.alloc.available_size(), node.pool.available_size()
    mgr = build(node)
    req = _a_finished_request_with_a_copy_accepted(node, mgr)
    mgr.release_host_resources()  # at once: no progress check in between
    assert len(mgr.ongoing_offload) == 0
    stats = mgr.stats()
    assert (stats.released, stats.abandoned, stats.inflight_writes, stats.inflight_storage) == (1, 0, 0, 0)
    assert req.kv.req_pool_idx is None
    assert node.alloc.available_size() == free_pages and node.pool.available_size() == free_rows
    want = expected_pages(node, req, mgr.offload_stride)
    suffix = hicache_file_suffix(MODEL, 0, 1, False)
    assert len(want) == 1 and os.listdir(store_dir) == [f"{want[0][0]}{suffix}.bin"]
    assert hicache_file_get(store_dir, want[0][0], suffix, mgr.decode_host_mem_pool.page_nbytes) == want[0][1]


def test_release_host_resources_bound_is_configurable_and_what_it_cuts_off_is_logged_once_and_counted(
        store_dir, monkeypatch):
    import structlog

    monkeypatch.setenv("KV_LIFECYCLE_SGLANG_SHUTDOWN_TIMEOUT_S", "0.1")
    node = Node(doubles_kit(), page_size=4)
    mgr = build(node)
    assert mgr.config.shutdown_timeout_s == 0.1
    free_pages = node.alloc.available_size()
    req = _a_finished_request_with_a_copy_accepted(node, mgr, "stuck")
    mgr.offloader.engine.poll = lambda: []  # the copy never reports: a stuck copy
    with structlog.testing.capture_logs() as logs:
        mgr.release_host_resources()
    cut = [e for e in logs if e["event"] == "lifecycle.abandoned"]
    assert len(cut) == 1 and cut[0]["log_level"] == "error" and cut[0]["copies"] == [("stuck", 1, 4, 8)]
    assert mgr.stats().abandoned == 1 and len(mgr.ongoing_offload) == 0
    assert req.kv.req_pool_idx is not None  # never freed under the copy that may still read it
    assert node.alloc.available_size() < free_pages
    assert os.listdir(store_dir) == []


def _retracted_after_the_wait_expired(node, mgr, rid):
    """A decoding request with a copy that never reports, retracted by SGLang (release_kv_cache):
    the TP=1 wait expires and SGLang frees its slots and row."""
    from lifecycle.integrations.sglang.install import _release_hook
    from lifecycle_tools.testkit.sglang_doubles import release_kv_cache

    mgr.SGLANG_RELEASE_WAIT_S = 0.05
    req = node.admit(rid, list(range(10)), 24)
    for _ in range(6):
        node._grow(req, req.kv.kv_committed_len + 1)
        req.output_ids.append(2000 + req.kv.kv_committed_len)
    poll = mgr.offloader.engine.poll
    mgr.offloader.engine.poll = lambda: []  # the copy never reports while SGLang waits
    assert mgr.offload_kv_cache(req)
    _release_hook(release_kv_cache)(req, node.tree, is_insert=False)  # retract_decode
    req.reset_for_retract()
    mgr.offloader.engine.poll = poll
    return req


def test_resume_after_the_tp1_release_wait_expired_starts_a_new_lifecycle(kit, store_dir):
    """Issue 20, point 4: no InvalidRequest into SGLang's loop; the resumed request is offloaded
    and released in a new lifecycle, every slot and row comes back once, and only bytes read from
    slots SGLang still held are stored."""
    node = Node(kit, page_size=4)
    free_pages, free_rows = node.alloc.available_size(), node.pool.available_size()
    mgr = build(node)
    req = _retracted_after_the_wait_expired(node, mgr, "r")
    assert req.kv.req_pool_idx is None and node.alloc.available_size() == free_pages
    # resume_retracted_reqs: a new row, the KV restored, decoding goes on
    node.pool.alloc([req])
    node._grow(req, len(req.origin_input_ids) + len(req.output_ids) - 1)
    running = [req]
    while running:
        running = node.decode_step(mgr, running)
    node.drain(mgr)
    mgr.check_integrity()
    stats = mgr.stats()
    assert (stats.released, stats.leaked, stats.tracked, stats.copies_expired) == (2, 0, 0, 1)
    assert node.alloc.available_size() == free_pages and node.pool.available_size() == free_rows
    assert node.tree.protected_size_ == 0
    want = expected_pages(node, req, mgr.offload_stride)
    suffix = hicache_file_suffix(MODEL, 0, 1, False)
    assert sorted(os.listdir(store_dir)) == sorted(f"{h}{suffix}.bin" for h, _ in want)
    for h, data in want:
        assert hicache_file_get(store_dir, h, suffix, mgr.decode_host_mem_pool.page_nbytes) == data
    mgr.release_host_resources()


def test_a_request_aborted_while_retracted_after_the_wait_expired_is_not_a_leak(kit, store_dir):
    import gc

    node = Node(kit, page_size=4)
    free_pages, free_rows = node.alloc.available_size(), node.pool.available_size()
    mgr = build(node)
    req = _retracted_after_the_wait_expired(node, mgr, "gone")
    req.finished_reason = "abort"  # aborted in the waiting queue: SGLang drops it, no row to free
    del req
    gc.collect()
    node.drain(mgr)
    stats = mgr.stats()
    assert (stats.leaked, stats.released, stats.tracked) == (0, 1, 0)
    assert node.alloc.available_size() == free_pages and node.pool.available_size() == free_rows
    mgr.release_host_resources()


def test_shutdown_with_an_abandoned_copy_leaves_the_host_pool_pinned_even_at_exit(tmp_path):
    """Issue 35, point 13: ``release_host_resources`` with a copy still in flight (it never
    reports) neither closes nor unpins the pinned host pool under it — not at shutdown, not at
    interpreter exit (the pool's ``cudaHostUnregister`` is a stand-in that prints when it runs, in
    a process of its own). The control: with the copy landed, the pool is unpinned once, at
    shutdown."""
    from tests.support.pinned_exit import run

    assert run("sglang-abandoned", tmp_path) == ["pinned True", "end of run"]
    assert run("sglang-clean", tmp_path) == ["unregister during-run", "pinned False", "end of run"]


def test_release_host_resources_is_one_bound_even_with_a_storage_write_hung_in_the_filesystem(
        kit, store_dir, monkeypatch):
    """The bound is the whole call's: the drain, the offloader's close and the store's close share one
    deadline. A page write hung in the filesystem (a FIFO where the store opens its temporary file)
    once cost the bound, then the file tier's own 10 s close wait on top of it."""
    import time

    from tests.support.hung_fs import HungWrite

    bound = 2.0
    node = Node(kit, page_size=4)
    mgr = build(node)
    req = _a_finished_request_with_a_copy_accepted(node, mgr, "hung")
    (name, _), = expected_pages(node, req, mgr.offload_stride)
    hung = HungWrite(mgr.storage, name + hicache_file_suffix(MODEL, 0, 1, False), monkeypatch)
    start = time.monotonic()
    mgr.release_host_resources(timeout_s=bound)
    took = time.monotonic() - start
    hung.release()
    assert took < bound + 3.0, f"release_host_resources(timeout_s={bound}) took {took:.2f} s"
    assert mgr.stats().abandoned == 1 and len(mgr.ongoing_offload) == 0
    assert os.listdir(store_dir) == []
