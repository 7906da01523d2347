"""hashing.page_hashes pages/s vs raw hashlib.sha256 over the same bytes (one digest per page).

Run: .venv/bin/python bench/bench_hashing.py
"""

from __future__ import annotations

import hashlib
import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import hashing  # noqa: E402

TOKENS = 1 << 16


def best(fn, reps=5):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    tokens = [(i * 2654435761) % 150_000 for i in range(TOKENS)]
    raw = array("I", tokens).tobytes()
    print(f"{TOKENS} tokens; best of 5")
    print(f"{'page':>4} {'raw hashlib pages/s':>20} {'page_hashes pages/s':>20} {'ratio':>6}")
    for ps in (16, 32, 64):
        pages = TOKENS // ps
        step = 4 * ps
        mv = memoryview(raw)

        def baseline():
            for off in range(0, pages * step, step):
                hashlib.sha256(mv[off:off + step]).digest()

        t_raw = best(baseline)
        t_chain = best(lambda: hashing.page_hashes(tokens, ps))
        print(f"{ps:>4} {pages / t_raw:>20,.0f} {pages / t_chain:>20,.0f} {t_raw / t_chain:>6.2f}")


if __name__ == "__main__":
    main()
