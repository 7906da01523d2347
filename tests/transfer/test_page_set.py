"""PageSet against a plain-Python model: every alloc/free sequence agrees, bad frees change nothing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.errors import BadIndices, DoubleFree, IntegrityError, NotAllocated
from transfer.page_set import _HELD, _RELEASED, PageSet

ops = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 6)),
    st.tuples(st.just("free"), st.lists(st.integers(-1, 21), max_size=6)),
), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_matches_a_python_model(seq):
    ps = PageSet(20, first=1)
    free, held, released = set(range(1, 20)), set(), set()
    for op, arg in seq:
        if op == "alloc":
            got = ps.alloc(arg)
            if arg > len(free):
                assert got is None
                continue
            ids = got.tolist()
            assert len(ids) == arg and len(set(ids)) == arg and set(ids) <= free
            assert ids == sorted(ids)  # ascending: lowest ids first after a merge
            free -= set(ids)
            held |= set(ids)
            continue
        before = (ps.free_count(), ps.held_count())
        uniq = set(arg)
        if any(p < 0 or p >= 20 for p in uniq):
            with pytest.raises(BadIndices):
                ps.free(np.array(arg, dtype=np.int64))
        elif not uniq <= held:
            never = uniq - held - released
            with pytest.raises(NotAllocated if never else DoubleFree):
                ps.free(np.array(arg, dtype=np.int64))
        else:
            assert ps.free(np.array(arg, dtype=np.int64)) == len(uniq)
            held -= uniq
            free |= uniq
            released |= uniq
            continue
        assert (ps.free_count(), ps.held_count()) == before  # a refused free changes nothing
    assert ps.free_count() == len(free) and ps.held_count() == len(held)
    ps.check_integrity()


def test_one_run_and_scattered_frees_and_reserved_page():
    ps = PageSet(10, first=1)
    got = ps.alloc(9)
    assert got.tolist() == list(range(1, 10))
    assert ps.free(np.array([3, 4, 5])) == 3  # one run
    assert ps.free(np.array([9, 1, 7, 7])) == 3  # scattered, a repeat counts once
    with pytest.raises(DoubleFree):
        ps.free(np.array([4]))
    with pytest.raises(NotAllocated):
        ps.free(np.array([0]))  # the reserved page
    assert ps.alloc(6).tolist() == [1, 3, 4, 5, 7, 9]  # merged and sorted
    ps.check_integrity()


@settings(max_examples=80, deadline=None)
@given(ops)
def test_holds_run_agrees_with_the_model_for_every_run(seq):
    ps = PageSet(20, first=1)
    held = set()
    for op, arg in seq:
        if op == "alloc":
            got = ps.alloc(arg)
            held |= set() if got is None else set(got.tolist())
        else:
            try:
                ps.free(np.array(arg, dtype=np.int64))
            except (BadIndices, NotAllocated, DoubleFree):
                continue
            held -= set(arg)
    for lo in range(-1, 21):
        for hi in range(lo - 1, 22):
            expected = 0 <= lo <= hi < 20 and all(p in held for p in range(lo, hi + 1))
            assert ps.holds_run(lo, hi) is expected, (lo, hi, sorted(held))


def test_holds_run_of_more_pages_than_its_byte_compare_covers():
    ps = PageSet(5000)
    ps.alloc(5000)
    assert ps.holds_run(0, 4999) is True                 # 5000 pages: the NumPy comparison
    ps.free(np.array([4321]))
    assert ps.holds_run(0, 4999) is False and ps.holds_run(0, 4320) is True


def test_holds_run_past_the_last_page_is_false_however_long():
    ps = PageSet(5000)
    ps.alloc(5000)
    assert ps.holds_run(0, 4999) is True
    assert ps.holds_run(0, 5000) is False and ps.holds_run(4999, 5000) is False  # 5000 is out of range


def test_released_pages_are_merged_back_only_when_the_free_run_is_short():
    ps = PageSet(4)
    assert ps.alloc(2).tolist() == [0, 1]
    ps.free(np.array([0]))
    assert ps.alloc(2).tolist() == [2, 3]  # exactly what is left of the free run: no merge
    assert ps.alloc(1).tolist() == [0]
    ps.check_integrity()


def test_frees_of_any_integer_dtype_keep_handed_out_ids_int64():
    ps = PageSet(4)
    ps.alloc(4)
    ps.check_free([2, 3])                          # a plain list is fine
    assert ps.free(np.array([3, 1], dtype=np.uint64)) == 2
    assert ps.free(np.array([2, 0], dtype=np.uint64)) == 2
    got = ps.alloc(4)
    assert got.dtype == np.int64 and got.tolist() == [0, 1, 2, 3]
    ps.check_integrity()


def test_not_allocated_names_at_most_eight_pages():
    ps = PageSet(20, first=10)
    with pytest.raises(NotAllocated, match=r"^pages \[0, 1, 2, 3, 4, 5, 6, 7\] were never allocated$"):
        ps.free(np.arange(10))
    with pytest.raises(NotAllocated, match=r"^pages \[0\] were never allocated$"):
        ps.check_free(np.array([0]))


def test_check_integrity_names_each_inconsistency():
    ps = PageSet(4)
    ps.alloc(2)
    ps._state[0] = _RELEASED                       # held 1 + free 2 != total 4
    with pytest.raises(IntegrityError, match=r"^held 1 \+ free 2 != total 4$"):
        ps.check_integrity()
    ps = PageSet(4)
    ps._state[3] = _HELD                           # page 3 is on the free list and held
    with pytest.raises(IntegrityError, match=r"^a page is both free and held$"):
        ps.check_integrity()
    ps = PageSet(4)
    ps._free = np.array([0, 1, 2, 2], dtype=np.int64)
    with pytest.raises(IntegrityError, match=r"^a page is on the free list twice$"):
        ps.check_integrity()


# -- a Python list of pages (several ops' host pages) is freed as the same pages in NumPy would be --
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as hst  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(hst.lists(hst.integers(-2, 20), max_size=12), hst.integers(0, 6))
def test_freeing_a_list_of_pages_does_what_freeing_their_array_does(pages, released):
    """Any pages (held, never handed out, already free, repeated, out of range): the same count or
    the same error, and the same state after."""
    import numpy as np

    def run(as_list):
        ps = PageSet(16, first=1)
        got = ps.alloc(12)
        ps.free(got[:released])
        try:
            out = ps.free(list(pages) if as_list else np.array(pages, dtype=np.int64))
        except Exception as err:  # noqa: BLE001 - the verdict compared is the error itself
            out = (type(err), str(err))
        return out, ps.free_count(), ps._state.tobytes()

    assert run(True) == run(False)
