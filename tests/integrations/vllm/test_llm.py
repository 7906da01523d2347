"""The connector inside a whole vLLM 0.32.0 engine on CPU: ``LLM(...)`` over a local tiny Llama
with random weights (``load_format="dummy"``, ``skip_tokenizer_init=True``, nothing downloaded), the
connector loaded by ``kv_connector_module_path`` in vLLM's own engine core, scheduler, CPU worker,
model runner (``KVConnectorModelRunnerMixin``) and CPU attention backend.

Run with and without async scheduling (vLLM's ``AsyncScheduler``: ``num_computed_tokens`` runs a
step ahead of the KV written). Checked: generation completes; the pages stored are exactly the decode pages the forwards wrote,
under the chain names of the generated tokens, in SGLang's HiCacheFile names; each page's bytes are
what vLLM's KV blocks held when the copy was submitted (read through ``VllmKVLayout``, the worker's
own view of vLLM's tensors).
"""

from __future__ import annotations

import os

import pytest

from tests.integrations.vllm.vllm_kit import require_vllm

BS = 32


@pytest.fixture(params=[False, True], ids=["sync", "async-scheduling"])
def llm(tmp_path, monkeypatch, request):
    require_vllm()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the engine core in this process
    from vllm import LLM

    from lifecycle_tools.testkit.vllm_engine import tiny_llama

    store = tmp_path / "hicache"
    engine = LLM(model=tiny_llama(tmp_path), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                 block_size=BS, max_model_len=512, max_num_seqs=4, gpu_memory_utilization=0.05,
                 async_scheduling=request.param,
                 kv_cache_memory_bytes=32 << 20, disable_hybrid_kv_cache_manager=True, dtype="float32", seed=0,
                 kv_transfer_config={"kv_connector": "LifecycleConnector", "kv_role": "kv_both",
                                     "kv_connector_module_path": "lifecycle.integrations.vllm.connector",
                                     "kv_connector_extra_config": {"storage": f"file:{store}",
                                                                   "model_name": "org/tiny"},
                                     "kv_load_failure_policy": "recompute"})
    yield engine, store
    engine.llm_engine.engine_core.shutdown()


def _worker_connector():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def test_a_whole_engine_stores_the_decode_pages_its_forwards_wrote(llm):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from hashing import page_hashes
    from lifecycle.integrations.vllm.worker import StoreWorker

    engine, store = llm
    worker = _worker_connector()
    assert type(worker).__name__ == "LifecycleConnector" and worker.worker is not None
    seen: dict[tuple, bytes] = {}          # host page written by a copy -> the block's bytes then
    run = StoreWorker.run

    def recording(self, jobs):
        for op in jobs.ops:
            if type(op).__name__ == "Write":
                pages = self.layout.page_bytes_of(op.blocks)
                for i, page in enumerate(op.host_pages):
                    seen[(op.ack, page)] = pages[i].reshape(-1).view(__import__("torch").uint8).numpy().tobytes()
        return run(self, jobs)
    StoreWorker.run = recording
    try:
        prompts = [list(range(10 + i, 50 + 7 * i)) for i in range(3)] + [list(range(500, 540))]
        # the last: 40 + 57 tokens, 96 with KV at finish: its page [64, 96) is whole only then
        lengths = [70, 70, 70, 57]
        outs = engine.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths], use_tqdm=False)
    finally:
        StoreWorker.run = run
    sched = engine.llm_engine.engine_core.engine_core.scheduler
    assert (type(sched).__name__ == "AsyncScheduler") == engine.llm_engine.vllm_config.scheduler_config.async_scheduling
    import time

    deadline = time.monotonic() + 60       # the last copies' stores settle on later steps: the
    while sched.has_requests():            # connector keeps vLLM stepping (has_pending_push_work)
        assert time.monotonic() < deadline
        engine.llm_engine.engine_core.engine_core.step()
        time.sleep(0.001)
    assert sched.connector.store.idle() and worker.worker.idle()
    expected = {}
    for prompt, out, n in zip(prompts, outs, lengths):
        tokens = prompt + list(out.outputs[0].token_ids)
        assert len(out.outputs[0].token_ids) == n
        written = len(tokens) - 1                      # the last sampled token has no KV
        names = page_hashes(tokens[: written // BS * BS], BS)
        for i in range(len(prompt) // BS, written // BS):
            expected[names[i]] = i
    suffix = "_org-tiny_0_1.bin"
    files = sorted(os.listdir(store))
    assert files == sorted(f"{h}{suffix}" for h in expected) and len(files) == 8
    copied = set(seen.values())
    for name in files:
        data = (store / name).read_bytes()
        assert len(data) == worker.layout.page_nbytes
        assert data in copied              # the bytes vLLM's blocks held when the copy ran
    assert not sched.requests
    pool = sched.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
