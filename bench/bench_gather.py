"""Chunk gather (paged device pool -> host pages, page-first) vs a same-size contiguous copy_.

Both sides read memory that is cold in cache: the gather reads a rotating random set of device
pages from a large pool; the baseline copies a rotating slice of an equally large contiguous
buffer into the same destination. On CUDA (when present) the baseline is a pinned D2H copy_.
Run: .venv/bin/python bench/bench_gather.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from transfer import HostPool, KVPool
from transfer.gather import ChunkCopy

LAYERS, HEADS, DIM, DTYPE = 32, 8, 128, torch.bfloat16
CHUNK_TOKENS = 256
POOL_TOKENS = 4096
ROUNDS = 16


def timeit(fn, reps, sync=lambda: None):
    for i in range(3):
        fn(i)
    sync()
    t = time.perf_counter()
    for i in range(reps):
        fn(i % ROUNDS)
    sync()
    return (time.perf_counter() - t) / reps


def run(device: str, page_size: int) -> tuple[float, float]:
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
    reps = 40
    base = timeit(lambda i: dst.copy_(src[i], non_blocking=True), reps, sync)
    gather = timeit(lambda i: plans[i].to_host(), reps, sync)
    return nbytes / base / 1e9, nbytes / gather / 1e9


def main() -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"chunk = {CHUNK_TOKENS} tokens x {LAYERS} layers x K,V x {HEADS}x{DIM} {DTYPE}; "
          f"torch threads = {torch.get_num_threads()}")
    print(f"{'device':6} {'page':>4} {'contig copy_ GB/s':>18} {'gather GB/s':>12} {'ratio':>6}")
    for device in devices:
        for ps in (16, 32, 64):
            base, gather = run(device, ps)
            print(f"{device:6} {ps:>4} {base:>18.2f} {gather:>12.2f} {gather / base:>6.2f}")


if __name__ == "__main__":
    main()
