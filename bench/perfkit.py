"""Shared measurement kit for the benchmarks: interleaved repeated timing, medians, the machine.

Every row compares *our path* with *its baseline* measured in the same process, interleaved
(ours, baseline, ours, baseline, ...) so that load from other processes hits both alike, and
reports medians. No benchmark result is ever asserted in a test.
"""

from __future__ import annotations

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
