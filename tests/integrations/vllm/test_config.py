"""What the connector refuses at construction, in one typed line, before anything starts
(``lifecycle.integrations.vllm.config`` / ``versions``), on vLLM's own config classes; the version
gate runs without vLLM."""

from __future__ import annotations

import pytest

from lifecycle import ConfigError
from lifecycle.integrations.vllm import versions
from lifecycle.integrations.vllm.errors import VllmConfigError
from tests.integrations.vllm.vllm_kit import require_vllm


def _one_line(err) -> None:
    assert isinstance(err.value, ConfigError) and "\n" not in str(err.value)


def test_an_untested_vllm_release_is_refused_unless_forced():
    assert versions.check("0.32.0", {}) == "0.32.0"
    with pytest.raises(VllmConfigError, match=r"vLLM 0.33.0 .* tested with \(0.32.0\).*KV_LIFECYCLE_VLLM_UNTESTED_OK=1") as err:
        versions.check("0.33.0", {})
    _one_line(err)
    assert versions.check("0.33.0", {versions.UNTESTED_OK_ENV: "1"}) == "0.33.0"


@pytest.fixture
def rig_parts(tmp_path):
    require_vllm()
    from lifecycle_tools.testkit.vllm_engine import VllmRig

    rig = VllmRig(tmp_path, extra={"storage": "memory"}, num_blocks=16)
    yield rig
    rig.close()


def _refused(rig, match, *, kv_cache_config=None, **changes):
    import copy

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from lifecycle.integrations.vllm.connector import LifecycleConnector

    config = copy.copy(rig.vllm_config)
    for path, value in changes.items():
        if "__" not in path:
            object.__setattr__(config, path, value)
            continue
        obj_name, attr = path.split("__")
        obj = copy.copy(getattr(config, obj_name))
        object.__setattr__(obj, attr, value)
        object.__setattr__(config, obj_name, obj)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(VllmConfigError, match=match) as err:
            LifecycleConnector(config, role, kv_cache_config or rig.kv_cache_config)
        _one_line(err)


def test_what_cannot_be_stored_as_an_sglang_nodes_pages_is_refused_at_construction(rig_parts):
    import dataclasses

    import torch
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MLAAttentionSpec, SlidingWindowSpec

    rig = rig_parts
    kcc = rig.kv_cache_config
    full = kcc.kv_cache_groups[0]
    swa = KVCacheGroupSpec(["model.layers.9.attn"], SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=128))
    _refused(rig, "2 KV cache groups", kv_cache_config=dataclasses.replace(kcc, kv_cache_groups=[full, swa]))
    _refused(rig, "SlidingWindowSpec", kv_cache_config=dataclasses.replace(kcc, kv_cache_groups=[swa]))
    mla = KVCacheGroupSpec(full.layer_names, MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=64,
                                                              dtype=torch.float32))
    _refused(rig, "MLAAttentionSpec", kv_cache_config=dataclasses.replace(kcc, kv_cache_groups=[mla]))
    _refused(rig, "kv_cache_dtype 'fp8'", cache_config__cache_dtype="fp8")
    _refused(rig, "LoRA", lora_config=object())
    _refused(rig, "pipeline parallelism", parallel_config__pipeline_parallel_size=2)
    ktc = rig.vllm_config.kv_transfer_config
    _refused(rig, "unknown kv_connector_extra_config keys", kv_transfer_config__kv_connector_extra_config={"storag": "x"})
    _refused(rig, "write_timeout_s", kv_transfer_config__kv_connector_extra_config={"write_timeout_s": -1})
    assert ktc.kv_connector_extra_config == {"storage": "memory"}     # nothing changed on the rig's config


def test_the_kv_tensors_are_checked_when_the_worker_registers_them(rig_parts):
    """HND with K|V channels (a GPU backend under VLLM_KV_CACHE_LAYOUT=HND) is refused there."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from lifecycle.integrations.vllm import connector as mod

    rig = rig_parts
    caches = allocate_kv_cache(rig.kv_cache_config, __import__("torch").device("cpu"), KVCacheLayout.LBHNC,
                               kernel_block_sizes=[16])
    worker = mod.LifecycleConnector(rig.vllm_config, KVConnectorRole.WORKER, rig.kv_cache_config)
    orig = mod._kv_split
    mod._kv_split = lambda: "channels"          # a GPU backend's split
    try:
        with pytest.raises(VllmConfigError, match="HND") as err:
            worker.register_kv_caches(caches)
        _one_line(err)
        assert worker.worker is None
    finally:
        mod._kv_split = orig
