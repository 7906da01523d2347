"""Per decode step beside SGLang's own manager: SGLang 0.5.19's ``DecodeKVCacheOffloadManager`` and
our drop-in, in SGLang's real classes on CPU, the same workload and seed, paired (issue 33).

    /work/sglang-venv/bin/python bench/bench_sglang_step.py [--quick] [--pairs N] [--steps N]
        [--configs 256/16,256/64,64/16] [--output 64,256] [--gap-ms 5] [--dropin-copies after-calls]

Needs SGLang 0.5.19 importable (the environment ``bash .ci/sglang-env`` prepares; it installs this
checkout editable, so the drop-in measured is the code of this working tree).

The two managers, each constructed as ``Scheduler.__init__`` constructs it (``req_to_token_pool``,
``token_to_kv_pool_allocator``, ``tp_group`` = the TP CPU group, ``tree_cache``):
  - ``sglang``:  ``sglang.srt.disaggregation.decode_kvcache_offload_manager.DecodeKVCacheOffloadManager``
  - ``drop-in``: ``lifecycle.integrations.sglang.DecodeKVCacheOffloadManager`` (what
    ``KV_LIFECYCLE_SGLANG=1`` switches SGLang's scheduler to)
Both read the same ``ServerArgs`` (PD decode, decode offload, ``--hicache-storage-backend file`` in a
temporary directory, ``--hicache-io-backend kernel``, ``--hicache-mem-layout page_first``, resolved by
SGLang and published as a scheduler's runtime context; ``hicache_ratio`` 2.0 as SGLang's
``kv_cache_builder`` resolves it for decode offload) over SGLang's ``ReqToTokenPool``,
``MHATokenToKVPool``, ``PagedTokenToKVPoolAllocator``, ``ChunkCache`` and real ``Req`` objects, one
rank (gloo).

CPU stand-ins for SGLang's CUDA-only pieces (SGLang's own manager cannot run on CPU without them):
its host pool's ``cudaHostRegister`` (construction only) is skipped, and its device -> host copy
kernel (``sgl_kernel``'s ``transfer_kv_all_layer_lf_pf``, one launch on a GPU) is a torch gather
that runs synchronously on the scheduler thread. That copy's thread CPU is measured apart and
subtracted from SGLang's figures (reported as ``copy``). The drop-in's copies run on its copy
worker threads on CPU, off the scheduler thread (on a GPU: one launch), so nothing is subtracted from
it. Storage writes run on each manager's own worker threads (SGLang's backup thread; our writer).

``--dropin-copies`` says when those copy workers start: ``threads`` (default) at once, as a CPU
deployment runs, so they compete with the scheduler thread for the GIL (and the cores) while it
makes the step's calls; ``after-calls`` once the step's calls end (``HeldCopies``), so they run
during the forward's gap, as on a GPU, where the copy engine launches on the stream and has no
worker thread. Either way nothing of the drop-in's copy is moved onto the measured thread or
subtracted.

Workload per configuration ``running/page`` (offload stride = page, SGLang's default): a steady decode
batch of ``running`` requests (prompt 1-4 pages + a partial page, ``--output`` tokens of output, drawn
from one seeded RNG, so both managers see identical requests, tokens and finishing steps; a finished
request is replaced by a new one). Each step, in SGLang's order: ``check_offload_progress``
(``process_decode_queue``), the forward (one slot and one sampled token per request, untimed; then
``--gap-ms`` of sleep while the managers' threads run), then for each request
``_handle_finish_state_updated_req``'s calls (``offload_kv_cache``; for a finished one
``offload_kv_cache`` and, when that enqueues nothing, ``finalize_release_on_finish``). At the end every
request is finished and drained; both managers must give every row and slot back.

Measured: the scheduler thread's CPU (``time.thread_time_ns``, which load from other processes does not
inflate) of those calls. Even steps: per step (the calls untimed one by one); odd steps: per call, less
the clock's own cost: a call with no chunk due, a call that enqueues a chunk, and a finished request's
release (a ``finalize_release_on_finish`` that frees the request's row). Runs in pairs: one run of
each manager, each over its own fresh pools, the same seed, stepped in lockstep (step i of one, then
step i of the other; which goes first alternates every other step and pair by pair), so that load from
other processes falls on both alike. Configurations interleave (reversed in odd pairs). Reported:
medians over the pairs of each run's median / p99, and the median of the pairs' ratios (drop-in /
SGLang) with their range.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from bench.perfkit import (  # noqa: E402
    clock_overhead_ns, finish, fmt, load_line, machine, parse_configs, percentile, ratio_text, ratios, schedule, summarize,
)
from lifecycle_tools.testkit.sglang_doubles import grow_row  # noqa: E402

SGLANG = "sglang"
DROPIN = "drop-in"
KINDS = (SGLANG, DROPIN)
NAMES = {
    SGLANG: "sglang.srt.disaggregation.decode_kvcache_offload_manager.DecodeKVCacheOffloadManager",
    DROPIN: "lifecycle.integrations.sglang.DecodeKVCacheOffloadManager",
}
MODEL = "bench/Llama-like"
LAYERS, HEADS, HEAD_DIM = 4, 2, 64  # bf16: 2 KiB of K+V per token
DEFAULT_CONFIGS = "256/16,256/64,64/16"

# --- pure helpers (no sglang; tests/bench/test_bench_sglang_step.py) -------------------------------


def net_of_copy(totals, copies) -> list:
    """Each step's (or call's) scheduler-thread time less the copy measured inside it. Raises
    ValueError when the lists differ in length or a copy exceeds the time that contains it."""
    if len(totals) != len(copies):
        raise ValueError(f"{len(totals)} totals but {len(copies)} copy times")
    out = []
    for total, copy in zip(totals, copies):
        if copy < 0 or copy > total:
            raise ValueError(f"copy time {copy} is not within its step's time {total}")
        out.append(total - copy)
    return out


def pair_order(pair: int) -> tuple[str, str]:
    """Which manager runs first in pair ``pair`` (0-based): SGLang's in even pairs, ours in odd ones."""
    return (SGLANG, DROPIN) if pair % 2 == 0 else (DROPIN, SGLANG)


def step_order(pair: int, step: int) -> tuple[str, str]:
    """Which manager steps first at measured step ``step`` of pair ``pair``: ``pair_order(pair)``,
    swapped every other pair of steps (steps alternate per step / per call, so each manager goes first
    in half of the steps of each kind)."""
    first, second = pair_order(pair)
    return (first, second) if (step // 2) % 2 == 0 else (second, first)


# --- SGLang's classes on CPU ------------------------------------------------------------------------


class CopyStandIn:
    """``sgl_kernel.kvcacheio.transfer_kv_all_layer_lf_pf`` on CPU: every layer's K and V rows of the
    device slots gathered into the page-first host buffer, on the calling (scheduler) thread; its
    thread CPU accumulated in ``ns`` (with the cost of its own clock reads)."""

    def __init__(self, overhead_ns: int) -> None:
        self.ns = 0
        self.calls = 0
        self.overhead_ns = overhead_ns
        self._pools: dict[int, tuple] = {}

    def register(self, device_pool) -> None:
        """The device pool whose ``k_data_ptrs`` / ``v_data_ptrs`` the kernel will be handed."""
        self._pools[id(device_pool.k_data_ptrs)] = (device_pool.k_buffer, device_pool.v_buffer)

    def __call__(self, src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size,
                 dst_layout_dim, num_layers) -> None:
        c0 = time.thread_time_ns()
        k_layers, v_layers = self._pools[id(src_k_layers)]
        for layer in range(num_layers):
            dst_k[dst_indices, layer] = k_layers[layer][src_indices]
            dst_v[dst_indices, layer] = v_layers[layer][src_indices]
        self.ns += time.thread_time_ns() - c0 + self.overhead_ns
        self.calls += 1


class SGLangEnv:
    """The process-wide part: a model directory, SGLang's model-parallel groups (gloo, one rank),
    the CPU stand-ins; ``publish(page)`` resolves and publishes a decode scheduler's ``ServerArgs``."""

    def __init__(self, overhead_ns: int) -> None:
        warnings.filterwarnings("ignore")
        from sglang.srt.distributed import parallel_state as ps
        from sglang.srt.mem_cache.pool_host import common as host_common
        from sglang.srt.mem_cache.pool_host import mha as host_mha

        from lifecycle_tools.testkit.redis_server import free_port

        self.root = tempfile.mkdtemp(prefix="bench-sglang-step-")
        self.model = os.path.join(self.root, "model")
        os.mkdir(self.model)
        with open(os.path.join(self.model, "config.json"), "w") as f:
            json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * HEAD_DIM,
                       "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "num_hidden_layers": LAYERS,
                       "intermediate_size": 4 * HEADS * HEAD_DIM, "vocab_size": 32000,
                       "max_position_embeddings": 8192, "head_dim": HEAD_DIM, "torch_dtype": "bfloat16"}, f)
        self.copy = CopyStandIn(overhead_ns)
        self._restore: list = []
        if not (host_mha._is_cuda or host_mha._is_hip):  # the CUDA-only pieces, on CPU (put back by close)
            kernel = "transfer_kv_all_layer_lf_pf"
            self._restore = [(host_common, "_cuda_host_register", host_common._cuda_host_register),
                             (host_mha, kernel, getattr(host_mha, kernel, None))]
            host_common._cuda_host_register = lambda buffer, granularity=None: None
            host_mha.transfer_kv_all_layer_lf_pf = self.copy
        os.environ.pop("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", None)
        os.environ.pop("KV_LIFECYCLE_SGLANG", None)
        ps.init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                        distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        ps.initialize_model_parallel(backend="gloo")
        self.tp_group = ps.get_tp_group().cpu_group  # Scheduler's tp_cpu_group

    def publish(self, page: int) -> None:
        from sglang.srt import runtime_context
        from sglang.srt.server_args import ServerArgs

        os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = os.path.join(self.root, "store")
        runtime_context.reset_context()
        args = ServerArgs(model_path=self.model, skip_tokenizer_init=True, device="cpu", page_size=page,
                          served_model_name=MODEL, disaggregation_mode="decode",
                          disaggregation_decode_enable_offload_kvcache=True, hicache_storage_backend="file",
                          hicache_io_backend="kernel", hicache_mem_layout="page_first")
        runtime_context.publish(args, role="scheduler")
        # kv_cache_builder.resolve_decode_retraction_backup, for decode offload (it needs a model worker)
        runtime_context.get_context().override("kv_cache_builder.decode_retraction",
                                               disaggregation_decode_retraction_backup="cpu_tensor",
                                               hicache_ratio=2.0)

    def close(self) -> None:
        from sglang.srt import runtime_context
        from sglang.srt.distributed import parallel_state as ps

        runtime_context.reset_context()
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
        for module, name, value in self._restore:
            if value is None:
                module.__dict__.pop(name, None)
            else:
                setattr(module, name, value)
        os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
        shutil.rmtree(self.root, ignore_errors=True)


class HeldCopies:
    """``--dropin-copies after-calls``: the drop-in's copy jobs are held while the scheduler thread
    makes the step's calls and handed to its copy workers when they end (``release``), so the
    copies run during the forward's gap, as on a GPU, where the copy engine has no worker thread
    and nothing competes with the scheduler thread for the GIL while it makes its calls. Each copy
    is still planned and run on a worker thread (nothing is moved onto the measured thread, and
    nothing is subtracted); only when the workers start differs. ``threads`` (the default) submits
    each job at once, as a CPU deployment does."""

    def __init__(self, engine) -> None:
        self.engine, self.held = engine, []
        self._submit = engine.submit
        engine.submit = self.hold  # the engine's own to_host builds the job and calls submit

    def hold(self, tag, fn) -> None:
        self.held.append((tag, fn))

    def release(self) -> None:
        held, self.held = self.held, []
        for tag, fn in held:
            self._submit(tag, fn)


def make_manager(kind: str, pool, alloc, tp_group, tree):
    """``Scheduler.__init__``'s construction, keyword for keyword, of SGLang's class or ours."""
    if kind == SGLANG:
        from sglang.srt.disaggregation.decode_kvcache_offload_manager import DecodeKVCacheOffloadManager
    else:
        from lifecycle.integrations.sglang import DecodeKVCacheOffloadManager
    return DecodeKVCacheOffloadManager(req_to_token_pool=pool, token_to_kv_pool_allocator=alloc,
                                       tp_group=tp_group, tree_cache=tree)


class Run:
    """One manager over fresh SGLang pools, ``running`` requests decoding (see the module doc)."""

    def __init__(self, env: SGLangEnv, kind: str, running: int, page: int, seed: int,
                 output: tuple[int, int], overhead_ns: int, copies: str = "threads") -> None:
        import torch
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.chunk_cache import ChunkCache
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.sampling.sampling_params import SamplingParams

        self.kind, self.n, self.page, self.output = kind, running, page, output
        self.Req, self.SamplingParams, self.FINISH_LENGTH = Req, SamplingParams, FINISH_LENGTH
        self.rng = random.Random(seed)
        self.env, self.overhead = env, overhead_ns
        self.store = tempfile.mkdtemp(prefix=f"store-{'sglang' if kind == SGLANG else 'dropin'}-", dir=env.root)
        self.copy_calls = 0  # SGLang's copies this run made (on this thread)
        max_len = 5 * page + output[1] + 2 * page
        rows = running + running // 4 + 16  # finished requests wait for their last copy with their rows
        tokens = (running + 16) * max_len
        self.kv = MHATokenToKVPool(tokens, page, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False)
        self.alloc = PagedTokenToKVPoolAllocator(tokens, page, torch.bfloat16, "cpu", self.kv, False)
        self.pool = ReqToTokenPool(rows, max_len, "cpu", False)
        self.tree = ChunkCache(CacheInitParams(disable=True, req_to_token_pool=self.pool,
                                               token_to_kv_pool_allocator=self.alloc, page_size=page))
        self.free_slots, self.free_rows = self.alloc.available_size(), self.pool.available_size()
        self.table = self.pool.req_to_token
        if kind == SGLANG:
            env.copy.register(self.kv)
        os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = self.store  # read by both at construction
        self.mgr = make_manager(kind, self.pool, self.alloc, env.tp_group, self.tree)
        self.held = HeldCopies(self.mgr.offloader.engine) if kind == DROPIN and copies == "after-calls" else None
        self.running: list = []
        self.target: dict[int, int] = {}
        self._rid = 0
        for _ in range(running):
            req = self._admit()
            for _ in range(self.rng.randrange(self.target[id(req)] - 1)):  # a steady batch: part-way through
                self._decode(req)

    # the scheduler's own work (untimed) -----------------------------------------------------------

    def _admit(self):
        """A request as the PD transfer leaves it: a row, the prompt's slots and KV, one sampled token."""
        page, rng = self.page, self.rng
        n = rng.randint(1, 4) * page + rng.randrange(page)
        self._rid += 1
        req = self.Req(f"r{self._rid}", "", array("q", (rng.randrange(32000) for _ in range(n))),
                       self.SamplingParams(max_new_tokens=self.output[1]))
        assert self.pool.alloc([req]) is not None, "rows exhausted"
        self._grow(req, n)
        req.output_ids.append(rng.randrange(32000))
        self.target[id(req)] = rng.randint(*self.output)
        self.running.append(req)
        return req

    def _grow(self, req, n_tokens: int) -> None:
        """Slots up to ``n_tokens`` as SGLang's paged allocator hands them out (a page at each page
        boundary), committed."""
        grow_row(self.table, self.alloc, req.kv, n_tokens, self.page)
        req.kv.kv_committed_len = n_tokens

    def _decode(self, req) -> None:
        """One forward step of ``req``: its next position's slot, then a sampled token."""
        self._grow(req, req.kv.kv_committed_len + 1)
        req.output_ids.append(self.rng.randrange(32000))
        if len(req.output_ids) >= self.target[id(req)]:
            req.finished_reason = self.FINISH_LENGTH(length=len(req.output_ids))

    # one decode step -------------------------------------------------------------------------------

    def step(self, per_call: bool, calls: dict | None):
        """One step. Per step (``per_call`` False): returns (ns, copy ns) of the manager calls. Per
        call: appends each call's net ns to ``calls`` (keys idle / enqueue / release) and returns None."""
        mgr, clock, copy = self.mgr, time.thread_time_ns, self.env.copy
        copies_before = copy.calls
        if per_call:
            c0, k0 = clock(), copy.ns
            mgr.check_offload_progress()
            calls["progress"].append(clock() - c0 - (copy.ns - k0) - self.overhead)
        else:
            c0, k0 = clock(), copy.ns
            mgr.check_offload_progress()
            t, k = clock() - c0, copy.ns - k0
        for req in self.running:
            self._decode(req)
        if per_call:
            for req in self.running:
                finished = req.finished()
                c0, k0 = clock(), copy.ns
                due = mgr.offload_kv_cache(req)
                ns = clock() - c0 - (copy.ns - k0) - self.overhead
                calls["enqueue" if due else ("finished_idle" if finished else "idle")].append(ns)
                if finished and not due:
                    c0, k0 = clock(), copy.ns
                    mgr.finalize_release_on_finish(req)
                    ns = clock() - c0 - (copy.ns - k0) - self.overhead
                    kv = req.kv
                    freed = kv.req_pool_idx is None or kv.req_pool_idx == -1
                    calls["release" if freed else "deferred"].append(ns)
        else:
            c0, k0 = clock(), copy.ns
            for req in self.running:
                if not req.finished():
                    mgr.offload_kv_cache(req)
                elif not mgr.offload_kv_cache(req):
                    mgr.finalize_release_on_finish(req)
            t, k = t + clock() - c0, k + copy.ns - k0
        if self.held is not None:  # the step's calls are over: the forward's gap begins
            self.held.release()
        done = [r for r in self.running if r.finished()]
        if done:
            self.running = [r for r in self.running if not r.finished()]
            for req in done:
                del self.target[id(req)]
                self._admit()
        self.copy_calls += copy.calls - copies_before
        return None if per_call else (t, k)

    def close(self, timeout_s: float = 60.0) -> dict:
        """Finish every request as the scheduler does, drain, check every row and slot came back."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        mgr = self.mgr
        for req in self.running:
            req.finished_reason = FINISH_ABORT()
            if not mgr.offload_kv_cache(req):
                mgr.finalize_release_on_finish(req)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.held is not None:
                self.held.release()
            mgr.check_offload_progress()
            if self._idle():
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.kind}: offload did not drain in {timeout_s:g} s")
            time.sleep(0.002)
        leaks = (self.free_slots - self.alloc.available_size(), self.free_rows - self.pool.available_size(),
                 self.tree.protected_size_)
        if self.kind == SGLANG:
            mgr.release_host_resources()
            mgr.cache_controller._stop_storage_threads()
        else:
            mgr.release_host_resources()
        if leaks != (0, 0, 0):
            raise RuntimeError(f"{self.kind} left {leaks[0]} slots, {leaks[1]} rows, protected {leaks[2]} behind")
        stored = sum(1 for _ in os.scandir(self.store))
        shutil.rmtree(self.store, ignore_errors=True)
        return {"pages_stored": stored}

    def _idle(self) -> bool:
        if self.kind == SGLANG:
            return not self.mgr.ongoing_offload and not self.mgr.ongoing_backup
        return self.mgr.idle() and len(self.mgr.ongoing_offload) == 0


class Measure:
    """One run's measured steps: per step (net of SGLang's copy) and per call."""

    KEYS = ("progress", "idle", "enqueue", "finished_idle", "release", "deferred")

    def __init__(self) -> None:
        self.totals: list[int] = []
        self.copies: list[int] = []
        self.calls: dict[str, list] = {k: [] for k in self.KEYS}

    def step(self, run: Run, per_call: bool) -> None:
        if per_call:
            run.step(True, self.calls)
        else:
            t, k = run.step(False, None)
            self.totals.append(t)
            self.copies.append(k)

    def result(self, run: Run, steps: int, load: float, end: dict) -> dict:
        net = net_of_copy(self.totals, self.copies)
        calls = self.calls
        us = lambda v: v / 1e3  # noqa: E731
        med = lambda key: us(statistics.median(calls[key])) if calls[key] else float("nan")  # noqa: E731
        return {
            "p50": us(percentile(net, 50)), "p99": us(percentile(net, 99)),
            "copy_p50": us(percentile(self.copies, 50)), "gross_p50": us(percentile(self.totals, 50)),
            "idle_call": med("idle"), "enqueue_call": med("enqueue"), "release_call": med("release"),
            "progress_call": med("progress"),
            "enqueues_per_step": len(calls["enqueue"]) / max(1, steps // 2),
            "releases_per_step": (len(calls["release"]) + len(calls["deferred"])) / max(1, steps // 2),
            "deferred": len(calls["deferred"]), "sglang_copies": run.copy_calls, "load": load, **end,
        }


def run_pair(env: SGLangEnv, pair: int, running: int, page: int, steps: int, warmup: int, gap_s: float,
             seed: int, output: tuple[int, int], overhead_ns: int, copies: str = "threads") -> dict[str, dict]:
    """One pair: both managers over their own fresh pools, the same seed, stepped in lockstep (step
    ``i`` of one, then step ``i`` of the other, which goes first alternating step by step and pair by
    pair), so that what else loads the machine falls on both alike. Warm-up, then ``steps`` measured
    steps alternating per step / per call."""
    gc.collect()
    load_start = os.getloadavg()[0]
    env.publish(page)
    first, second = pair_order(pair)
    runs = {kind: Run(env, kind, running, page, seed, output, overhead_ns, copies) for kind in (first, second)}
    for i in range(warmup):
        for kind in (first, second) if i % 2 == 0 else (second, first):
            runs[kind].step(False, None)
        time.sleep(gap_s)
    measures = {kind: Measure() for kind in runs}
    for i in range(steps):
        for kind in step_order(pair, i):
            measures[kind].step(runs[kind], per_call=bool(i % 2))
        time.sleep(gap_s)
    ends = {kind: runs[kind].close() for kind in (first, second)}
    load = max(load_start, os.getloadavg()[0])
    return {kind: measures[kind].result(runs[kind], steps, load, ends[kind]) for kind in runs}


ROWS = (("p50", "per step p50"), ("p99", "per step p99"), ("idle_call", "call, no chunk due"),
        ("enqueue_call", "call that enqueues a chunk"), ("release_call", "finished request's release"),
        ("progress_call", "check_offload_progress"))
PER_STEP_TARGET, PER_CALL_TARGET = 0.5, 1.0  # issue 33: per step at 256 running requests; per call


def quiet_pairs(ours: list[dict], theirs: list[dict], cpus: int) -> list[int]:
    """The pairs (indices) in which the 1-minute load average stayed at or below ``cpus`` at the start
    and end of both runs: the machine was not oversubscribed by others."""
    return [i for i, (o, t) in enumerate(zip(ours, theirs)) if max(o["load"], t["load"]) <= cpus]


def target_of(key: str, running: int) -> float | None:
    """Issue 33's bound on the drop-in / SGLang ratio of a figure (None: no bound)."""
    if key in ("p50", "p99"):
        return PER_STEP_TARGET if running == 256 else None
    return PER_CALL_TARGET if key in ("enqueue_call", "release_call") else None


def report(results: dict, pairs: int) -> None:
    print()
    print(f"scheduler-thread CPU, us: median over {pairs} pair(s) of each run's figure; ratio = median over the "
          f"pairs of drop-in / sglang (range: min-max); sglang's CPU stand-in copy subtracted")
    print(f"{'running/page':>12} {'figure':<28} {'sglang':>9} {'drop-in':>9} {'ratio':>7} {'range':>11} "
          f"{'target':>7}  met")
    for (running, page), by_kind in results.items():
        s, d = by_kind[SGLANG], by_kind[DROPIN]
        for key, label in ROWS:
            sv, dv = summarize(s, key), summarize(d, key)
            both = [(x[key], y[key]) for x, y in zip(d, s) if x[key] == x[key] and y[key] == y[key] and y[key] > 0]
            bound = target_of(key, running)
            rt, rng, met = "-", "-", "-"
            if both:
                rs = ratios([o for o, _ in both], [t for _, t in both])
                ratio = statistics.median(rs)
                rt, rng = f"{ratio:.2f}x", f"{min(rs):.2f}-{max(rs):.2f}"
                met = "-" if bound is None else ("yes" if ratio <= bound else "NO")
            tg = "-" if bound is None else f"<={bound:.2f}x"
            print(f"{f'{running}/{page}':>12} {label:<28} {fmt(sv)} {fmt(dv)} {rt:>7} {rng:>11} {tg:>7}  {met}")
        quiet = quiet_pairs(d, s, os.cpu_count() or 1)
        if quiet:
            parts = []
            for key in ("p50", "p99"):
                parts.append(f"{key} {ratio_text(ratios([d[i][key] for i in quiet], [s[i][key] for i in quiet]))}")
            print(f"{'':>12} quiet pairs (load <= {os.cpu_count()} at both runs' start and end): {len(quiet)} of "
                  f"{len(s)}; per step ratio " + ", ".join(parts))
        else:
            print(f"{'':>12} quiet pairs (load <= {os.cpu_count()} at both runs' start and end): none of {len(s)}")
        same = all(x["pages_stored"] == y["pages_stored"] for x, y in zip(d, s))
        print(f"{'':>12} sglang's copy (subtracted): {summarize(s, 'copy_p50'):.1f} us per step p50; "
              f"chunks/step {summarize(s, 'enqueues_per_step'):.1f}, "
              f"finished/step {summarize(s, 'releases_per_step'):.2f}; "
              f"pages stored per run {summarize(s, 'pages_stored'):.0f} "
              f"({'the same for both managers in every pair' if same else 'DIFFERENT between the managers'})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="RUNNING/PAGE,... (default %(default)s)")
    ap.add_argument("--pairs", type=int, default=5, help="paired runs per configuration (default %(default)s)")
    ap.add_argument("--steps", type=int, default=400, help="measured steps per run, half per step, half per call")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per run (default 2 x page + 32)")
    ap.add_argument("--output", default="64,256", help="output tokens per request, MIN,MAX (default %(default)s)")
    ap.add_argument("--gap-ms", type=float, default=5.0, help="sleep between steps: the forward pass")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dropin-copies", choices=("threads", "after-calls"), default="threads",
                    help="when the drop-in's CPU copy workers start a copy: at once (threads, as a CPU "
                         "deployment runs) or once the step's calls end (after-calls: as on a GPU, no copy "
                         "thread beside the measured calls); default %(default)s")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 64/16 and 32/64, 1 pair, 24 steps")
    ap.add_argument("--json", metavar="PATH", help="also write every run's figures as JSON")
    args = ap.parse_args(argv)
    from importlib.metadata import PackageNotFoundError, version
    try:
        release = version("sglang")
    except PackageNotFoundError:
        release = None
    if release != "0.5.19":
        print(f"bench_sglang_step: needs SGLang 0.5.19 (its own manager is what it measures), found {release}; "
              "build the environment with `bash .ci/sglang-env VENV 0.5.19`", file=sys.stderr)
        return 2
    if args.quick:
        args.configs, args.pairs, args.steps, args.output = "64/16,32/64", 1, 24, "32,96"
    configs = parse_configs(args.configs)
    output = tuple(int(x) for x in args.output.split(","))
    if len(output) != 2 or not 2 <= output[0] <= output[1]:
        ap.error("--output is MIN,MAX with 2 <= MIN <= MAX")
    if args.pairs < 1 or args.steps < 2:
        ap.error("--pairs >= 1 and --steps >= 2")

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    logging.disable(logging.WARNING)  # SGLang's per-construction INFO lines and CPU-platform notices
    try:
        import sglang  # noqa: F401
        from sglang.srt.disaggregation import decode_kvcache_offload_manager  # noqa: F401
    except ImportError as err:
        print(f"bench_sglang_step: sglang does not import here ({err}); run it with the environment "
              f"`bash .ci/sglang-env` prepares, e.g. /work/sglang-venv/bin/python {sys.argv[0]}", file=sys.stderr)
        return 2
    from importlib.metadata import version

    overhead = clock_overhead_ns()
    env = SGLangEnv(overhead)
    print(machine())
    print(f"SGLang {version('sglang')}; {load_line()} at start")
    print(f"managers: sglang = {NAMES[SGLANG]}")
    print(f"          drop-in = {NAMES[DROPIN]} (this checkout)")
    print(f"KV {LAYERS} layers x {HEADS} heads x {HEAD_DIM} bf16, stride = page, "
          f"output {output[0]}-{output[1]} tokens, "
          f"{args.steps} measured steps per run ({args.steps // 2} per step, {args.steps // 2} per call), "
          f"{args.gap_ms:g} ms gap, {args.pairs} pairs per configuration, order alternating; "
          f"thread_time clock cost {overhead} ns (subtracted per call); "
          f"drop-in copies: {args.dropin_copies}")
    results: dict = {c: {SGLANG: [], DROPIN: []} for c in configs}
    try:
        for pair, (running, page) in schedule(configs, args.pairs):
            warmup = args.warmup if args.warmup is not None else 2 * page + 32
            both = run_pair(env, pair, running, page, args.steps, warmup, args.gap_ms / 1e3,
                            args.seed + pair, output, overhead, args.dropin_copies)  # the same seed for both runs of a pair
            for kind in pair_order(pair):
                r = both[kind]
                results[(running, page)][kind].append(r)
                print(f"  pair {pair + 1}/{args.pairs} {running}/{page} {kind:<7} p50 {r['p50']:8.1f} us "
                      f"p99 {r['p99']:8.1f} us (sglang's copy subtracted: {r['copy_p50']:.1f}; "
                      f"load {r['load']:.2f})", flush=True)
    finally:
        env.close()
    finish(report, results, args.pairs, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
