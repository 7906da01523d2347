"""``lifecycle_tools.testkit.kv_pattern.synthetic_kv``: a pure function of (request, position) whose bytes are a fixed hash.

The simulator recomputes these bytes independently (``lifecycle_tools.simulate.kvdata``), and
pages written by one process are verified by another, so the byte pattern itself is the contract:
byte ``o`` of token ``p`` of request ``r`` in (kind ``k``, layer ``l``) is bits 13..20 of
``((r*1_000_003 + p*7_919 + k*104_729 + l*1_299_709 + o*31) mod 2**32) * 2_654_435_761 mod 2**32``.
"""

import pytest
import torch

from transfer import KVPool
from lifecycle_tools.testkit.kv_pattern import synthetic_kv

M32 = 0xFFFFFFFF


def reference_byte(request, pos, kind, layer, off):
    x = (request * 1_000_003 + pos * 7_919 + kind * 104_729 + layer * 1_299_709 + off * 31) & M32
    return ((x * 2_654_435_761) & M32) >> 13 & 0xFF


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("mla,heads", [(False, 2), (True, 1)])
def test_every_byte_is_the_documented_hash(dtype, mla, heads):
    pool = KVPool(3, heads, 4, dtype, 16, mla=mla)
    request, positions = 123_457, torch.tensor([0, 1, 7, 300_001, (1 << 31) - 5])
    out = synthetic_kv(pool, request, positions)
    assert out.shape == (pool.kinds, 3, 5, heads, 4) and out.dtype == dtype
    raw = out.contiguous().view(torch.uint8).reshape(pool.kinds, 3, 5, -1)
    nbytes = raw.shape[-1]
    assert nbytes == heads * 4 * torch.empty((), dtype=dtype).element_size()
    want = torch.tensor([[[[reference_byte(request, p, k, l, o) for o in range(nbytes)]
                           for p in positions.tolist()] for l in range(3)] for k in range(pool.kinds)],
                        dtype=torch.uint8)
    assert torch.equal(raw, want)


def test_positions_of_any_integer_dtype_give_the_same_bytes():
    pool = KVPool(2, 2, 8, torch.bfloat16, 16)
    for pos, dtypes in ((torch.tensor([5, 1 << 20, (1 << 31) - 1]), (torch.int32,)),
                        (torch.tensor([5, 200, 255]), (torch.uint8, torch.int16, torch.int32))):
        want = synthetic_kv(pool, 9, pos).view(torch.uint8)
        for dtype in dtypes:   # (p * 7_919 overflows 16 bits: the pattern is computed in 64)
            assert torch.equal(synthetic_kv(pool, 9, pos.to(dtype)).view(torch.uint8), want)


def test_requests_and_positions_give_different_bytes_and_the_same_inputs_the_same_bytes():
    pool = KVPool(2, 2, 8, torch.float16, 16)
    a = synthetic_kv(pool, 1, torch.arange(4)).view(torch.uint8)
    assert torch.equal(a, synthetic_kv(pool, 1, torch.arange(4)).view(torch.uint8))
    assert not torch.equal(a, synthetic_kv(pool, 2, torch.arange(4)).view(torch.uint8))
    assert not torch.equal(a[:, :, 0], a[:, :, 1])
