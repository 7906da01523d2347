"""Deterministic synthetic KV: a pure function of (request, position), for tests and the simulator."""

from __future__ import annotations

import torch

from transfer.kv_pool import KVPool


def synthetic_kv(pool: KVPool, request: int, positions: torch.Tensor) -> torch.Tensor:
    """KV for tokens at ``positions`` of request ``request``, shaped for ``KVPool.write``.

    Every byte is ``hash(request, position, kind, layer, byte offset) mod 256`` built from integer
    arithmetic, so it is reproducible, differs between requests and positions, and is bit-exact
    in any dtype (values are compared as bytes; some bit patterns may be NaN, which is fine).
    """
    pos = positions.to(torch.int64).view(1, 1, -1, 1)
    nbytes = pool.heads * pool.head_dim * torch.empty((), dtype=pool.dtype).element_size()
    kind = torch.arange(pool.kinds, dtype=torch.int64).view(-1, 1, 1, 1)
    layer = torch.arange(pool.layers, dtype=torch.int64).view(1, -1, 1, 1)
    off = torch.arange(nbytes, dtype=torch.int64).view(1, 1, 1, -1)
    x = (request * 1_000_003 + pos * 7_919 + kind * 104_729 + layer * 1_299_709 + off * 31) & 0xFFFFFFFF
    x = (x * 2_654_435_761) & 0xFFFFFFFF
    raw = ((x >> 13) & 0xFF).to(torch.uint8)
    shape = (pool.kinds, pool.layers, pos.shape[2], pool.heads, pool.head_dim)
    return raw.view(pool.kinds, pool.layers, pos.shape[2], nbytes).view(pool.dtype).view(shape)
