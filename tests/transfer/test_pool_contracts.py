"""The slot allocator, the page set and the row pool at the edges of their contracts.

Each case is a mutant that survived the suite before it: the smallest valid sizes, the first
invalid slot, zero-token allocations, errors that name what was wrong, pages handed out in
ascending order, and a fresh row pool whose rows are all free.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transfer import BadIndices, DoubleFree, NotAllocated, PagedTokenAllocator, ReqToTokenPool
from transfer.page_set import PageSet


class Kv:
    def __init__(self, row):
        self.req_pool_idx = row


class R:
    def __init__(self, row):
        self.kv = Kv(row)


@pytest.mark.parametrize("rows,max_len", [(0, 4), (4, 0)])
def test_row_pool_sizes_below_one_are_refused_by_name(rows, max_len):
    with pytest.raises(ValueError, match=rf"rows \({rows}\) and max_len \({max_len}\) must be >= 1"):
        ReqToTokenPool(rows, max_len)


def test_the_smallest_row_pool_is_one_row_of_one_slot_all_free():
    pool = ReqToTokenPool(1, 1)
    assert pool.req_to_token.shape == (1, 1) and pool.req_to_token.dtype == torch.int32
    assert pool.req_to_token.device.type == "cpu" and pool.available_size() == 1
    with pytest.raises(DoubleFree, match="row 0 is already free"):
        pool.free(R(0))                              # never allocated: free from the start


def test_a_freed_row_is_free_again_and_held_when_reallocated():
    pool = ReqToTokenPool(2, 4)
    row = pool.alloc()
    req = R(row)
    pool.free(req)
    assert req.kv.req_pool_idx is None and pool.available_size() == 2
    assert pool.alloc() == row
    pool.free(R(row))
    with pytest.raises(DoubleFree, match=f"row {row} is already free"):
        pool.free(R(row))


@pytest.mark.parametrize("row", [2, -1, None, True])
def test_a_row_outside_the_pool_is_not_allocated(row):
    pool = ReqToTokenPool(2, 4)
    pool.alloc(), pool.alloc()
    with pytest.raises(NotAllocated, match=rf"request holds no row \(req_pool_idx={row!r}\)"):
        pool.free(R(row))


@pytest.mark.parametrize("size,page", [(4, 1), (4, 4), (8, 4)])
def test_the_smallest_allocators_are_valid(size, page):
    alloc = PagedTokenAllocator(size, page)
    assert (alloc.size, alloc.page_size, alloc.total_slots) == (size, page, size + page)
    assert alloc.available_size() == size


@pytest.mark.parametrize("size,page", [(0, 4), (6, 4), (4, 0), (2, 4)])
def test_impossible_allocator_sizes_are_named(size, page):
    with pytest.raises(ValueError, match=rf"size_tokens \({size}\) must be a positive multiple of page_size \({page}\)"):
        PagedTokenAllocator(size, page)


def test_zero_tokens_allocate_nothing_and_negative_is_refused():
    alloc = PagedTokenAllocator(16, 4)
    got = alloc.alloc(0)
    assert got is not None and got.numel() == 0 and alloc.available_size() == 16
    with pytest.raises(ValueError, match="cannot allocate -1 tokens"):
        alloc.alloc(-1)


def test_slots_come_page_by_page_in_ascending_page_order():
    alloc = PagedTokenAllocator(32, 4)
    first = alloc.alloc(32)                           # every page
    alloc.free(first[[4, 20, 12]])                    # pages 2, 6, 4 come back, out of order
    again = alloc.alloc(12)
    assert again.tolist() == [8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27]


@pytest.mark.parametrize("bad", [[-1], [36], [5, 36], [-1, 5]])
def test_a_slot_outside_the_pool_is_refused_naming_the_range(bad):
    alloc = PagedTokenAllocator(32, 4)                # slots 0..35
    alloc.alloc(32)
    with pytest.raises(BadIndices, match=r"slot indices must lie in 0\.\.35$"):
        alloc.free(torch.tensor(bad, dtype=torch.int64))
    assert alloc.available_size() == 0


def test_free_reports_pages_freed_once_each():
    alloc = PagedTokenAllocator(32, 4)
    slots = alloc.alloc(8)
    assert alloc.free(slots[[0, 1, 5, 6]]) == 2 and alloc.available_size() == 32


@pytest.mark.parametrize("bad,match", [
    ([1, 2], r"indices must be a torch\.Tensor, got list"),
    (torch.tensor([1.0]), r"indices must have an integer dtype, got torch\.float32"),
    (torch.tensor([[4, 5]]), r"indices must be 1-D, got shape \(1, 2\)"),
])
def test_malformed_indices_are_refused_by_name(bad, match):
    alloc = PagedTokenAllocator(16, 4)
    alloc.alloc(16)
    with pytest.raises(BadIndices, match=match):
        alloc.free(bad)
    assert alloc.available_size() == 0


@pytest.mark.parametrize("end,first", [(0, 0), (3, 3), (3, -1)])
def test_an_empty_or_negative_page_set_is_refused(end, first):
    with pytest.raises(ValueError, match=rf"need 0 <= first < end, got first={first} end={end}"):
        PageSet(end, first)


def test_a_one_page_set_hands_out_its_page_then_none():
    ps = PageSet(1)
    assert ps.alloc(1).tolist() == [0] and ps.alloc(1) is None
    assert ps.free(np.array([0])) == 1 and ps.alloc(1).tolist() == [0]


def test_page_set_errors_name_the_pages():
    ps = PageSet(12, first=1)
    ps.alloc(11)
    ps.free(np.array([3, 4, 5]))
    with pytest.raises(DoubleFree, match=r"pages \[3, 4, 5\] are already free"):
        ps.free(np.array([5, 4, 3]))
    with pytest.raises(NotAllocated, match=r"pages \[0\] were never allocated"):
        ps.free(np.array([0, 6]))
    with pytest.raises(BadIndices, match=r"page ids 2\.\.12 outside 0\.\.11"):
        ps.free(np.array([2, 12]))
    assert ps.free(np.array([7, 7])) == 1             # a page listed twice counts once
    assert ps.free_count() == 4 and ps.held_count() == 7
    ps.check_integrity()


def test_page_set_lists_at_most_eight_pages_in_an_error():
    ps = PageSet(20)
    ps.alloc(20)
    ps.free(np.arange(10))
    with pytest.raises(DoubleFree, match=r"pages \[0, 1, 2, 3, 4, 5, 6, 7\] are already free$"):
        ps.free(np.arange(10))


def test_a_negative_page_count_is_refused_by_name():
    with pytest.raises(ValueError, match="^cannot allocate -1 pages$"):
        PageSet(4).alloc(-1)
