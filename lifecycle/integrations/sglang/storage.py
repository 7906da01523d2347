"""The storage tier SGLang's configuration asks for, as a ``transfer`` ``Storage``.

``file``: our ``FileStorage`` (HiCacheFile-compatible names and raw page bytes) in the directory
SGLang's ``HiCacheFile`` uses (``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``, default
``/tmp/hicache``), with SGLang's names (from the rank's deployment identity,
``lifecycle.integrations.sglang.identity``) and byte cap. ``mooncake``: our ``MooncakeStorage``
configured as SGLang's MooncakeStore is, its objects named from the same identity. Both store
pages in the byte order of the host layout SGLang resolved (``page_first``,
``page_first_direct``, ``page_head``), so SGLang nodes of that layout read them right, and seal
them with it, so ours refuse other layouts. The others: ``backends.SGLangBackendStorage`` over
SGLang's own backend object (see ``backends``; ``page_first`` only).

MLA KV is the same on every TP rank; as in SGLang (``HiCacheController.backup_skip``), only rank 0
writes it: other ranks get a ``ReplicaStorage`` whose writes are counted ``skipped`` and succeed
without I/O, and which neither evicts nor cleans the shared directory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from transfer.errors import StorageConfigError, StorageUnavailable, TransferError
from transfer.host_pool import HostPool
from transfer.stack import page_format
from transfer.storage.base import Storage, StorageStats, check_batch
from transfer.storage.file import FileStorage
from transfer.storage.layout import stored_in_layout

from lifecycle.integrations.sglang import backends
from lifecycle.integrations.sglang.config import OffloadConfig
from lifecycle.integrations.sglang.errors import SGLangConfigError
from lifecycle.integrations.sglang.identity import deployment_identity


class ReplicaStorage(Storage):
    """A rank that does not write replicated pages: ``batch_set`` succeeds without writing (the
    owning rank writes the same bytes under the same keys); reads and existence checks go to
    ``reader``.

    Args:
        reader: the owning store's directory opened without a capacity bound.
    """

    def __init__(self, reader: Storage) -> None:
        self.reader = reader
        self.suffix, self.page_nbytes = reader.suffix, reader.page_nbytes
        self._skipped = 0

    def batch_set(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Check the batch as any store does, write nothing, report every page stored.

        Raises:
            ValueError / PageSizeMismatch: as ``Storage.batch_set``.
        """
        check_batch(keys, pages, self.page_nbytes)
        self._skipped += len(keys)
        return [True] * len(keys)

    def batch_get(self, keys: Sequence[str], into: Sequence[torch.Tensor]) -> list[bool]:
        return self.reader.batch_get(keys, into)

    def batch_exists(self, keys: Sequence[str]) -> int:
        return self.reader.batch_exists(keys)

    def delete(self, key: str) -> bool:
        """Never deletes: the pages belong to the owning rank."""
        return False

    def stats(self) -> StorageStats:
        stats = self.reader.stats()
        stats.skipped += self._skipped
        return stats

    def close(self) -> None:
        self.reader.close()


class StoragePlan:
    """The store a rank will open, checked before any host pool, directory or thread exists."""

    def __init__(self, config: OffloadConfig, identity, owner: bool, *, mooncake=None, sglang_config=None):
        self.config, self.identity, self.suffix, self.owner = config, identity, identity.file_suffix, owner
        self.mooncake, self.sglang_config = mooncake, sglang_config


def plan_storage(config: OffloadConfig, tp_rank: int, tp_size: int, mla: bool) -> StoragePlan:
    """Check everything the configured backend needs for this rank (see ``backends``).

    Raises:
        SGLangConfigError: a backend refused, a setting it cannot honour, its client missing.
    """
    refused = backends.refusal(config.storage_backend, config.extra_config, config.sglang_release)
    if refused:  # read_config refuses these first; kept for direct callers
        raise SGLangConfigError(refused)
    identity = deployment_identity(config, tp_rank, tp_size, mla)  # SGLangConfigError: no SGLang name
    owner = not mla or tp_rank == 0  # SGLang's backup_skip: replicated (MLA) pages from rank 0 only
    backend = config.storage_backend
    if backend == "file":
        return StoragePlan(config, identity, owner)
    if backend == "mooncake":
        settings = backends.mooncake_settings(
            config.extra_config, config.environ, tp_rank=tp_rank, tp_size=tp_size, pp_rank=config.pp_rank,
            pp_size=config.pp_size, model=config.model_name, mla=mla, require_checksum=config.require_checksum)
        return StoragePlan(config, identity, owner, mooncake=settings)
    try:
        sglang_config = backends.storage_config(
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=config.pp_rank, pp_size=config.pp_size, mla=mla,
            model=config.model_name, extra=config.extra_config)
    except ImportError as err:
        raise SGLangConfigError(
            f"--hicache-storage-backend {backend}: goes through SGLang's own StorageBackendFactory, "
            f"and sglang does not import ({err})") from err
    return StoragePlan(config, identity, owner, sglang_config=sglang_config)


def open_storage(config: OffloadConfig, host: HostPool, tp_rank: int, tp_size: int, mla: bool,
                 plan: StoragePlan | None = None, factory=None) -> Storage:
    """The configured store for this rank, for pages of ``host`` (sealed as page-first pages of
    its dtype and shape, as ``transfer.build_stack`` seals them). Ranks that do not own
    replicated (MLA) pages get a ``ReplicaStorage``: they succeed without writing.

    Raises:
        SGLangConfigError: see ``plan_storage``; a directory that cannot be written; a Mooncake
            master that cannot be reached; a backend SGLang's factory could not build.
    """
    plan = plan or plan_storage(config, tp_rank, tp_size, mla)
    fmt = page_format(host)
    if config.storage_backend == "file":
        try:
            store = stored_in_layout(
                lambda f: FileStorage(config.storage_dir, plan.suffix, host.page_nbytes,
                                      capacity_bytes=config.capacity_bytes if plan.owner else None,
                                      page_format=f, require_checksum=config.require_checksum),
                plan.identity.layout, fmt)
        except StorageConfigError as err:
            raise SGLangConfigError(f"file backend: {err}") from None
        except StorageUnavailable as err:
            raise SGLangConfigError(
                f"file backend directory {config.storage_dir!r} is not writable "
                f"(SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR): {err}") from err
    elif plan.mooncake is not None:
        from transfer.storage.mooncake.store import MooncakeStorage  # noqa: PLC0415 (Mooncake is optional)

        try:
            store = stored_in_layout(
                lambda f: MooncakeStorage(plan.mooncake, page_nbytes=host.page_nbytes, identity=plan.identity,
                                          page_format=f, require_checksum=config.require_checksum),
                plan.identity.layout, fmt)
        except TransferError as err:
            raise SGLangConfigError(f"--hicache-storage-backend mooncake: {err}") from err
    else:
        backend = backends.build_sglang_backend(config.storage_backend, plan.sglang_config, host, factory)
        store = backends.SGLangBackendStorage(backend, config.storage_backend, plan.suffix, host.page_nbytes,
                                              page_format=fmt, require_checksum=config.require_checksum)
    return store if plan.owner else ReplicaStorage(store)
