"""Chunk copies between SGLang's per-layer device buffers and our page-first host pool.

A host page is ``HostPool.buffer[page] = [kinds, page_size, layers, heads, head_dim]``; a device
page of layer ``l`` is ``buffers[kind][l][slot:slot + page_size]``. Both sides are reinterpreted
as the integer type of the same width, so every dtype moves bit-exact.

* CPU: per run of pages consecutive on both sides, one strided copy per (kind, layer); when the
  device pages are scattered (more such runs than runs of host pages), one row gather per
  (kind, layer) and run of host pages instead.
* CUDA: per (kind, layer) one device ``index_select`` of whole pages straight into that buffer's
  slab of the engine's staging buffer (``transfer.gather.Staging``: no allocation per chunk), laid
  out as the host pages, then one async D2H copy per run of consecutive host pages, all on the
  engine's copy stream: kinds x layers + runs launches per chunk. One launch per chunk would need a
  kernel over a table of the per-layer buffers' addresses (SGLang's ``transfer_kv_all_layer``);
  torch has none, and this project ships no custom kernel.

The engines subclass ``transfer``'s, so ``HostOffloader`` drives them unchanged.
"""

from __future__ import annotations

import torch

from transfer.copy_engine import CpuCopyEngine, CudaCopyEngine
from transfer.errors import DeviceMismatch
from transfer.gather import Staging, check_on_device, landed_error, page_runs
from transfer.indices import as_index_tensor, pages_of_slots
from transfer.host_pool import HostPool

from lifecycle.integrations.sglang.device_pool import LayeredKVPool

_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _word(dtype: torch.dtype) -> torch.dtype:
    return _WORD[torch.empty((), dtype=dtype).element_size()]


class LayeredChunkCopy:
    """A planned copy between device ``slots`` (whole pages) and ``host_pages`` (same count).

    Raises:
        ValueError: the pools disagree on shape or dtype.
    """

    def __init__(self, kv: LayeredKVPool, host: HostPool, slots: torch.Tensor, host_pages: torch.Tensor,
                 check_end: int | None = None, staging: Staging | None = None) -> None:
        shape = (kv.kinds, kv.layers, kv.heads, kv.head_dim, kv.dtype)
        if shape != (host.kinds, host.layers, host.heads, host.head_dim, host.dtype):
            raise ValueError(f"device pool {shape} and host pool disagree")
        self.kv, self.host, self.ps = kv, host, host.page_size
        word = _word(kv.dtype)
        self.dev = [[b.view(word) for b in kind] for kind in kv.buffers]
        self.host_words = host.buffer.view(word)
        self.n_pages = host_pages.numel()
        self.cuda = kv.device.type == "cuda" or staging is not None  # the staged path
        self.check_end, self.ok, self.pool = check_end, None, staging
        if self.cuda:
            self.index = slots.to(kv.device, dtype=torch.int64, non_blocking=True)
            if check_end is not None:
                self.index, self.ok = check_on_device(self.index, self.ps, check_end)
            self.page_ids = self.index.view(-1, self.ps)[:, 0] // self.ps  # device pages, on the device
            self.runs = page_runs(host_pages)
            self.staging: torch.Tensor | None = None
        else:
            if check_end is not None:  # on the copy worker: the ids may be read here
                slots = as_index_tensor(slots, "device indices")
                pages_of_slots(slots.numpy(), self.ps, "device indices", check_end)
            firsts = slots.view(-1, self.ps)[:, 0].tolist()
            self.block_runs = _block_runs(firsts, host_pages.tolist(), self.ps)
            self.runs = page_runs(host_pages)
            # scattered device pages: one row gather per buffer and host run beats one slice copy
            # per buffer and page (the per-call cost dominates small pages)
            self.gather = len(self.block_runs) > len(self.runs)
            if self.gather:
                self.index = slots.to(torch.int64)

    def landed_error(self):
        """Once the copy's event has fired: the ``BadIndices`` its device-side check found, or None."""
        return landed_error(self.ok, self.check_end)

    def _pages(self, t: torch.Tensor, n: int) -> torch.Tensor:
        return t.view(n, self.ps, self.kv.heads, self.kv.head_dim)

    def to_host(self) -> None:
        """Device -> host (on CUDA: launched on the current stream, asynchronous)."""
        if self.cuda:
            staging = self._staging()
            for k, layer, buf in self._buffers():  # one gather per buffer, straight into its slab
                torch.index_select(self._whole_pages(buf), 0, self.page_ids, out=staging[:, k, :, layer])
            for pos, first, length in self.runs:
                self.host_words[first:first + length].copy_(staging[pos:pos + length], non_blocking=True)
            self.staging = staging  # alive until the copy's event fires
            return
        if self.gather:
            for pos, first, n in self.runs:
                rows = self.index[pos * self.ps:(pos + n) * self.ps]
                for k, layer, buf in self._buffers():
                    self.host_words[first:first + n, k, :, layer].copy_(self._pages(buf.index_select(0, rows), n))
            return
        for dev, host, n in self.block_runs:
            for k, layer, buf in self._buffers():
                self.host_words[host:host + n, k, :, layer].copy_(
                    self._pages(buf[dev:dev + n * self.ps], n))

    def _buffers(self):
        """Every device buffer with its kind (K/V or latent) and layer index."""
        for k, per_layer in enumerate(self.dev):
            for layer, buf in enumerate(per_layer):
                yield k, layer, buf

    def _staging(self) -> torch.Tensor:
        """A device buffer in the host pages' layout for this chunk (staged path): a view of the
        engine's ``Staging`` (no allocation per chunk), else one of its own."""
        kv = self.kv
        shape = (self.n_pages, kv.kinds, self.ps, kv.layers, kv.heads, kv.head_dim)
        if self.pool is not None:
            rows = self.n_pages * kv.kinds * self.ps * kv.layers
            return self.pool.take(rows, kv.heads * kv.head_dim, self.host_words.dtype).view(shape)
        return torch.empty(shape, dtype=self.host_words.dtype, device=kv.device)

    def _whole_pages(self, buf: torch.Tensor) -> torch.Tensor:
        """A per-layer buffer as ``[pages, page_size, heads, head_dim]`` (rows past the last whole
        page left out: never a slot of a page)."""
        whole = buf.shape[0] // self.ps * self.ps
        return buf[:whole].view(-1, self.ps, self.kv.heads, self.kv.head_dim)

    def to_device(self) -> None:
        """Host -> device (on CUDA: asynchronous H2D per run, then one scatter per buffer)."""
        kv = self.kv
        if self.cuda:
            staging = self._staging()
            for pos, first, length in self.runs:
                staging[pos:pos + length].copy_(self.host_words[first:first + length], non_blocking=True)
            for k, layer, buf in self._buffers():  # one scatter per buffer, straight from its slab
                self._whole_pages(buf).index_copy_(0, self.page_ids, staging[:, k, :, layer])
            self.staging = staging
            return
        if self.gather:
            for pos, first, n in self.runs:
                rows = self.index[pos * self.ps:(pos + n) * self.ps]
                for k, layer, buf in self._buffers():
                    part = self.host_words[first:first + n, k, :, layer]
                    buf.index_copy_(0, rows, part.reshape(n * self.ps, kv.heads, kv.head_dim))
            return
        for dev, host, n in self.block_runs:
            for k, layer, buf in self._buffers():
                self._pages(buf[dev:dev + n * self.ps], n).copy_(self.host_words[host:host + n, k, :, layer])


def _block_runs(dev_starts: list[int], host_pages: list[int], page_size: int) -> list[tuple[int, int, int]]:
    """Page pairs grouped into runs consecutive on both sides: ``(first slot, first host page, n)``."""
    runs: list[list[int]] = []
    for dev, host in zip(dev_starts, host_pages):
        if runs and dev == runs[-1][0] + runs[-1][2] * page_size and host == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([dev, host, 1])
    return [(a, b, c) for a, b, c in runs]


class LayeredCpuCopyEngine(CpuCopyEngine):
    """``CpuCopyEngine`` over a ``LayeredKVPool`` (copies on worker threads)."""

    def to_host(self, tag, kv, host, slots, host_pages, check_end=None) -> None:
        """Planned and run on the worker: the caller's thread never reads ``slots``."""
        self.check_pool(kv)
        self.submit(tag, lambda: LayeredChunkCopy(kv, host, slots, host_pages, check_end).to_host())

    def to_device(self, tag, kv, host, slots, host_pages, check_end=None) -> None:
        self.check_pool(kv)
        self.submit(tag, lambda: LayeredChunkCopy(kv, host, slots, host_pages, check_end).to_device())


class LayeredCudaCopyEngine(CudaCopyEngine):
    """``CudaCopyEngine`` over a ``LayeredKVPool`` (copy stream, completion by event query, the
    engine's one staging buffer)."""

    def to_host(self, tag, kv, host, slots, host_pages, check_end=None) -> None:
        self.check_pool(kv)
        self.submit(tag, self._launch(
            lambda: LayeredChunkCopy(kv, host, slots, host_pages, check_end, self.staging_buffer),
            "to_host", (slots,)))

    def to_device(self, tag, kv, host, slots, host_pages, check_end=None) -> None:
        self.check_pool(kv)
        self.submit(tag, self._launch(
            lambda: LayeredChunkCopy(kv, host, slots, host_pages, check_end, self.staging_buffer),
            "to_device", (slots,)))


def make_layered_copy_engine(kv: LayeredKVPool, threads: int = 2):
    """The CUDA stream engine for a CUDA pool, worker threads for a CPU pool.

    Raises:
        DeviceMismatch: the pool is on another device, or on CUDA without a usable CUDA.
    """
    if kv.device.type == "cuda" and torch.cuda.is_available():
        return LayeredCudaCopyEngine(kv.device)
    if kv.device.type != "cpu":
        raise DeviceMismatch(f"no copy engine for SGLang KV buffers on {kv.device} "
                             f"(CUDA available: {torch.cuda.is_available()})")
    return LayeredCpuCopyEngine(threads)
