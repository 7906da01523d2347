import pytest
import torch

from transfer import BadIndices, DoubleFree, HostPool, NotAllocated


def test_page_first_layout_and_contiguous_page():
    hp = HostPool(3, 2, 4, torch.bfloat16, 8, 32)
    assert hp.buffer.shape == (4, 2, 8, 3, 2, 4)  # [pages, K/V, page_size, layers, heads, dim]
    assert hp.page_nbytes == 2 * 8 * 3 * 2 * 4 * 2
    v = hp.page_view(2)
    assert v.is_contiguous() and v.shape == (2, 8, 3, 2, 4)
    b = hp.page_bytes(2)
    assert b.dtype == torch.uint8 and b.numel() == hp.page_nbytes
    assert b.data_ptr() == hp.buffer.data_ptr() + 2 * hp.page_nbytes
    assert hp.pinned == torch.cuda.is_available()


def test_mla_layout():
    hp = HostPool(3, 1, 16, torch.float16, 4, 8, mla=True)
    assert hp.buffer.shape == (2, 1, 4, 3, 1, 16)


def test_alloc_free_and_double_free():
    hp = HostPool(1, 1, 4, torch.float32, 4, 16)
    a = hp.alloc(5)
    assert a.tolist() == list(range(8))
    assert hp.available_size() == 8
    hp.free(a)
    with pytest.raises(DoubleFree):
        hp.free(a)
    with pytest.raises(NotAllocated):
        hp.free(torch.arange(8, 12))
    with pytest.raises(BadIndices):
        hp.free(torch.tensor([1, 2, 3, 4]))  # not page aligned
    with pytest.raises(BadIndices):
        hp.free(torch.arange(16, 20))
    assert hp.available_size() == 16
    hp.check_integrity()
    assert hp.alloc(17) is None
