"""One fleet, two engines across virtual environments: SGLang 0.5.19's own classes and vLLM 0.32.0's
real scheduler share one HiCacheFile directory, and each loads the other's pages bit-exact.

    python bench/cross_engine_check.py [--sglang-python /work/sglang-venv/bin/python]
                                       [--vllm-python /work/vllm-venv/bin/python] [--dir DIR]

Three phases, each in its own interpreter (the two engines never share a process or a venv):

1. ``sglang-write`` (SGLang's venv): SGLang's own ``get_hash_str`` names prompt A's pages and SGLang's
   own ``HiCacheFile.set`` writes them (raw page bytes in SGLang's ``page_first`` host layout, no seal),
   as SGLang's HiCache controller stores a host page (``get_data_page(index, flat=True)``).
2. ``vllm`` (vLLM's venv): vLLM's real ``Scheduler`` / ``KVCacheManager`` / ``BlockPool`` with the load
   path as a connector loaded by module path (``tests/integrations/vllm/test_load_scheduler.py``'s
   ``LoadConnector``) and the worker side over ``allocate_kv_cache``'s tensors: prompt A's request is
   looked up (our chain), loaded into the blocks vLLM allocated, only the rest computed, and the
   loaded blocks hold exactly the KV SGLang's pages carry (read as vLLM's CPU kernel reads them).
   Then prompt B's KV is read out of vLLM blocks (``VllmKVLayout``, what the connector's store path
   writes) into the same directory under our chain names.
3. ``sglang-read`` (SGLang's venv): SGLang's own ``HiCacheFile`` finds prompt B's pages under SGLang's
   own names (``batch_exists``) and reads them (``get``) byte-identical to SGLang's page layout of
   the same KV.

The KV is arithmetic (small integers, exact in bf16), so both venvs compute the same values without
sharing a generator. Prints one line per phase and ``OK``, or ``FAILED`` with the reason (exit 1).
Measured here: docs/integration.md, "Loading prefixes".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BS, LAYERS, HEADS, DIM = 16, 3, 2, 32
MODEL = "org/M"
PROMPT_A = [100 + i for i in range(4 * BS + 6)]          # 4 whole pages stored by SGLang, then 6 tokens
PROMPT_B = [5000 + 3 * i for i in range(3 * BS + 1)]     # 3 whole pages stored by vLLM


def kv_of(n_tokens: int, salt: int):
    """``[positions, 2, layers, heads, dim]`` bf16 KV, the same in any torch: small integers."""
    import torch

    pos = torch.arange(n_tokens).view(-1, 1, 1, 1, 1)
    kind = torch.arange(2).view(1, -1, 1, 1, 1)
    layer = torch.arange(LAYERS).view(1, 1, -1, 1, 1)
    head = torch.arange(HEADS).view(1, 1, 1, -1, 1)
    dim = torch.arange(DIM).view(1, 1, 1, 1, -1)
    return (((pos * 131 + kind * 61 + layer * 17 + head * 7 + dim * 3 + salt) % 251) - 125).to(torch.bfloat16)


def page_first(kv, page: int):
    """SGLang's ``page_first`` host page of positions ``[page*BS, (page+1)*BS)``: ``[2, BS, L, H, D]``."""
    return kv[page * BS:(page + 1) * BS].permute(1, 0, 2, 3, 4).contiguous()


def _hicache_file(directory: str):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name=MODEL)
    return HiCacheFile(config, file_path=directory)


def sglang_write(directory: str) -> None:
    from sglang.srt.mem_cache.utils import get_hash_str

    store = _hicache_file(directory)
    names = get_hash_str(PROMPT_A[: 4 * BS], None, page_size=BS)
    kv = kv_of(len(PROMPT_A), salt=0)
    ok = [store.set(name, page_first(kv, i)) for i, name in enumerate(names)]
    assert all(ok) and len(names) == 4, ok
    print(f"sglang-write: SGLang {__import__('sglang').__version__} HiCacheFile wrote {len(names)} pages "
          f"(suffix {store.config_suffix})")


def vllm_phase(directory: str) -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    import tests.integrations.vllm.test_load_scheduler as t
    from vllm.v1.request import RequestStatus

    import hashing
    from lifecycle.integrations.vllm.layout import VllmKVLayout

    assert (t.BS, t.LAYERS, t.HEADS, t.DIM) == (BS, LAYERS, HEADS, DIM) and t.SUFFIX == "_org-M_0_1"
    with tempfile.TemporaryDirectory() as tmp:
        engine = t.Engine(Path(tmp), store_dir=directory)   # the shared HiCacheFile directory
        try:
            engine.add("a", PROMPT_A)
            engine.run_until(lambda: engine.scheduler.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS,
                             "prompt A waits for its load")
            blocks = engine.blocks_of("a")[:4]
            engine.run_until(lambda: "a" in engine.scheduled, "prompt A is scheduled after its load")
            computed = engine.scheduled["a"][0]
            assert computed == len(PROMPT_A) - 4 * BS, computed
            want = kv_of(len(PROMPT_A), salt=0)[: 4 * BS].permute(1, 2, 0, 3, 4)
            got = engine.loaded_kv(blocks)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "loaded KV differs"
            print(f"vllm: vLLM {__import__('vllm').__version__} real Scheduler loaded SGLang's 4 pages bit-exact "
                  f"into blocks {blocks}, computed {computed} tokens")
            # prompt B: vLLM blocks holding its KV, read out as the store path writes them
            kv_b = kv_of(len(PROMPT_B), salt=9)
            caches = engine.caches
            free = [b for b in range(1, engine.kv_cache_config.num_blocks) if b not in blocks][:3]
            layout = VllmKVLayout.from_kv_caches(caches, BS)
            layout.write_pages(free, torch.stack([page_first(kv_b, i) for i in range(3)]))
            names = hashing.page_hashes(PROMPT_B, BS)
            pages = layout.page_bytes_of(free)
            assert all(engine.worker.store.batch_set(names, [p.reshape(-1).view(torch.uint8) for p in pages]))
            print(f"vllm: stored prompt B's {len(names)} pages from blocks {free}")
            engine.run_until(lambda: not engine.scheduler.requests, "prompt A finishes")
            engine.assert_every_block_free_once()
        finally:
            engine.close()


def sglang_read(directory: str) -> None:
    import torch
    from sglang.srt.mem_cache.utils import get_hash_str

    store = _hicache_file(directory)
    names = get_hash_str(PROMPT_B[: 3 * BS], None, page_size=BS)
    assert store.batch_exists(names) == 3, "SGLang does not find vLLM's pages under its names"
    kv = kv_of(len(PROMPT_B), salt=9)
    for i, name in enumerate(names):
        want = page_first(kv, i)
        into = torch.empty_like(want)
        assert store.get(name, into) is not None, f"page {i} not read"
        assert torch.equal(into.view(torch.int16), want.view(torch.int16)), f"page {i} differs"
    print(f"sglang-read: SGLang's HiCacheFile found and read vLLM's {len(names)} pages byte-identical")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", nargs="?", choices=["sglang-write", "vllm", "sglang-read"])
    parser.add_argument("directory", nargs="?")
    parser.add_argument("--sglang-python", default="/work/sglang-venv/bin/python")
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    parser.add_argument("--dir", default=None, help="the shared directory (default: a temporary one)")
    args = parser.parse_args()
    if args.phase:
        {"sglang-write": sglang_write, "vllm": vllm_phase, "sglang-read": sglang_read}[args.phase](args.directory)
        return 0
    directory = args.dir or tempfile.mkdtemp(prefix="cross-engine-")
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    for phase, python in (("sglang-write", args.sglang_python), ("vllm", args.vllm_python),
                          ("sglang-read", args.sglang_python)):
        run = subprocess.run([python, __file__, phase, directory], env=env, capture_output=True, text=True)
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith(phase.split("-")[0])]
        print("\n".join(lines))
        if run.returncode:
            print(f"FAILED in {phase}: {run.stderr.strip().splitlines()[-1] if run.stderr.strip() else run.returncode}")
            return 1
    print(f"OK: one directory ({directory}), SGLang's pages loaded by vLLM, vLLM's pages read by SGLang, bit-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
