"""Offloader enqueue cost on the scheduler thread: ``HostOffloader.write`` + its share of polling.

Workload (per step, as a decode scheduler drives it): ``--batch`` chunks are written (``write``),
then one ``finished_writes`` poll reports what has landed, and the host pages of landed chunks are
returned (``free_host``). Between steps the thread sleeps ``--gap-ms`` (the model's forward pass;
not timed), so the copy workers run while the scheduler is away, as on a GPU node. Only time
spent inside the offloader's calls on the calling thread is counted.

The KV shape is deliberately tiny (2 layers x 1 head x 8 fp16): the copies themselves are measured
by ``bench_gather.py``; here they must not compete with the scheduler thread for the 2 cores.

Baseline: the floor of handing work to a thread at all: per chunk one ``BackgroundWorker.submit``
of a no-op job, one dict insert, and the same once-per-step poll (what any offloader that copies
off the scheduler thread must do).

Run: .venv/bin/python bench/bench_enqueue.py [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from bench.perfkit import Row, machine, print_rows  # noqa: E402
from transfer import CpuCopyEngine, HostOffloader, HostPool, KVPool, MemoryStorage  # noqa: E402
from transfer.worker import BackgroundWorker  # noqa: E402

PAGE = 16
TARGET_US = 10.0


class _Clocks:
    """Wall time and this thread's CPU time spent inside timed sections."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def __enter__(self) -> "_Clocks":
        self._w, self._c = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall += time.perf_counter() - self._w
        self.cpu += time.thread_time() - self._c


def offloader_run(steps: int, batch: int, chunk_pages: int, gap_s: float) -> tuple[_Clocks, _Clocks]:
    """Time inside (write + finished_writes) and inside free_host, over ``steps * batch`` chunks."""
    slots = (batch * chunk_pages + 1) * PAGE
    kv = KVPool(2, 1, 8, torch.float16, slots)
    host = HostPool(2, 1, 8, torch.float16, PAGE, 16 * batch * chunk_pages * PAGE, pin=False)
    off = HostOffloader(kv, host, MemoryStorage("_b_0_1", host.page_nbytes), copy_engine=CpuCopyEngine(2))
    chunk = chunk_pages * PAGE
    indices = [torch.arange(PAGE + i * chunk, PAGE + (i + 1) * chunk) for i in range(batch)]
    hosts: dict[int, torch.Tensor] = {}
    enq, free = _Clocks(), _Clocks()
    ack = rejected = 0
    for _ in range(steps):
        got = []
        with enq:
            for i in range(batch):
                got.append(off.write(indices[i], ack + i))
        hosts.update((a, h) for a, h in zip(range(ack, ack + batch), got) if h is not None)
        rejected += sum(h is None for h in got)
        ack += batch
        time.sleep(gap_s)
        with enq:
            landed = off.finished_writes().landed
        with free:
            for done in landed:
                off.free_host(hosts.pop(done))
    while hosts:  # settle the tail (not timed)
        for done in off.finished_writes().landed:
            off.free_host(hosts.pop(done))
        time.sleep(0.001)
    off.close()
    if rejected:
        print(f"note: {rejected} writes found the host pool full (copies lagging behind)", file=sys.stderr)
    return enq, free


def floor_run(steps: int, batch: int, gap_s: float) -> _Clocks:
    """The bare hand-off: submit a no-op job and remember it, poll once a step."""
    worker = BackgroundWorker("floor", 2)
    pending: dict[int, None] = {}
    t = _Clocks()
    ack = 0
    noop = lambda: None  # noqa: E731
    for _ in range(steps):
        with t:
            for _ in range(batch):
                ack += 1
                pending[ack] = None
                worker.submit(ack, noop)
        time.sleep(gap_s)
        with t:
            for done in worker.poll():
                pending.pop(done.tag)
    worker.close()
    return t


def rows(repeats: int = 5, steps: int = 60, batch: int = 64, gap_ms: float = 5.0) -> list[Row]:
    """Per chunk size (1 page: a decode stride; 32 pages: a 512-token prefill), median of repeats.

    Two figures each: wall time (what the scheduler thread waits, including preemption by other
    processes on a shared machine) and the thread's CPU time (the work itself).
    """
    out = []
    n = steps * batch
    med = statistics.median
    for pages in (1, 32):
        runs = []
        for _ in range(repeats):  # interleaved: ours, floor, ours, floor ...
            enq, free = offloader_run(steps, batch, pages, gap_ms / 1e3)
            runs.append((enq, free, floor_run(steps, batch, gap_ms / 1e3)))
        for kind in ("cpu", "wall"):
            e = med(getattr(r[0], kind) for r in runs) / n * 1e6
            f = med(getattr(r[1], kind) for r in runs) / n * 1e6
            b = med(getattr(r[2], kind) for r in runs) / n * 1e6
            out.append(Row(f"write + poll share, {pages} page(s), {kind}", e, b, "us/chunk", e / b,
                           f"<= {TARGET_US:g}us", e <= TARGET_US, "baseline: bare thread hand-off"))
            out.append(Row(f"free_host, {pages} page(s), {kind}", f, b, "us/chunk", f / b, "-", None,
                           "info: returning the host pages"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--gap-ms", type=float, default=5.0)
    args = ap.parse_args()
    print(machine())
    print(f"page {PAGE}; {args.batch} chunks a step, {args.steps} steps, one poll a step; "
          f"median of {args.repeats} interleaved runs")
    print_rows("offloader enqueue (scheduler thread)", rows(args.repeats, args.steps, args.batch, args.gap_ms))


if __name__ == "__main__":
    main()
