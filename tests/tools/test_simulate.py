"""``kv-lifecycle simulate`` end to end on small configurations (subprocesses, real stack, file store)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lifecycle_tools.simulate import ConfigProblem, SimConfig, check_capacity, kv_ids, make_workload, parse_dist

SMALL = ["--requests", "12", "--turns", "3", "--prompt-len", "8-40", "--output-len", "10-40",
         "--layers", "2", "--heads", "2", "--head-dim", "8", "--page-size", "4", "--stride", "8",
         "--device-tokens", "2048", "--host-tokens", "1024", "--rows", "6", "--spec-tokens", "2",
         "--retract-frac", "0.3", "--abort-frac", "0.15", "--arrival-rate", "0.5", "--seed", "5",
         "--verify", "all", "--no-progress"]


def simulate(tmp_path: Path, *extra: str, store: Path | None = None, name: str = "r"):
    out = tmp_path / f"{name}.json"
    where = [] if "--storage" in extra else ["--store", str(store or tmp_path / "store")]
    proc = subprocess.run(
        [sys.executable, "-m", "lifecycle_tools", "simulate", *SMALL, *where, "--json", str(out), *extra],
        capture_output=True, text=True, timeout=120)
    report = json.loads(out.read_text()) if out.exists() else None
    return proc, report


def check_pass(p):
    assert p["slots_leaked"] == 0 and p["rows_leaked"] == 0 and p["host_pages_leaked"] == 0
    assert p["manager_leaked"] == 0 and p["manager_unreleased"] == 0
    assert p["double_frees"] == 0 and p["lifecycle_errors"] == 0, p["errors"]
    assert p["rows_freed"] == p["rows_admitted"] == p["requests"] + p["readmitted"]
    assert p["finished"] + p["aborted"] == p["requests"]
    assert p["readmitted"] == p["retracted"]
    assert p["chunks_offloaded"] >= 1 and p["chunks_landed"] == p["chunks_offloaded"]
    assert p["storage_ops"] == p["chunks_landed"] and p["storage_failures"] == 0
    assert p["bytes_offloaded"] > 0 and p["pages_offloaded"] >= p["chunks_offloaded"]
    assert 0 < p["verify_sampled"] <= p["verify_population"] == p["pages_offloaded"]
    assert p["verify_ok"] == p["verify_sampled"] and p["verify_mismatched"] == 0 and p["verify_missing"] == 0
    # every page offered to storage is either newly written or found already there
    assert p["storage_pages_written"] + p["storage_pages_skipped"] == p["pages_stored"] + p["prefill_backup_pages"]
    assert p["requests_per_s"] > 0 and p["enqueue_us_p99"] >= p["enqueue_us_p50"] > 0
    assert p["prefix_mismatches"] == 0 and p["prefix_pages_verified"] == p["prefix_pages_hit"]
    assert p["overhead_us_p99"] >= p["overhead_us_p50"] > 0
    assert p["tokens_decoded"] > 0 and p["drained"]


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("warm")
    return d, *simulate(d, "--warm")


def test_warm_run_exits_0_with_a_consistent_report(warm_run):
    d, proc, report = warm_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["ok"] and report["problems"] == []
    cold, warm = report["passes"]
    for p in (cold, warm):
        check_pass(p)
    assert cold["requests"] == warm["requests"] == 12
    # the warm pass finds what the cold one stored, and loads it bit-exact
    assert warm["prefix_hit_rate"] > cold["prefix_hit_rate"]
    assert warm["prefix_hit_rate"] > 0.9
    assert warm["prefix_bytes_loaded"] > 0
    assert warm["prompt_tokens_computed"] < cold["prompt_tokens_computed"]
    assert "slots leaked" in proc.stdout and "OK:" in proc.stdout and proc.stderr == ""
    # a rerun's pages are found, not written again: the summary says so
    assert warm["storage_pages_skipped"] > 0


def test_a_second_invocation_on_the_same_store_hits(warm_run, tmp_path):
    d, _, first = warm_run
    proc, report = simulate(tmp_path, store=d / "store", name="again")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (p,) = report["passes"]
    check_pass(p)
    assert p["prefix_hit_rate"] > first["passes"][0]["prefix_hit_rate"]
    assert p["prefix_pages_hit"] == p["prefix_pages_verified"] > 0


def test_audit_log_written_and_memory_storage(tmp_path):
    proc, report = simulate(tmp_path, "--storage", "memory", "--audit", str(tmp_path / "a.jsonl"),
                            "--verify", "5", "--no-reuse")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (p,) = report["passes"]
    assert 0 < p["verify_sampled"] <= 5 and p["verify_ok"] == p["verify_sampled"]
    assert p["prefix_lookups"] == 0
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    events = [json.loads(s) for s in lines]
    assert all("t" in e and "timestamp" in e and "level" in e for e in events)
    assert {"lifecycle.transition", "lifecycle.chunk_enqueued", "lifecycle.released"} <= {e["event"] for e in events}
    assert all("rid" in e for e in events if e["event"].startswith("lifecycle."))


def test_workload_is_a_function_of_the_seed():
    cfg = SimConfig(requests=9, turns=3, seed=11)
    a, b = make_workload(cfg), make_workload(cfg)
    assert [(p.rid, p.prompt, p.output, p.arrival) for p in a] == [(p.rid, p.prompt, p.output, p.arrival) for p in b]
    c = make_workload(SimConfig(requests=9, turns=3, seed=12))
    assert [p.prompt for p in a] != [p.prompt for p in c]
    # later turns extend the earlier ones (multi-turn chats share prefixes)
    t0 = a[0]
    t1 = t0.next
    assert t1.prompt[: len(t0.prompt) + len(t0.output)] == t0.prompt + t0.output
    # every chat shares the system prompt
    assert a[0].prompt[: cfg.system_prompt] == a[1].prompt[: cfg.system_prompt]


def test_kv_ids_depend_on_the_whole_prefix():
    assert kv_ids([1, 2, 3])[:2] == kv_ids([1, 2, 9])[:2]
    assert kv_ids([1, 2, 3])[2] != kv_ids([1, 2, 9])[2]
    assert kv_ids([5, 2, 3])[2] != kv_ids([1, 2, 3])[2]


def test_distributions():
    import random

    rng = random.Random(0)
    assert parse_dist("7").sample(rng) == 7
    u = parse_dist("3-5")
    assert {u.sample(rng) for _ in range(200)} == {3, 4, 5}
    assert parse_dist("uniform:2:4").hi == 4
    e = parse_dist("exp:10")
    assert all(1 <= e.sample(rng) <= 40 for _ in range(200))
    n = parse_dist("normal:20:5")
    assert all(1 <= n.sample(rng) <= 40 for _ in range(200))
    for bad in ("0", "5-3", "exp:0", "normal:3", "abc", "1.5", "uniform:1"):
        with pytest.raises(ConfigProblem):
            parse_dist(bad)


def test_capacity_check_names_the_request():
    cfg = SimConfig(device_tokens=64, page_size=16)
    with pytest.raises(ConfigProblem, match="too small for one request"):
        check_capacity(cfg)
