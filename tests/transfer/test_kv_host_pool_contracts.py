"""Device KV pool and host pool at the edges of their contracts (each case a surviving mutant).

Smallest valid shapes, every dimension checked, the first slot/page outside the pool, zero-token
host allocations, K and V kept apart, sizes in bytes, and pinning on a machine that cannot pin
(a logged fallback to pageable memory, never a failure).
"""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from transfer import BadIndices, HostPool, KVPool


@pytest.mark.parametrize("dims", [(0, 1, 1, 1), (1, 0, 1, 1), (1, 1, 0, 1), (1, 1, 1, 0)])
def test_every_kv_pool_dimension_must_be_at_least_one(dims):
    layers, heads, head_dim, slots = dims
    with pytest.raises(ValueError, match=r"^layers, heads, head_dim and slots must be >= 1$"):
        KVPool(layers, heads, head_dim, torch.float16, slots)


def test_an_mla_pool_has_one_head_and_no_v_buffer():
    with pytest.raises(ValueError, match=r"^an MLA pool has one latent head, got heads=2$"):
        KVPool(1, 2, 4, torch.float16, 8, mla=True)
    with pytest.raises(ValueError, match=r"^an MLA pool has one latent head, got heads=2$"):
        HostPool(1, 2, 4, torch.float16, 4, 8, mla=True)
    pool = KVPool(2, 1, 4, torch.float16, 8, mla=True)
    with pytest.raises(TypeError, match=r"^an MLA pool has no separate V buffer$"):
        pool.v_buffer(0)


def test_kv_pool_shape_bytes_and_k_v_apart():
    pool = KVPool(2, 3, 4, torch.float16, 8)
    assert pool.device.type == "cpu" and pool.row_bytes == 3 * 4 * 2
    slots = torch.tensor([0, 7])
    values = torch.arange(2 * 2 * 2 * 3 * 4, dtype=torch.float16).reshape(2, 2, 2, 3, 4)
    pool.write(slots, values)
    assert torch.equal(pool.read(slots), values)
    assert torch.equal(pool.k_buffer(1)[7], values[0, 1, 1]) and torch.equal(pool.v_buffer(1)[7], values[1, 1, 1])


@pytest.mark.parametrize("bad", [[-1], [8], [0, 8]])
def test_a_kv_slot_outside_the_pool_is_refused_naming_the_range(bad):
    pool = KVPool(1, 1, 2, torch.float16, 8)
    with pytest.raises(BadIndices, match=r"^slots must lie in 0\.\.7$"):
        pool.read(torch.tensor(bad))
    assert pool.read(torch.tensor([0])).shape == (2, 1, 1, 1, 2)


def test_kv_errors_name_the_slots_argument():
    pool = KVPool(1, 1, 2, torch.float16, 8)
    with pytest.raises(BadIndices, match=r"^slots must be a torch\.Tensor, got list$"):
        pool.read([0])


@pytest.mark.parametrize("page,tokens", [(1, 1), (4, 4)])
def test_the_smallest_host_pools_are_valid(page, tokens):
    pool = HostPool(1, 1, 2, torch.float16, page, tokens, pin=False)
    assert pool.num_pages == tokens // page and not pool.pinned
    assert pool.page_nbytes == 2 * page * 1 * 1 * 2 * 2 and pool.row_bytes == 1 * 2 * 2


@pytest.mark.parametrize("page,tokens", [(0, 4), (4, 2), (4, 6)])
def test_impossible_host_pool_sizes_are_named(page, tokens):
    with pytest.raises(ValueError, match=rf"^tokens \({tokens}\) must be a positive multiple of page_size \({page}\)$"):
        HostPool(1, 1, 2, torch.float16, page, tokens, pin=False)


def test_host_alloc_of_zero_tokens_is_empty_and_negative_is_refused():
    pool = HostPool(1, 1, 2, torch.float16, 4, 16, pin=False)
    got = pool.alloc(0)
    assert got is not None and got.numel() == 0 and pool.available_size() == 16
    with pytest.raises(ValueError, match="^cannot allocate -1 tokens$"):
        pool.alloc(-1)


def test_host_pages_come_in_ascending_order_and_views_stop_at_the_last_page():
    pool = HostPool(1, 1, 2, torch.float16, 4, 16, pin=False)
    every = pool.alloc(16)
    pool.free(torch.cat([every[12:16], every[0:4]]))
    assert pool.alloc(8).tolist() == list(range(0, 4)) + list(range(12, 16))
    assert pool.page_view(0).shape == pool.page_view(3).shape
    for page in (-1, 4):
        with pytest.raises(BadIndices, match=rf"^host page {page} outside 0\.\.3$"):
            pool.page_view(page)


def test_host_index_errors_name_host_indices_and_the_pool_end():
    pool = HostPool(1, 1, 2, torch.float16, 4, 16, pin=False)
    with pytest.raises(BadIndices, match="host indices"):
        pool.page_ids(torch.tensor([1, 2, 3, 4]))     # not page-aligned
    with pytest.raises(BadIndices):
        pool.page_ids(torch.arange(16, 20))           # one page past the pool


class FakeCudart:
    """``torch.cuda.cudart()``'s two registration calls, recorded; ``rc`` is what register returns."""

    def __init__(self, rc: int = 0):
        self.rc, self.registered, self.unregistered = rc, [], []

    def cudaHostRegister(self, ptr, size, flags):
        self.registered.append((ptr, size, flags))
        return self.rc

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0

    def cudaGetErrorString(self, rc):
        return "out of memory"


@pytest.fixture
def cudart(monkeypatch):
    import transfer.host_pool as host_pool

    fake = FakeCudart()
    monkeypatch.setattr(host_pool, "_cudart", lambda: fake)
    return fake


def test_the_host_pool_is_pinned_at_its_exact_size_and_unpinned_on_close(cudart):
    pool = HostPool(3, 2, 24, torch.float16, 4, 12, pin=True)  # 3 pages of 1152 bytes: not a power of two
    nbytes = pool.buffer.numel() * pool.buffer.element_size()
    assert nbytes == 3 * 2 * 4 * 3 * 2 * 24 * 2
    assert pool.pinned and cudart.registered == [(pool.buffer.data_ptr(), nbytes, 0)]
    pool.close()
    pool.close()
    assert cudart.unregistered == [pool.buffer.data_ptr()] and not pool.pinned


def test_a_pinned_pool_dropped_without_close_is_unpinned(cudart):
    import gc

    pool = HostPool(1, 1, 2, torch.float16, 4, 8, pin=True)
    ptr = pool.buffer.data_ptr()
    del pool
    gc.collect()
    assert cudart.unregistered == [ptr]


def test_pinning_that_fails_is_one_typed_line_unless_pageable_is_allowed(cudart):
    from transfer import PinningFailed

    cudart.rc = 2
    with pytest.raises(PinningFailed) as err:
        HostPool(1, 1, 2, torch.float16, 4, 8, pin=True)
    msg = str(err.value)
    assert "\n" not in msg and "cannot pin the 64-byte host pool" in msg and "rc=2" in msg and "allow_pageable" in msg
    assert cudart.unregistered == []
    with capture_logs() as logs:
        pool = HostPool(1, 1, 2, torch.float16, 4, 8, pin=True, allow_pageable=True)
    assert not pool.pinned and pool.buffer.shape == (2, 2, 4, 1, 1, 2) and pool.buffer.dtype == torch.float16
    (warn,) = [e for e in logs if e["event"] == "host_pool.pin_failed"]
    assert warn["fallback"] == "pageable" and "rc=2" in warn["error"] and warn["log_level"] == "warning"
    pool.close()
    assert cudart.unregistered == []  # never registered: nothing to unregister


def test_without_cuda_asking_for_pinned_memory_is_refused_and_the_default_is_pageable():
    from transfer import PinningFailed

    if torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    with pytest.raises(PinningFailed, match="CUDA is not available"):
        HostPool(1, 1, 2, torch.float16, 4, 8, pin=True)
    assert not HostPool(1, 1, 2, torch.float16, 4, 8).pinned


def test_a_stack_closed_cleanly_unpins_its_host_pool(cudart):
    from transfer import build_stack

    stack = build_stack(1, 1, 4, torch.float16, 4, 64, 32, 2, 32)
    stack.host_pool.close()  # pinned only where CUDA is available
    cudart.unregistered.clear()
    stack.host_pool = pinned = HostPool(1, 1, 4, torch.float16, 4, 32, pin=True)  # as on a GPU machine
    assert stack.close().clean
    assert cudart.unregistered == [pinned.buffer.data_ptr()] and not pinned.pinned


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_pool_is_registered_and_unregistered():
    pool = HostPool(2, 2, 64, torch.bfloat16, 16, 64, pin=True)
    assert pool.pinned and pool.buffer.is_pinned()
    pool.close()
    assert not pool.buffer.is_pinned()


def test_kv_values_of_the_wrong_shape_or_dtype_are_named():
    pool = KVPool(1, 1, 2, torch.float16, 8)
    with pytest.raises(ValueError, match=r"^values must be \(2, 1, 1, 1, 2\) torch\.float16, got \(2, 1, 1, 1, 3\) torch\.float16$"):
        pool.write(torch.tensor([0]), torch.zeros(2, 1, 1, 1, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"got \(2, 1, 1, 1, 2\) torch\.float32$"):
        pool.write(torch.tensor([0]), torch.zeros(2, 1, 1, 1, 2))
