"""Issue 12: every bad input to a tool fails in one clear line (exit 2) before any work, never with a
traceback; conflicting flags are refused; the failing component is named."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.tools.test_cli import keep_structlog_config, run_main  # noqa: F401 (autouse fixture)

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--requests", "6", "--turns", "2", "--prompt-len", "8-24", "--output-len", "8-24", "--layers", "1",
        "--heads", "1", "--head-dim", "8", "--page-size", "4", "--device-tokens", "512", "--host-tokens", "128",
        "--rows", "4", "--verify", "all", "--no-progress"]


def one_line_error(rc, out, err):
    assert rc == 2, (rc, out, err)
    assert out == "" and len(err.strip().splitlines()) == 1 and "error" in err, err
    assert "Traceback" not in err


# Each of these passed validation on 988768c and then crashed (OverflowError, MemoryError) or ran for
# minutes generating the workload, or silently did something else than asked.
FAIL_FAST = {
    "exp mean overflows": (["--output-len", "exp:1e308"], "--output-len"),
    "normal mean overflows": (["--prompt-len", "normal:1e308:1"], "--prompt-len"),
    "constant length 1e300": (["--prompt-len", "1e300"], "--prompt-len"),
    "one request longer than the pool": (["--prompt-len", "300000000", "--requests", "1"], "--prompt-len"),
    "huge system prompt": (["--system-prompt", "300000000"], "--system-prompt"),
    "workload too large": (["--requests", "100000000"], "--requests"),
    "longest request exceeds the pool": (["--prompt-len", "4000", "--turns", "5"], "--device-tokens"),
    "KV pool larger than memory": (["--layers", "100000"], "device KV pool"),
    "rate too small to be a rate": (["--arrival-rate", "1e-320"], "--arrival-rate"),
    "non-ascii digits in verify": (["--verify", "١٢"], "--verify"),
}


@pytest.mark.parametrize("flags,named", FAIL_FAST.values(), ids=FAIL_FAST.keys())
def test_impossible_workloads_fail_fast_in_one_line(flags, named, capsys, tmp_path):
    rc, out, err = run_main(["simulate", "--store", str(tmp_path / "s"), *flags], capsys)
    one_line_error(rc, out, err)
    assert named in err, err
    assert not (tmp_path / "s").exists()


def test_layers_100000_blames_the_kv_pool_not_the_storage(capsys, tmp_path):
    rc, out, err = run_main(["simulate", "--storage", "memory", "--layers", "100000"], capsys)
    one_line_error(rc, out, err)
    assert "device KV pool" in err and "storage" not in err, err


def test_conflicting_flags_are_refused(tmp_path, capsys):
    same = str(tmp_path / "x.json")
    rc, out, err = run_main(["simulate", "--store", str(tmp_path / "s"), "--audit", same, "--json", same], capsys)
    one_line_error(rc, out, err)
    assert "--audit" in err and "--json" in err
    rc, out, err = run_main(["simulate", "--store", str(tmp_path / "s"), "--storage", "memory"], capsys)
    one_line_error(rc, out, err)
    assert "--store" in err and "--storage" in err
    rc, out, err = run_main(["simulate", "--storage", "memory", "--audit", "-"], capsys)
    one_line_error(rc, out, err)
    assert not (tmp_path / "s").exists() and not os.path.exists(same)


def test_unknown_storage_spec_is_refused(capsys):
    rc, out, err = run_main(["simulate", "--storage", "s3://bucket/x"], capsys)
    one_line_error(rc, out, err)
    assert "unknown storage 's3://bucket/x'" in err


def test_json_dash_writes_the_report_to_stdout(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lifecycle_tools", "simulate", *TINY, "--storage", "memory",
                           "--json", "-"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)          # stdout is the JSON document alone
    assert report["ok"] and report["passes"][0]["requests"] == 6
    assert "OK:" in proc.stderr and "requests per second" in proc.stderr   # the table went to stderr
    assert not (tmp_path / "-").exists()


def test_summary_names_each_denominator_and_one_unit_system(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lifecycle_tools", "simulate", *TINY, "--store",
                           str(tmp_path / "s")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for label in ("storage pages: newly written / already there", "prefix pages found / looked up",
                  "stored pages verified: ok / sampled", "sampled from pages offloaded",
                  "manager calls per step p50/p99 (1)", "offloader enqueue per chunk p50/p99 (2)",
                  "requests per second", "(1) time inside every DecodeOffloadManager call"):
        assert label in out, label
    assert "GB/s" not in out and "MiB/s" in out


# -- audit ----------------------------------------------------------------------------------------

def test_audit_of_an_endless_line_is_refused_in_one_line(capsys):
    rc, out, err = run_main(["audit", "/dev/zero"], capsys)
    one_line_error(rc, out, err)


def test_audit_of_a_binary_or_huge_line_file(tmp_path, capsys):
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"{" + b" " * (2 << 20) + b"}\n")
    rc, out, err = run_main(["audit", str(big)], capsys)
    one_line_error(rc, out, err)
    assert "longer than" in err
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\x01\n")
    one_line_error(*run_main(["audit", str(binary)], capsys))
    one_line_error(*run_main(["audit", str(tmp_path)], capsys))    # a directory


@pytest.mark.parametrize("text", ["", "\n\n", '{"event": "http.request", "path": "/"}\n', "[1, 2]\n"])
def test_audit_of_a_log_without_lifecycle_events_fails(text, tmp_path, capsys):
    log = tmp_path / "x.jsonl"
    log.write_text(text)
    rc, out, err = run_main(["audit", str(log)], capsys)
    assert rc == 1, out
    assert "no lifecycle events" in out and "OK" not in out


def test_audit_reports_a_type_invalid_event_with_its_line(tmp_path, capsys):
    log = tmp_path / "x.jsonl"
    log.write_text(json.dumps({"event": "lifecycle.transition", "rid": ["a"], "trigger": "offload",
                               "src": "PREFILLED", "dst": "OFFLOADING"}) + "\n")
    rc, out, err = run_main(["audit", str(log)], capsys)
    assert rc == 1 and "line 1:" in out and "'rid' is list" in out, out


# -- diagrams -------------------------------------------------------------------------------------

@pytest.mark.parametrize("body", ["# states\nno markers\n", "<!-- /generated:state-table -->\n<!-- generated:state-table -->\n"])
def test_diagrams_validate_the_states_doc_before_writing(body, tmp_path, capsys):
    doc = tmp_path / "states.md"
    doc.write_text(body)
    rc, out, err = run_main(["diagrams", "--out", str(tmp_path / "d"), "--states-doc", str(doc)], capsys)
    one_line_error(rc, out, err)
    assert "generated:state-table" in err
    assert not (tmp_path / "d").exists() and doc.read_text() == body


# -- imports --------------------------------------------------------------------------------------

def _modules_after(code: str) -> set:
    proc = subprocess.run([sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_help_imports_no_torch_and_no_library():
    mods = _modules_after("from lifecycle_tools.cli import main\n"
                          "for argv in (['--help'], ['simulate', '--help'], ['audit', '--help']):\n"
                          "    try: main(argv)\n    except SystemExit: pass")
    assert "torch" not in mods and "lifecycle.manager" not in mods and "transfer" not in mods


def test_the_library_imports_no_tool_module():
    mods = _modules_after("import lifecycle, transfer, hashing")
    assert not [m for m in mods if m.startswith("lifecycle_tools")]
