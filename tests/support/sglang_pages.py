"""Host pages with known KV, and the check that an SGLang host pool (the verbatim copy in
``tests/data/sglang_0_5_19.py``) holds the same KV for every token and layer, whatever its layout."""

from __future__ import annotations

import itertools

import torch

from tests.data.sglang_0_5_19 import MHAHostPool, MLAHostPool
from transfer.host_pool import HostPool


def random_host(layers: int, heads: int, head_dim: int, page_size: int, pages: int, mla: bool,
                dtype=torch.bfloat16, seed: int = 7) -> HostPool:
    """A host pool whose every byte is random (MLA: ``heads`` 1, ``head_dim`` the latent width)."""
    host = HostPool(layers, 1 if mla else heads, head_dim, dtype, page_size, pages * page_size, mla=mla)
    g = torch.Generator().manual_seed(seed)
    nbytes = host.buffer.numel() * host.buffer.element_size()
    host.buffer.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    return host


def sglang_pool(host: HostPool, layout: str, pages: int):
    """An empty SGLang host pool of ``layout`` for ``host``'s model shape."""
    _, kinds, page_size, layers, heads, dim = host.buffer.shape
    if host.mla:
        return MLAHostPool(layout, pages * page_size, page_size, layers, dim, host.buffer.dtype)
    return MHAHostPool(layout, pages * page_size, page_size, layers, heads, dim, host.buffer.dtype)


def same_kv(host: HostPool, page: int, pool, sglang_page: int) -> bool:
    """Whether every token's and layer's K and V (MLA: latent) of our host page equal SGLang's page."""
    view = host.page_view(page)
    page_size, layers = view.shape[1], view.shape[2]
    for t, layer in itertools.product(range(page_size), range(layers)):
        theirs = pool.token_kv(sglang_page * page_size + t, layer)
        if host.mla:
            ours = view[0, t, layer]
            if not torch.equal(ours.view(torch.uint8), theirs.reshape(ours.shape).view(torch.uint8)):
                return False
            continue
        for kind in (0, 1):
            if not torch.equal(view[kind, t, layer].view(torch.uint8), theirs[kind].view(torch.uint8)):
                return False
    return True


def fill_random(pool, seed: int) -> None:
    """Random bytes in every element of an SGLang host pool."""
    g = torch.Generator().manual_seed(seed)
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))
