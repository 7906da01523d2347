"""In-process page storage (tests, single-node experiments): page bytes in a dict."""

from __future__ import annotations

import torch

from transfer.storage.base import IndexedStorage


class MemoryStorage(IndexedStorage):
    """Pages kept as private byte copies in memory. Same semantics as ``FileStorage``.

    Args: see ``IndexedStorage``.
    """

    def __init__(self, suffix: str = "", page_nbytes: int | None = None,
                 capacity_bytes: int | None = None, capacity_pages: int | None = None) -> None:
        super().__init__(suffix, page_nbytes, capacity_bytes, capacity_pages)
        self._data: dict[str, torch.Tensor] = {}

    def _write(self, name: str, page: torch.Tensor) -> None:
        self._data[name] = page.reshape(-1).view(torch.uint8).clone()

    def _read(self, name: str, into: torch.Tensor) -> bool:
        data = self._data.get(name)
        dst = into.reshape(-1).view(torch.uint8)
        if data is None or data.numel() != dst.numel():
            return False
        dst.copy_(data)
        return True

    def _remove(self, name: str) -> None:
        self._data.pop(name, None)
