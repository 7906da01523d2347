"""``LruIndex`` (the stores' page index) behaves exactly like a plain ordered map of names.

The index keys page names ``{64 hex}{suffix}`` by their binary digest and compacts its dict now and
then; neither may show: every answer, every eviction (which names, in which order, spelled as
given) and the byte count must equal a reference ``OrderedDict`` model's.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict

import pytest

from transfer.storage.lru import LruIndex


class Reference:
    """The specification: an ``OrderedDict`` of names, oldest first, evicting the oldest others."""

    def __init__(self, capacity_bytes=None, capacity_pages=None):
        self.cb, self.cp, self.d = capacity_bytes, capacity_pages, OrderedDict()

    def over(self):
        return (self.cb is not None and sum(self.d.values()) > self.cb) or (
            self.cp is not None and len(self.d) > self.cp)

    def add(self, name, nbytes):
        self.d.pop(name, None)
        self.d[name] = nbytes
        out = []
        while len(self.d) > 1 and self.over():
            out.append(self.d.popitem(last=False)[0])
        return out

    def touch(self, name):
        if name not in self.d:
            return False
        self.d.move_to_end(name)
        return True

    def remove(self, name):
        return self.d.pop(name, None) is not None


def page(i, suffix="_m_0_1"):
    return hashlib.sha256(str(i).encode()).hexdigest() + suffix


def names(rng, suffix):
    pages = [page(rng.random(), suffix) for _ in range(24)]
    odd = ["odd", page(1).upper(), page(2, "_other"), page(3)[:63] + suffix, " " + page(4, suffix)[1:]]
    return pages + odd


@pytest.mark.parametrize("seed", range(40))
def test_every_answer_and_eviction_matches_the_reference(seed):
    rng = random.Random(seed)
    cb, cp = rng.choice([None, 1, 40, 300]), rng.choice([None, 1, 3, 12])
    got, want = LruIndex(cb, cp), Reference(cb, cp)
    pool = names(rng, rng.choice(["", "_m_0_1", "@x"]))
    for _ in range(600):
        name, op = rng.choice(pool), rng.random()
        if op < 0.45:
            size = rng.choice([1, 7, 30, 4096])
            assert got.add(name, size) == want.add(name, size)
        elif op < 0.7:
            assert got.touch(name) == want.touch(name)
        elif op < 0.85:
            assert got.remove(name) == want.remove(name)
        else:
            assert (name in got) == (name in want.d)
        assert (len(got), got.bytes) == (len(want.d), sum(want.d.values()))


def test_eviction_order_survives_many_touches_and_compactions():
    cap = 2000
    got, want = LruIndex(capacity_pages=cap), Reference(capacity_pages=cap)
    rng = random.Random(7)
    for i in range(3 * cap):
        name = page(i)
        assert got.add(name, 4096) == want.add(name, 4096)
        if i % 3 == 0:                                  # re-use old pages: holes all over the dict
            old = page(rng.randrange(i + 1))
            assert got.touch(old) == want.touch(old)
        if i % 11 == 0:
            gone = page(rng.randrange(i + 1))
            assert got.remove(gone) == want.remove(gone)
    assert got.add(page("last"), 1) == want.add(page("last"), 1) != []
    assert list(want.d) == [got._name(k) for k in got._sizes]  # the same order, oldest first
    small = LruIndex(capacity_bytes=10)
    assert small.add(page(1), 4) == [] and small.add(page(2), 4) == []
    assert small.add(page(3), 4) == [page(1)]           # names come back spelled as given


def test_names_of_another_suffix_or_shape_are_indexed_as_themselves():
    idx = LruIndex(capacity_pages=3)
    first, other, odd = page(1, "_a"), page(2, "_b"), "not-a-hash"
    for n in (first, other, odd):
        assert idx.add(n, 1) == []
    assert all(n in idx for n in (first, other, odd)) and page(2, "_a") not in idx
    assert idx.add(page(3, "_a"), 1) == [first]
    assert idx.add(page(4, "_a"), 1) == [other]
    assert idx.add(page(5, "_a"), 1) == [odd]


def test_capacities_below_one_are_refused():
    with pytest.raises(ValueError):
        LruIndex(capacity_bytes=0)
    with pytest.raises(ValueError):
        LruIndex(capacity_pages=0)
