"""The manager's per-request bookkeeping stays out of the cycle collector's way.

A full (generation 2) collection walks every tracked object in the process; a decode node with
10k live requests must not add tens of thousands of them. Records, offload progress, chunks,
storage ops, ownership claims are untracked msgspec structs (``gc=False``), token and page-name
sequences are tuples (untracked by the collector's first pass), and the weak-reference callback is
one object per manager. What stays tracked: one ``weakref.KeyedRef`` per live request; while a
copy is in flight the two slot tensors it carries (the device slots it reads and the host slots
the offloader returned; torch tensors are always tracked), and while its storage op is in flight
the host-slot tensor.

Counts objects (``gc.get_objects()`` after a full collection): deterministic, no timing.
"""

from transfer.offloader import WriteReport
import gc

import torch

from lifecycle import DecodeOffloadManager, State
from lifecycle_tools.testkit.doubles import Req, ReqToTokenPool

N = 2_000
PS = 4
WIDTH = 64
FIXED = 64  # first-use caches and the like: a constant, not per request


class Offloader:
    """A plain offloader double: copies land when ``land`` is called, storage ops at the next poll.
    Per pending copy it keeps only an int (its ack id); ``write`` returns a view of one tensor."""

    def __init__(self):
        self.host = torch.arange(1 << 12, dtype=torch.int64)
        self.pending, self.landed, self.ops, self.next_op = [], [], [], 0

    def write(self, device_indices, ack_id):
        self.pending.append(ack_id)
        return self.host[: device_indices.shape[0]]

    def land(self):
        self.landed, self.pending = self.landed + self.pending, []

    def finished_writes(self):
        out, self.landed = self.landed, []
        return WriteReport(out, [], [])

    def write_storage(self, host_indices, tokens, page_hashes, parent_hash=None):
        assert len(tokens) == len(page_hashes) * PS
        self.next_op += 1
        self.ops.append(self.next_op)
        return self.next_op

    def finished_storage(self):
        out, self.ops = self.ops, []
        return out

    def free_host(self, host_indices):
        pass

    def close(self, timeout):
        pass


class Allocator:
    """Frees pages (each once) and keeps no per-call record (the test counts objects)."""

    page_size = PS

    def __init__(self, n):
        self.held = bytearray(b"\x01") * (n * WIDTH // PS)

    def check_free(self, indices):
        pages = (indices // PS).unique()
        assert all(self.held[p] for p in pages.tolist()), "page freed twice"

    def free(self, indices):
        self.check_free(indices)
        for p in (indices // PS).unique().tolist():
            self.held[p] = 0


def tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


def rig(n):
    pool = ReqToTokenPool(rows=n, width=WIDTH)
    alloc = Allocator(n)
    off = Offloader()
    mgr = DecodeOffloadManager(pool, alloc, page_size=PS, offloader=off)
    # prompt 10 tokens (2 whole pages hashed on first sight), one sampled token: no chunk due yet
    reqs = [Req(f"r{i}", range(i, i + 10), i, outputs=(7,)) for i in range(n)]
    return mgr, off, reqs


def warm_up():
    """One small run through every path first, so first-use caches are not counted below."""
    mgr, off, reqs = rig(8)
    for r in reqs:
        mgr.offload_kv_cache(r)
        for t in range(PS):
            r.decode(t)
        mgr.offload_kv_cache(r)
    off.land()
    mgr.check_offload_progress()
    mgr.check_offload_progress()
    for r in reqs:
        r.finish()
        if not mgr.offload_kv_cache(r):
            mgr.finalize_release_on_finish(r)
    mgr.check_offload_progress()


def test_at_most_one_tracked_object_per_live_request_and_two_per_copy_in_flight():
    warm_up()
    mgr, off, reqs = rig(N)
    base = tracked()

    for r in reqs:
        assert mgr.offload_kv_cache(r) is False  # first sight: a record, its progress, a claim
    live = tracked() - base
    assert mgr.stats().tracked == N
    assert live <= N + FIXED, f"{live / N:.2f} tracked objects per live request (target <= 1)"

    for r in reqs:  # one chunk due for every request: N copies in flight
        for t in range(PS):
            r.decode(t)
        assert mgr.offload_kv_cache(r) is True
    in_flight = tracked() - base - live
    assert mgr.stats().inflight_writes == N
    assert in_flight <= 2 * N + FIXED, f"{in_flight / N:.2f} tracked objects per copy in flight (target <= 2)"

    off.land()
    mgr.check_offload_progress()  # landed: storage ops in flight (untracked StorageOps)
    assert mgr.stats().inflight_storage == N
    assert tracked() - base <= 2 * N + FIXED  # + the host-slot tensor each op frees when it ends
    mgr.check_offload_progress()  # stored: back to the records alone
    assert mgr.idle() and tracked() - base <= N + FIXED

    for r in reqs:
        r.finish()
        assert mgr.offload_kv_cache(r) is False
        mgr.finalize_release_on_finish(r)
    assert all(mgr.state_of(r) is State.RELEASED for r in reqs)
    assert tracked() - base <= N + FIXED  # released records are kept while the scheduler holds them

    alloc = mgr.token_to_kv_pool_allocator
    assert alloc.held.count(0) == N * 4  # 14 tokens of KV each: four pages per request freed, once
    del reqs, r
    mgr.check_offload_progress()  # retire the dropped requests' records
    assert mgr.stats().tracked == 0 and mgr.stats().leaked == 0
    assert tracked() - base <= FIXED, "dropped requests left tracked objects behind"


def test_a_dropped_request_releases_its_ownership_claim_and_a_newer_claim_survives_an_older_ref():
    """The ownership registry shares the record's weak reference and is cleaned by its callback."""
    from lifecycle import table

    mgr, off, reqs = rig(2)
    a, b = reqs
    mgr.offload_kv_cache(a)
    assert table.OWNERS.owner(a) is mgr and id(a) in table.OWNERS._by_id
    key = id(a)
    a.finish()
    mgr.finalize_release_on_finish(a)
    mgr2 = DecodeOffloadManager(ReqToTokenPool(rows=2, width=WIDTH), Allocator(2),
                                page_size=PS, offloader=Offloader())
    mgr2.offload_kv_cache(b)
    assert table.OWNERS.owner(b) is mgr2
    del a, reqs
    gc.collect()
    assert key not in table.OWNERS._by_id  # forgotten with the request, before any manager call
    mgr.check_offload_progress()
    assert mgr.stats().tracked == 0 and mgr.stats().leaked == 0
    assert table.OWNERS.owner(b) is mgr2
