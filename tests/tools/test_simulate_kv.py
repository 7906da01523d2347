"""The simulator's synthetic KV is exactly ``lifecycle_tools.testkit.kv_pattern.synthetic_kv``'s bytes (every dtype and shape
the CLI offers), computed faster; pages come out in the host pool's page-first layout."""

import pytest
import torch

from lifecycle_tools.simulate.kvdata import SyntheticKV, page_first
from transfer import KVPool, ReqToTokenPool
from lifecycle_tools.testkit.kv_pattern import synthetic_kv


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", [(1, 1, 8), (4, 4, 64), (3, 2, 24)])
def test_values_are_the_reference_pattern(dtype, shape):
    layers, heads, dim = shape
    pool = KVPool(layers, heads, dim, dtype, 64)
    kv = SyntheticKV(pool, ReqToTokenPool(1, 64), 16)
    g = torch.Generator().manual_seed(layers * 100 + dim)
    kvids = torch.randint(0, 2_147_483_647, (300,), generator=g)   # the digests' whole range
    pos = torch.randint(0, 1 << 22, (300,), generator=g)
    want = synthetic_kv(pool, kvids.view(1, 1, -1, 1), pos)
    got = kv.values(kvids, pos)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_page_bytes_are_page_first_and_batched():
    pool = KVPool(2, 2, 8, torch.float16, 4096)
    kv = SyntheticKV(pool, ReqToTokenPool(1, 4096), 4)
    kvids = torch.arange(3000, dtype=torch.int64) * 7 + 1
    pages = kv.page_bytes(kvids, 8, 100)             # spans several WRITE_BATCH batches
    vals = synthetic_kv(pool, kvids[8:408].view(1, 1, -1, 1), torch.arange(8, 408))
    assert torch.equal(pages, page_first(vals, 100, 4))
    # page 1 of the batch = tokens 12..15, kind-major then token then layer
    first = vals[:, :, 4:8].permute(0, 2, 1, 3, 4).contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(pages[1], first)
