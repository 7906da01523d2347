"""``lifecycle.table``: the ownership registries, the ledger's record table as a manager uses it, and
the test kit's ``deep_copy`` (``lifecycle_tools.testkit.model_copy.CopyableManager.__deepcopy__``):
an independent manager over copied requests that can be driven on its own — the bounded model
check explores what-if orderings on such copies.

The deep copy promises "an independent copy, requests included": the copy's records are keyed by
the copied requests, its copies in flight refer to its own records, driving it leaves the original
as it was (and the other way round), the copy owns its live requests and its copied offloader, and
the logger, clock, TP group, machine and ownership registry are shared.
"""

from __future__ import annotations

import copy

import pytest

from lifecycle import ConfigError, DecodeOffloadManager, State
from lifecycle import table
from lifecycle_tools.testkit.model_copy import CopyableManager
from lifecycle_tools.testkit.doubles import Req
from tests.conftest import Node


def node_with_three():
    """'a' INFLIGHT (ack 1), 'b' PREFILLED, 'c' RELEASED."""
    node = Node(page_size=4, manager_cls=CopyableManager)
    a, b, c = Req("a", range(4), row=0), Req("b", range(4), row=1), Req("c", range(4), row=2, finished=True)
    for i in range(4):
        a.decode(i)
        node.mgr.offload_kv_cache(a)
    node.mgr.offload_kv_cache(b)
    node.mgr.finalize_release_on_finish(c)
    return node, a, b, c


def states(mgr, *reqs):
    return [mgr.state_of(r) for r in reqs]


def test_a_copy_is_a_manager_over_copied_requests_driven_on_its_own():
    node, a, b, c = node_with_three()
    mgr = node.mgr
    twin, a2, b2, c2 = copy.deepcopy((mgr, a, b, c))
    assert type(twin) is CopyableManager and twin is not mgr
    assert all(x is not y for x, y in ((a, a2), (b, b2), (c, c2)))
    # the copy knows the copied requests, in the same states, and not the originals
    assert states(twin, a2, b2, c2) == [State.INFLIGHT, State.PREFILLED, State.RELEASED]
    assert states(twin, a, b, c) == [None, None, None] and states(mgr, a2, b2, c2) == [None, None, None]
    assert set(twin._ledger.records) == {id(a2), id(b2), id(c2)}
    rec = twin._ledger.records[id(a2)]
    assert rec is not mgr._ledger.records[id(a)] and rec.offload is not mgr._ledger.records[id(a)].offload
    assert twin._ledger.ongoing[1].rec is rec and twin._ledger.ongoing[1].req is a2 and twin.copies_of(a2) == [1]
    # shared: logger, rate limiter, clock, TP group, machine, ownership registry; the rest copied
    for key in ("_log", "_alerts", "_clock", "tp_group", "_owners"):
        assert getattr(twin, key) is getattr(mgr, key), key
    for key in ("offloader", "req_to_token_pool", "token_to_kv_pool_allocator", "_ledger"):
        assert getattr(twin, key) is not getattr(mgr, key), key
    for key in ("ongoing", "by_state", "reading", "dropped", "records"):
        assert getattr(twin._ledger, key) is not getattr(mgr._ledger, key), key
    assert twin.stats() == mgr.stats() and twin.snapshot() == mgr.snapshot()
    twin.check_integrity()
    # driving the copy leaves the original as it was
    before = (mgr.stats(), mgr.snapshot(), mgr.progress_of(a))
    twin.offloader.land()
    twin.check_offload_progress()
    a2.decode(9)
    a2.finish()
    twin.finalize_release_on_finish(a2)
    assert states(twin, a2, b2) == [State.RELEASED, State.PREFILLED]
    assert (mgr.stats(), mgr.snapshot(), mgr.progress_of(a)) == before
    assert states(mgr, a, b, c) == [State.INFLIGHT, State.PREFILLED, State.RELEASED]
    assert twin.req_to_token_pool.freed_rows == [2, 0] and twin.stats().released == 2
    assert node.pool.freed_rows == [2]
    # and the other way round
    node.land_all()
    assert twin.stats().chunks_landed == 1 and mgr.stats().chunks_landed == 1
    mgr.check_integrity()
    twin.check_integrity()


def test_a_copy_owns_its_live_requests_and_its_offloader():
    node, a, b, c = node_with_three()
    mgr = node.mgr
    twin, a2, b2, c2 = copy.deepcopy((mgr, a, b, c))
    owner = table.OWNERS.owner
    assert (owner(a2), owner(b2), owner(a), owner(b)) == (twin, twin, mgr, mgr)
    assert owner(c2) is None and owner(c) is mgr            # a RELEASED request is claimed by nobody new
    with pytest.raises(ConfigError, match="already serves another DecodeOffloadManager"):
        DecodeOffloadManager(twin.req_to_token_pool, twin.token_to_kv_pool_allocator, page_size=4,
                             offloader=twin.offloader)


def test_a_copy_of_a_closed_manager_is_closed_and_claims_no_offloader():
    node = Node(page_size=4, manager_cls=CopyableManager)
    node.mgr.shutdown()
    twin = copy.deepcopy(node.mgr)
    assert twin.closed
    other = DecodeOffloadManager(twin.req_to_token_pool, twin.token_to_kv_pool_allocator, page_size=4,
                                 offloader=twin.offloader)     # the copy does not hold it
    assert not other.closed


def test_a_request_dropped_before_the_copy_is_not_copied_and_drops_are_each_managers_own():
    node, a, b, c = node_with_three()
    mgr = node.mgr
    gone = Req("gone", range(4), row=3)
    mgr.offload_kv_cache(gone)
    later = Req("later", range(4), row=4)                  # recorded after the one that goes
    mgr.offload_kv_cache(later)
    del gone
    # its record is queued (refcount drop: the weakref callback ran), not retired yet
    twin, a2, b2, c2, later2 = copy.deepcopy((mgr, a, b, c, later))
    assert len(twin._ledger.records) == 4 and len(mgr._ledger.records) == 5   # the dropped one is skipped, not the rest
    assert twin.state_of(later2) is State.PREFILLED
    assert twin.stats().leaked == 0 and mgr.stats().leaked == 1
    del b2
    # the copy's request: the copy's leak only
    assert (twin.stats().leaked, mgr.stats().leaked) == (1, 1)
    fresh = Req("fresh", range(4), row=5)                 # first seen by the copy, after the copy
    twin.offload_kv_cache(fresh)
    assert twin.stats().tracked == 4
    del fresh
    # dropped: its record goes with the next call
    assert (twin.stats().leaked, twin.stats().tracked, mgr.stats().leaked) == (2, 3, 1)
    assert states(mgr, a, b) == [State.INFLIGHT, State.PREFILLED] and twin.state_of(a2) is State.INFLIGHT


def test_one_memo_copies_the_manager_once():
    node, a, _, _ = node_with_three()
    first, second, a2 = copy.deepcopy((node.mgr, node.mgr, a))
    assert first is second and first.state_of(a2) is State.INFLIGHT


def test_a_new_ownership_registry_starts_empty_and_tracks_claims():
    owners, offloaders = table.Owners(), table.Offloaders()
    node = Node(page_size=4, manager_cls=CopyableManager)
    req = Req("r", range(4), row=0)
    assert owners.owner(req) is None
    owners.check(req, node.mgr)                            # nobody holds it: fine
    node.mgr.offload_kv_cache(req)
    ref = node.mgr._ledger.records[id(req)].ref
    owners.claim(req, node.mgr, ref)
    assert owners.owner(req) is node.mgr
    owners.forget(ref)
    assert owners.owner(req) is None
    offloaders.claim(node.off, node.mgr)                   # a fresh registry: no other claim
    offloaders.claim(node.off, node.mgr)                   # the same manager again: fine
    other = Node(page_size=4, manager_cls=CopyableManager)
    with pytest.raises(ConfigError, match="already serves another"):
        offloaders.claim(node.off, other.mgr)


def test_what_refers_back_to_the_manager_refers_to_the_copy_in_the_copy():
    """A collaborator holding its manager (here a release sink that remembers it) is copied with a
    reference to the copy, not to the original, and not lost."""
    node, a, _, _ = node_with_three()
    node.mgr.release_sink.owner = node.mgr
    twin, a2 = copy.deepcopy((node.mgr, a))
    assert twin.release_sink is not node.mgr.release_sink and twin.release_sink.owner is twin
    assert node.mgr.release_sink.owner is node.mgr


def test_a_record_whose_request_is_gone_is_not_found_for_an_object_reusing_its_id():
    """``lookup`` answers for the object it is given: a record keyed by an id its own request no
    longer has (the id reused by another object) is nobody's record."""
    node = Node(page_size=4, manager_cls=CopyableManager)
    a, b = Req("a", range(4), row=0), Req("b", range(4), row=1)
    node.mgr.offload_kv_cache(a)
    node.mgr._ledger.records[id(b)] = node.mgr._ledger.records[id(a)]   # as if b had a's id after a was dropped
    assert node.mgr._ledger.lookup(b) is None and node.mgr._ledger.lookup(a) is node.mgr._ledger.records[id(a)]


def test_draining_a_drop_retires_only_the_record_that_ref_belongs_to():
    import collections
    import weakref
    from types import SimpleNamespace

    class Obj:
        pass

    stale, live_obj = Obj(), Obj()
    live = SimpleNamespace(ref=weakref.KeyedRef(live_obj, None, 7), state=State.RELEASED)
    from lifecycle.ledger import Ledger

    ledger = Ledger(table.Owners(), None)
    ledger.dropped.extend([weakref.KeyedRef(stale, None, 7), weakref.KeyedRef(stale, None, 8)])
    ledger.records[7] = live
    ledger.by_state["RELEASED"] = 1
    assert ledger.drain_dropped() == []            # key 7: another request's record; key 8: none left
    assert ledger.records == {7: live} and not ledger.dropped and ledger.leaked == 0


def test_a_record_left_under_a_reused_id_is_retired_as_leaked_when_the_new_request_is_seen():
    node = Node(page_size=4, manager_cls=CopyableManager)
    a, b = Req("a", range(4), row=0), Req("b", range(4), row=1)
    import weakref

    import msgspec

    node.mgr.offload_kv_cache(a)                         # PREFILLED, never released
    old = node.mgr._ledger.records.pop(id(a))                   # as if a was dropped and b took its id:
    node.mgr._ledger.records[id(b)] = msgspec.structs.replace(old, ref=weakref.KeyedRef(a, None, id(b)))
    node.mgr.offload_kv_cache(b)
    s = node.mgr.stats()
    assert s.leaked == 1 and node.mgr.state_of(b) is State.PREFILLED
    assert node.mgr._ledger.by_state["PREFILLED"] == 1 and len(node.mgr._ledger.records) == 1


class Owner:
    """A manager stand-in for the registries: weak-referenceable, open or closed."""

    def __init__(self, closed=False):
        self.closed = closed


class Offloader:
    pass


class Slotted:
    __slots__ = ()                                       # not weak-referenceable


def test_an_offloader_claim_is_forgotten_when_the_offloader_is_gone():
    import gc

    offs = table.Offloaders()
    off, mgr = Offloader(), Owner()
    offs.claim(off, mgr)
    assert list(offs._by_id) == [id(off)]
    del off
    gc.collect()
    assert offs._by_id == {}


def test_a_stale_forget_leaves_a_newer_offloader_claim():
    offs = table.Offloaders()
    off, mgr = Offloader(), Owner()
    offs.claim(off, mgr)
    offs._forget(id(off), object())                      # another (older) reference's callback
    offs._forget(12345, object())                        # nothing under that key
    assert list(offs._by_id) == [id(off)]


@pytest.mark.parametrize("make", [Offloader, Slotted], ids=["weakref", "not-weakref"])
def test_a_second_open_manager_over_one_offloader_is_refused(make):
    offs = table.Offloaders()
    off, first, second = make(), Owner(), Owner()
    offs.claim(off, first)
    offs.claim(off, first)                               # the same manager again: fine
    with pytest.raises(ConfigError) as err:
        offs.claim(off, second)
    assert str(err.value) == ("this offloader already serves another DecodeOffloadManager; give each manager "
                              "its own (their ack ids and completions would mix)")
    first.closed = True
    offs.claim(off, second)                              # the first one closed: taken over


def test_an_ownership_claim_needs_a_keyed_reference_to_that_request_under_its_id():
    import weakref

    owners = table.Owners()
    req, other = Req("r", range(4), row=0), Req("o", range(4), row=1)
    msg = "a claim's reference must be a KeyedRef to the request, keyed by its id"
    for ref in (weakref.KeyedRef(req, None, id(other)), weakref.KeyedRef(other, None, id(req))):
        with pytest.raises(ValueError) as err:
            owners.claim(req, Owner(), ref)
        assert str(err.value) == msg
    mgr = Owner()
    owners.claim(req, mgr, weakref.KeyedRef(req, None, id(req)))
    assert owners.owner(req) is mgr


def test_forgetting_an_old_ownership_claim_keeps_the_newer_one():
    import weakref

    owners = table.Owners()
    req, mgr = Req("r", range(4), row=0), Owner()
    old, new = weakref.KeyedRef(req, None, id(req)), weakref.KeyedRef(req, None, id(req))
    owners.claim(req, Owner(), old)
    owners.claim(req, mgr, new)
    owners.forget(old)                                   # the old claim's callback, late
    owners.forget(weakref.KeyedRef(Owner(), None, 424242))   # no claim under that key
    assert owners.owner(req) is mgr
    owners.forget(new)
    assert owners.owner(req) is None
