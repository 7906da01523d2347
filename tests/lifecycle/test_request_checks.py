"""What the manager reads from a request, checked at the edges (each case a mutant that survived).

Rows: negative or one past the pool; KV fields missing; bad tokens named by request and position
(prompt and output); the extreme valid token id; a namespace seed under a non-empty prefill; and
chunk slot ids that must not alias the row (an int64 ``req_to_token`` recycled while a stuck copy
is quarantined).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hashing import page_hashes
from lifecycle import InvalidRequest, InvalidTransition, State
from lifecycle.errors import InvalidToken
from lifecycle.requests import row_of
from lifecycle_tools.testkit.doubles import Req
from tests.support.real_rig import Rig
from transfer import PagedTokenAllocator, ReqToTokenPool
from lifecycle_tools.testkit.memory import InMemoryOffloader

PS = 4


@pytest.mark.parametrize("row,match", [(-2, r"request 'b' has no req_to_token row \(-2\)"),
                                       (4, r"request 'b': row 4 is outside the pool's 4 rows")])
def test_a_row_outside_the_pool_is_refused_by_every_call(row, match):
    rig = Rig(PS)
    req, _ = rig.admit("b", 8, 8)
    req.kv.req_pool_idx = row
    req.finish()
    with pytest.raises(InvalidRequest, match=match):
        rig.mgr.finalize_release_on_finish(req)
    assert rig.mgr.state_of(req) is None


class NotQuiteKV:
    def __init__(self):
        self.req_pool_idx, self.kv_committed_len = 0, 8


class Thing:
    def __init__(self):
        self.rid, self.origin_input_ids, self.output_ids, self.kv = "t", [1] * 8, [2], NotQuiteKV()

    def finished(self):
        return False


def test_a_kv_missing_a_field_is_named_with_the_type():
    with pytest.raises(InvalidRequest, match=r"Thing is not a request: it lacks kv\.kv_allocated_len"):
        Rig(PS).mgr.offload_kv_cache(Thing())


def test_finished_must_be_callable():
    req = Req("nc", range(8), row=0)
    req.finished = True
    with pytest.raises(InvalidRequest, match=r"request 'nc': finished is not callable"):
        Rig(PS).mgr.offload_kv_cache(req)


def test_a_bad_prompt_token_is_named_by_request_and_position_on_first_sight():
    rig = Rig(PS)
    req, _ = rig.admit("p", 8, 12)
    req.origin_input_ids[5] = -3
    with pytest.raises(InvalidToken, match=r"request 'p': token id -3 at position 5 is not an int"):
        rig.mgr.offload_kv_cache(req)
    assert rig.mgr.state_of(req) is None


def test_a_bad_output_token_is_named_by_request_and_position_in_the_chunk():
    rig = Rig(PS)
    req, _ = rig.admit("o", 8, 16)
    rig.decode(req, 2)
    req.output_ids[1] = 2**32                         # request position 9
    with pytest.raises(InvalidToken, match=r"request 'o': token id 4294967296 at position 9 "):
        rig.decode(req, 2)
    assert rig.mgr.progress_of(req).inc_len == 0 and rig.mgr.stats().chunks_enqueued == 0


def test_the_largest_token_id_is_valid_everywhere():
    rig = Rig(PS)
    req, _ = rig.admit("m", 8, 16)
    req.origin_input_ids[3] = 2**32 - 1
    req.output_ids[0] = 2**32 - 1
    rig.decode(req, 4)
    full = req.origin_input_ids + req.output_ids
    assert rig.mgr.progress_of(req).last_hash == page_hashes(full[:12], PS)[-1]


def test_a_namespace_seed_starts_the_chain_under_a_prefill():
    seed = "cd" * 32
    rig = Rig(PS, namespace_seed=seed)
    req, _ = rig.admit("n", 10, 16)                  # P = 8: two prefill pages chained from the seed
    assert rig.mgr.offload_kv_cache(req) is False
    assert rig.mgr.progress_of(req).last_hash == page_hashes(req.origin_input_ids[:8], PS, seed)[-1]


def test_quarantined_slots_are_the_copys_even_when_the_row_is_int64_and_recycled():
    """A stuck copy's slots are remembered by value: recycling an int64 row (no dtype conversion,
    so a view would alias it) must not change which slots come back when the copy ends."""
    alloc, pool = PagedTokenAllocator(4 * 64, PS), ReqToTokenPool(4, 64)
    pool.req_to_token = pool.req_to_token.to(torch.int64)
    rig = Rig(PS, pool=pool, alloc=alloc)
    req, slots = rig.admit("q", 8, 16)
    row = req.kv.req_pool_idx
    rig.decode(req, 4)                                # ack 1 reads positions 8..11
    rig.off.expire([1])
    req.finish()
    rig.mgr.finalize_release_on_finish(req)
    rig.progress()                                    # released around the quarantined slots
    assert rig.mgr.state_of(req) is State.RELEASED
    again = pool.alloc()
    assert again == row
    theirs = alloc.alloc(16)
    pool.req_to_token[row, :16] = theirs              # the next request writes the row in place
    before = alloc.available_size()
    rig.off.land([1])
    rig.progress()                                    # the stuck copy ends: its own 4 slots return
    assert alloc.available_size() == before + 4
    alloc.free(theirs)                                # the new owner's slots were never freed
    alloc.check_integrity()


def test_a_request_another_manager_holds_is_refused_without_touching_it():
    a, b = Rig(PS), Rig(PS)
    req, _ = a.admit("shared", 8, 16)
    a.decode(req, 1)
    with pytest.raises(InvalidRequest, match="another manager"):
        b.mgr.offload_kv_cache(req)
    req.finish()
    a.mgr.finalize_release_on_finish(req)
    assert a.mgr.state_of(req) is State.RELEASED and b.mgr.state_of(req) is None
    with pytest.raises(InvalidTransition):
        a.mgr.offload_kv_cache(req)


class StoringOffloader(InMemoryOffloader):
    """Keeps what each storage write was given: tokens, page hashes and the parent page."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.writes_seen = []

    def write_storage(self, host_indices, tokens, page_hashes, parent_hash=None):
        self.writes_seen.append((list(tokens), list(page_hashes), parent_hash))
        return super().write_storage(host_indices, tokens, page_hashes)


def storing_rig(**kw):
    return Rig(PS, offloader=StoringOffloader(page_size=PS, host_pages=64, auto_land=True), **kw)


def test_output_ids_in_a_tuple_are_offloaded_as_their_tokens():
    rig = storing_rig()
    req, _ = rig.admit("t", 8, 16, outputs=(7000,))
    req.output_ids = tuple(7000 + i for i in range(5))
    req.kv.kv_committed_len = req.kv.kv_allocated_len = 12
    assert rig.mgr.offload_kv_cache(req)
    rig.progress()
    prior = page_hashes(list(range(1000, 1008)), PS, rig.mgr.namespace_seed)[-1]
    ((tokens, names, _),) = rig.off.writes_seen
    assert tokens == [7000, 7001, 7002, 7003] and names == page_hashes(tokens, PS, prior)


def test_numpy_integer_tokens_continue_the_requests_hash_chain():
    import numpy as np

    rig = storing_rig()
    req, _ = rig.admit("n", 8, 16, outputs=(7000,))
    for t in range(7001, 7005):
        req.decode(np.int64(t))
        rig.mgr.offload_kv_cache(req)
    rig.progress()
    prior = page_hashes(list(range(1000, 1008)), PS, rig.mgr.namespace_seed)[-1]
    ((tokens, names, _),) = rig.off.writes_seen
    assert tokens == [7000, 7001, 7002, 7003] and names == page_hashes(tokens, PS, prior)


@pytest.mark.parametrize("seed", [None, "5e" * 32])
def test_each_stored_chunk_names_the_page_before_it_and_a_first_page_none(seed):
    """A namespace seed is the chain's prior, not a page: the first page's parent is None."""
    rig = storing_rig(namespace_seed=seed)
    short, _ = rig.admit("s", 3, 16, outputs=(7000,))   # no prompt page: the chain starts at the seed
    rig.decode(short, 8)                                 # two chunks: [0, 4) and [4, 8)
    rig.progress()
    long, _ = rig.admit("l", 8, 16, outputs=(7000,))    # a prompt page before the first chunk
    rig.decode(long, 4)
    rig.progress()
    (t1, n1, p1), (t2, n2, p2), (t3, n3, p3) = rig.off.writes_seen
    assert p1 is None and n1 == page_hashes(t1, PS, rig.mgr.namespace_seed)
    assert p2 == n1[-1] and n2 == page_hashes(t2, PS, n1[-1])
    prompt_tail = page_hashes(list(range(1000, 1008)), PS, rig.mgr.namespace_seed)[-1]
    assert p3 == prompt_tail and n3 == page_hashes(t3, PS, prompt_tail)


@pytest.mark.parametrize("field, words", [("kv_committed_len", "committed"), ("kv_allocated_len", "allocated")])
def test_a_tracked_request_whose_kv_length_is_not_an_int_is_refused_by_name(field, words):
    import numpy as np

    rig = Rig(PS)
    req, _ = rig.admit("k", 8, 16)
    assert rig.decode(req, 3) == [False] * 3            # tracked, no chunk due yet
    req.decode(7004)                                    # a chunk due: the request is read
    value = getattr(req.kv, field)
    setattr(req.kv, field, np.int64(value))             # an int-like, not an int
    with pytest.raises(InvalidRequest, match=rf"request 'k': kv {words} length np\.int64\({value}\) is not a non-negative int"):
        rig.mgr.offload_kv_cache(req)
    setattr(req.kv, field, value)
    assert rig.mgr.offload_kv_cache(req)                # repaired: works


def test_a_non_callable_effective_length_attribute_is_ignored():
    rig = Rig(PS)
    req, _ = rig.admit("e", 8, 16)
    rig.decode(req, 1)
    req.effective_kv_committed_len = 3                  # an attribute, not SGLang's method
    assert rig.decode(req, 3, first=7002) == [False, False, True]   # kv_committed_len counts
    assert rig.mgr.progress_of(req).inc_len == 4


def test_a_request_allocated_to_the_full_row_width_is_accepted():
    rig = Rig(PS, width=16)
    req, _ = rig.admit("w", 8, 16)
    assert rig.decode(req, 3) == [False] * 3
    req.decode(7004)                                    # a chunk due: the request is read
    req.kv.kv_allocated_len = 17
    with pytest.raises(InvalidRequest, match=r"request 'w': allocated 17 exceeds the row width 16"):
        rig.mgr.offload_kv_cache(req)
    req.kv.kv_allocated_len = 16                        # speculative slots up to the row's end
    assert rig.mgr.offload_kv_cache(req)


def test_a_request_first_seen_allocated_to_the_full_row_width_is_accepted():
    rig = Rig(PS, width=16)
    req, _ = rig.admit("f", 8, 16, outputs=tuple(range(7000, 7005)))
    req.kv.kv_allocated_len = 16                        # committed 12, speculative slots to the row's end
    assert rig.mgr.offload_kv_cache(req) and rig.mgr.progress_of(req).inc_len == 4


@pytest.mark.parametrize("thing, shown", [
    (object(), "request None has no req_to_token row (None)"),                        # no kv, no rid
    (SimpleNamespace(rid="a", kv=SimpleNamespace()), "request 'a' has no req_to_token row (None)"),
    (SimpleNamespace(kv=SimpleNamespace(req_pool_idx=-1)), "request None has no req_to_token row (-1)"),
    (SimpleNamespace(rid="b", kv=SimpleNamespace(req_pool_idx=True)), "request 'b' has no req_to_token row (True)"),
])
def test_row_of_refuses_whatever_lacks_an_int_row_with_invalid_request(thing, shown):
    """``row_of`` is the one reading of a row: anything without an int row, even without a ``kv``
    or a ``rid``, is an InvalidRequest naming what it found, never an AttributeError."""
    with pytest.raises(InvalidRequest) as exc:
        row_of(4, thing)
    assert str(exc.value) == shown
    assert row_of(4, SimpleNamespace(rid="c", kv=SimpleNamespace(req_pool_idx=3))) == 3
