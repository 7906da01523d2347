"""Shared measurement kit for the benchmarks: interleaved repeated timing, medians, the machine.

Every row compares *our path* with *its baseline* measured in the same process, interleaved
(ours, baseline, ours, baseline, ...) so that load from other processes hits both alike, and
reports medians. No benchmark result is ever asserted in a test.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable

import msgspec


class Row(msgspec.Struct):
    """One figure: ``ours`` and ``baseline`` in ``unit`` (higher is better when ``higher_better``).

    ``ratio`` is ours relative to the baseline as the target states it (throughput ratio, or
    time ratio when lower is better); ``target`` is the bound text, e.g. ">= 0.85".
    """

    name: str
    ours: float
    baseline: float
    unit: str
    ratio: float
    target: str
    met: bool | None
    note: str = ""


def interleaved_times(cases: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Wall seconds of every run of each case, cases run round-robin ``repeats`` times after ``warmup``."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    for rnd in range(warmup + repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if rnd >= warmup:
                times[name].append(dt)
    return times


def interleaved(cases: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median wall seconds of each case (see ``interleaved_times``)."""
    return {k: statistics.median(v) for k, v in interleaved_times(cases, repeats, warmup).items()}


def best_note(ours: list[float], base: list[float]) -> str:
    """"best-of ratio X" from run times: fastest baseline run / fastest run of ours (the speed
    ratio of the best runs, less sensitive than the median to a loaded machine)."""
    return f"best-of ratio {min(base) / min(ours):.2f}"


def machine() -> str:
    """One line describing where the numbers were taken."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{os.cpu_count()} CPUs ({cpu}), {gpu}; Python {platform.python_version()}, "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads); load avg {load:.2f}")


def print_rows(title: str, rows: list[Row]) -> None:
    """Print rows as an aligned table: ours and baseline side by side, ratio, target, met."""
    print(f"\n== {title}")
    print(f"{'row':44} {'ours':>12} {'baseline':>12} {'unit':>10} {'ratio':>6} {'target':>8}  met")
    for r in rows:
        met = "-" if r.met is None else ("yes" if r.met else "NO")
        print(f"{r.name:44} {r.ours:12,.2f} {r.baseline:12,.2f} {r.unit:>10} {r.ratio:6.2f} "
              f"{r.target:>8}  {met}{'  ' + r.note if r.note else ''}")


# --- the engine step benches' shared arithmetic (bench_sglang_step.py, bench_vllm_step.py) ------------


def percentile(values, q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``values``: the smallest value with at
    least ``q`` % of the values at or below it. Raises ValueError for no values or q out of range."""
    if not 0 < q <= 100:
        raise ValueError(f"percentile {q} is not in (0, 100]")
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ratios(ours, theirs) -> list:
    """Run by run, ``ours / theirs``. Raises ValueError for unequal lengths or a denominator that is
    not positive (NaN included)."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} figures but {len(theirs)} to divide by")
    if any(not t > 0 for t in theirs):
        raise ValueError("a non-positive figure has no ratio")
    return [o / t for o, t in zip(ours, theirs)]


def ratio_text(values) -> str:
    """``"1.23x (1.10-1.40)"``: the median of run-by-run ratios and their range; ``"-"`` for none."""
    if not values:
        return "-"
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def schedule(configs: list, rounds: int) -> list[tuple[int, tuple[int, int]]]:
    """The rounds (pairs, triples) in the order they run: ``(round, config)``, every configuration once
    per round index, in reverse order in odd rounds."""
    return [(r, c) for r in range(rounds) for c in (configs if r % 2 == 0 else configs[::-1])]


def parse_configs(text: str, unit: str = "PAGE") -> list[tuple[int, int]]:
    """``"256/16,64/16"`` -> ``[(256, 16), (64, 16)]`` (running requests / ``unit``: page or block size).
    Raises ValueError naming the item that is not ``RUNNING/UNIT`` with both positive."""
    out = []
    for item in text.split(","):
        running, _, size = item.strip().partition("/")
        if not running.isdigit() or not size.isdigit() or int(running) < 1 or int(size) < 1:
            raise ValueError(f"configuration {item!r} is not RUNNING/{unit}")
        out.append((int(running), int(size)))
    return out


def summarize(runs: list[dict], key: str) -> float:
    """The median over runs of one run figure, runs without it (missing or NaN) left out; NaN if none."""
    values = [v for v in (r.get(key, float("nan")) for r in runs) if v == v]
    return statistics.median(values) if values else float("nan")


def fmt(value: float, width: int = 9) -> str:
    """``value`` to one decimal in ``width`` columns; ``-`` for NaN (no such figure)."""
    return f"{'-':>{width}}" if value != value else f"{value:{width}.1f}"


def clock_overhead_ns(samples: int = 2001) -> int:
    """The median cost of one timed section with nothing in it (two ``thread_time_ns`` reads)."""
    clock = time.thread_time_ns
    deltas = []
    for _ in range(samples):
        a = clock()
        deltas.append(clock() - a)
    return int(statistics.median(deltas))


def load_line() -> str:
    """The load averages, to say how loaded the machine was."""
    load = os.getloadavg()
    return f"load avg {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min) on {os.cpu_count()} CPUs"



def finish(report, results: dict, rounds: int, json_path: str | None) -> None:
    """The end of a paired step bench (``bench_sglang_step``, ``bench_vllm_step``): ``report(results,
    rounds)``, the load line, and, when asked, every run's figures as JSON keyed ``RUNNING/SIZE``."""
    report(results, rounds)
    print(f"{load_line()} at end")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({f"{n}/{p}": v for (n, p), v in results.items()}, f, indent=1)
