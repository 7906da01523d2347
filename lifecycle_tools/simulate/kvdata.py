"""The simulator's model stand-in: synthetic KV written to and expected from the pools.

The KV of position ``p`` is ``lifecycle_tools.testkit.kv_pattern.synthetic_kv(pool, kv_id[p], p)`` where ``kv_id[p]`` is the
rolling digest of the tokens up to ``p`` (``workload.kv_ids``): a pure function of the prefix, so
pages shared by two requests hold the same bytes and any page's expected content can be recomputed.

``SyntheticKV.values`` computes exactly those bytes (a test holds it to ``lifecycle_tools.testkit.kv_pattern.synthetic_kv``),
faster: the per-(kind, layer, byte) part of the hash is computed once per pool, and the rest in
32-bit integers, since only bits 13..20 of the 32-bit hash reach the output byte (see ``values``).
Work is done in batches of ``WRITE_BATCH`` tokens so the temporaries stay a few MiB.
"""

from __future__ import annotations

import threading

import torch

WRITE_BATCH = 256    # tokens per computed batch (bounds the temporary tensors)
_MASK = 0xFFFFFFFF
_MUL = 2_654_435_761               # the pattern's multiplier
_LOW = (1 << 21) - 1                # the bits of a product that reach output bits 13..20


def page_first(values: torch.Tensor, n_pages: int, page_size: int) -> torch.Tensor:
    """``[kinds, layers, n_pages * page_size, heads, dim]`` KV -> ``[n_pages, page_nbytes]`` bytes in
    the host pool's page-first layout (``page, kind, token, layer, head, dim``)."""
    k, layers, _, heads, dim = values.shape
    pages = values.view(k, layers, n_pages, page_size, heads, dim).permute(2, 0, 3, 1, 4, 5).contiguous()
    return pages.view(n_pages, -1).view(torch.uint8)


class SyntheticKV:
    """Writes and recomputes the synthetic KV of one pool.

    Args:
        kv_pool: the device ``KVPool``.
        rows: the ``ReqToTokenPool`` (slot ids of each request's positions).
        page_size: tokens per page.
    """

    def __init__(self, kv_pool, rows, page_size: int) -> None:
        self.kv, self.rows, self.ps = kv_pool, rows, page_size
        nbytes = kv_pool.heads * kv_pool.head_dim * torch.empty((), dtype=kv_pool.dtype).element_size()
        kind = torch.arange(kv_pool.kinds, dtype=torch.int64).view(-1, 1, 1, 1)
        layer = torch.arange(kv_pool.layers, dtype=torch.int64).view(1, -1, 1, 1)
        off = torch.arange(nbytes, dtype=torch.int64).view(1, 1, 1, -1)
        base = (kind * 104_729 + layer * 1_299_709 + off * 31) & _MASK
        self._base = ((base * _MUL) & _LOW).to(torch.int32)      # [kinds, layers, 1, nbytes]
        self._row = kv_pool.kinds * kv_pool.layers * nbytes       # elements per token
        self._local = threading.local()                          # a scratch buffer per thread

    def _scratch(self, n: int) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < n * self._row:
            buf = self._local.buf = torch.empty(max(n, WRITE_BATCH) * self._row, dtype=torch.int32)
        return buf[: n * self._row]

    def values(self, kvids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """KV of the positions (``kvids`` their digests), shaped for ``KVPool.write``: the bytes
        ``lifecycle_tools.testkit.kv_pattern.synthetic_kv(pool, kvids, positions)`` gives.

        That pattern's byte is bits 13..20 of ``(t + b) * M mod 2**32`` (``t`` from the token, ``b``
        from kind, layer and byte offset), which equals bits 13..20 of ``(t*M mod 2**21) + (b*M mod
        2**21)``: one add and one shift per byte, in 32-bit integers.
        """
        pool, n = self.kv, positions.numel()
        t = (kvids.to(torch.int64) * 1_000_003 + positions.to(torch.int64) * 7_919) & _MASK
        tok = ((t * _MUL) & _LOW).to(torch.int32).view(1, 1, n, 1)
        x = torch.add(tok, self._base, out=self._scratch(n).view(pool.kinds, pool.layers, n, -1))
        raw = x.bitwise_right_shift_(13).to(torch.uint8)       # the conversion keeps the low 8 bits
        return raw.view(pool.dtype).view(pool.kinds, pool.layers, n, pool.heads, pool.head_dim)

    def write_rows(self, row: int, kvids: torch.Tensor, lo: int, hi: int) -> None:
        """Compute and write the KV of positions ``[lo, hi)`` of ``row``."""
        for a in range(lo, hi, WRITE_BATCH):
            b = min(hi, a + WRITE_BATCH)
            slots = self.rows.req_to_token[row, a:b].to(torch.int64)
            self.kv.write(slots, self.values(kvids[a:b], torch.arange(a, b)))

    def write_slots(self, slots: torch.Tensor, kvids: torch.Tensor, positions: torch.Tensor) -> None:
        """Write the KV of ``positions`` into ``slots`` (one decode step of a batch)."""
        self.kv.write(slots, self.values(kvids, positions))

    def page_bytes(self, kvids: torch.Tensor, first_pos: int, n_pages: int) -> torch.Tensor:
        """Expected bytes ``[n_pages, page_nbytes]`` of the pages starting at ``first_pos``
        (``kvids`` indexed by position)."""
        step = max(1, WRITE_BATCH // self.ps)
        parts = []
        for p in range(0, n_pages, step):
            m, a = min(step, n_pages - p), first_pos + p * self.ps
            vals = self.values(kvids[a:a + m * self.ps], torch.arange(a, a + m * self.ps))
            parts.append(page_first(vals, m, self.ps))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def mismatched_pages(self, slots: torch.Tensor, kvids: torch.Tensor, n_pages: int) -> int:
        """How many of the first ``n_pages`` pages held in ``slots`` (their positions ``0 ..``)
        differ from their expected KV."""
        step, bad = max(1, WRITE_BATCH // self.ps), 0
        for p in range(0, n_pages, step):
            m, a = min(step, n_pages - p), p * self.ps
            got = self.kv.read(slots[a:a + m * self.ps]).view(torch.uint8)
            want = self.values(kvids[a:a + m * self.ps], torch.arange(a, a + m * self.ps)).view(torch.uint8)
            k, layers = got.shape[0], got.shape[1]
            bad += int((~(got == want).view(k, layers, m, -1).all(-1).all(0).all(0)).sum())
        return bad
