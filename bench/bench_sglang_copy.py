"""Device -> host chunk copy from SGLang's per-layer buffers, read in place (the SGLang integration's
``LayeredChunkCopy``), vs the same copy from our single-tensor ``KVPool`` (``transfer.gather``).

Same shape, dtype, chunk and host pages on both sides; the device pages of each round are a
rotating random set from a large pool (cold in cache). Ours and the baseline alternate
(interleaved), medians reported. CPU only here (on CUDA both run on the current stream).

Run: .venv/bin/python bench/bench_sglang_copy.py [--repeats N]
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
from lifecycle.integrations.sglang.device_pool import LayeredKVPool  # noqa: E402
from lifecycle.integrations.sglang.layered_copy import LayeredChunkCopy  # noqa: E402
from transfer import HostPool, KVPool  # noqa: E402
from transfer.gather import ChunkCopy  # noqa: E402

LAYERS, HEADS, DIM, DTYPE = 32, 8, 128, torch.bfloat16
CHUNK_TOKENS, POOL_TOKENS, ROUNDS = 256, 4096, 8


def run(page_size: int, repeats: int) -> tuple[list[float], list[float], int]:
    """Seconds of every layered copy and every single-tensor copy, and the bytes each moves."""
    ours_kv = LayeredKVPool([[torch.randn(POOL_TOKENS, HEADS, DIM).to(DTYPE) for _ in range(LAYERS)]
                             for _ in range(2)], mla=False)
    base_kv = KVPool(LAYERS, HEADS, DIM, DTYPE, POOL_TOKENS)
    host = HostPool(LAYERS, HEADS, DIM, DTYPE, page_size, CHUNK_TOKENS, pin=False)
    pages = CHUNK_TOKENS // page_size
    gen = torch.Generator().manual_seed(0)
    plans = []
    for _ in range(ROUNDS):
        dev_pages = torch.randperm(POOL_TOKENS // page_size, generator=gen)[:pages]
        slots = (dev_pages.view(-1, 1) * page_size + torch.arange(page_size)).reshape(-1)
        host_pages = torch.arange(pages)
        plans.append((LayeredChunkCopy(ours_kv, host, slots, host_pages), ChunkCopy(base_kv, host, slots, host_pages)))
    t_ours, t_base = [], []
    for i in range(2 + repeats):
        ours, base = plans[i % ROUNDS]
        for plan, acc in ((ours, t_ours), (base, t_base)):
            t0 = time.perf_counter()
            plan.to_host()
            if i >= 2:
                acc.append(time.perf_counter() - t0)
    return t_ours, t_base, host.page_nbytes * pages


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args()
    print(machine())
    print(f"shape: {LAYERS} layers x {HEADS} heads x {DIM} dim, {DTYPE}, MHA, {CHUNK_TOKENS}-token chunk")
    rows = []
    for ps in (16, 64):
        ours, base, nbytes = run(ps, args.repeats)
        mo, mb = statistics.median(ours), statistics.median(base)
        rows.append(Row(f"layered copy, page {ps} (GB/s)", nbytes / mo / 1e9, nbytes / mb / 1e9, "GB/s",
                        mb / mo, "report", None, best_note(ours, base)))
    print_rows("SGLang per-layer buffers (ours) vs one KVPool tensor (baseline)", rows)


if __name__ == "__main__":
    main()
