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
from tests.integrations.sglang_kit import Node, doubles_kit, require_sglang, sglang_kit, sglang_version
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
    from transfer.storage.mooncake.conn import import_store

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


# --- the adapter's contract, call by call ----------------------------------------------------------

import dataclasses  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

import structlog  # noqa: E402

from lifecycle.integrations.sglang.backends import storage_config  # noqa: E402
from lifecycle.integrations.sglang.storage import ReplicaStorage, open_storage, plan_storage  # noqa: E402
from tests.data import sglang_0_5_19, sglang_0_5_23  # noqa: E402
from transfer.errors import InvalidKey, PageSizeMismatch  # noqa: E402

KEYS = ["ab" * 32, "cd" * 32, "ef" * 32]


@pytest.fixture
def hicache_storage_config(monkeypatch):
    """SGLang's ``HiCacheStorageConfig`` importable: the real one where sglang imports, else the
    verbatim stand-in of ``tests/data/sglang_0_5_19`` under its module name."""
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    except ImportError:
        module = types.ModuleType("sglang.srt.mem_cache.hicache_storage")
        module.HiCacheStorageConfig = HiCacheStorageConfig = sglang_0_5_19.HiCacheStorageConfig
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return HiCacheStorageConfig


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("extra", [{}, {"backend_name": "b", "interface_v1": 0, "tp_lcm_size": 4}])
def test_storage_config_is_the_one_sglangs_controller_generates(hicache_storage_config, mla, extra):
    given = dict(extra)
    ours = storage_config(tp_rank=1, tp_size=2, pp_rank=2, pp_size=3, mla=mla, model="org/Model-7B", extra=extra)
    from_controller = (sglang_0_5_23 if sglang_version() == "0.5.23" else sglang_0_5_19).storage_config_from_controller
    sglang = from_controller(
        tp_rank=1, tp_size=2, pp_rank=2, pp_size=3, attn_cp_group_rank_size=(0, 1), is_mla=mla,
        layout="page_first", model_name="org/Model-7B", extra_config=extra)
    assert isinstance(ours, hicache_storage_config)
    assert dataclasses.asdict(ours) == dataclasses.asdict(sglang)
    assert extra == given and ours.extra_config is not extra  # the caller's mapping is left alone


class FakeFactory:
    """SGLang's ``StorageBackendFactory.create_backend`` seam: records its call, builds ``make()``."""

    def __init__(self, make):
        self.make, self.calls = make, []

    def create_backend(self, name, config, pool):
        self.calls.append((name, config, pool))
        return self.make()


def _adapted_config(tmp_path, backend="aibrix", strict=False):
    from lifecycle.integrations.sglang import read_config

    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path), "KV_LIFECYCLE_REQUIRE_CHECKSUM": "1" if strict else "0"}
    return read_config(runtime_context(page_size=4, model=MODEL, backend=backend, pp_rank=1, pp_size=2,
                                       extra_config=json.dumps({"k": "v"})), env)


@pytest.mark.parametrize("strict", [False, True])
def test_an_adapted_backend_is_built_by_sglangs_factory_over_the_host_pool_view(
        hicache_storage_config, tmp_path, strict):
    host = HostPool(3, 2, 8, torch.bfloat16, 4, 16)
    factory = FakeFactory(TensorInterfaceBackend)
    store = open_storage(_adapted_config(tmp_path, strict=strict), host, 1, 2, False, factory=factory)
    (name, config, view), = factory.calls
    assert name == "aibrix" and isinstance(view, HostPoolView) and view.host is host
    assert (config.tp_rank, config.tp_size, config.pp_rank, config.pp_size, config.is_mla_model,
            config.model_name, config.extra_config) == (1, 2, 1, 2, False, MODEL, {"k": "v"})
    assert isinstance(store, SGLangBackendStorage) and store.backend.registered is view
    assert (store.name, store.suffix, store.page_nbytes, store.require_checksum) == (
        "aibrix", sglang_0_5_19.HiCacheFileNames(config).config_suffix, host.page_nbytes, strict)
    store.close()


def test_mla_replicas_of_an_adapted_backend_write_nothing(hicache_storage_config, tmp_path):
    host = HostPool(3, 1, 8, torch.bfloat16, 4, 16, mla=True)
    factory = FakeFactory(TensorInterfaceBackend)
    store = open_storage(_adapted_config(tmp_path), host, 1, 2, True, factory=factory)
    assert isinstance(store, ReplicaStorage) and isinstance(store.reader, SGLangBackendStorage)
    assert store.batch_set(KEYS[:1], [host.page_view(0)]) == [True] and store.reader.backend.pages == {}
    assert factory.calls[0][1].is_mla_model is True
    owner = open_storage(_adapted_config(tmp_path), host, 0, 2, True, factory=factory)
    assert isinstance(owner, SGLangBackendStorage)


def test_without_sglang_an_adapted_backend_plan_names_the_backend_and_the_import_error():
    try:
        import sglang  # noqa: F401
        pytest.skip("sglang imports here")
    except ImportError:
        pass
    with pytest.raises(SGLangConfigError, match=r"^--hicache-storage-backend eic: goes through SGLang's own "
                                                r"StorageBackendFactory, and sglang does not import \(No module"):
        plan_storage(_adapted_config("/nonexistent", backend="eic"), 0, 1, False)


def test_a_factory_failure_is_one_config_error_naming_the_backend_and_sglangs_error(hicache_storage_config, tmp_path):
    host = HostPool(3, 2, 8, torch.bfloat16, 4, 16)

    def boom():
        raise RuntimeError("no aibrix server")

    with pytest.raises(SGLangConfigError) as err:
        open_storage(_adapted_config(tmp_path), host, 0, 1, False, factory=FakeFactory(boom))
    assert str(err.value) == ("--hicache-storage-backend aibrix: SGLang's StorageBackendFactory could not "
                              "build it: RuntimeError: no aibrix server")
    assert isinstance(err.value.__cause__, RuntimeError)

    def missing():
        raise ImportError("No module named 'aibrix_kvcache'")

    with pytest.raises(SGLangConfigError) as err:
        open_storage(_adapted_config(tmp_path), host, 0, 1, False, factory=FakeFactory(missing))
    assert str(err.value) == ("--hicache-storage-backend aibrix: SGLang's backend does not import "
                              "(No module named 'aibrix_kvcache')")
    assert isinstance(err.value.__cause__, ImportError)


def test_a_backend_without_register_mem_pool_host_is_used_as_built(hicache_storage_config, tmp_path):
    class Plain:
        def batch_set(self, keys, values):
            return True

    host = HostPool(3, 2, 8, torch.bfloat16, 4, 16)
    store = open_storage(_adapted_config(tmp_path), host, 0, 1, False, factory=FakeFactory(Plain))
    assert isinstance(store.backend, Plain) and store.batch_set(KEYS[:1], [host.page_view(0)]) == [True]
    store.close()  # no close() on the backend: nothing to call


def test_the_host_pool_view_of_an_mla_pool_and_its_page_helpers():
    host = HostPool(3, 1, 8, torch.bfloat16, 4, 16, mla=True)
    view = HostPoolView(host)
    assert (view.device, view.head_num, view.head_dim, view.size, view.page_num) == ("cpu", 1, 8, 16, 4)
    assert view.kv_buffer is host.buffer
    per_token = view.get_size_per_token()
    assert type(per_token) is int and per_token == host.page_nbytes // 4
    assert view.get_ksize_per_token() == per_token  # MLA: one latent, no V
    page = view.get_data_page(5, flat=False)  # token 5: page 1, in the host buffer's own shape
    assert page.shape == host.buffer[1].shape and page.data_ptr() == host.buffer[1].data_ptr()
    dummy = view.get_dummy_flat_data_page()
    assert dummy.shape == (host.buffer[0].numel(),) and dummy.dtype == host.dtype and not dummy.any()
    assert type(view.get_ksize_per_token()) is int
    mha = HostPoolView(HostPool(3, 2, 8, torch.bfloat16, 4, 16))
    assert mha.device == "cpu" and mha.get_ksize_per_token() * 2 == mha.get_size_per_token()
    assert type(mha.get_ksize_per_token()) is int
    one = HostPoolView(HostPool(3, 2, 8, torch.bfloat16, 4, 4))  # a host pool of one page
    assert not one.get_dummy_flat_data_page().any() and one.get_dummy_flat_data_page().numel() == 3 * 2 * 8 * 4 * 2


class RaisingBackend(TensorInterfaceBackend):
    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        raise OSError("disk gone")

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        raise OSError("read gone")

    def close(self):
        raise OSError("close gone")


def _pages(host, n):
    return [host.page_view(i).fill_(i + 1) for i in range(n)]


def test_a_backend_write_that_raises_fails_every_page_counted_and_logged():
    host = HostPool(2, 2, 8, torch.bfloat16, 4, 16)
    store = SGLangBackendStorage(RaisingBackend(), "eic", "_s", host.page_nbytes)
    with structlog.testing.capture_logs() as logs:
        assert store.batch_set(KEYS[:2], _pages(host, 2)) == [False, False]
    assert store.stats().errors == 2 and store.stats().stored == 0
    assert logs == [{"event": "sglang.backend_write_failed", "log_level": "warning", "backend": "eic",
                     "pages": 2, "error": repr(OSError("disk gone"))}]


@pytest.mark.parametrize("answer", [False, None, [True, True]])
def test_a_backend_write_not_answered_true_fails_every_page_counted_and_logged(answer):
    host = HostPool(2, 2, 8, torch.bfloat16, 4, 16)
    backend = TensorInterfaceBackend()
    backend.batch_set = lambda keys, values: answer
    store = SGLangBackendStorage(backend, "aibrix", "_s", host.page_nbytes)
    with structlog.testing.capture_logs() as logs:
        assert store.batch_set(KEYS[:2], _pages(host, 2)) == [False, False]
    assert (store.stats().errors, store.stats().stored) == (2, 0)
    assert logs == [{"event": "sglang.backend_write_failed", "log_level": "warning", "backend": "aibrix",
                     "pages": 2, "result": repr(answer)}]


def test_a_backend_read_that_raises_misses_every_page_counted_and_logged():
    host = HostPool(2, 2, 8, torch.bfloat16, 4, 16)
    store = SGLangBackendStorage(RaisingBackend(), "eic", "_s", host.page_nbytes)
    into = [torch.full_like(host.page_view(0), 3) for _ in range(2)]
    with structlog.testing.capture_logs() as logs:
        assert store.batch_get(KEYS[:2], into) == [False, False]
    stats = store.stats()
    assert (stats.errors, stats.misses, stats.hits, stats.unverified) == (2, 2, 0, 0)
    assert logs == [{"event": "sglang.backend_read_failed", "log_level": "warning", "backend": "eic",
                     "pages": 2, "error": repr(OSError("read gone"))}]


def test_strict_mode_counts_every_refused_page_as_an_unverified_miss_without_reading():
    host = HostPool(2, 2, 8, torch.bfloat16, 4, 16)
    backend = TensorInterfaceBackend()
    store = SGLangBackendStorage(backend, "aibrix", "_s", host.page_nbytes, require_checksum=True)
    assert store.batch_set(KEYS[:2], _pages(host, 2)) == [True, True] and len(backend.pages) == 2
    assert store.batch_get(KEYS[:2], [torch.empty_like(host.page_view(0)) for _ in range(2)]) == [False, False]
    stats = store.stats()
    assert (stats.stored, stats.hits, stats.misses, stats.unverified) == (2, 0, 2, 2)


def test_the_first_unverified_read_warns_once_per_store():
    host = HostPool(2, 2, 8, torch.bfloat16, 4, 16)
    backend = TensorInterfaceBackend()
    store = SGLangBackendStorage(backend, "dynamic", "_s", host.page_nbytes)
    into = [torch.empty_like(host.page_view(0))]
    with structlog.testing.capture_logs() as logs:
        assert store.batch_get(KEYS[:1], into) == [False]  # a miss is not an unverified page
        assert logs == []
        store.batch_set(KEYS[:1], _pages(host, 1))
        assert store.batch_get(KEYS[:1], into) == [True]
        assert store.batch_get(KEYS[:1], into) == [True]
    assert [(e["event"], e["backend"]) for e in logs] == [("sglang.backend_unverified_pages", "dynamic")]
    assert "KV_LIFECYCLE_REQUIRE_CHECKSUM=1" in logs[0]["why"]
    assert store.stats().unverified == 2


def test_a_backend_answering_a_count_hits_the_leading_pages_and_zeroes_the_rest():
    host = HostPool(2, 2, 8, torch.bfloat16, 4, 16)
    backend = TensorInterfaceBackend()
    backend.batch_get = lambda keys, targets: 2
    store = SGLangBackendStorage(backend, "eic", "_s", host.page_nbytes)
    into = [torch.full_like(host.page_view(0), 9) for _ in range(3)]
    assert store.batch_get(KEYS, into) == [True, True, False]
    assert bool((into[0] == 9).all()) and bool((into[1] == 9).all()) and not into[2].any()
    backend.batch_get = lambda keys, targets: None  # nothing answered: every page missed
    assert store.batch_get(KEYS[:2], into[:2]) == [False, False] and not into[0].any()
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.unverified) == (2, 3, 2)


def test_adapter_batches_are_checked_before_the_backend_sees_them():
    host = HostPool(2, 2, 8, torch.bfloat16, 4, 16)
    backend = TensorInterfaceBackend()
    store = SGLangBackendStorage(backend, "aibrix", "_s", host.page_nbytes)
    short = torch.zeros(host.page_nbytes // 2, dtype=torch.uint8)
    with pytest.raises(PageSizeMismatch):
        store.batch_set(KEYS[:1], [short])
    with pytest.raises(PageSizeMismatch):
        store.batch_get(KEYS[:1], [short])
    strict = SGLangBackendStorage(backend, "aibrix", "_s", host.page_nbytes, require_checksum=True)
    with pytest.raises(PageSizeMismatch):
        strict.batch_get(KEYS[:1], [short])
    with pytest.raises(InvalidKey):
        store.batch_exists(["not-a-hash"])
    with pytest.raises(InvalidKey):
        store.delete("not-a-hash")
    assert backend.pages == {} and store.stats() == type(store.stats())()
    assert store.batch_set([], []) == [] and store.batch_get([], []) == [] and store.batch_exists([]) == 0


def test_adapter_delete_removes_nothing_and_close_never_raises():
    host = HostPool(2, 2, 8, torch.bfloat16, 4, 16)
    backend = TensorInterfaceBackend()
    store = SGLangBackendStorage(backend, "aibrix", "_s", host.page_nbytes)
    store.batch_set(KEYS[:1], _pages(host, 1))
    assert store.delete(KEYS[0]) is False and store.batch_exists(KEYS[:1]) == 1
    closed = []
    backend.close = lambda: closed.append(True)
    store.close()
    assert closed == [True]
    failing = SGLangBackendStorage(RaisingBackend(), "eic", "_s", host.page_nbytes)
    with structlog.testing.capture_logs() as logs:
        failing.close()
    assert logs == [{"event": "sglang.backend_close_failed", "log_level": "warning", "backend": "eic",
                     "error": repr(OSError("close gone"))}]
