"""Completion settling at its edges (each case a mutant that survived the suite before it).

A release refused when the last copy lands (raised after settling the rest, logged, the request
kept FINISHED for a retry); an expiry reported twice; an unknown storage op named once; what
``pending()`` reports, field by field; latencies to the microsecond; generations across readmits.
"""

from __future__ import annotations

from transfer.offloader import WriteReport
import pytest
import torch
from structlog.testing import capture_logs

from hashing import page_hashes
from lifecycle import InvalidTransition, State, UnknownCompletion, audit
from lifecycle.release import AllocatorReleaseSink, ReleaseRefused
from tests.support.real_rig import Rig
from transfer import PagedTokenAllocator, ReqToTokenPool
from lifecycle_tools.testkit.memory import InMemoryOffloader

PS = 4


class RowCheckingPool(ReqToTokenPool):
    def check_free(self, req):
        row = req.kv.req_pool_idx
        if row is None or not self._held[row]:
            raise ValueError(f"row {row} is not held")


def checking_rig():
    alloc, pool = PagedTokenAllocator(4 * 64, PS), RowCheckingPool(4, 64)
    return Rig(PS, pool=pool, alloc=alloc, release_sink=AllocatorReleaseSink(pool, alloc))


def finished_with_a_copy(rig, rid):
    req, _ = rig.admit(rid, 8, 16)
    rig.decode(req, 4)
    req.finish()
    rig.mgr.finalize_release_on_finish(req)
    return req


def steal_row(rig, req):
    row = req.kv.req_pool_idx
    rig.pool.free(req)                               # freed behind the manager's back
    req.kv.req_pool_idx = row
    return row


@pytest.mark.parametrize("how", ["landed", "expired"])
def test_a_release_refused_when_the_last_copy_ends_is_raised_logged_and_retried(how):
    rig = checking_rig()
    first, second = finished_with_a_copy(rig, "r1"), finished_with_a_copy(rig, "r2")
    row = steal_row(rig, first)
    with capture_logs() as logs, pytest.raises(ReleaseRefused, match=rf"request 'r1': cannot free its row \(row {row}\)"):
        (rig.off.land if how == "landed" else rig.off.expire)([1, 2])
        rig.progress()
    assert rig.mgr.state_of(first) is State.FINISHED          # kept for a retry
    assert rig.mgr.state_of(second) is State.RELEASED         # the rest was settled
    (refused,) = [e for e in logs if e["event"] == audit.REFUSED]
    assert {k: refused[k] for k in ("rid", "trigger", "state", "log_level")} == dict(
        rid="r1", trigger="release", state="FINISHED", log_level="error")
    assert "cannot free its row" in refused["reason"]


def test_two_refused_releases_raise_the_first():
    rig = checking_rig()
    first, second = finished_with_a_copy(rig, "r1"), finished_with_a_copy(rig, "r2")
    steal_row(rig, first)
    steal_row(rig, second)
    with pytest.raises(ReleaseRefused, match="request 'r1'"):
        rig.off.land([1, 2])
        rig.progress()
    assert rig.mgr.state_of(first) is rig.mgr.state_of(second) is State.FINISHED


def test_an_expiry_reported_twice_is_settled_once():
    rig = Rig(PS)
    req, _ = rig.admit("x", 8, 16)
    rig.decode(req, 4)
    rig.off.expire([1])
    rig.off.expire([1])
    rig.progress()
    assert rig.mgr.stats().copies_expired == 1 and rig.mgr.pending().quarantined_slots == 4


class LyingOffloader(InMemoryOffloader):
    """Reports a storage op it never issued, once."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.lie = [99]

    def finished_storage(self):
        out, self.lie = super().finished_storage() + self.lie, []
        return out


def test_an_unknown_storage_op_is_named_once_and_forgotten():
    rig = Rig(PS, offloader=LyingOffloader(page_size=PS, host_pages=64, auto_land=False))
    with pytest.raises(UnknownCompletion, match=r"\('op', 99\)"):
        rig.progress()
    rig.progress()                                   # not reported again
    assert rig.mgr.idle()


def test_pending_reports_every_kind_of_wait():
    rig = Rig(PS)
    done, _ = rig.admit("d", 8, 24)                  # finished, 2 copies: 1 landed unsettled, 1 not
    rig.decode(done, 8)
    done.finish()
    rig.mgr.finalize_release_on_finish(done)
    ready, _ = rig.admit("e", 8, 16)                 # finished, its only copy landed unsettled
    rig.decode(ready, 4)
    ready.finish()
    rig.mgr.finalize_release_on_finish(ready)
    stuck, _ = rig.admit("s", 8, 16)                 # live, copy expired: 4 slots quarantined
    rig.decode(stuck, 4)
    stored, _ = rig.admit("t", 8, 16)                # live, one storage op in flight
    rig.decode(stored, 4)
    # acks: d 1, 2; e 3; s 4; t 5
    rig.off.land([5])
    rig.off.expire([4])
    rig.progress()                                   # t's copy settled (op 1), s's quarantined
    rig.off.complete_storage()                       # op 1 reported, not settled
    rig.off.land([1, 3])                             # reported by pending()'s poll, not settled
    p = rig.mgr.pending()
    assert (p.copies, p.unsettled, p.storage_ops, p.quarantined_slots, p.finished_waiting,
            p.finished_waiting_on_settled) == (1, 3, 1, 4, 2, 1)
    assert "4 slots quarantined" in p.describe() and "2 finished requests holding slots" in p.describe()


def test_latency_is_logged_to_the_microsecond():
    rig = Rig(PS)
    req, _ = rig.admit("l", 8, 16)
    rig.clock.t = 100.0
    rig.decode(req, 4)
    rig.clock.t = 100.00000049                       # under half a microsecond later
    with capture_logs() as logs:
        rig.off.land()
        rig.progress()
    (landed,) = [e for e in logs if e["event"] == audit.CHUNK_LANDED]
    assert landed["latency_s"] == 0.0


def test_generations_count_every_readmit():
    rig = Rig(PS, rows=6)
    req, _ = rig.admit("g", 8, 16)
    for gen in (1, 2):
        rig.decode(req, 1, first=7000 + gen)
        rig.mgr.finalize_release_on_finish(req)      # retracted
        rig.pool.alloc()                             # its old row goes to someone else
        row = rig.pool.alloc()
        rig.pool.req_to_token[row, :16] = rig.alloc.alloc(16).to(rig.pool.req_to_token.dtype)
        req.kv.req_pool_idx = row
        rig.mgr.readmit(req)
    with capture_logs() as logs:
        rig.decode(req, 4, first=7100)
    assert {e["gen"] for e in logs if "gen" in e} == {2}


def test_release_of_a_never_seen_unfinished_request_is_refused_as_unseen():
    rig = Rig(PS)
    req, _ = rig.admit("u", 8, 8)
    with capture_logs() as logs, pytest.raises(InvalidTransition) as info:
        rig.mgr._release_finished_req(req)
    err = info.value
    assert (err.rid, err.trigger, err.state) == ("u", "release", "UNSEEN")
    assert err.reason == "the request is neither finished nor finalized"
    (log,) = [e for e in logs if e["event"] == audit.REFUSED]
    assert (log["rid"], log["trigger"], log["state"], log["reason"]) == ("u", "release", "UNSEEN", err.reason)


def test_a_finished_request_released_at_first_sight_keeps_its_prompt_chain():
    rig = Rig(PS)
    req, _ = rig.admit("f", 8, 8)
    req.finish()
    rig.mgr._release_finished_req(req)
    prog = rig.mgr.progress_of(req)
    assert (prog.inc_len, prog.last_hash) == (0, page_hashes(req.origin_input_ids, PS)[-1])


def test_a_non_callable_check_free_attribute_is_ignored():
    alloc, pool = PagedTokenAllocator(4 * 64, PS), ReqToTokenPool(4, 64)
    alloc.check_free = pool.check_free = "not a method"
    rig = Rig(PS, pool=pool, alloc=alloc)
    req, _ = rig.admit("c", 8, 8)
    req.finish()
    rig.mgr.finalize_release_on_finish(req)
    assert rig.mgr.state_of(req) is State.RELEASED


class ReenteringOffloader(InMemoryOffloader):
    """Calls back into the manager from ``finished_writes`` (a bug the manager must refuse)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.mgr = self.req = None
        self.errors = []

    def finished_writes(self):
        if self.mgr is not None:
            try:
                self.mgr.offload_kv_cache(self.req)
            except Exception as err:  # noqa: BLE001 - recorded for the test
                self.errors.append(err)
        return super().finished_writes()


def test_a_call_back_into_the_manager_during_progress_is_refused_and_changes_nothing():
    from lifecycle.errors import ReentrantCall

    rig = Rig(PS, offloader=ReenteringOffloader(page_size=PS, host_pages=64, auto_land=False))
    req, _ = rig.admit("re", 8, 24)
    rig.decode(req, 8)                                # acks 1, 2 in flight
    for t in range(4):                               # KV 20: a third chunk is due, not offloaded
        req.decode(7200 + t)
    rig.off.mgr, rig.off.req = rig.mgr, req
    before = rig.mgr.stats().chunks_enqueued
    rig.progress()
    assert [type(e) for e in rig.off.errors] == [ReentrantCall]
    assert rig.mgr.stats().chunks_enqueued == before


def test_a_failed_copy_is_settled_once_and_leaves_nothing_behind():
    rig = Rig(PS)
    req, _ = rig.admit("f", 8, 16)
    rig.decode(req, 4)                                   # ack 1
    rig.off.fail([1])
    rig.progress()
    assert rig.mgr.stats().copy_failures == 1 and rig.off.pending_storage == {}
    assert not rig.mgr._ledger.failed and not rig.mgr._ledger.ongoing  # no per-copy trace kept once settled
    rig.decode(req, 4, first=7005)                       # the next chunk: ack 2, landed and stored
    rig.off.land([2])
    rig.progress()
    assert rig.mgr.stats().copy_failures == 1 and len(rig.off.pending_storage) == 1


def test_an_expired_copy_that_then_fails_ends_its_quarantine_and_leaves_nothing_behind():
    rig = Rig(PS)
    req, _ = rig.admit("e", 8, 16)
    rig.decode(req, 4)                                   # ack 1
    rig.off.expire([1])
    rig.progress()                                       # expired: its slots quarantined
    assert rig.mgr.stats().copies_expired == 1 and 1 in rig.mgr._ledger.expired
    rig.off.fail([1])                                    # it ends, as a failure
    rig.progress()
    assert not rig.mgr._ledger.expired and not rig.mgr._ledger.failed and rig.mgr._ledger.reading.total() == 0


class NoFailureReports(InMemoryOffloader):
    """An offloader that implements the protocol but never reports a failure or an expiry: each
    report lists landings only (a new ``WriteReport``, not the shared empty one)."""

    def finished_writes(self):
        return WriteReport(list(super().finished_writes().landed), [], [])


def test_an_offloader_without_failure_reports_is_collected_and_shut_down():
    rig = Rig(PS, offloader=NoFailureReports(page_size=PS, host_pages=64, auto_land=False))
    req, _ = rig.admit("n", 8, 16)
    rig.decode(req, 4)
    rig.off.land()
    assert rig.mgr.pending().unsettled == 1          # collected: the landing, no failures reported
    rig.progress()
    rig.off.complete_storage()
    rig.progress()
    assert rig.mgr.stats().copy_failures == 0 and rig.mgr.shutdown().copies == 0


# --- chain order: a request's storage writes go out in the order of its chain (issue 35.6) -------


def two_chunks(rig, rid="a"):
    req, _ = rig.admit(rid, 8, 24)
    rig.decode(req, 8)                                  # acks: [8, 12) then [12, 16)
    assert len(rig.mgr.copies_of(req)) == 2
    return req


def stored_names(rig):
    return [names for _, names in rig.off.pending_storage.values()]


def test_a_chunk_that_lands_before_its_predecessor_waits_for_it():
    """The request's second chunk lands first: its pages are not handed to storage (so never
    announced before their parent) until the first has landed; then both go, first first."""
    rig = Rig(PS)
    req = two_chunks(rig)
    first, second = rig.mgr.copies_of(req)
    chain = rig.mgr.progress_of(req).last_hash
    rig.off.land([second])
    rig.progress()
    assert stored_names(rig) == [] and rig.mgr.copies_of(req) == [first]
    assert rig.mgr.state_of(req) is State.INFLIGHT and rig.mgr.stats().unsettled == 1
    rig.off.land([first])
    rig.progress()
    names = stored_names(rig)
    assert len(names) == 2 and names[1][-1] == chain and rig.mgr.state_of(req) is State.PREFILLED
    assert rig.mgr.stats().unsettled == 0
    rig.mgr.check_integrity()


def test_a_waiting_chunk_goes_once_its_predecessor_expired():
    rig = Rig(PS)
    req = two_chunks(rig)
    first, second = rig.mgr.copies_of(req)
    rig.off.land([second])
    rig.progress()
    assert stored_names(rig) == []
    rig.off.expire([first])
    rig.progress()                                      # the predecessor will never store: no wait
    assert len(stored_names(rig)) == 1 and rig.mgr.copies_of(req) == []


def test_another_requests_chunk_does_not_wait():
    rig = Rig(PS)
    a = two_chunks(rig, "a")
    b = two_chunks(rig, "b")
    rig.off.land(rig.mgr.copies_of(b))                  # b's chunks land, a's are still in flight
    rig.progress()
    assert len(stored_names(rig)) == 2 and rig.mgr.copies_of(b) == [] and len(rig.mgr.copies_of(a)) == 2


class FreeHostFails:
    """Wraps an offloader's ``free_host`` to raise, freeing nothing, when asked to free any host
    index of the tensors in ``bad`` (in one tensor, or in a list of them)."""

    def __init__(self, off):
        self.off, self.real, self.bad, self.raised = off, off.free_host, [], 0
        off.free_host = self

    def __call__(self, host):
        hosts = host if type(host) is list else [host]  # several ops' pages in one call, or one tensor
        if any(bool(torch.isin(h, b).any()) for h in hosts for b in self.bad):
            self.raised += 1
            raise RuntimeError("host pages cannot be freed")
        self.real(host)


def test_a_free_host_error_while_settling_expired_copies_settles_the_others_then_raises():
    from tests.lifecycle.test_two_expired_copies import two_expired

    rig, sink, req, slots, start_free, _ = two_expired()
    ledger = rig.mgr._ledger
    broken = FreeHostFails(rig.off)
    broken.bad = [ledger.expired[1].host]
    rig.off.land([1, 2])
    with pytest.raises(RuntimeError, match="cannot be freed"):
        rig.progress()
    assert broken.raised == 1
    assert not ledger.expired and ledger.reading.total() == 0  # both ended: no slot still counted as read
    req.finish()
    rig.mgr.finalize_release_on_finish(req)                    # nothing refused as "still read"
    assert rig.mgr.state_of(req) is State.RELEASED and sink.plans[-1].quarantined == 0
    assert rig.alloc.available_size() == start_free
    rig.mgr.check_integrity()


def test_a_free_host_error_for_a_failed_copy_still_moves_its_request_on():
    rig = Rig(PS)
    req, _ = rig.admit("f", 8, 16)
    rig.decode(req, 4)                                          # ack 1
    broken = FreeHostFails(rig.off)
    broken.bad = [rig.mgr._ledger.ongoing[1].host]
    rig.off.fail([1])
    with pytest.raises(RuntimeError, match="cannot be freed"):
        rig.progress()
    assert rig.mgr.state_of(req) is State.PREFILLED and not rig.mgr._ledger.ongoing
    assert rig.mgr.copies_of(req) == []
    req.finish()
    rig.mgr.finalize_release_on_finish(req)
    assert rig.mgr.state_of(req) is State.RELEASED


def test_one_storage_ops_host_pages_failing_to_free_keep_no_other_ops_pages():
    rig = Rig(PS)
    a, _ = rig.admit("a", 8, 16)
    b, _ = rig.admit("b", 8, 16)
    rig.decode(a, 4)
    rig.decode(b, 4)
    rig.off.land()
    rig.progress()                                              # both chunks handed to storage
    ops = list(rig.mgr._ledger.storage_ops.values())
    assert len(ops) == 2
    free_before = rig.off.host_free_pages()
    broken = FreeHostFails(rig.off)
    broken.bad = [ops[0].host]
    rig.off.complete_storage()
    with pytest.raises(RuntimeError, match="cannot be freed"):
        rig.progress()
    assert not rig.mgr._ledger.storage_ops
    assert broken.raised == 2                                   # the whole call, then the one op alone
    assert rig.off.host_free_pages() == free_before + ops[1].host.numel() // PS
