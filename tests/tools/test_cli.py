"""The command line: bad flags and impossible configurations exit 2 with one line, before any work."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from lifecycle_tools.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def keep_structlog_config():
    """``main`` configures structlog (it is the application); give the other tests theirs back."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def run_main(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as exit_:
        rc = exit_.code
    out, err = capsys.readouterr()
    return rc, out, err


BAD = {
    "negative count": ["--requests", "-1"],
    "zero page size": ["--page-size", "0"],
    "negative seed": ["--seed", "-3"],
    "fraction above 1": ["--abort-frac", "2"],
    "negative rate": ["--arrival-rate", "-1"],
    "not a number": ["--layers", "many"],
    "stride not a page multiple": ["--page-size", "16", "--stride", "24"],
    "unknown dtype": ["--dtype", "fp7"],
    "bad length distribution": ["--prompt-len", "9-3"],
    "pool too small for one request": ["--device-tokens", "64"],
    "device tokens not whole pages": ["--device-tokens", "1000"],
    "host pool below one chunk": ["--host-tokens", "16", "--stride", "32"],
    "fractions above 1 together": ["--abort-frac", "0.6", "--retract-frac", "0.6"],
    "bad verify": ["--verify", "some"],
    "negative LoRA adapter count": ["--lora-adapters", "-1"],
    "salted tenants not a number": ["--cache-salts", "two"],
    "unknown flag": ["--warp"],
}


@pytest.mark.parametrize("flags", BAD.values(), ids=BAD.keys())
def test_bad_flags_exit_2_with_one_line(flags, capsys, tmp_path):
    rc, out, err = run_main(["simulate", "--store", str(tmp_path / "s"), *flags], capsys)
    assert rc == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and "error" in err, err
    assert not (tmp_path / "s").exists()  # nothing was done


def test_unwritable_store_exits_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for store in (blocker, blocker / "sub"):
        rc, out, err = run_main(["simulate", "--store", str(store), "--requests", "2"], capsys)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "--store" in err, err


def test_unreachable_redis_exits_2(capsys):
    rc, out, err = run_main(["simulate", "--storage", "redis://127.0.0.1:1/0", "--requests", "2"], capsys)
    assert rc == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and "redis://127.0.0.1:1/0" in err, err


def test_unwritable_outputs_exit_2(tmp_path, capsys):
    for flag in ("--json", "--audit"):
        rc, out, err = run_main(["simulate", "--store", str(tmp_path / "s"), flag, str(tmp_path / "no" / "x")],
                                capsys)
        assert rc == 2 and flag in err and len(err.strip().splitlines()) == 1


def test_audit_of_a_missing_file_and_a_bad_timeline_suffix(tmp_path, capsys):
    rc, _, err = run_main(["audit", str(tmp_path / "none.jsonl")], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    log = tmp_path / "empty.jsonl"
    log.write_text("")
    rc, _, err = run_main(["audit", str(log), "--timeline", str(tmp_path / "t.pdf")], capsys)
    assert rc == 2 and ".svg or .mmd" in err


def test_diagrams_command_writes_the_diagrams_and_refreshes_the_state_table(tmp_path, capsys):
    from lifecycle_tools.diagrams import DOC_BEGIN, DOC_END

    doc = tmp_path / "states.md"
    doc.write_text(f"# states\n{DOC_BEGIN}\nstale\n{DOC_END}\n")
    rc, out, _ = run_main(["diagrams", "--out", str(tmp_path / "d"), "--states-doc", str(doc)], capsys)
    written = out.split()
    assert rc == 0 and str(tmp_path / "d" / "request_lifecycle.mmd") in written and str(doc) in written
    assert "stale" not in doc.read_text() and "| `offload` | PREFILLED | OFFLOADING |" in doc.read_text()


def test_diagrams_in_another_directory_write_only_its_diagrams_folder(tmp_path, capsys, monkeypatch):
    """Issue 21: run anywhere, the command writes ./diagrams/ (or --out) and never another
    project's docs/states.md, even one with the generated-table markers."""
    from lifecycle_tools.diagrams import DOC_BEGIN, DOC_END

    other = tmp_path / "docs" / "states.md"
    other.parent.mkdir()
    text = f"# someone else's doc\n{DOC_BEGIN}\ntheir table\n{DOC_END}\n"
    other.write_text(text)
    monkeypatch.chdir(tmp_path)
    rc, out, _ = run_main(["diagrams"], capsys)
    assert rc == 0 and other.read_text() == text
    assert sorted(p.name for p in (tmp_path / "diagrams").iterdir()) == sorted(
        os.path.basename(p) for p in out.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diagrams", "docs"]


def test_no_subcommand_and_help(capsys):
    rc, _, err = run_main([], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    rc, out, _ = run_main(["simulate", "--help"], capsys)
    assert rc == 0 and "--spec-tokens" in out and "--warm" in out
    flat = " ".join(out.split())   # issue 21: every backend the library opens, and the retention flags
    assert all(spec in flat for spec in ("memory", "file:DIR", "redis://", "redis+cluster://", "mooncake://"))
    assert all(flag in flat for flag in ("--ttl", "--key-prefix", "--capacity-bytes"))


def test_console_entry_point_runs_as_a_module(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lifecycle_tools", "simulate", "--stride", "7",
                           "--store", str(tmp_path / "s")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "kv-lifecycle: error: --stride 7 is not a positive multiple of --page-size 16"]


def test_readme_first_command_is_simulate():
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0].strip().splitlines()
    assert block[0].endswith("&& .venv/bin/kv-lifecycle simulate")
    assert block[1].endswith("&& .venv/bin/python -m pytest")


def test_the_library_never_imports_its_tools():
    """Issue 21: ``lifecycle``, ``transfer`` and ``hashing`` name no ``lifecycle_tools`` module in
    any import (``python -m lifecycle`` was the last one); the tools import the library, not back."""
    import ast

    offenders = []
    for package in ("lifecycle", "transfer", "hashing"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "lifecycle_tools"]
    assert offenders == []


def test_the_command_modules_import_no_circle():
    """Issue 21: ``cli`` and ``simulate_cmd`` share ``command`` and do not import each other."""
    import ast

    def imported(name):
        tree = ast.parse((ROOT / "lifecycle_tools" / f"{name}.py").read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}

    assert "lifecycle_tools.cli" not in imported("simulate_cmd")
    assert "lifecycle_tools.simulate_cmd" in imported("cli") and "lifecycle_tools.command" in imported("simulate_cmd")
