"""FileStorage write throughput vs a raw sequential write of the same bytes, same run, same disk.

The store writes one file per page (temp file + os.replace, no fsync); the baseline writes the same
bytes to one file with one write per page, no fsync. Both run into fresh directories on the same
filesystem. Run: .venv/bin/python bench/bench_file_store.py [DIR]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from transfer import FileStorage  # noqa: E402

PAGE_BYTES = 32 * 2 * 16 * 8 * 128 * 2  # 32 layers, K+V, 16 tokens, 8 heads x 128, bf16 = 2 MiB
PAGES = 256


def raw_write(path: str, pages: list[torch.Tensor]) -> float:
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for p in pages:
            f.write(p.numpy().data)
    return time.perf_counter() - t


def store_write(directory: str, pages: list[torch.Tensor]) -> float:
    store = FileStorage(directory, "_bench_0_1", PAGE_BYTES)
    keys = [f"{i:064x}" for i in range(len(pages))]
    t = time.perf_counter()
    ok = store.batch_set(keys, pages)
    elapsed = time.perf_counter() - t
    assert all(ok)
    return elapsed


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.gettempdir()
    pages = [torch.randint(0, 256, (PAGE_BYTES,), dtype=torch.uint8) for _ in range(PAGES)]
    total = PAGE_BYTES * PAGES
    print(f"{PAGES} pages x {PAGE_BYTES / 2**20:.0f} MiB = {total / 2**30:.2f} GiB under {root}")
    print(f"{'round':>5} {'raw sequential GB/s':>20} {'file store GB/s':>16} {'ratio':>6}")
    for rnd in range(4):  # round 0 warms the page cache and allocator and is not printed
        work = tempfile.mkdtemp(dir=root, prefix="kvbench-")
        try:
            raw = raw_write(os.path.join(work, "raw.bin"), pages)
            os.unlink(os.path.join(work, "raw.bin"))
            st = store_write(os.path.join(work, "store"), pages)
        finally:
            shutil.rmtree(work)
        if rnd:
            print(f"{rnd:>5} {total / raw / 1e9:>20.2f} {total / st / 1e9:>16.2f} {raw / st:>6.2f}")


if __name__ == "__main__":
    main()
