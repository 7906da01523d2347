"""The scheduler thread's time per decode step: every manager call of a step, with the real
``HostOffloader`` (CPU copy engine, memory tier) underneath.

    .venv/bin/python bench/bench_step.py [--running 64,256,1024] [--pages 16,64] [--steps 192] [--repeats 3]
    .venv/bin/python bench/bench_step.py --profile 256,16 [--profiler cprofile|pyinstrument]

Workload, per configuration (``running`` requests, page ``P``, stride = ``P``): a steady decode
batch. Every step the scheduler (this thread) calls ``check_offload_progress`` (settles landed
copies, hands their pages to the memory tier, frees host pages of finished storage ops, releases
finished requests whose last copy landed), appends one token to every running request (committed
KV, one page allocated when a request crosses a page boundary: not timed, the scheduler's own), then
calls ``offload_kv_cache`` for every running request (a chunk is due for about ``running / P`` of
them), and for each request that finished this step ``offload_kv_cache`` + ``finalize_release_on_finish``
(the release, or its deferral to the progress check). A finished request is replaced by a new
one (prompt 1-4 pages + a partial page, output 64-256 tokens: staggered, so chunks are due evenly).
Then the thread sleeps ``--gap-ms`` (the model's forward pass, not timed) while the copy and
storage workers run, as they would on a GPU node.

Reported per configuration, medians over the measured steps and then over repeats (configurations
interleaved, each repeat in a fresh stack): the scheduler thread's time per step in two clocks —
``cpu`` (``time.thread_time``: the work itself, what other processes on a shared machine cannot
inflate) and ``wall`` — split into *bookkeeping* (manager calls minus the offloader calls inside
them), *enqueue* (``HostOffloader.write``) and *progress* (``check_offload_progress``, offloader
polls, storage hand-off and releases included); per running request; and as a fraction of a 20 ms
decode step. The KV bytes the copies move (on the copy worker threads here, on the copy engine of a
GPU) are reported apart, per step.
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import structlog  # noqa: E402

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

import torch  # noqa: E402

from bench.perfkit import machine  # noqa: E402
from lifecycle import DecodeOffloadManager, State  # noqa: E402
from lifecycle_tools.request import Request  # noqa: E402
from transfer import build_stack  # noqa: E402

STEP_MS = 20.0
TARGET_US = 200.0  # at 256 running requests
OUTPUT = (64, 256)
LAYERS, HEADS, HEAD_DIM = 4, 2, 64  # fp16: 2 KiB of K+V per token


class Clock:
    """Wall and this thread's CPU time accumulated inside timed sections (re-entrant safe: the
    enqueue timer nests inside a manager call and is subtracted from it)."""

    __slots__ = ("wall", "cpu")

    def __init__(self) -> None:
        self.wall = self.cpu = 0

    def reset(self) -> None:
        self.wall = self.cpu = 0


def timed_write(offloader, clock: Clock, pages: list) -> None:
    """Wrap ``offloader.write`` so its time lands in ``clock`` and its pages in ``pages[0]``."""
    inner = offloader.write
    wall, cpu = time.perf_counter_ns, time.thread_time_ns

    def write(indices, ack_id):
        w, c = wall(), cpu()
        try:
            return inner(indices, ack_id)
        finally:
            clock.cpu += cpu() - c
            clock.wall += wall() - w
            pages[0] += indices.shape[0]

    offloader.write = write


class Bench:
    """One stack, one manager, ``running`` requests decoding."""

    def __init__(self, running: int, page: int, seed: int) -> None:
        self.n, self.page = running, page
        self.rng = random.Random(seed)
        max_len = 5 * page + OUTPUT[1] + page
        per_req = -(-max_len // page) * page
        self.stack = build_stack(LAYERS, HEADS, HEAD_DIM, torch.float16, page, running * per_req + 4 * page,
                                 max(running, 64) * 8 * page, running + 8, max_len, storage="memory")
        self.enqueue, self.tokens = Clock(), [0]
        timed_write(self.stack.offloader, self.enqueue, self.tokens)
        self.mgr = DecodeOffloadManager.from_stack(self.stack)
        self.rows = self.stack.req_to_token_pool
        self.alloc = self.stack.allocator
        self.running: list[Request] = []
        self.finishing: list[Request] = []
        self.left: dict[int, int] = {}
        self._rid = 0
        for _ in range(running):
            self._admit()
            # stagger: each request starts part-way through its output, as in a steady batch
            req = self.running[-1]
            for _ in range(self.rng.randrange(page)):
                self._decode(req)

    def _admit(self) -> None:
        page, rng = self.page, self.rng
        n = rng.randint(1, 4) * page + rng.randrange(page)
        self._rid += 1
        req = Request(f"r{self._rid}", (rng.randrange(1 << 15) for _ in range(n)), self.rows.alloc(),
                      outputs=[rng.randrange(1 << 15)])
        slots = self.alloc.alloc(n + 1)
        self.rows.req_to_token[req.kv.req_pool_idx, : slots.shape[0]] = slots.to(torch.int32)
        req.kv.kv_committed_len = n
        req.kv.kv_allocated_len = slots.shape[0]
        self.left[id(req)] = rng.randint(*OUTPUT)
        self.running.append(req)

    def _decode(self, req: Request) -> None:
        """One token: its KV committed (a page allocated when the row runs out), one sampled."""
        kv = req.kv
        if kv.kv_committed_len + 1 > kv.kv_allocated_len:
            slots = self.alloc.alloc(self.page)
            a = kv.kv_allocated_len
            self.rows.req_to_token[kv.req_pool_idx, a : a + self.page] = slots.to(torch.int32)
            kv.kv_allocated_len = a + self.page
        kv.kv_committed_len += 1
        req.output_ids.append(self.rng.randrange(1 << 15))
        self.left[id(req)] -= 1
        if self.left[id(req)] <= 0:
            req.finish()

    def step(self) -> tuple[int, int, int, int, int, int, int]:
        """One decode step. Returns ns (cpu, wall) of progress, of the manager's offload/finish
        calls (enqueue included), of the enqueue; and the tokens enqueued."""
        mgr, wall, cpu = self.mgr, time.perf_counter_ns, time.thread_time_ns
        self.enqueue.reset()
        self.tokens[0] = 0
        w, c = wall(), cpu()
        mgr.check_offload_progress()
        pc, pw = cpu() - c, wall() - w
        if self.finishing:  # released in the progress check: the scheduler returns the row slot
            still = []
            for req in self.finishing:
                if mgr.state_of(req) is State.RELEASED:
                    del self.left[id(req)]
                else:
                    still.append(req)
            self.finishing = still
        for req in self.running:
            self._decode(req)
        done = [r for r in self.running if r._finished]
        w, c = wall(), cpu()
        for req in self.running:
            if req._finished:
                if not mgr.offload_kv_cache(req):
                    mgr.finalize_release_on_finish(req)
            else:
                mgr.offload_kv_cache(req)
        oc, ow = cpu() - c, wall() - w
        if done:
            self.running = [r for r in self.running if not r._finished]
            for req in done:
                if mgr.state_of(req) is State.RELEASED:
                    del self.left[id(req)]
                else:
                    self.finishing.append(req)
                self._admit()
        return pc, pw, oc, ow, self.enqueue.cpu, self.enqueue.wall, self.tokens[0]

    def close(self) -> None:
        for req in self.running:
            req.finish()
            if not self.mgr.offload_kv_cache(req):
                self.mgr.finalize_release_on_finish(req)
        deadline = time.monotonic() + 30
        while not self.mgr.idle() and time.monotonic() < deadline:
            self.mgr.check_offload_progress()
            time.sleep(0.001)
        s = self.mgr.stats()
        assert s.leaked == 0 and not any(v for k, v in s.by_state.items() if k != "RELEASED"), s
        self.mgr.shutdown()
        self.stack.close()


def run(running: int, page: int, steps: int, gap_s: float, seed: int) -> dict:
    """Medians over ``steps`` measured steps (after ``2 * page`` warm-up steps) of one fresh bench."""
    b = Bench(running, page, seed)
    for _ in range(2 * page):
        b.step()
        time.sleep(gap_s)
    rows = []
    for _ in range(steps):
        rows.append(b.step())
        time.sleep(gap_s)
    b.close()
    med = lambda i: statistics.median(r[i] for r in rows) / 1e3  # noqa: E731 - us
    tot = lambda clk: statistics.median((r[0] + r[2]) if clk == "cpu" else (r[1] + r[3]) for r in rows) / 1e3  # noqa: E731
    p99 = lambda clk: sorted((r[0] + r[2]) if clk == "cpu" else (r[1] + r[3]) for r in rows)[int(len(rows) * 0.99)] / 1e3  # noqa: E731
    kv_bytes = b.stack.host_pool.page_nbytes // page
    return dict(
        progress_cpu=med(0), progress_wall=med(1), enqueue_cpu=med(4), enqueue_wall=med(5),
        bookkeeping_cpu=statistics.median((r[2] - r[4]) for r in rows) / 1e3,
        bookkeeping_wall=statistics.median((r[3] - r[5]) for r in rows) / 1e3,
        total_cpu=tot("cpu"), total_wall=tot("wall"), p99_cpu=p99("cpu"), p99_wall=p99("wall"),
        copy_kib=statistics.mean(r[6] for r in rows) * kv_bytes / 1024,
        chunks=statistics.mean(r[6] for r in rows) / page,
    )


def table(results: dict, repeats: int) -> None:
    print(f"{'running':>7} {'page':>4} {'clock':>5} {'us/step':>8} {'p99':>8} {'us/req':>7} {'% of 20ms':>9} "
          f"{'bookkeeping':>11} {'enqueue':>8} {'progress':>8} {'chunks/step':>11} {'copy KiB/step':>13}")
    for (n, page), runs in results.items():
        for clk in ("cpu", "wall"):
            m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            tot = m[f"total_{clk}"]
            print(f"{n:7d} {page:4d} {clk:>5} {tot:8.1f} {m[f'p99_{clk}']:8.1f} {tot / n:7.3f} "
                  f"{tot / (STEP_MS * 1e3) * 100:8.2f}% {m[f'bookkeeping_{clk}']:11.1f} {m[f'enqueue_{clk}']:8.1f} "
                  f"{m[f'progress_{clk}']:8.1f} {m['chunks']:11.1f} {m['copy_kib']:13.0f}")
    print(f"(medians of {repeats} interleaved repeats of the per-step median; p99 = median of the repeats' "
          f"per-step p99; target: <= {TARGET_US:g} us per step at 256 requests, {TARGET_US / STEP_MS / 10:.0f}% of a "
          f"{STEP_MS:g} ms step; copy bytes move on worker threads, not in these times)")


def profile(spec: str, steps: int, gap_s: float, seed: int, profiler: str) -> None:
    """Profile the scheduler thread's calls for one configuration (``running,page``)."""
    n, page = (int(x) for x in spec.split(","))
    b = Bench(n, page, seed)
    for _ in range(2 * page):
        b.step()
        time.sleep(gap_s)
    if profiler == "pyinstrument":
        from pyinstrument import Profiler

        prof = Profiler(interval=0.0001)
        for _ in range(steps):
            prof.start()
            b.step()
            prof.stop()
            time.sleep(gap_s)
        print(prof.output_text(unicode=False, color=False, show_all=False))
    else:
        import cProfile
        import pstats

        prof = cProfile.Profile(time.thread_time_ns, 1e-9)  # CPU time of this thread: not the machine's load
        for _ in range(steps):
            prof.enable()
            b.step()
            prof.disable()
            time.sleep(gap_s)
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(40)
    b.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", default="64,256,1024")
    ap.add_argument("--pages", default="16,64")
    ap.add_argument("--steps", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gap-ms", type=float, default=5.0, help="sleep between steps (the forward pass)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profile", metavar="RUNNING,PAGE")
    ap.add_argument("--profiler", choices=("cprofile", "pyinstrument"), default="cprofile")
    args = ap.parse_args()
    if args.profile:
        return profile(args.profile, args.steps, args.gap_ms / 1e3, args.seed, args.profiler)
    print(machine())
    print(f"KV {LAYERS} layers x {HEADS} heads x {HEAD_DIM} fp16; memory tier; CPU copy engine (2 threads); "
          f"{args.steps} measured steps, {args.gap_ms:g} ms gap; stride = page")
    configs = [(int(n), int(p)) for p in args.pages.split(",") for n in args.running.split(",")]
    results: dict = {c: [] for c in configs}
    for rep in range(args.repeats):
        for c in configs if rep % 2 == 0 else configs[::-1]:
            gc.collect()
            results[c].append(run(*c, args.steps, args.gap_ms / 1e3, args.seed + rep))
    table(results, args.repeats)


if __name__ == "__main__":
    main()
