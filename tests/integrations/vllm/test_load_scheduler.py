"""The load path under vLLM 0.32.0's real ``Scheduler`` / ``KVCacheManager`` / ``BlockPool`` on CPU.

The connector is loaded by vLLM's factory from ``kv_connector_module_path`` (``LoadConnector``
below: the load half of the connector, wired exactly as docs/integration.md's "Loading prefixes"
lists the call sites); the worker side runs in-process over the KV tensors vLLM's own
``allocate_kv_cache`` makes (the CPU backend's head-major layout), driven step by step as vLLM's
model runner drives it (``kv_connector_model_runner_mixin``). Skipped without vLLM (run by
``.ci/vllm-env``), failed without it under ``KV_LIFECYCLE_REQUIRE_VLLM=1``.

Checked: a stored prefix is loaded bit-exact into the blocks vLLM allocated (read back as vLLM's CPU
kernel addresses them) and vLLM computes only the rest; a late join (the lookup pending: ``None``,
the request not scheduled and holding no block, then answered); the scheduler thread never waits
on a hung tier (other requests keep running); pages that fail to load come back through
``get_block_ids_with_load_errors`` and vLLM recomputes from the first of them; an abort while a
load writes its blocks holds them until the worker reports the load (vLLM 0.32 holds a request in
``WAITING_FOR_REMOTE_KVS`` itself; the planner's ``request_finished`` says the same), and every
block returns to vLLM's pool exactly once.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

import hashing
from lifecycle_tools.testkit.vllm_kv import read_kv
from transfer.storage.file import FileStorage
from transfer.storage.integrity import PageFormat

REQUIRE_ENV = "KV_LIFECYCLE_REQUIRE_VLLM"
if os.environ.get(REQUIRE_ENV) != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (.ci/vllm-env runs these tests)")

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs, get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from lifecycle.integrations.vllm.layout import VllmKVLayout  # noqa: E402
from lifecycle_tools.testkit.vllm_engine import worker_output  # noqa: E402
from lifecycle.integrations.vllm.load import LoadJob, LoadWorker  # noqa: E402
from lifecycle.integrations.vllm.lookup import LoadPlanner  # noqa: E402

BS, LAYERS, HEADS, DIM, BLOCKS = 16, 3, 2, 32, 40
DTYPE = torch.bfloat16
SUFFIX = "_org-M_0_1"
MODULE = __name__
DEADLINE_S = 60.0
PAGE_NBYTES = 2 * BS * LAYERS * HEADS * DIM * 2
FORMAT = PageFormat.of("page_first", DTYPE, (2, BS, LAYERS, HEADS, DIM))
GATES: dict[str, threading.Event] = {}   # a test's hung tier: lookups wait on it


class LoadMeta(KVConnectorMetadata):
    def __init__(self, load_jobs: list[LoadJob]) -> None:
        self.load_jobs = load_jobs


class _GatedStore:
    """The scheduler side's tier, whose lookups wait while the test's gate is closed (a hung tier)."""

    def __init__(self, inner, gate: threading.Event | None) -> None:
        self.inner, self.gate, self.suffix, self.page_nbytes = inner, gate, inner.suffix, inner.page_nbytes

    def batch_exists(self, keys):
        if self.gate is not None:
            assert self.gate.wait(DEADLINE_S)
        return self.inner.batch_exists(keys)


class LoadConnector(KVConnectorBase_V1):
    """The load half of the connector: the call sites of docs/integration.md, "Loading prefixes"."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.store = FileStorage(extra["dir"], SUFFIX, PAGE_NBYTES, page_format=FORMAT)
        self.block_size = vllm_config.cache_config.block_size
        if role == KVConnectorRole.SCHEDULER:
            self.planner = LoadPlanner(_GatedStore(self.store, GATES.get(extra["dir"])), self.block_size)
            self.finished_calls: list[str] = []
        self.loader: LoadWorker | None = None

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.planner.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.planner.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return LoadMeta(self.planner.take_load_jobs())

    def update_connector_output(self, connector_output):
        self.planner.on_finished_recving(connector_output.finished_recving)

    def request_finished(self, request, block_ids):
        self.finished_calls.append(request.request_id)
        return self.planner.request_finished(request.request_id), None

    # worker side
    def register_kv_caches(self, kv_caches):
        self.loader = LoadWorker(VllmKVLayout.from_kv_caches(kv_caches, self.block_size), self.store)

    def start_load_kv(self, forward_context, **kwargs):
        self.loader.start(self._get_connector_metadata().load_jobs)

    def wait_for_layer_load(self, layer_name):
        self.loader.wait(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass

    def get_finished(self, finished_req_ids):
        return None, self.loader.finished_recving()

    def get_block_ids_with_load_errors(self):
        return self.loader.load_error_block_ids()

    def shutdown(self):
        if self.loader is not None:
            self.loader.close(DEADLINE_S)


class Engine:
    """vLLM's scheduler and, in-process, the worker side over ``allocate_kv_cache``'s tensors,
    stepped as vLLM's engine core and model runner step them."""

    def __init__(self, tmp_path, *, gate: threading.Event | None = None, store_dir=None) -> None:
        model = tmp_path / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "num_hidden_layers": LAYERS,
            "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 512, "head_dim": DIM,
            "torch_dtype": "bfloat16"}))
        self.dir = str(store_dir or tmp_path / "store")   # the tier's directory (a HiCacheFile directory)
        os.makedirs(self.dir, exist_ok=True)
        if gate is not None:
            GATES[self.dir] = gate
        cache = CacheConfig(block_size=BS, enable_prefix_caching=True)
        cache.kv_cache_layout = "LBHNC"   # what the engine core resolves for the CPU backend
        self.config = VllmConfig(
            model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", seed=0),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
                                             enable_chunked_prefill=True, is_encoder_decoder=False,
                                             disable_hybrid_kv_cache_manager=True),
            cache_config=cache,
            kv_transfer_config=KVTransferConfig(
                kv_connector="LoadConnector", kv_connector_module_path=MODULE, kv_role="kv_both",
                kv_load_failure_policy="recompute", kv_connector_extra_config={"dir": self.dir}),
            device_config=DeviceConfig("cpu"))
        spec = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
            block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype=DTYPE) for i in range(LAYERS)}
        page = next(iter(spec.values())).page_size_bytes
        (self.kv_cache_config,) = get_kv_cache_configs(self.config, [spec], [page * LAYERS * BLOCKS])
        self.config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=self.kv_cache_config, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(self.config), block_size=BS)
        self.connector = self.scheduler.connector
        self.caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC)
        self.worker = LoadConnector(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.worker.register_kv_caches(self.caches)
        self.scheduled: dict[str, list[int]] = {}   # request -> tokens scheduled per step
        init_none_hash(sha256)

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 1) -> Request:
        params = SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, 999)
        req = Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=params, pooling_params=None,
                      block_hasher=get_request_block_hasher(BS, sha256))
        self.scheduler.add_request(req)
        return req

    def step(self):
        """One engine step: schedule, the worker's connector calls around a forward (which writes
        no KV: only the loaded blocks are compared), the output back to the scheduler."""
        out = self.scheduler.schedule()
        kv_out = worker_output(self.worker, out, layers=self.caches)
        req_ids = list(out.num_scheduled_tokens)
        for rid, n in out.num_scheduled_tokens.items():
            self.scheduled.setdefault(rid, []).append(n)
        if not req_ids and kv_out.is_empty():
            return out   # vLLM's executor returns an empty output: update_from_output sees nothing new
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[7] for _ in req_ids], kv_connector_output=kv_out))
        return out

    def run_until(self, predicate, what: str) -> None:
        for _ in range(int(DEADLINE_S / 0.005)):
            if predicate():
                return
            self.step()
            threading.Event().wait(0.005)
        raise AssertionError(f"never reached: {what}")

    def blocks_of(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def store_prefix(self, tokens: list[int], seed: int = 0) -> tuple[list[str], torch.Tensor]:
        """Pages of ``tokens`` stored as an SGLang node stores them: page-first host pages of known
        KV (``[2, layers, pages * BS, heads, dim]``) under our chain names."""
        names = hashing.page_hashes(tokens, BS)
        gen = torch.Generator().manual_seed(seed)
        kv = torch.randn((2, LAYERS, len(names) * BS, HEADS, DIM), generator=gen).to(DTYPE)
        pages = kv.view(2, LAYERS, len(names), BS, HEADS, DIM).permute(2, 0, 3, 1, 4, 5).contiguous()
        assert all(self.worker.store.batch_set(names, [p.reshape(-1).view(torch.uint8) for p in pages]))
        return names, kv

    def loaded_kv(self, blocks: list[int]) -> torch.Tensor:
        """The KV of ``blocks`` as vLLM's CPU kernel reads it (``[2, layers, n * BS, heads, dim]``)."""
        slots = (torch.tensor(blocks).view(-1, 1) * BS + torch.arange(BS)).reshape(-1)
        return read_kv(self.caches, "rows", DIM)[:, :, slots]

    def assert_every_block_free_once(self) -> None:
        pool = self.scheduler.kv_cache_manager.block_pool
        assert not self.scheduler.requests and not self.scheduler.running
        assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1   # the null block aside
        assert all(b.ref_cnt == 0 for b in pool.blocks)

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.planner.close()
        GATES.pop(self.dir, None)


@pytest.fixture
def engine(tmp_path):
    e = Engine(tmp_path)
    yield e
    e.close()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_stored_prefix_is_loaded_bit_exact_into_the_blocks_vllm_allocated_and_only_the_rest_computed(engine):
    tokens = list(range(100, 170))                      # 4 whole pages + 6 tokens
    names, kv = engine.store_prefix(tokens[:64])
    engine.add("a", tokens)
    engine.run_until(lambda: engine.scheduler.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS,
                     "the request waits for its load")
    blocks = engine.blocks_of("a")
    engine.run_until(lambda: "a" in engine.scheduled, "the request is scheduled after its load")
    assert engine.scheduled["a"][0] == 70 - 64          # vLLM computes only what was not loaded
    assert _same(engine.loaded_kv(blocks[:4]), kv)      # bit-exact, where vLLM's kernel reads it
    engine.run_until(lambda: not engine.scheduler.requests, "the request finishes")
    assert engine.worker.loader.stats().pages_loaded == 4
    engine.assert_every_block_free_once()


def test_a_late_join_the_scheduler_skips_the_request_while_its_lookup_is_pending_and_never_waits(tmp_path):
    gate = threading.Event()
    engine = Engine(tmp_path, gate=gate)
    try:
        tokens = list(range(300, 350))
        _names, kv = engine.store_prefix(tokens[:48])
        engine.add("late", tokens)
        for _ in range(3):                               # the tier hangs: schedule() returns all the same
            out = engine.step()
            assert "late" not in out.num_scheduled_tokens
            assert engine.scheduler.requests["late"].status == RequestStatus.WAITING
            assert not engine.blocks_of("late")          # nothing allocated while pending
        gate.set()
        engine.run_until(lambda: engine.scheduler.requests["late"].status == RequestStatus.WAITING_FOR_REMOTE_KVS,
                         "the lookup answers and the request waits for its load")
        blocks = engine.blocks_of("late")
        engine.run_until(lambda: "late" in engine.scheduled, "the late request is scheduled")
        assert engine.scheduled["late"][0] == 50 - 48
        assert _same(engine.loaded_kv(blocks[:3]), kv)
        engine.run_until(lambda: not engine.scheduler.requests, "the request finishes")
        engine.assert_every_block_free_once()
    finally:
        gate.set()
        engine.close()


def test_pages_that_fail_to_load_are_recomputed_by_vllm_from_the_first_of_them(engine):
    tokens = list(range(500, 570))
    names, kv = engine.store_prefix(tokens[:64])
    gone = threading.Event()
    original = engine.worker.store.batch_get

    def evicted_between_lookup_and_load(keys, into):     # page 2 evicted after the lookup answered
        if not gone.is_set():
            gone.set()
            engine.worker.store.delete(names[2])
        return original(keys, into)

    engine.worker.store.batch_get = evicted_between_lookup_and_load
    engine.add("e", tokens)
    engine.run_until(lambda: engine.scheduler.requests["e"].status == RequestStatus.WAITING_FOR_REMOTE_KVS,
                     "the request waits for its load")
    blocks = engine.blocks_of("e")
    engine.run_until(lambda: "e" in engine.scheduled, "the request is scheduled after its failed load")
    assert engine.scheduled["e"][0] == 70 - 2 * BS       # recomputed from the first page that failed
    assert _same(engine.loaded_kv(blocks[:2]), kv[:, :, :2 * BS])
    engine.run_until(lambda: not engine.scheduler.requests, "the request finishes")
    engine.assert_every_block_free_once()


def test_an_abort_while_a_load_writes_the_blocks_holds_them_until_the_load_is_reported(engine):
    tokens = list(range(700, 750))
    engine.store_prefix(tokens[:48])
    hold, entered = threading.Event(), threading.Event()
    original = engine.worker.store.batch_get

    def slow(keys, into):
        entered.set()
        assert hold.wait(DEADLINE_S)
        return original(keys, into)

    engine.worker.store.batch_get = slow
    engine.add("x", tokens)
    engine.run_until(entered.is_set, "the load reads the tier")
    blocks = engine.blocks_of("x")
    pool = engine.scheduler.kv_cache_manager.block_pool
    engine.scheduler.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    assert engine.connector.finished_calls == ["x"]
    assert all(pool.blocks[b].ref_cnt == 1 for b in blocks)   # held: the load still writes them
    engine.step()
    assert all(pool.blocks[b].ref_cnt == 1 for b in blocks)
    hold.set()
    engine.run_until(lambda: not engine.scheduler.requests, "the aborted request's blocks are freed")
    engine.assert_every_block_free_once()


def test_many_requests_share_and_miss_prefixes_and_every_block_returns_once(engine):
    base = list(range(1000, 1064))
    _names, kv = engine.store_prefix(base)
    for i in range(6):
        tail = [2000 + 10 * i + j for j in range(5 + i)]
        engine.add(f"r{i}", base[: 16 * (1 + i % 4)] + tail, max_tokens=3)
    engine.add("miss", list(range(3000, 3040)), max_tokens=2)
    engine.run_until(lambda: not engine.scheduler.requests and engine.worker.loader.idle(), "all requests finish")
    for i in range(6):
        n = 16 * (1 + i % 4) + 5 + i
        hit = 16 * (1 + i % 4)
        # a hit of the same pages another request loaded is vLLM's own local hit: never loaded twice
        assert sum(engine.scheduled[f"r{i}"]) >= n - hit + 2
    assert engine.scheduled["miss"][0] == 40
    engine.assert_every_block_free_once()
