"""Copies between SGLang's per-layer device buffers (read in place) and the page-first host pool,
for consecutive and scattered device pages, both ways, bit-exact."""

from __future__ import annotations

import pytest
import torch

from lifecycle.integrations.sglang.device_pool import LayeredKVPool
from lifecycle.integrations.sglang.layered_copy import LayeredChunkCopy, LayeredCpuCopyEngine
from transfer.host_pool import HostPool

PS, LAYERS, HEADS, DIM = 4, 3, 2, 8


def _pool(mla: bool, dtype=torch.bfloat16) -> LayeredKVPool:
    heads = 1 if mla else HEADS
    gen = torch.Generator().manual_seed(1)
    return LayeredKVPool([[torch.randn(64, heads, DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
                          for _ in range(1 if mla else 2)], mla=mla)


def _slots(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages).view(-1, 1) * PS + torch.arange(PS)).reshape(-1)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("dev_pages,host_pages,gather", [
    ([2, 3, 4], [0, 1, 2], False),   # consecutive on both sides: one strided copy per buffer
    ([9, 2, 14], [3, 4, 5], True),   # scattered device pages: row gathers
    ([5, 6, 1], [7, 0, 1], True),    # two host runs
])
def test_round_trip_is_bit_exact(mla, dev_pages, host_pages, gather):
    kv = _pool(mla)
    host = HostPool(LAYERS, kv.heads, DIM, kv.dtype, PS, 8 * PS, mla=mla, pin=False)
    slots, hp = _slots(dev_pages), torch.tensor(host_pages)
    plan = LayeredChunkCopy(kv, host, slots, hp)
    assert plan.gather is gather
    plan.to_host()
    want = kv.read(slots)  # [kinds, layers, n, heads, dim]
    for i, page in enumerate(host_pages):
        got = host.page_view(page)  # [kinds, ps, layers, heads, dim]
        assert torch.equal(got.view(torch.int16), want[:, :, i * PS:(i + 1) * PS].transpose(1, 2).view(torch.int16))
    back = _pool(mla)
    for kind in back.buffers:
        for buf in kind:
            buf.zero_()
    LayeredChunkCopy(back, host, slots, hp).to_device()
    assert torch.equal(back.read(slots).view(torch.int16), want.view(torch.int16))


def test_the_engine_reports_the_copy_once():
    kv = _pool(False)
    host = HostPool(LAYERS, HEADS, DIM, kv.dtype, PS, 4 * PS, pin=False)
    engine = LayeredCpuCopyEngine(1)
    engine.to_host("t", kv, host, _slots([3, 1]), torch.tensor([0, 1]))
    engine.close()
    assert [d.tag for d in engine.poll()] == ["t"]


def test_pools_of_another_shape_are_refused():
    kv = _pool(False)
    with pytest.raises(ValueError, match="disagree"):
        LayeredChunkCopy(kv, HostPool(LAYERS, HEADS, DIM, torch.float16, PS, 4 * PS, pin=False),
                         _slots([1]), torch.tensor([0]))


def test_the_cpu_engine_refuses_device_buffers_and_none_is_made_for_them():
    """'meta' stands in for CUDA: buffers that are not in host memory (issue 25, point 6)."""
    from lifecycle.integrations.sglang.layered_copy import make_layered_copy_engine

    kv = LayeredKVPool([[torch.empty(64, HEADS, DIM, dtype=torch.bfloat16, device="meta") for _ in range(LAYERS)]
                        for _ in range(2)], mla=False)
    host = HostPool(LAYERS, HEADS, DIM, kv.dtype, PS, 4 * PS, pin=False)
    engine = LayeredCpuCopyEngine(1)
    with pytest.raises(ValueError, match="meta"):  # DeviceMismatch
        engine.to_host("t", kv, host, _slots([1]), torch.tensor([0]))
    assert engine.pending == 0
    engine.close()
    with pytest.raises(ValueError, match="meta"):
        make_layered_copy_engine(kv)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("dev_pages,host_pages", [([9, 2, 14], [3, 4, 5]), ([5, 6, 1], [7, 0, 1])])
def test_the_staged_path_round_trip_is_bit_exact_through_one_reused_buffer(mla, dev_pages, host_pages):
    """What the CUDA engine runs (one gather per buffer of whole pages straight into its slab of
    the engine's staging buffer, one copy per host run; ids checked on the device), on CPU."""
    from transfer.gather import Staging

    kv = _pool(mla)
    host = HostPool(LAYERS, kv.heads, DIM, kv.dtype, PS, 8 * PS, mla=mla, pin=False)
    slots, hp = _slots(dev_pages), torch.tensor(host_pages)
    staging = Staging("cpu")
    plan = LayeredChunkCopy(kv, host, slots, hp, check_end=64, staging=staging)
    plan.to_host()
    assert plan.landed_error() is None
    want = kv.read(slots)
    for i, page in enumerate(host_pages):
        got = host.page_view(page)
        assert torch.equal(got.view(torch.int16), want[:, :, i * PS:(i + 1) * PS].transpose(1, 2).view(torch.int16))
    back = _pool(mla)
    for kind in back.buffers:
        for buf in kind:
            buf.zero_()
    LayeredChunkCopy(back, host, slots, hp, check_end=64, staging=staging).to_device()
    assert torch.equal(back.read(slots).view(torch.int16), want.view(torch.int16))
    assert staging.grown == 1


def test_the_staged_path_reports_bad_ids_after_the_copy():
    from transfer.errors import BadIndices
    from transfer.gather import Staging

    kv = _pool(False)
    host = HostPool(LAYERS, HEADS, DIM, kv.dtype, PS, 4 * PS, pin=False)
    plan = LayeredChunkCopy(kv, host, torch.tensor([5, 6, 7, 8]), torch.tensor([0]), check_end=64,
                            staging=Staging("cpu"))
    plan.to_host()
    assert isinstance(plan.landed_error(), BadIndices)


def test_the_engine_copies_back_to_the_device_bit_exact_and_checks_the_ids_on_its_worker():
    kv = _pool(False)
    host = HostPool(LAYERS, HEADS, DIM, kv.dtype, PS, 4 * PS, pin=False)
    slots, hp = _slots([3, 1]), torch.tensor([2, 0])
    engine = LayeredCpuCopyEngine(1)
    engine.to_host("out", kv, host, slots, hp, check_end=64)
    engine.close()
    assert [(d.tag, d.error) for d in engine.poll()] == [("out", None)]
    want = kv.read(slots)
    back = _pool(False)
    for kind in back.buffers:
        for buf in kind:
            buf.zero_()
    engine = LayeredCpuCopyEngine(1)
    engine.to_device("in", back, host, slots, hp, check_end=64)
    engine.to_device("bad", back, host, _slots([16]), torch.tensor([1]), check_end=64)  # slot 64: past the end
    engine.close()
    done = {d.tag: d.error for d in engine.poll()}
    assert done["in"] is None and isinstance(done["bad"], ValueError)
    assert torch.equal(back.read(slots).view(torch.int16), want.view(torch.int16))
    assert not back.read(_slots([2])).any()  # nothing else written


def test_the_cpu_engine_refuses_a_device_pool_for_copies_back_too():
    kv = LayeredKVPool([[torch.empty(64, HEADS, DIM, dtype=torch.bfloat16, device="meta") for _ in range(LAYERS)]
                        for _ in range(2)], mla=False)
    engine = LayeredCpuCopyEngine(1)
    with pytest.raises(ValueError, match="copies host-memory pools only; this pool is on meta"):
        engine.to_device("t", kv, HostPool(LAYERS, HEADS, DIM, kv.dtype, PS, 4 * PS, pin=False),
                         _slots([1]), torch.tensor([0]))
    assert engine.pending == 0
    engine.close()
