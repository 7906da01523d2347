"""Chunk gather (paged device pool -> host pages, page-first) vs a same-size contiguous copy_.

Both sides read memory that is cold in cache: the gather reads a rotating random set of device
pages from a large pool; the baseline copies a rotating slice of an equally large contiguous
buffer into the same destination. Ours and the baseline alternate (interleaved), medians
reported. On CUDA (when present) the baseline is a pinned D2H copy_.

Run: .venv/bin/python bench/bench_gather.py [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from bench.perfkit import Row, best_note, machine, print_rows  # noqa: E402
from transfer import HostPool, KVPool  # noqa: E402
from transfer.gather import ChunkCopy  # noqa: E402

LAYERS, HEADS, DIM, DTYPE = 32, 8, 128, torch.bfloat16
CHUNK_TOKENS = 256
POOL_TOKENS = 4096
ROUNDS = 16
TARGET = 0.90


def _interleaved_pair(ours, base, repeats: int, sync) -> tuple[list[float], list[float]]:
    """Seconds of every run of ``ours(i)`` and ``base(i)``, alternating, after 3 warm-up pairs."""
    t_ours, t_base = [], []
    for i in range(3 + repeats):
        for fn, acc in ((ours, t_ours), (base, t_base)):
            sync()
            t0 = time.perf_counter()
            fn(i % ROUNDS)
            sync()
            if i >= 3:
                acc.append(time.perf_counter() - t0)
    return t_ours, t_base


def run(device: str, page_size: int, repeats: int) -> tuple[list[float], list[float], int]:
    """Seconds of every gather run and every contiguous-copy run, and the bytes each moves."""
    kv = KVPool(LAYERS, HEADS, DIM, DTYPE, POOL_TOKENS, device=device)
    kv.buffer.fill_(1.0)
    host = HostPool(LAYERS, HEADS, DIM, DTYPE, page_size, CHUNK_TOKENS)
    pages = CHUNK_TOKENS // page_size
    host_pages = torch.arange(pages)
    g = torch.Generator().manual_seed(0)
    plans = []
    for _ in range(ROUNDS):
        dev_pages = torch.randperm(POOL_TOKENS // page_size - 1, generator=g)[:pages] + 1
        slots = (dev_pages.view(-1, 1) * page_size + torch.arange(page_size)).reshape(-1)
        plans.append(ChunkCopy(kv, host, slots, host_pages))
    nbytes = host.buffer.numel() * host.buffer.element_size()
    src = torch.ones((ROUNDS, host.buffer.numel()), dtype=DTYPE, device=device)
    dst = host.buffer.view(-1)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ours, base = _interleaved_pair(lambda i: plans[i].to_host(),
                                   lambda i: dst.copy_(src[i], non_blocking=True), repeats, sync)
    return ours, base, nbytes


def rows(repeats: int = 40) -> list[Row]:
    """One row per (device, page size): gather GB/s vs contiguous copy_ GB/s."""
    out = []
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        for ps in (16, 32, 64):
            t_ours, t_base, nbytes = run(device, ps, repeats)
            ours, base = nbytes / statistics.median(t_ours) / 1e9, nbytes / statistics.median(t_base) / 1e9
            ratio = ours / base
            out.append(Row(f"{device} gather to host pages, page {ps}", ours, base, "GB/s", ratio,
                           f">= {TARGET}", ratio >= TARGET, best_note(t_ours, t_base)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    print(machine())
    print(f"chunk = {CHUNK_TOKENS} tokens x {LAYERS} layers x K,V x {HEADS}x{DIM} {DTYPE} "
          f"({CHUNK_TOKENS * LAYERS * 2 * HEADS * DIM * 2 / 1e6:.1f} MB); median of {args.repeats} interleaved runs")
    print_rows("chunk gather vs contiguous copy_", rows(args.repeats))


if __name__ == "__main__":
    main()
