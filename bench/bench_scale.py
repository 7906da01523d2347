"""Manager bookkeeping cost per request-step at 100, 1k and 10k live requests (must stay flat),
and bookkeeping memory per live request.

    .venv/bin/python bench/bench_scale.py [--steps 48] [--repeats 3]

Same doubles as bench_manager.py (copies land by the next check); page 16; 128-token prompts.
Time counted: every ``offload_kv_cache`` call and every ``check_offload_progress`` of the decode
steps (first sight and finish excluded), divided by requests x steps, in this thread's CPU time
(``time.thread_time``: on a machine shared with busy processes wall time counts their turns too).
Logging filtered (WARNING).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_manager import Allocator, Offloader, Pool, Req  # noqa: E402 (configures structlog)
from lifecycle import DecodeOffloadManager  # noqa: E402


def run(n: int, steps: int, page: int = 16, prompt: int = 128) -> tuple[float, float, float]:
    pool, alloc, off = Pool(n, prompt + steps + page), Allocator(), Offloader()
    mgr = DecodeOffloadManager(pool, alloc, page_size=page, offloader=off)
    reqs = [Req(f"r{i}", list(range(i, i + prompt)), i) for i in range(n)]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for r in reqs:
        mgr.offload_kv_cache(r)
    per_req = (tracemalloc.get_traced_memory()[0] - base) / n
    tracemalloc.stop()
    clock = time.thread_time
    spent = 0.0
    gc_pause = 0.0
    for step in range(steps):
        for r in reqs:
            r.output_ids.append(step)
            r.kv.kv_committed_len += 1
            r.kv.kv_allocated_len += 1
        t0 = clock()
        for r in reqs:
            mgr.offload_kv_cache(r)
        mgr.check_offload_progress()
        spent += clock() - t0
    t0 = clock()
    gc.collect()
    gc_pause = clock() - t0
    for r in reqs:
        r._done = True
        if not mgr.offload_kv_cache(r):
            mgr.finalize_release_on_finish(r)
    for _ in range(3):
        mgr.check_offload_progress()
    assert mgr.stats().released == n and mgr.stats().leaked == 0
    return spent / (n * steps) * 1e6, per_req, gc_pause * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"{'live requests':>13} {'us/request-step':>16} {'bytes/request':>14} {'full gc ms':>11}")
    for n in (100, 1_000, 10_000):
        runs = [run(n, args.steps) for _ in range(args.repeats)]
        us = statistics.median(r[0] for r in runs)
        print(f"{n:>13} {us:>16.3f} {runs[0][1]:>14.0f} {statistics.median(r[2] for r in runs):>11.1f}")


if __name__ == "__main__":
    main()
