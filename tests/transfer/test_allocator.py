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


def _outcome(call):
    """The error type ``call`` raises (None when it returns)."""
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the type is what is compared
        return type(err)
    return None


def test_check_free_raises_exactly_what_free_would_and_changes_nothing():
    a = PagedTokenAllocator(64, 16)
    got = a.alloc(32)                                  # pages 1, 2 held; 3, 4 never allocated
    a.free(got[16:])                                   # page 2 released
    cases = [
        (got[:16], None), (got[:3], None), (got, DoubleFree), (torch.tensor([0]), NotAllocated),
        (torch.tensor([16, 70]), NotAllocated), (torch.tensor([16, 80]), BadIndices),
        (torch.tensor([-1]), BadIndices), (torch.tensor([[16]]), BadIndices),
        (torch.tensor([16.0]), BadIndices), (torch.empty(0, dtype=torch.int64), None),
    ]
    for indices, expected in cases:
        before = a.available_size()
        assert _outcome(lambda: a.check_free(indices)) is expected, indices
        assert a.available_size() == before
        a.check_integrity()
    assert _outcome(lambda: a.free(got[:16])) is None   # check_free passed: free frees
    assert a.available_size() == 64


def test_check_free_agrees_with_free_under_churn():
    a = PagedTokenAllocator(256, 4)
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        a.alloc(int(torch.randint(1, 12, (1,), generator=g)))
        probe = torch.randint(0, a.total_slots, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)
        before = a.available_size()
        expected = _outcome(lambda: a.check_free(probe))
        assert a.available_size() == before
        assert _outcome(lambda: a.free(probe)) is expected
        if expected is not None:
            assert a.available_size() == before
    a.check_integrity()


def test_holds_slots_says_what_check_free_of_the_run_would_say():
    """``holds_slots(lo, hi)`` is the cheap form of ``check_free`` for one run of slots: True exactly
    when ``check_free(arange(lo, hi + 1))`` would pass, whatever the range (padding page, released
    and never-allocated pages, out of range, negative, empty)."""
    a = PagedTokenAllocator(256, 4)
    g = torch.Generator().manual_seed(7)
    for _ in range(150):
        a.alloc(int(torch.randint(1, 12, (1,), generator=g)))
        if int(torch.randint(0, 3, (1,), generator=g)) == 0:
            victim = torch.randint(4, a.total_slots, (1,), generator=g)
            if _outcome(lambda: a.check_free(victim)) is None:
                a.free(victim)
        lo = int(torch.randint(-3, a.total_slots + 3, (1,), generator=g))
        hi = lo + int(torch.randint(-1, 14, (1,), generator=g))
        before = a.available_size()
        run = torch.arange(lo, hi + 1) if hi >= lo else None
        expected = run is not None and _outcome(lambda: a.check_free(run)) is None
        assert a.holds_slots(lo, hi) is expected, (lo, hi)
        assert a.available_size() == before
    a.check_integrity()


def test_a_refusal_names_the_exact_page_of_a_slot_past_float_precision():
    """Slot -> page arithmetic is integer: a slot id past 2**53 names its own page."""
    alloc = PagedTokenAllocator(2**60, 2**40)                   # 2**20 pages, none allocated
    with pytest.raises(NotAllocated, match=r"\b1048575\b") as exc:
        alloc.check_free(torch.tensor([2**60 - 1]))
    assert "1048576" not in str(exc.value)
