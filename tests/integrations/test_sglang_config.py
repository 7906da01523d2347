"""What the integration reads from SGLang's configuration, and the one typed error for what it
cannot honour: raised at construction, before a directory, host pool or thread exists."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from lifecycle import ConfigError, LifecycleError
from lifecycle.integrations.sglang import (
    DecodeKVCacheOffloadManager, SGLangConfigError, read_config, use_runtime,
)
from lifecycle.integrations.sglang.device_pool import from_sglang
from lifecycle.integrations.sglang.runtime import current
from lifecycle_tools.testkit import sglang_doubles as d
from lifecycle_tools.testkit.sglang_doubles import runtime_context
from tests.integrations.sglang_kit import Node, doubles_kit


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    path = tmp_path / "hicache"
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(path))
    for var in ("SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE", "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE",
                "SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE", "SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO",
                "KV_LIFECYCLE_SGLANG_SHUTDOWN_TIMEOUT_S", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", "MOONCAKE_MASTER",
                "MOONCAKE_CLIENT", "KV_LIFECYCLE_REQUIRE_CHECKSUM", "KV_LIFECYCLE_SGLANG_STAGING_MIB"):
        monkeypatch.delenv(var, raising=False)
    return str(path)


def construct(node, ctx):
    with use_runtime(ctx):
        return DecodeKVCacheOffloadManager(req_to_token_pool=node.pool, token_to_kv_pool_allocator=node.alloc,
                                           tp_group=None, tree_cache=node.tree)


REFUSED = [
    ({"backend": "sim"}, {}, "backend sim cannot be used.*stores keys but no bytes.*supported: file, mooncake"),
    ({"backend": "hf3fs"}, {}, "backend hf3fs cannot be used.*zero-copy"),
    ({"backend": "nixl"}, {}, "backend nixl cannot be used.*NotImplementedError"),
    ({"backend": "shm"}, {}, "backend shm cannot be used"),
    ({"backend": "dynamic", "extra_config": '{"interface_v1": 1}'}, {}, "dynamic with interface_v1"),
    ({"backend": "s3"}, {}, "'s3' is not one of SGLang 0.5.19's"),
    ({"backend": None}, {}, "hicache-storage-backend is not set.*supported: file"),
    ({"backend": "mooncake"}, {}, "mooncake: no master configured"),
    ({"backend": "mooncake", "extra_config": '{"master_server_address": "127.0.0.1:1", "tenant_id": "t"}'}, {},
     "tenant_id 't'"),
    ({"backend": "mooncake", "extra_config": '{"master_server_address": "127.0.0.1:1", "enable_group_semantics": true}'},
     {}, "enable_group_semantics"),
    ({"backend": "mooncake"}, {"MOONCAKE_CLIENT": "127.0.0.1:2"}, "client_server_address.*MOONCAKE_\\* environment"),
    ({"backend": "mooncake", "extra_config": '{"master_server_address": "127.0.0.1:1", "bogus": 1}'}, {},
     r"keys \['bogus'\] are not read by SGLang's Mooncake backend"),
    ({"backend": "aibrix"}, {"KV_LIFECYCLE_REQUIRE_CHECKSUM": "yes"}, "KV_LIFECYCLE_REQUIRE_CHECKSUM='yes'"),
    ({"layout": "layer_first"}, {}, "hicache-mem-layout layer_first --hicache-io-backend kernel is not supported"),
    ({"layout": "layer_first", "io_backend": "direct"}, {},
     "hicache-mem-layout layer_first --hicache-io-backend direct is not supported"),
    ({"io_backend": "kernel_ascend"}, {}, "io-backend kernel_ascend is not supported.*Ascend"),
    ({"layout": "page_last"}, {}, "hicache-mem-layout 'page_last' is not one of SGLang 0.5.19's"),
    ({"extra_config": "{not json"}, {}, "not valid JSON"),
    ({"extra_config": "[1, 2]"}, {}, "must be a JSON object"),
    ({"extra_config": '{"tp_lcm_size": 8}'}, {}, r"keys \['tp_lcm_size'\] are not supported"),
    ({"extra_config": '{"min_free_space": "10G"}'}, {},
     r"file backend min_free_space \(SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE\) = 10000000000 bytes is not "
     "supported; bound the store with max_size instead"),
    ({}, {"SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE": "1Gi"}, "min_free_space .* = 1073741824 bytes"),
    ({"extra_config": '{"min_free_space": "lots"}'}, {}, "file backend min_free_space 'lots' is not a size"),
    ({"extra_config": '{"eviction_ratio": 0.5}'}, {}, "eviction_ratio 0.5"),
    ({"extra_config": '{"eviction_ratio": "half"}'}, {}, "file backend eviction_ratio 'half' is not a number"),
    ({}, {"SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": "12X"}, "max_size '12X' is not a size"),
    ({}, {"SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": "1.5Gi"},
     r"max_size '1.5Gi' is not a size \(decimals are not allowed with IEC suffixes\)"),
    ({"extra_config": '{"max_size": true}'}, {}, "file backend max_size True is not a size"),
    ({}, {"SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE": "abc"}, "SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE='abc'"),
    ({"dcp_enabled": True}, {}, "decode context parallel"),
    ({"model": ""}, {}, "served_model_name"),
    ({"ratio": 0, "size_gb": 0}, {}, "hicache-ratio"),
    ({"size_gb": -1}, {}, "hicache-size"),
    ({"page_size": 0}, {}, "page_size"),
    ({"pp_rank": 2, "pp_size": 2}, {}, "pp_rank"),
    ({}, {"KV_LIFECYCLE_SGLANG_SHUTDOWN_TIMEOUT_S": "-1"}, "KV_LIFECYCLE_SGLANG_SHUTDOWN_TIMEOUT_S='-1'"),
    ({}, {"KV_LIFECYCLE_SGLANG_SHUTDOWN_TIMEOUT_S": "soon"}, "KV_LIFECYCLE_SGLANG_SHUTDOWN_TIMEOUT_S='soon'"),
    ({}, {"KV_LIFECYCLE_SGLANG_STAGING_MIB": "0"}, "KV_LIFECYCLE_SGLANG_STAGING_MIB='0' must be a positive whole"),
    ({}, {"KV_LIFECYCLE_SGLANG_STAGING_MIB": "1.5"}, "KV_LIFECYCLE_SGLANG_STAGING_MIB='1.5'"),
    ({}, {"KV_LIFECYCLE_SGLANG_STAGING_MIB": "-4"}, "KV_LIFECYCLE_SGLANG_STAGING_MIB='-4'"),
]


@pytest.mark.parametrize("ctx,env,match", REFUSED, ids=[m.split(".")[0][:40] for _, _, m in REFUSED])
def test_unsupported_configuration_is_one_typed_error_and_creates_nothing(store_dir, monkeypatch, ctx, env, match):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    node = Node(doubles_kit())
    threads = threading.active_count()
    with pytest.raises(SGLangConfigError, match=match) as info:
        construct(node, runtime_context(**{"page_size": 4, **ctx}))
    assert isinstance(info.value, ConfigError) and isinstance(info.value, LifecycleError)
    assert not os.path.exists(store_dir)
    assert threading.active_count() == threads


class HybridLinearKVPool:  # SGLang's own manager refuses it too
    size, page_size = 512, 4


@pytest.mark.parametrize("make,match", [
    (lambda: HybridLinearKVPool(), "unsupported KV cache type.*HybridLinearKVPool.*MHATokenToKVPool"),
    (lambda: d.MHATokenToKVPool(64, 4, torch.bfloat16, 2, 8, 2, "cpu", False, v_head_dim=4), "v_head_dim 4"),
    (lambda: _with(d.MHATokenToKVPool(64, 4, torch.bfloat16, 2, 8, 2, "cpu", False), kv_cache_layout="hnd"),
     "layout 'hnd'"),
    (lambda: _with(d.MHATokenToKVPool(64, 4, torch.bfloat16, 2, 8, 2, "cpu", False),
                   k_scale_buffer=[torch.zeros(1)]), "scale buffers"),
    (lambda: _with(d.MHATokenToKVPool(64, 4, torch.bfloat16, 2, 8, 2, "cpu", False), layer_shard_enabled=True),
     "layer-sharded"),
    (lambda: _with(d.MHATokenToKVPool(64, 4, torch.bfloat16, 2, 8, 2, "cpu", False),
                   v_buffer=[torch.zeros(68, 2, 8)]), "equal length"),
    (lambda: _with(d.MHATokenToKVPool(64, 4, torch.bfloat16, 2, 8, 2, "cpu", False),
                   v_buffer=[torch.zeros(68, 2, 8), torch.zeros(68, 2, 8)]), r"float32"),
    (lambda: type("MHATokenToKVPoolFP4", (d.MHATokenToKVPool,), {})(64, 4, torch.bfloat16, 2, 8, 2, "cpu", False),
     "MHATokenToKVPoolFP4"),
])
def test_unsupported_device_pools_are_refused(make, match):
    with pytest.raises(SGLangConfigError, match=match):
        from_sglang(make())


def _mla(name: str):
    """An MLA pool of SGLang's class ``name`` (a subclass of ``MLATokenToKVPool``, as SGLang's is)."""
    return type(name, (d.MLATokenToKVPool,), {})(64, 4, torch.bfloat16, 6, 2, 2, "cpu", False)


@pytest.mark.parametrize("make", [lambda: _mla("UnifiedMLATokenToKVPool"),
                                  lambda: type("UnifiedMHATokenToKVPool", (d.MHATokenToKVPool,), {})(
                                      64, 4, torch.bfloat16, 2, 8, 2, "cpu", False),
                                  lambda: _with(_mla("SomeMLAPool"), _unified_buffer=object())],
                         ids=["unified-mla", "unified-mha", "views-of-a-unified-buffer"])
def test_the_unified_memory_pool_is_refused_in_one_line(make):
    """Issue 34, point 3: SGLang 0.5.19's ``--enable-unified-memory`` pools subclass
    ``MLATokenToKVPool`` / ``MHATokenToKVPool`` (SGLang's own manager accepts them) but their
    ``req_to_token`` holds virtual slot ids, which our copies would read as rows."""
    with pytest.raises(SGLangConfigError, match="virtual slot ids") as info:
        from_sglang(make())
    assert "\n" not in str(info.value) and "--enable-unified-memory" in str(info.value)


def _virtual_allocator(node):
    node.alloc.virtual_to_physical = torch.arange(node.alloc.num_pages + 1)
    return node


def _virtual_rows(node):
    node.pool.__class__ = type("UnifiedHybridReqToTokenPool", (type(node.pool),), {})
    return node


def _unified_flag(ctx):
    ctx.get_memory().enable_unified_memory = True
    return ctx


@pytest.mark.parametrize("node_of,ctx_of,match", [
    (_virtual_allocator, lambda c: c, r"allocator .*\(virtual_to_physical\).*virtual slot ids"),
    (_virtual_rows, lambda c: c, r"req_to_token pool for decode offload: UnifiedHybridReqToTokenPool addresses KV by virtual slot ids"),
    (lambda n: n, _unified_flag, r"--enable-unified-memory is not supported.*virtual slot ids"),
], ids=["virtual-id-allocator", "unified-req-to-token-pool", "the-flag"])
def test_any_pool_whose_req_to_token_is_not_physical_slot_ids_is_refused_at_construction(
        store_dir, node_of, ctx_of, match):
    node = node_of(Node(doubles_kit()))
    threads = threading.active_count()
    with pytest.raises(SGLangConfigError, match=match) as info:
        construct(node, ctx_of(runtime_context(page_size=4)))
    assert "\n" not in str(info.value)
    assert not os.path.exists(store_dir) and threading.active_count() == threads


def _with(obj, **attrs):
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


class SWARadixCache:
    """SGLang's SWA (and Mamba) radix caches keep per-component protected sizes, no ``protected_size_``."""

    full_protected_size_ = swa_protected_size_ = 0

    def free_kv_row(self, kv, ranges):
        raise AssertionError("never called")


@pytest.mark.parametrize("tree,match", [(object(), "free_kv_row"), (SWARadixCache(), "protected_size_")])
def test_a_tree_cache_the_release_cannot_go_through_is_refused(store_dir, tree, match):
    node = Node(doubles_kit())
    node.tree = tree
    with pytest.raises(SGLangConfigError, match=match):
        construct(node, runtime_context(page_size=4))
    assert not os.path.exists(store_dir)


@pytest.mark.parametrize("raw,stride", [(None, 4), ("0", 4), ("-3", 4), ("2", 4), ("4", 4), ("10", 8), ("16", 16)])
def test_stride_follows_sglangs_rule(raw, stride):
    env = {} if raw is None else {"SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE": raw}
    assert read_config(runtime_context(page_size=4), env).offload_stride == stride


@pytest.mark.parametrize("extra,env,cap", [
    (None, {}, None),
    (None, {"SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": "0"}, None),
    (None, {"SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": ""}, None),
    (None, {"SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": "-5"}, None),
    ('{"max_size": -5}', {}, None),
    ('{"max_size": 0.5}', {}, None),
    (None, {"SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": "2M"}, 2_000_000),
    (None, {"SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": "1.5G"}, 1_500_000_000),
    ('{"max_size": "3Ki"}', {"SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE": "2M"}, 3072),  # extra config wins
    ('{"max_size": 4096, "eviction_ratio": 0.9, "enable_metadata_cache": true}', {}, 4096),
])
def test_file_backend_capacity_as_sglang_reads_it(extra, env, cap):
    assert read_config(runtime_context(page_size=4, extra_config=extra), env).capacity_bytes == cap


def test_directory_and_naming_come_from_sglangs_settings(tmp_path):
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path / "x")}
    cfg = read_config(runtime_context(page_size=8, model="a/b", pp_rank=1, pp_size=2), env)
    assert (cfg.storage_dir, cfg.model_name, cfg.pp_rank, cfg.pp_size) == (str(tmp_path / "x"), "a/b", 1, 2)
    assert read_config(runtime_context(), {}).storage_dir == "/tmp/hicache"  # HiCacheFile's default


def test_the_byte_cap_bounds_the_store_directory(store_dir, monkeypatch):
    node = Node(doubles_kit())
    page = 2 * 4 * node.layers * node.heads * node.dim * 2  # bf16 MHA page, page-first
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE", str(3 * page))
    mgr = construct(node, runtime_context(page_size=4))
    reqs = [node.admit("big", list(range(4)), 30)]
    running = list(reqs)
    while running:
        running = node.decode_step(mgr, running)
    node.drain(mgr)
    files = [f for f in os.listdir(store_dir) if f.endswith(".bin")]
    assert mgr.stats().pages_enqueued > 3 and len(files) == 3
    assert sum(os.path.getsize(os.path.join(store_dir, f)) for f in files) <= 3 * page
    assert mgr.storage.stats().evictions == mgr.stats().pages_enqueued - 3
    mgr.release_host_resources()


def test_without_sglang_or_an_override_the_runtime_context_is_a_config_error():
    try:
        import sglang.srt.runtime_context  # noqa: F401
    except ImportError:
        with pytest.raises(SGLangConfigError, match="use_runtime"):
            current()
    else:
        pytest.skip("sglang is importable: its runtime context is the default")


def test_use_runtime_refuses_an_object_without_the_getters():
    with pytest.raises(SGLangConfigError, match="get_parallel"):
        with use_runtime(object()):
            pass


LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_first_kv_split", "page_head")
IOS = ("kernel", "direct", "kernel_ascend")


def sglangs_resolution(layout, io, backend):
    """SGLang 0.5.19's hicache_hook rules, spelled out pair by pair (the table in docs/integration.md)."""
    table = {("page_first_direct", "kernel"): ("page_first_direct", "direct"),
             ("page_first", "direct"): ("page_first_direct", "direct")}
    if backend == "mooncake":
        table[("layer_first", "kernel")] = ("page_first", "kernel")
        table[("layer_first", "direct")] = ("page_first_direct", "direct")
    return table.get((layout, io), (layout, io))


@pytest.mark.parametrize("backend", ["file", "mooncake"])
@pytest.mark.parametrize("io", IOS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_io_pair_is_accepted_as_sglang_resolves_it_or_refused_naming_the_resolved_pair(
        layout, io, backend):
    """Issue 20, point 2: the pair SGLang resolves decides; a refusal is one line naming the pair
    passed, SGLang's resolved pair and what to pass instead."""
    from lifecycle.integrations.sglang.config import check_layout_io, resolve_layout_io

    resolved = sglangs_resolution(layout, io, backend)
    assert resolve_layout_io(layout, io, backend) == resolved
    assert resolve_layout_io(*resolved, backend) == resolved  # SGLang's get_memory() holds the resolved pair
    for pair in {(layout, io), resolved}:
        # issue 24: the file and Mooncake tiers store pages in each of these layouts' byte order
        if resolved[0] in ("page_first", "page_first_direct", "page_head") and resolved[1] in ("kernel", "direct"):
            assert check_layout_io(*pair, backend) == resolved
            continue
        with pytest.raises(SGLangConfigError) as info:
            check_layout_io(*pair, backend)
        msg = str(info.value)
        assert "\n" not in msg and f"--hicache-mem-layout {pair[0]} --hicache-io-backend {pair[1]}" in msg
        if pair != resolved:
            assert f"SGLang resolves it to {resolved[0]} + {resolved[1]}" in msg
        assert msg.endswith("pass --hicache-mem-layout page_first --hicache-io-backend kernel "
                            "(its copies do not use SGLang's io backend)")


@pytest.mark.parametrize("layout,io", [("page_first", "direct"), ("page_first_direct", "kernel"), ("page_head", "kernel")])
def test_the_adapter_over_sglangs_other_backends_takes_page_first_only(layout, io):
    """SGLang's other backends see our host pool as page_first (HostPoolView): any other resolved
    layout is refused in one line for them, while file and Mooncake store it."""
    from lifecycle.integrations.sglang.config import check_layout_io

    assert check_layout_io(layout, io, "file")[0] != "page_first"
    with pytest.raises(SGLangConfigError, match="the dynamic backend here stores page_first pages"):
        check_layout_io(layout, io, "dynamic")


def test_mooncakes_layer_first_resolves_to_page_first_and_is_read_as_such(store_dir):
    from lifecycle.integrations.sglang.config import check_layout_io

    assert check_layout_io("layer_first", "kernel", "mooncake") == ("page_first", "kernel")


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_the_resolution_is_sglangs_own(backend):
    """Where sglang imports: the installed SGLang's own resolvers (``hicache_hook``, 0.5.19 or
    0.5.23; 0.5.23 reads ``dcp_size``, 1: no decode context parallelism) give, for every pair, the
    pair ``resolve_layout_io`` gives."""
    from types import SimpleNamespace

    from tests.integrations.sglang_kit import require_sglang

    require_sglang()
    from sglang.srt.arg_groups.hicache_hook import (
        resolve_layout_io_compatibility, resolve_storage_layout_compatibility,
    )
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from lifecycle.integrations.sglang.config import resolve_layout_io

    for layout in LAYOUTS:
        for io in IOS:
            args = SimpleNamespace(hicache_mem_layout=layout, hicache_io_backend=io,
                                   hicache_storage_backend=backend, dcp_size=1)
            resolve_layout_io_compatibility(args)
            resolve_storage_layout_compatibility(args)
            view = resolved_view(args)
            assert resolve_layout_io(layout, io, backend) == (view.hicache_mem_layout, view.hicache_io_backend)


def test_an_unset_hicache_ratio_on_a_decode_server_is_sglangs_2(store_dir):
    """SGLang 0.5.19 leaves ``--hicache-ratio`` unset on a decode server (``handle_hicache_ratio_default``
    skips decode) and its ``kv_cache_builder`` resolves it to 2.0 when decode offload is on."""
    config = read_config(runtime_context(page_size=4, ratio=None), {})
    assert (config.host_ratio, config.host_size_gb) == (2.0, 0.0)


EXTRA = {"max_size": "3Ki", "eviction_ratio": 0.9}


@pytest.mark.parametrize("name,text", [
    ("extra.json", '{"max_size": "3Ki", "eviction_ratio": 0.9}'),
    ("EXTRA.Json", '{"max_size": "3Ki", "eviction_ratio": 0.9}'),
    ("extra.toml", 'max_size = "3Ki"\neviction_ratio = 0.9\n'),
    ("extra.yaml", "max_size: 3Ki\neviction_ratio: 0.9\n"),
    ("extra.yml", "max_size: 3Ki\neviction_ratio: 0.9\n"),
])
def test_the_extra_config_can_be_an_at_file_as_sglang_reads_it(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    cfg = read_config(runtime_context(page_size=4, extra_config=f"@{path}"), {})
    assert cfg.extra_config == EXTRA and cfg.capacity_bytes == 3072


def test_an_at_file_that_cannot_be_used_is_one_line_naming_it(tmp_path, monkeypatch):
    def refused(path):
        with pytest.raises(SGLangConfigError) as err:
            read_config(runtime_context(page_size=4, extra_config=f"@{path}"), {})
        return str(err.value)

    missing = tmp_path / "missing.json"
    assert refused(missing).startswith(f"--hicache-storage-backend-extra-config @{missing} cannot be read: [Errno 2]")
    broken = tmp_path / "broken.toml"
    broken.write_text("max_size = \n")
    assert refused(broken).startswith(f"--hicache-storage-backend-extra-config @{broken} cannot be read: ")
    ini = tmp_path / "extra.ini"
    ini.write_text("[x]\n")
    assert refused(ini) == (f"--hicache-storage-backend-extra-config @{ini}: unsupported config format '.ini' "
                            "(.json, .toml, .yaml)")
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    assert refused(listed) == f"--hicache-storage-backend-extra-config must be a JSON object, got '@{listed}'"
    good = tmp_path / "extra.yaml"
    good.write_text("max_size: 3Ki\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # PyYAML missing
    assert refused(good).startswith(f"--hicache-storage-backend-extra-config @{good}: import of yaml halted")


def test_a_file_backend_extra_config_with_a_key_it_does_not_read_is_refused_naming_them(tmp_path):
    path = tmp_path / "extra.json"
    path.write_text('{"max_size": 1, "zeta": 1, "alpha": 2}')
    with pytest.raises(SGLangConfigError) as err:
        read_config(runtime_context(page_size=4, extra_config=f"@{path}"), {})
    assert str(err.value) == ("--hicache-storage-backend-extra-config keys ['alpha', 'zeta'] are not supported for "
                              "the file backend; supported: max_size, min_free_space, eviction_ratio, "
                              "enable_metadata_cache, metadata_ttl")
    # other backends read their own keys: passed on as given
    assert read_config(runtime_context(page_size=4, backend="aibrix", extra_config=f"@{path}"), {}).extra_config == {
        "max_size": 1, "zeta": 1, "alpha": 2}


def test_an_empty_extra_config_is_none_and_a_dict_is_taken_as_given():
    assert read_config(runtime_context(page_size=4, extra_config=""), {}).extra_config == {}
    given = {"max_size": 2048}
    cfg = read_config(runtime_context(page_size=4, extra_config=given), {})
    assert cfg.extra_config == given and cfg.extra_config is not given and cfg.capacity_bytes == 2048


@pytest.mark.parametrize("env,want", [({}, 16 << 20), ({"KV_LIFECYCLE_SGLANG_STAGING_MIB": "4"}, 4 << 20),
                                      ({"KV_LIFECYCLE_SGLANG_STAGING_MIB": ""}, 16 << 20)])
def test_the_staging_budget_is_read_in_mib(env, want):
    """The copy stream's staging buffer budget (docs/integration.md, "What it reads")."""
    assert read_config(runtime_context(page_size=4), env).staging_bytes == want


# --- what differs on SGLang 0.5.23 (issue 36) -----------------------------------------------------


def _v23(**kw):
    ctx = runtime_context(**kw)
    ctx.sglang_version = "0.5.23"
    return ctx


def test_on_0_5_23_the_file_directory_also_comes_from_the_extra_configs_file_storage_path(tmp_path):
    """SGLang 0.5.23's HiCacheFile: the environment variable, then ``file_storage_path``, then
    ``/tmp/hicache``; 0.5.19's reads no such key (refused there, as any key it does not read)."""
    extra = f'{{"file_storage_path": "{tmp_path / "p"}"}}'
    assert read_config(_v23(page_size=4, extra_config=extra), {}).storage_dir == str(tmp_path / "p")
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path / "env")}
    assert read_config(_v23(page_size=4, extra_config=extra), env).storage_dir == str(tmp_path / "env")
    assert read_config(_v23(page_size=4), {}).storage_dir == "/tmp/hicache"
    with pytest.raises(SGLangConfigError, match=r"keys \['file_storage_path'\] are not supported for the file"):
        read_config(runtime_context(page_size=4, extra_config=extra), {})
    with pytest.raises(SGLangConfigError, match="file_storage_path 7 must be a str"):
        read_config(_v23(page_size=4, extra_config='{"file_storage_path": 7}'), {})


@pytest.mark.parametrize("backend", ["npu_memcache", "tensorcast", "seaweedfs"])
def test_the_backends_0_5_23_added_are_refused_in_one_line_and_are_not_0_5_19_choices(backend):
    with pytest.raises(SGLangConfigError) as err:
        read_config(_v23(page_size=4, backend=backend), {})
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(f"--hicache-storage-backend {backend} cannot be used by kv-lifecycle's decode "
                                     "offload: a backend SGLang 0.5.23 added")
    with pytest.raises(SGLangConfigError, match=rf"{backend!r} is not one of SGLang 0.5.19's"):
        read_config(runtime_context(page_size=4, backend=backend), {})


def test_the_release_in_force_is_recorded_in_the_configuration():
    assert read_config(runtime_context(page_size=4), {}).sglang_release == "0.5.19"
    assert read_config(_v23(page_size=4), {}).sglang_release == "0.5.23"


class SWAKVPool:  # SGLang's hybrid sliding-window pool (0.5.19 and 0.5.23), not an MHA pool
    size, page_size = 512, 4


class UnifiedSWAKVPool(SWAKVPool):  # 0.5.23's, offloaded by its own manager as two host pools
    pass


@pytest.mark.parametrize("version", ["0.5.19", "0.5.23"])
@pytest.mark.parametrize("cls", [SWAKVPool, UnifiedSWAKVPool])
def test_a_hybrid_sliding_window_pool_is_refused_at_construction_in_one_line(store_dir, version, cls):
    node = Node(doubles_kit())
    pool = cls()
    node.alloc.get_kvcache = lambda: pool
    ctx = runtime_context(page_size=4)
    ctx.sglang_version = version
    threads = threading.active_count()
    with pytest.raises(SGLangConfigError) as err:
        construct(node, ctx)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"hybrid sliding-window KV pool {cls.__name__} is not supported")
    assert "unset KV_LIFECYCLE_SGLANG" in text
    assert not os.path.exists(store_dir) and threading.active_count() == threads


def test_sglangs_own_hybrid_sliding_window_pools_are_refused_by_their_classes():
    """Where sglang imports: its real SWA pool classes (0.5.23's ``UnifiedSWAKVPool`` among them)."""
    from lifecycle.integrations.sglang.device_pool import check_pool_kind
    from tests.integrations.sglang_kit import require_sglang, sglang_version

    require_sglang()
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool as Real

    classes = [Real]
    if sglang_version() == "0.5.23":
        from sglang.srt.mem_cache.unified_memory_pool import UnifiedSWAKVPool as RealUnified

        classes.append(RealUnified)
    for real in classes:
        with pytest.raises(SGLangConfigError, match=f"hybrid sliding-window KV pool {real.__name__} is not supported"):
            check_pool_kind(object.__new__(real))
