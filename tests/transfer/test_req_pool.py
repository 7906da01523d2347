from types import SimpleNamespace

import pytest
import torch

from transfer import DoubleFree, NotAllocated, ReqToTokenPool


def req(idx):
    return SimpleNamespace(kv=SimpleNamespace(req_pool_idx=idx))


def test_alloc_until_empty_then_none():
    pool = ReqToTokenPool(2, 8)
    assert pool.req_to_token.shape == (2, 8) and pool.req_to_token.dtype == torch.int32
    rows = {pool.alloc(), pool.alloc()}
    assert rows == {0, 1}
    assert pool.alloc() is None and pool.available_size() == 0


def test_free_sets_index_none_and_double_free_raises():
    pool = ReqToTokenPool(2, 8)
    r = req(pool.alloc())
    stale = req(r.kv.req_pool_idx)
    pool.free(r)
    assert r.kv.req_pool_idx is None and pool.available_size() == 2
    with pytest.raises(NotAllocated):
        pool.free(r)
    with pytest.raises(DoubleFree):
        pool.free(stale)
    assert stale.kv.req_pool_idx is not None and pool.available_size() == 2


@pytest.mark.parametrize("idx", [None, -1, 5])
def test_free_of_no_row_raises(idx):
    pool = ReqToTokenPool(2, 8)
    with pytest.raises(NotAllocated):
        pool.free(req(idx))
    assert pool.available_size() == 2


@pytest.mark.parametrize("idx", [None, -1, 5, True, "x", object()])
def test_check_free_and_free_of_no_row_raise_not_allocated_and_change_nothing(idx):
    pool = ReqToTokenPool(2, 8)
    pool.alloc()
    r = req(idx)
    for call in (pool.check_free, pool.free):
        with pytest.raises(NotAllocated):
            call(r)
        assert pool.available_size() == 1 and r.kv.req_pool_idx is idx


def test_check_free_of_a_row_already_free_raises_double_free_and_changes_nothing():
    pool = ReqToTokenPool(2, 8)
    r = req(pool.alloc())
    stale = req(r.kv.req_pool_idx)
    pool.check_free(r)                                 # held: nothing to say, nothing changed
    assert r.kv.req_pool_idx == 0 and pool.available_size() == 1
    pool.free(r)
    with pytest.raises(DoubleFree):
        pool.check_free(stale)
    assert stale.kv.req_pool_idx == 0 and pool.available_size() == 2
    assert pool.alloc() == 0                           # taken again: the stale handle may free it
    pool.check_free(stale)
    pool.free(stale)
    assert pool.available_size() == 2


def test_table_lives_on_the_device_asked_for():
    pool = ReqToTokenPool(2, 8, device="meta")  # any non-CPU device; "meta" holds no memory
    assert pool.req_to_token.device.type == "meta" and pool.req_to_token.shape == (2, 8)
