"""SGLang's device KV cache, read in place: per-layer buffers seen as one ``transfer`` device pool.

SGLang (0.5.19, 0.5.23) keeps one tensor per layer: ``MHATokenToKVPool.k_buffer[l]`` / ``v_buffer[l]`` of
shape ``[size + page_size, head_num, head_dim]`` (NHD layout), and
``MLATokenToKVPool.kv_buffer[l]`` of shape ``[size + page_size, 1, kv_lora_rank +
qk_rope_head_dim]``, in the pool's ``store_dtype`` (uint8 for fp8). ``LayeredKVPool`` holds those
very tensors (no copy) and exposes what ``transfer.HostOffloader`` needs of a device pool.
"""

from __future__ import annotations

import torch

from lifecycle.integrations.sglang.errors import SGLangConfigError

MHA, MLA = "MHATokenToKVPool", "MLATokenToKVPool"
# subclasses whose buffers hold something else than plain per-token KV rows (packed FP4 / MXFP8
# with scale buffers, page-major envelopes, no-op pools)
UNSUPPORTED = frozenset({
    "MHATokenToKVPoolFP4", "MHATokenToKVPoolMXFP8", "PageMajorMHATokenToKVPool",
    "NoOpMHATokenToKVPool", "MLATokenToKVPoolFP4",
})
_SCALES = ("k_scale_buffer", "v_scale_buffer", "kv_scale_buffer")
# SGLang 0.5.19's unified memory pool (--enable-unified-memory, sglang/srt/mem_cache/
# unified_memory_pool.py and multi_ended_allocator.py): its KV pools are views of one byte buffer
# addressed through the allocator's virtual -> physical table, and req_to_token holds virtual ids
VIRTUAL_ID_POOLS = frozenset({"UnifiedMHATokenToKVPool", "UnifiedMLATokenToKVPool", "UnifiedKVPool"})
VIRTUAL_ID_ROWS = frozenset({"UnifiedHybridReqToTokenPool"})
VIRTUAL_ID_ALLOCATORS = frozenset({
    "MultiEndedAllocator", "FloatMultiEndedAllocator", "UnifiedMambaTokenToKVPoolAllocator",
    "UnifiedSWATokenToKVPoolAllocator",
})
# what an allocator whose ids are virtual has (SGLang's base allocator has none of these)
_VIRTUAL_ID_MARKS = ("virtual_to_physical", "translate_kv_loc", "translate_kv_loc_for_kernel")
# hybrid sliding-window pools: full-attention and SWA layers in two sub-pools, SWA ids translated
# from full ones (SGLang 0.5.23's own manager offloads UnifiedSWAKVPool as two host pools,
# build_hybrid_swa_stack; 0.5.19's refuses every SWA pool)
HYBRID_SWA = frozenset({"SWAKVPool", "UnifiedSWAKVPool", "UnifiedDraftSWAKVPool"})


def check_pool_kind(kv_cache) -> None:
    """Refuse a hybrid sliding-window KV pool (``SWAKVPool`` and its subclasses, SGLang 0.5.23's
    ``UnifiedSWAKVPool`` among them) in one line: the drop-in offloads one full-attention pool.

    Raises:
        SGLangConfigError: one line naming the class and what to run instead.
    """
    names = _class_names(kv_cache)
    if any(n in HYBRID_SWA for n in names):
        cls = type(kv_cache).__name__
        raise SGLangConfigError(
            f"hybrid sliding-window KV pool {cls} is not supported by kv-lifecycle's decode offload "
            "(it offloads one full-attention pool; SGLang 0.5.23's own manager offloads the full and "
            "SWA layers as two host pools): for this model, run SGLang's own manager (unset KV_LIFECYCLE_SGLANG)")


class LayeredKVPool:
    """Device KV as ``buffers[kind][layer]``, each ``[slots, heads, head_dim]`` (kind 0 = K or the
    MLA latent, 1 = V).

    Args:
        buffers: per kind, one contiguous tensor per layer; all of one shape, dtype and device.
        mla: latent-only KV (one kind, one head).
    Raises:
        SGLangConfigError: ragged, non-contiguous or mismatched buffers.
    """

    def __init__(self, buffers, mla: bool) -> None:
        kinds = 1 if mla else 2
        if not isinstance(buffers, (list, tuple)) or len(buffers) != kinds:
            raise SGLangConfigError(f"expected {kinds} buffer lists, got {type(buffers).__name__}")
        layers = [list(b) if isinstance(b, (list, tuple)) else None for b in buffers]
        if any(b is None or not b for b in layers) or len({len(b) for b in layers}) != 1:
            raise SGLangConfigError("device KV buffers must be non-empty per-layer lists of equal length")
        first = layers[0][0]
        for kind, per_layer in enumerate(layers):
            for layer, t in enumerate(per_layer):
                if not isinstance(t, torch.Tensor):
                    raise SGLangConfigError(f"device KV buffer [{kind}][{layer}] is not a tensor")
                if t.dim() != 3 or t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                    raise SGLangConfigError(
                        f"device KV buffer [{kind}][{layer}] is {tuple(t.shape)} {t.dtype} on {t.device}; "
                        f"expected [slots, heads, head_dim] like buffer [0][0] {tuple(first.shape)} "
                        f"{first.dtype} on {first.device}")
                if not t.is_contiguous():
                    raise SGLangConfigError(f"device KV buffer [{kind}][{layer}] is not contiguous")
        if mla and first.shape[1] != 1:
            raise SGLangConfigError(f"an MLA buffer has one latent head, got {first.shape[1]}")
        self.buffers = layers
        self.mla, self.kinds, self.layers = mla, kinds, len(layers[0])
        self.slots, self.heads, self.head_dim = (int(x) for x in first.shape)
        self.dtype, self.device = first.dtype, first.device
        self.row_bytes = self.heads * self.head_dim * first.element_size()

    def k_buffer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K (MHA) or latent (MLA) buffer: SGLang's own tensor."""
        return self.buffers[0][layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V buffer (MHA only): SGLang's own tensor."""
        if self.mla:
            raise TypeError("an MLA pool has no separate V buffer")
        return self.buffers[1][layer]

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """A copy of the KV of ``slots``: ``[kinds, layers, n, heads, head_dim]`` (for checks)."""
        idx = slots.to(device=self.device, dtype=torch.int64)
        return torch.stack([torch.stack([b.index_select(0, idx) for b in kind]) for kind in self.buffers])


def _class_names(obj) -> list[str]:
    return [c.__name__ for c in type(obj).__mro__]


def check_physical_slot_ids(kv_cache, allocator=None, req_to_token_pool=None) -> None:
    """Refuse pools whose ``req_to_token`` does not hold physical slot ids (the rows our copies
    read): SGLang's unified memory pool (``--enable-unified-memory``: its KV pools, its
    ``UnifiedHybridReqToTokenPool``, its multi-ended allocators), and any allocator that translates
    virtual ids (``virtual_to_physical``, ``translate_kv_loc``).

    Raises:
        SGLangConfigError: one line naming the class found.
    """
    for role, obj, names in (("KV cache", kv_cache, VIRTUAL_ID_POOLS), ("allocator", allocator, VIRTUAL_ID_ALLOCATORS),
                             ("req_to_token pool", req_to_token_pool, VIRTUAL_ID_ROWS)):
        if obj is None:
            continue
        found = [n for n in _class_names(obj) if n in names]
        marks = [m for m in _VIRTUAL_ID_MARKS if getattr(obj, m, None) is not None] if role == "allocator" else []
        if found or marks or getattr(obj, "_unified_buffer", None) is not None:
            cls = type(obj).__name__
            why = "" if found and found[0] == cls else f" ({found[0] if found else (marks or ['_unified_buffer'])[0]})"
            raise SGLangConfigError(
                f"unsupported {role} for decode offload: {cls}{why} addresses KV by virtual "
                f"slot ids (SGLang's --enable-unified-memory pool), which our copies would read as physical "
                f"rows; run without --enable-unified-memory")


def from_sglang(kv_cache, allocator=None, req_to_token_pool=None) -> LayeredKVPool:
    """Wrap SGLang's ``token_to_kv_pool_allocator.get_kvcache()`` in place.

    Args:
        kv_cache: the KV cache.
        allocator, req_to_token_pool: SGLang's, when given: checked to hold physical slot ids
            (``check_physical_slot_ids``) with the KV cache.
    Raises:
        SGLangConfigError: a hybrid sliding-window pool (``check_pool_kind``); not an
            ``MHATokenToKVPool`` / ``MLATokenToKVPool`` (as SGLang's own manager refuses), or one whose buffers are not plain per-token rows: quantized with
            scale buffers, HND / vectorized layout, K and V of different head dims, layer-sharded;
            or one whose ``req_to_token`` holds virtual slot ids (the unified memory pool).
    """
    check_pool_kind(kv_cache)
    check_physical_slot_ids(kv_cache, allocator, req_to_token_pool)
    names = _class_names(kv_cache)
    cls = type(kv_cache).__name__
    if MLA in names:
        mla = True
    elif MHA in names:
        mla = False
    else:
        raise SGLangConfigError(
            f"unsupported KV cache type for decode offload: {cls}; supported: {MHA}, {MLA}")
    if cls in UNSUPPORTED:
        raise SGLangConfigError(f"unsupported KV cache type for decode offload: {cls} (packed or paged buffers)")
    if getattr(kv_cache, "layer_shard_enabled", False):
        raise SGLangConfigError(f"{cls}: layer-sharded KV pools are not supported")
    if getattr(kv_cache, "is_quantized_kv_cache", False) or any(
            getattr(kv_cache, s, None) is not None for s in _SCALES):
        raise SGLangConfigError(f"{cls}: quantized KV with scale buffers is not supported")
    if mla:
        return LayeredKVPool([_buffer_list(kv_cache, "kv_buffer", cls)], mla=True)
    layout = getattr(kv_cache, "kv_cache_layout", "nhd")
    if layout != "nhd" or getattr(kv_cache, "use_hnd", False):
        raise SGLangConfigError(f"{cls}: KV cache layout {layout!r} is not supported; supported: 'nhd'")
    head_dim, v_head_dim = getattr(kv_cache, "head_dim", None), getattr(kv_cache, "v_head_dim", None)
    if v_head_dim is not None and v_head_dim != head_dim:
        raise SGLangConfigError(f"{cls}: v_head_dim {v_head_dim} != head_dim {head_dim} is not supported")
    pool = LayeredKVPool(
        [_buffer_list(kv_cache, "k_buffer", cls), _buffer_list(kv_cache, "v_buffer", cls)], mla=False)
    expect = (getattr(kv_cache, "head_num", pool.heads), head_dim or pool.head_dim)
    if (pool.heads, pool.head_dim) != expect:
        raise SGLangConfigError(f"{cls}: buffers hold {pool.heads} heads x {pool.head_dim}, pool says {expect}")
    return pool


def _buffer_list(kv_cache, name: str, cls: str):
    buffers = getattr(kv_cache, name, None)
    if not isinstance(buffers, (list, tuple)):
        raise SGLangConfigError(f"{cls}.{name} is {type(buffers).__name__}, expected a per-layer list")
    return buffers
