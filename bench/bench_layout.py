"""What storing pages in another SGLang host layout costs: the reorder of one page
(``transfer.storage.layout.PageOrder``) per layout, and a file-tier batch write + read through
``LayoutStorage`` against the same tier in ``page_first`` (no reorder).

Llama-3.1-8B-like pages per TP rank (16 tokens, 32 layers, 8 KV heads, head_dim 128, bf16: 2 MiB),
single thread. Per case, rounds are interleaved over layouts and the median round is printed.
Run: .venv/bin/python bench/bench_layout.py [--rounds 5] [--pages 32] [--dir /dev/shm/...]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from transfer.host_pool import HostPool  # noqa: E402
from transfer.stack import page_format  # noqa: E402
from transfer.storage.identity import LAYOUTS, DeploymentIdentity  # noqa: E402
from transfer.storage.layout import PageOrder  # noqa: E402
from transfer.storage.spec import open_storage  # noqa: E402

LAYERS, HEADS, DIM, PS = 32, 8, 128, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--dir", default=None, help="parent of the file tier's directory (default: a tmpfs if any)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    host = HostPool(LAYERS, HEADS, DIM, torch.bfloat16, PS, args.pages * PS, pin=False)
    host.buffer.view(-1).view(torch.int16).random_()
    fmt = page_format(host)
    nb = host.page_nbytes
    out = torch.empty(nb, dtype=torch.uint8)
    reorder = {layout: [] for layout in LAYOUTS}
    for _ in range(args.rounds):
        for layout in LAYOUTS:
            order = PageOrder(layout, fmt.shape, 2)
            t = time.perf_counter()
            for p in range(args.pages):
                order.to_layout(host.page_bytes(p), out)
            reorder[layout].append((time.perf_counter() - t) / args.pages)
    print(f"page {nb >> 20} MiB; reorder to the layout, per page (median of {args.rounds}):")
    for layout, times in reorder.items():
        med = statistics.median(times)
        print(f"  {layout:18s} {med * 1e6:8.0f} us  {nb / med / 1e9:6.2f} GB/s")
    parent = args.dir or ("/dev/shm" if Path("/dev/shm").is_dir() else None)
    root = Path(tempfile.mkdtemp(prefix="kv-bench-layout-", dir=parent))
    keys = [f"{i:064x}" for i in range(args.pages)]
    pages = [host.page_bytes(p) for p in range(args.pages)]
    into = [torch.empty(nb, dtype=torch.uint8) for _ in range(args.pages)]
    io = {layout: ([], []) for layout in LAYOUTS}
    try:
        for r in range(args.rounds):
            for layout in LAYOUTS:
                d = root / f"{layout}-{r}"
                store = open_storage(f"file:{d}", page_nbytes=nb, page_format=fmt,
                                     identity=DeploymentIdentity(model_name="bench", layout=layout))
                t = time.perf_counter()
                assert all(store.batch_set(keys, pages))
                t1 = time.perf_counter()
                assert all(store.batch_get(keys, into))
                t2 = time.perf_counter()
                store.close()
                shutil.rmtree(d)
                io[layout][0].append(t1 - t)
                io[layout][1].append(t2 - t1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total = nb * args.pages
    print(f"file tier under {parent or 'the default temp dir'}, {args.pages} pages per batch (median MB/s):")
    for layout, (w, g) in io.items():
        print(f"  {layout:18s} write {total / statistics.median(w) / 1e6:7.0f}  read {total / statistics.median(g) / 1e6:7.0f}")


if __name__ == "__main__":
    main()
