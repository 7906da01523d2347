"""``bench/bench_sglang_step.py``: its pure helpers (percentiles, the copy subtraction, the pairing),
and ``--quick`` end to end where sglang imports (skipped otherwise; failed instead under
``KV_LIFECYCLE_REQUIRE_SGLANG=1``, as tests/integrations). No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.bench_sglang_step import (  # noqa: E402
    DROPIN, SGLANG, HeldCopies, net_of_copy, pair_order, parse_configs, percentile, ratios, schedule, step_order,
    target_of,
)


def test_percentile_is_nearest_rank():
    values = list(range(100, 0, -1))  # 1..100, unsorted
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100
    assert percentile(values, 1) == 1
    assert percentile([7], 99) == 7
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 1000], 99) == 1000  # the one slow step is the p99
    assert percentile([1, 2, 3], 50) == 2
    assert percentile([4, 1, 3, 2], 50) == 2


@pytest.mark.parametrize("values, q", [([], 50), ([1], 0), ([1], 100.5), ([1], -1)])
def test_percentile_refuses_no_values_or_a_bad_rank(values, q):
    with pytest.raises(ValueError):
        percentile(values, q)


def test_the_copy_is_subtracted_step_by_step():
    assert net_of_copy([100, 250, 80], [0, 50, 80]) == [100, 200, 0]
    with pytest.raises(ValueError):
        net_of_copy([100, 200], [10])
    with pytest.raises(ValueError):
        net_of_copy([100], [101])  # a copy longer than the step containing it
    with pytest.raises(ValueError):
        net_of_copy([100], [-1])


def test_pairs_alternate_which_manager_runs_first():
    assert pair_order(0) == (SGLANG, DROPIN)
    assert pair_order(1) == (DROPIN, SGLANG)
    assert pair_order(2) == (SGLANG, DROPIN)


def test_the_schedule_runs_every_config_once_per_pair_reversed_in_odd_pairs():
    configs = [(256, 16), (256, 64), (64, 16)]
    runs = schedule(configs, 3)
    assert runs == [(0, c) for c in configs] + [(1, c) for c in configs[::-1]] + [(2, c) for c in configs]


def test_in_lockstep_each_manager_goes_first_in_half_the_steps_of_each_kind():
    for pair in range(2):
        orders = [step_order(pair, i) for i in range(8)]
        assert all(set(o) == {SGLANG, DROPIN} for o in orders)
        for kind_of_step in (0, 1):  # even steps: per step; odd steps: per call
            firsts = [orders[i][0] for i in range(kind_of_step, 8, 2)]
            assert firsts.count(SGLANG) == firsts.count(DROPIN) == 2
        assert orders[0] == pair_order(pair)
    assert step_order(0, 0) != step_order(1, 0)  # pair by pair too


def test_ratios_are_per_pair_drop_in_over_sglang():
    assert ratios([1.0, 3.0], [2.0, 2.0]) == [0.5, 1.5]
    with pytest.raises(ValueError):
        ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        ratios([1.0], [0.0])


def test_configs_and_targets():
    assert parse_configs("256/16, 64/16") == [(256, 16), (64, 16)]
    for bad in ("256", "256/x", "0/16", "256/0", ""):
        with pytest.raises(ValueError):
            parse_configs(bad)
    assert target_of("p50", 256) == target_of("p99", 256) == 0.5
    assert target_of("p50", 64) is None
    assert target_of("enqueue_call", 64) == target_of("release_call", 256) == 1.0
    assert target_of("idle_call", 256) is None


def test_held_copies_reach_the_engine_only_when_the_steps_calls_end_in_submission_order():
    """``--dropin-copies after-calls``: the engine's own ``to_host`` builds each job; its submission
    waits for ``release`` (the end of the step's calls), then every held job goes, in order, once."""
    class Engine:
        def __init__(self):
            self.submitted = []

        def submit(self, tag, fn):
            self.submitted.append((tag, fn()))

        def to_host(self, tag):
            self.submit(tag, lambda: f"copy {tag}")

    engine = Engine()
    held = HeldCopies(engine)
    engine.to_host(1)
    engine.to_host(2)
    assert engine.submitted == [] and [t for t, _ in held.held] == [1, 2]
    held.release()
    assert engine.submitted == [(1, "copy 1"), (2, "copy 2")] and held.held == []
    held.release()
    engine.to_host(3)
    assert len(engine.submitted) == 2
    held.release()
    assert engine.submitted[-1] == (3, "copy 3")


@pytest.mark.parametrize("copies", ["threads", "after-calls"])
def test_quick_runs_end_to_end_inside_sglang(tmp_path, copies):
    from tests.integrations.sglang_kit import require_sglang

    require_sglang()  # skips without sglang, fails under KV_LIFECYCLE_REQUIRE_SGLANG=1
    out_json = tmp_path / "runs.json"
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_sglang_step.py"), "--quick",
                          "--dropin-copies", copies, "--json", str(out_json)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert f"drop-in copies: {copies}" in text
    assert "sglang = sglang.srt.disaggregation.decode_kvcache_offload_manager.DecodeKVCacheOffloadManager" in text
    assert "drop-in = lifecycle.integrations.sglang.DecodeKVCacheOffloadManager" in text
    runs = json.loads(out_json.read_text())
    assert set(runs) == {"64/16", "32/64"}
    for config, by_kind in runs.items():
        (s,), (d,) = by_kind[SGLANG], by_kind[DROPIN]
        assert s["sglang_copies"] > 0 and d["sglang_copies"] == 0  # SGLang's copy ran on this thread; ours not
        assert d["copy_p50"] == 0
        assert s["pages_stored"] == d["pages_stored"] > 0  # the same workload: the same pages stored
        for run in (s, d):
            assert 0 < run["p50"] <= run["p99"]
            assert run["gross_p50"] >= run["p50"]
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(config) and "per step p50" in ln)
        assert line.split()[-4].endswith("x")  # the ratio column


def test_quiet_pairs_are_those_where_neither_run_saw_the_machine_oversubscribed():
    from bench.bench_sglang_step import quiet_pairs

    ours = [{"load": 1.5}, {"load": 3.0}, {"load": 2.0}]
    theirs = [{"load": 1.9}, {"load": 1.0}, {"load": 2.5}]
    assert quiet_pairs(ours, theirs, 2) == [0]
    assert quiet_pairs(ours, theirs, 4) == [0, 1, 2]


def test_a_figure_no_run_has_is_left_out_of_the_median():
    from bench.bench_sglang_step import summarize

    nan = float("nan")
    assert summarize([{"x": 3.0}, {"x": nan}, {"x": 1.0}], "x") == 2.0
    assert summarize([{"x": nan}], "x") != summarize([{"x": nan}], "x")  # NaN: no run had one
