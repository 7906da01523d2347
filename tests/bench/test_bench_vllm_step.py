"""``bench/bench_vllm_step.py``: its pure helpers (percentiles, the lockstep order, ratios, what each
connector's rule stores), and ``--quick`` end to end where vLLM imports (skipped otherwise; failed
instead under ``KV_LIFECYCLE_REQUIRE_VLLM=1``, as tests/integrations/vllm). No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.bench_vllm_step import (  # noqa: E402
    KINDS, NONE, OFFLOAD, OURS, parse_configs, percentile, ratio_text, ratios, schedule, step_order, summarize,
    written_pages,
)


def test_percentile_is_nearest_rank():
    values = list(range(100, 0, -1))
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100
    assert percentile([7], 99) == 7
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 1000], 99) == 1000
    assert percentile([4, 1, 3, 2], 50) == 2


@pytest.mark.parametrize("values, q", [([], 50), ([1], 0), ([1], 100.5)])
def test_percentile_refuses_no_values_or_a_bad_rank(values, q):
    with pytest.raises(ValueError):
        percentile(values, q)


def test_in_lockstep_each_run_goes_first_second_and_third_equally_in_both_kinds_of_step():
    for triple in range(3):
        orders = [step_order(triple, i) for i in range(24)]
        assert all(sorted(o) == sorted(KINDS) for o in orders)
        for kind_of_step in (0, 1):   # even steps: per step; odd steps: per call
            steps = orders[kind_of_step::2]
            for position in range(3):
                assert Counter(o[position] for o in steps) == {k: 4 for k in KINDS}
    assert step_order(0, 0) != step_order(1, 0)   # triple by triple too


def test_the_schedule_runs_every_config_once_per_triple_reversed_in_odd_ones():
    configs = [(256, 16), (64, 16)]
    assert schedule(configs, 3) == [(0, c) for c in configs] + [(1, c) for c in configs[::-1]] + [
        (2, c) for c in configs]


def test_ratios_are_run_by_run_and_reported_as_median_and_range():
    assert ratios([1.0, 3.0, 6.0], [2.0, 2.0, 2.0]) == [0.5, 1.5, 3.0]
    assert ratio_text([0.5, 1.5, 3.0]) == "1.50x (0.50-3.00)"
    assert ratio_text([]) == "-"
    with pytest.raises(ValueError):
        ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        ratios([1.0], [0.0])
    with pytest.raises(ValueError):
        ratios([1.0], [float("nan")])


def test_configs_parse_and_refuse():
    assert parse_configs("256/16, 64/16") == [(256, 16), (64, 16)]
    for bad in ("256", "256/x", "0/16", "256/0", ""):
        with pytest.raises(ValueError):
            parse_configs(bad)


def test_a_figure_no_run_has_is_left_out_of_the_median():
    nan = float("nan")
    assert summarize([{"x": 3.0}, {"x": nan}, {"x": 1.0}], "x") == 2.0
    assert summarize([{"x": nan}], "x") != summarize([{"x": nan}], "x")


def test_pages_each_rule_stores():
    # prompt 37 tokens (2 whole blocks of 16 + 5), finished at 100 tokens: 99 written -> 6 whole blocks;
    # ours from the block holding the prompt's tail (block 2) on: 4
    assert written_pages(100, 99, 37, 16) == (6, 4)
    assert written_pages(96, 95, 32, 16) == (5, 3)        # a prompt on a block boundary: decode from block 2
    assert written_pages(97, 96, 32, 16) == (6, 4)        # the last sampled token never counts
    assert written_pages(100, 40, 37, 16) == (2, 0)       # aborted with 40 computed: only computed tokens count
    assert written_pages(100, 0, 37, 16) == (0, 0)        # never scheduled
    for bad in ((0, 0, 0, 16), (10, 11, 5, 16), (10, 5, 11, 16), (10, 5, 5, 0)):
        with pytest.raises(ValueError):
            written_pages(*bad)


def test_quick_runs_end_to_end_inside_vllm(tmp_path):
    from tests.integrations.vllm.vllm_kit import require_vllm

    require_vllm()  # skips without vLLM, fails under KV_LIFECYCLE_REQUIRE_VLLM=1 (.ci/vllm-env sets it)
    out_json = tmp_path / "runs.json"
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_vllm_step.py"), "--quick",
                          "--json", str(out_json)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "offload = vLLM's OffloadingConnector" in text and "'offload_prompt_only': False" in text
    assert "ours = lifecycle.integrations.vllm.connector" in text
    runs = json.loads(out_json.read_text())
    assert set(runs) == {"32/16"}
    (n,), (o,), (u,) = (runs["32/16"][k] for k in (NONE, OFFLOAD, OURS))
    for run in (n, o, u):
        assert 0 < run["p50"] <= run["p99"]
        assert run["finished"] > 0 and run["sampled"] > 0
    assert n["finished"] == o["finished"] and n["sampled"] == o["sampled"]   # the same workload, step for step
    for run in (o, u):   # each stored exactly what its rule says, all of it through its own worker side
        assert run["pages_stored"] == run["expected_pages"] > 0
        assert 0 < run["calls_p50"] <= run["calls_p99"]
        assert run["build_connector_meta"] > 0 and run["n_finished_calls"] > 0
    assert o["pages_stored"] > u["pages_stored"]   # prompt blocks too (offload_prompt_only=False) vs decode pages
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("32/16") and "per step p50" in ln)
    assert line.count("x (") == 3   # ours/offload, offload/none, ours/none


def test_what_a_connector_adds_is_taken_triple_by_triple():
    from bench.bench_vllm_step import added

    assert added([{"p50": 5.0}, {"p50": 9.0}], [{"p50": 4.0}, {"p50": 5.0}], "p50") == [1.0, 4.0]
    with pytest.raises(ValueError):
        added([{"p50": 5.0}], [], "p50")


def test_a_triple_that_did_different_work_is_refused():
    from bench.bench_vllm_step import check_same_work

    def triple(**changes):
        runs = {NONE: {"finished": 5, "sampled": 50, "pages_stored": None, "expected_pages": float("nan")},
                OFFLOAD: {"finished": 5, "sampled": 50, "pages_stored": 30, "expected_pages": 30},
                OURS: {"finished": 4, "sampled": 49, "pages_stored": 20, "expected_pages": 20}}
        for key, value in changes.items():
            kind, field = key.split("__")
            runs[kind][field] = value
        return runs

    check_same_work(triple())   # ours may lag a step (its lookups are asynchronous)
    for bad in ({"offload__sampled": 49}, {"offload__finished": 4}, {"offload__pages_stored": 29},
                {"ours__pages_stored": 21}):
        with pytest.raises(RuntimeError):
            check_same_work(triple(**bad))
