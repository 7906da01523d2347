"""The drop-in and SGLang's own ``DecodeKVCacheOffloadManager`` over the same requests, page stores
compared name by name and byte by byte (issue 36), in whichever tested release is installed
(0.5.19 or 0.5.23; run by ``.ci/sglang-env``, skipped without sglang, failed under
``KV_LIFECYCLE_REQUIRE_SGLANG=1``).

Two decode nodes of SGLang's own pools, allocator, tree cache (0.5.19 ``ChunkCache``, 0.5.23
``UnifiedRadixCache``, the caches a decode server without radix caching builds) and ``Req``\\s, under
SGLang's ``ServerArgs`` (PD decode + decode offload, ``page_first_direct`` host layout with the
``direct`` io backend) published as the scheduler's runtime context: one drives SGLang's own
manager, the other ours, over the same requests — plain, with a LoRA ``extra_key``, with a
``cache_salt``, with both, all of the same tokens. Each writes to its own store: a HiCacheFile
directory (file backend), or a real ``mooncake_master`` of its own (Mooncake backend: SGLang's own
``MooncakeStore`` against one, our Mooncake tier against the other).

On a CPU machine two pieces of SGLang's own manager cannot run as shipped, and are replaced here:
its host pool's ``cudaHostRegister`` (no CUDA driver: a no-op), and sgl_kernel's
``transfer_kv_all_layer_direct_lf_pf`` (not importable without CUDA: ``_direct_lf_pf``, a torch
index copy of the same signature: layer-first device rows into page-first-direct host pages).
Everything else — its hashing and namespace seeds, its HiCacheController, its host pool's layout and
``get_data_page``, its HiCacheFile writes, its MooncakeStore (configuration, buffer registration,
zero-copy puts over TCP) — is SGLang's own.
"""

from __future__ import annotations

import os
import time
import urllib.request
from array import array

import pytest
import torch

from lifecycle_tools.testkit.mooncake_server import make_mooncake  # noqa: F401 (fixture)
from tests.integrations.sglang_kit import (
    Node, require_sglang, sglang_kit, sglang_version, start_scheduler_process, stop_scheduler_process, tiny_llama,
)

MODEL = "org/Tiny-Llama"
PROMPT = list(range(10, 23))  # three prompt pages (the prefill node's) and one token
# (rid, extra_key, cache_salt): the same tokens in four namespaces
REQUESTS = [("plain", None, None), ("lora", "lora-7", None), ("salted", None, "tenant-a"),
            ("both", "lora-8", "tenant-b")]


def _direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """sgl_kernel's ``transfer_kv_all_layer_direct_lf_pf`` in torch: ``src_ptrs`` are the device
    pool's per-layer buffers (K layers then V layers, ``[slots, heads, dim]``), ``dst_ptrs`` the
    host pool's K and V (``[pages, layers, page_size, heads, dim]``); each device row
    ``src_indices[i]`` goes to host token ``dst_indices[i]`` of every layer."""
    layers = len(src_ptrs) // len(dst_ptrs)
    src, dst = src_indices.to(torch.int64).cpu(), dst_indices.to(torch.int64).cpu()
    pages, offsets = dst // page_size, dst % page_size
    for kind, host in enumerate(dst_ptrs):
        for layer in range(layers):
            host[pages, layer, offsets] = src_ptrs[kind * layers + layer][src].to(host.device)


MOONCAKE_ENV = ("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", "MOONCAKE_MASTER", "MOONCAKE_CLIENT", "MOONCAKE_PROTOCOL",
                "MOONCAKE_LOCAL_HOSTNAME", "LOCAL_HOSTNAME", "MOONCAKE_GLOBAL_SEGMENT_SIZE", "MOONCAKE_DEVICE",
                "MOONCAKE_TE_META_DATA_SERVER", "MOONCAKE_TENANT_ID", "MOONCAKE_STANDALONE_STORAGE",
                "MOONCAKE_CHECK_SERVER", "MOONCAKE_ENABLE_SSD_OFFLOAD")


@pytest.fixture
def decode_scheduler(backend, tmp_path, monkeypatch):
    """SGLang's ServerArgs resolved and published as in a decode scheduler process (page_first_direct +
    direct, storage ``backend``), its gloo model-parallel groups (one rank), and the two CPU stand-ins
    above."""
    require_sglang()
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    import sglang.srt.mem_cache.pool_host.common as host_common
    import sglang.srt.mem_cache.pool_host.mha as host_mha
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.server_args import ServerArgs


    monkeypatch.setattr(host_common, "_cuda_host_register", lambda *a, **k: None)
    monkeypatch.setattr(host_mha, "transfer_kv_all_layer_direct_lf_pf", _direct_lf_pf, raising=False)
    monkeypatch.delenv("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", raising=False)
    for var in MOONCAKE_ENV:
        monkeypatch.delenv(var, raising=False)
    # hicache_ratio 2.0: what SGLang's kv_cache_builder resolves for decode offload (it does not run here)
    args = ServerArgs(model_path=tiny_llama(tmp_path), skip_tokenizer_init=True, device="cpu", page_size=4,
                      served_model_name=MODEL, disaggregation_mode="decode",
                      disaggregation_decode_enable_offload_kvcache=True, hicache_storage_backend=backend,
                      hicache_io_backend="direct", hicache_mem_layout="page_first_direct", hicache_ratio=2.0)
    start_scheduler_process(args)
    try:
        yield ps.get_tp_group().cpu_group
    finally:
        stop_scheduler_process()


def _node():
    """A decode node of SGLang's own classes: pools, allocator, the release's decode tree cache, Reqs."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.sampling.sampling_params import SamplingParams

    kit = sglang_kit()

    def make_req(rid, prompt, max_new):
        req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=max_new))
        req.max_new_tokens = max_new
        return req

    def make_tree(pool, alloc):
        common = dict(disable=True, req_to_token_pool=pool, token_to_kv_pool_allocator=alloc,
                      page_size=alloc.page_size)
        try:
            from sglang.srt.mem_cache.chunk_cache import ChunkCache  # 0.5.19
        except ImportError:  # 0.5.23: UnifiedRadixCache, disabled, full attention only
            from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

            return UnifiedRadixCache(CacheInitParams(**common, tree_components=(ComponentType.FULL,)))
        return ChunkCache(CacheInitParams(**common))

    kit.Req, kit.TreeCache = make_req, make_tree
    return Node(kit, page_size=4)


def _run(node, mgr, requests, idle) -> None:
    """Admit ``requests`` one after the other, decode each to its end with SGLang's offload calls,
    then wait until ``idle()`` (copies landed, storage writes done)."""
    for rid, extra_key, salt in requests:
        req = node.admit(rid, PROMPT, 11)
        req.extra_key, req.cache_salt = extra_key, salt
        running = [req]
        while running:
            running = node.decode_step(mgr, running)
    deadline = time.monotonic() + 120
    while not idle():
        assert time.monotonic() < deadline, "offload did not drain"
        mgr.check_offload_progress()
        time.sleep(0.005)


def _file_store(directory) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".bin"):
            with open(os.path.join(directory, name), "rb") as f:
                out[name] = f.read()
    return out


def _mooncake_store(master) -> dict[str, bytes]:
    """Every object ``master`` knows (its HTTP ``/get_all_keys``), each read back raw by a Mooncake
    client of its own (``get``: the object's bytes, whatever wrote them)."""
    from transfer.storage.mooncake.conn import import_store

    with urllib.request.urlopen(f"http://127.0.0.1:{master.metrics_port}/get_all_keys", timeout=30) as resp:
        names = resp.read().decode().split("\n")
    store_cls, _ = import_store()
    raw = store_cls()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.address) == 0
    try:
        out = {}
        for name in filter(None, names):
            out[name] = bytes(raw.get(name))
            assert out[name], f"{name} is listed but reads back empty"
        return out
    finally:
        raw.close()


def _mooncake_node(request, monkeypatch):
    """A dedicated master with a segment holder (objects outlive the client that wrote them, so the
    store is read after the manager is gone), configured through SGLang's ``MOONCAKE_*`` variables,
    which SGLang's ``MooncakeStore`` and the drop-in both read; returns the master."""
    make_mooncake = request.getfixturevalue("make_mooncake")
    master = make_mooncake()
    make_mooncake.holder(master)
    for var, value in (("MOONCAKE_MASTER", master.address), ("MOONCAKE_PROTOCOL", "tcp"),
                       ("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1"), ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "0"),
                       ("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE")):
        monkeypatch.setenv(var, value)
    return master


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_the_drop_in_stores_the_pages_sglangs_own_manager_stores_name_by_name_byte_by_byte(
        backend, decode_scheduler, tmp_path, monkeypatch, request):
    """File: each manager's HiCacheFile directory. Mooncake: SGLang's own ``MooncakeStore`` and the
    drop-in's Mooncake tier, each against its own ``mooncake_master``; compared are SGLang's K and V
    objects (``{model}_{hash}_{tp}_k`` / ``_v``). Listed apart and left out of the comparison: the
    drop-in's seal objects (``…_{tp}_kvlp``, exactly one per page it wrote) and SGLang's warmup object
    (``sglang_mooncake_store_warmup_key…``, one, written by ``MooncakeStore.warmup`` at setup)."""
    from sglang.srt.disaggregation.decode_kvcache_offload_manager import DecodeKVCacheOffloadManager as Own

    from lifecycle.integrations.sglang import DecodeKVCacheOffloadManager as Ours

    release = sglang_version()
    # 0.5.19's own manager names every request's pages from its tokens alone; the drop-in names a
    # LoRA / salted request's pages in its namespace (as 0.5.23 does): compared on plain requests there
    requests = REQUESTS if release == "0.5.23" else REQUESTS[:1]
    stores = {}
    for who, cls in (("own", Own), ("ours", Ours)):
        if backend == "mooncake":
            master = _mooncake_node(request, monkeypatch)
        else:
            directory = tmp_path / f"hicache-{who}"
            monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(directory))
        node = _node()
        free_pages, free_rows = node.alloc.available_size(), node.pool.available_size()
        mgr = cls(req_to_token_pool=node.pool, token_to_kv_pool_allocator=node.alloc,
                  tp_group=decode_scheduler, tree_cache=node.tree)
        if who == "own":
            assert type(mgr.decode_host_mem_pool).__name__ == "MHATokenToKVPoolHost"
            assert mgr.decode_host_mem_pool.layout == "page_first_direct"
            if backend == "mooncake":
                storage = mgr.cache_controller.storage_backend
                assert type(storage).__name__ == "MooncakeStore"
                assert storage.config.master_server_address == master.address
            idle = lambda m=mgr: not m.ongoing_offload and not m.ongoing_backup  # noqa: E731
        else:
            assert mgr.sglang_release.behaves_as == release and mgr.config.mem_layout == "page_first_direct"
            if backend == "mooncake":
                assert mgr.storage.inner.settings.master == master.address  # behind page_first_direct's layout
            idle = mgr.idle
        _run(node, mgr, requests, idle)
        assert node.alloc.available_size() == free_pages and node.pool.available_size() == free_rows, who
        if who == "ours":
            stats = mgr.stats()
            assert (stats.released, stats.leaked) == (len(requests), 0)
        mgr.release_host_resources()
        stores[who] = _mooncake_store(master) if backend == "mooncake" else _file_store(directory)
    own, ours = stores["own"], stores["ours"]
    pages = (11 - 1 + 1) // 4 * len(requests)  # whole decode pages past the prompt's three, per request
    if backend == "mooncake":
        kv = lambda store: {n: b for n, b in store.items() if n.endswith(("_0_k", "_0_v"))}  # noqa: E731
        own_rest, ours_rest = sorted(set(own) - set(kv(own))), sorted(set(ours) - set(kv(ours)))
        own, ours = kv(own), kv(ours)
        assert len(own_rest) == 1 and own_rest[0].startswith("sglang_mooncake_store_warmup_key"), own_rest
        assert ours_rest == sorted(n[:-len("_k")] + "_kvlp" for n in ours if n.endswith("_k")), ours_rest
        assert all(n.startswith("org-Tiny-Llama_") for n in own), sorted(own)
        pages *= 2  # a K and a V object per page
    assert len(own) == pages > 0
    assert sorted(ours) == sorted(own)                                    # name by name
    for name, data in own.items():
        assert ours[name] == data, name                                   # byte by byte


def test_the_namespace_seed_is_sglangs_own_function():
    """``hashing.namespace_seed`` (what ``lifecycle.requests.namespace_of`` seeds a chain with) equals
    SGLang 0.5.23's ``storage_namespace_seed`` on plain, LoRA, salted and non-ASCII inputs."""
    require_sglang()
    if sglang_version() != "0.5.23":
        pytest.skip("storage_namespace_seed is SGLang 0.5.23's (0.5.19 has no namespace)")
    from sglang.srt.mem_cache.utils import storage_namespace_seed

    from hashing import namespace_seed

    cases = [(None, None), ("lora-7", None), (None, "tenant-a"), ("lora-7", "tenant-a"), ("", ""),
             ("", None), (None, ""), ("ключ", "соль"), ("🦀" * 3, "a\x00b"), ("x" * 1000, "y")]
    for extra_key, salt in cases:
        assert namespace_seed(extra_key, salt) == storage_namespace_seed(extra_key, salt), (extra_key, salt)
