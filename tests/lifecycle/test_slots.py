"""``lifecycle.slots.SlotsInFlight`` on its own: how many copies read each device slot.

The manager counts a chunk through the ids its plan checked (``planned``); a copy added without a
plan is counted from its tensor (sorted, deduplicated). Either way ``read`` names exactly the ids
some copy reads, ``remove`` uncounts exactly what ``add`` counted, and the table grows on demand.
"""

from __future__ import annotations

import numpy as np
import torch

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
