import pytest
import torch

from transfer import BadIndices, DoubleFree, NotAllocated, PagedTokenAllocator


def test_alloc_whole_pages_skipping_padding_page():
    a = PagedTokenAllocator(64, 16)
    got = a.alloc(20)
    assert got.dtype == torch.int64
    assert got.tolist() == list(range(16, 48))  # page 0 is padding; 20 tokens -> 2 pages
    assert a.available_size() == 32
    a.check_integrity()


def test_alloc_returns_none_when_short_and_changes_nothing():
    a = PagedTokenAllocator(32, 16)
    assert a.alloc(33) is None
    assert a.available_size() == 32
    assert a.alloc(32).numel() == 32
    assert a.alloc(1) is None


def test_free_any_slot_frees_its_page_once():
    a = PagedTokenAllocator(64, 16)
    got = a.alloc(48)
    assert a.free(torch.tensor([16, 17, 31, 40])) == 2  # pages 1 and 2, page 1 listed thrice
    assert a.available_size() == 16 + 32
    a.check_integrity()
    assert a.free(got[32:]) == 1
    assert a.available_size() == 64
    a.check_integrity()


def test_double_free_raises_and_changes_nothing():
    a = PagedTokenAllocator(64, 16)
    got = a.alloc(32)
    a.free(got[:16])
    with pytest.raises(DoubleFree):
        a.free(got)  # page 2 held, page 1 already free: nothing may change
    assert a.available_size() == 48
    a.check_integrity()
    a.free(got[16:])
    assert a.available_size() == 64


def test_never_allocated_and_padding_raise():
    a = PagedTokenAllocator(64, 16)
    a.alloc(16)
    with pytest.raises(NotAllocated):
        a.free(torch.tensor([40]))
    with pytest.raises(NotAllocated):
        a.free(torch.tensor([0]))  # the padding page is never handed out
    with pytest.raises(BadIndices):
        a.free(torch.tensor([80]))
    with pytest.raises(BadIndices):
        a.free(torch.tensor([[16]]))
    assert a.available_size() == 48


def test_freed_pages_are_reused_and_integrity_holds_under_churn():
    a = PagedTokenAllocator(1024, 4)
    g = torch.Generator().manual_seed(0)
    held = []
    for step in range(300):
        if held and torch.rand(1, generator=g).item() < 0.5:
            a.free(held.pop(int(torch.randint(len(held), (1,), generator=g))))
        else:
            got = a.alloc(int(torch.randint(1, 40, (1,), generator=g)))
            if got is not None:
                held.append(got)
    a.check_integrity()
    all_held = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
    assert all_held.unique().numel() == all_held.numel()
    assert a.available_size() == 1024 - all_held.numel()


def test_bad_sizes():
    with pytest.raises(ValueError):
        PagedTokenAllocator(30, 16)
    with pytest.raises(ValueError):
        PagedTokenAllocator(16, 16).alloc(-1)
