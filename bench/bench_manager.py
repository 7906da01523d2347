"""Scheduler overhead of DecodeOffloadManager vs a plain-dict and an as-written implementation.

Same workload, same doubles, one run (interleaved repeats, medians): 128 requests, 512-token
prompts, 192 decode steps, page 16, copies landing by the next progress check. Logging is filtered
out (structlog at WARNING) so the machine and the algorithm are measured, not the log sink.

    .venv/bin/python bench/bench_manager.py [--repeats 7] [--requests 128] [--steps 192] [--clock cpu]
    .venv/bin/python bench/bench_manager.py --against /tmp/base988 --repeats 9 --clock cpu
    .venv/bin/python bench/bench_manager.py --slot-check --repeats 7 --clock cpu

``--against DIR`` compares this tree's ``lifecycle`` with an older one (``DIR/lifecycle``, e.g.
``git archive 988768c lifecycle | tar -x -C DIR``): each repeat runs the workload once in a fresh
process per version (order alternating), each version's ratio taken against the plain-dict run
of its own process; medians printed side by side.

``--clock cpu`` times the manager calls with this thread's CPU time (``time.thread_time``) instead
of wall time: on a shared machine other processes then do not inflate one implementation's runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if os.environ.get("BENCH_LIFECYCLE_FROM"):  # --against: this worker process measures an older lifecycle
    sys.path.insert(0, os.environ["BENCH_LIFECYCLE_FROM"])

import structlog  # noqa: E402
import torch  # noqa: E402

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

from bench.baselines import AsWrittenManager, PlainDictManager  # noqa: E402
from lifecycle import DecodeOffloadManager  # noqa: E402
from transfer.offloader import EMPTY_REPORT, WriteReport  # noqa: E402


class KV:
    __slots__ = ("req_pool_idx", "kv_committed_len", "kv_allocated_len")

    def __init__(self, row, n):
        self.req_pool_idx, self.kv_committed_len, self.kv_allocated_len = row, n, n


class Req:
    __slots__ = ("rid", "origin_input_ids", "output_ids", "kv", "_done", "__weakref__")

    def __init__(self, rid, prompt, row):
        self.rid, self.origin_input_ids, self.output_ids = rid, prompt, [7]
        self.kv = KV(row, len(prompt))
        self._done = False

    def finished(self):
        return self._done


class Pool:
    def __init__(self, rows, width):
        self.req_to_token = torch.arange(rows * width, dtype=torch.int32).reshape(rows, width)

    def free(self, req):
        req.kv.req_pool_idx = None


class Allocator:
    page_size = 16

    def __init__(self):
        self.freed = 0

    def free(self, indices):
        self.freed += indices.numel()


class Offloader:
    """Copies land by the next check; storage ops finish by the one after."""

    def __init__(self):
        self.host = torch.arange(1 << 16, dtype=torch.int64)
        self.writes, self.ops, self.next_op = [], [], 0

    def write(self, device_indices, ack_id):
        self.writes.append(ack_id)
        return self.host[: device_indices.shape[0]]

    def finished_writes(self):
        if not self.writes:
            return EMPTY_REPORT
        out, self.writes = self.writes, []
        return WriteReport(out, [], [])

    def write_storage(self, host_indices, tokens, page_hashes, parent_hash=None):
        self.next_op += 1
        self.ops.append(self.next_op)
        return self.next_op

    def finished_storage(self):
        out, self.ops = self.ops, []
        return out

    def free_host(self, host_indices):
        pass

    def close(self, timeout):
        pass


CLOCK = time.perf_counter  # --clock cpu: time.thread_time


def workload(make, n_req, prompt_len, steps, page):
    """Run the whole workload; returns (seconds inside the manager, manager)."""
    width = prompt_len + steps + page
    pool, alloc, off = Pool(n_req, width), Allocator(), Offloader()
    mgr = make(pool, alloc, page, off)
    reqs = [Req(f"r{i}", list(range(i, i + prompt_len)), i) for i in range(n_req)]
    spent = 0.0
    clock = CLOCK
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
    for r in reqs:
        r._done = True
        if not mgr.offload_kv_cache(r):
            mgr.finalize_release_on_finish(r)
    for _ in range(3):
        mgr.check_offload_progress()
    spent += clock() - t0
    assert alloc.freed == n_req * (prompt_len + steps), alloc.freed
    return spent, mgr


IMPLS = {
    "lifecycle (transitions)": lambda p, a, ps, o: _lifecycle(p, a, ps, o),
    "plain dict": lambda p, a, ps, o: PlainDictManager(p, a, ps, o),
    "as written (SGLang)": lambda p, a, ps, o: AsWrittenManager(p, a, ps, o),
}


def _lifecycle(p, a, ps, o):
    return DecodeOffloadManager(p, a, page_size=ps, offloader=o)


def fast_path_us(n=200_000, make=_lifecycle):
    pool, alloc, off = Pool(1, 2048), Allocator(), Offloader()
    mgr = make(pool, alloc, 16, off)
    req = Req("r", list(range(512)), 0)
    mgr.offload_kv_cache(req)
    t0 = CLOCK()
    for _ in range(n):
        mgr.offload_kv_cache(req)
    return (CLOCK() - t0) / n * 1e6


def per_chunk_us(n=20_000, make=_lifecycle, real_allocator=False):
    """Time of an offload call that enqueues one chunk plus its landing and storage settle.

    ``real_allocator``: the row lists slots of a ``transfer.PagedTokenAllocator`` (which has
    ``check_free``, so the chunk's slot check also asks it) instead of the bench's double."""
    pool, alloc, off = Pool(1, 16 * n + 64), Allocator(), Offloader()
    if real_allocator:
        from transfer import PagedTokenAllocator

        alloc = PagedTokenAllocator(16 * n + 64, 16)
        pool.req_to_token[0] = alloc.alloc(16 * n + 64).to(torch.int32)
    mgr = make(pool, alloc, 16, off)
    req = Req("r", list(range(16)), 0)
    mgr.offload_kv_cache(req)
    total = 0.0
    for i in range(n):
        req.output_ids.extend(range(16))
        req.kv.kv_committed_len += 16
        req.kv.kv_allocated_len += 16
        t0 = CLOCK()
        mgr.offload_kv_cache(req)
        mgr.check_offload_progress()
        total += CLOCK() - t0
    return total / n * 1e6


def first_sight_release_us(n=3_000, make=_lifecycle):
    """Per request: the first offload call (tracks it, hashes a 512-token prompt, enqueues its 32
    pages) and, once it finished with no copy in flight, the call that releases it."""
    pool, alloc, off = Pool(n, 600), Allocator(), Offloader()
    mgr = make(pool, alloc, 16, off)
    reqs = [Req(f"r{i}", list(range(512)), i) for i in range(n)]
    for r in reqs:
        r.output_ids.append(1)
        r.kv.kv_committed_len += 1
        r.kv.kv_allocated_len += 1
    t0 = CLOCK()
    for r in reqs:
        mgr.offload_kv_cache(r)
    t1 = CLOCK()
    mgr.check_offload_progress()
    mgr.check_offload_progress()
    t2 = CLOCK()
    for r in reqs:
        r._done = True
        if not mgr.offload_kv_cache(r):
            mgr.finalize_release_on_finish(r)
    t3 = CLOCK()
    assert alloc.freed == n * 513, alloc.freed
    return (t1 - t0) / n * 1e6, (t3 - t2) / n * 1e6


def per_operation(repeats=3):
    """Median per-operation times, lifecycle and plain dict interleaved."""
    plain = IMPLS["plain dict"]
    rows = {k: ([], []) for k in ("fast path (no new chunk)", "one chunk (offload + land + store settle)",
                                  "first sight (512-token prompt)", "release (finished, nothing in flight)")}
    for _ in range(repeats):
        for i, make in enumerate((_lifecycle, plain)):
            gc.collect()
            first, release = first_sight_release_us(make=make)
            got = (fast_path_us(make=make), per_chunk_us(make=make), first, release)
            for (_, pair), value in zip(rows.items(), got):
                pair[i].append(value)
    print(f"{'per operation (us, median of ' + str(repeats) + ')':44} {'lifecycle':>9} {'plain dict':>10} {'extra':>7}")
    for name, (ours, base) in rows.items():
        a, b = statistics.median(ours), statistics.median(base)
        print(f"{name:44} {a:9.3f} {b:10.3f} {a - b:7.3f}")


def bytes_per_request(n=10_000):
    """Per live request at ``n`` live requests: bytes the manager allocates on first sight, objects
    the cycle collector tracks (``gc.get_objects()`` growth); and one full collection's time (this
    thread's CPU time, median of 5) with those requests live, frozen heap (``gc.freeze()`` of
    everything before the manager, as after a server's warm-up) and not."""
    pool, alloc, off = Pool(n, 64), Allocator(), Offloader()
    mgr = DecodeOffloadManager(pool, alloc, page_size=16, offloader=off)
    reqs = [Req(f"r{i}", list(range(32)), i) for i in range(n)]
    for r in reqs:
        r.output_ids.append(1)
    gc.collect()
    objects = len(gc.get_objects())
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for r in reqs:
        mgr.offload_kv_cache(r)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    tracked = (len(gc.get_objects()) - objects) / n

    def full_gc_ms():
        times = []
        for _ in range(5):
            t0 = time.thread_time()
            gc.collect()
            times.append((time.thread_time() - t0) * 1e3)
        return statistics.median(times)

    gc_ms = full_gc_ms()
    assert mgr.stats().tracked == n
    return (after - before) / n, tracked, gc_ms


def full_gc_frozen_ms(n=10_000):
    """A full collection's CPU time with ``n`` live requests recorded after ``gc.freeze()``."""
    gc.collect()
    gc.freeze()
    try:
        pool, alloc, off = Pool(n, 64), Allocator(), Offloader()
        mgr = DecodeOffloadManager(pool, alloc, page_size=16, offloader=off)
        reqs = [Req(f"r{i}", list(range(32)), i) for i in range(n)]
        for r in reqs:
            r.output_ids.append(1)
            mgr.offload_kv_cache(r)
        times = []
        for _ in range(5):
            t0 = time.thread_time()
            gc.collect()
            times.append((time.thread_time() - t0) * 1e3)
        assert mgr.stats().tracked == n
        return statistics.median(times), len(gc.get_objects())
    finally:
        gc.unfreeze()


def slot_check_cost(repeats: int) -> None:
    """What the chunk plan's slot check (``lifecycle.slots``: ``check_slots`` and the per-copy
    ``SlotsInFlight`` counts) costs per chunk: ``per_chunk_us`` with the check in place and with it
    switched off (an ablation: the three functions replaced by no-ops), interleaved, medians; with
    the bench's allocator double (no ``check_free``) and with ``PagedTokenAllocator``."""
    import lifecycle.requests as requests
    import lifecycle.slots as slots

    real = (requests.check_slots, slots.SlotsInFlight.add, slots.SlotsInFlight.remove)
    off = (lambda *a, **k: None, lambda self, ack, indices: None, lambda self, ack: None)
    got = {(mode, alloc): [] for mode in ("with", "without") for alloc in (False, True)}
    try:
        for i in range(repeats):
            for mode in (("with", "without") if i % 2 == 0 else ("without", "with")):
                requests.check_slots, slots.SlotsInFlight.add, slots.SlotsInFlight.remove = \
                    real if mode == "with" else off
                for alloc in (False, True):
                    got[mode, alloc].append(per_chunk_us(n=5_000, real_allocator=alloc))
    finally:
        requests.check_slots, slots.SlotsInFlight.add, slots.SlotsInFlight.remove = real
    print(f"{'one chunk, us (median of ' + str(repeats) + ')':34} {'bench allocator':>15} {'PagedTokenAllocator':>20}")
    for mode in ("with", "without"):
        print(f"{mode + ' the slot check':34} {statistics.median(got[mode, False]):15.2f} "
              f"{statistics.median(got[mode, True]):20.2f}")
    print(f"{'the check costs':34} "
          f"{statistics.median(got['with', False]) - statistics.median(got['without', False]):15.2f} "
          f"{statistics.median(got['with', True]) - statistics.median(got['without', True]):20.2f}")


def against(args) -> None:
    """Interleaved fresh-process runs of this tree's lifecycle and ``args.against``'s (see module doc)."""
    import subprocess

    versions = {"this tree": None, f"{args.against}": str(Path(args.against).resolve())}
    ratios = {v: [] for v in versions}
    totals = {v: [] for v in versions}
    chunks = {v: ([], []) for v in versions}
    cmd = [sys.executable, __file__, "--worker", "--clock", args.clock, "--requests", str(args.requests),
           "--prompt", str(args.prompt), "--steps", str(args.steps), "--page", str(args.page)]
    for i in range(args.repeats):
        order = list(versions) if i % 2 == 0 else list(versions)[::-1]
        for v in order:
            env = dict(os.environ)
            env.pop("BENCH_LIFECYCLE_FROM", None)
            if versions[v]:
                env["BENCH_LIFECYCLE_FROM"] = versions[v]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            got = json.loads(out.strip().splitlines()[-1])
            assert got.pop("from").startswith(versions[v] or str(Path(__file__).resolve().parent.parent)), got
            ratios[v].append(got["lifecycle (transitions)"] / got["plain dict"])
            totals[v].append(got["lifecycle (transitions)"])
            chunks[v][0].append(got["chunk_us"])
            chunks[v][1].append(got["chunk_real_allocator_us"])
    print(f"workload: {args.requests} requests x {args.prompt}-token prompts x {args.steps} steps, page "
          f"{args.page}; {args.repeats} interleaved fresh-process runs per version; {args.clock} clock")
    print(f"{'lifecycle version':26} {'median ms':>9} {'median vs plain dict':>21} {'min':>6} {'max':>6}")
    for v in versions:
        r = ratios[v]
        print(f"{v:26} {statistics.median(totals[v]) * 1e3:9.1f} {statistics.median(r):20.2f}x "
              f"{min(r):5.2f}x {max(r):5.2f}x")
    print(f"{'one chunk (offload + land + store settle), us':46} {'bench allocator':>15} {'PagedTokenAllocator':>20}")
    for v in versions:
        print(f"{v:46} {statistics.median(chunks[v][0]):15.2f} {statistics.median(chunks[v][1]):20.2f}")


def worker(args) -> None:
    """One warm-up and one measured run of every implementation; prints their seconds as JSON."""
    got = {}
    for name, make in IMPLS.items():
        workload(make, args.requests, args.prompt, args.steps, args.page)
    for name, make in IMPLS.items():
        gc.collect()
        got[name], _ = workload(make, args.requests, args.prompt, args.steps, args.page)
    gc.collect()
    got["chunk_us"] = per_chunk_us(n=10_000)
    got["chunk_real_allocator_us"] = per_chunk_us(n=10_000, real_allocator=True)
    import lifecycle

    got["from"] = str(Path(lifecycle.__file__).resolve())
    print(json.dumps(got))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gc-only", action="store_true", help="only the per-request bookkeeping and collector figures")
    ap.add_argument("--slot-check", action="store_true", help="only the chunk slot check's cost per chunk (ablation)")
    ap.add_argument("--against", metavar="DIR", help="also measure DIR/lifecycle (an older version)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=192)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.worker:
        return worker(args)
    if args.against:
        return against(args)
    if args.slot_check:
        slot_check_cost(args.repeats)
        return
    if args.gc_only:
        per_req, tracked, gc_ms = bytes_per_request()
        frozen_ms, frozen_objects = full_gc_frozen_ms()
        print(f"per live request at 10k: {per_req:.0f} bytes, {tracked:.2f} tracked objects; full gc.collect() "
              f"(CPU) {gc_ms:.1f} ms; frozen heap {frozen_ms:.1f} ms ({frozen_objects} tracked objects)")
        return
    times = {name: [] for name in IMPLS}
    for _ in range(args.repeats):
        for name, make in IMPLS.items():
            gc.collect()
            spent, _ = workload(make, args.requests, args.prompt, args.steps, args.page)
            times[name].append(spent)
    med = {k: statistics.median(v) for k, v in times.items()}
    calls = args.requests * (args.steps + 1)
    base = med["plain dict"]
    print(f"workload: {args.requests} requests x {args.prompt}-token prompts x {args.steps} steps, "
          f"page {args.page}; median of {args.repeats} interleaved runs; {args.clock} clock; logging filtered (WARNING)")
    print(f"{'implementation':26} {'total ms':>9} {'us/call':>8} {'vs plain dict':>14}")
    for name, t in med.items():
        print(f"{name:26} {t * 1e3:9.1f} {t / calls * 1e6:8.2f} {t / base:13.2f}x")
    print(f"lifecycle vs as-written: {med['lifecycle (transitions)'] / med['as written (SGLang)']:.2f}x")
    per_operation()
    per_req, tracked, gc_ms = bytes_per_request()
    frozen_ms, frozen_objects = full_gc_frozen_ms()
    print(f"bookkeeping per live request at 10k requests: {per_req:.0f} bytes, {tracked:.2f} objects tracked by the "
          f"cycle collector; full gc.collect() (CPU): {gc_ms:.1f} ms, {frozen_ms:.1f} ms with the heap frozen before "
          f"the requests arrived ({frozen_objects} tracked objects left to walk)")


if __name__ == "__main__":
    main()
