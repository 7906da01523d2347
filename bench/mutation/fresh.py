"""Mutants of a group whose tests cannot run in a forked child: one fresh interpreter per mutant.

    .venv/bin/python bench/mutation/fresh.py --group transfer.mooncake [--modules mooncake.owned ...]
                                             [--commit HEAD] [--workdir mutation-runs] [--jobs 2]

mutmut forks each mutant's test run from a process that has already run the suite. Mooncake's
native client does not survive that: a forked child's first store call hangs (measured: a mutant's
run still hung after 142 s at 9.6 s of CPU, every mutant of the group timed out), so mutmut would
report every Mooncake mutant as a timeout — counted as killed, which is false. This runner lets
mutmut do what works in one process (generate the mutants, run the stats that map each function
to the tests that call it) and then runs each mutant's tests in a new ``python -m pytest`` with
``MUTANT_UNDER_TEST`` set (mutmut's trampolines read it), against the real ``mooncake_master``
those tests start. Outcomes go into ``{workdir}/{commit}/results.json`` next to the forked groups'
(``bench/mutation/campaign.py --report-only`` prints them all): exit 1 killed, 0 survived, past
``--timeout`` timeout, killed by a signal crashed; a mutant of a function no selected test calls
is "no tests"; ``--modules`` limits the run to some modules (the rest stay "not checked", reported
as not run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.mutation.campaign import _SHOW_ALL, PYTEST_ARGS, configure, snapshot_of  # noqa: E402


def stats_only(snapshot: Path, env: dict) -> None:
    """mutmut's mutant generation and stats run (in one process: no fork of a used client)."""
    code = ("from pathlib import Path\nimport os\n"
            "from mutmut.__main__ import (set_mutant_under_test, copy_src_dir, copy_also_copy_files,"
            " setup_source_paths, create_mutants, get_mutant_runner, collect_or_load_stats)\n"
            "set_mutant_under_test('mutant_generation'); os.makedirs('mutants', exist_ok=True)\n"
            "copy_src_dir(); copy_also_copy_files(); setup_source_paths(); create_mutants(2)\n"
            "collect_or_load_stats(get_mutant_runner(1), apply_config_invalidation=True)\n")
    subprocess.run([sys.executable, "-c", code], cwd=snapshot, env=env, check=True)


def mutants_with_tests(snapshot: Path) -> tuple[dict[str, list[str]], list[str]]:
    """{mutant: its tests} for mutants of functions some test calls, and the mutants of the rest."""
    stats = json.loads((snapshot / "mutants" / "mutmut-stats.json").read_text())
    by_function = stats["tests_by_mangled_function_name"]
    tested, untested = {}, []
    for meta in (snapshot / "mutants").rglob("*.py.meta"):
        for name in json.loads(meta.read_text())["exit_code_by_key"]:
            function = name.rsplit("__mutmut_", 1)[0].replace("__init__.", "")
            tests = sorted(by_function.get(function, ()))
            if tests:
                tested[name] = tests
            else:
                untested.append(name)
    return tested, untested


def run_one(snapshot: Path, env: dict, name: str, tests: list[str], timeout: float) -> str:
    run_env = dict(env, MUTANT_UNDER_TEST=name)
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", *PYTEST_ARGS, *tests], cwd=snapshot / "mutants",
                              env=run_env, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout"
    if proc.returncode == 0:
        return "survived"
    if proc.returncode == 1:
        return "killed"
    if proc.returncode < 0:
        return "segfault"
    return f"other (pytest exit {proc.returncode})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--group", required=True)
    ap.add_argument("--modules", nargs="*", help="module name parts to run (default: all of the group)")
    ap.add_argument("--commit", default="HEAD")
    ap.add_argument("--workdir", type=Path, default=ROOT / "mutation-runs")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per mutant's test run")
    args = ap.parse_args()
    os.nice(10)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.commit],
                            check=True, capture_output=True, text=True).stdout.strip()
    commit_dir = args.workdir.resolve() / commit
    snapshot = commit_dir / args.group
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["CI"] = "true"
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    start = time.monotonic()
    if not (snapshot / "mutants" / "mutmut-stats.json").exists():
        snapshot_of(commit, snapshot)
        modules, tests = configure(snapshot, args.group)
        stats_only(snapshot, env)
    tested, untested = mutants_with_tests(snapshot)
    outcomes = {name: "no tests" for name in untested}
    chosen = {n: t for n, t in tested.items() if not args.modules or any(m in n for m in args.modules)}
    outcomes.update({n: "not checked" for n in tested if n not in chosen})
    print(f"{args.group} on {commit}: {len(tested) + len(untested)} mutants, {len(untested)} without tests, "
          f"running {len(chosen)} in fresh interpreters ({args.jobs} at a time)", flush=True)
    partial = commit_dir / f"{args.group}.fresh.jsonl"  # one line per finished mutant: a stopped run goes on
    finished = {}
    if partial.exists():
        for line in partial.read_text().splitlines():
            got = json.loads(line)
            finished[got["mutant"]] = got["outcome"]
    todo = {n: t for n, t in chosen.items() if n not in finished}
    outcomes.update({n: s for n, s in finished.items() if n in chosen})
    with ThreadPoolExecutor(args.jobs) as pool, open(partial, "a") as log:
        futures = {n: pool.submit(run_one, snapshot, env, n, t, args.timeout) for n, t in todo.items()}
        for i, (name, fut) in enumerate(futures.items(), 1):
            outcomes[name] = fut.result()
            log.write(json.dumps({"mutant": name, "outcome": outcomes[name]}) + "\n")
            log.flush()
            print(f"  {i}/{len(todo)} {outcomes[name]:9} {name}", flush=True)
    results_file = commit_dir / "results.json"
    done = json.loads(results_file.read_text()) if results_file.exists() else []
    done = [r for r in done if r["group"] != args.group]
    done.append({"group": args.group, "rc": 0, "wall_s": round(time.monotonic() - start, 1), "modules": [],
                 "tests": [], "outcomes": outcomes, "runner": "fresh interpreter per mutant"})
    results_file.write_text(json.dumps(done, indent=1))
    survivors = [n for n, s in outcomes.items() if s == "survived"]
    subprocess.run([sys.executable, "-c", _SHOW_ALL, str(commit_dir / f"{args.group}.survivors.txt"), *survivors],
                   cwd=snapshot, env=env, check=False)


if __name__ == "__main__":
    main()
