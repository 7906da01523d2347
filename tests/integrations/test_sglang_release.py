"""The release sink for SGLang, call by call: what ``check`` refuses (naming the request and the
reason, with no effect) and the four steps ``free`` takes, as SGLang's own manager releases."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lifecycle.integrations.sglang import SGLangConfigError
from lifecycle.integrations.sglang.release import SGLangReleaseSink
from lifecycle.release import ReleaseRefused
from lifecycle_tools.testkit import sglang_doubles as d


class Tree:
    """SGLang's tree cache seam: ``free_kv_row`` calls recorded, ``protected_size_``."""

    def __init__(self, protected: int = 4) -> None:
        self.protected_size_, self.freed = protected, []

    def free_kv_row(self, kv, ranges):
        self.freed.append((kv, ranges))


def _setup(prefix: int = 2, protected: int = 4):
    pool = d.ReqToTokenPool(4, 16, "cpu", False)
    req = d.Req("r1", list(range(8)))
    req.prefix_indices = torch.arange(prefix, dtype=torch.int64)
    assert pool.alloc([req]) is not None
    req.kv.kv_allocated_len = 8
    tree = Tree(protected)
    return SGLangReleaseSink(tree, pool), tree, pool, req


def _plan(req, row=None, ranges=((0, 8),), quarantined=0):
    return SimpleNamespace(req=req, row=req.kv.req_pool_idx if row is None else row, ranges=tuple(ranges),
                           quarantined=quarantined)


def test_free_takes_sglangs_four_steps():
    sink, tree, pool, req = _setup(prefix=3, protected=5)
    kv, row = req.kv, req.kv.req_pool_idx
    plan = _plan(req, ranges=[(0, 4), (8, 12)])
    sink.check(plan)
    assert sink.free(plan) is True
    assert tree.freed == [(kv, [(0, 4), (8, 12)])]              # one call, the ranges as a list
    assert req.kv.req_pool_idx is None and pool.available_size() == 4 and row is not None
    assert kv.kv_allocated_len == 0                               # mark_kv_released
    assert tree.protected_size_ == 2                              # 5 - 3 prefix tokens


def test_a_request_sglang_frees_itself_is_neither_checked_nor_freed_inside_the_block_only():
    sink, tree, pool, req = _setup()
    bad = _plan(req, row=req.kv.req_pool_idx + 1)
    with sink.released_by_sglang(req):
        sink.check(bad)                                           # nothing to check
        assert sink.free(_plan(req)) is False and tree.freed == []
    with pytest.raises(ReleaseRefused):
        sink.check(bad)
    assert sink.free(_plan(req)) is True and len(tree.freed) == 1


@pytest.mark.parametrize("edit,plan_kw,message", [
    (lambda r: setattr(r.kv, "req_pool_idx", 2), {"row": 3}, "request 'r1': kv row 2 is not the row 3 being released"),
    (lambda r: setattr(r.kv, "req_pool_idx", None), {"row": 0}, "request 'r1': kv row None is not the row 0"),
    (lambda r: setattr(r.kv, "req_pool_idx", -1), {"row": -1}, "request 'r1': kv row -1 is not the row -1"),
    (lambda r: setattr(r, "kv", SimpleNamespace(req_pool_idx=0)), {"row": 0},
     "request 'r1': kv has no mark_kv_released()"),
    (lambda r: setattr(r, "prefix_indices", None), {}, "request 'r1': prefix_indices None has no length"),
    (lambda r: delattr(r, "prefix_indices"), {}, "request 'r1': prefix_indices None has no length"),
    (lambda r: delattr(r, "kv"), {"row": 0}, "request 'r1': kv row None is not the row 0"),
    (lambda r: setattr(r, "kv", SimpleNamespace(mark_kv_released=lambda: None)), {"row": 0},
     "request 'r1': kv row None is not the row 0"),
    (lambda r: (delattr(r, "rid"), setattr(r.kv, "req_pool_idx", 2)), {"row": 3},
     "request None: kv row 2 is not the row 3"),
    (lambda r: setattr(r, "prefix_indices", torch.arange(5)), {},
     "request 'r1': 5 prefix tokens but the tree cache protects only 4"),
    (lambda r: None, {"quarantined": 2}, "request 'r1': 2 slots are quarantined by a stuck copy"),
    (lambda r: None, {"ranges": [(4, 8), (0, 2)]}, "are not ascending, disjoint, non-empty and inside the row"),
    (lambda r: None, {"ranges": [(0, 4), (3, 8)]}, "are not ascending, disjoint"),
    (lambda r: None, {"ranges": [(2, 2)]}, "are not ascending, disjoint, non-empty"),
    (lambda r: None, {"ranges": [(8, 17)]}, "inside the row (width 16)"),
])
def test_check_refuses_what_free_could_not_do_and_changes_nothing(edit, plan_kw, message):
    sink, tree, pool, req = _setup()
    edit(req)
    with pytest.raises(ReleaseRefused) as err:
        sink.check(_plan(req, **plan_kw))
    assert message in str(err.value)
    assert tree.freed == [] and tree.protected_size_ == 4 and pool.available_size() == 3


def test_check_accepts_the_edges():
    sink, tree, pool, req = _setup(prefix=4, protected=4)       # every protected token is this request's
    sink.check(_plan(req, ranges=[(0, 4), (4, 16)]))              # adjacent ranges, up to the row's width
    assert tree.freed == []


@pytest.mark.parametrize("tree,message", [
    (SimpleNamespace(protected_size_=0), "tree cache SimpleNamespace has no free_kv_row(kv, ranges)"),
    (SimpleNamespace(free_kv_row=1, protected_size_=0), "has no free_kv_row"),
    (SimpleNamespace(free_kv_row=lambda kv, r: None), "tree cache SimpleNamespace has no integer protected_size_"),
    (SimpleNamespace(free_kv_row=lambda kv, r: None, protected_size_=1.0), "has no integer protected_size_"),
])
def test_a_tree_cache_without_sglangs_seams_is_refused(tree, message):
    with pytest.raises(SGLangConfigError) as err:
        SGLangReleaseSink(tree, d.ReqToTokenPool(4, 16, "cpu", False))
    assert message in str(err.value)


def test_inside_another_requests_sglang_release_a_request_is_checked_and_freed_as_usual():
    sink, tree, pool, req = _setup()
    other = d.Req("r2", [1])
    with sink.released_by_sglang(other):
        with pytest.raises(ReleaseRefused):
            sink.check(_plan(req, row=req.kv.req_pool_idx + 1))
        assert sink.free(_plan(req)) is True
    assert tree.freed == [(req.kv, [(0, 8)])] and req.kv.req_pool_idx is None


# --- SGLang 0.5.23's release (issue 36): [cache_protected_len, kv_allocated_len), then the tree lock ---

from lifecycle.integrations.sglang.versions import Release  # noqa: E402

V23 = Release("0.5.23", "0.5.23", "test")


class LockTree(Tree):
    """0.5.23's tree cache seam: ``free_kv_row`` and ``unlock(lock)`` recorded (no ``protected_size_``)."""

    def __init__(self) -> None:
        super().__init__()
        del self.protected_size_
        self.unlocked = []

    def unlock(self, lock):
        self.unlocked.append(lock)


def _setup_v23(protected_len: int = 4, allocated: int = 12):
    pool = d.ReqToTokenPool(4, 16, "cpu", False)
    req = d.Req("r1", list(range(8)))
    assert pool.alloc([req]) is not None
    req.kv.kv_allocated_len, req.kv.cache_protected_len, req.lock = allocated, protected_len, "the-lock"
    tree = LockTree()
    return SGLangReleaseSink(tree, pool, release=V23), tree, pool, req


def test_free_on_0_5_23_frees_past_the_protected_prefix_then_unlocks_as_sglang_0_5_23_does():
    sink, tree, pool, req = _setup_v23(protected_len=4, allocated=12)
    kv = req.kv
    plan = _plan(req, ranges=[(0, 8), (8, 12)])                   # the core's ranges: not what 0.5.23 frees
    sink.check(plan)
    assert sink.free(plan) is True
    assert tree.freed == [(kv, [(4, 12)])]                        # the prefix stays the tree's
    assert tree.unlocked == ["the-lock"] and req.lock is None
    assert req.kv.req_pool_idx is None and pool.available_size() == 4 and kv.kv_allocated_len == 0


@pytest.mark.parametrize("protected_len,allocated", [(-1, 8), (9, 8), (None, 8), (2.0, 8)])
def test_check_on_0_5_23_refuses_a_protected_length_outside_the_row_and_changes_nothing(protected_len, allocated):
    sink, tree, pool, req = _setup_v23(protected_len=protected_len, allocated=allocated)
    with pytest.raises(ReleaseRefused, match=r"request 'r1': kv.cache_protected_len .* is not an int in"):
        sink.check(_plan(req, ranges=[(0, 8)]))
    assert tree.freed == [] and tree.unlocked == [] and req.lock == "the-lock" and pool.available_size() == 3


def test_on_0_5_23_a_tree_cache_without_unlock_is_refused_and_protected_size_is_not_needed():
    with pytest.raises(SGLangConfigError, match=r"has no unlock\(lock\) \(SGLang 0.5.23\)"):
        SGLangReleaseSink(Tree(), d.ReqToTokenPool(4, 16, "cpu", False), release=V23)
    SGLangReleaseSink(LockTree(), d.ReqToTokenPool(4, 16, "cpu", False), release=V23)
