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


# -- page_ids: the scheduler-thread validator (numpy view; one-run fast path + general path) ----
import numpy as np  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from transfer.indices import page_ids, pages_of_slots, slots_of_pages  # noqa: E402


def slots_for(pages, ps):
    return (torch.tensor(pages, dtype=torch.int64).view(-1, 1) * ps + torch.arange(ps)).reshape(-1)


@given(st.lists(st.integers(0, 40), max_size=12), st.sampled_from([1, 2, 4, 16]),
       st.sampled_from([torch.int64, torch.int32]))
def test_page_ids_of_valid_slots_are_the_pages_in_order(pages, ps, dtype):
    got = page_ids(slots_for(pages, ps).to(dtype), ps, end=41 * ps)
    assert got.dtype == np.int64 and got.tolist() == pages
    assert torch.equal(slots_of_pages(got, ps), slots_for(pages, ps))  # and back, either path


@pytest.mark.parametrize("pages", [[3, 4, 5], [7], [9, 2, 3], [4, 4]])
def test_page_ids_range_check_covers_every_slot(pages):
    s = slots_for(pages, 4)
    hi = int(s.max())
    assert page_ids(s, 4, end=hi + 1).tolist() == pages
    with pytest.raises(BadIndices, match="0..%d" % (hi - 1)):
        page_ids(s, 4, "x", end=hi)  # the last slot is one past the end


@pytest.mark.parametrize("slots", [
    [-4, -3, -2, -1],           # negative, page-aligned in Python's modulo sense
    [4, 5, 6, 7, -4, -3, -2, -1],
])
def test_negative_slots_are_out_of_range(slots):
    with pytest.raises(BadIndices):
        page_ids(torch.tensor(slots), 4, end=64)


@pytest.mark.parametrize("slots", [
    [2, 3, 4, 5],              # consecutive but misaligned (the one-run path)
    [4, 5, 6, 7, 9, 10, 11, 12],  # second page misaligned (the general path)
    [4, 5, 7, 6],              # a page's slots out of order
])
def test_page_ids_rejects_misaligned_or_shuffled(slots):
    with pytest.raises(BadIndices):
        page_ids(torch.tensor(slots), 4)


def test_page_ids_of_nothing_and_strided_views():
    assert page_ids(torch.empty(0, dtype=torch.int64), 4).tolist() == []
    strided = torch.arange(0, 64)[::2]  # 0, 2, 4 ...: a non-contiguous view, not whole pages
    with pytest.raises(BadIndices):
        page_ids(strided, 4)
    view = torch.arange(0, 32).view(4, 8)[:, :4].reshape(-1)  # pages 0, 2, 4, 6 from a 2-D view
    assert page_ids(view, 4).tolist() == [0, 2, 4, 6]


# -- slots_of_pages: the one-run shortcut only for ids that really are one ascending run --------
@pytest.mark.parametrize("pages", [[1, 0], [0, 0, 2], [0, 3, 2], [0, 2, 1, 3]],
                         ids=["descending", "repeat", "ends-span-n", "shuffled-run"])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_slots_of_pages_that_are_not_one_ascending_run(pages, as_tensor):
    p = np.array(pages, dtype=np.int64)
    want = [page * 2 + k for page in pages for k in range(2)]  # page by page, in the order given
    got = slots_of_pages(torch.from_numpy(p) if as_tensor else p, 2)
    assert got.dtype == torch.int64 and got.tolist() == want


# -- error messages name the argument (``what``), "indices" by default --------------------------
def test_errors_name_the_argument_and_the_shape_of_the_problem():
    with pytest.raises(BadIndices, match=r"^indices: 5 slots is not a whole number of pages of 2$"):
        pages_of_slots(np.arange(5, dtype=np.int64), 2)
    with pytest.raises(BadIndices, match=r"^indices are not whole"):
        page_ids(torch.tensor([1, 2]), 2)
    with pytest.raises(BadIndices, match=r"^indices are not whole"):
        pages_of_aligned(torch.tensor([1, 2]), 2)
    with pytest.raises(BadIndices, match=r"^chunk slots must be 1-D"):
        page_ids(torch.zeros((2, 2), dtype=torch.int64), 2, "chunk slots")
    with pytest.raises(BadIndices, match=r"^chunk slots must be 1-D"):
        page_ids(torch.zeros((2, 2), dtype=torch.int64), 2, what="chunk slots", end=8)
    with pytest.raises(BadIndices, match=r"^chunk slots are not whole"):
        pages_of_aligned(torch.tensor([1, 2]), 2, "chunk slots")
    with pytest.raises(BadIndices, match=r"^chunk slots must be 1-D"):
        pages_of_aligned(torch.zeros((2, 2), dtype=torch.int64), 2, "chunk slots")


@pytest.mark.parametrize("first, page", [(2**53 + 1, 1), (2**62, 2**10), (2**63 - 4, 4)])
def test_page_ids_of_huge_slot_ids_are_exact(first, page):
    """Page arithmetic stays in integers: slot ids past 2**53 name their own pages, not a
    float-rounded neighbour's (nor one page too many or too few)."""
    slots = torch.tensor(list(range(first, first + page)), dtype=torch.int64)
    assert pages_of_aligned(slots, page).tolist() == [first // page]


# -- count_pages: the write's check, a decode chunk checked as one Python list -------------------
from transfer.indices import count_pages  # noqa: E402


def _verdict(f, a, ps, end):
    try:
        return f(a, ps, "x", end)
    except BadIndices as err:
        return str(err)


@settings(deadline=None)  # a loaded CI machine may stall one example past hypothesis' 200 ms
@given(st.lists(st.integers(-8, 80), max_size=40), st.sampled_from([1, 2, 4, 16]),
       st.sampled_from([None, 33, 64]))
def test_count_pages_gives_the_verdict_pages_of_slots_gives(ids, ps, end):
    """Any ids: the same count, or the same error, as the NumPy check (shifted runs included)."""
    for a in (np.array(ids, dtype=np.int64), np.arange(len(ids), dtype=np.int64) + (ids[0] if ids else 0)):
        want = _verdict(pages_of_slots, a, ps, end)
        got = _verdict(count_pages, a, ps, end)
        assert got == (want if isinstance(want, str) else want.shape[0])


@pytest.mark.parametrize("n_pages", [1, 4, 32, 33])  # 33 pages of 16: past the list check's length
def test_count_pages_of_one_run_checks_the_range_at_both_ends(n_pages):
    a = np.arange(16, 16 + 16 * n_pages, dtype=np.int64)
    assert count_pages(a, 16, end=16 + 16 * n_pages) == n_pages
    with pytest.raises(BadIndices, match="must lie in"):
        count_pages(a, 16, end=16 + 16 * n_pages - 1)
    with pytest.raises(BadIndices, match="must lie in"):
        count_pages(a - 32, 16, end=10**6)  # starts at -16


# -- page_list: several ops' host pages freed in one call, checked page by page in Python ---------
from transfer.indices import page_list  # noqa: E402


@settings(deadline=None)
@given(st.lists(st.integers(0, 40), max_size=40), st.sampled_from([1, 2, 4, 16]),
       st.sampled_from([None, 100, 41 * 16]), st.integers(0, 3), st.integers(-3, 3))
def test_page_list_gives_the_verdict_pages_of_slots_gives(pages, ps, end, where, delta):
    """Valid pages, and the same with one slot moved (misaligned, shuffled, out of range): the same
    pages, or the same error, as the NumPy check."""
    a = slots_for(pages, ps).numpy().copy()
    if a.shape[0] and delta:
        a[where % a.shape[0]] += delta
    want = _verdict(pages_of_slots, a, ps, end)
    got = _verdict(page_list, a, ps, end)
    assert got == (want if isinstance(want, str) else want.tolist())


@pytest.mark.parametrize("pages", [[3, 4, 5], [7], [1, 3, 2, 4], [4, 4], [2, 1], []],
                         ids=["run", "one", "ends-span-n", "repeat", "descending", "none"])
def test_slots_of_a_list_of_pages_are_page_by_page_in_the_order_given(pages):
    """A list of ints (a caller's own page ids) is one run only when it ascends: a consecutive set
    out of order keeps its order (the host pages a placing pool hands out)."""
    got = slots_of_pages(pages, 2)
    assert got.dtype == torch.int64 and got.tolist() == [p * 2 + k for p in pages for k in range(2)]
