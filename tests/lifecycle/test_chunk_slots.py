"""A chunk's slot ids are checked the way a release's are: one check (``lifecycle.slots``) for both.

docs/states.md and the manager promise that a refused call changes nothing and that the KV stored
under a page's hash is that page's KV. A ``req_to_token`` row that lists, for a chunk, a slot never
written (-1), one device slot twice, a slot the allocator does not hold, or a slot a copy in flight
reads (another request's, or this request's at another position) would store the wrong KV under a
valid hash. Every entry point that builds a chunk refuses such a row with ``InvalidSlots`` (a
``LifecycleError``), leaves no record on first sight, enqueues nothing, and works once the row is
repaired: first sight, later chunks, the finishing request's last chunk, a TP manager, the SGLang
drop-in. The release plan refuses a slot another request's copy still reads, through the same check.
"""

from __future__ import annotations

import pytest
import torch

from lifecycle import InvalidRequest, LifecycleError, State
from lifecycle.errors import InvalidSlots
from tests.support.ranks import world  # noqa: F401 (fixture)
from tests.support.real_rig import Rig

PS = 4


def frozen(rig):
    """Everything a refused call must leave as it was."""
    s = rig.mgr.stats()
    return (s, rig.mgr.snapshot(), rig.off.writes, rig.off.host_free_pages(), rig.alloc.available_size(),
            rig.mgr._ledger.reading.total())


def first_sight(rig, rid="a", prompt=8, room=16, outputs=5):
    """A request seen for the first time with ``outputs - 1`` decode tokens of KV (one chunk due)."""
    req, slots = rig.admit(rid, prompt, room, outputs=tuple(7000 + i for i in range(outputs)))
    req.kv.kv_committed_len = req.kv.kv_allocated_len = prompt + outputs - 1
    return req, slots


@pytest.mark.parametrize("bad", ["minus_one", "repeated", "unallocated", "out_of_range"])
def test_first_sight_refuses_a_bad_chunk_row_and_leaves_no_record(bad):
    rig = Rig(PS)
    req, slots = first_sight(rig)
    row = req.kv.req_pool_idx
    table = rig.pool.req_to_token
    good = table[row, 8:12].clone()
    if bad == "minus_one":
        table[row, 10] = -1
        match = r"request 'a': row \d+ lists slot -1 at a position to offload \(ranges \[\(8, 12\)\]\)"
    elif bad == "repeated":
        table[row, 10] = table[row, 9]
        match = r"lists 1 slot ids more than once in \[\(8, 12\)\]"
    elif bad == "unallocated":
        spare = rig.alloc.alloc(PS)
        rig.alloc.free(spare)                            # a page nobody holds
        table[row, 8:12] = spare.to(table.dtype)
        match = r"lists slots the allocator does not hold at positions to offload \(ranges \[\(8, 12\)\]\)"
    else:
        table[row, 8:12] = torch.arange(10**6, 10**6 + 4, dtype=table.dtype)
        match = r"lists slots the allocator does not hold"
    before = frozen(rig)
    with pytest.raises(InvalidSlots, match=match) as err:
        rig.mgr.offload_kv_cache(req)
    assert isinstance(err.value, LifecycleError) and isinstance(err.value, InvalidRequest)
    assert rig.mgr.state_of(req) is None and frozen(rig) == before
    table[row, 8:12] = good                              # repaired: the same call now works
    assert rig.mgr.offload_kv_cache(req) is True
    assert rig.mgr.state_of(req) is State.INFLIGHT and rig.off.writes == 1


def test_a_refused_first_sight_is_not_reported_as_a_leak_when_dropped():
    rig = Rig(PS)
    req, _ = first_sight(rig)
    rig.pool.req_to_token[req.kv.req_pool_idx, 9] = -1
    with pytest.raises(InvalidSlots):
        rig.mgr.offload_kv_cache(req)
    del req
    rig.progress()
    assert (rig.mgr.stats().leaked, rig.mgr.stats().tracked) == (0, 0)


def test_a_later_chunk_repeating_a_slot_in_itself_is_refused():
    rig = Rig(PS, stride=8)
    req, _ = rig.admit("b", 8, 24)
    row = req.kv.req_pool_idx
    table = rig.pool.req_to_token
    table[row, 12:16] = table[row, 8:12].clone()         # the page of [12, 16) is the page of [8, 12)
    assert rig.decode(req, 7) == [False] * 7
    before = frozen(rig)
    with pytest.raises(InvalidSlots, match=r"row \d+ lists 4 slot ids more than once in \[\(8, 16\)\]"):
        req.decode(9000)
        rig.mgr.offload_kv_cache(req)
    assert frozen(rig) == before and rig.mgr.state_of(req) is State.PREFILLED


def test_a_chunk_listing_a_slot_its_own_earlier_copy_still_reads_is_refused_naming_the_copy():
    rig = Rig(PS)
    req, _ = rig.admit("c", 8, 24)
    row = req.kv.req_pool_idx
    table = rig.pool.req_to_token
    rig.decode(req, 4)                                  # ack 1 reads the slots of [8, 12)
    good = table[row, 12:16].clone()
    table[row, 12:16] = table[row, 8:12].clone()
    rig.decode(req, 3)
    before = frozen(rig)
    with pytest.raises(InvalidSlots, match=r"at a position to offload \(ranges \[\(12, 16\)\]\), which a copy in "
                                           r"flight of request 'c' \(ack 1, tokens \[8, 12\)\) still reads"):
        rig.decode(req, 1)
    assert frozen(rig) == before
    table[row, 12:16] = good
    assert rig.mgr.offload_kv_cache(req) is True


def test_a_chunk_listing_another_live_requests_slot_in_flight_is_refused():
    rig = Rig(PS)
    a, _ = rig.admit("a", 8, 16)
    rig.decode(a, 4)                                    # ack 1: a's [8, 12) in flight
    b, _ = first_sight(rig, "b")
    rig.pool.req_to_token[b.kv.req_pool_idx, 8:12] = rig.pool.req_to_token[a.kv.req_pool_idx, 8:12]
    before = frozen(rig)
    with pytest.raises(InvalidSlots, match=r"request 'b': .* which a copy in flight of request 'a' \(ack 1"):
        rig.mgr.offload_kv_cache(b)
    assert frozen(rig) == before and rig.mgr.state_of(b) is None


def test_a_chunk_listing_a_slot_an_expired_copy_may_still_read_is_refused():
    rig = Rig(PS)
    a, _ = rig.admit("a", 8, 16)
    rig.decode(a, 4)
    rig.off.expire([1])
    rig.progress()                                      # ack 1 expired: its slots quarantined
    b, _ = first_sight(rig, "b")
    rig.pool.req_to_token[b.kv.req_pool_idx, 8:12] = rig.pool.req_to_token[a.kv.req_pool_idx, 8:12]
    with pytest.raises(InvalidSlots, match=r"which an expired copy of request 'a' \(ack 1, slots quarantined\)"):
        rig.mgr.offload_kv_cache(b)
    rig.off.land([1])
    rig.progress()                                      # the expired copy ended: nothing reads them now
    assert rig.mgr._ledger.reading.total() == 0


def test_the_refusal_names_the_copy_that_reads_the_slot_among_copies_whose_spans_overlap():
    """Two copies in flight read interleaved slots (neither a run): the first's span covers slots
    only the second reads. A chunk listing one of those names the second copy, whether the slot is
    inside the second's span or its highest."""
    rig = Rig(PS)
    s = sorted(rig.alloc.alloc(8).tolist())             # held by nobody's row but these chunks
    a, _ = first_sight(rig, "a")
    b, _ = first_sight(rig, "b")
    table = rig.pool.req_to_token
    table[a.kv.req_pool_idx, 8:12] = torch.tensor(s[0::2], dtype=table.dtype)   # ack 1: s0 s2 s4 s6
    table[b.kv.req_pool_idx, 8:12] = torch.tensor(s[1::2], dtype=table.dtype)   # ack 2: s1 s3 s5 s7
    assert rig.mgr.offload_kv_cache(a) is True and rig.mgr.offload_kv_cache(b) is True
    c, _ = first_sight(rig, "c")
    own = table[c.kv.req_pool_idx, 8:12].clone()
    for slot in (s[3], s[7]):                           # inside ack 1's span / ack 2's highest slot
        table[c.kv.req_pool_idx, 8:12] = own
        table[c.kv.req_pool_idx, 9] = slot
        before = frozen(rig)
        with pytest.raises(InvalidSlots, match=rf"request 'c': row \d+ lists slot {slot} at a position to offload "
                                               rf"\(ranges \[\(8, 12\)\]\), which a copy in flight of request "
                                               rf"'b' \(ack 2, tokens \[8, 12\)\) still reads$"):
            rig.mgr.offload_kv_cache(c)
        assert frozen(rig) == before and rig.mgr.state_of(c) is None
    table[c.kv.req_pool_idx, 8:12] = torch.tensor([s[6], *own[1:].tolist()], dtype=table.dtype)
    with pytest.raises(InvalidSlots, match=rf"lists slot {s[6]} .* request 'a' \(ack 1, tokens \[8, 12\)\)"):
        rig.mgr.offload_kv_cache(c)
    table[c.kv.req_pool_idx, 8:12] = own
    assert rig.mgr.offload_kv_cache(c) is True and rig.mgr.copies_of(c) == [3]


def test_once_the_copy_landed_its_slots_are_not_held_any_more():
    rig = Rig(PS)
    req, _ = rig.admit("d", 8, 24)
    rig.decode(req, 4)
    assert rig.mgr._ledger.reading.total() == 4
    rig.off.land()
    rig.progress()
    assert rig.mgr._ledger.reading.total() == 0
    rig.mgr.check_integrity()


def test_the_finishing_requests_last_chunk_is_checked_and_then_finalized():
    rig = Rig(PS)
    req, _ = rig.admit("e", 8, 16)
    rig.decode(req, 3)
    req.decode(7100)
    req.finish()
    row = req.kv.req_pool_idx
    rig.pool.req_to_token[row, 11] = -1
    before = frozen(rig)
    with pytest.raises(InvalidSlots, match=r"lists slot -1 at a position to offload \(ranges \[\(8, 12\)\]\)"):
        rig.mgr.offload_kv_cache(req)                   # the finish path: offload, then finalize if False
    assert frozen(rig) == before
    with pytest.raises(InvalidSlots, match=r"lists slot -1 at a position to free"):
        rig.mgr.finalize_release_on_finish(req)          # the release plan refuses the same row
    assert frozen(rig) == before


def test_a_release_listing_a_slot_another_requests_copy_reads_is_refused_and_frees_nothing():
    rig = Rig(PS)
    a, _ = rig.admit("a", 8, 16)
    rig.decode(a, 4)                                    # ack 1 reads a's [8, 12)
    b, _ = rig.admit("b", 8, 16)
    b.finish()
    rig.pool.req_to_token[b.kv.req_pool_idx, 4:8] = rig.pool.req_to_token[a.kv.req_pool_idx, 8:12]
    before = frozen(rig)
    with pytest.raises(InvalidSlots, match=r"request 'b': .* at a position to free .* which a copy in flight of "
                                           r"request 'a' \(ack 1"):
        rig.mgr.finalize_release_on_finish(b)
    assert frozen(rig) == before and rig.mgr.state_of(b) is None


def test_a_tp_manager_refuses_the_same_rows(world):
    rig = Rig(PS, tp_group=world)
    a, _ = rig.admit("a", 8, 16)
    rig.decode(a, 4)
    b, _ = first_sight(rig, "b")
    rig.pool.req_to_token[b.kv.req_pool_idx, 8:12] = rig.pool.req_to_token[a.kv.req_pool_idx, 8:12]
    before = frozen(rig)
    with pytest.raises(InvalidSlots, match="which a copy in flight of request 'a'"):
        rig.mgr.offload_kv_cache(b)
    assert frozen(rig) == before and rig.mgr.state_of(b) is None
    rig.pool.req_to_token[a.kv.req_pool_idx, 13] = -1    # a later chunk of a
    with pytest.raises(InvalidSlots, match="lists slot -1"):
        rig.decode(a, 4)


@pytest.mark.parametrize("bad", ["repeated", "swapped", "minus_one", "good"])
def test_a_chunk_longer_than_the_byte_compare_path_is_checked_the_same_way(bad):
    """A chunk of 304 slot ids (more than ``lifecycle.slots._SMALL``) goes through the NumPy path
    of the check: the same refusals, and a good row counts every slot read exactly once."""
    rig = Rig(PS, stride=304, rows=2, width=512)
    req, _ = rig.admit("long", 8, 320, outputs=tuple(7000 + i for i in range(305)))
    req.kv.kv_committed_len = req.kv.kv_allocated_len = 312
    row = req.kv.req_pool_idx
    table = rig.pool.req_to_token
    if bad == "repeated":
        table[row, 150] = table[row, 40]
    elif bad == "swapped":                               # distinct, but not ascending: sorted, then checked
        table[row, [40, 41]] = table[row, [41, 40]]
    elif bad == "minus_one":
        table[row, 311] = -1
    before = frozen(rig)
    if bad in ("repeated", "minus_one"):
        with pytest.raises(InvalidSlots, match=r"request 'long': row \d+ lists"):
            rig.mgr.offload_kv_cache(req)
        assert frozen(rig) == before and rig.mgr.state_of(req) is None
        return
    assert rig.mgr.offload_kv_cache(req) is True
    assert rig.mgr._ledger.reading.total() == 304
    rig.off.land()
    rig.progress()
    assert rig.mgr._ledger.reading.total() == 0


def test_slot_counts_stay_exact_when_copies_overlap_outside_the_check():
    """Copies counted without a plan (``add`` deriving the ids) may overlap: the counts are kept per
    copy, so the slots stay read until the last of them ends, for a run and for scattered ids."""
    from lifecycle.slots import SlotsInFlight

    reading = SlotsInFlight()
    run = torch.arange(2000, 2016, dtype=torch.int64)       # beyond the initial table: it grows
    scattered = torch.tensor([5, 9, 2003], dtype=torch.int64)
    reading.add(1, run)
    reading.add(2, run)
    reading.add(3, scattered)
    ids = run.numpy()
    assert reading.total() == 35 and reading.read(ids, 2000, 2015, True) is not None
    reading.remove(1)
    assert reading.total() == 19
    assert reading.read(ids, 2000, 2015, True).tolist() == ids.tolist()   # copy 2 still reads them
    reading.remove(2)
    assert reading.read(ids, 2000, 2015, True).tolist() == [2003]         # copy 3's slot only
    assert reading.reader(2003) == 3 and reading.reader(2004) is None
    reading.remove(3)
    reading.remove(3)                                                     # a second end changes nothing
    assert reading.total() == 0 and reading.read(ids, 2000, 2015, True) is None


def test_a_one_slot_chunk_is_checked_like_any_other():
    """Page size 1: each chunk is one slot id, and that one id is checked too."""
    rig = Rig(1)
    a, _ = rig.admit("a", 4, 8, outputs=(7000, 7001))     # KV for 5 tokens: chunk [4, 5) due
    table = rig.pool.req_to_token
    good = int(table[a.kv.req_pool_idx, 4])
    table[a.kv.req_pool_idx, 4] = -1
    before = frozen(rig)
    with pytest.raises(InvalidSlots, match=r"request 'a': row \d+ lists slot -1 at a position to offload "
                                           r"\(ranges \[\(4, 5\)\]\): KV never allocated there"):
        rig.mgr.offload_kv_cache(a)
    assert frozen(rig) == before and rig.mgr.state_of(a) is None
    table[a.kv.req_pool_idx, 4] = good
    assert rig.mgr.offload_kv_cache(a) is True and rig.mgr._ledger.reading.total() == 1
    b, _ = rig.admit("b", 4, 8, outputs=(7000, 7001))
    table[b.kv.req_pool_idx, 4] = good                    # the slot a's copy reads
    with pytest.raises(InvalidSlots, match=rf"lists slot {good} .* which a copy in flight of request 'a' \(ack 1"):
        rig.mgr.offload_kv_cache(b)
    assert rig.mgr.state_of(b) is None


@pytest.mark.parametrize("bad", ["repeated", "minus_one_last", "descending"])
def test_a_two_slot_chunk_is_checked_like_any_other(bad):
    """Page size 2: a chunk of two slot ids, not in order, repeated or with a -1 in second place."""
    rig = Rig(2)
    req, _ = rig.admit("t", 4, 8, outputs=(7000, 7001, 7002))   # KV for 6 tokens: chunk [4, 6) due
    table, row = rig.pool.req_to_token, req.kv.req_pool_idx
    first, second = int(table[row, 4]), int(table[row, 5])
    before = frozen(rig)
    if bad == "repeated":
        table[row, 5] = first
        with pytest.raises(InvalidSlots, match=r"row \d+ lists 1 slot ids more than once in \[\(4, 6\)\]"):
            rig.mgr.offload_kv_cache(req)
    elif bad == "minus_one_last":
        table[row, 5] = -1
        with pytest.raises(InvalidSlots, match=r"row \d+ lists slot -1 at a position to offload \(ranges \[\(4, 6\)\]\)"):
            rig.mgr.offload_kv_cache(req)
    if bad != "descending":
        assert frozen(rig) == before and rig.mgr.state_of(req) is None
        return
    table[row, 4], table[row, 5] = second, first          # both still the request's: accepted
    assert rig.mgr.offload_kv_cache(req) is True and rig.mgr._ledger.reading.total() == 2
    other, _ = rig.admit("o", 4, 8, outputs=(7000, 7001, 7002))
    for slot in (first, second):
        table[other.kv.req_pool_idx, 4] = slot
        with pytest.raises(InvalidSlots, match=rf"lists slot {slot} .* which a copy in flight of request 't' "
                                               rf"\(ack 1, tokens \[4, 6\)\) still reads$"):
            rig.mgr.offload_kv_cache(other)


def test_a_chunk_listing_a_device_page_another_live_request_holds_under_another_name_is_refused():
    """Request a's chunk landed (nothing reads its slots now) and a still decodes; b's row lists a's
    page for b's own chunk, whose tokens differ: storing it would put a's KV under b's page name.
    Refused with ``InvalidSlots`` naming both names, nothing changed; once a is released the page is
    nobody's and b's chunk (its row repaired or not) goes through."""
    rig = Rig(PS)
    a, _ = rig.admit("a", 8, 16)
    rig.decode(a, 4)
    rig.off.land()
    rig.progress()                                      # a's [8, 12) landed: no copy reads it, a is live
    b, _ = first_sight(rig, "b")
    b.origin_input_ids[0] = 999                         # another prompt: another chain, other page names
    row_b = b.kv.req_pool_idx
    own = rig.pool.req_to_token[row_b, 8:12].clone()
    rig.pool.req_to_token[row_b, 8:12] = rig.pool.req_to_token[a.kv.req_pool_idx, 8:12]
    before = frozen(rig)
    with pytest.raises(InvalidSlots, match=r"request 'b': row \d+ lists slot \d+ at a position to offload "
                                           r"\(ranges \[\(8, 12\)\]\), on a device page request 'a' holds under "
                                           r"another page name \([0-9a-f]{64} there, [0-9a-f]{64} here\)"):
        rig.mgr.offload_kv_cache(b)
    assert frozen(rig) == before and rig.mgr.state_of(b) is None
    rig.pool.req_to_token[row_b, 8:12] = own
    assert rig.mgr.offload_kv_cache(b) is True


def test_a_device_page_shared_under_the_same_name_stays_allowed():
    """A prefix page shared through SGLang's radix cache is one device page under one name in both
    requests: b (same tokens, so the same chain) listing a's landed page for the same positions is
    allowed while a is live."""
    rig = Rig(PS)
    a, _ = rig.admit("a", 8, 16)
    rig.decode(a, 4)
    rig.off.land()
    rig.progress()
    b, _ = first_sight(rig, "b")                        # the same prompt and outputs as a: the same names
    rig.pool.req_to_token[b.kv.req_pool_idx, 8:12] = rig.pool.req_to_token[a.kv.req_pool_idx, 8:12]
    assert rig.mgr.offload_kv_cache(b) is True
    assert rig.mgr.progress_of(b).last_hash == rig.mgr.progress_of(a).last_hash


def test_a_released_requests_pages_are_nobodys():
    """The check follows live lifecycles only: after a's release the device page it held under its
    name may be listed under another (the allocator hands pages out again)."""
    rig = Rig(PS)
    a, _ = rig.admit("a", 8, 16)
    rig.decode(a, 4)
    rig.off.land()
    rig.progress()
    b, _ = first_sight(rig, "b")
    b.origin_input_ids[0] = 999
    rig.pool.req_to_token[b.kv.req_pool_idx, 8:12] = rig.pool.req_to_token[a.kv.req_pool_idx, 8:12]
    with pytest.raises(InvalidSlots, match="holds under another page name"):
        rig.mgr.offload_kv_cache(b)
    a.finish()
    rig.mgr.finalize_release_on_finish(a)
    assert rig.mgr.state_of(a) is State.RELEASED
    rig.alloc.alloc(rig.alloc.available_size())         # as if the freed pages were handed out again
    assert rig.mgr.offload_kv_cache(b) is True
