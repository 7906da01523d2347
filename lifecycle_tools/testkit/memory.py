"""An in-memory ``Offloader`` for tests and the demo: real tensors, completions under the caller's control.

Copies are real (``kv[device_indices]`` into a host buffer) but land only when told to
(``land``) or, with ``auto_land=True``, by the next ``finished_writes`` call, which reports them
as a ``transfer.WriteReport`` (landed / failed / expired). Storage keeps page
bytes in a dict keyed by page hash. Every misuse of the seam (double free of host pages, unknown
ids) raises, so tests catch a manager that breaks the contract.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from transfer.offloader import EMPTY_REPORT, WriteReport


class OffloaderMisuse(RuntimeError):
    """The caller broke the Offloader contract (double free, unknown id)."""


class InMemoryOffloader:
    """Offloader over a device KV tensor ``[slots, ...]`` with a bounded host buffer.

    Args:
        kv: device KV, first dim indexed by token slot (``None``: copy nothing, track ids only).
        page_size: tokens per page.
        host_pages: host capacity in pages.
        auto_land: land every pending copy (and finish every storage op) at the next poll.
        fail_storage: page hashes whose storage op should be reported failed.
    """

    def __init__(
        self,
        kv: torch.Tensor | None = None,
        *,
        page_size: int = 1,
        host_pages: int = 1 << 16,
        auto_land: bool = True,
        fail_storage: Iterable[str] = (),
    ) -> None:
        self.kv = kv
        self.page_size = page_size
        self.auto_land = auto_land
        self.fail_storage = set(fail_storage)
        self._free_pages = list(range(host_pages - 1, -1, -1))
        self._held_pages: set[int] = set()
        self.host = (
            torch.empty((host_pages * page_size, *kv.shape[1:]), dtype=kv.dtype)
            if kv is not None
            else None
        )
        self.pending_writes: dict[int, torch.Tensor] = {}
        self._landed: list[int] = []
        self._expired: list[int] = []
        self._failed: list[int] = []
        self.pending_storage: dict[int, tuple[torch.Tensor, list[str]]] = {}
        self._stored_ops: list[int] = []
        self._op_ids = itertools.count(1)
        self.stored: dict[str, torch.Tensor | None] = {}
        self.failed_ops = 0
        self.writes = 0

    def host_free_pages(self) -> int:
        return len(self._free_pages)

    def write(self, device_indices: torch.Tensor | np.ndarray, ack_id: int) -> torch.Tensor | None:
        if type(device_indices) is np.ndarray:  # a host row's ids, as the manager hands them over
            device_indices = torch.from_numpy(device_indices)
        n = device_indices.numel()
        if n % self.page_size:
            raise OffloaderMisuse(f"write of {n} slots is not a whole number of pages")
        if ack_id in self.pending_writes:
            raise OffloaderMisuse(f"ack id {ack_id} is already pending")
        pages = n // self.page_size
        if pages > len(self._free_pages):
            return None
        got = [self._free_pages.pop() for _ in range(pages)]
        self._held_pages.update(got)
        host = (
            torch.tensor(got, dtype=torch.int64).repeat_interleave(self.page_size) * self.page_size
            + torch.arange(self.page_size, dtype=torch.int64).repeat(pages)
        )
        if self.kv is not None:
            self.host[host] = self.kv[device_indices]
        self.pending_writes[ack_id] = host
        self.writes += 1
        return host

    def land(self, ack_ids: Iterable[int] | None = None) -> None:
        """Mark copies as landed (all pending when ``ack_ids`` is None), in the order given."""
        ids = list(self.pending_writes) if ack_ids is None else list(ack_ids)
        for ack in ids:
            if ack not in self.pending_writes:
                raise OffloaderMisuse(f"ack id {ack} is not pending")
            del self.pending_writes[ack]
            self._landed.append(ack)

    def finished_writes(self) -> WriteReport:
        """Expired acks, then those landed (``land``) or failed (``fail``) since the last call."""
        if self.auto_land:
            self.land()
        landed, failed, expired = self._landed, self._failed, self._expired
        if not (landed or expired):
            return EMPTY_REPORT
        self._landed, self._failed, self._expired = [], [], []
        if failed:
            bad = set(failed)
            landed = [a for a in landed if a not in bad]
        return WriteReport(landed, failed, expired)

    def expire(self, ack_ids: Iterable[int]) -> None:
        """Report pending copies as past their deadline; they stay pending until ``land``."""
        for ack in ack_ids:
            if ack not in self.pending_writes:
                raise OffloaderMisuse(f"ack id {ack} is not pending")
            self._expired.append(ack)

    def fail(self, ack_ids: Iterable[int]) -> None:
        """Land pending copies as failed: reported failed by ``finished_writes``."""
        ids = list(ack_ids)
        self.land(ids)
        self._failed.extend(ids)

    def write_storage(
        self, host_indices: torch.Tensor, tokens: Sequence[int], page_hashes: Sequence[str],
        parent_hash: str | None = None,
    ) -> int:
        if len(tokens) != len(page_hashes) * self.page_size:
            raise OffloaderMisuse(
                f"{len(tokens)} tokens for {len(page_hashes)} pages of {self.page_size}"
            )
        op = next(self._op_ids)
        self.pending_storage[op] = (host_indices, list(page_hashes))
        return op

    def complete_storage(self, op_ids: Iterable[int] | None = None) -> None:
        """Finish storage ops (all pending when None): store their pages or count a failure."""
        ids = list(self.pending_storage) if op_ids is None else list(op_ids)
        for op in ids:
            host, hashes = self.pending_storage.pop(op)
            if self.fail_storage.intersection(hashes):
                self.failed_ops += 1
            else:
                for i, h in enumerate(hashes):
                    page = host[i * self.page_size : (i + 1) * self.page_size]
                    self.stored.setdefault(h, self.host[page].clone() if self.host is not None else None)
            self._stored_ops.append(op)

    def finished_storage(self) -> list[int]:
        if self.auto_land:
            self.complete_storage()
        out, self._stored_ops = self._stored_ops, []
        return out

    def free_host(self, host_indices: torch.Tensor | list[torch.Tensor]) -> None:
        if type(host_indices) is list:  # several ops' pages in one call (``Offloader.free_host``)
            if not host_indices:
                return
            host_indices = torch.cat(host_indices)
        pages = sorted(set((host_indices // self.page_size).tolist()))
        missing = [p for p in pages if p not in self._held_pages]
        if missing:
            raise OffloaderMisuse(f"host pages {missing} freed but not held (double free?)")
        self._held_pages.difference_update(pages)
        self._free_pages.extend(pages)

    def close(self, timeout: float | None = None) -> None:
        """Nothing runs in the background: closing waits for nothing."""
