"""vLLM's per-layer KV tensors <-> the host pages an SGLang node stores, both ways, bit-exact.

vLLM 0.32 (``vllm.v1.worker.utils.allocate_kv_cache``) gives one view per attention layer, logical
``[blocks, kv_heads, block_tokens, 2 * head_dim]`` over one shared int8 allocation, with the strides of
the layout the attention backend asked for (``vllm.v1.kv_cache_layout.KVCacheLayout``):

* the CPU backend (``CPU_ATTN``, layout ``LBHNC``, head-major): per block and head the interior is
  ``[2, block_tokens, head_dim]`` — the K rows of every token of the block, then their V rows
  (``cpu_attn.py``: ``kv_cache.view(B, H, 2 * N, D).chunk(2, dim=2)``): ``kv_split="rows"``;
* FlashAttention, Triton, FlashInfer (default ``LBNHC``, token-major): K is ``[..., :head_dim]``
  and V ``[..., head_dim:]`` of each token and head: ``kv_split="channels"``.

A host page is what our SGLang drop-in and ``transfer`` stack store for the same tokens and KV
(``transfer.host_pool.HostPool``: SGLang's ``page_first`` layout, MHA): ``[2, page_size, layers,
kv_heads, head_dim]`` — K then V, token, layer (in layer-index order), head, dim. A vLLM block is
one page (``page_size = block_size``); a manager block that vLLM split into kernel blocks
(``block_tokens`` < ``block_size``) is gathered from its ``block_size / block_tokens`` consecutive
kernel blocks. Every copy moves the elements reinterpreted as integers of their width, so every
dtype moves bit-exact.

Refused at construction (``VllmLayoutError``, one line): anything not a non-empty dict of 4-D
tensors of one shape, dtype and device; quantized or packed KV (any dtype but float16, bfloat16,
float32: fp8 / uint8 caches carry scales elsewhere); MLA (3-D latent caches) or an odd last dim;
layer names without exactly one layer index, or two layers on the same index or the same memory
(cross-layer KV sharing); a head-major layout with the channel split (vLLM's ``HND`` for GPU
backends) or a token-major one with the row split; a last dim that is not unit-stride, a row-split
block whose interior is not dense; kernel blocks that do not tile ``block_size``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from lifecycle.integrations.vllm.errors import VllmLayoutError
from transfer.gather import page_runs
from transfer.host_pool import HostPool

ROWS, CHANNELS = "rows", "channels"
KV_SPLITS = (ROWS, CHANNELS)
#: attention backends (``AttentionBackend.get_name()``) and how their KV is split
BACKEND_SPLIT = {
    "CPU_ATTN": ROWS,
    "FLASH_ATTN": CHANNELS,
    "TRITON_ATTN": CHANNELS,
    "FLASHINFER": CHANNELS,
}
#: plain KV dtypes: anything else (fp8, uint8, int8) is quantized or packed
PLAIN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def layer_index(name: str) -> int:
    """The layer index in a vLLM layer name (``model.layers.3.self_attn.attn`` -> 3), as vLLM's
    ``extract_layer_index`` reads it: the one integer among the name's dot-separated parts.

    Raises:
        VllmLayoutError: no integer part, or more than one.
    """
    found = [int(p) for p in name.split(".") if p.isdigit()]
    if len(found) != 1:
        raise VllmLayoutError(
            f"KV cache layer name {name!r} must hold exactly one layer index (found {found or 'none'}); "
            "pages are laid out in layer-index order")
    return found[0]


def _word(dtype: torch.dtype) -> torch.dtype:
    return _WORD[torch.empty((), dtype=dtype).element_size()]


class VllmKVLayout:
    """vLLM's per-layer KV tensors seen as SGLang ``page_first`` host pages.

    Built by ``from_kv_caches`` (which checks everything); holds the tensors (no copy).

    Attributes:
        layer_names: the layers in page order (ascending layer index).
        layers, heads, head_dim, dtype, device: the KV shape (``heads``: KV heads of this rank).
        block_size: tokens per manager block = per host page.
        num_blocks: manager blocks.
        kv_split: ``"rows"`` or ``"channels"``.
        kinds: 2 (K, V); ``mla``: False. ``slots``: ``num_blocks * block_size`` token slots (slot
            ``block * block_size + i``, as vLLM's slot mapping).
        page_nbytes: bytes of one host page.
    """

    kinds = 2
    mla = False

    def __init__(self, names: list[str], tensors: list[torch.Tensor], block_size: int, kv_split: str) -> None:
        first = tensors[0]
        blocks, heads, tokens, width = (int(x) for x in first.shape)
        self.layer_names, self.tensors = names, tensors
        self.layers, self.heads, self.head_dim = len(tensors), heads, width // 2
        self.dtype, self.device = first.dtype, first.device
        self.block_size, self.kv_split = block_size, kv_split
        self.kernel_tokens, self.ratio = tokens, block_size // tokens
        self.num_blocks = blocks // self.ratio
        self.slots = self.num_blocks * block_size
        self.word = _word(first.dtype)
        esize = first.element_size()
        self.row_bytes = heads * self.head_dim * esize
        self.page_nbytes = 2 * block_size * self.layers * self.row_bytes
        # per layer: [blocks, kind, ratio, kernel tokens, heads, head_dim] words, a view (no copy)
        self._sem = [self._semantic(t) for t in tensors]

    # --- construction -----------------------------------------------------------------------------

    @classmethod
    def from_kv_caches(cls, kv_caches: Mapping[str, torch.Tensor], block_size: int, *,
                       kv_split: str | None = None, backend: str | None = None) -> "VllmKVLayout":
        """Check vLLM's ``{layer name: tensor}`` (as ``register_kv_caches`` receives it) and view it.

        Args:
            kv_caches: per attention layer, vLLM's ``[blocks, kv_heads, block_tokens, 2*head_dim]``
                view (``allocate_kv_cache``).
            block_size: vLLM's (manager) block size: tokens per host page.
            kv_split: ``"rows"`` (CPU backend) or ``"channels"`` (FlashAttention and the others);
                None: from ``backend`` when given, else from the strides (head-major: rows,
                token-major: channels).
            backend: the attention backend's name (``AttentionBackend.get_name()``).
        Raises:
            VllmLayoutError: see the module docstring; nothing is kept.
        """
        if not isinstance(kv_caches, Mapping) or not kv_caches:
            raise VllmLayoutError(f"kv_caches must be a non-empty dict of layer name -> tensor, "
                                  f"got {type(kv_caches).__name__}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise VllmLayoutError(f"block_size must be a positive int, got {block_size!r}")
        by_index: dict[int, tuple[str, torch.Tensor]] = {}
        for name, t in kv_caches.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise VllmLayoutError(f"kv_caches entry {name!r} is {type(t).__name__}, expected a tensor "
                                      "under a layer name")
            idx = layer_index(name)
            if idx in by_index:
                raise VllmLayoutError(f"layers {by_index[idx][0]!r} and {name!r} share layer index {idx}")
            by_index[idx] = (name, t)
        ordered = [by_index[i] for i in sorted(by_index)]
        names, tensors = [n for n, _ in ordered], [t for _, t in ordered]
        first = tensors[0]
        if first.dim() != 4:
            what = "an MLA latent cache" if first.dim() == 3 else f"{first.dim()}-D"
            raise VllmLayoutError(
                f"KV cache of {names[0]!r} is {what} {tuple(first.shape)}; supported: MHA "
                "[blocks, kv_heads, block_tokens, 2*head_dim]")
        for name, t in ordered:
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise VllmLayoutError(
                    f"KV cache of {name!r} is {tuple(t.shape)} {t.dtype} on {t.device}, unlike {names[0]!r} "
                    f"{tuple(first.shape)} {first.dtype} on {first.device}: hybrid or mixed KV cache groups "
                    "are not supported")
        if first.dtype not in PLAIN_DTYPES:
            raise VllmLayoutError(
                f"KV cache dtype {first.dtype} is quantized or packed; supported: "
                f"{', '.join(str(d).replace('torch.', '') for d in PLAIN_DTYPES)} (kv_cache_dtype='auto')")
        blocks, heads, tokens, width = (int(x) for x in first.shape)
        if width % 2 or width < 2:
            raise VllmLayoutError(f"KV cache last dim {width} is not 2*head_dim (K and V)")
        if block_size % tokens or blocks % (block_size // tokens):
            raise VllmLayoutError(
                f"kernel blocks of {tokens} tokens ({blocks} of them) do not tile blocks of {block_size} tokens")
        starts = {}
        for name, t in ordered:
            if t.numel() and t.data_ptr() in starts:
                raise VllmLayoutError(f"layers {starts[t.data_ptr()]!r} and {name!r} share KV memory "
                                      "(cross-layer KV sharing is not supported)")
            starts[t.data_ptr()] = name
        split = cls._split(first, kv_split, backend)
        for name, t in ordered:
            cls._check_strides(name, t, split)
        return cls(names, tensors, block_size, split)

    @staticmethod
    def _split(t: torch.Tensor, kv_split: str | None, backend: str | None) -> str:
        head_major = t.shape[1] > 1 and t.shape[2] > 1 and t.stride(1) > t.stride(2)
        if kv_split is None and backend is not None:
            kv_split = BACKEND_SPLIT.get(backend)
            if kv_split is None:
                raise VllmLayoutError(f"attention backend {backend!r} is not supported; supported: "
                                      f"{', '.join(BACKEND_SPLIT)}")
        if kv_split is None:
            kv_split = ROWS if head_major else CHANNELS
        if kv_split not in KV_SPLITS:
            raise VllmLayoutError(f"kv_split must be one of {KV_SPLITS}, got {kv_split!r}")
        if kv_split == CHANNELS and head_major:
            raise VllmLayoutError(
                "KV cache layout HND (head-major) with K|V channels is not supported; supported: NHD "
                "(token-major; unset VLLM_KV_CACHE_LAYOUT) or the CPU backend's head-major rows")
        if kv_split == ROWS and t.shape[1] > 1 and t.shape[2] > 1 and not head_major:
            raise VllmLayoutError("the CPU backend's K/V row split needs its head-major layout (LBHNC)")
        return kv_split

    @staticmethod
    def _check_strides(name: str, t: torch.Tensor, split: str) -> None:
        if t.stride(3) != 1:
            raise VllmLayoutError(f"KV cache of {name!r}: the last dim is not unit-stride ({t.stride()})")
        if split == ROWS and t.shape[2] > 1 and t.stride(2) != t.shape[3]:
            raise VllmLayoutError(
                f"KV cache of {name!r}: a head's block interior is not dense (strides {t.stride()})")

    def _semantic(self, t: torch.Tensor) -> torch.Tensor:
        """``[blocks, kind, ratio, kernel tokens, heads, head_dim]`` words of ``t``, a view."""
        w = t.view(self.word)
        sb, sh, sn, _ = w.stride()
        r, nk, d = self.ratio, self.kernel_tokens, self.head_dim
        size = (self.num_blocks, 2, r, nk, self.heads, d)
        if self.kv_split == CHANNELS:
            stride = (sb * r, d, sb, sn, sh, 1)
        else:
            stride = (sb * r, nk * d, sb, d, sh, 1)
        return w.as_strided(size, stride, w.storage_offset())

    # --- pages ------------------------------------------------------------------------------------

    def host_pool(self, tokens: int, **kwargs) -> HostPool:
        """A ``HostPool`` of ``tokens`` slots (a multiple of ``block_size``) for these pages
        (kwargs: ``pin``, ``allow_pageable``)."""
        return HostPool(self.layers, self.heads, self.head_dim, self.dtype, self.block_size, tokens, **kwargs)

    def slots_of(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The token slots of ``block_ids`` (``block * block_size + i``, block by block), int64."""
        ids = self._ids(block_ids)
        return (ids.view(-1, 1) * self.block_size + torch.arange(self.block_size)).reshape(-1)

    def _ids(self, block_ids) -> torch.Tensor:
        ids = torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1).cpu()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise IndexError(f"block ids must lie in 0..{self.num_blocks - 1}")
        return ids

    def _gather(self, ids: torch.Tensor, out: torch.Tensor, non_blocking: bool = False) -> list:
        """Blocks ``ids`` into ``out`` (``[n, 2, block_size, layers, heads, head_dim]`` words, any
        strides). Returns the temporaries a ``non_blocking`` copy reads (keep them alive until it ends)."""
        dev = ids.to(self.device, non_blocking=non_blocking)
        n = ids.numel()
        keep = [dev]
        for layer, sem in enumerate(self._sem):
            block = sem.index_select(0, dev).view(n, 2, self.block_size, self.heads, self.head_dim)
            out[:, :, :, layer].copy_(block, non_blocking=non_blocking)
            keep.append(block)
        return keep

    def page_bytes_of(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A host copy of blocks ``block_ids`` as host pages: ``[n, 2, block_size, layers, heads,
        head_dim]`` of the KV dtype; ``out[i].reshape(-1).view(torch.uint8)`` is page ``i``'s stored
        bytes (``HostPool.page_bytes``)."""
        ids = self._ids(block_ids)
        out = torch.empty((ids.numel(), 2, self.block_size, self.layers, self.heads, self.head_dim),
                          dtype=self.word)
        self._gather(ids, out)
        return out.view(self.dtype)

    def to_host(self, block_ids: Sequence[int], host: HostPool, host_pages: Sequence[int],
                non_blocking: bool = False) -> list:
        """Copy blocks ``block_ids`` into ``host``'s pages ``host_pages`` (same count), straight into
        the pool's buffer (one gather per layer per run of consecutive host pages). With
        ``non_blocking`` (KV on CUDA, a pinned pool, on the copy stream) returns the temporaries to
        keep alive until the copy has ended."""
        keep = []
        for ids, pages in self._host_runs(block_ids, host, host_pages):
            keep += self._gather(ids, pages, non_blocking)
        return keep

    def write_pages(self, block_ids: Sequence[int], pages) -> None:
        """Write host pages into blocks ``block_ids`` (device <- host).

        Args:
            pages: a ``[n, 2, block_size, layers, heads, head_dim]`` tensor of the KV dtype (as
                ``page_bytes_of`` returns), or ``n`` pages' raw bytes (uint8 tensors of
                ``page_nbytes`` each, as a storage tier returns them).
        Raises:
            ValueError: wrong count, shape or size.
        """
        ids = self._ids(block_ids)
        shape = (2, self.block_size, self.layers, self.heads, self.head_dim)
        if isinstance(pages, torch.Tensor):
            if tuple(pages.shape) != (ids.numel(), *shape) or pages.dtype != self.dtype:
                raise ValueError(f"pages must be {(ids.numel(), *shape)} {self.dtype}, got "
                                 f"{tuple(pages.shape)} {pages.dtype}")
            src = pages.view(self.word)
        else:
            pages = list(pages)
            if len(pages) != ids.numel() or any(
                    not isinstance(p, torch.Tensor) or p.numel() * p.element_size() != self.page_nbytes for p in pages):
                raise ValueError(f"{ids.numel()} pages of {self.page_nbytes} bytes expected")
            src = torch.stack([p.reshape(-1).view(torch.uint8) for p in pages]).view(self.word).view(-1, *shape)
        self._scatter(ids, src)

    def from_host(self, host: HostPool, host_pages: Sequence[int], block_ids: Sequence[int],
                  non_blocking: bool = False) -> list:
        """Copy ``host``'s pages ``host_pages`` into blocks ``block_ids`` (same count); returns what
        a ``non_blocking`` copy reads (see ``to_host``)."""
        keep = []
        for ids, pages in self._host_runs(block_ids, host, host_pages):
            keep += self._scatter(ids, pages, non_blocking)
        return keep

    def _scatter(self, ids: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> list:
        dev = ids.to(self.device, non_blocking=non_blocking)
        n = ids.numel()
        r, nk = self.ratio, self.kernel_tokens
        keep = [dev]
        for layer, sem in enumerate(self._sem):
            block = src[:, :, :, layer].to(self.device, non_blocking=non_blocking).reshape(
                n, 2, r, nk, self.heads, self.head_dim)
            sem.index_copy_(0, dev, block)
            keep.append(block)
        return keep

    def _host_runs(self, block_ids, host: HostPool, host_pages) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``block_ids`` paired with ``host``'s pages ``host_pages`` (checked), one ``(block ids, host
        pages' words)`` per run of consecutive host pages."""
        ids, pages = self._ids(block_ids), [int(p) for p in host_pages]
        self._check_host(host, ids, pages)
        buf = host.buffer.view(self.word)
        return [(ids[pos:pos + n], buf[first:first + n]) for pos, first, n in page_runs(pages)]

    def _check_host(self, host: HostPool, ids: torch.Tensor, pages: list[int]) -> None:
        want = (2, self.block_size, self.layers, self.heads, self.head_dim)
        if host.mla or tuple(host.buffer.shape[1:]) != want or host.dtype != self.dtype:
            raise ValueError(f"host pool pages are {tuple(host.buffer.shape[1:])} {host.dtype}, "
                             f"these blocks {want} {self.dtype}")
        if len(pages) != ids.numel():
            raise ValueError(f"{ids.numel()} blocks, {len(pages)} host pages")
        if pages and (min(pages) < 0 or max(pages) >= host.num_pages):
            raise IndexError(f"host pages must lie in 0..{host.num_pages - 1}")

    def describe(self) -> dict:
        """What the layout is, for logs."""
        return {"layers": self.layers, "kv_heads": self.heads, "head_dim": self.head_dim,
                "dtype": str(self.dtype).replace("torch.", ""), "block_size": self.block_size,
                "kernel_block_tokens": self.kernel_tokens, "blocks": self.num_blocks, "kv_split": self.kv_split}


__all__ = ["BACKEND_SPLIT", "CHANNELS", "KV_SPLITS", "PLAIN_DTYPES", "ROWS", "VllmKVLayout", "layer_index"]
