"""``simulate --metrics-port`` / ``--kv-events``: /metrics scraped over HTTP during and after a run
and checked against the run's report; a ZMQ subscriber's reconstruction of the stored pages checked
against the file tier's directory; bad endpoints and ports refused in one line before any work."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lifecycle_tools.simulate import SimConfig, build, prepare, run
from lifecycle_tools.simulate.telemetry import Telemetry
from tests.lifecycle.test_metrics import scrape
from tests.support.kv_subscriber import Subscriber, int64_id, pages_held
from tests.tools.test_cli import keep_structlog_config, run_main  # noqa: F401 (autouse fixture)
from tests.tools.test_cli_bad_input import TINY, one_line_error

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(requests=10, turns=2, prompt_len="8-40", output_len="10-40", layers=2, heads=2, head_dim=8,
             page_size=4, stride=8, device_tokens=2048, host_tokens=1024, rows=6, retract_frac=0.3,
             abort_frac=0.15, seed=3, verify="all")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _disk_pages(directory: Path) -> set[int]:
    return {int64_id(n[:64]) for n in os.listdir(directory) if n.endswith(".bin") and not n.startswith(".")}


def test_metrics_during_and_after_a_run_match_the_report_and_events_match_the_store(tmp_path):
    store = tmp_path / "store"
    port, ev, replay = free_port(), f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = SimConfig(**SMALL, storage=f"file:{store}", warm=True, metrics_port=port, kv_events=ev,
                    kv_events_replay=replay)
    width = prepare(cfg)
    stack, mgr = build(cfg, width)
    sub = Subscriber(ev, replay)                 # before the publisher binds
    telemetry = Telemetry.start(cfg, stack, mgr)
    url = f"http://127.0.0.1:{port}/metrics"
    seen = []

    def progress(p):                             # on the scheduler thread, mid-run
        sub.pump()
        if p.done and not seen:
            seen.append(scrape(url))

    try:
        report = run(cfg, stack, mgr, progress=progress, telemetry=telemetry)
        final = scrape(url)                      # still served: the final numbers
    finally:
        telemetry.close()
    try:
        assert report.ok, report.problems
        passes = report.passes
        mid = seen[0]
        assert 0 < mid[("kv_lifecycle_pages_offloaded_total", ())] <= final[("kv_lifecycle_pages_offloaded_total", ())]

        def total(field):
            return sum(getattr(p, field) for p in passes)

        assert final[("kv_lifecycle_chunks_offloaded_total", ())] == total("chunks_offloaded") > 0
        assert final[("kv_lifecycle_pages_offloaded_total", ())] == total("pages_offloaded")
        assert final[("kv_lifecycle_bytes_offloaded_total", ())] == total("bytes_offloaded")
        assert final[("kv_lifecycle_storage_pages_total", (("result", "new"), ("tier", "file")))] == \
            report.storage["stored"] == total("storage_pages_written")
        assert final[("kv_lifecycle_storage_pages_total", (("result", "already_there"), ("tier", "file")))] == \
            report.storage["skipped"] == total("storage_pages_skipped")
        assert final[("kv_lifecycle_requests_total", (("outcome", "released"),))] == \
            report.stats["manager"]["released"] == total("rows_freed")
        assert final[("kv_lifecycle_requests_total", (("outcome", "leaked"),))] == total("manager_leaked") == 0
        assert final[("kv_lifecycle_refusals_total", (("reason", "host_short"),))] == total("host_short")
        assert final[("kv_lifecycle_prefix_pages_total", (("stage", "hit"),))] == total("prefix_pages_hit") > 0
        assert final[("kv_lifecycle_copy_seconds_count", ())] == total("chunks_landed")
        assert final[("kv_lifecycle_manager_step_seconds_count", ())] >= total("steps")
        assert final[("kv_lifecycle_copies_in_flight", ())] == 0
        assert final[("kv_lifecycle_host_free_pages", ())] == report.stats["offloader"]["host_free_pages"]
        # the ZMQ subscriber: everything the run stored, and nothing else, is on disk
        sub.receive_until_end()
        assert sub.missing() == [] and min(sub.batches) == 0
        assert len(sub.batches) == telemetry.events_stats()["batches"]
        disk = _disk_pages(store)
        assert disk and pages_held(sub.batches, "DISK") == disk
        assert pages_held(sub.batches, "CPU_PINNED") == set()
    finally:
        sub.close()


def test_the_command_publishes_and_reports_what_it_published(tmp_path):
    store, out = tmp_path / "store", tmp_path / "r.json"
    ev, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    sub = Subscriber(ev, replay)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lifecycle_tools", "simulate", *TINY, "--store", str(store), "--json", str(out),
             "--kv-events", ev, "--kv-events-replay", replay, "--metrics-port", str(free_port())],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sub.receive_until_end(timeout_s=120)
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stdout + stderr
        report = json.loads(out.read_text())
        assert report["kv_events"]["batches"] == len(sub.batches) and report["kv_events"]["queued"] == 0
        assert report["kv_events"]["stored"] >= len(_disk_pages(store)) > 0
        assert pages_held(sub.batches, "DISK") == _disk_pages(store)
        assert set(report["stats"]) == {"manager", "offloader", "tiers", "prefix", "page_nbytes", "refusals"}
    finally:
        sub.close()


@pytest.mark.parametrize("flags, named", [
    (["--kv-events", "tcp://127.0.0.1"], "--kv-events"),
    (["--kv-events", "localhost:5557"], "--kv-events"),
    (["--kv-events-replay", "tcp://127.0.0.1:5"], "--kv-events-replay needs --kv-events"),
    (["--kv-events", "tcp://127.0.0.1:5", "--kv-events-replay", "tcp://127.0.0.1:5"], "both name"),
    (["--metrics-port", "0"], "--metrics-port"),
    (["--metrics-port", "65536"], "--metrics-port"),
    (["--metrics-port", "x"], "--metrics-port"),
    (["--metrics-port", "9100", "--metrics-host", "a b"], "--metrics-host"),
])
def test_bad_flags_fail_in_one_line_before_any_work(flags, named, capsys, tmp_path):
    rc, out, err = run_main(["simulate", "--store", str(tmp_path / "s"), *TINY, *flags], capsys)
    one_line_error(rc, out, err)
    assert named in err
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())


def test_a_port_or_endpoint_in_use_is_one_line_and_nothing_stays_bound(capsys, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ev = f"tcp://127.0.0.1:{free_port()}"
        rc, out, err = run_main(["simulate", "--store", str(tmp_path / "s"), *TINY, "--kv-events", ev,
                                 "--metrics-port", str(port)], capsys)
        one_line_error(rc, out, err)
        assert f"--metrics-port {port}" in err
        rc, out, err = run_main(["simulate", "--store", str(tmp_path / "s"), *TINY,
                                 "--kv-events", f"tcp://127.0.0.1:{port}"], capsys)
        one_line_error(rc, out, err)
        assert "--kv-events" in err and "cannot bind" in err
    from tests.transfer.test_kv_events_publisher import assert_bindable

    assert_bindable(ev)    # the publisher of the refused run released its endpoint
