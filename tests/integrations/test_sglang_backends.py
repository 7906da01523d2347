"""Issue 20, point 1: every storage backend SGLang 0.5.19 can configure, through the drop-in.

Mooncake goes through our Mooncake tier, configured exactly as SGLang's ``MooncakeStore`` reads its
configuration (extra-config, the JSON file in ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``, the
``MOONCAKE_*`` variables), against a real master and segment holder: SGLang's object names, the
device KV's bytes, and a page SGLang wrote is read by us. The other backends go through one adapter
over the ``HiCacheStorage`` object SGLang's ``StorageBackendFactory`` builds: driven here with
SGLang's own ``HiCacheFile`` (built by the real factory, ``dynamic``) where sglang imports, and with
a backend of SGLang's tensor interface otherwise.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from lifecycle.integrations.sglang import DecodeKVCacheOffloadManager, SGLangConfigError, use_runtime
from lifecycle.integrations.sglang.backends import HostPoolView, SGLangBackendStorage
from lifecycle_tools.testkit.mooncake_server import (  # noqa: F401 (fixtures)
    make_mooncake, mooncake_session_master, require_mooncake,
)
from lifecycle_tools.testkit.sglang_doubles import runtime_context
from tests.integrations.sglang_kit import Node, doubles_kit, require_sglang, sglang_kit
from tests.integrations.test_sglang import expected_pages, run_decode
from transfer.host_pool import HostPool

MODEL = "org/Model-7B"
ENV_VARS = ("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", "MOONCAKE_MASTER", "MOONCAKE_CLIENT", "MOONCAKE_PROTOCOL",
            "MOONCAKE_LOCAL_HOSTNAME", "MOONCAKE_GLOBAL_SEGMENT_SIZE", "MOONCAKE_DEVICE", "LOCAL_HOSTNAME",
            "KV_LIFECYCLE_REQUIRE_CHECKSUM", "SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE")


@pytest.fixture(autouse=True)
def clean_env(tmp_path, monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "hicache"))


def build(node, **ctx):
    with use_runtime(runtime_context(page_size=node.ps, model=MODEL, **ctx)):
        return DecodeKVCacheOffloadManager(req_to_token_pool=node.pool, token_to_kv_pool_allocator=node.alloc,
                                           tp_group=None, tree_cache=node.tree)


# --- Mooncake --------------------------------------------------------------------------------------


def sglang_mooncake_names(page_hash: str, tp_rank: int = 0) -> list[str]:
    """SGLang's MooncakeStore object names of an MHA page (no pipeline parallelism, no backend tag)."""
    base = f"{'-'.join(MODEL.split('/'))}_{page_hash}"
    return [f"{base}_{tp_rank}_k", f"{base}_{tp_rank}_v"]


@pytest.fixture
def mooncake_pair(make_mooncake):
    """A dedicated master and a segment holder (objects outlive the client that wrote them), and
    SGLang's side: a raw Mooncake client contributing no memory."""
    from transfer.storage.mooncake_conn import import_store

    master = make_mooncake()
    make_mooncake.holder(master)
    store_cls, _ = import_store()
    raw = store_cls()
    assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master.address) == 0
    yield master, raw
    raw.close()


def _configure(source: str, master: str, tmp_path, monkeypatch) -> dict:
    """SGLang's three Mooncake configuration sources; returns the runtime-context keywords."""
    fields = {"master_server_address": master, "protocol": "tcp", "local_hostname": "127.0.0.1",
              "global_segment_size": 0, "metadata_server": "P2PHANDSHAKE", "device_name": ""}
    if source == "extra_config":
        return {"backend": "mooncake", "extra_config": json.dumps(fields)}
    if source == "config_file":
        path = tmp_path / "mooncake.json"
        path.write_text(json.dumps(fields))
        monkeypatch.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(path))
        return {"backend": "mooncake"}
    monkeypatch.setenv("MOONCAKE_MASTER", master)
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "0")
    return {"backend": "mooncake"}


@pytest.mark.parametrize("source", ["extra_config", "config_file", "env"])
def test_mooncake_through_the_drop_in_writes_sglangs_objects_with_the_device_kvs_bytes(
        mooncake_pair, source, tmp_path, monkeypatch):
    master, raw = mooncake_pair
    node = Node(doubles_kit(), page_size=4)
    free_pages = node.alloc.available_size()
    mgr = build(node, **_configure(source, master.address, tmp_path, monkeypatch))
    assert mgr.storage.settings.master == master.address and mgr.storage.settings.global_segment_size == 0
    reqs = run_decode(node, mgr, [("a", list(range(10, 23)), 11, 0), ("b", list(range(50, 58)), 9, 0)])
    stats = mgr.stats()
    assert (stats.released, stats.leaked) == (2, 0) and node.alloc.available_size() == free_pages
    assert mgr.storage.stats().stored == stats.pages_enqueued > 0
    mgr.release_host_resources()
    half = mgr.decode_host_mem_pool.page_nbytes // 2
    for req in reqs:
        for page_hash, data in expected_pages(node, req, mgr.offload_stride):
            k, v = sglang_mooncake_names(page_hash)
            out = torch.zeros(2 * half, dtype=torch.uint8)
            # what SGLang's batch_get_v1 does: K and V of its page_first host page, zero-copy
            raw.register_buffer(out.data_ptr(), 2 * half)
            try:
                got = raw.batch_get_into([k, v], [out.data_ptr(), out.data_ptr() + half], [half, half])
            finally:
                raw.unregister_buffer(out.data_ptr())
            assert got == [half, half], (req.rid, page_hash)
            assert out.numpy().tobytes() == data


def test_a_page_sglang_wrote_to_mooncake_is_read_by_the_drop_ins_store_unverified_or_refused_strict(
        mooncake_pair, tmp_path, monkeypatch):
    from lifecycle.integrations.sglang import read_config
    from lifecycle.integrations.sglang.storage import open_storage

    master, raw = mooncake_pair
    ctx = _configure("extra_config", master.address, tmp_path, monkeypatch)
    host = HostPool(3, 2, 8, torch.bfloat16, 4, 16)
    page = torch.randint(0, 255, (host.page_nbytes,), dtype=torch.uint8)
    page_hash, half = "cd" * 32, host.page_nbytes // 2
    k, v = sglang_mooncake_names(page_hash)
    raw.register_buffer(page.data_ptr(), host.page_nbytes)
    try:  # SGLang's batch_set_v1: K and V halves of its host page, under its names
        assert raw.batch_put_from([k, v], [page.data_ptr(), page.data_ptr() + half], [half, half]) == [0, 0]
    finally:
        raw.unregister_buffer(page.data_ptr())
    for strict in (False, True):
        env = {**os.environ, "KV_LIFECYCLE_REQUIRE_CHECKSUM": "1" if strict else "0"}
        config = read_config(runtime_context(page_size=4, model=MODEL, **ctx), env)
        store = open_storage(config, host, 0, 1, False)
        try:
            into = torch.zeros(host.page_nbytes, dtype=torch.uint8)
            assert store.batch_get([page_hash], [into]) == [not strict]
            assert into.numpy().tobytes() == (bytes(host.page_nbytes) if strict else page.numpy().tobytes())
            stats = store.stats()
            assert (stats.hits, stats.misses, stats.unverified) == ((0, 1, 0) if strict else (1, 0, 1))
        finally:
            store.close()


# --- the adapter over SGLang's HiCacheStorage ---------------------------------------------------------


class TensorInterfaceBackend:
    """A backend with SGLang's ``HiCacheStorage`` tensor interface (what ``_generic_page_set`` /
    ``_generic_page_get`` call), keeping bytes per key; for when sglang does not import."""

    def __init__(self):
        self.pages: dict[str, bytes] = {}
        self.registered = None
        self.fail_writes = False

    def register_mem_pool_host(self, pool):
        self.registered = pool

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        if self.fail_writes:
            return False
        for key, value in zip(keys, values):
            self.pages[key] = value.contiguous().view(torch.uint8).numpy().tobytes()
        return True

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        out = []
        for key, target in zip(keys, target_locations):
            data = self.pages.get(key)
            if data is None:
                out.append(None)
                continue
            target.view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            out.append(target)
        return out

    def batch_exists(self, keys, extra_info=None):
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n


def test_the_adapter_stores_sglangs_bytes_counts_unverified_reads_and_strict_mode_refuses_them():
    host = HostPool(2, 2, 8, torch.bfloat16, 4, 16)
    backend = TensorInterfaceBackend()
    store = SGLangBackendStorage(backend, "aibrix", "_org-M_0_1", host.page_nbytes)
    page = host.page_view(0)
    page.copy_(torch.randn(page.shape).to(page.dtype))
    keys = ["ab" * 32, "cd" * 32]
    assert store.batch_set(keys[:1], [page]) == [True]
    assert backend.pages[keys[0]] == page.contiguous().view(torch.uint8).numpy().tobytes()
    assert store.batch_exists(keys) == 1
    into = [torch.zeros_like(host.page_view(1)), torch.full_like(host.page_view(2), 7)]
    assert store.batch_get(keys, into) == [True, False]
    assert torch.equal(into[0], page) and not into[1].any()  # a miss leaves nothing behind
    stats = store.stats()
    assert (stats.stored, stats.hits, stats.misses, stats.unverified) == (1, 1, 1, 1)
    strict = SGLangBackendStorage(backend, "aibrix", "_org-M_0_1", host.page_nbytes, require_checksum=True)
    assert strict.batch_get(keys[:1], [torch.zeros_like(page)]) == [False]
    assert strict.stats().unverified == 1
    backend.fail_writes = True
    assert store.batch_set(keys[1:], [page]) == [False] and store.stats().errors == 1


def test_the_host_pool_view_is_what_sglangs_backends_read_of_mem_pool_host():
    host = HostPool(3, 2, 8, torch.bfloat16, 4, 16)
    view = HostPoolView(host)
    assert (view.layout, view.page_size, view.dtype, view.layer_num, view.head_num, view.head_dim) == (
        "page_first", 4, torch.bfloat16, 3, 2, 8)
    assert view.get_size_per_token() * view.page_size == host.page_nbytes
    data = torch.arange(host.page_nbytes, dtype=torch.uint8)
    view.set_from_flat_data_page(8, data)  # host index 8: page 2, as SGLang passes token indices
    assert torch.equal(view.get_data_page(8).view(torch.uint8), data)


def test_sglangs_own_factory_builds_the_backend_the_adapter_drives_and_hicachefile_reads_every_page(tmp_path):
    """Where sglang imports: ``dynamic`` -> SGLang's StorageBackendFactory builds SGLang's own
    HiCacheFile; the decode loop stores through the adapter; HiCacheFile reads each page bit-exact."""
    require_sglang()
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    node = Node(sglang_kit(), page_size=4)
    extra = {"backend_name": "hicache-file", "module_path": "sglang.srt.mem_cache.hicache_storage",
             "class_name": "HiCacheFile"}
    mgr = build(node, backend="dynamic", extra_config=json.dumps(extra))
    assert isinstance(mgr.storage, SGLangBackendStorage) and isinstance(mgr.storage.backend, HiCacheFile)
    reqs = run_decode(node, mgr, [("a", list(range(10, 23)), 11, 0), ("b", [3] * 9, 10, 0)])
    assert mgr.stats().released == 2
    sglang_file, nbytes = mgr.storage.backend, mgr.decode_host_mem_pool.page_nbytes
    n = 0
    for req in reqs:
        for page_hash, data in expected_pages(node, req, mgr.offload_stride):
            target = torch.empty(nbytes, dtype=torch.uint8)
            assert sglang_file.get(page_hash, target) is not None
            assert target.numpy().tobytes() == data
            n += 1
    assert n == mgr.storage.stats().stored > 0
    mgr.release_host_resources()


def test_an_adapted_backend_without_sglang_is_refused_in_one_line():
    try:
        import sglang  # noqa: F401
        pytest.skip("sglang imports here: the factory path runs instead")
    except ImportError:
        pass
    node = Node(doubles_kit(), page_size=4)
    with pytest.raises(SGLangConfigError, match="backend aibrix: goes through SGLang's own StorageBackendFactory"):
        build(node, backend="aibrix")
