"""What the manager reads from a request, checked at the edges (each case a mutant that survived).

Rows: negative or one past the pool; KV fields missing; bad tokens named by request and position
(prompt and output); the extreme valid token id; a namespace seed under a non-empty prefill; and
chunk slot ids that must not alias the row (an int64 ``req_to_token`` recycled while a stuck copy
is quarantined).
"""

from __future__ import annotations

import pytest
import torch

from hashing import page_hashes
from lifecycle import InvalidRequest, InvalidTransition, State
from lifecycle.errors import InvalidToken
from lifecycle_tools.testkit.doubles import Req
from tests.support.real_rig import Rig
from transfer import PagedTokenAllocator, ReqToTokenPool

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
