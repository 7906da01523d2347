"""``kv-lifecycle simulate`` end to end: this checkout vs a baseline revision, same command, same run.

Each measurement is one whole ``python -m lifecycle_tools simulate --requests N --store DIR`` process
(fresh store each time, default configuration otherwise): wall time from spawn to exit and the
process's peak RSS (``os.wait4``). Ours and the baseline (a ``git archive`` of ``--baseline-rev``
unpacked in a temporary directory, run with the same interpreter) alternate, ``--repeats`` times,
and the medians are printed side by side with the ratio. ``--big N`` adds one run of each at N
requests, to show memory staying flat in the number of requests (skip the baseline there with
``--big-baseline 0``: it holds the whole workload and every request's tokens until the end).

Run: .venv/bin/python bench/bench_simulate.py [--requests 2000] [--repeats 3] [--big 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

from bench.perfkit import machine  # noqa: E402


def baseline_tree(rev: str, into: str) -> str:
    """Unpack ``rev`` of this repository into ``into`` (nothing in the repository changes)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def run_once(tree: str, requests: int, work: str) -> dict:
    """One simulate process over a fresh store: wall s, peak RSS MiB, exit code, its report."""
    store, report = os.path.join(work, "store"), os.path.join(work, "report.json")
    shutil.rmtree(store, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, "-m", "lifecycle_tools", "simulate", "--requests", str(requests), "--store", store,
           "--no-progress", "--json", report]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    shutil.rmtree(store, ignore_errors=True)
    rc = os.waitstatus_to_exitcode(status)
    ok = rc == 0 and json.loads(Path(report).read_text())["ok"]
    if not ok:
        print(f"  run failed (rc {rc}): {err.strip().splitlines()[-1:] }", file=sys.stderr)
    return {"wall_s": wall, "rss_mib": usage.ru_maxrss / 1024, "ok": ok}


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def compare(trees: dict[str, str], requests: int, repeats: int, work: str) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for i in range(repeats):
        order = list(trees) if i % 2 == 0 else list(trees)[::-1]
        for name in order:
            r = run_once(trees[name], requests, work)
            runs[name].append(r)
            print(f"  {requests} requests, round {i + 1}, {name}: {r['wall_s']:.1f} s, {r['rss_mib']:.0f} MiB"
                  f"{'' if r['ok'] else ' (FAILED)'}", flush=True)
    return runs


def table(requests: int, runs: dict[str, list[dict]]) -> None:
    print(f"\nsimulate --requests {requests} --store DIR (median of {len(next(iter(runs.values())))})")
    print(f"{'':<18}{'wall s':>9}{'ms/request':>12}{'requests/s':>12}{'peak RSS MiB':>14}")
    for name, rs in runs.items():
        wall = median_of(rs, "wall_s")
        print(f"{name:<18}{wall:>9.1f}{wall / requests * 1e3:>12.2f}{requests / wall:>12.1f}"
              f"{median_of(rs, 'rss_mib'):>14.0f}")
    if len(runs) == 2:
        ours, base = (median_of(runs[n], "wall_s") for n in runs)
        print(f"wall time per request: ours / baseline = {ours / base:.2f} (target <= 0.50)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline-rev", default="988768c", help="the revision to compare with (default 988768c)")
    ap.add_argument("--big", type=int, default=0, help="also one run at this many requests (e.g. 20000)")
    ap.add_argument("--big-baseline", type=int, default=1, help="run the baseline at --big too (0: no)")
    args = ap.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory(prefix="bench-simulate-") as tmp:
        os.makedirs(os.path.join(tmp, "baseline"))
        base = baseline_tree(args.baseline_rev, os.path.join(tmp, "baseline"))
        trees = {"ours": str(ROOT), f"baseline {args.baseline_rev}": base}
        table(args.requests, compare(trees, args.requests, args.repeats, tmp))
        if args.big:
            big = trees if args.big_baseline else {"ours": trees["ours"]}
            table(args.big, compare(big, args.big, 1, tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
