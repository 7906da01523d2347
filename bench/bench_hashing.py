"""``hashing.page_hashes`` vs raw ``hashlib.sha256`` over the same pre-packed bytes.

Rows per page size (16/32/64), one digest per page, 65,536 token ids:

* ours (list): ``page_hashes(tokens)`` with ``tokens`` a Python list, as the manager calls it;
  it packs the list itself (``array("I", ...)``), chains and returns hex names.
* ours (array): ``page_hashes(packed)`` with ``packed`` an ``array("I")``: the same bytes the
  baseline gets, so only the chaining and hex naming differ.
* baseline: ``hashlib.sha256(page).digest()`` of each page of the pre-packed bytes (no chain,
  no hex): the issue's baseline.
* pack + baseline: ``array("I", tokens)`` then the baseline, the least work any list input needs.

Interleaved, repeated, medians. Run: .venv/bin/python bench/bench_hashing.py [--repeats N]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import hashing  # noqa: E402
from bench.perfkit import Row, best_note, interleaved_times, machine, print_rows  # noqa: E402

TOKENS = 1 << 16
TARGET = 0.85


def _raw(data: memoryview, step: int):
    sha256 = hashlib.sha256

    def run() -> None:
        for off in range(0, len(data), step):
            sha256(data[off:off + step]).digest()
    return run


def rows(repeats: int = 21) -> list[Row]:
    """The hashing rows: ours (list and packed input) vs raw hashlib, per page size."""
    tokens = [(i * 2654435761) % 150_000 for i in range(TOKENS)]
    packed = array("I", tokens)
    data = memoryview(packed).cast("B")
    out = []
    for ps in (16, 32, 64):
        raw = _raw(data, 4 * ps)
        times = interleaved_times({
            "list": lambda: hashing.page_hashes(tokens, ps),
            "array": lambda: hashing.page_hashes(packed, ps),
            "raw": raw,
            "pack+raw": lambda: (array("I").fromlist(tokens), raw()),
        }, repeats)
        pages = TOKENS // ps
        rate = {k: pages / statistics.median(v) / 1e6 for k, v in times.items()}
        for what in ("list", "array"):
            ratio = rate[what] / rate["raw"]
            out.append(Row(f"page_hashes ({what}) vs raw sha256, page {ps}", rate[what], rate["raw"],
                           "Mpages/s", ratio, f">= {TARGET}", ratio >= TARGET,
                           best_note(times[what], times["raw"])))
        ratio = rate["list"] / rate["pack+raw"]
        out.append(Row(f"page_hashes (list) vs pack + raw, page {ps}", rate["list"], rate["pack+raw"],
                       "Mpages/s", ratio, "-", None, "info: least work for list input"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    print(machine())
    print(f"{TOKENS} tokens; median of {args.repeats} interleaved runs")
    print_rows("page hashing", rows(args.repeats))


if __name__ == "__main__":
    main()
