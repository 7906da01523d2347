"""The storage tier SGLang's configuration asks for, as a ``transfer`` ``Storage``.

``file``: our ``FileStorage`` (HiCacheFile-compatible names and raw page bytes) in the directory
SGLang's ``HiCacheFile`` uses (``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``, default
``/tmp/hicache``), with SGLang's names (from the rank's deployment identity,
``lifecycle.integrations.sglang.identity``), byte cap and host layout: pages are stored in the byte
order of the layout SGLang resolved (``page_first``, ``page_first_direct``, ``page_head``), so
SGLang nodes of that layout read them right, and sealed with it, so ours refuse other layouts.

MLA KV is the same on every TP rank; as in SGLang (``HiCacheController.backup_skip``), only rank 0
writes it: other ranks get a ``ReplicaStorage`` whose writes are counted ``skipped`` and succeed
without I/O, and which neither evicts nor cleans the shared directory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from transfer.errors import StorageConfigError, StorageUnavailable
from transfer.host_pool import HostPool
from transfer.stack import page_format
from transfer.storage.base import Storage, StorageStats, check_batch
from transfer.storage.file import FileStorage
from transfer.storage.layout import stored_in_layout

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


def open_storage(config: OffloadConfig, host: HostPool, tp_rank: int, tp_size: int, mla: bool) -> Storage:
    """The configured store for this rank, for pages of ``host`` (page-first host pages, stored
    and sealed in the configured host layout, as ``transfer.build_stack`` stores them).

    Raises:
        SGLangConfigError: an unsupported backend, or a directory that cannot be written.
    """
    if config.storage_backend != "file":  # read_config refuses these first; kept for direct callers
        raise SGLangConfigError(f"storage backend {config.storage_backend!r} is not supported; supported: file")
    identity = deployment_identity(config, tp_rank, tp_size, mla)
    owner = not mla or tp_rank == 0
    try:
        store = stored_in_layout(
            lambda fmt: FileStorage(config.storage_dir, identity.file_suffix, host.page_nbytes,
                                    capacity_bytes=config.capacity_bytes if owner else None, page_format=fmt),
            identity.layout, page_format(host))
    except StorageConfigError as err:
        raise SGLangConfigError(f"file backend: {err}") from None
    except StorageUnavailable as err:
        raise SGLangConfigError(
            f"file backend directory {config.storage_dir!r} is not writable "
            f"(SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR): {err}") from err
    return store if owner else ReplicaStorage(store)
