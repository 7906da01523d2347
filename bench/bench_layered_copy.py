"""What one chunk copy costs the thread that plans it, at real model depth: the SGLang integration's
``LayeredChunkCopy`` (per-layer device buffers -> page-first host pages) dispatched over small CPU
tensors, so the figure is the Python and dispatch work per chunk, not the bytes.

Cases, interleaved round-robin, medians over ``--repeats`` rounds of ``--chunks`` chunks each:

* ``before``: the op sequence of the previous version (per chunk and buffer: a word view, a slice,
  a slab view, one ``index_select``), frozen here as the baseline;
* ``staged``: today's path without SGLang's kernel (what CUDA runs when ``sgl_kernel`` does not
  import): views built once per pool and staging buffer, one ``index_select`` per buffer;
* ``kernel``: today's path with SGLang's all-layer kernel: everything the plan does (slot check,
  host ids, the call), with the kernel itself a no-op stand-in: its launch (a few microseconds of
  CPU on a GPU node) is not in the figure; ``bench/gpu_check.py`` runs the real one.

A chunk is one page (stride = page, 16 tokens) whose slots are one run, into one host page; slot ids
checked on the device as ``HostOffloader`` asks. One intra-op thread: with more, a loaded 2-core
machine spends milliseconds in OpenMP barriers on copies this small, which says nothing about
dispatch. Target: kernel path <= 0.15 ms per chunk at 80-layer MHA and 61-layer MLA.

Run: .venv/bin/python bench/bench_layered_copy.py [--repeats 15] [--chunks 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from bench.perfkit import machine  # noqa: E402
from lifecycle.integrations.sglang.device_pool import LayeredKVPool  # noqa: E402
from lifecycle.integrations.sglang.layered_copy import KERNEL_FUNCTIONS, LayeredChunkCopy  # noqa: E402
from transfer.gather import Staging, check_on_device, page_runs  # noqa: E402
from transfer.host_pool import HostPool  # noqa: E402

PAGE, DIM, POOL_PAGES = 16, 8, 16
TARGET_MS = 0.15
SHAPES = (("MHA", 80, False), ("MLA", 61, True), ("MHA", 32, False))
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _GrowingStaging:
    """The previous ``Staging``: grown to the largest chunk, no budget."""

    def __init__(self) -> None:
        self.buf = None

    def take(self, rows, width, word):
        nbytes = rows * width * torch.empty((), dtype=word).element_size()
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = torch.empty(nbytes, dtype=torch.uint8)
        return self.buf[:nbytes].view(word).view(rows, width)


class Before:
    """The previous staged plan's op sequence, device -> host (baseline)."""

    def __init__(self, kv, host, slots, host_pages, check_end, staging) -> None:
        self.kv, self.host, self.ps, self.pool = kv, host, host.page_size, staging
        word = _WORD[torch.empty((), dtype=kv.dtype).element_size()]
        self.dev = [[b.view(word) for b in kind] for kind in kv.buffers]
        self.host_words = host.buffer.view(word)
        self.n_pages = host_pages.numel()
        self.index = slots.to(kv.device, dtype=torch.int64, non_blocking=True)
        self.index, self.ok = check_on_device(self.index, self.ps, check_end)
        self.page_ids = self.index.view(-1, self.ps)[:, 0] // self.ps
        self.runs = page_runs(host_pages)

    def to_host(self) -> None:
        kv = self.kv
        shape = (self.n_pages, kv.kinds, self.ps, kv.layers, kv.heads, kv.head_dim)
        rows = self.n_pages * kv.kinds * self.ps * kv.layers
        staging = self.pool.take(rows, kv.heads * kv.head_dim, self.host_words.dtype).view(shape)
        for k, per_layer in enumerate(self.dev):
            for layer, buf in enumerate(per_layer):
                whole = buf.shape[0] // self.ps * self.ps
                pages = buf[:whole].view(-1, self.ps, kv.heads, kv.head_dim)
                torch.index_select(pages, 0, self.page_ids, out=staging[:, k, :, layer])
        for pos, first, length in self.runs:
            self.host_words[first:first + length].copy_(staging[pos:pos + length], non_blocking=True)
        self.staging = staging


NO_OP_KERNEL = types.SimpleNamespace(**{name: (lambda **kwargs: None) for name in KERNEL_FUNCTIONS})


def cases(layers: int, mla: bool):
    heads = 1 if mla else 2
    kv = LayeredKVPool([[torch.randn(POOL_PAGES * PAGE, heads, DIM).to(torch.bfloat16) for _ in range(layers)]
                        for _ in range(1 if mla else 2)], mla=mla)
    host = HostPool(layers, heads, DIM, torch.bfloat16, PAGE, 4 * PAGE, mla=mla, pin=False)
    slots, host_pages, end = torch.arange(5 * PAGE, 6 * PAGE), torch.tensor([2]), kv.slots
    old_staging, staging = _GrowingStaging(), Staging("cpu")
    return {
        "before": lambda: Before(kv, host, slots, host_pages, end, old_staging).to_host(),
        "staged": lambda: LayeredChunkCopy(kv, host, slots, host_pages, end, staging).to_host(),
        "kernel": lambda: LayeredChunkCopy(kv, host, slots, host_pages, end, kernel=NO_OP_KERNEL).to_host(),
    }


def measure(layers: int, mla: bool, repeats: int, chunks: int) -> dict[str, list[float]]:
    """Ms per chunk of each case in every round, the cases interleaved round by round."""
    fns = cases(layers, mla)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rnd in range(1 + repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(chunks):
                fn()
            if rnd:
                times[name].append((time.perf_counter() - t0) / chunks * 1e3)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--chunks", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(machine())
    print(f"one {PAGE}-token chunk (one run of slots, one host page), bf16, small heads; "
          f"ms per chunk, median of {args.repeats} rounds x {args.chunks} chunks")
    print(f"{'shape':14} {'before':>8} {'staged':>8} {'kernel':>8}  kernel <= {TARGET_MS} ms"
          f"   best round: before / staged / kernel")
    for kind, layers, mla in SHAPES:
        t = measure(layers, mla, args.repeats, args.chunks)
        m = {name: statistics.median(v) for name, v in t.items()}
        met = "yes" if m["kernel"] <= TARGET_MS else "NO"
        print(f"{layers:3}-layer {kind:4} {m['before']:8.3f} {m['staged']:8.3f} {m['kernel']:8.3f}  {met:20}"
              f"{min(t['before']):.3f} / {min(t['staged']):.3f} / {min(t['kernel']):.3f}")


if __name__ == "__main__":
    main()
