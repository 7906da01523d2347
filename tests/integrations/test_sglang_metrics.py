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
