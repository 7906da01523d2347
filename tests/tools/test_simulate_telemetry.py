"""``simulate --metrics-port`` / ``--kv-events``: /metrics scraped over HTTP during and after a run
and checked against the run's report; a ZMQ subscriber's reconstruction of the stored pages checked
against the file tier's directory; bad endpoints and ports refused in one line before any work."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lifecycle.node_stats import NodeStats
from lifecycle_tools.simulate import ConfigProblem, SimConfig, build, prepare, run
from lifecycle_tools.simulate.scheduler import Simulator
from lifecycle_tools.simulate.telemetry import PUSH_JOB, Telemetry
from lifecycle_tools.testkit.pushgateway import Pushgateway, require_binary
from tests.lifecycle.test_metrics import _expected, scrape
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
    # refreshed at every step (not at most every 0.1 s), so the mid-run point below is a step of the
    # run, not a timer: the first step after which pages were offloaded
    telemetry = Telemetry.start(cfg, stack, mgr, update_s=0.0)
    url = f"http://127.0.0.1:{port}/metrics"
    seen = []
    on_step = telemetry.on_step

    def step_then_scrape(seconds):               # on the scheduler thread, after each step's refresh
        on_step(seconds)
        if not seen and telemetry.registry.get_sample_value("kv_lifecycle_pages_offloaded_total"):
            seen.append(scrape(url))

    telemetry.on_step = step_then_scrape

    def progress(p):
        sub.pump()

    try:
        report = run(cfg, stack, mgr, progress=progress, telemetry=telemetry)
        final = scrape(url)                      # still served: the final numbers
    finally:
        telemetry.close()
    try:
        assert report.ok, report.problems
        passes = report.passes
        assert len(seen) == 1
        mid = seen[0]
        assert 0 < mid[("kv_lifecycle_pages_offloaded_total", ())] <= final[("kv_lifecycle_pages_offloaded_total", ())]
        released = ("kv_lifecycle_requests_total", (("outcome", "released"),))
        assert mid[released] < final[released]    # served mid-run: more requests ended after it

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
        sub.receive_until(telemetry.events_stats()["batches"])   # no end marker on the PUB socket
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
        sub.pump_while(lambda: proc.poll() is None)   # gaps replayed while the run lasts
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stdout + stderr
        report = json.loads(out.read_text())
        sub.receive_until(report["kv_events"]["batches"])
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
    (["--metrics-linger", "5"], "--metrics-linger needs --metrics-port"),
    (["--metrics-port", "9100", "--metrics-linger", "-1"], "--metrics-linger"),
    (["--metrics-port", "9100", "--metrics-linger", "inf"], "--metrics-linger"),
    (["--metrics-port", "9100", "--metrics-linger", "x"], "--metrics-linger"),
    (["--metrics-push", "ftp://127.0.0.1:9091"], "--metrics-push"),
    (["--metrics-push", "127.0.0.1:9091"], "--metrics-push"),
    (["--metrics-push", "http://:9091"], "--metrics-push"),
    (["--metrics-push", "http://127.0.0.1:99999"], "--metrics-push"),
    (["--metrics-push", "http://127.0.0.1:9091/?job=x"], "--metrics-push"),
    (["--metrics-push", "http://user:pw@127.0.0.1:9091"], "--metrics-push"),
    (["--metrics-push", ""], "--metrics-push"),
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


@pytest.mark.parametrize("fields, named", [
    (dict(metrics_linger=5), "--metrics-linger needs --metrics-port"),
    (dict(metrics_port=9100, metrics_linger=float("nan")), "--metrics-linger"),
    (dict(metrics_push="ftp://127.0.0.1:9091"), "--metrics-push"),
    (dict(metrics_push=9091), "--metrics-push"),
])
def test_bad_metrics_settings_are_refused_by_prepare_too(fields, named, tmp_path):
    with pytest.raises(ConfigProblem) as err:
        prepare(SimConfig(**SMALL, storage=f"file:{tmp_path / 's'}", **fields))
    assert named in str(err.value)
    assert not (tmp_path / "s").exists()


def test_the_metrics_are_refreshed_while_a_pass_drains(monkeypatch):
    """docs/metrics.md: refreshed at least every 0.1 s, the end-of-pass drain included. The tier's
    writes are held until the metrics were refreshed three times inside the drain (or 30 s passed):
    without refreshes there, the drain waits the whole bound and none is counted."""
    cfg = SimConfig(**SMALL, storage="memory", metrics_port=free_port(), drain_stall_s=600)
    stack, mgr = build(cfg, prepare(cfg))
    telemetry = Telemetry.start(cfg, stack, mgr)
    in_drain, refreshed = threading.Event(), []
    take = telemetry.updater.take

    def take_and_record():
        stats = take()
        if in_drain.is_set():
            refreshed.append(stats)
        return stats

    telemetry.updater.take = take_and_record
    drain = Simulator._drain

    def marked_drain(self, rep):
        in_drain.set()
        try:
            drain(self, rep)
        finally:
            in_drain.clear()

    monkeypatch.setattr(Simulator, "_drain", marked_drain)
    batch_set, deadline = stack.storage.batch_set, time.monotonic() + 30

    def held_batch_set(keys, pages):              # on the storage worker
        while len(refreshed) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        return batch_set(keys, pages)

    monkeypatch.setattr(stack.storage, "batch_set", held_batch_set)
    try:
        report = run(cfg, stack, mgr, telemetry=telemetry)
        final = telemetry.registry.get_sample_value
    finally:
        telemetry.close()
    assert report.ok, report.problems
    assert report.passes[0].drain_end == "done"
    assert len(refreshed) >= 3
    assert refreshed[0].manager.inflight_storage > 0          # the drain was waiting on the held writes
    assert final("kv_lifecycle_storage_ops_in_flight") == 0
    assert final("kv_lifecycle_storage_pages_total", {"tier": "memory", "result": "new"}) == report.storage["stored"]


def test_linger_returns_no_sooner_than_s_seconds_after_the_final_update():
    cfg = SimConfig(**SMALL, storage="memory", metrics_port=free_port(), metrics_linger=0.3)
    stack, mgr = build(cfg, prepare(cfg))
    telemetry = Telemetry.start(cfg, stack, mgr)
    try:
        report = run(cfg, stack, mgr, telemetry=telemetry)
        telemetry.linger()
        assert time.monotonic() >= telemetry.final_at + 0.3
        got = scrape(telemetry.url)               # served until close
    finally:
        telemetry.close()
    assert got[("kv_lifecycle_requests_total", (("outcome", "released"),))] == report.stats["manager"]["released"]


def _pushed(text: str) -> dict:
    """``{(sample name, sorted labels): value}`` of the counters and gauges pushed under our job
    (without the ``job`` and ``instance`` labels the Pushgateway adds)."""
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("job", "instance")))): s.value
            for fam in text_string_to_metric_families(text) if fam.type in ("counter", "gauge")
            for s in fam.samples
            if s.labels.get("job") == PUSH_JOB and s.name.startswith("kv_lifecycle_") and not s.name.endswith("_created")}


@pytest.fixture
def pushgateway():
    gw = Pushgateway(require_binary()).start()
    try:
        yield gw
    finally:
        gw.stop()


def test_the_final_values_are_pushed_to_a_real_pushgateway(pushgateway, tmp_path):
    """``--metrics-push URL``: after the run, every counter and gauge the Pushgateway holds under
    job ``kv_lifecycle_simulate`` is the report's final ``NodeStats``, and the histograms came along."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "lifecycle_tools", "simulate", *TINY, "--store", str(tmp_path / "s"),
                           "--json", str(out), "--metrics-push", pushgateway.url],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    final = msgspec.convert(report["stats"], NodeStats)
    text = pushgateway.metrics_text()
    assert _pushed(text) == _expected(final, ())
    assert final.manager.released > 0 and final.manager.pages_enqueued > 0
    landed = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.name == "kv_lifecycle_copy_seconds_count" and s.labels.get("job") == PUSH_JOB]
    assert landed == [final.manager.chunks_landed]


def test_a_push_the_gateway_refuses_is_one_line_and_exit_2_after_the_summary(pushgateway, capsys, tmp_path):
    out = tmp_path / "r.json"
    rc, stdout, err = run_main(["simulate", *TINY, "--store", str(tmp_path / "s"), "--json", str(out),
                                "--metrics-push", f"{pushgateway.url}/no/such/prefix"], capsys)
    assert rc == 2, (rc, stdout, err)
    assert err.strip().splitlines()[-1].startswith("kv-lifecycle: error: --metrics-push ")
    assert "HTTP Error 404" in err and "Traceback" not in err
    assert "OK: no slot leaked" in stdout and json.loads(out.read_text())["stats"]   # the run's own output first
    assert _pushed(pushgateway.metrics_text()) == {}


def test_an_unreachable_push_url_is_one_line_and_exit_2(capsys, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"       # nothing listens there
    rc, stdout, err = run_main(["simulate", *TINY, "--store", str(tmp_path / "s"), "--metrics-push", url], capsys)
    assert rc == 2, (rc, stdout, err)
    assert err.strip().splitlines() == [f"kv-lifecycle: error: --metrics-push {url}: the final metrics were not "
                                        f"pushed: [Errno 111] Connection refused"]
    assert "OK: no slot leaked" in stdout


def test_linger_keeps_serving_the_final_values_after_the_run(tmp_path):
    """``--metrics-linger S``: once the report is written the process still serves ``/metrics``, with
    the report's final numbers, until S seconds after the final update (Ctrl-C ends the wait)."""
    port, out = free_port(), tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-m", "lifecycle_tools", "simulate", *TINY, "--store", str(tmp_path / "s"),
                             "--json", str(out), "--metrics-port", str(port), "--metrics-linger", "300"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out.exists() and out.read_text().endswith("}\n")) and proc.poll() is None:
            assert time.monotonic() < deadline, "no report within 240 s"
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        got = scrape(f"http://127.0.0.1:{port}/metrics")
        final = msgspec.convert(json.loads(out.read_text())["stats"], NodeStats)
        assert {k: v for k, v in got.items() if k in _expected(final, ())} == _expected(final, ())
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130, stdout + stderr
        assert "Traceback" not in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
