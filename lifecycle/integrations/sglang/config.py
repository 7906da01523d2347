"""SGLang's decode-offload configuration, read where SGLang (0.5.19, 0.5.23) reads it, checked in one place.

Sources (as ``DecodeKVCacheOffloadManager.__init__`` and the ``HiCacheFile`` backend read them):

* ``get_schedule().page_size``
* ``get_memory()``: ``hicache_storage_backend``, ``hicache_storage_backend_extra_config`` (JSON),
  ``hicache_io_backend``, ``hicache_mem_layout``, ``hicache_ratio``, ``hicache_size``
* ``get_memory().enable_unified_memory`` (refused: ``req_to_token`` then holds virtual slot ids)
* ``get_serving().served_model_name``; ``get_parallel()``: ``pp_rank``, ``pp_size``, ``dcp_enabled``
* environment: ``SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE``, ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``
  (default ``/tmp/hicache``), ``SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE``,
  ``..._MIN_FREE_SPACE``, ``..._EVICTION_RATIO`` (extra-config keys take precedence, as in SGLang)
* SGLang 0.5.23 only: the file backend's directory from the extra-config key ``file_storage_path``
  when ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`` is unset (as its ``HiCacheFile`` reads it)

Anything this integration cannot honour raises ``SGLangConfigError`` naming the setting.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

from lifecycle.integrations.sglang import backends, versions
from lifecycle.integrations.sglang.errors import SGLangConfigError

STRIDE_ENV = "SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE"
FILE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
FILE_MAX_SIZE_ENV = "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"
FILE_MIN_FREE_ENV = "SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE"
FILE_EVICTION_RATIO_ENV = "SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO"
FILE_DEFAULT_DIR = "/tmp/hicache"  # HiCacheFile's default file_path
# ours: how long release_host_resources() drains accepted copies and storage writes at shutdown
SHUTDOWN_TIMEOUT_ENV = "KV_LIFECYCLE_SGLANG_SHUTDOWN_TIMEOUT_S"
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
# ours: MiB of the copy stream's device staging buffer (a larger chunk is copied in pieces that fit)
STAGING_ENV = "KV_LIFECYCLE_SGLANG_STAGING_MIB"
DEFAULT_STAGING_MIB = 16
# --hicache-ratio unset on a decode server with decode offload: SGLang's kv_cache_builder makes it 2.0
DECODE_OFFLOAD_HICACHE_RATIO = 2.0

# --enable-unified-memory: req_to_token holds virtual slot ids (SGLang's allocator translates them
# to physical ones when it launches a kernel); our copies read req_to_token's ids as rows
UNIFIED_MEMORY_REFUSAL = (
    "--enable-unified-memory is not supported by kv-lifecycle's decode offload: its req_to_token holds "
    "virtual slot ids, which our copies would read as physical rows (wrong KV stored); run without it")
SUPPORTED_BACKENDS = ("file", "mooncake", "aibrix", "eic", "dynamic")  # see backends.py
# SGLang 0.5.19's --hicache-mem-layout / --hicache-io-backend choices
SGLANG_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_first_kv_split", "page_head")
SGLANG_IO_BACKENDS = ("direct", "kernel", "kernel_ascend")
# The byte order of one stored page per SGLang host layout (MHA; MLA has one kind and one head):
# what HiCache's get_data_page hands a storage backend, so what a reader of the same fleet expects.
PAGE_BYTE_ORDER = {
    "page_first": "[kv, token, layer, head, dim]",
    "layer_first": "[kv, layer, token, head, dim]",
    "page_first_direct": "[kv, layer, token, head, dim]",
    "page_head": "[kv, head, token, layer, dim]",
    "page_first_kv_split": "Ascend NPU only",
}
# The layouts whose page bytes this integration's stores write: the file and Mooncake tiers store
# pages in any of these (transfer.storage.layout); the adapter over SGLang's other backends sees
# our host pool as page_first only. The io backend is SGLang's copy path, which ours replaces.
SUPPORTED_LAYOUTS = ("page_first", "page_first_direct", "page_head")
OWN_TIER_BACKENDS = ("file", "mooncake")
ADAPTER_LAYOUTS = ("page_first",)
SUPPORTED_IO_BACKENDS = ("kernel", "direct")
# extra-config keys the file backend reads; the metadata-cache ones only tune existence checks,
# which our store answers from its own index anyway
FILE_EXTRA_KEYS = ("max_size", "min_free_space", "eviction_ratio", "enable_metadata_cache", "metadata_ttl")
FILE_PATH_KEY = "file_storage_path"  # SGLang 0.5.23's HiCacheFile: the directory, after the env variable
_DEFAULT_EVICTION_RATIO = 0.9


@dataclass(frozen=True)
class OffloadConfig:
    """Everything the integration takes from SGLang's configuration (see the module docstring)."""

    page_size: int
    offload_stride: int
    storage_backend: str
    storage_dir: str
    capacity_bytes: int | None
    io_backend: str
    mem_layout: str
    host_ratio: float | None
    host_size_gb: float
    model_name: str
    pp_rank: int = 0
    pp_size: int = 1
    extra_config: dict = field(default_factory=dict)
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    staging_bytes: int = DEFAULT_STAGING_MIB << 20  # KV_LIFECYCLE_SGLANG_STAGING_MIB
    require_checksum: bool = False  # KV_LIFECYCLE_REQUIRE_CHECKSUM=1: unsealed pages are misses
    sglang_release: str = "0.5.19"  # the tested release whose differences apply (versions.Release.behaves_as)
    environ: dict = field(default_factory=dict, repr=False)  # what the backends read (MOONCAKE_*, ...)


def read_config(runtime, environ: Mapping[str, str] | None = None, *,
                release: versions.Release | None = None) -> OffloadConfig:
    """Read and check the configuration from ``runtime`` (the four getters) and ``environ``, as
    SGLang ``release`` reads it (default: ``versions.release_of(runtime, environ)``).

    Raises:
        SGLangConfigError: an untested SGLang release (``versions``); a missing, malformed or
            unsupported setting (the first one found).
    """
    env = os.environ if environ is None else environ
    release = release or versions.release_of(runtime, env)
    sglang = release.behaves_as
    sched, mem, serving, parallel = (
        runtime.get_schedule(), runtime.get_memory(), runtime.get_serving(), runtime.get_parallel())
    page_size = _setting(sched, "page_size", "get_schedule()")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise SGLangConfigError(f"get_schedule().page_size must be a positive int, got {page_size!r}")
    backend = _setting(mem, "hicache_storage_backend", "get_memory()")
    extra = _extra_config(getattr(mem, "hicache_storage_backend_extra_config", None), backend,
                          release.file_storage_path_key)
    refused = backends.refusal(backend, extra, sglang)
    if refused:
        raise SGLangConfigError(refused)
    layout, io_backend = check_layout_io(
        _setting(mem, "hicache_mem_layout", "get_memory()"), _setting(mem, "hicache_io_backend", "get_memory()"),
        backend, sglang)
    if getattr(parallel, "dcp_enabled", False):
        raise SGLangConfigError("decode context parallel (--dcp-size > 1) is not supported")
    if getattr(mem, "enable_unified_memory", False):
        raise SGLangConfigError(UNIFIED_MEMORY_REFUSAL)
    model = getattr(serving, "served_model_name", None)
    if not isinstance(model, str) or not model:
        raise SGLangConfigError(f"get_serving().served_model_name must be a non-empty str, got {model!r}")
    pp_rank, pp_size = getattr(parallel, "pp_rank", 0), getattr(parallel, "pp_size", 1)
    if not (isinstance(pp_size, int) and isinstance(pp_rank, int) and pp_size >= 1 and 0 <= pp_rank < pp_size):
        raise SGLangConfigError(f"get_parallel() pp_rank {pp_rank!r} / pp_size {pp_size!r} are inconsistent")
    ratio, size_gb = _host_size(mem)
    return OffloadConfig(
        page_size=page_size,
        offload_stride=_stride(env.get(STRIDE_ENV), page_size),
        storage_backend=backend,
        storage_dir=_file_dir(env, extra, release.file_storage_path_key),
        capacity_bytes=_file_capacity(extra, env) if backend == "file" else None,
        io_backend=io_backend,
        mem_layout=layout,
        host_ratio=ratio,
        host_size_gb=size_gb,
        model_name=model,
        pp_rank=pp_rank,
        pp_size=pp_size,
        extra_config=extra,
        shutdown_timeout_s=_shutdown_timeout(env.get(SHUTDOWN_TIMEOUT_ENV)),
        staging_bytes=_staging_bytes(env.get(STAGING_ENV)),
        require_checksum=backends.strict(env),
        sglang_release=sglang,
        environ=dict(env),
    )


def _file_dir(env: Mapping[str, str], extra: dict, path_key: bool) -> str:
    """HiCacheFile's directory: the environment variable, then (0.5.23) the extra-config
    ``file_storage_path``, then ``/tmp/hicache``."""
    if env.get(FILE_DIR_ENV):
        return env[FILE_DIR_ENV]
    if path_key and extra.get(FILE_PATH_KEY):
        path = extra[FILE_PATH_KEY]
        if not isinstance(path, str):
            raise SGLangConfigError(f"file backend {FILE_PATH_KEY} {path!r} must be a str")
        return path
    return FILE_DEFAULT_DIR


def _shutdown_timeout(raw: str | None) -> float:
    """``KV_LIFECYCLE_SGLANG_SHUTDOWN_TIMEOUT_S``: seconds >= 0 (unset: 5)."""
    if raw is None or raw == "":
        return DEFAULT_SHUTDOWN_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise SGLangConfigError(f"{SHUTDOWN_TIMEOUT_ENV}={raw!r} must be a finite number of seconds >= 0")
    return value


def _staging_bytes(raw: str | None) -> int:
    """``KV_LIFECYCLE_SGLANG_STAGING_MIB``: a positive whole number of MiB (unset: 16), in bytes."""
    if raw is None or raw == "":
        return DEFAULT_STAGING_MIB << 20
    if not re.fullmatch(r"\s*[0-9]+\s*", raw) or int(raw) < 1:
        raise SGLangConfigError(f"{STAGING_ENV}={raw!r} must be a positive whole number of MiB")
    return int(raw) << 20


def resolve_layout_io(layout: str, io_backend: str, backend: str | None) -> tuple[str, str]:
    """The (layout, io backend) pair SGLang 0.5.19 runs with, from the pair passed: its
    ``resolve_layout_io_compatibility`` then ``resolve_storage_layout_compatibility``
    (``sglang/srt/arg_groups/hicache_hook.py``), which ``ServerArgs`` applies for decode offload.
    ``get_memory()`` inside SGLang already holds the resolved pair; resolving again changes nothing."""
    if layout == "page_first_direct" and io_backend == "kernel":
        io_backend = "direct"
    if layout == "page_first" and io_backend == "direct":
        layout = "page_first_direct"
    if backend == "mooncake" and layout == "layer_first":
        layout = {"direct": "page_first_direct", "kernel": "page_first"}.get(io_backend, layout)
    return layout, io_backend


def check_layout_io(layout, io_backend, backend: str | None, release: str = "0.5.19") -> tuple[str, str]:
    """SGLang's resolved (layout, io backend) pair if this integration writes that layout's page
    bytes, else one ``SGLangConfigError`` naming the pair passed, SGLang's resolved pair, the byte
    order it implies and what to pass instead. (0.5.19 and 0.5.23 have the same choices and the
    same resolution for decode offload.)"""
    if layout not in SGLANG_LAYOUTS:
        raise SGLangConfigError(
            f"--hicache-mem-layout {layout!r} is not one of SGLang {release}'s: {', '.join(SGLANG_LAYOUTS)}")
    if io_backend not in SGLANG_IO_BACKENDS:
        raise SGLangConfigError(
            f"--hicache-io-backend {io_backend!r} is not one of SGLang {release}'s: {', '.join(SGLANG_IO_BACKENDS)}")
    resolved = resolve_layout_io(layout, io_backend, backend)
    layouts = SUPPORTED_LAYOUTS if backend is None or backend in OWN_TIER_BACKENDS else ADAPTER_LAYOUTS
    if resolved[0] in layouts and resolved[1] in SUPPORTED_IO_BACKENDS:
        return resolved
    passed = f"--hicache-mem-layout {layout} --hicache-io-backend {io_backend}"
    as_resolved = "" if resolved == (layout, io_backend) else \
        f" (SGLang resolves it to {resolved[0]} + {resolved[1]})"
    why = ("the Ascend NPU transfer path" if "kernel_ascend" in resolved or resolved[0] == "page_first_kv_split"
           else f"pages stored in {resolved[0]} byte order {PAGE_BYTE_ORDER[resolved[0]]}")
    writes = (f"the {backend} backend here stores page_first pages {PAGE_BYTE_ORDER['page_first']}"
              if layouts is ADAPTER_LAYOUTS else f"this integration stores pages in {', '.join(layouts)} order")
    raise SGLangConfigError(
        f"{passed}{as_resolved} is not supported by kv-lifecycle's decode offload: it needs {why}, {writes}; "
        f"pass --hicache-mem-layout page_first --hicache-io-backend kernel (its copies do not use SGLang's io backend)")


def _setting(bag, name: str, where: str):
    if not hasattr(bag, name):
        raise SGLangConfigError(f"{where} has no {name}: not SGLang's runtime context?")
    return getattr(bag, name)


def _stride(raw: str | None, page_size: int) -> int:
    """SGLang's rule: unset or <= 0 -> one page; else rounded down to pages, at least one page."""
    if raw is None or raw == "None":
        return page_size
    try:
        value = int(raw)
    except ValueError:
        raise SGLangConfigError(f"{STRIDE_ENV}={raw!r} is not an integer") from None
    if value <= 0:
        return page_size
    return max(page_size, value // page_size * page_size)


def _extra_config(raw, backend, path_key: bool = False) -> dict:
    """The extra config as SGLang's HiCache reads it: a JSON object, or ``@FILE`` (.json, .toml,
    .yaml / .yml). The file backend's keys are checked here (``path_key``: 0.5.23's
    ``file_storage_path`` too), Mooncake's in ``backends``; other backends read their own."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, dict):
        extra = dict(raw)
    elif isinstance(raw, str) and raw.startswith("@"):
        extra = _extra_config_file(raw[1:])
    else:
        try:
            extra = json.loads(raw)
        except (TypeError, json.JSONDecodeError) as err:
            raise SGLangConfigError(f"--hicache-storage-backend-extra-config is not valid JSON: {err}") from None
    if not isinstance(extra, dict):
        raise SGLangConfigError(f"--hicache-storage-backend-extra-config must be a JSON object, got {raw!r}")
    if backend != "file":
        return extra
    keys = (*FILE_EXTRA_KEYS, FILE_PATH_KEY) if path_key else FILE_EXTRA_KEYS
    unknown = sorted(set(extra) - set(keys))
    if unknown:
        raise SGLangConfigError(
            f"--hicache-storage-backend-extra-config keys {unknown} are not supported for the file "
            f"backend; supported: {', '.join(keys)}")
    return extra


def _extra_config_file(path: str):
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".json":
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        if ext == ".toml":
            import tomllib  # noqa: PLC0415

            with open(path, "rb") as f:
                return tomllib.load(f)
        if ext in (".yaml", ".yml"):
            import yaml  # noqa: PLC0415 (SGLang installs PyYAML)

            with open(path, encoding="utf-8") as f:
                return yaml.safe_load(f)
    except ImportError as err:
        raise SGLangConfigError(f"--hicache-storage-backend-extra-config @{path}: {err}") from None
    except Exception as err:  # noqa: BLE001 (any parse or read failure: one line)
        raise SGLangConfigError(f"--hicache-storage-backend-extra-config @{path} cannot be read: {err}") from None
    raise SGLangConfigError(
        f"--hicache-storage-backend-extra-config @{path}: unsupported config format {ext!r} (.json, .toml, .yaml)")


def _file_capacity(extra: dict, env: Mapping[str, str]) -> int | None:
    """The file backend's byte cap (``max_size``; None: unbounded). Free-space watermarks and a
    non-default eviction ratio are refused: our store evicts least recently used pages only until
    the byte cap holds."""
    def pick(key: str, var: str):
        value = extra.get(key)
        return env.get(var) if value is None else value

    min_free = _size_bytes(pick("min_free_space", FILE_MIN_FREE_ENV), "min_free_space")
    if min_free:
        raise SGLangConfigError(
            f"file backend min_free_space ({FILE_MIN_FREE_ENV}) = {min_free} bytes is not supported; "
            "bound the store with max_size instead")
    ratio = pick("eviction_ratio", FILE_EVICTION_RATIO_ENV)
    if ratio is not None:
        try:
            ratio_value = float(ratio)
        except (TypeError, ValueError):
            raise SGLangConfigError(f"file backend eviction_ratio {ratio!r} is not a number") from None
        if ratio_value != _DEFAULT_EVICTION_RATIO:
            raise SGLangConfigError(
                f"file backend eviction_ratio {ratio_value} is not supported (our store evicts least "
                f"recently used pages only until max_size holds); leave it at {_DEFAULT_EVICTION_RATIO}")
    cap = _size_bytes(pick("max_size", FILE_MAX_SIZE_ENV), "max_size")
    return cap or None


_SIZE = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)")
_SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _size_bytes(value, what: str) -> int:
    """SGLang's ``human_readable_int``: '200G', '1.5T', '1Gi', '1048576'; None, '' and '0' -> 0.
    Where SGLang disables the bound on a malformed size (with a warning), this refuses it."""
    if value is None:
        return 0
    if isinstance(value, bool):
        raise SGLangConfigError(f"file backend {what} {value!r} is not a size")
    if isinstance(value, (int, float)):
        return max(0, int(value))
    text = str(value).strip()
    if not text or text == "0":
        return 0
    match = _SIZE.fullmatch(text)
    try:
        if match:
            number, suffix = match.groups()
            if suffix in _IEC:
                if "." in number:
                    raise ValueError("decimals are not allowed with IEC suffixes")
                return int(number) * _IEC[suffix]
            return int(Decimal(number) * _SI[suffix])
        return max(0, int(text))
    except (ValueError, InvalidOperation) as err:
        raise SGLangConfigError(f"file backend {what} {value!r} is not a size ({err})") from None


def _host_size(mem) -> tuple[float | None, float]:
    size_gb = getattr(mem, "hicache_size", 0) or 0
    ratio = getattr(mem, "hicache_ratio", None)
    if not isinstance(size_gb, (int, float)) or isinstance(size_gb, bool) or size_gb < 0:
        raise SGLangConfigError(f"--hicache-size must be a non-negative number of GB, got {size_gb!r}")
    if size_gb > 0:
        return ratio, float(size_gb)
    if ratio is None:  # a decode server: SGLang's kv_cache_builder resolves it, 2.0 with decode offload
        return DECODE_OFFLOAD_HICACHE_RATIO, 0.0
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not ratio > 0:
        raise SGLangConfigError(f"--hicache-ratio must be > 0 when --hicache-size is 0, got {ratio!r}")
    return float(ratio), 0.0
