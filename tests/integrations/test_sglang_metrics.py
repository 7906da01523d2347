"""Inside SGLang with ``--enable-metrics``: our metrics reach SGLang's ``/metrics``, which serves what
``prometheus_client``'s ``MultiProcessCollector`` reads from the scheduler processes'
``PROMETHEUS_MULTIPROC_DIR`` (``sglang.srt.utils.common.add_prometheus_middleware``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, multiprocess
from prometheus_client.exposition import generate_latest

from lifecycle import metrics as lifecycle_metrics
from lifecycle.integrations.sglang import metrics as sglang_metrics
from lifecycle_tools.testkit.sglang_doubles import runtime_context

ROOT = Path(__file__).resolve().parents[2]


def test_a_scheduler_process_metrics_are_served_from_the_multiprocess_dir(tmp_path):
    prom, out = tmp_path / "prom", tmp_path / "stats.json"
    prom.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(prom), "PYTHONPATH": str(ROOT),
           "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path / "hicache")}
    env.pop("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", None)
    proc = subprocess.run([sys.executable, "-m", "tests.support.sglang_metrics_worker", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stats = json.loads(out.read_text())
    reg = CollectorRegistry()                      # what SGLang's HTTP server does
    multiprocess.MultiProcessCollector(reg, path=str(prom))
    rank = {"tp_rank": "0", "pp_rank": "0"}

    def value(name, **labels):
        v = reg.get_sample_value(name, {**rank, **labels})
        assert v is not None, (name, labels, generate_latest(reg).decode()[:2000])
        return v

    m, tier = stats["manager"], stats["tiers"][0]
    assert value("kv_lifecycle_requests_total", outcome="released") == m["released"] == 2
    assert value("kv_lifecycle_pages_offloaded_total") == m["pages_enqueued"] > 0
    assert value("kv_lifecycle_chunks_offloaded_total") == m["chunks_enqueued"]
    assert value("kv_lifecycle_storage_pages_total", tier="file", result="new") == tier["storage"]["stored"] > 0
    assert value("kv_lifecycle_copy_seconds_count") == stats["offloader"]["writes_landed"]
    assert value("kv_lifecycle_manager_step_seconds_count") > 0
    assert value("kv_lifecycle_copies_in_flight") == 0


def test_without_enable_metrics_nothing_is_hooked():
    ctx = runtime_context()
    assert not sglang_metrics.enabled(ctx)                 # no get_observability at all
    ctx.get_observability = lambda: type("O", (), {"enable_metrics": False})()
    assert not sglang_metrics.enabled(ctx)
    assert sglang_metrics.hook(object(), ctx, 0, 0) is None
    ctx.get_observability = lambda: object()              # an observability without the flag
    assert not sglang_metrics.enabled(ctx)
    ctx.get_observability = lambda: type("O", (), {"enable_metrics": True})()
    assert sglang_metrics.enabled(ctx)


# --- in this process: the hook itself ------------------------------------------------------------

import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import prometheus_client  # noqa: E402
import pytest  # noqa: E402

from lifecycle.integrations.sglang import DecodeKVCacheOffloadManager, use_runtime  # noqa: E402
from lifecycle.node_stats import collect  # noqa: E402
from tests.integrations.sglang_kit import Node, doubles_kit  # noqa: E402


@pytest.fixture
def registry(monkeypatch, tmp_path):
    """A fresh default registry (SGLang's schedulers use ``prometheus_client.REGISTRY``), and no
    process metrics created yet."""
    reg = CollectorRegistry()
    monkeypatch.setattr(prometheus_client, "REGISTRY", reg)
    monkeypatch.setattr(lifecycle_metrics, "_process_metrics", None)
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "hicache"))
    monkeypatch.delenv("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", raising=False)
    return reg


def _manager(node, pp_rank=1):
    ctx = runtime_context(page_size=node.ps, model="org/Model-7B", pp_rank=pp_rank, pp_size=2)
    ctx.get_observability = lambda: SimpleNamespace(enable_metrics=True)
    with use_runtime(ctx):
        return DecodeKVCacheOffloadManager(req_to_token_pool=node.pool, token_to_kv_pool_allocator=node.alloc,
                                           tp_group=None, tree_cache=node.tree)


def _decode(node, mgr) -> int:
    """Decode two requests to the end and drain; how many scheduler steps (``check_offload_progress``
    calls) that took."""
    steps, step = [0], mgr.check_offload_progress

    def counted():
        steps[0] += 1
        step()

    mgr.check_offload_progress = counted
    running = [node.admit("a", list(range(10, 23)), 11), node.admit("b", [5] * 9, 6)]
    while running:
        running = node.decode_step(mgr, running)
    node.drain(mgr)
    mgr.check_offload_progress = step
    return steps[0]


RANK = {"tp_rank": "0", "pp_rank": "1"}


@pytest.mark.parametrize("update_s", [0.0, 3600.0])
def test_the_hook_refreshes_our_metrics_every_update_s_and_at_shutdown(registry, monkeypatch, update_s):
    monkeypatch.setattr(sglang_metrics, "UPDATE_S", update_s)
    node = Node(doubles_kit(), page_size=4)
    mgr = _manager(node)
    assert mgr.metrics is not None and mgr.metrics.labels == RANK
    steps = _decode(node, mgr)
    released = mgr.stats().released
    assert released == 2
    # every step refreshes with UPDATE_S 0; with an hour, only the first step did (nothing released yet)
    assert registry.get_sample_value("kv_lifecycle_requests_total", {**RANK, "outcome": "released"}) == (
        released if update_s == 0 else 0)
    assert registry.get_sample_value("kv_lifecycle_manager_step_seconds_count", RANK) == steps
    mgr.release_host_resources()  # forces a refresh
    stats = collect(mgr.manager, offloader=mgr.offloader, storage=mgr.storage)
    assert registry.get_sample_value("kv_lifecycle_requests_total", {**RANK, "outcome": "released"}) == 2
    assert registry.get_sample_value("kv_lifecycle_pages_offloaded_total", RANK) == stats.manager.pages_enqueued > 0
    assert registry.get_sample_value("kv_lifecycle_copy_seconds_count", RANK) == stats.offloader.writes_landed > 0
    # the storage tier's own counters and latencies, under its tier name; the offloader's host pool
    assert registry.get_sample_value("kv_lifecycle_storage_pages_total", {**RANK, "tier": "file", "result": "new"}) \
        == stats.tiers[0].storage.stored > 0
    assert registry.get_sample_value("kv_lifecycle_storage_op_seconds_count", {**RANK, "tier": "file", "op": "set"}) > 0
    assert registry.get_sample_value("kv_lifecycle_host_free_pages", RANK) == stats.offloader.host_free_pages > 0


def test_a_step_sums_every_manager_call_until_check_offload_progress(registry):
    node = Node(doubles_kit(), page_size=4)
    mgr = _manager(node, pp_rank=0)
    hook, rank = mgr.metrics, {"tp_rank": "0", "pp_rank": "0"}

    def step_sum():
        return registry.get_sample_value("kv_lifecycle_manager_step_seconds_sum", rank) or 0.0

    slow = hook.timed(lambda x: (time.sleep(0.05), x)[1])
    assert slow(x=7) == 7                      # the wrapped call's result, its time not yet observed
    assert registry.get_sample_value("kv_lifecycle_manager_step_seconds_count", rank) in (None, 0.0)
    end = hook.timed(lambda: "done", ends_step=True)
    assert end() == "done"
    first = step_sum()
    assert 0.05 <= first < 0.5                # the first step starts from zero too
    assert registry.get_sample_value("kv_lifecycle_manager_step_seconds_count", rank) == 1
    end()                                    # the next step starts from zero
    assert step_sum() - first < 0.05
    with pytest.raises(KeyError):            # a call that raises still counts, and raises
        hook.timed(lambda: {}["x"], ends_step=True)()
    assert registry.get_sample_value("kv_lifecycle_manager_step_seconds_count", rank) == 3
    mgr.release_host_resources()


def test_every_manager_of_a_process_shares_one_set_of_metrics(registry):
    first, second = Node(doubles_kit(), page_size=4), Node(doubles_kit(), page_size=4)
    a, b = _manager(first, pp_rank=0), _manager(second, pp_rank=1)
    assert a.metrics.metrics is b.metrics.metrics  # registered once on the default registry
    assert a.metrics.labels != b.metrics.labels
    _decode(first, a)
    _decode(second, b)
    a.release_host_resources()
    b.release_host_resources()
    for mgr, rank in ((a, {"tp_rank": "0", "pp_rank": "0"}), (b, {"tp_rank": "0", "pp_rank": "1"})):
        assert registry.get_sample_value("kv_lifecycle_copies_in_flight", rank) == 0
        # each manager's counts under its own labels, not deltas against the other's
        assert registry.get_sample_value("kv_lifecycle_requests_total", {**rank, "outcome": "released"}) == 2
        assert registry.get_sample_value("kv_lifecycle_pages_offloaded_total", rank) == mgr.stats().pages_enqueued


def test_tick_refreshes_once_update_s_has_passed_or_when_forced(registry, monkeypatch):
    node = Node(doubles_kit(), page_size=4)
    mgr = _manager(node, pp_rank=0)
    hook, clock, updates = mgr.metrics, [100.0], []
    monkeypatch.setattr(hook._updater, "_clock", lambda: clock[0])   # the hook's throttle (lifecycle.metrics.Updater)
    monkeypatch.setattr(hook.metrics, "update", lambda stats, source=None, labels=None: updates.append(labels))
    hook.tick()
    assert len(updates) == 1                  # the first one refreshes
    for now, expected in ((100.5, 1), (101.0, 2), (101.9, 2), (102.0, 3)):
        clock[0] = now
        hook.tick()
        assert len(updates) == expected, now  # exactly UPDATE_S (1 s) after the last refresh: refreshed
    hook.tick(force=True)
    assert updates == [{"tp_rank": "0", "pp_rank": "0"}] * 4
    mgr.release_host_resources()
