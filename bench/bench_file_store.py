"""FileStorage write throughput vs a raw sequential write of the same bytes, same run, same disk.

The store writes one file per page (temp file + os.replace, no fsync), by default with the page's
seal (XXH3-128 over name, format and bytes) in an extended attribute; the baseline writes the same
bytes to one file with one write per page, no fsync. Each writer starts after an ``os.sync()`` (not timed) and the order rotates
each round, so page-cache writeback left by one writer does not throttle the next.
All run into fresh directories on the same filesystem, interleaved, and the median round is kept.
Columns: the store with seals (the default) and without (``checksum=False``).
Run: .venv/bin/python bench/bench_file_store.py [DIR] [ROUNDS]
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


def store_write(directory: str, pages: list[torch.Tensor], checksum: bool = True) -> float:
    store = FileStorage(directory, "_bench_0_1", PAGE_BYTES, checksum=checksum)
    keys = [f"{i:064x}" for i in range(len(pages))]
    t = time.perf_counter()
    ok = store.batch_set(keys, pages)
    elapsed = time.perf_counter() - t
    assert all(ok)
    return elapsed


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.gettempdir()
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    pages = [torch.randint(0, 256, (PAGE_BYTES,), dtype=torch.uint8) for _ in range(PAGES)]
    total = PAGE_BYTES * PAGES
    print(f"{PAGES} pages x {PAGE_BYTES / 2**20:.0f} MiB = {total / 2**30:.2f} GiB under {root}")
    print(f"{'round':>5} {'raw GB/s':>9} {'store+sum GB/s':>15} {'ratio':>6} {'store no-sum GB/s':>18} {'ratio':>6}")
    rows = []
    for rnd in range(rounds + 1):  # round 0 warms the page cache and allocator and is not kept
        work = tempfile.mkdtemp(dir=root, prefix="kvbench-")
        runs = {
            "raw": lambda: raw_write(os.path.join(work, "raw.bin"), pages),
            "crc": lambda: store_write(os.path.join(work, "crc"), pages, checksum=True),
            "plain": lambda: store_write(os.path.join(work, "plain"), pages, checksum=False),
        }
        order = list(runs)[rnd % 3:] + list(runs)[: rnd % 3]  # rotate who goes first
        took = {}
        try:
            for name in order:
                os.sync()  # start each writer with no dirty pages left by the previous one
                took[name] = runs[name]()
                for entry in os.listdir(work):  # and with only its own bytes on disk
                    path = os.path.join(work, entry)
                    shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
        finally:
            shutil.rmtree(work)
            os.sync()
        raw, crc, plain = took["raw"], took["crc"], took["plain"]
        if rnd:
            rows.append((raw / crc, raw / plain, raw, crc, plain))
            print(f"{rnd:>5} {total / raw / 1e9:>9.2f} {total / crc / 1e9:>15.2f} {raw / crc:>6.2f}"
                  f" {total / plain / 1e9:>18.2f} {raw / plain:>6.2f}")
    rows.sort()
    med = rows[len(rows) // 2]
    print(f"median ratio: store+checksum {med[0]:.2f}, store no-checksum {sorted(r[1] for r in rows)[len(rows) // 2]:.2f}")


if __name__ == "__main__":
    main()
