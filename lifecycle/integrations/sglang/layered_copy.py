"""Chunk copies between SGLang's per-layer device buffers and our page-first host pool.

A host page is ``HostPool.buffer[page] = [kinds, page_size, layers, heads, head_dim]``; a device
page of layer ``l`` is ``buffers[kind][l][slot:slot + page_size]``. Both sides are reinterpreted
as the integer type of the same width, so every dtype moves bit-exact.

Three ways, chosen per chunk:

* **Kernel** (CUDA, when ``sgl_kernel.kvcacheio`` imports with the all-layer kernels, the host pool
  is pinned and a token row is a multiple of 8 bytes): device -> host is SGLang's own
  ``transfer_kv_all_layer_lf_pf`` (``..._mla_lf_pf`` for MLA), one launch per chunk over a table of
  the per-layer buffers' addresses, writing straight into the pinned host pages (no staging), as
  SGLang 0.5.19's HiCache host pool calls it for its ``page_first`` layout. Host -> device is its
  ``transfer_kv_per_layer_pf_lf`` (``..._mla_pf_lf``), one launch per layer, as SGLang loads. The
  scheduler thread's work per chunk does not grow with layers.
* **Staged** (CUDA without the kernels; on the CPU when a ``Staging`` is given, which tests use to
  run this path): per piece of the chunk within the staging budget (``transfer.gather.Staging``),
  one device ``index_select`` of whole pages per buffer straight into that buffer's slab of the
  staging buffer, then one async D2H copy per run of consecutive host pages. The per-buffer views
  and slab views are built once (per pool, per staging buffer) and reused; what is left per chunk
  is one indexing op per buffer: torch has no op that gathers from many separate tensors.
* **Direct** (CPU pools, on the copy worker): per run of pages consecutive on both sides, one
  strided copy per buffer; scattered device pages: one row gather per buffer and host run.

The engines subclass ``transfer``'s, so ``HostOffloader`` drives them unchanged.
"""

from __future__ import annotations

import weakref

import torch

from transfer.copy_engine import CpuCopyEngine, CudaCopyEngine
from transfer.errors import DeviceMismatch
from transfer.gather import (DEFAULT_STAGING_BYTES, Staging, check_on_device, check_staging_bytes, landed_error,
                             page_runs, piece_runs)
from transfer.indices import as_index_tensor, as_tensor, pages_of_slots
from transfer.host_pool import HostPool

from lifecycle.integrations.sglang.device_pool import LayeredKVPool
from lifecycle.log import get_logger

log = get_logger("lifecycle.integrations.sglang.layered_copy")

_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: ``sgl_kernel.kvcacheio`` functions the kernel path calls (SGLang 0.5.19's keyword names)
KERNEL_FUNCTIONS = ("transfer_kv_all_layer_lf_pf", "transfer_kv_all_layer_mla_lf_pf",
                    "transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_mla_pf_lf")

#: warn at construction above this many copy ops per running request per decode step: a chunk
#: (``stride`` tokens) costs one kernel launch, or one gather per buffer (kinds x layers) without
#: the kernel, so ``ops per chunk / stride``; at batch 128, 4 is 512 ops (~1-2 ms of scheduler CPU)
#: a step. Not counted: the chunk's fixed ~16 small ops (slot check, index building), the same at
#: any depth.
OPS_PER_REQUEST_STEP_WARN = 4


def _word(dtype: torch.dtype) -> torch.dtype:
    return _WORD[torch.empty((), dtype=dtype).element_size()]


def load_kernel():
    """``sgl_kernel.kvcacheio`` when it imports and has every ``KERNEL_FUNCTIONS``, else None."""
    try:
        from sgl_kernel import kvcacheio  # SGLang's CUDA kernels: present on SGLang GPU nodes
    except Exception:  # noqa: BLE001 - absent, or built for another torch/CUDA: the staged path
        return None
    if not all(callable(getattr(kvcacheio, name, None)) for name in KERNEL_FUNCTIONS):
        return None
    return kvcacheio


def kernel_fits(kv: LayeredKVPool, host: HostPool) -> bool:
    """Whether the kernels can copy between these pools: rows a multiple of 8 bytes (the kernel
    moves 8-byte words), a contiguous host buffer, pinned when the pool is on CUDA (the kernel
    writes and reads host memory through its device mapping)."""
    return (kv.row_bytes % 8 == 0 and host.buffer.is_contiguous()
            and (kv.device.type != "cuda" or bool(host.pinned)))


class PoolViews:
    """One device pool's word views for one page size, built once and reused by every chunk.

    ``flat[i]`` / ``pages[i]`` is buffer ``i`` in (kind, layer) order as ``[slots, heads, dim]`` /
    ``[whole pages, page_size, heads, dim]`` words (slots past the last whole page left out: never
    a slot of a page).
    """

    def __init__(self, kv: LayeredKVPool, page_size: int) -> None:
        self.word = _word(kv.dtype)
        self.keys = [(k, layer) for k in range(kv.kinds) for layer in range(kv.layers)]
        self.flat = [b.view(self.word) for kind in kv.buffers for b in kind]
        whole = kv.slots // page_size * page_size
        self.pages = [b[:whole].view(-1, page_size, kv.heads, kv.head_dim) for b in self.flat]
        self.token = torch.arange(page_size, dtype=torch.int64)


_VIEWS: "weakref.WeakKeyDictionary[LayeredKVPool, dict[int, PoolViews]]" = weakref.WeakKeyDictionary()
_TABLES: "weakref.WeakKeyDictionary[LayeredKVPool, list[torch.Tensor]]" = weakref.WeakKeyDictionary()


def address_tables(kv: LayeredKVPool) -> list[torch.Tensor]:
    """Per kind, the uint64 addresses of the pool's per-layer buffers on the pool's device (the
    kernels' ``src_k_layers`` / ``src_v_layers``, as SGLang's ``k_data_ptrs``): built once per pool
    (``make_layered_copy_engine`` builds them, so no decode step does)."""
    tables = _TABLES.get(kv)
    if tables is None:
        tables = _TABLES.setdefault(kv, [
            torch.tensor([b.data_ptr() for b in kind], dtype=torch.uint64, device=kv.device)
            for kind in kv.buffers])
    return tables


def pool_views(kv: LayeredKVPool, page_size: int) -> PoolViews:
    """The cached ``PoolViews`` of ``kv`` for ``page_size`` (built on first use, dropped with the pool)."""
    per_pool = _VIEWS.get(kv)
    if per_pool is None:
        per_pool = _VIEWS.setdefault(kv, {})
    views = per_pool.get(page_size)
    if views is None:
        views = per_pool.setdefault(page_size, PoolViews(kv, page_size))
    return views


def host_token_ids(host_pages: torch.Tensor, kinds: int, page_size: int, token: torch.Tensor,
                   device: torch.device) -> torch.Tensor:
    """The kernels' host index of every token of ``host_pages``: ``page * kinds * page_size +
    token`` (with ``dst_k = buffer[:, 0]``, ``dst_v = buffer[:, 1]`` and a token stride of
    ``layers * row bytes``, that addresses ``buffer[page, kind, token, layer]``), on ``device``
    (through pinned memory, asynchronously, on CUDA)."""
    ids = (host_pages.to(torch.int64).view(-1, 1) * (kinds * page_size) + token).view(-1)
    if device.type == "cuda":
        ids = ids.pin_memory().to(device, non_blocking=True)
    return ids


class LayeredChunkCopy:
    """A planned copy between device ``slots`` (whole pages) and ``host_pages`` (same count).

    Args:
        check_end: when given, the slot ids must be whole aligned pages inside ``0 .. check_end-1``;
            direct: checked here (``BadIndices``); kernel and staged: checked on the device, the
            verdict read by ``landed_error`` after the copy's event (a bad chunk moves harmless
            clamped rows).
        staging: the engine's ``Staging`` (staged path; None on CUDA: one of the default budget).
        kernel: ``sgl_kernel.kvcacheio`` (or anything with ``KERNEL_FUNCTIONS``): the kernel path,
            when ``kernel_fits`` the pools.
    Raises:
        ValueError: the pools disagree on shape or dtype.
    """

    def __init__(self, kv: LayeredKVPool, host: HostPool, slots: torch.Tensor, host_pages: torch.Tensor,
                 check_end: int | None = None, staging: Staging | None = None, kernel=None) -> None:
        shape = (kv.kinds, kv.layers, kv.heads, kv.head_dim, kv.dtype)
        if shape != (host.kinds, host.layers, host.heads, host.head_dim, host.dtype):
            raise ValueError(f"device pool {shape} and host pool disagree")
        slots, host_pages = as_tensor(slots), as_tensor(host_pages)  # NumPy ids from the scheduler thread
        self.kv, self.host, self.ps = kv, host, host.page_size
        self.views = views = pool_views(kv, self.ps)
        self.host_words = host.buffer.view(views.word)
        self.n_pages = host_pages.numel()
        self.kernel = kernel if kernel is not None and kernel_fits(kv, host) else None
        self.cuda = kv.device.type == "cuda" or staging is not None or self.kernel is not None  # ids on device
        self.check_end, self.ok, self.pool = check_end, None, staging
        self.staging: torch.Tensor | None = None
        if self.cuda:
            self.index = slots.to(kv.device, dtype=torch.int64, non_blocking=True)
            if self.kernel is not None and check_end is None:
                # the kernel reads and writes where the ids say, unchecked: always check and clamp
                self.check_end = check_end = kv.slots
            if check_end is not None:
                self.index, self.ok = check_on_device(self.index, self.ps, check_end)
            if self.kernel is not None:
                self.host_ids = host_token_ids(host_pages, kv.kinds, self.ps, views.token, kv.device)
                return
            self.page_ids = self.index.view(-1, self.ps)[:, 0] // self.ps  # device pages, on the device
            self.runs = page_runs(host_pages)
            if self.pool is None:
                self.pool = Staging(kv.device)
            return
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

    # -- the kernel path -------------------------------------------------------------------------
    def _kernel_to_host(self) -> None:
        kv, buf = self.kv, self.host.buffer
        item = kv.row_bytes
        tables = address_tables(kv)
        if kv.mla:
            self.kernel.transfer_kv_all_layer_mla_lf_pf(
                src_layers=tables[0], dst=buf, src_indices=self.index, dst_indices=self.host_ids,
                item_size=item, dst_layout_dim=kv.layers * item, num_layers=kv.layers)
        else:
            self.kernel.transfer_kv_all_layer_lf_pf(
                src_k_layers=tables[0], dst_k=buf[:, 0], src_v_layers=tables[1], dst_v=buf[:, 1],
                src_indices=self.index, dst_indices=self.host_ids,
                item_size=item, dst_layout_dim=kv.layers * item, num_layers=kv.layers)

    def _kernel_to_device(self) -> None:
        kv, buf = self.kv, self.host.buffer
        item = kv.row_bytes
        for layer in range(kv.layers):
            if kv.mla:
                self.kernel.transfer_kv_per_layer_mla_pf_lf(
                    src=buf, dst=kv.buffers[0][layer], src_indices=self.host_ids, dst_indices=self.index,
                    layer_id=layer, item_size=item, src_layout_dim=kv.layers * item)
            else:
                self.kernel.transfer_kv_per_layer_pf_lf(
                    src_k=buf[:, 0], dst_k=kv.buffers[0][layer], src_v=buf[:, 1], dst_v=kv.buffers[1][layer],
                    src_indices=self.host_ids, dst_indices=self.index,
                    layer_id=layer, item_size=item, src_layout_dim=kv.layers * item)

    # -- the staged path -------------------------------------------------------------------------
    def _pieces(self):
        """Per piece of the chunk within the staging budget: the staging buffer's view in host page
        layout, the per-buffer slab views of it (both built once per piece size and buffer), the
        piece's device page ids, and its runs of host pages."""
        kv, ps, word = self.kv, self.ps, self.views.word
        width = kv.heads * kv.head_dim
        rows_per_page = kv.kinds * ps * kv.layers
        page_bytes = self.host.page_nbytes
        for pos, n in self.pool.pieces(self.n_pages, page_bytes):
            flat = self.pool.take(n * rows_per_page, width, word, page_bytes)

            def build(flat=flat, n=n):
                pages = flat.view(n, kv.kinds, ps, kv.layers, kv.heads, kv.head_dim)
                return pages, [pages[:, k, :, layer] for k, layer in self.views.keys]

            key = ("layered", n, kv.kinds, ps, kv.layers, kv.heads, kv.head_dim, word)
            pages, slabs = self.pool.cached(key, build)
            yield pages, slabs, self.page_ids[pos:pos + n], piece_runs(self.runs, pos, n)

    def to_host(self) -> None:
        """Device -> host (on CUDA: launched on the current stream, asynchronous)."""
        if self.kernel is not None:
            self._kernel_to_host()
            return
        if self.cuda:
            select = torch.index_select
            for pages, slabs, ids, runs in self._pieces():
                for src, dst in zip(self.views.pages, slabs):  # one gather per buffer, into its slab
                    select(src, 0, ids, out=dst)
                for at, first, length in runs:
                    self.host_words[first:first + length].copy_(pages[at:at + length], non_blocking=True)
                self.staging = pages  # alive until the copy's event fires
            return
        keys, flat = self.views.keys, self.views.flat
        if self.gather:
            for pos, first, n in self.runs:
                rows = self.index[pos * self.ps:(pos + n) * self.ps]
                for (k, layer), buf in zip(keys, flat):
                    self.host_words[first:first + n, k, :, layer].copy_(self._pages(buf.index_select(0, rows), n))
            return
        for dev, host, n in self.block_runs:
            for (k, layer), buf in zip(keys, flat):
                self.host_words[host:host + n, k, :, layer].copy_(
                    self._pages(buf[dev:dev + n * self.ps], n))

    def to_device(self) -> None:
        """Host -> device (on CUDA: asynchronous; staged: H2D per run, then one scatter per buffer)."""
        kv = self.kv
        if self.kernel is not None:
            self._kernel_to_device()
            return
        if self.cuda:
            for pages, slabs, ids, runs in self._pieces():
                for at, first, length in runs:
                    pages[at:at + length].copy_(self.host_words[first:first + length], non_blocking=True)
                for dst, src in zip(self.views.pages, slabs):  # one scatter per buffer, from its slab
                    dst.index_copy_(0, ids, src)
                self.staging = pages
            return
        keys, flat = self.views.keys, self.views.flat
        if self.gather:
            for pos, first, n in self.runs:
                rows = self.index[pos * self.ps:(pos + n) * self.ps]
                for (k, layer), buf in zip(keys, flat):
                    part = self.host_words[first:first + n, k, :, layer]
                    buf.index_copy_(0, rows, part.reshape(n * self.ps, kv.heads, kv.head_dim))
            return
        for dev, host, n in self.block_runs:
            for (k, layer), buf in zip(keys, flat):
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
    """``CudaCopyEngine`` over a ``LayeredKVPool`` (copy stream, completion by event query; SGLang's
    all-layer kernel when ``kernel`` is given, else the engine's one bounded staging buffer).

    Args:
        device: the pool's CUDA device.
        staging_bytes: the staging buffer's budget (``transfer.gather.Staging``).
        kernel: ``sgl_kernel.kvcacheio`` (``load_kernel()``), or None for the staged path.
    """

    def __init__(self, device, staging_bytes: int = DEFAULT_STAGING_BYTES, kernel=None) -> None:
        super().__init__(device, staging_bytes=staging_bytes)
        self.kernel = kernel

    def to_host(self, tag, kv, host, slots, host_pages, check_end=None) -> None:
        self.check_pool(kv)
        self.submit(tag, self._launch(
            lambda: LayeredChunkCopy(kv, host, slots, host_pages, check_end, self.staging_buffer, self.kernel),
            "to_host", (slots,)))

    def to_device(self, tag, kv, host, slots, host_pages, check_end=None) -> None:
        self.check_pool(kv)
        self.submit(tag, self._launch(
            lambda: LayeredChunkCopy(kv, host, slots, host_pages, check_end, self.staging_buffer, self.kernel),
            "to_device", (slots,)))


def copy_ops_per_chunk(kv: LayeredKVPool, kernel: bool) -> int:
    """Copy ops one chunk costs the thread that plans it: one kernel launch, or one gather per
    buffer (kinds x layers) without the kernel."""
    return 1 if kernel else kv.kinds * kv.layers


def warn_if_copy_work_large(kv: LayeredKVPool, offload_stride: int | None, kernel: bool) -> float | None:
    """Log ``sglang.copy_work_large`` (WARNING) when a running request costs more than
    ``OPS_PER_REQUEST_STEP_WARN`` device ops per decode step: one chunk every ``offload_stride``
    tokens, ``copy_ops_per_chunk`` each. Returns that rate (None: no stride given)."""
    if offload_stride is None:
        return None
    per_step = copy_ops_per_chunk(kv, kernel) / offload_stride
    if per_step > OPS_PER_REQUEST_STEP_WARN:
        log.warning("sglang.copy_work_large", ops_per_request_step=round(per_step, 2),
                    limit=OPS_PER_REQUEST_STEP_WARN, stride=offload_stride, layers=kv.layers, kinds=kv.kinds,
                    path="kernel" if kernel else "per-buffer",
                    advice="raise SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE" + (
                        "" if kernel else " or install sgl_kernel (one launch per chunk)"))
    return per_step


def make_layered_copy_engine(kv: LayeredKVPool, threads: int = 2, *, offload_stride: int | None = None,
                             staging_bytes: int = DEFAULT_STAGING_BYTES, kernel=None):
    """The CUDA stream engine for a CUDA pool, worker threads for a CPU pool.

    On CUDA the engine uses SGLang's all-layer kernel when ``load_kernel()`` finds it (``kernel``:
    False never, None look it up, else the module to use); its address tables are built here, not
    on a decode step. With ``offload_stride`` (tokens per chunk) it warns when the copy work per
    decode step is large (``warn_if_copy_work_large``).

    Raises:
        DeviceMismatch: the pool is on another device, or on CUDA without a usable CUDA.
        ValueError: ``staging_bytes`` is not a positive int (nothing built).
    """
    check_staging_bytes(staging_bytes)
    if kv.device.type == "cuda" and torch.cuda.is_available():
        module = load_kernel() if kernel is None else (None if kernel is False else kernel)
        engine = LayeredCudaCopyEngine(kv.device, staging_bytes=staging_bytes, kernel=module)
        uses_kernel = module is not None and kv.row_bytes % 8 == 0  # and a pinned host pool, per chunk
        if uses_kernel:
            address_tables(kv)  # one host -> device copy, here rather than on a decode step
        log.info("sglang.copy_path", path="kernel" if uses_kernel else "staged",
                 staging_bytes=staging_bytes, layers=kv.layers, kinds=kv.kinds)
        warn_if_copy_work_large(kv, offload_stride, uses_kernel)
        return engine
    if kv.device.type != "cpu":
        raise DeviceMismatch(f"no copy engine for SGLang KV buffers on {kv.device} "
                             f"(CUDA available: {torch.cuda.is_available()})")
    warn_if_copy_work_large(kv, offload_stride, False)
    return LayeredCpuCopyEngine(threads)
