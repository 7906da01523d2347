"""The stream rule on a GPU (issue 25, points 4 and 5; docs/architecture.md "Streams"): a copy is
ordered after the work queued before it on the caller's stream; a prefix load is ordered after the
slots' previous use and before the caller's later work (the load fence); slot ids that live on the
device are checked there. Every test here needs CUDA (names carry ``cuda``: ``bench/gpu_check.sh``
selects them with ``-k cuda``); on CPU the same logic is covered through the staged path
(``test_gather_staged.py``) and the stand-in (``test_device_indices.py``)."""

from __future__ import annotations

import pytest
import torch

import hashing
from transfer import HostOffloader, HostPool, KVPool, MemoryStorage, build_stack
from lifecycle_tools.testkit.kv_pattern import synthetic_kv
from tests.support.transfer_helpers import drain, polls

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PS = 16
SPIN = int(2e8)  # ~0.1 s of GPU time: work still queued when the next call is made


def test_cuda_copy_sees_kv_written_by_work_still_queued_on_the_compute_stream():
    kv = KVPool(4, 2, 64, torch.bfloat16, 1024, device="cuda")
    host = HostPool(4, 2, 64, torch.bfloat16, PS, 256)
    off = HostOffloader(kv, host, MemoryStorage("_c_0_1", host.page_nbytes))
    slots = torch.arange(64, 128, device="cuda")
    torch.cuda._sleep(SPIN)  # the "forward" is still running ...
    kv.buffer[:, :, 64:128] = 3.0  # ... when it writes the KV the copy must read
    h = off.write(slots, ack_id=1)  # queued right away, no sync
    assert drain(polls(off).ended, 1) == [1] and polls(off).failed() == []
    pages = host.page_ids(h).tolist()
    assert all(bool((host.page_view(p).float() == 3.0).all()) for p in pages)
    off.close()


def test_cuda_device_slot_ids_that_are_bad_fail_the_copy_without_a_device_fault():
    kv = KVPool(2, 2, 64, torch.bfloat16, 256, device="cuda")
    host = HostPool(2, 2, 64, torch.bfloat16, PS, 64)
    off = HostOffloader(kv, host, MemoryStorage("_c_0_1", host.page_nbytes))
    bad = torch.arange(250, 250 + PS, device="cuda")  # not aligned, past the pool's end
    assert off.write(bad, ack_id=7) is not None
    assert drain(polls(off).ended, 1) == [7] and polls(off).failed() == [7]
    good = torch.arange(PS, 2 * PS, device="cuda")
    assert off.write(good, ack_id=8) is not None  # the context is fine: no device-side assert
    assert drain(polls(off).ended, 1) == [8] and polls(off).failed() == []
    off.close()


def test_cuda_prefix_load_waits_for_the_slots_previous_use_and_fences_the_callers_stream():
    s = build_stack(2, 2, 64, torch.bfloat16, PS, 1024, 256, 4, 256, device="cuda")
    tokens = list(range(3 * PS))
    src = s.allocator.alloc(len(tokens))
    s.kv_pool.write(src, synthetic_kv(s.kv_pool, 1, torch.arange(len(tokens))))
    h = s.offloader.write(src, 1)
    drain(polls(s.offloader).ended, 1)
    s.offloader.write_storage(h, tokens, hashing.page_hashes(tokens, PS))
    drain(s.offloader.finished_storage, 1)
    s.offloader.free_host(h)
    want = s.kv_pool.read(src).clone()
    torch.cuda._sleep(SPIN)  # the previous user of every free slot is still running ...
    s.kv_pool.buffer[:, :, int(src.max()) + 1:] = -1.0  # ... and writes them last
    assert s.prefix_loader.start(2, tokens) == 3
    (done,) = drain(s.prefix_loader.finished, 1)
    got = s.kv_pool.read(done.device_indices)  # queued on the caller's stream after the fence
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    s.close()


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_cuda_layered_engine_round_trip_is_bit_exact(mla, dtype):
    from lifecycle.integrations.sglang.device_pool import LayeredKVPool
    from lifecycle.integrations.sglang.layered_copy import LayeredCudaCopyEngine

    heads = 1 if mla else 2
    gen = torch.Generator(device="cuda").manual_seed(3)
    kv = LayeredKVPool([[torch.randn(512 + PS, heads, 64, generator=gen, device="cuda").to(dtype) for _ in range(4)]
                        for _ in range(1 if mla else 2)], mla=mla)
    host = HostPool(4, heads, 64, dtype, PS, 8 * PS, mla=mla)
    eng = LayeredCudaCopyEngine(kv.device)
    slots = (torch.tensor([9, 2, 14], device="cuda").view(-1, 1) * PS + torch.arange(PS, device="cuda")).reshape(-1)
    hp = torch.tensor([5, 6, 1])
    eng.to_host("d2h", kv, host, slots, hp, check_end=512 + PS)
    assert [d.error for d in drain(eng.poll, 1)] == [None]
    want = kv.read(slots).cpu()  # [kinds, layers, n, heads, dim]
    for i, p in enumerate(hp.tolist()):
        got = host.page_view(p)
        assert torch.equal(got.view(torch.uint8), want[:, :, i * PS:(i + 1) * PS].transpose(1, 2).contiguous().view(torch.uint8))
    dst = (torch.tensor([20, 21, 3], device="cuda").view(-1, 1) * PS + torch.arange(PS, device="cuda")).reshape(-1)
    eng.to_device("h2d", kv, host, dst, hp, check_end=512 + PS)
    assert [d.error for d in drain(eng.poll, 1)] == [None]
    assert torch.equal(kv.read(dst).cpu().view(torch.uint8), want.view(torch.uint8))
    assert eng.staging_buffer.grown == 1
    eng.close()
