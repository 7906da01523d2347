"""Mutation testing of the library (mutmut 3), group by group, each against its own test files.

    .venv/bin/pip install -e '.[mutation]'
    .venv/bin/python bench/mutation/campaign.py [--groups hashing lifecycle ...] [--commit HEAD]
                                       [--workdir mutation-runs] [--max-children 2] [--nice 10]

Not part of CI. For each group of ``bench/mutation/map.py`` it extracts the commit into a fresh
snapshot (``git archive``: the working tree, and whoever is editing it, is never touched), writes
the group's ``[tool.mutmut]`` section there (modules to mutate, test files to run), runs
``mutmut run`` at low priority and collects every mutant's outcome. It prints, per group and per
package: mutants generated, killed, survived, timeout, no tests (code no selected test reaches),
crashed (the test run died of a signal: SIGSEGV, or SIGKILL past the CPU limit — the
mutant did not pass, counted as detected), other (suspicious), known equivalent (listed in ``bench/mutation/equivalent.txt`` with
the reason and the hash of its function's source when judged: an entry whose function changed
since is stale and its survivor counts as a survivor, see ``bench/mutation/equivalents.py``), not run (the group was stopped first) and the kill rate = (killed + timeout +
crashed) / (generated - equivalent - no tests - not run).

``--continue`` goes on with a stopped run of the same commit (a group's snapshot is kept, and
mutmut runs only the mutants that have no outcome yet). ``--resume-from REV`` starts each group from REV's finished snapshot instead of from scratch:
the library files are replaced by this commit's (mutmut regenerates them and resets the outcomes
of every function whose code changed), the tests are this commit's (new tests get their stats
run), and REV's survivors and timeouts that kept their outcome are run again by name (a timeout
may be only a run slowed by load past its bound). A killed mutant of an
unchanged function stays killed: tests are only ever added or tightened. The resumed snapshot keeps
REV's ``[tool.mutmut]`` settings (pytest arguments, test files): mutmut throws away every outcome of
a group whose settings changed, so test files added since REV are not run (they are listed). ``--report-only`` reprints a finished run's table.
Survivor diffs go to ``{workdir}/{commit}/{group}.survivors.txt`` and all outcomes to
``{workdir}/{commit}/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.mutation import equivalents  # noqa: E402
from bench.mutation.map import (  # noqa: E402
    ALSO_COPY,
    DESELECT,
    GROUPS,
    LIBRARY,
    NEVER_MUTATE,
    SLOW_OR_MULTIPROCESS_TESTS,
)

EQUIVALENT_FILE = ROOT / "bench" / "mutation" / "equivalent.txt"
# a mutant's test run may take this many times the tests' measured time (+1 s) before it is called
# a timeout (mutmut's default is 15): a hung copy thread then costs seconds, not a minute, while a
# run slowed by two or three other processes on the cores is still far inside the bound
TIMEOUT_MULTIPLIER = 6.0
# the slowest test of any group takes about 6 s on this machine (stats runs, under load)
PER_TEST_TIMEOUT_S = 30
KILLED = {"killed", "caught by type check"}
# the test run died of a signal (SIGSEGV, or SIGKILL after the CPU limit): the mutant did not pass
CRASHED = {"segfault"}
# ``bench.mutation.order``: each mutant's tests run cheapest first (see that module; outcomes unchanged)
PYTEST_ARGS = ["-p", "no:cacheprovider", "-p", "bench.mutation.order", "-x", "-q", "--hypothesis-seed=0"]
MUTMUT = Path(sys.executable).with_name("mutmut")
RERUN = ("survived", "timeout")  # a resumed run's outcomes that are run again (``rerun_names``)
COLUMNS = ("generated", "killed", "survived", "timeout", "crashed", "no tests", "other", "not run", "equivalent")


def expand(snapshot: Path, patterns: list[str], exclude: list[str] = ()) -> list[str]:
    """Files under ``snapshot`` matching any pattern (component-wise globs), minus ``exclude``."""
    found = {p.relative_to(snapshot).as_posix() for pat in patterns for p in snapshot.glob(pat)}
    dropped = {p.relative_to(snapshot).as_posix() for pat in exclude for p in snapshot.glob(pat)}
    return sorted(found - dropped)


def toml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def snapshot_of(commit: str, dest: Path) -> None:
    """A clean copy of ``commit``'s tree at ``dest``."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def stale_equivalents(commit: str) -> dict[str, str]:
    """The listed equivalents that are stale in ``commit``'s tree (name -> why): the campaign's guard on
    the list, run before any group (a stale entry's survivor counts as a survivor)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        snapshot_of(commit, tree)
        return judge_equivalent(tree)[1]


def configure(snapshot: Path, group: str, write: bool = True) -> tuple[list[str], list[str]]:
    """Write the group's [tool.mutmut] into the snapshot's pyproject (unless ``write`` is False: a
    snapshot configured before); return (modules, tests)."""
    spec = GROUPS[group]
    modules = expand(snapshot, spec["mutate"], NEVER_MUTATE + spec.get("exclude", []))
    tests = expand(snapshot, spec["tests"], SLOW_OR_MULTIPROCESS_TESTS)
    if not write:
        return modules, tests
    # a test running past PER_TEST_TIMEOUT_S fails (pytest-timeout): a mutant that hangs a test is
    # detected in seconds instead of the whole selection's timeout; set in pytest's own section,
    # outside what mutmut fingerprints, so a resumed snapshot keeps its outcomes
    _write_settings(snapshot / "pyproject.toml", f"timeout = {PER_TEST_TIMEOUT_S}", f"""
[tool.mutmut]
source_paths = {toml_list([p + "/" for p in LIBRARY])}
only_mutate = {toml_list(modules)}
also_copy = {toml_list(ALSO_COPY)}
pytest_add_cli_args = {toml_list(PYTEST_ARGS + [f"--deselect={t}" for t in DESELECT])}
pytest_add_cli_args_test_selection = {toml_list(tests)}
use_git_change_detection = false
timeout_multiplier = {TIMEOUT_MULTIPLIER}
""" + (f'process_isolation = "{spec["isolation"]}"\n' if "isolation" in spec else "")
      + (f"timeout_constant = {float(spec['timeout_constant'])}\n" if "timeout_constant" in spec else ""))
    return modules, tests


def overlay(commit: str, dest: Path, previous: Path) -> None:
    """``previous``'s snapshot (mutmut's state: mutants, outcomes, test stats) with ``commit``'s tree
    over it: changed library files are touched so mutmut regenerates them and resets the outcomes
    of the functions whose code changed; unchanged functions keep theirs."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(previous, dest, symlinks=True)
    for top in [*LIBRARY, *ALSO_COPY, "pyproject.toml"]:
        path = dest / top
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    now = time.time()
    for top in LIBRARY:
        for f in (dest / top).rglob("*.py"):
            os.utime(f, (now, now))


def carry_settings(old: Path, new: Path) -> None:
    """Give the resumed snapshot's pyproject (``new``: the commit's own) the previous run's
    ``[tool.mutmut]`` section and pytest timeout line, unchanged. mutmut fingerprints its pytest
    arguments and test selection, and a changed fingerprint throws away every recorded outcome
    of the group: a resumed run keeps the settings its outcomes were obtained with."""
    before = old.read_text()
    timeout = next(line for line in before.splitlines() if line.startswith("timeout = "))
    _write_settings(new, timeout, before[before.index("\n[tool.mutmut]"):])


def _write_settings(pyproject: Path, timeout_line: str, section: str) -> None:
    """Put ``timeout_line`` first in pytest's ini section and append the ``[tool.mutmut]`` ``section``."""
    text = pyproject.read_text()
    if "[tool.mutmut]" in text:
        raise SystemExit(f"{pyproject} already has [tool.mutmut]: bench/mutation/campaign.py owns that section")
    text = text.replace("[tool.pytest.ini_options]\n", f"[tool.pytest.ini_options]\n{timeout_line}\n", 1)
    pyproject.write_text(text + section)


def mutmut_section_list(pyproject: Path, key: str) -> list[str]:
    """A list value of the ``[tool.mutmut]`` section as written by ``configure``."""
    for line in pyproject.read_text().split("[tool.mutmut]", 1)[1].splitlines():
        if line.startswith(f"{key} = "):
            return json.loads(line.split(" = ", 1)[1])
    return []


def _mutmut(snapshot: Path, env: dict, log: Path, args: list[str]) -> int:
    with open(log, "ab") as out:  # its own process group: stopping the campaign stops its workers
        proc = subprocess.Popen([str(MUTMUT), *args], cwd=snapshot,
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)
            raise


def rerun_names(before: list[str], outcomes: dict[str, str], equivalent: dict[str, str]) -> list[str]:
    """Of a resumed run's previous survivors and timeouts (``before``), those to run again by name
    (mutmut re-runs a finished mutant only when named): the ones whose function did not change kept
    that outcome here, and are not listed equivalent (they survive by definition). A timeout is
    run again because a test run slowed by load past its bound is reported as one (counted
    detected) whatever the mutant does; seen on mutants that only reword a message."""
    return [m for m in before if outcomes.get(m) in RERUN and m not in equivalent]


def _mutmut_env() -> dict:
    """This environment for mutmut, without PYTHONPATH: mutmut puts mutants/ first on sys.path
    itself (a PYTHONPATH entry breaks its test run)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def listing(snapshot: Path) -> dict[str, str]:
    """Every mutant's outcome as the snapshot's mutmut state records it (the authority: a stopped
    run has no ``results.json``, and one written at a run's start lists every mutant not checked)."""
    out = subprocess.run([str(MUTMUT), "results", "--all", "true"],
                         cwd=snapshot, env=_mutmut_env(), capture_output=True, text=True).stdout
    return dict(line.strip().rsplit(": ", 1) for line in out.splitlines() if ": " in line)


def run_group(commit_dir: Path, commit: str, group: str, max_children: int, previous: Path | None = None,
              resume: bool = False, survivors_only: bool = False) -> dict:
    snapshot = commit_dir / group
    rerun_before = []
    continuing = resume and (snapshot / "mutants").is_dir()
    from_rev = previous is not None and (previous / group).is_dir()
    resumed = not continuing and from_rev
    if from_rev:
        rerun_before = [m for m, s in listing(previous / group).items() if s in RERUN]
    if continuing:
        pass  # --continue: the stopped run's snapshot; mutmut runs what has no outcome yet (with
        # --resume-from REV too: a stopped resumed run goes on, then REV's survivors run again)
    elif resumed:
        overlay(commit, snapshot, previous / group)
        carry_settings(previous / group / "pyproject.toml", snapshot / "pyproject.toml")
    else:
        snapshot_of(commit, snapshot)
    modules, tests = configure(snapshot, group, write=not continuing and not resumed)
    if resumed:
        kept = set(mutmut_section_list(snapshot / "pyproject.toml", "pytest_add_cli_args_test_selection"))
        if set(tests) - kept:
            print(f"  {group}: test files new since {previous.name} are not run (the selection is kept so "
                  f"mutmut keeps its outcomes): {sorted(set(tests) - kept)}", flush=True)
    env = _mutmut_env()
    env["CI"] = "true"  # a test that needs a server fails instead of skipping
    # one torch/OpenMP thread: mutmut forks each mutant's run from a process whose thread pool is
    # started, and a child entering a parallel region then waits forever on a lock its parent's
    # pool thread held at the fork (seen: single-threaded children stuck in a futex, reported as
    # timeouts, i.e. as killed, whatever the mutant did)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    log = commit_dir / f"{group}.log"
    if not resume:
        log.unlink(missing_ok=True)
    start = time.monotonic()
    run = ["run", "--max-children", str(max_children)]
    rc = 0 if survivors_only and rerun_before else _mutmut(snapshot, env, log, run)

    outcomes = listing(snapshot)
    again = rerun_names(rerun_before, outcomes, load_equivalent(snapshot))
    for i in range(0, len(again), 200):
        batch = again[i:i + 200]
        got = _mutmut(snapshot, env, log, [*run, *batch])
        if got != 0:  # e.g. mutmut's stats run for the new tests crashed: this batch was not run; once more
            print(f"  {group}: mutmut exited {got} on survivors {i}-{i + len(batch) - 1}; running them again",
                  flush=True)
            got = _mutmut(snapshot, env, log, [*run, *batch])
        rc = got or rc
    if again:
        outcomes = listing(snapshot)
    wall = time.monotonic() - start
    survivors = [m for m, s in outcomes.items() if s == "survived"]
    subprocess.run([sys.executable, "-c", _SHOW_ALL, str(commit_dir / f"{group}.survivors.txt"), *survivors],
                   cwd=snapshot, env=env, check=False)
    return {"group": group, "rc": rc, "wall_s": round(wall, 1), "modules": modules, "tests": tests,
            "outcomes": outcomes, "resumed_from": previous.name if rerun_before else None,
            "rerun_survivors": len(again)}


# one process for every survivor's diff (``mutmut show`` per mutant costs an interpreter start each)
_SHOW_ALL = """
import sys
from mutmut.__main__ import find_mutant, get_diff_for_mutant
with open(sys.argv[1], "w") as f:
    for name in sys.argv[2:]:
        f.write(f"# {name}\\n" + get_diff_for_mutant(name, path=find_mutant(name).path) + "\\n")
"""


def judge_equivalent(root: Path | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """The listed equivalents (``mutant name @function hash  # reason`` lines), judged in ``root``.

    ``root`` is a tree of the library's sources (a snapshot, a commit's extract). An entry whose
    function is gone or changed there since it was judged may name another mutant now
    (``bench/mutation/equivalents.py``): it is stale, and its survivor counts as a survivor.
    Returns:
        (name -> reason of the current entries, name -> why of the stale ones); without ``root``
        every entry is taken as current.
    """
    entries = equivalents.load(EQUIVALENT_FILE)
    stale = equivalents.stale(entries, root) if root is not None else {}
    return {e.name: e.reason for e in entries if e.name not in stale}, stale


def load_equivalent(root: Path | None = None) -> dict[str, str]:
    """The current entries of the list in ``root``, name -> reason (see ``judge_equivalent``)."""
    return judge_equivalent(root)[0]


def tally(outcomes: dict[str, str], equivalent: dict[str, str]) -> Counter:
    c = Counter(generated=len(outcomes))
    for name, status in outcomes.items():
        if status in KILLED:
            c["killed"] += 1
        elif status == "survived":
            c["equivalent" if name in equivalent else "survived"] += 1
        elif status in CRASHED:
            c["crashed"] += 1
        elif status in ("timeout", "no tests"):
            c[status] += 1
        elif status in ("not checked", "check was interrupted by user"):
            c["not run"] += 1  # the group was stopped before this mutant ran
        else:
            c["other"] += 1
    return c


def kill_rate(c: Counter) -> str:
    judged = c["generated"] - c["equivalent"] - c["no tests"] - c["not run"]
    return f"{100 * (c['killed'] + c['timeout'] + c['crashed']) / judged:.1f}%" if judged else "-"


def print_table(rows: list[tuple[str, Counter, float | None]]) -> None:
    head = f"{'group':<24}" + "".join(f"{h:>11}" for h in COLUMNS) + f"{'kill rate':>11}{'wall s':>9}"
    print(head)
    print("-" * len(head))
    for name, c, wall in rows:
        print(f"{name:<24}" + "".join(f"{c[h]:>11}" for h in COLUMNS)
              + f"{kill_rate(c):>11}" + (f"{wall:>9.0f}" if wall is not None else f"{'':>9}"))


def report(results: list[dict], equivalent: dict[str, str]) -> None:
    rows, per_package, total = [], {}, Counter()
    for r in results:
        c = tally(r["outcomes"], equivalent)
        rows.append((r["group"], c, r["wall_s"]))
        per_package.setdefault(r["group"].split(".")[0], Counter()).update(c)
        total.update(c)
    rows += [(f"= {pkg}", c, None) for pkg, c in per_package.items()]
    rows.append(("= all", total, sum(r["wall_s"] for r in results)))
    print_table(rows)
    seen = {m for r in results for m in r["outcomes"]}
    modules = {m.rsplit(".", 1)[0] for m in seen}
    stale = sorted(m for m in set(equivalent) - seen if m.rsplit(".", 1)[0] in modules)
    if stale:
        print(f"\n{len(stale)} listed equivalent mutants were not generated (code changed): {stale}")


def by_module(results: list[dict], equivalent: dict[str, str]) -> list[tuple[str, Counter, None]]:
    """One row per mutated module (a mutant's name is its module, a dot, then its function)."""
    outcomes: dict[str, dict[str, str]] = {}
    for r in results:
        for name, status in r["outcomes"].items():
            outcomes.setdefault(name.rsplit(".", 1)[0], {})[name] = status
    return [(module, tally(o, equivalent), None) for module, o in sorted(outcomes.items())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", nargs="+", choices=list(GROUPS), default=list(GROUPS))
    ap.add_argument("--commit", default="HEAD")
    ap.add_argument("--workdir", type=Path, default=ROOT / "mutation-runs")
    ap.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--nice", type=int, default=10)
    ap.add_argument("--report-only", action="store_true", help="print the table of a finished run")
    ap.add_argument("--by-module", action="store_true", help="also print one row per mutated module")
    ap.add_argument("--survivors-only", action="store_true",
                    help="with --resume-from: run only REV's survivors and timeouts again (by name), nothing else")
    ap.add_argument("--continue", dest="resume", action="store_true",
                    help="go on with a stopped run of the same commit (its snapshots kept); with "
                    "--resume-from REV, a stopped resumed run: REV's survivors are run again at its end")
    ap.add_argument("--resume-from", metavar="REV", help="start each group from REV's finished snapshot: only "
                    "mutants of changed functions and REV's survivors and timeouts are run again")
    args = ap.parse_args()
    os.nice(args.nice)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.commit],
                            check=True, capture_output=True, text=True).stdout.strip()
    commit_dir = args.workdir.resolve() / commit
    commit_dir.mkdir(parents=True, exist_ok=True)
    results_file = commit_dir / "results.json"
    done = {r["group"]: r for r in json.loads(results_file.read_text())} if results_file.exists() else {}
    print(f"mutation campaign on {commit}, groups {', '.join(args.groups)}", flush=True)
    if not args.report_only:
        stale_at_start = stale_equivalents(commit)
        if stale_at_start:     # the guard on the list: its survivors will count as survivors
            print(f"{len(stale_at_start)} listed equivalents are stale at {commit}; re-read them before trusting "
                  "the rate (bench/mutation/equivalents.py --show NAME, then --refresh NAME or delete):", flush=True)
            for name, why in stale_at_start.items():
                print(f"  {name}: {why}", flush=True)
    previous = None
    if args.resume_from:
        old = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.resume_from],
                             check=True, capture_output=True, text=True).stdout.strip()
        previous = args.workdir.resolve() / old
    for group in [] if args.report_only else args.groups:
        r = run_group(commit_dir, commit, group, args.max_children, previous, args.resume, args.survivors_only)
        done[group] = r
        results_file.write_text(json.dumps(list(done.values()), indent=1))
        print(f"  {group}: {len(r['outcomes'])} mutants in {r['wall_s']:.0f} s (mutmut rc {r['rc']})",
              flush=True)
    print()
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        snapshot_of(commit, tree)                      # the sources the run's equivalents are judged in
        equivalent, stale = judge_equivalent(tree)
    finished = [done[g] for g in GROUPS if g in done]
    report(finished, equivalent)
    if stale:
        print(f"\n{len(stale)} listed equivalents are stale at {commit} (their survivors count as survivors; "
              "re-read them: bench/mutation/equivalents.py --show):")
        for name, why in stale.items():
            print(f"  {name}: {why}")
    if args.by_module:
        print()
        print_table(by_module(finished, equivalent))
    print(f"\nsurvivor diffs: {commit_dir}/<group>.survivors.txt; outcomes: {results_file}")


if __name__ == "__main__":
    main()
