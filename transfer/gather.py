"""Batched KV movement between the device pool's slot layout and host pages (page-first).

Both pools are viewed as "rows" of one (kind, layer, token) each, ``heads * head_dim`` values
wide, reinterpreted as the widest integer type that divides a row (dtype-agnostic, fp8 included).

* CUDA: one device ``index_select`` (a flat row index in host order ``(page, kind, token, layer)``)
  into a staging buffer, then one async D2H copy per run of consecutive host pages (and the
  reverse for loads): one gather launch per chunk.
* CPU: one strided ``copy_`` per run of pages consecutive on both sides (the device pages' rows,
  permuted ``(kind, layer, token) -> (page, kind, token, layer)``). On CPU this beats a row gather:
  each copy moves whole ``page_size``-row blocks instead of looking up every row.
"""

from __future__ import annotations

import torch

from transfer.host_pool import HostPool
from transfer.kv_pool import KVPool

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def row_word(row_bytes: int, *buffers: torch.Tensor) -> torch.dtype:
    """The widest int dtype that divides ``row_bytes`` and every buffer's start address."""
    for word in _WORDS:
        size = torch.empty((), dtype=word).element_size()
        if row_bytes % size == 0 and all(b.data_ptr() % size == 0 for b in buffers):
            return word
    raise AssertionError("unreachable: uint8 divides every row")


def word_rows(buffer: torch.Tensor, row_bytes: int, word: torch.dtype) -> torch.Tensor:
    """View a contiguous buffer as ``[-1, row_bytes / sizeof(word)]`` rows of ``word``."""
    return buffer.view(-1).view(torch.uint8).view(word).view(-1, row_bytes // torch.empty((), dtype=word).element_size())


def host_order_rows(kv: KVPool, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat device row ids of ``slots`` (whole pages) in host page-first order.

    The row of (kind, layer, slot) is ``(kind * layers + layer) * kv.slots + slot``; the result is
    ordered ``[page, kind, token-in-page, layer]``, matching a host page ``[kinds, page_size,
    layers, ...]``.
    """
    plane = (torch.arange(kv.kinds).view(1, -1, 1, 1) * kv.layers
             + torch.arange(kv.layers).view(1, 1, 1, -1)) * kv.slots
    return (plane + slots.view(-1, 1, page_size, 1)).reshape(-1)


def page_runs(pages: torch.Tensor) -> list[tuple[int, int, int]]:
    """Split page ids into runs of consecutive ids: ``(position in pages, first page, length)``."""
    n = pages.numel()
    if n == 0:
        return []
    cuts = ((pages[1:] - pages[:-1]) != 1).nonzero().view(-1).add(1).tolist()
    starts, ends = [0, *cuts], [*cuts, n]
    first = pages[starts].tolist()
    return [(s, f, e - s) for s, f, e in zip(starts, first, ends)]


class ChunkCopy:
    """A planned copy between ``slots`` (device) and ``host_pages`` (host), same page count.

    Holds the index tensors it uses, so they stay alive until the copy is done.
    """

    def __init__(self, kv: KVPool, host: HostPool, slots: torch.Tensor, host_pages: torch.Tensor):
        self.kv, self.host = kv, host
        self.rows_per_page = kv.kinds * host.page_size * kv.layers
        self.index = (host_order_rows(kv, slots, host.page_size).to(kv.device, non_blocking=True)
                      if kv.device.type == "cuda" else None)
        self.runs = page_runs(host_pages)
        word = row_word(kv.row_bytes, kv.buffer, host.buffer)
        self.dev_rows = word_rows(kv.buffer, kv.row_bytes, word)
        self.host_rows = word_rows(host.buffer, host.row_bytes, word)
        self.staging: torch.Tensor | None = None
        if kv.device.type != "cuda":
            ps = host.page_size
            self.dev_blocks = self.dev_rows.view(kv.kinds, kv.layers, kv.slots, -1)
            self.host_blocks = self.host_rows.view(host.num_pages, kv.kinds, ps, kv.layers, -1)
            self.block_runs = _block_runs(slots.view(-1, ps)[:, 0].tolist(), host_pages.tolist(), ps)

    def _run_slices(self):
        rpp = self.rows_per_page
        for pos, first, length in self.runs:
            yield slice(pos * rpp, (pos + length) * rpp), slice(first * rpp, (first + length) * rpp)

    def to_host(self) -> None:
        """Device -> host. On CUDA: one device gather, then async D2H per run (current stream)."""
        if self.kv.device.type == "cuda":
            self.staging = self.dev_rows.index_select(0, self.index)
            for src, dst in self._run_slices():
                self.host_rows[dst].copy_(self.staging[src], non_blocking=True)
            return
        for dev, host, n in self.block_runs:
            self.host_blocks[host:host + n].copy_(self._dev_block(dev, n))

    def to_device(self) -> None:
        """Host -> device. On CUDA: async H2D per run into staging, then one device scatter."""
        if self.kv.device.type == "cuda":
            self.staging = torch.empty(
                (self.index.numel(), self.dev_rows.shape[1]), dtype=self.dev_rows.dtype, device=self.kv.device
            )
            for src, dst in self._run_slices():
                self.staging[src].copy_(self.host_rows[dst], non_blocking=True)
            self.dev_rows.index_copy_(0, self.index, self.staging)
            return
        for dev, host, n in self.block_runs:
            self._dev_block(dev, n).copy_(self.host_blocks[host:host + n])

    def _dev_block(self, first_slot: int, n_pages: int) -> torch.Tensor:
        """``n_pages`` device pages from ``first_slot`` as ``[page, kind, token, layer, word]``."""
        k, layers, _, w = self.dev_blocks.shape
        ps = self.host.page_size
        block = self.dev_blocks[:, :, first_slot:first_slot + n_pages * ps]
        return block.reshape(k, layers, n_pages, ps, w).permute(2, 0, 3, 1, 4)


def _block_runs(dev_starts: list[int], host_pages: list[int], page_size: int) -> list[tuple[int, int, int]]:
    """Group page pairs into runs consecutive on both sides: ``(first device slot, first host page, n)``."""
    runs: list[list[int]] = []
    for dev, host in zip(dev_starts, host_pages):
        if runs and dev == runs[-1][0] + runs[-1][2] * page_size and host == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([dev, host, 1])
    return [tuple(r) for r in runs]
