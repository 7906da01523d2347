"""vLLM-shaped per-layer KV tensors for tests that run without vLLM, and an oracle that reads and
writes them the way vLLM's attention kernels do.

``make_kv_caches`` lays the tensors out as vLLM 0.32's ``allocate_kv_cache`` does (one shared int8
allocation, layer-compact, one ``[blocks, kv_heads, block_tokens, 2*head_dim]`` view per layer):
``"rows"`` as the CPU backend's ``LBHNC`` (head-major, dense), ``"channels"`` as FlashAttention's
default ``LBNHC`` (token-major). ``write_kv`` / ``read_kv`` address K and V exactly as the kernels do
(``cpu_attn.py``: ``kv_cache.view(B, H, 2 * N, D).chunk(2, dim=2)``; ``flash_attn.py``:
``kv_cache.transpose(1, 2).split(head_size, dim=-1)``) and never go through
``lifecycle.integrations.vllm.layout``: they are the independent side of its tests.
"""

from __future__ import annotations

import torch


def make_kv_caches(split: str, layers: int, blocks: int, heads: int, block_tokens: int, head_dim: int,
                   dtype: torch.dtype, *, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """``{layer name: view}`` over one zeroed int8 allocation (``blocks`` kernel blocks of
    ``block_tokens`` tokens per layer)."""
    esize = torch.empty((), dtype=dtype).element_size()
    width = 2 * head_dim
    per_layer = blocks * heads * block_tokens * width
    raw = torch.zeros(layers * per_layer * esize, dtype=torch.int8)
    typed = raw.view(dtype)
    names = names or [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    out = {}
    for layer, name in enumerate(names):
        base = layer * per_layer
        if split == "rows":   # [B, H, N, C] dense
            stride = (heads * block_tokens * width, block_tokens * width, width, 1)
        else:                 # physical [B, N, H, C], logical [B, H, N, C]
            stride = (block_tokens * heads * width, width, heads * width, 1)
        out[name] = typed.as_strided((blocks, heads, block_tokens, width), stride, base)
    return out


def _kv_views(t: torch.Tensor, split: str, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer as ``[kernel blocks, tokens, heads, head_dim]`` views, addressed as the
    kernels address them."""
    blocks, heads, tokens, _ = t.shape
    if split == "rows":
        key, value = t.view(blocks, heads, 2 * tokens, head_dim).chunk(2, dim=2)
        return key.transpose(1, 2), value.transpose(1, 2)
    key, value = t.transpose(1, 2).split(head_dim, dim=-1)
    return key, value


def write_kv(caches: dict[str, torch.Tensor], split: str, kv: torch.Tensor) -> None:
    """Write ``kv`` (``[2, layers, slots, heads, head_dim]``, ``transfer.KVPool.buffer``'s layout;
    slot = kernel block * block_tokens + token) into the caches, layer ``i`` = the ``i``-th name."""
    head_dim = kv.shape[-1]
    for layer, t in enumerate(caches.values()):
        key, value = _kv_views(t, split, head_dim)
        blocks, tokens = key.shape[0], key.shape[1]
        key.copy_(kv[0, layer].reshape(blocks, tokens, *kv.shape[3:]))
        value.copy_(kv[1, layer].reshape(blocks, tokens, *kv.shape[3:]))


def read_kv(caches: dict[str, torch.Tensor], split: str, head_dim: int) -> torch.Tensor:
    """The caches' KV as ``[2, layers, slots, heads, head_dim]`` (a copy)."""
    out = []
    for t in caches.values():
        key, value = _kv_views(t, split, head_dim)
        out.append(torch.stack([key.reshape(-1, *key.shape[2:]), value.reshape(-1, *value.shape[2:])]))
    return torch.stack(out, dim=1)


def write_slots(caches: dict[str, torch.Tensor], split: str, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Write ``kv`` (``[2, layers, n, heads, head_dim]``) at token ``slots`` (kernel block *
    block_tokens + token), as the attention kernels address them: what a forward writes."""
    head_dim = kv.shape[-1]
    for layer, t in enumerate(caches.values()):
        key, value = _kv_views(t, split, head_dim)
        tokens = key.shape[1]
        b, i = slots // tokens, slots % tokens
        key[b, i] = kv[0, layer].to(key.dtype)
        value[b, i] = kv[1, layer].to(value.dtype)


def read_slots(caches: dict[str, torch.Tensor], split: str, slots: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The KV at token ``slots``: ``[2, layers, n, heads, head_dim]``."""
    out = []
    for t in caches.values():
        key, value = _kv_views(t, split, head_dim)
        tokens = key.shape[1]
        b, i = slots // tokens, slots % tokens
        out.append(torch.stack([key[b, i], value[b, i]]))
    return torch.stack(out, dim=1)
