import pytest
import torch

from transfer import BadIndices
from transfer.indices import pages_of_aligned


@pytest.mark.parametrize("n_pages", [1, 3, 300])  # the Python path for chunks, tensors for big ones
def test_whole_aligned_pages_map_to_their_ids(n_pages):
    pages = torch.arange(n_pages) * 3 + 1
    slots = (pages.view(-1, 1) * 4 + torch.arange(4)).reshape(-1)
    assert torch.equal(pages_of_aligned(slots, 4), pages)


@pytest.mark.parametrize("n_pages", [1, 300])
@pytest.mark.parametrize(
    "mangle",
    [
        lambda s: s + 1,                                   # not page-aligned
        lambda s: torch.cat([s[:2], s[3:4], s[2:3], s[4:]]),  # a page's slots out of order
        lambda s: s[:-1],                                  # not a whole number of pages
        lambda s: s.float(),                               # not integer
    ],
    ids=["misaligned", "shuffled", "partial", "float"],
)
def test_anything_else_is_bad_indices(n_pages, mangle):
    slots = torch.arange(n_pages * 4)
    with pytest.raises(BadIndices):
        pages_of_aligned(mangle(slots), 4)
