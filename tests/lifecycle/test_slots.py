"""``lifecycle.slots.SlotsInFlight`` on its own: how many copies read each device slot.

The manager counts a chunk through the ids its plan checked (``planned``); a copy added without a
plan is counted from its tensor (sorted, deduplicated). Either way ``read`` names exactly the ids
some copy reads, ``remove`` uncounts exactly what ``add`` counted, and the table grows on demand.
"""

from __future__ import annotations

import numpy as np
import torch

from lifecycle.pools import Pools
from lifecycle.slots import SlotsInFlight


def ids(*xs):
    return np.array(xs, dtype=np.int64)


def busy(r, s):
    s = np.asarray(s, dtype=np.int64)
    lo, hi = int(s[0]), int(s[-1])
    out = r.read(s, lo, hi, hi - lo + 1 == s.shape[0])
    return None if out is None else out.tolist()


def test_a_copy_added_without_a_plan_counts_its_own_ids_only():
    r = SlotsInFlight()
    r.add(1, torch.tensor([9, 5, 7, 5]))                 # not a run, unsorted, a repeat
    assert r.total() == 3 and r.reader(7) == 1 and r.reader(6) is None
    assert busy(r, [6]) is None and busy(r, [8]) is None   # the gaps inside its span are not read
    assert busy(r, range(4, 11)) == [5, 7, 9] and busy(r, [5, 6, 8]) == [5]
    r.add(2, torch.tensor([12, 10, 11, 13]))             # a run, unsorted
    assert r.total() == 7 and busy(r, range(9, 15)) == [9, 10, 11, 12, 13] and r.reader(13) == 2
    r.add(3, torch.tensor([11, 12]))                     # a second reader of two of them
    r.remove(2)
    assert r.total() == 5 and busy(r, range(10, 14)) == [11, 12] and r.reader(11) == 3
    r.remove(1)
    r.remove(3)
    r.remove(3)                                          # an ack counted no more: nothing happens
    assert r.total() == 0 and busy(r, range(0, 20)) is None


def test_the_table_grows_for_ids_at_and_past_its_end():
    r = SlotsInFlight()
    size = r._n.shape[0]
    r.add(1, torch.tensor([size]))                        # the first id past the table
    r.add(2, torch.tensor([size + 4, size + 2]))
    assert r.total() == 3 and busy(r, [size]) == [size] and busy(r, [size + 1, size + 3]) is None
    assert busy(r, [size + 2, size + 3, size + 4]) == [size + 2, size + 4]
    r.add(3, torch.tensor(range(5 * size, 5 * size + 3)))
    assert r.total() == 6 and busy(r, [5 * size + 2]) == [5 * size + 2]
    assert busy(r, [10 * size]) is None                   # past the table: nobody reads it
    end = r._n.shape[0]                                   # ids from inside the table to past its end
    assert busy(r, [size, end]) == [size] and busy(r, [size, 10 * end]) == [size]
    assert busy(r, [size + 1, end, end + 7]) is None
    for ack in (1, 2, 3):
        r.remove(ack)
    assert r.total() == 0


def test_an_empty_copy_counts_nothing():
    r = SlotsInFlight()
    r.add(1, torch.tensor([], dtype=torch.int64))
    assert r.total() == 0 and r.reader(0) is None
    r.remove(1)
    assert r.total() == 0


# ``check_slots`` on its own: a manager stand-in holding only what the check reads.

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from lifecycle.errors import InvalidSlots  # noqa: E402
from lifecycle.slots import check_slots  # noqa: E402


class SpyAllocator:
    """Answers ``holds_slots`` with ``holds`` and records what the check asks."""

    def __init__(self, holds=True, refuse=()):
        self.holds, self.refuse, self.asked, self.probed = holds, set(refuse), [], []

    def holds_slots(self, lo, hi):
        self.asked.append((lo, hi))
        return self.holds

    def check_free(self, firsts):
        self.probed.append(firsts.tolist())
        bad = self.refuse.intersection(firsts.tolist())
        if bad:
            raise ValueError(f"page {min(bad)} not held")


def bare_mgr(alloc=None, page=4, reading=()):
    """``reading``: (ack, ids) of copies in flight."""
    from lifecycle.ledger import Ledger
    from lifecycle.table import Owners

    ledger = Ledger(Owners(), None)
    r = ledger.reading
    for ack, xs in reading:
        r.add(ack, torch.tensor(xs, dtype=torch.int64))
    pools = Pools(page, page, None, None, alloc if alloc is not None else SpyAllocator())
    return SimpleNamespace(pools=pools, ledger=ledger)


def plan(mgr, xs, **kw):
    a = ids(*xs)
    return check_slots(mgr.pools, mgr.ledger, "r", 3, ((0, len(xs)),), a, "offload", indices=torch.from_numpy(a), **kw)


def test_a_run_the_allocator_says_it_holds_is_not_probed_page_by_page():
    alloc = SpyAllocator(holds=True)
    s, _ = plan(bare_mgr(alloc), [5, 6, 7, 8, 9, 10])
    assert s.tolist() == [5, 6, 7, 8, 9, 10] and alloc.asked == [(5, 10)] and alloc.probed == []


@pytest.mark.parametrize("xs, pages", [
    ([5, 6, 7, 8, 9, 10], [4, 8]),        # a run not page-aligned: its two pages
    ([8, 9, 10, 11], [8]),                # one whole page, nothing past it
    ([3, 4], [0, 4]),
])
def test_a_run_the_allocator_does_not_vouch_for_is_probed_once_per_page_it_touches(xs, pages):
    alloc = SpyAllocator(holds=False, refuse={pages[-1] + 4})  # the page after the run is free
    s, _ = plan(bare_mgr(alloc), xs)
    assert s.tolist() == xs and alloc.asked == [(xs[0], xs[-1])] and alloc.probed == [pages]


def test_ids_that_are_no_run_are_probed_by_their_own_pages_only():
    alloc = SpyAllocator(holds=True, refuse={4})       # page 4..7 lies between them, not held
    s, _ = plan(bare_mgr(alloc), [1, 0, 9, 8])
    assert s.tolist() == [0, 1, 8, 9] and alloc.asked == [] and alloc.probed == [[0, 8]]
    mgr = bare_mgr(SpyAllocator(holds=False, refuse={8}))
    with pytest.raises(InvalidSlots, match=r"row 3 lists slots the allocator does not hold .*page 8 not held"):
        plan(mgr, [1, 0, 9, 8])
    assert mgr.ledger.reading.planned is None


@pytest.mark.parametrize("check_free", ["absent", 0])
def test_an_allocator_without_a_callable_check_free_is_trusted(check_free):
    alloc = SimpleNamespace() if check_free == "absent" else SimpleNamespace(check_free=check_free)
    mgr = bare_mgr(alloc)
    s, _ = plan(mgr, [0, 2, 9])
    assert s.tolist() == [0, 2, 9] and mgr.ledger.reading.planned[1].tolist() == [0, 2, 9]


def test_ids_with_gaps_ignore_a_copy_reading_the_gaps():
    mgr = bare_mgr(reading=[(1, [2, 3])])
    s, _ = plan(mgr, [0, 1, 4])
    assert s.tolist() == [0, 1, 4]
    with pytest.raises(InvalidSlots, match=r"lists slot 3 at a position to offload"):
        plan(mgr, [0, 3, 4])


@pytest.mark.parametrize("xs, held, busy", [
    ([0, 1, 2, 5], [1], 5),               # left [0, 2, 5]: no run, the last one read
    ([5, 7, 2000], [7], 5),               # left [5, 2000]: past the counts table, the first one read
    ([4, 9], [4], 9),                     # left one id
])
def test_a_release_around_quarantined_slots_still_refuses_a_slot_another_copy_reads(xs, held, busy):
    mgr = bare_mgr(reading=[(7, [busy])])
    with pytest.raises(InvalidSlots, match=rf"request 'r': row 3 lists slot {busy} at a position to free"):
        check_slots(mgr.pools, mgr.ledger, "r", 3, ((0, 9),), ids(*xs), "free", quarantined=ids(*held))
    free = bare_mgr()
    s, left_out = check_slots(free.pools, free.ledger, "r", 3, ((0, 9),), ids(*xs), "free", quarantined=ids(*held))
    assert s.tolist() == [x for x in xs if x not in held] and left_out == len(held)


def test_no_ids_are_no_ids_checked_and_none_left_out():
    for verb, kw in (("offload", {"indices": torch.empty(0, dtype=torch.int64)}), ("free", {"quarantined": ids(3)})):
        bare = bare_mgr()
        s, left_out = check_slots(bare.pools, bare.ledger, "r", 3, ((0, 0),), np.empty(0, dtype=np.int64), verb, **kw)
        assert s.shape == (0,) and left_out == 0


@pytest.mark.parametrize("slot", [2**53 + 1, 2**63 - 1], ids=["past float precision", "largest int64"])
def test_the_allocator_is_asked_about_the_exact_page_of_a_huge_slot_id(slot):
    """Page arithmetic stays in int64: a slot id past 2**53 is not rounded to a neighbour's page
    (which the allocator may hold) nor turned into a float the allocator cannot read."""
    alloc = SpyAllocator(holds=False)
    s, _ = plan(bare_mgr(alloc, page=1), [slot])
    assert s.tolist() == [slot] and alloc.probed == [[slot]]
    assert all(type(p) is int for p in alloc.probed[0])


# --- DeviceReads: a device row's counts and the allocator's held pages, on the device ---------------

class _Alloc:
    """SGLang's allocator as the check sees it: free page ids on the device (page 0 never free)."""

    def __init__(self, free, release=()):
        self.free_pages = torch.tensor(free, dtype=torch.int64)
        self.release_pages = torch.tensor(release, dtype=torch.int64)


def test_device_reads_count_at_commit_and_uncount_when_the_copy_ends():
    from lifecycle.slots import DeviceReads
    from lifecycle_tools.testkit.sync_trap import as_device_resident, no_host_sync

    r = SlotsInFlight()
    ids_ = as_device_resident(torch.arange(8, 16))
    r.device = dev = DeviceReads(ids_, 4, 64)
    pages = torch.tensor([2, 3])
    with no_host_sync():
        dev.plan(ids_, torch.tensor(False), pages)
        r.add(7, ids_)
    assert dev.counts.tolist()[2:4] == [1, 1] and r.total() == 0  # the host table is not involved
    with no_host_sync():
        dev.plan(ids_, torch.tensor(True), pages)  # a chunk the check refused: on the spare entry
        r.add(8, ids_)
    assert dev.counts[:16].tolist() == [0, 0, 1, 1] + [0] * 12 and int(dev.counts[16]) == 2
    with no_host_sync():
        r.remove(7)
        r.remove(8)
        r.remove(9)  # unknown: nothing
    assert int(dev.counts.sum()) == 0
    with no_host_sync():
        r.add(10, as_device_resident(torch.arange(4, 8)))  # not the planned tensor: not counted, not read
    assert int(dev.counts.sum()) == 0


def test_the_held_mask_follows_the_allocators_free_lists_and_is_rebuilt_only_when_they_change():
    from lifecycle.slots import DeviceReads

    dev = DeviceReads(torch.arange(4), 4, 8 * 4)  # pages 0..7
    alloc = _Alloc([3, 5], release=[6])
    mask = dev.held(alloc, torch.device("cpu"), 4)
    assert mask[:8].tolist() == [False, True, True, False, True, False, False, True]  # 0: padding
    assert dev.held(alloc, torch.device("cpu"), 4) is mask  # same lists: reused
    alloc.free_pages = alloc.free_pages[1:]  # page 3 allocated (SGLang reassigns a slice)
    assert dev.held(alloc, torch.device("cpu"), 4)[3]
    alloc.release_pages[0] = 2  # written in place
    assert dev.held(alloc, torch.device("cpu"), 4)[:8].tolist() == [False, True, False, True, True, False, True, True]
    assert dev.held(object(), torch.device("cpu"), 4) is None  # no free lists on the device: not checked
    assert dev.held(_Alloc([1]), torch.device("meta"), 4) is None  # lists on another device
