"""Narrated scenarios: each rule of the lifecycle, asserting the whole state after each event."""

from transfer.offloader import WriteReport
import gc

import msgspec
import pytest
import torch

from hashing import page_hashes
from lifecycle import (
    ConfigError,
    DecodeOffloadManager,
    InvalidRequest,
    InvalidTransition,
    LifecycleError,
    ManagerClosed,
    State,
    UnknownCompletion,
)
from lifecycle import machine
from lifecycle.records import RecordView
from tests.conftest import Node
from lifecycle_tools.testkit.doubles import CountingReq, DoubleFree, EffectiveReq, Req
from lifecycle_tools.testkit.memory import InMemoryOffloader

P, O, I, F, R = State.PREFILLED, State.OFFLOADING, State.INFLIGHT, State.FINISHED, State.RELEASED


def view(node, req):
    """The whole observable state of one request and the node."""
    s = node.mgr.stats()
    prog = node.mgr.progress_of(req)
    return dict(
        state=node.mgr.state_of(req),
        inc_len=None if prog is None else prog.inc_len,
        inflight=s.inflight_writes,
        storage=s.inflight_storage,
        freed_pages=list(node.alloc.freed_pages),
        freed_rows=list(node.pool.freed_rows),
        released=s.released,
        leaked=s.leaked,
    )


def decode(node, req, n, first=100):
    """n decode steps, offloading after each; returns the offload results."""
    results = []
    for i in range(n):
        req.decode(first + i)
        results.append(node.mgr.offload_kv_cache(req))
    return results


# --- release ranges (SGLang 0.5.19 release unit scenarios) ------------------------------------


@pytest.mark.parametrize(
    "page,committed,allocated,expected_calls",
    [
        (1, 20, 20, [(0, 20)]),                    # no over-allocation
        (1, 20, 28, [(0, 20), (20, 28)]),          # spec-v2 over-allocation, page 1
        (4, 10, 28, [(0, 10), (12, 28)]),          # partial page covered by committed range
        (4, 10, 12, [(0, 10)]),                    # over-allocation inside the committed page: none
        (4, 12, 20, [(0, 12), (12, 20)]),          # aligned boundary released once
        (4, 0, 8, [(0, 8)]),                       # nothing committed: only the reservation
    ],
)
def test_release_ranges_free_every_slot_exactly_once(page, committed, allocated, expected_calls):
    node = Node(page_size=page)
    req = Req("r", range(committed), row=1, outputs=(), finished=True)
    req.kv.kv_committed_len, req.kv.kv_allocated_len = committed, allocated
    node.mgr._release_finished_req(req)
    base = 1 * node.pool.width
    # one allocator call (a page shared by the two ranges is freed once), holding exactly the ranges
    assert len(node.alloc.calls) == 1
    wanted = sorted(base + i for start, end in expected_calls for i in range(start, end))
    assert node.alloc.calls[0].tolist() == wanted
    pages = node.alloc.freed_pages
    assert len(pages) == len(set(pages))
    covered = set(range(base // page, (base + -(-allocated // page) * page) // page))
    assert set(pages) == covered
    assert node.pool.freed_rows == [1]
    assert node.mgr.state_of(req) is R


def test_effective_committed_length_wins():
    node = Node(page_size=1)
    req = EffectiveReq("r", range(10), row=0, outputs=(), finished=True, effective=6)
    req.kv.kv_allocated_len = 6
    node.mgr._release_finished_req(req)
    assert node.alloc.slots_freed() == list(range(6))


def test_finalize_never_seen_request_releases_at_once():
    node = Node(page_size=4)
    req = Req("r", range(10), row=0, outputs=(7,))
    assert view(node, req)["state"] is None
    node.mgr.finalize_release_on_finish(req)
    assert view(node, req) == dict(
        state=R, inc_len=0, inflight=0, storage=0, freed_pages=[0, 1, 2], freed_rows=[0], released=1, leaked=0
    )


# --- incremental offload -----------------------------------------------------------------------


def test_prefill_then_incremental_chunks_on_the_reference_chain():
    node = Node(page_size=4)
    req = Req("r", range(10), row=0)              # P = 8; tokens 8, 9 + outputs are decode-side
    assert node.mgr.offload_kv_cache(req) is False  # KV for 10 tokens: 2 past P, no full chunk
    assert view(node, req)["state"] is P
    assert node.mgr.progress_of(req).last_hash == page_hashes(list(range(8)), 4)[-1]

    assert decode(node, req, 3) == [False, True, False]  # 12 tokens with KV after the 2nd step
    assert view(node, req) == dict(
        state=I, inc_len=4, inflight=1, storage=0, freed_pages=[], freed_rows=[], released=0, leaked=0
    )
    assert decode(node, req, 4) == [False, False, True, False]
    assert view(node, req)["inc_len"] == 8 and view(node, req)["inflight"] == 2

    node.off.land([2, 1])                           # out of submission order
    node.mgr.check_offload_progress()
    assert view(node, req) == dict(
        state=P, inc_len=8, inflight=0, storage=2, freed_pages=[], freed_rows=[], released=0, leaked=0
    )
    node.store_all()
    assert view(node, req)["storage"] == 0
    full = req.origin_input_ids + req.output_ids[:-1]
    assert sorted(node.off.stored) == sorted(page_hashes(full, 4)[2:4])


def test_last_sampled_token_is_never_offloaded():
    node = Node(page_size=4)
    req = Req("r", range(8), row=0, outputs=(50, 51, 52, 53))  # 11 tokens with KV
    assert node.mgr.offload_kv_cache(req) is False
    req.decode(54)                                                # now 12: outputs 50..53 have KV
    assert node.mgr.offload_kv_cache(req) is True
    chunk = next(iter(node.mgr._ledger.ongoing.values()))
    assert chunk.tokens == (50, 51, 52, 53) and 54 not in chunk.tokens


def test_stride_is_a_page_multiple_and_chunks_are_stride_sized():
    node = Node(page_size=4, stride=8)
    req = Req("r", range(8), row=0)
    assert decode(node, req, 8) == [False] * 7 + [True]
    chunk = next(iter(node.mgr._ledger.ongoing.values()))
    assert (chunk.start, chunk.end, len(chunk.page_hashes)) == (8, 16, 2)


def test_namespace_seed_is_the_first_pages_prior():
    seed = "ab" * 32
    node = Node(page_size=4, seed=seed)
    req = Req("r", range(3), row=0)                 # P = 0: the first decode page starts the chain
    decode(node, req, 2)
    chunk = next(iter(node.mgr._ledger.ongoing.values()))
    assert chunk.page_hashes == tuple(page_hashes([0, 1, 2, 9000], 4, seed))


def test_hashes_fixed_at_enqueue_even_when_copies_land_out_of_order():
    node = Node(page_size=2)
    req = Req("r", range(2), row=0)
    decode(node, req, 8)
    assert node.mgr.stats().inflight_writes == 4
    node.off.land([4, 2, 3, 1])
    node.mgr.check_offload_progress()
    node.store_all()
    full = req.origin_input_ids + req.output_ids[:-1]
    assert sorted(node.off.stored) == sorted(page_hashes(full, 2)[1:])


def test_host_memory_short_changes_nothing_then_recovers():
    node = Node(page_size=4, host_pages=1)
    req = Req("r", range(4), row=0)
    assert decode(node, req, 5) == [False, False, False, True, False]
    before = view(node, req)
    assert decode(node, req, 4) == [False, False, False, False]   # the 2nd chunk finds no host page
    after = view(node, req)
    assert after == before and node.mgr.stats().host_short == 2   # tried at each of the last 2 steps
    assert node.mgr.state_of(req) is I                            # back to where it was
    node.land_all()
    node.store_all()                                               # frees the host page
    assert node.mgr.offload_kv_cache(req) is True
    assert view(node, req)["inc_len"] == 8


def test_host_short_from_prefilled_returns_to_prefilled():
    node = Node(page_size=4, host_pages=0)
    req = Req("r", range(4), row=0)
    assert decode(node, req, 4) == [False] * 4
    assert node.mgr.state_of(req) is P and node.mgr.progress_of(req).inc_len == 0
    node.mgr.check_integrity()


# --- deferred release -----------------------------------------------------------------------------


def test_finish_with_copies_in_flight_defers_release_until_every_chunk_lands():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0)
    decode(node, req, 8)                                   # two chunks in flight: acks 1, 2
    req.finish()
    assert node.mgr.offload_kv_cache(req) is False
    node.mgr.finalize_release_on_finish(req)
    assert view(node, req) == dict(
        state=F, inc_len=8, inflight=2, storage=0, freed_pages=[], freed_rows=[], released=0, leaked=0
    )
    node.off.land([2])
    node.mgr.check_offload_progress()
    assert view(node, req)["state"] is F and view(node, req)["freed_pages"] == []
    node.off.land([1])
    node.mgr.check_offload_progress()
    assert view(node, req) == dict(
        state=R, inc_len=8, inflight=0, storage=2, freed_pages=[0, 1, 2], freed_rows=[0], released=1, leaked=0
    )


def test_offload_at_finish_then_release_when_copy_lands_without_finalize():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0)
    decode(node, req, 3)
    req.finish()
    req.decode(103)                                 # the finishing step fills the page
    assert node.mgr.offload_kv_cache(req) is True   # the scheduler then does not finalize
    assert node.mgr.state_of(req) is I
    node.land_all()
    assert node.mgr.state_of(req) is R and node.pool.freed_rows == [0]


# --- refusals change nothing ----------------------------------------------------------------------


def frozen(node, req):
    return (view(node, req), node.mgr.snapshot(), sorted(node.mgr._ledger.ongoing), node.off.host_free_pages())


def test_release_while_copy_in_flight_is_refused():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0)
    decode(node, req, 4)
    req.finish()
    before = frozen(node, req)
    with pytest.raises(InvalidTransition, match=r"'r'.*'release'.*INFLIGHT.*1 copies still in flight") as exc:
        node.mgr._release_finished_req(req)
    assert (exc.value.rid, exc.value.trigger, exc.value.state) == ("r", "release", "INFLIGHT")
    assert frozen(node, req) == before


def test_release_of_unfinished_request_is_refused_and_creates_no_record():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0)
    with pytest.raises(InvalidTransition, match="UNSEEN.*neither finished nor finalized"):
        node.mgr._release_finished_req(req)
    assert node.mgr.state_of(req) is None and node.mgr.stats().tracked == 0
    node.mgr.offload_kv_cache(req)
    before = frozen(node, req)
    with pytest.raises(InvalidTransition, match="PREFILLED.*neither finished nor finalized"):
        node.mgr._release_finished_req(req)
    assert frozen(node, req) == before


def test_second_release_and_offload_after_release_are_refused():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0, finished=True)
    node.mgr.finalize_release_on_finish(req)
    before = frozen(node, req)
    for call in (node.mgr._release_finished_req, node.mgr.offload_kv_cache, node.mgr.finalize_release_on_finish):
        with pytest.raises(InvalidTransition, match="RELEASED"):
            call(req)
        assert frozen(node, req) == before
    assert node.pool.freed_rows == [0]


def test_offload_after_finalize_is_refused():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0)
    decode(node, req, 4)
    node.mgr.finalize_release_on_finish(req)            # retracted: deferred, still FINISHED
    before = frozen(node, req)
    req.decode(1)
    with pytest.raises(InvalidTransition, match="'offload' in state FINISHED"):
        node.mgr.offload_kv_cache(req)
    req.output_ids.pop()
    assert frozen(node, req) == before


def test_invalid_transition_is_both_lifecycle_and_machine_error():
    from transitions import MachineError

    assert issubclass(InvalidTransition, LifecycleError) and issubclass(InvalidTransition, MachineError)


# --- identity, reuse, readmission, leaks --------------------------------------------------------------


def test_reused_rid_does_not_inherit_progress():
    node = Node(page_size=4)
    first = Req("same", range(4), row=0)
    decode(node, first, 8)
    second = Req("same", range(4), row=1)
    assert node.mgr.offload_kv_cache(second) is False
    assert node.mgr.progress_of(second).inc_len == 0 and node.mgr.progress_of(first).inc_len == 8


def test_readmit_starts_a_new_lifecycle_on_the_new_row():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0)
    decode(node, req, 4)
    node.mgr.finalize_release_on_finish(req)            # retracted with a copy in flight
    node.land_all()
    assert node.mgr.state_of(req) is R
    req.kv.req_pool_idx = 2
    node.mgr.readmit(req)
    assert node.mgr.state_of(req) is P and node.mgr.progress_of(req).inc_len == 0
    assert node.mgr.offload_kv_cache(req) is True       # the same tokens, now from row 2
    chunk = next(iter(node.mgr._ledger.ongoing.values()))
    assert int(chunk.start) == 4 and int(node.pool.req_to_token[2, 4]) == 2 * node.pool.width + 4
    with pytest.raises(InvalidTransition, match="readmit"):
        node.mgr.readmit(req)


def test_readmit_of_unknown_request_is_refused():
    node = Node()
    with pytest.raises(InvalidTransition, match="never seen"):
        node.mgr.readmit(Req("x", range(4), row=0))


def test_readmit_of_something_never_seen_names_no_request_and_says_why():
    node = Node()
    for thing in (Req("x", range(4), row=0), object()):   # a request, or anything without a rid
        with pytest.raises(InvalidTransition) as exc:
            node.mgr.readmit(thing)
        rid = getattr(thing, "rid", None)
        assert (exc.value.rid, exc.value.trigger, exc.value.state, exc.value.reason) == (
            rid, "readmit", "UNSEEN", "the request was never seen")
    assert node.mgr.refusals() == {"readmit in UNSEEN": 2} and node.mgr.stats().tracked == 0


def test_a_finished_request_released_at_first_sight_is_read_once():
    node = Node(page_size=4)
    req = CountingReq("r", range(8), row=0, outputs=(1, 2, 3), finished=True)
    node.mgr._release_finished_req(req)
    assert req.reads == 1                                # one read of the request per call
    assert view(node, req) == dict(state=R, inc_len=0, inflight=0, storage=0, freed_pages=[0, 1, 2],
                                   freed_rows=[0], released=1, leaked=0)


def test_copies_of_lists_a_requests_copies_in_flight_in_issue_order():
    node = Node(page_size=4)
    a, b = Req("a", range(4), row=0), Req("b", range(4), row=1)
    assert node.mgr.copies_of(a) == []                  # never seen
    node.mgr.offload_kv_cache(a)
    assert node.mgr.state_of(a) is P and node.mgr.copies_of(a) == []
    decode(node, a, 4)                                  # ack 1
    decode(node, b, 4)                                  # ack 2
    decode(node, a, 8)                                  # acks 3, 4
    assert node.mgr.copies_of(a) == [1, 3, 4] and node.mgr.copies_of(b) == [2]
    node.off.land([3])
    node.mgr.check_offload_progress()
    assert node.mgr.copies_of(a) == [1, 4] and node.mgr.copies_of(b) == [2]
    node.off.expire([1])                                # an expired copy is not in flight any more
    node.mgr.check_offload_progress()
    assert node.mgr.copies_of(a) == [4] and node.mgr.stats().quarantined_slots == 4
    node.off.land([4, 2])
    node.mgr.check_offload_progress()
    assert node.mgr.copies_of(a) == [] and node.mgr.copies_of(b) == []
    assert node.mgr.copies_of(Req("a", range(4), row=0)) == []   # same rid, another request


def test_disowned_expired_copies_leave_their_slots_to_their_owner():
    """SGLang frees a request under its copies once its TP=1 release wait runs out: the expired
    copies' slots are then SGLang's. Disowning them stops the manager guarding and freeing them;
    their host pages still come back when the copies end."""
    node = Node(page_size=4)
    req = Req("r", range(4), row=0)
    other = Req("o", range(4), row=1)
    decode(node, req, 8)                                # acks 1 ([4, 8)) and 2 ([8, 12))
    decode(node, other, 4)                              # ack 3
    req.finish()
    node.mgr.finalize_release_on_finish(req)
    node.off.expire([1, 2])
    node.mgr.check_offload_progress()                   # released, slots of [4, 12) quarantined
    assert node.mgr.state_of(req) is R and node.alloc.freed_pages == [0]
    assert (node.mgr.stats().quarantined_slots, node.mgr._ledger.reading.total()) == (8, 12)
    assert node.mgr.disown_expired_copies([]) == 0
    assert node.mgr.disown_expired_copies([3, 1, 99]) == 1          # ack 3 is in flight, 99 unknown
    assert node.mgr.disown_expired_copies([1]) == 0                 # already disowned
    assert node.mgr._ledger.reading.total() == 8                           # ack 1's slots are not guarded
    node.mgr.check_integrity()
    node.off.land([1])                                  # the disowned copy ends: host pages only
    node.mgr.check_offload_progress()
    assert node.alloc.freed_pages == [0] and node.mgr.stats().quarantined_slots == 4
    node.off.land([2])                                  # the other expired copy: its slots come back
    node.mgr.check_offload_progress()
    assert node.alloc.freed_pages == [0, 2] and node.mgr.stats().quarantined_slots == 0
    assert node.mgr.copies_of(other) == [3] and node.mgr.disown_expired_copies([2, 3]) == 0
    node.land_all()
    node.store_all()
    assert node.mgr.idle() and node.off.host_free_pages() == 1 << 12


def test_disowning_several_expired_copies_counts_each_once():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0)
    decode(node, req, 12)                               # acks 1, 2, 3
    node.off.expire([1, 2, 3])
    node.mgr.check_offload_progress()
    assert node.mgr.disown_expired_copies([3, 1, 3]) == 2 and node.mgr._ledger.reading.total() == 4
    assert node.mgr.disown_expired_copies(iter([1, 2, 3])) == 1 and node.mgr._ledger.reading.total() == 0
    node.mgr.check_integrity()


def test_dropped_released_request_is_not_pinned_and_not_a_leak():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0, finished=True)
    node.mgr.finalize_release_on_finish(req)
    del req
    gc.collect()
    node.mgr.check_offload_progress()
    assert node.mgr._ledger.records == {} and node.mgr.stats().leaked == 0


def test_dropped_live_request_is_reported_as_a_leak(capsys):
    from structlog.testing import capture_logs

    node = Node(page_size=4)
    req = Req("lost", range(4), row=3)
    decode(node, req, 2)
    with capture_logs() as logs:
        del req
        gc.collect()
        assert node.mgr.stats().leaked == 1
    leak = [e for e in logs if e["event"] == "lifecycle.leaked"]
    assert leak == [dict(event="lifecycle.leaked", log_level="warning", rid="lost", row=3, gen=0, state="PREFILLED", slots=6)]
    assert node.mgr.stats().tracked == 0


def test_in_flight_work_holds_the_request_until_it_lands():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0)
    decode(node, req, 4)
    req.finish()
    del req
    gc.collect()
    assert node.mgr.stats().tracked == 1
    node.land_all()
    gc.collect()
    node.mgr.check_offload_progress()
    s = node.mgr.stats()
    assert (s.tracked, s.released, s.leaked) == (0, 1, 0) and node.mgr._ledger.records == {}


# --- fast path ----------------------------------------------------------------------------------------


class NoSlicing(list):
    def __getitem__(self, item):
        if isinstance(item, slice):
            raise AssertionError("fast path sliced a token list")
        return super().__getitem__(item)

    def __iter__(self):
        raise AssertionError("fast path iterated a token list")

    def __add__(self, other):
        raise AssertionError("fast path concatenated token lists")


def test_fast_path_fires_no_trigger_and_builds_no_token_list(monkeypatch):
    node = Node(page_size=16)
    req = Req("r", range(20), row=0)
    node.mgr.offload_kv_cache(req)                       # first sight (hashes the prefill)
    fired = []
    for k in machine.TRIGGERS:
        monkeypatch.setattr(machine, k, lambda *a, _k=k, **kw: fired.append(_k))
    req.origin_input_ids = NoSlicing(req.origin_input_ids)
    req.output_ids = NoSlicing(req.output_ids)
    for i in range(10):
        list.append(req.output_ids, i)
        req.kv.kv_committed_len += 1
        assert node.mgr.offload_kv_cache(req) is False
    assert fired == []


# --- tables, stats, snapshot, config ----------------------------------------------------------------


def test_snapshot_encodes_live_records():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0)
    decode(node, req, 4)
    views = msgspec.msgpack.decode(node.mgr.snapshot(), type=list[RecordView])
    assert views == [RecordView("r", "INFLIGHT", 0, 1, 4, node.mgr.progress_of(req).last_hash, 0)]


def test_integrity_check_catches_a_corrupted_table():
    from lifecycle import IntegrityError

    node = Node(page_size=4)
    req = Req("r", range(4), row=0)
    decode(node, req, 4)
    node.mgr.check_integrity()
    node.mgr._ledger.records[id(req)].inflight = 0
    with pytest.raises(IntegrityError, match="inflight 0 but 1 chunks"):
        node.mgr.check_integrity()


def test_unknown_ack_is_reported_after_settling_known_ones():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0)
    decode(node, req, 4)
    node.off.land()
    node.off._landed.append(999)
    with pytest.raises(UnknownCompletion, match="999"):
        node.mgr.check_offload_progress()
    assert node.mgr.state_of(req) is P


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(page_size=0), "page_size"),
        (dict(page_size=True), "page_size"),
        (dict(page_size=4, offload_stride=6), "not a multiple"),
        (dict(page_size=4, offload_stride=-4), "offload_stride"),
        (dict(page_size=4, namespace_seed="xyz"), "namespace_seed"),
    ],
)
def test_bad_configuration_is_a_config_error(kwargs, match):
    node = Node()
    with pytest.raises(ConfigError, match=match):
        DecodeOffloadManager(node.pool, node.alloc, offloader=node.off, **kwargs)


def test_offloader_without_the_protocol_is_rejected():
    node = Node()
    with pytest.raises(ConfigError, match="offloader lacks"):
        DecodeOffloadManager(node.pool, node.alloc, page_size=4, offloader=object())


def test_inconsistent_lengths_are_refused_before_anything_changes():
    node = Node(page_size=4)
    req = Req("r", range(8), row=0, finished=True)
    req.kv.kv_allocated_len = 4                              # committed 8 > allocated 4
    with pytest.raises(InvalidRequest, match="committed 8 > allocated 4"):
        node.mgr.finalize_release_on_finish(req)
    assert node.mgr.state_of(req) is None and node.alloc.freed_pages == []
    req.kv.req_pool_idx = None
    with pytest.raises(InvalidRequest, match="no req_to_token row"):
        node.mgr.finalize_release_on_finish(req)


def test_calls_after_shutdown_raise():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0)
    decode(node, req, 4)
    with pytest.raises(LifecycleError, match="in flight"):
        node.mgr.shutdown()
    node.land_all()
    node.store_all()
    node.mgr.shutdown()
    with pytest.raises(ManagerClosed):
        node.mgr.check_offload_progress()
    with pytest.raises(ManagerClosed):
        node.mgr.finalize_release_on_finish(req)


def test_strict_doubles_catch_a_double_free():
    node = Node(page_size=4)
    with pytest.raises(DoubleFree):
        node.alloc.free(torch.tensor([0, 1], dtype=torch.int64))
        node.alloc.free(torch.tensor([2], dtype=torch.int64))


def test_a_bad_chunk_is_refused_before_any_state_change():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0)
    node.mgr.offload_kv_cache(req)
    for t in (0, 1, 2**32):                      # a token id out of range...
        req.decode(t)
        node.mgr.offload_kv_cache(req)
    req.decode(5)                                # ...whose KV now fills the page
    before = frozen(node, req)
    from hashing import TokenRangeError

    # the request's own position (origin_input_ids + output_ids), and a LifecycleError too
    with pytest.raises(TokenRangeError, match="token id 4294967296 at position 7") as exc:
        node.mgr.offload_kv_cache(req)
    assert isinstance(exc.value, LifecycleError)
    assert frozen(node, req) == before
    req.output_ids[-2] = 3
    req.kv.kv_committed_len -= 1                 # KV of the page's last token is not written
    with pytest.raises(InvalidRequest, match="not committed"):
        node.mgr.offload_kv_cache(req)
    req.kv.kv_committed_len += 1
    req.kv.req_pool_idx = 5                      # the row moved without readmit
    with pytest.raises(InvalidRequest, match="row changed from 0 to 5 without readmit"):
        node.mgr.offload_kv_cache(req)
    assert frozen(node, req) == before
    req.kv.req_pool_idx = 0
    assert node.mgr.offload_kv_cache(req) is True


def test_float_req_to_token_is_a_config_error():
    node = Node()
    node.pool.req_to_token = node.pool.req_to_token.float()
    with pytest.raises(ConfigError, match="integer slots"):
        DecodeOffloadManager(node.pool, node.alloc, page_size=4, offloader=node.off)


# --- failed and stuck copies ---------------------------------------------------------------------


def test_a_failed_copy_is_never_stored_and_the_request_still_releases():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0)
    decode(node, req, 4)
    req.finish()
    node.mgr.finalize_release_on_finish(req)
    node.off.fail([1])
    node.mgr.check_offload_progress()
    s = node.mgr.stats()
    assert node.mgr.state_of(req) is R and s.copy_failures == 1 and s.inflight_storage == 0
    assert node.off.pending_storage == {} and node.off.host_free_pages() == 1 << 12
    assert node.alloc.freed_pages == [0, 1] and node.mgr.idle()


def test_an_expired_copy_releases_the_request_but_quarantines_the_slots_it_reads():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0)
    decode(node, req, 8)                      # chunks [4, 8) ack 1 and [8, 12) ack 2
    req.finish()
    node.mgr.finalize_release_on_finish(req)
    node.off.land([2])
    node.off.expire([1])                      # ack 1 is stuck past its deadline
    node.mgr.check_offload_progress()
    s = node.mgr.stats()
    assert node.mgr.state_of(req) is R and node.pool.freed_rows == [0]
    assert node.alloc.freed_pages == [0, 2]   # page 1 ([4, 8)) is still read by the stuck copy
    assert (s.copies_expired, s.quarantined_slots, node.mgr.idle()) == (1, 4, False)
    node.mgr.check_integrity()
    node.off.land([1])                        # the stuck copy finally ends
    node.mgr.check_offload_progress()
    assert sorted(node.alloc.freed_pages) == [0, 1, 2]
    node.store_all()
    assert node.mgr.idle() and node.mgr.stats().quarantined_slots == 0
    assert node.off.host_free_pages() == 1 << 12 and len(node.off.stored) == 1   # only ack 2's page


def test_an_expired_copy_of_a_live_request_returns_its_slots_to_the_request():
    node = Node(page_size=4)
    req = Req("r", range(4), row=0)
    decode(node, req, 4)
    node.off.expire([1])
    node.mgr.check_offload_progress()
    assert node.mgr.state_of(req) is P and node.mgr.stats().quarantined_slots == 4
    node.off.land([1])
    node.mgr.check_offload_progress()
    assert node.mgr.stats().quarantined_slots == 0 and node.alloc.freed_pages == []
    req.finish()
    node.mgr.finalize_release_on_finish(req)
    assert node.alloc.freed_pages == [0, 1]


def test_sglang_style_mock_request_releases_committed_and_over_allocation():
    """SGLang's own unit tests drive the manager with MagicMock requests; they work here too."""
    from types import SimpleNamespace
    from unittest.mock import MagicMock

    node = Node(page_size=1)
    req = MagicMock()
    req.rid = 0
    req.origin_input_ids = list(range(8))
    req.output_ids = [1]
    req.kv = SimpleNamespace(req_pool_idx=0, kv_committed_len=20, kv_allocated_len=28)
    req.effective_kv_committed_len = lambda: 20
    req.finished.return_value = True
    req.extra_key = req.cache_salt = None  # as SGLang 0.5.23's tests set them: its manager hashes both
    node.mgr._release_finished_req(req)
    assert [c.tolist() for c in node.alloc.calls] == [list(range(28))]  # both ranges, one call
    assert node.pool.freed_rows == [0] and node.mgr.state_of(req) is R
    with pytest.raises(InvalidTransition, match="already released"):
        node.mgr._release_finished_req(req)


class ReportsAnUnknownLanding(InMemoryOffloader):
    """Reports, once, the landing of a copy it never issued."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.lie = [99]

    def finished_writes(self):
        out, lie, self.lie = super().finished_writes(), self.lie, []
        return WriteReport(out.landed + lie, out.failed, out.expired)


def test_a_reported_landing_not_settled_yet_keeps_the_manager_busy():
    from tests.support.real_rig import Rig

    rig = Rig(4, offloader=ReportsAnUnknownLanding(page_size=4, host_pages=64, auto_land=False))
    assert rig.mgr.pending().unsettled == 1 and not rig.mgr.idle()   # collected, not settled
    with pytest.raises(LifecycleError, match="1 completions reported but never settled"):
        rig.mgr.shutdown()
    with pytest.raises(UnknownCompletion, match=r"\('ack', 99\)"):
        rig.progress()
    assert rig.mgr.idle() and rig.mgr.shutdown().unsettled == 0
