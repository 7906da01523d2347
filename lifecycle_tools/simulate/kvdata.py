"""The simulator's model stand-in: synthetic KV written to and expected from the pools.

The KV of position ``p`` is ``transfer.synthetic_kv(pool, kv_id[p], p)`` where ``kv_id[p]`` is the
rolling digest of the tokens up to ``p`` (``workload.kv_ids``): a pure function of the prefix, so
pages shared by two requests hold the same bytes and any page's expected content can be recomputed.
"""

from __future__ import annotations

import torch

from transfer import synthetic_kv

WRITE_BATCH = 1024   # tokens per write while prefilling (bounds the temporary tensors)


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

    def values(self, kvids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """KV of the positions (``kvids`` their digests), shaped for ``KVPool.write``."""
        return synthetic_kv(self.kv, kvids.view(1, 1, -1, 1), positions)

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
        n = n_pages * self.ps
        vals = self.values(kvids[first_pos:first_pos + n], torch.arange(first_pos, first_pos + n))
        return page_first(vals, n_pages, self.ps)

    def mismatched_pages(self, slots: torch.Tensor, kvids: torch.Tensor, n_pages: int) -> int:
        """How many of the first ``n_pages`` pages held in ``slots`` differ from their expected KV."""
        n = n_pages * self.ps
        got = self.kv.read(slots).view(torch.uint8)
        want = self.values(kvids[:n], torch.arange(n)).view(torch.uint8)
        k, layers = got.shape[0], got.shape[1]
        same = (got == want).view(k, layers, n_pages, -1).all(-1).all(0).all(0)
        return int((~same).sum())
