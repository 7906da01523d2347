"""The connector's settings (``kv_connector_extra_config``) and the refusals made at construction.

Settings (all optional):

``storage``
    where pages go: a ``transfer.storage.spec`` spec (``"file:DIR"``, ``"memory"``,
    ``"redis://HOST:PORT/DB"``, ``"mooncake://..."``); default ``file:`` +
    ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`` (else ``/tmp/hicache``): SGLang's HiCacheFile directory,
    its names (``{chain hash}_{model}_{tp_rank}_{tp_size}.bin``) and raw page-first bytes.
``model_name``
    the name pages are stored under (default: vLLM's served model name): the same string an SGLang
    node's ``served_model_name`` gives, to share pages with it.
``host_ratio`` / ``host_size_gb``
    the host pool: ``host_size_gb`` GB, else ``host_ratio`` (default 2.0) x vLLM's KV blocks.
``namespace_seed``
    the manager's namespace (64 hex characters; see ``DecodeOffloadManager``).
``write_timeout_s`` (default 30), ``fence_timeout_s`` (default 30)
    a copy not ended this long after submission is a miss; the most a preemption fence waits.
``metrics`` (default false)
    the ``kv_lifecycle_*`` metrics on vLLM's ``/metrics``, labelled ``role`` / ``tp_rank``
    (``lifecycle.integrations.vllm.metrics``).

Refused (``VllmConfigError``, one line; ``check_vllm``): an untested vLLM (``versions``); more than
one KV cache group (hybrid models) or a group whose spec is not plain full attention (sliding
window, chunked local, MLA); a quantized KV cache (``kv_cache_dtype`` other than ``auto``); LoRA
(``--enable-lora``) and multimodal models (a page's tokens would not say what its KV is);
pipeline or decode-context parallelism. The KV tensors themselves are checked by
``layout.VllmKVLayout.from_kv_caches`` when the worker registers them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from lifecycle.integrations.vllm.errors import VllmConfigError

DEFAULT_DIR = "/tmp/hicache"
SGLANG_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
KNOWN = frozenset({"storage", "model_name", "host_ratio", "host_size_gb", "namespace_seed", "write_timeout_s",
                   "fence_timeout_s", "require_checksum", "metrics"})


@dataclass(frozen=True)
class ConnectorConfig:
    storage: str
    model_name: str
    host_ratio: float
    host_size_gb: float
    namespace_seed: str | None
    write_timeout_s: float | None
    fence_timeout_s: float
    require_checksum: bool
    metrics: bool
    block_size: int
    num_blocks: int
    tp_size: int
    max_num_seqs: int
    max_model_len: int

    def host_pages(self, page_nbytes: int) -> int:
        """Host pool pages: ``host_size_gb`` GB of pages, else ``host_ratio`` x the device blocks
        (``page_nbytes`` is only needed for the former; the scheduler side, which has no KV, uses
        the ratio)."""
        if self.host_size_gb > 0:
            return max(1, int(self.host_size_gb * 1e9 // page_nbytes))
        return max(1, int(self.num_blocks * self.host_ratio))


def _number(extra: dict, key: str, default, *, positive: bool = True, allow_none: bool = False):
    value = extra.get(key, default)
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            positive and value <= 0) or value < 0:
        raise VllmConfigError(f"kv_connector_extra_config[{key!r}] must be a {'positive' if positive else 'non-negative'} "
                              f"number, got {value!r}")
    return float(value)


def read(vllm_config, kv_cache_config, environ=None) -> ConnectorConfig:
    """The connector's settings, checked (``check_vllm`` first).

    Raises:
        VllmConfigError: see the module docstring; an unknown or malformed setting.
    """
    check_vllm(vllm_config, kv_cache_config)
    env = os.environ if environ is None else environ
    extra = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})
    unknown = sorted(set(extra) - KNOWN)
    if unknown:
        raise VllmConfigError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(KNOWN)}")
    storage = extra.get("storage") or f"file:{env.get(SGLANG_DIR_ENV) or DEFAULT_DIR}"
    if not isinstance(storage, str):
        raise VllmConfigError(f"kv_connector_extra_config['storage'] must be a str, got {storage!r}")
    model = vllm_config.model_config
    name = extra.get("model_name")
    if name is None:
        served = getattr(model, "served_model_name", None)
        name = served[0] if isinstance(served, (list, tuple)) and served else (served or model.model)
    if not isinstance(name, str):
        raise VllmConfigError(f"kv_connector_extra_config['model_name'] must be a str, got {name!r}")
    seed = extra.get("namespace_seed")
    if seed is not None and not isinstance(seed, str):
        raise VllmConfigError(f"kv_connector_extra_config['namespace_seed'] must be a str, got {seed!r}")
    checksum, metrics = extra.get("require_checksum", False), extra.get("metrics", False)
    for key, value in (("require_checksum", checksum), ("metrics", metrics)):
        if not isinstance(value, bool):
            raise VllmConfigError(f"kv_connector_extra_config[{key!r}] must be a bool, got {value!r}")
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    sched = vllm_config.scheduler_config
    return ConnectorConfig(
        storage=storage, model_name=name,
        host_ratio=_number(extra, "host_ratio", 2.0),
        host_size_gb=_number(extra, "host_size_gb", 0, positive=False),
        namespace_seed=seed,
        write_timeout_s=_number(extra, "write_timeout_s", 30.0, allow_none=True),
        fence_timeout_s=_number(extra, "fence_timeout_s", 30.0),
        require_checksum=checksum, metrics=metrics,
        block_size=int(spec.block_size), num_blocks=int(kv_cache_config.num_blocks),
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        max_num_seqs=int(sched.max_num_seqs), max_model_len=int(vllm_config.model_config.max_model_len))


def check_vllm(vllm_config, kv_cache_config) -> None:
    """Refuse, in one line, what the connector cannot store as an SGLang node's pages (module
    docstring).

    Raises:
        VllmConfigError: the first thing found.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise VllmConfigError(
            f"{len(groups)} KV cache groups (a hybrid model: sliding-window, Mamba or mixed layers); "
            "supported: one full-attention group")
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    if kind != "FullAttentionSpec":
        raise VllmConfigError(f"KV cache spec {kind} is not supported (sliding window, chunked local, MLA); "
                              "supported: FullAttentionSpec")
    if getattr(spec, "sliding_window", None) is not None or getattr(spec, "attention_chunk_size", None) is not None:
        raise VllmConfigError("sliding-window or chunked-local attention layers are not supported")
    head_v = getattr(spec, "head_size_v", None)
    if head_v is not None and head_v != spec.head_size:
        raise VllmConfigError(f"V head size {head_v} != K head size {spec.head_size} is not supported")
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    if cache_dtype not in (None, "auto"):
        raise VllmConfigError(f"kv_cache_dtype {cache_dtype!r} (quantized KV) is not supported; use 'auto'")
    if getattr(vllm_config, "lora_config", None) is not None:
        raise VllmConfigError("LoRA (--enable-lora) is not supported: a page's tokens would not say which "
                              "adapter's KV it holds")
    model = vllm_config.model_config
    if getattr(model, "is_multimodal_model", False):
        raise VllmConfigError("multimodal models are not supported: a page's tokens would not say what its KV is")
    par = vllm_config.parallel_config
    if getattr(par, "pipeline_parallel_size", 1) != 1:
        raise VllmConfigError(f"pipeline parallelism ({par.pipeline_parallel_size}) is not supported")
    if getattr(par, "decode_context_parallel_size", 1) != 1:
        raise VllmConfigError(f"decode context parallelism ({par.decode_context_parallel_size}) is not supported")


__all__ = ["ConnectorConfig", "check_vllm", "read"]
