"""Every performance figure of issue 14 in one run: ours next to its baseline, machine described.

Rows and where they come from (each bench interleaves ours with its baseline, repeats, and
prints medians side by side):

* page hashing vs raw sha256            ``bench/bench_hashing.py``   (in process, ``rows()``)
* CPU chunk gather vs contiguous copy_  ``bench/bench_gather.py``    (in process, ``rows()``)
* offloader enqueue on the scheduler    ``bench/bench_enqueue.py``   (in process, ``rows()``)
* manager bookkeeping vs plain dict     ``bench/bench_manager.py``   (own process)
* Redis store vs plain pipeline         ``bench/bench_redis.py``     (own process)
* ``kv-lifecycle simulate`` end to end  ``bench/bench_simulate.py``  (own process)

A bench that exposes ``rows(...) -> list[bench.perfkit.Row]`` runs in this process and joins the
summary table; the others run as their own command (with their own defaults unless ``--quick``)
and their tables are printed as they come. One command:

    .venv/bin/python bench/perf.py            # everything, default repeats (several minutes)
    .venv/bin/python bench/perf.py --quick    # fewer repeats, smaller simulate run
    .venv/bin/python bench/perf.py --only hashing,gather,enqueue
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

from bench import bench_enqueue, bench_gather, bench_hashing  # noqa: E402
from bench.perfkit import Row, machine, print_rows  # noqa: E402

#: in-process rows: name -> (title, full-run call, quick-run call)
IN_PROCESS = {
    "hashing": ("page hashing vs raw sha256 (65,536 tokens)",
                lambda: bench_hashing.rows(21), lambda: bench_hashing.rows(7)),
    "gather": ("CPU chunk gather vs contiguous copy_ (33.6 MB chunk)",
               lambda: bench_gather.rows(40), lambda: bench_gather.rows(12)),
    "enqueue": ("offloader enqueue on the scheduler thread",
                lambda: bench_enqueue.rows(5), lambda: bench_enqueue.rows(3, steps=20)),
}

#: own-process benches: name -> (full-run args, quick-run args, time limit s)
COMMANDS = {
    "manager": (["bench/bench_manager.py"], ["bench/bench_manager.py", "--repeats", "3"], 900),
    "redis": (["bench/bench_redis.py"], ["bench/bench_redis.py", "--reps", "2"], 900),
    "simulate": (["bench/bench_simulate.py"],
                 ["bench/bench_simulate.py", "--requests", "200", "--repeats", "1"], 1800),
}


def run_command(name: str, args: list[str], limit: float) -> bool:
    """Run one bench as its own process, its output streamed here. True when it exited 0."""
    print(f"\n== {name}: {' '.join([Path(sys.executable).name, *args])}", flush=True)
    t0 = time.monotonic()
    try:
        rc = subprocess.run([sys.executable, *args], cwd=ROOT, timeout=limit).returncode
    except subprocess.TimeoutExpired:
        print(f"!! {name}: no result within {limit:.0f}s", flush=True)
        return False
    print(f"-- {name}: exit {rc} after {time.monotonic() - t0:.0f}s", flush=True)
    return rc == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats everywhere")
    ap.add_argument("--only", default="", help=f"comma-separated subset of {','.join([*IN_PROCESS, *COMMANDS])}")
    args = ap.parse_args()
    wanted = [w for w in args.only.split(",") if w] or [*IN_PROCESS, *COMMANDS]
    unknown = set(wanted) - set(IN_PROCESS) - set(COMMANDS)
    if unknown:
        ap.error(f"unknown rows: {', '.join(sorted(unknown))}")
    print(machine())
    summary: list[tuple[str, list[Row]]] = []
    failed = []
    for name in wanted:
        if name in IN_PROCESS:
            title, full, quick = IN_PROCESS[name]
            rows = (quick if args.quick else full)()
            print_rows(title, rows)
            summary.append((title, rows))
        else:
            full, quick, limit = COMMANDS[name]
            if not run_command(name, quick if args.quick else full, limit):
                failed.append(name)
    if summary:
        print("\n==== summary (in-process rows; the other benches' tables are above)")
        print(machine())
        for title, rows in summary:
            print_rows(title, rows)
    if failed:
        print(f"\nbenches that did not finish: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
