"""Page checksum candidates, same random pages, same run: XXH3-128 (the one the stores use, via
``xxhash``), XXH3-64, CRC32C (``crc32c`` and ``google-crc32c`` when installed), zlib.crc32, and
the weighted 64-bit word sum the stores used before (kept here only as the baseline).

Single thread; per size, each candidate hashes the same page ``reps`` times per round, rounds are
interleaved over candidates, and the median round is printed (GB/s = 1e9 bytes/s). Rounds are
timed in this thread's CPU time (``time.thread_time``), not wall time: on a machine shared with
other busy processes wall time mostly measures their turns (the GB/s swung 5x between runs).
Run: .venv/bin/python bench/bench_checksum.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

SIZES = [4 << 10, 64 << 10, 1 << 20, 8 << 20]
ROUNDS = 5


_WEIGHTS: dict[int, np.ndarray] = {}


def weighted_sum(data) -> int:
    """The replaced checksum: sum(word[i] * (2i + 1)) mod 2**64 (misses two bit-63 flips); its
    weights cached per size, as the old implementation did."""
    view = memoryview(data).cast("B")
    n = view.nbytes // 8
    w = _WEIGHTS.get(n)
    if w is None:
        w = _WEIGHTS[n] = np.arange(n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    words = np.frombuffer(view[: n * 8], dtype="<u8")
    return int(np.dot(words, w)) if n else 0


def candidates() -> dict:
    out = {"xxh3_128": xxhash.xxh3_128_intdigest, "xxh3_64": xxhash.xxh3_64_intdigest}
    try:
        import crc32c
        out["crc32c"] = crc32c.crc32c
    except ImportError:
        pass
    try:
        import google_crc32c
        out["google_crc32c"] = google_crc32c.value
    except ImportError:
        pass
    out["zlib.crc32"] = zlib.crc32
    out["weighted_sum"] = weighted_sum
    return out


def main() -> None:
    fns = candidates()
    print(f"{'page':>8} " + " ".join(f"{name:>14}" for name in fns) + "   (GB/s of thread CPU time, median "
          f"of {ROUNDS} interleaved rounds)")
    for size in SIZES:
        data = os.urandom(size)
        reps = max(3, (64 << 20) // size)
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(ROUNDS):
            for name, fn in fns.items():
                t = time.thread_time()
                for _ in range(reps):
                    fn(data)
                times[name].append(time.thread_time() - t)
        row = [size * reps / statistics.median(times[name]) / 1e9 for name in fns]
        print(f"{size >> 10:>6}Ki " + " ".join(f"{v:>14.2f}" for v in row))


if __name__ == "__main__":
    main()
