"""``bench/mutation/campaign.py`` and ``bench/mutation/fresh.py``: the campaign's bookkeeping (what counts as
detected, what the kill rate divides by, which files a group mutates and runs, what a fresh
interpreter's exit status means). mutmut itself is not needed: these parts never import it."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from bench.mutation import campaign, equivalents, fresh
from bench.mutation.map import GROUPS, NEVER_MUTATE, SLOW_OR_MULTIPROCESS_TESTS

ROOT = Path(__file__).resolve().parents[2]


def test_every_outcome_is_counted_in_exactly_one_column():
    outcomes = {
        "a.x_f__mutmut_1": "killed",
        "a.x_f__mutmut_2": "caught by type check",
        "a.x_f__mutmut_3": "survived",
        "a.x_f__mutmut_4": "survived",  # listed equivalent below
        "a.x_f__mutmut_5": "timeout",
        "a.x_f__mutmut_6": "segfault",
        "a.x_f__mutmut_7": "no tests",
        "a.x_f__mutmut_8": "not checked",
        "a.x_f__mutmut_9": "check was interrupted by user",
        "a.x_f__mutmut_10": "suspicious",
    }
    c = campaign.tally(outcomes, {"a.x_f__mutmut_4": "same bytes"})
    assert c == Counter({"generated": 10, "killed": 2, "survived": 1, "equivalent": 1, "timeout": 1,
                         "crashed": 1, "no tests": 1, "not run": 2, "other": 1})
    assert sum(c[k] for k in campaign.COLUMNS if k != "generated") == c["generated"]


def test_kill_rate_counts_timeouts_and_crashes_as_detected_and_leaves_out_what_was_not_judged():
    c = Counter({"generated": 20, "killed": 6, "timeout": 1, "crashed": 1, "survived": 2, "equivalent": 3,
                 "no tests": 4, "not run": 3})
    # judged = 20 - 3 - 4 - 3 = 10; detected = 6 + 1 + 1 = 8
    assert campaign.kill_rate(c) == "80.0%"
    assert campaign.kill_rate(Counter({"generated": 2, "no tests": 2})) == "-"


def test_equivalent_file_is_name_then_reason(tmp_path, monkeypatch):
    f = tmp_path / "eq.txt"
    f.write_text("m.x_a__mutmut_1  # speed only\n\n   \nm.x_b__mutmut_2 # a # in the reason\n")
    monkeypatch.setattr(campaign, "EQUIVALENT_FILE", f)
    assert campaign.load_equivalent() == {"m.x_a__mutmut_1": "speed only", "m.x_b__mutmut_2": "a # in the reason"}
    monkeypatch.setattr(campaign, "EQUIVALENT_FILE", tmp_path / "missing.txt")
    assert campaign.load_equivalent() == {}


def test_the_equivalent_list_has_a_reason_on_every_line_and_no_name_twice():
    lines = [line for line in (ROOT / "bench" / "mutation" / "equivalent.txt").read_text().splitlines() if line.strip()]
    entries = [equivalents.parse_line(line) for line in lines]
    assert all("__mutmut_" in e.name and e.reason and e.hash for e in entries)
    assert len({e.name for e in entries}) == len(entries)


def test_expand_matches_globs_and_drops_exclusions(tmp_path):
    for p in ("transfer/storage/file.py", "transfer/storage/mooncake.py", "transfer/storage/mooncake_keys.py",
              "transfer/storage/__main__.py", "transfer/other.py"):
        (tmp_path / p).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / p).write_text("")
    got = campaign.expand(tmp_path, ["transfer/storage/*.py"], ["transfer/storage/mooncake*.py", *NEVER_MUTATE])
    assert got == ["transfer/storage/file.py"]


def test_every_group_mutates_real_modules_and_runs_real_tests_and_no_module_is_in_two_groups():
    seen: dict[str, str] = {}
    for group, spec in GROUPS.items():
        modules = campaign.expand(ROOT, spec["mutate"], NEVER_MUTATE + spec.get("exclude", []))
        tests = campaign.expand(ROOT, spec["tests"], SLOW_OR_MULTIPROCESS_TESTS)
        assert modules and tests, group
        for m in modules:
            assert m not in seen, f"{m} in {seen.get(m)} and {group}"
            seen[m] = group
        assert not set(tests) & set(SLOW_OR_MULTIPROCESS_TESTS)
    library = {p.relative_to(ROOT).as_posix() for top in ("lifecycle", "transfer", "hashing")
               for p in (ROOT / top).rglob("*.py") if p.name != "__main__.py"}
    # every library module with code is in some group (package __init__ files may be re-exports only)
    missing = sorted(m for m in library - set(seen) if not m.endswith("__init__.py"))
    assert missing == []


def hashing_tree(root: Path, pyproject: str) -> None:
    """A snapshot holding one module of the hashing group, its test file and ``pyproject``."""
    (root / "hashing").mkdir()
    (root / "hashing" / "chain.py").write_text("")
    (root / "tests" / "hashing").mkdir(parents=True)
    (root / "tests" / "hashing" / "test_chain.py").write_text("")
    (root / "pyproject.toml").write_text(pyproject)


def test_configure_writes_the_group_section_once_and_refuses_a_second(tmp_path):
    hashing_tree(tmp_path, "[project]\nname = 'x'\n\n[tool.pytest.ini_options]\naddopts = ''\n")
    modules, tests = campaign.configure(tmp_path, "hashing")
    assert modules == ["hashing/chain.py"] and tests == ["tests/hashing/test_chain.py"]
    text = (tmp_path / "pyproject.toml").read_text()
    assert f"[tool.pytest.ini_options]\ntimeout = {campaign.PER_TEST_TIMEOUT_S}\n" in text
    assert 'only_mutate = ["hashing/chain.py"]' in text
    assert f"timeout_multiplier = {campaign.TIMEOUT_MULTIPLIER}" in text
    with pytest.raises(SystemExit, match="already has"):
        campaign.configure(tmp_path, "hashing")
    # a configured snapshot is only read back
    assert campaign.configure(tmp_path, "hashing", write=False) == (modules, tests)


def test_fresh_runner_maps_each_mutant_to_the_tests_of_its_function(tmp_path):
    mutants = tmp_path / "mutants"
    (mutants / "transfer" / "storage").mkdir(parents=True)
    (mutants / "mutmut-stats.json").write_text(json.dumps({"tests_by_mangled_function_name": {
        "transfer.storage.m.xǁCǁput": ["tests/t.py::test_b", "tests/t.py::test_a"]}}))
    (mutants / "transfer" / "storage" / "m.py.meta").write_text(json.dumps({"exit_code_by_key": {
        "transfer.storage.m.xǁCǁput__mutmut_1": None, "transfer.storage.m.xǁCǁget__mutmut_1": None}}))
    tested, untested = fresh.mutants_with_tests(tmp_path)
    assert tested == {"transfer.storage.m.xǁCǁput__mutmut_1": ["tests/t.py::test_a", "tests/t.py::test_b"]}
    assert untested == ["transfer.storage.m.xǁCǁget__mutmut_1"]


def test_fresh_runner_reads_pytests_exit_status(tmp_path, monkeypatch):
    mutants = tmp_path / "mutants"
    mutants.mkdir()
    (mutants / "test_m.py").write_text(
        "import os, signal, time\n"
        "def test_m():\n"
        "    m = os.environ['MUTANT_UNDER_TEST']\n"
        "    if m == 'hang': time.sleep(30)\n"
        "    if m == 'crash': os.kill(os.getpid(), signal.SIGKILL)\n"
        "    assert m != 'bad'\n")
    monkeypatch.setattr(fresh, "PYTEST_ARGS", ["-p", "no:cacheprovider", "-q"])
    env = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}
    run = fresh.run_one
    assert run(tmp_path, env, "good", ["test_m.py"], 60) == "survived"
    assert run(tmp_path, env, "bad", ["test_m.py"], 60) == "killed"
    assert run(tmp_path, env, "crash", ["test_m.py"], 60) == "segfault"
    assert run(tmp_path, env, "hang", ["test_m.py"], 3) == "timeout"
    assert run(tmp_path, env, "good", ["no_such_test.py"], 60).startswith("other (pytest exit")


def test_a_group_can_ask_for_the_fork_server_and_a_longer_timeout_constant(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "a.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("")
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    monkeypatch.setitem(campaign.GROUPS, "g", {"mutate": ["m/*.py"], "tests": ["tests/test_*.py"],
                                              "isolation": "forkserver", "timeout_constant": 10})
    campaign.configure(tmp_path, "g")
    section = (tmp_path / "pyproject.toml").read_text().split("[tool.mutmut]")[1]
    assert 'process_isolation = "forkserver"\n' in section and "timeout_constant = 10.0\n" in section
    assert campaign.GROUPS["transfer.mooncake"]["isolation"] == "forkserver"  # its client hangs in a plain fork


def test_a_group_without_those_keys_keeps_mutmuts_defaults(tmp_path):
    hashing_tree(tmp_path, "[tool.pytest.ini_options]\n")
    campaign.configure(tmp_path, "hashing")
    section = (tmp_path / "pyproject.toml").read_text().split("[tool.mutmut]")[1]
    assert "process_isolation" not in section and "timeout_constant" not in section


def test_tests_run_cheapest_file_first_and_cheapest_test_first_within_a_file():
    from bench.mutation.order import cheapest_first

    ids = ["a.py::slow", "b.py::x", "a.py::fast", "c.py::unmeasured", "b.py::y", "a.py::mid"]
    d = {"a.py::slow": 5.0, "a.py::fast": 0.1, "a.py::mid": 1.0, "b.py::x": 0.3, "b.py::y": 0.2}
    order = [ids[i] for i in cheapest_first(ids, d)]
    assert order == ["c.py::unmeasured", "b.py::y", "b.py::x", "a.py::fast", "a.py::mid", "a.py::slow"]
    assert sorted(cheapest_first(ids, d)) == list(range(len(ids)))  # a permutation: nothing dropped or doubled
    assert cheapest_first(["t.py::a", "t.py::b"], {}) == [0, 1]    # no durations: order kept


def test_the_plugin_reorders_a_real_run_and_leaves_it_alone_without_stats(tmp_path):
    import subprocess
    import sys

    (tmp_path / "test_t.py").write_text("import pytest\n"
                                        "@pytest.mark.parametrize('n', ['a', 'b', 'c'])\n"
                                        "def test_t(n):\n    print('RAN', n)\n")
    args = [sys.executable, "-m", "pytest", "-p", "bench.mutation.order", "-p", "no:cacheprovider", "-s", "-q",
            "test_t.py"]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}

    def ran() -> list[str]:
        out = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        return [line.split()[1] for line in out.stdout.replace("RAN", "\nRAN").splitlines() if line.startswith("RAN")]

    assert ran() == ["a", "b", "c"]
    (tmp_path / "mutmut-stats.json").write_text(json.dumps({"duration_by_test": {
        "test_t.py::test_t[a]": 3.0, "test_t.py::test_t[b]": 1.0, "test_t.py::test_t[c]": 2.0}}))
    assert ran() == ["b", "c", "a"]


def test_a_resumed_snapshot_keeps_the_settings_its_outcomes_were_obtained_with(tmp_path):
    old, new = tmp_path / "old.toml", tmp_path / "new.toml"
    old.write_text("[project]\nname = 'x'\n\n[tool.pytest.ini_options]\ntimeout = 30\naddopts = ''\n"
                   '\n[tool.mutmut]\npytest_add_cli_args = ["-x"]\n'
                   'pytest_add_cli_args_test_selection = ["tests/test_a.py"]\n')
    new.write_text("[project]\nname = 'x'\nversion = '2'\n\n[tool.pytest.ini_options]\naddopts = ''\n")
    campaign.carry_settings(old, new)
    text = new.read_text()
    assert "version = '2'" in text                                  # the commit's own project table
    assert "[tool.pytest.ini_options]\ntimeout = 30\naddopts = ''\n" in text
    assert text.endswith('\n[tool.mutmut]\npytest_add_cli_args = ["-x"]\n'
                         'pytest_add_cli_args_test_selection = ["tests/test_a.py"]\n')
    assert campaign.mutmut_section_list(new, "pytest_add_cli_args_test_selection") == ["tests/test_a.py"]
    assert campaign.mutmut_section_list(new, "only_mutate") == []
    with pytest.raises(SystemExit, match="already has"):
        campaign.carry_settings(old, new)


def test_by_module_splits_each_groups_outcomes_by_the_module_a_mutant_names():
    results = [{"group": "g", "outcomes": {"a.b.x_f__mutmut_1": "killed", "a.b.xǁCǁm__mutmut_2": "survived",
                                           "a.c.x_g__mutmut_1": "survived", "a.c.x_g__mutmut_2": "timeout"}}]
    rows = {name: c for name, c, _ in campaign.by_module(results, {"a.c.x_g__mutmut_1": "same"})}
    assert set(rows) == {"a.b", "a.c"}
    assert (rows["a.b"]["killed"], rows["a.b"]["survived"]) == (1, 1)
    assert (rows["a.c"]["equivalent"], rows["a.c"]["timeout"], rows["a.c"]["generated"]) == (1, 1, 2)
    assert campaign.kill_rate(rows["a.c"]) == "100.0%"


def test_a_resumed_run_reruns_survivors_and_timeouts_that_kept_their_outcome_but_not_equivalents():
    before = ["m.s1", "m.t1", "m.eq", "m.changed", "m.gone"]
    now = {"m.s1": "survived", "m.t1": "timeout", "m.eq": "survived", "m.changed": "not checked",
           "m.k": "killed"}
    assert campaign.rerun_names(before, now, {"m.eq": "same ids"}) == ["m.s1", "m.t1"]
    assert campaign.rerun_names(before, {**now, "m.changed": "killed"}, {}) == ["m.s1", "m.t1", "m.eq"]
