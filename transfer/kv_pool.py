"""Device KV pool: the KV of every token slot, for every layer, in one tensor.

Layout: ``buffer[kind, layer, slot, head, dim]`` where ``kind`` is 0 = K, 1 = V for MHA
(``kinds = 2``), and the single latent buffer for MLA (``kinds = 1``, ``heads = 1``,
``head_dim = kv_lora_rank + qk_rope_head_dim``). ``buffer[kind, layer]`` is a contiguous
``[slots, heads, head_dim]`` tensor: SGLang's per-layer ``k_buffer[layer]`` / ``v_buffer[layer]``.
"""

from __future__ import annotations

import torch

from transfer.errors import BadIndices
from transfer.indices import as_index_tensor


class KVPool:
    """KV storage for ``slots`` token slots.

    Args:
        layers, heads, head_dim: model shape (MLA: heads must be 1).
        dtype: any torch dtype (bf16, fp16, fp32, float8_e4m3fn ...).
        slots: token slots, including the allocator's reserved padding page.
        device: "cpu", "cuda" or a torch.device.
        mla: one latent buffer instead of K and V.
    Raises:
        ValueError: non-positive sizes, or ``mla`` with ``heads != 1``.
    """

    def __init__(
        self,
        layers: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        slots: int,
        device: str | torch.device = "cpu",
        mla: bool = False,
    ) -> None:
        if min(layers, heads, head_dim, slots) < 1:
            raise ValueError("layers, heads, head_dim and slots must be >= 1")
        if mla and heads != 1:
            raise ValueError(f"an MLA pool has one latent head, got heads={heads}")
        self.layers, self.heads, self.head_dim, self.slots = layers, heads, head_dim, slots
        self.dtype, self.mla = dtype, mla
        self.kinds = 1 if mla else 2
        self.buffer = torch.zeros(
            (self.kinds, layers, slots, heads, head_dim), dtype=dtype, device=device
        )
        self.device = self.buffer.device
        self.row_bytes = heads * head_dim * self.buffer.element_size()

    def k_buffer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K (MHA) or latent (MLA) ``[slots, heads, head_dim]``."""
        return self.buffer[0, layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V ``[slots, heads, head_dim]`` (MHA only)."""
        if self.mla:
            raise TypeError("an MLA pool has no separate V buffer")
        return self.buffer[1, layer]

    def _slots(self, slots: torch.Tensor) -> torch.Tensor:
        idx = as_index_tensor(slots, "slots")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.slots):
            raise BadIndices(f"slots must lie in 0..{self.slots - 1}")
        return idx.to(self.device)

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Set the KV of ``slots``.

        Args:
            slots: 1-D integer slot indices (n).
            values: ``[kinds, layers, n, heads, head_dim]`` of this pool's dtype.
        Raises:
            BadIndices: bad or out-of-range slots. ValueError: wrong shape or dtype.
        """
        idx = self._slots(slots)
        want = (self.kinds, self.layers, idx.numel(), self.heads, self.head_dim)
        if tuple(values.shape) != want or values.dtype != self.dtype:
            raise ValueError(f"values must be {want} {self.dtype}, got {tuple(values.shape)} {values.dtype}")
        raw = self.buffer.view(torch.uint8)
        raw.index_copy_(2, idx, values.to(self.device).contiguous().view(torch.uint8))

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """A copy of the KV of ``slots``: ``[kinds, layers, n, heads, head_dim]``."""
        idx = self._slots(slots)
        return self.buffer.view(torch.uint8).index_select(2, idx).view(self.dtype)
