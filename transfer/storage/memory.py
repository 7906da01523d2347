"""In-process page storage (tests, single-node experiments): sealed page bytes in a dict."""

from __future__ import annotations

import torch

from transfer.storage.base import IndexedStorage
from transfer.storage.integrity import PageFormat


class MemoryStorage(IndexedStorage):
    """Pages kept as private byte copies in memory, each with its seal (verified on read exactly as
    the file and Redis tiers do: a changed, renamed or foreign-format page is a miss).

    Args: see ``IndexedStorage``.
    """

    def __init__(self, suffix: str = "", page_nbytes: int | None = None,
                 capacity_bytes: int | None = None, capacity_pages: int | None = None, *,
                 page_format: PageFormat | None = None, checksum: bool = True,
                 require_checksum: bool = False) -> None:
        super().__init__(suffix, page_nbytes, capacity_bytes, capacity_pages, page_format=page_format,
                         checksum=checksum, require_checksum=require_checksum)
        self._data: dict[str, tuple[torch.Tensor, bytes | None]] = {}

    def _write(self, name: str, page: torch.Tensor, seal_bytes: bytes | None) -> None:
        self._data[name] = (page.reshape(-1).view(torch.uint8).clone(), seal_bytes)

    def _read(self, name: str, into: torch.Tensor) -> tuple[bool, bytes | None]:
        data, seal_bytes = self._data.get(name, (None, None))
        dst = into.reshape(-1).view(torch.uint8)
        if data is None:
            return False, None
        if data.numel() != dst.numel():
            self._count("wrong_size")
            return False, None
        dst.copy_(data)
        return True, seal_bytes

    def _stored_seal(self, name: str) -> tuple[int, bytes | None] | None:
        data, seal_bytes = self._data.get(name, (None, None))
        return None if data is None else (data.numel(), seal_bytes)

    def _remove(self, name: str) -> bool:
        return self._data.pop(name, None) is not None
