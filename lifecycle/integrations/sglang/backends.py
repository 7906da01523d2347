"""Every storage backend SGLang 0.5.19 and 0.5.23 can configure, as the drop-in wires it.

SGLang's ``--hicache-storage-backend`` choices, and what this integration does with each:

* ``file``: our ``FileStorage`` in HiCacheFile's directory (``storage.open_storage``).
* ``mooncake``: our Mooncake tier (``transfer.storage.mooncake``: SGLang's object names and bytes,
  our seal object beside them), configured exactly as SGLang's ``MooncakeStore._load_config``
  reads its configuration: ``--hicache-storage-backend-extra-config`` when it names
  ``master_server_address``, else the JSON file in ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``, else
  the ``MOONCAKE_*`` environment variables (``mooncake_settings``).
* every other backend whose pages SGLang moves as tensors (``aibrix``, ``eic``, and ``dynamic``
  without ``interface_v1``): ``SGLangBackendStorage``, one adapter over the ``HiCacheStorage``
  object SGLang's own ``StorageBackendFactory`` builds (its names, its bytes). Those backends
  store no seal: every page read is served unverified (counted), or refused as a miss in strict
  mode (``KV_LIFECYCLE_REQUIRE_CHECKSUM=1``).
* refused, one line naming the backend and the reason (``refusal``): ``sim`` (stores no bytes),
  ``shm`` (its page calls store nothing), and the backends SGLang drives only zero-copy through
  its own host pool (``hf3fs``, ``nixl``, ``simm``, ``mori``, ``dynamic`` with ``interface_v1``):
  their tensor calls do nothing, raise or assert; and the backends SGLang 0.5.23 added
  (``npu_memcache``, ``tensorcast``, ``seaweedfs``), which the drop-in was not checked against.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence

import torch

from lifecycle.integrations.sglang.errors import SGLangConfigError
from lifecycle.log import get_logger
from transfer.storage.base import Storage, StorageStats, check_batch, check_keys

log = get_logger("lifecycle.integrations.sglang.backends")

STRICT_ENV = "KV_LIFECYCLE_REQUIRE_CHECKSUM"
MOONCAKE_CONFIG_ENV = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"

# SGLang 0.5.19's --hicache-storage-backend choices, and 0.5.23's (three more)
SGLANG_BACKENDS = ("file", "sim", "mooncake", "hf3fs", "nixl", "aibrix", "dynamic", "eic", "simm", "mori", "shm")
ADDED_IN_0_5_23 = ("npu_memcache", "tensorcast", "seaweedfs")
BACKENDS_BY_RELEASE = {"0.5.19": SGLANG_BACKENDS, "0.5.23": (*SGLANG_BACKENDS, *ADDED_IN_0_5_23)}
OURS = {"file": "our FileStorage (HiCacheFile's names and bytes)",
        "mooncake": "our Mooncake tier (SGLang's object names and bytes, sealed)"}
ADAPTED = ("aibrix", "eic", "dynamic")
_ZERO_COPY = ("SGLang drives it only zero-copy through its own host pool (batch_set_v1 over HostKVCache "
              "indices); its tensor page calls {how}, so kv-lifecycle's host pages cannot reach it")
REFUSED = {
    "sim": "a simulator: it stores keys but no bytes, so a page read back would be garbage",
    "shm": "its page calls store nothing (it implements only SGLang's v2 pool interface)",
    "hf3fs": _ZERO_COPY.format(how="do nothing"),
    "nixl": _ZERO_COPY.format(how="raise NotImplementedError"),
    "simm": _ZERO_COPY.format(how="assert raw host pointers"),
    "mori": _ZERO_COPY.format(how="are not implemented"),
}
# extra-config keys SGLang's HiRadixCache reads for prefetching; decode offload never prefetches
PREFETCH_KEYS = ("prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
                 "hicache_storage_pass_prefix_keys")


def strict(environ: Mapping[str, str]) -> bool:
    """``KV_LIFECYCLE_REQUIRE_CHECKSUM=1``: refuse (as misses) pages that carry no seal."""
    raw = environ.get(STRICT_ENV, "")
    if raw not in ("", "0", "1"):
        raise SGLangConfigError(f"{STRICT_ENV}={raw!r} must be 0 or 1")
    return raw == "1"


def refusal(backend, extra: Mapping, release: str = "0.5.19") -> str | None:
    """Why ``backend`` cannot be used by the drop-in on SGLang ``release`` (one line naming it), or None."""
    if backend is None:
        return ("--hicache-storage-backend is not set: decode offload needs a storage backend "
                f"(SGLang's own manager fails too); supported: {', '.join(supported())}")
    choices = BACKENDS_BY_RELEASE.get(release, SGLANG_BACKENDS)
    if backend not in choices:
        return f"--hicache-storage-backend {backend!r} is not one of SGLang {release}'s: {', '.join(choices)}"
    if backend in ADDED_IN_0_5_23:
        return (f"--hicache-storage-backend {backend} cannot be used by kv-lifecycle's decode offload: a backend "
                f"SGLang 0.5.23 added, which the drop-in was not checked against; supported: {', '.join(supported())}")
    if backend == "dynamic" and bool(extra.get("interface_v1", 0)):
        return ("--hicache-storage-backend dynamic with interface_v1: " + _ZERO_COPY.format(how="are not used")
                + "; set interface_v1 to 0 if the class implements batch_set/batch_get over tensors")
    if backend in REFUSED:
        return (f"--hicache-storage-backend {backend} cannot be used by kv-lifecycle's decode offload: "
                f"{REFUSED[backend]}; supported: {', '.join(supported())}")
    return None


def supported() -> list[str]:
    return [*OURS, *ADAPTED]


# --- Mooncake ----------------------------------------------------------------------------------------

# MooncakeStoreConfig's fields, as SGLang reads them from extra-config, the JSON file or the env
MOONCAKE_ENV = {
    "local_hostname": ("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
    "metadata_server": ("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
    "global_segment_size": ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "4gb"),
    "protocol": ("MOONCAKE_PROTOCOL", "rdma"),
    "device_name": ("MOONCAKE_DEVICE", ""),
    "master_server_address": ("MOONCAKE_MASTER", None),
    "master_metrics_port": ("MOONCAKE_MASTER_METRICS_PORT", "9003"),
    "check_server": ("MOONCAKE_CHECK_SERVER", "false"),
    "standalone_storage": ("MOONCAKE_STANDALONE_STORAGE", "false"),
    "client_server_address": ("MOONCAKE_CLIENT", None),
    "enable_ssd_offload": ("MOONCAKE_ENABLE_SSD_OFFLOAD", "false"),
    "ssd_offload_path": ("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", None),
    "tenant_id": ("MOONCAKE_TENANT_ID", "default"),
}
MOONCAKE_EXTRA_KEYS = (*MOONCAKE_ENV, "enable_group_semantics", "extra_backend_tag", *PREFETCH_KEYS)
_TRUE, _FALSE = ("true", "1", "yes", "y"), ("false", "0", "no", "n")


def _flag(value, what: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise SGLangConfigError(f"Mooncake {what} {value!r} is not a boolean")


def _segment_size(value) -> int:
    """SGLang's ``_parse_global_segment_size``: an int, ``'4gb'`` (GiB) or a decimal string."""
    try:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text.endswith("gb"):
            return int(text[:-2].strip()) << 30
        return int(text)
    except ValueError:
        raise SGLangConfigError(f"Mooncake global_segment_size {value!r} is not a size") from None


def mooncake_source(extra: Mapping, environ: Mapping[str, str]) -> tuple[str, dict]:
    """Where SGLang's ``MooncakeStore._load_config`` takes its configuration from, and the raw
    fields: extra-config naming a master or client, else the JSON file, else the environment."""
    if extra.get("master_server_address") is not None or extra.get("client_server_address") is not None:
        fields = {k: extra[k] for k in MOONCAKE_ENV if k in extra}
        return "--hicache-storage-backend-extra-config", {
            k: fields.get(k, default) for k, (_var, default) in MOONCAKE_ENV.items()}
    path = environ.get(MOONCAKE_CONFIG_ENV)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                loaded = json.load(f)
        except (OSError, ValueError) as err:
            raise SGLangConfigError(f"{MOONCAKE_CONFIG_ENV}={path!r}: cannot read its JSON: {err}") from None
        if not isinstance(loaded, dict) or (
                "master_server_address" not in loaded and "client_server_address" not in loaded):
            raise SGLangConfigError(
                f"{MOONCAKE_CONFIG_ENV}={path!r}: master_server_address or client_server_address is required")
        return f"{MOONCAKE_CONFIG_ENV}={path}", {
            k: loaded.get(k, default) for k, (_var, default) in MOONCAKE_ENV.items()}
    fields = {}
    for key, (var, default) in MOONCAKE_ENV.items():
        fields[key] = environ.get(var, default)
    if fields["master_server_address"] is None and fields["client_server_address"] is None:
        raise SGLangConfigError(
            "--hicache-storage-backend mooncake: no master configured (SGLang's order: extra-config "
            f"master_server_address, then {MOONCAKE_CONFIG_ENV}, then MOONCAKE_MASTER)")
    if fields["local_hostname"] == "localhost" and "MOONCAKE_LOCAL_HOSTNAME" not in environ:
        fields["local_hostname"] = environ.get("LOCAL_HOSTNAME", "localhost")  # SGLang's legacy variable
    return "MOONCAKE_* environment", fields


def mooncake_settings(extra: Mapping, environ: Mapping[str, str], *, tp_rank: int, tp_size: int,
                      pp_rank: int, pp_size: int, model: str, mla: bool, require_checksum: bool):
    """``MooncakeSettings`` for our Mooncake tier from SGLang's Mooncake configuration.

    Raises:
        SGLangConfigError: a setting our tier cannot honour (a standalone ``client_server_address``,
            group semantics, a non-default tenant, SSD offload), an extra-config key SGLang does not
            read, a malformed value; one line naming the setting and where it came from.
    """
    from transfer.storage.mooncake.conn import MooncakeSettings  # noqa: PLC0415 (Mooncake is optional)

    unknown = sorted(set(extra) - set(MOONCAKE_EXTRA_KEYS))
    if unknown:
        raise SGLangConfigError(
            f"--hicache-storage-backend-extra-config keys {unknown} are not read by SGLang's Mooncake "
            f"backend; supported: {', '.join(MOONCAKE_EXTRA_KEYS)}")
    if _flag(extra.get("enable_group_semantics", False), "enable_group_semantics"):
        raise SGLangConfigError(
            "Mooncake enable_group_semantics is not supported: group ids change how SGLang places "
            "objects; leave it unset")
    source, f = mooncake_source(extra, environ)
    if f["client_server_address"] is not None or _flag(f["standalone_storage"], "standalone_storage"):
        raise SGLangConfigError(
            f"Mooncake client_server_address / standalone_storage (from {source}) is not supported: "
            "kv-lifecycle's Mooncake tier runs its own client against master_server_address")
    if f["master_server_address"] is None:
        raise SGLangConfigError(f"Mooncake master_server_address is not set (from {source})")
    tenant = str(f["tenant_id"] or "default").strip() or "default"
    if tenant != "default":
        raise SGLangConfigError(f"Mooncake tenant_id {tenant!r} (from {source}) is not supported; leave it default")
    if _flag(f["enable_ssd_offload"], "enable_ssd_offload") or f["ssd_offload_path"] is not None:
        raise SGLangConfigError(f"Mooncake SSD offload (from {source}) is not supported by kv-lifecycle's tier")
    device = f["device_name"] or ""
    if isinstance(device, str) and device.strip().startswith("{"):  # SGLang's per-rank device map
        try:
            by_rank = json.loads(device)
        except ValueError:
            by_rank = {}
        device = by_rank.get(str(tp_rank), by_rank.get(tp_rank, "")) if isinstance(by_rank, dict) else ""
    per_rank = _segment_size(f["global_segment_size"]) // (tp_size * pp_size)  # as SGLang splits it
    try:
        return MooncakeSettings(
            master=str(f["master_server_address"]), local_hostname=str(f["local_hostname"]),
            metadata_server=str(f["metadata_server"]), protocol=str(f["protocol"]), device_name=str(device),
            global_segment_size=per_rank, require_checksum=require_checksum)  # names: the deployment identity
    except (TypeError, ValueError) as err:
        raise SGLangConfigError(f"Mooncake configuration (from {source}): {err}") from None


# --- every other backend: one adapter over SGLang's own HiCacheStorage ------------------------------------


class HostPoolView:
    """What SGLang's storage backends read of ``mem_pool_host`` when the factory builds them, over
    our page-first host pool: its layout, geometry and dtype, and its pages as flat tensors."""

    layout = "page_first"

    def __init__(self, host) -> None:
        self.host = host
        self.page_size, self.dtype, self.device = host.page_size, host.dtype, "cpu"
        self.size, self.page_num = host.size, host.num_pages
        self.kv_buffer = host.buffer
        self.layer_num = host.layers
        self.head_num, self.head_dim = (1, host.head_dim) if host.mla else (host.heads, host.head_dim)

    def get_size_per_token(self) -> int:
        return self.host.page_nbytes // self.page_size

    def get_ksize_per_token(self) -> int:
        return self.get_size_per_token() // (1 if self.host.mla else 2)

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        page = self.host.buffer[int(index) // self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros_like(self.host.buffer[0]).flatten()

    def set_from_flat_data_page(self, index, data_page: torch.Tensor) -> None:
        page = self.host.buffer[int(index) // self.page_size]
        page.copy_(data_page.view(page.dtype).reshape(page.shape))


def storage_config(*, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, mla: bool, model: str,
                   extra: Mapping):
    """SGLang's ``HiCacheStorageConfig`` as ``HiCacheController._generate_storage_config`` fills it
    (``tp_lcm_size`` moved out of the extra config into its own field, as SGLang moves it)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: PLC0415

    extra_config = dict(extra)
    tp_lcm_size = extra_config.pop("tp_lcm_size", None)
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True, model_name=model,
        tp_lcm_size=tp_lcm_size, extra_config=extra_config)


def build_sglang_backend(name: str, config, host, factory=None):
    """SGLang's own backend object for ``name``, built by its ``StorageBackendFactory`` (or
    ``factory``) and registered with our host pool's view, as ``HiCacheController`` does.

    Raises:
        SGLangConfigError: sglang does not import, or the factory or the backend refused (one
            line naming the backend and SGLang's error).
    """
    view = HostPoolView(host)
    try:
        if factory is None:
            from sglang.srt.mem_cache.storage import StorageBackendFactory as factory  # noqa: PLC0415,N813
        backend = factory.create_backend(name, config, view)
        register = getattr(backend, "register_mem_pool_host", None)
        if callable(register):
            register(view)
    except ImportError as err:
        raise SGLangConfigError(f"--hicache-storage-backend {name}: SGLang's backend does not import ({err})") from err
    except Exception as err:  # noqa: BLE001 (any construction failure is a configuration error)
        raise SGLangConfigError(
            f"--hicache-storage-backend {name}: SGLang's StorageBackendFactory could not build it: "
            f"{type(err).__name__}: {err}") from err
    return backend


class SGLangBackendStorage(Storage):
    """A ``transfer`` ``Storage`` over the ``HiCacheStorage`` object SGLang's factory built: pages go
    through its tensor calls (``batch_set(keys, values)``, ``batch_get(keys, target_locations)``,
    ``batch_exists``) under the page hash alone (the backend adds its own model and rank naming),
    as SGLang's ``_generic_page_set`` / ``_generic_page_get`` call them. Nothing is sealed: a page
    read back is counted ``unverified`` (first one warned), or refused as a miss with
    ``require_checksum``.

    Args:
        backend: SGLang's ``HiCacheStorage``. name: its ``--hicache-storage-backend`` name.
        suffix: our deployment suffix (for the record). page_nbytes: the host page size.
    """

    def __init__(self, backend, name: str, suffix: str, page_nbytes: int, *, page_format=None,
                 require_checksum: bool = False) -> None:
        self.backend, self.name = backend, name
        self.suffix, self.page_nbytes, self.page_format = suffix, page_nbytes, page_format
        self.require_checksum = require_checksum
        self._stats = StorageStats()
        self._lock = threading.Lock()
        self._warned = False

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for key, value in deltas.items():
                setattr(self._stats, key, getattr(self._stats, key) + value)

    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        check_batch(keys, pages, self.page_nbytes)
        if not keys:
            return []
        try:
            ok = self.backend.batch_set(list(keys), [p.flatten() for p in pages])
        except Exception as err:  # noqa: BLE001 (a backend failure is a failed write, counted)
            self._count(errors=len(keys))
            log.warning("sglang.backend_write_failed", backend=self.name, pages=len(keys), error=repr(err))
            return [False] * len(keys)
        if ok is True:
            self._count(stored=len(keys))
            return [True] * len(keys)
        self._count(errors=len(keys))
        log.warning("sglang.backend_write_failed", backend=self.name, pages=len(keys), result=repr(ok))
        return [False] * len(keys)

    def batch_get(self, keys: Sequence[str], into: Sequence[torch.Tensor]) -> list[bool]:
        check_batch(keys, into, self.page_nbytes)
        if not keys:
            return []
        if self.require_checksum:  # strict: nothing this backend holds carries a seal
            self._count(unverified=len(keys), misses=len(keys))
            return [False] * len(keys)
        flat = [t.view(-1) for t in into]
        try:
            got = self.backend.batch_get(list(keys), flat)
        except Exception as err:  # noqa: BLE001
            self._count(errors=len(keys), misses=len(keys))
            log.warning("sglang.backend_read_failed", backend=self.name, pages=len(keys), error=repr(err))
            return [False] * len(keys)
        if isinstance(got, int):  # some backends answer with the number of leading pages read
            hits = [i < got for i in range(len(keys))]
        else:
            hits = [g is not None for g in (got or [None] * len(keys))]
        out = []
        for hit, target in zip(hits, into):
            if not hit:
                target.zero_()
            out.append(bool(hit))
        n = sum(out)
        self._count(hits=n, misses=len(keys) - n, unverified=n)
        if n and not self._warned:
            self._warned = True
            log.warning("sglang.backend_unverified_pages", backend=self.name,
                        why="SGLang's backend stores no seal: pages are served unverified "
                            f"({STRICT_ENV}=1 refuses them)")
        return out

    def batch_exists(self, keys: Sequence[str]) -> int:
        check_keys(keys)
        if not keys:
            return 0
        return int(self.backend.batch_exists(list(keys)))

    def delete(self, key: str) -> bool:
        """SGLang's ``HiCacheStorage`` has no per-page delete: nothing is removed."""
        check_keys([key])
        return False

    def stats(self) -> StorageStats:
        with self._lock:
            return StorageStats(**{f: getattr(self._stats, f) for f in StorageStats.__struct_fields__})

    def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if callable(close):
            try:
                close()
            except Exception as err:  # noqa: BLE001 (shutdown never raises for a backend's close)
                log.warning("sglang.backend_close_failed", backend=self.name, error=repr(err))

