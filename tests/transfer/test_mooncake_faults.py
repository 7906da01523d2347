"""Mooncake faults against real processes: the master killed and restarted empty, a master that is
not there (or never answers) at setup, a segment holder holding the only replica killed — each a
bounded-time miss, writes resume after recovery. A whole decode run through a master killed
mid-run (nothing leaked, the report written): tests/transfer/test_mooncake_simulate.py."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from lifecycle_tools.testkit.mooncake_server import make_mooncake, require_mooncake  # noqa: F401 (fixture)
from tests.transfer.test_mooncake_storage import MHA, NB, fresh_hashes, pages
from transfer import open_storage
from transfer.errors import StorageUnavailable
from transfer.storage.breaker import BreakerState
from transfer.storage.identity import DeploymentIdentity

M0 = DeploymentIdentity(model_name="m")  # rank 0 of 1
M1 = DeploymentIdentity(model_name="m", tp_rank=1, tp_size=2)


def wait_for(cond, timeout: float, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(step)
    return cond()


def stored(store, keys, pages_) -> bool:
    """Whether one write of the batch stored every page (an unreachable tier is a False)."""
    try:
        return store.batch_set(keys, pages_) == [True] * len(keys)
    except StorageUnavailable:
        return False


def timed(fn):
    t = time.monotonic()
    out = fn()
    return out, time.monotonic() - t


def test_master_killed_then_restarted_empty(make_mooncake):
    master = make_mooncake()
    s = open_storage(master.spec(), page_nbytes=NB, identity=M0, page_format=MHA)
    try:
        old, new = fresh_hashes(2), fresh_hashes(2)
        pool = pages(4)
        assert s.batch_set(old, [pool[0], pool[1]]) == [True, True]
        master.kill()
        # the existence check (a prefix lookup): always bounded, a typed error the loader counts as a miss
        for _ in range(6):
            t = time.monotonic()
            with pytest.raises(StorageUnavailable):
                s.batch_exists(old)
            assert time.monotonic() - t < 1.5
        assert s.breaker.state is not BreakerState.CLOSED and s.stats().unavailable >= 1
        # worker-thread calls: misses / a typed error, within Mooncake's own RPC bound
        got, took = timed(lambda: s.batch_get(old, [pool[2].clone(), pool[3].clone()]))
        assert got == [False, False] and took < 6.0
        with pytest.raises(StorageUnavailable):
            s.batch_set(new, [pool[2], pool[3]])
        master.start()  # same port, empty
        assert wait_for(lambda: stored(s, new, [pool[2], pool[3]]), 20.0, 0.25)
        out = [torch.zeros(NB, dtype=torch.uint8) for _ in range(2)]
        assert s.batch_get(new, out) == [True, True] and torch.equal(out[1], pool[3])
        assert s.batch_exists(old) == 0  # what it held before is gone
        assert s.breaker.state is BreakerState.CLOSED and s.breaker.stats().outages >= 1
    finally:
        s.close(wait=True)  # while the master is up: a close racing its stop takes seconds longer


def test_master_absent_at_setup_lazy_connects_later(make_mooncake):
    require_mooncake()
    from lifecycle_tools.testkit.mooncake_server import MooncakeMaster, mooncake_dir

    master = MooncakeMaster(mooncake_dir())  # ports chosen, not started
    s, took = timed(lambda: open_storage(master.spec(lazy=1), page_nbytes=NB, identity=M0, page_format=MHA))
    try:
        assert took < 1.0 and not s.connected
        h = fresh_hashes(1)
        page = pages(1)[0]
        t = time.monotonic()
        with pytest.raises(StorageUnavailable):
            s.batch_exists(h)
        assert time.monotonic() - t < 0.1 and s.batch_get(h, [page.clone()]) == [False]
        with pytest.raises(StorageUnavailable):
            s.batch_set(h, [page])
        master.start()
        try:
            assert wait_for(lambda: s.connected, 15.0)
            assert s.batch_set(h, [page]) == [True] and s.batch_exists(h) == 1
        finally:
            s.close(wait=True)
            master.stop()
    finally:
        s.close(wait=True)  # while the master is up: a close racing its stop takes seconds longer


def test_setup_against_a_silent_port_is_bounded():
    require_mooncake()
    with socket.socket() as listener:  # accepts connections, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        t = time.monotonic()
        with pytest.raises(StorageUnavailable, match="setup"):
            open_storage(f"mooncake://127.0.0.1:{port}?setup_timeout_s=1", page_nbytes=NB, identity=M0)
        assert time.monotonic() - t < 5.0  # Mooncake's setup holds the GIL: bounded by its RPC timeout


def on_holder(store, names, holder) -> list[bool]:
    """Whether each object's (only) replica lies in ``holder``'s segment."""
    return [holder.holds(store._store.get_replica_desc(name)[0].get_memory_descriptor()
                         .buffer_descriptor.transport_endpoint) for name in names]


def test_holder_of_the_only_replica_killed_then_two_replicas_survive(make_mooncake):
    # the master drops a dead holder after client_ttl_s: long enough that the reads right after the
    # kill (each may wait seconds on a connect to the dead peer) still find h1 listed on a loaded
    # machine (2 s once let the master drop h1 first: holder_gone 0 instead of 6)
    master = make_mooncake(client_ttl_s=8)
    h1, h2 = make_mooncake.holder(master), make_mooncake.holder(master)
    # objects on holders
    one = open_storage(master.spec(global_segment_size=0), page_nbytes=NB, identity=M0, page_format=MHA)
    two = open_storage(master.spec(global_segment_size=0, replica_num=2), page_nbytes=NB, identity=M1, page_format=MHA)
    try:
        n = 8
        keys1, keys2 = fresh_hashes(n), fresh_hashes(n)
        pool = pages(n)
        assert wait_for(lambda: stored(one, keys1, list(pool)), 10.0)
        assert two.batch_set(keys2, list(pool)) == [True] * n
        # placement is random per object: which pages lose K or V, which only their seal, with h1
        kv_on_h1 = [any(on_holder(one, one.naming.objects(k), h1)) for k in keys1]
        seal_on_h1 = on_holder(one, [one.naming.seal_object(k) for k in keys1], h1)
        names = [o for k in keys1 for o in one.naming.objects(k) + [one.naming.seal_object(k)]]
        where = on_holder(one, names, h1)
        assert where != on_holder(one, names, h2) and all(a != b for a, b in zip(where, on_holder(one, names, h2)))
        h1_objects = [o for o, on in zip(names, where) if on]
        h1.kill()
        out = [torch.zeros(NB, dtype=torch.uint8) for _ in range(n)]
        for s, keys in ((one, keys1), (two, keys2)):  # while the master still lists h1: bounded misses
            got, took = timed(lambda: s.batch_get(keys, out))
            assert took < 6.0  # a worker-thread call (GIL released): the transfer's connect to a dead peer
            assert all(torch.equal(o, p) for o, p, ok in zip(out, pool, got) if ok)
            assert all(not o.any() for o, ok in zip(out, got) if not ok)
        assert one.stats().holder_gone == sum(kv_on_h1)  # counted while the master still listed h1
        # once the master drops h1 (client_ttl 8 s): h1's objects are gone ...
        assert wait_for(lambda: not any(c == 1 for c in one._store.batch_is_exist(h1_objects)), 30.0, 0.25)
        # ... two replicas: every page, bit-exact
        assert two.batch_get(keys2, out) == [True] * n and all(torch.equal(o, p) for o, p in zip(out, pool))
        # one replica: exactly the pages that had K or V on h1 are misses; a page that lost only its
        # seal is served, counted unverified; every page served is bit-exact
        before = one.stats().unverified
        got = one.batch_get(keys1, out)
        assert got == [not lost for lost in kv_on_h1], (got, kv_on_h1)
        assert one.batch_exists(keys1) == (kv_on_h1 + [True]).index(True)
        assert one.stats().unverified - before == sum(s and not k for s, k in zip(seal_on_h1, kv_on_h1))
        assert all(torch.equal(o, p) for o, p, ok in zip(out, pool, got) if ok)
        # and rewritable
        assert stored(one, keys1, list(pool)) and one.batch_get(keys1, out) == [True] * n
        h2.kill()
    finally:
        one.close(wait=True)
        two.close(wait=True)


def test_preferred_local_segment_keeps_pages_when_another_holder_dies(make_mooncake):
    master = make_mooncake()
    holder = make_mooncake.holder(master)
    s = open_storage(master.spec(preferred_segment="local"), page_nbytes=NB, identity=M0, page_format=MHA)
    try:
        keys, pool = fresh_hashes(16), pages(16)
        assert s.batch_set(keys, list(pool)) == [True] * 16
        ends = {s._store.get_replica_desc(o)[0].get_memory_descriptor().buffer_descriptor.transport_endpoint
                for k in keys for o in s.naming.objects(k)}
        assert len(ends) == 1  # 32 objects on one segment (random placement over 2 would split them)
        holder.kill()
        out = [torch.zeros(NB, dtype=torch.uint8) for _ in keys]
        assert s.batch_get(keys, out) == [True] * 16 and all(torch.equal(o, p) for o, p in zip(out, pool))
        assert s.stats().holder_gone == 0
    finally:
        s.close(wait=True)  # while the master is up: a close racing its stop takes seconds longer


def test_a_full_store_refuses_pages_and_never_leaves_one_without_its_seal(make_mooncake):
    master = make_mooncake()
    s = open_storage(master.spec(global_segment_size="16MiB"), page_nbytes=None, identity=M0)  # the only segment
    try:
        nb = 256 << 10
        n = (32 << 20) // nb  # twice what fits
        keys = fresh_hashes(n)
        pool = torch.randint(0, 256, (n, nb), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
        got = s.batch_set(keys, list(pool))
        assert 0 < got.count(True) < n and s.stats().no_space >= 1 and s.stats().stored == got.count(True)
        for key, ok in zip(keys, got):
            if not ok:  # a refused page is never left visible as a whole page of ours without its seal
                present = s._store.batch_is_exist(s.naming.objects(key) + [s.naming.seal_object(key)])
                assert present[:2] != [1, 1] or present[2] == 1
        out = torch.zeros(n, nb, dtype=torch.uint8)
        read = s.batch_get(keys, list(out))  # Mooncake evicts objects to make room: stored pages may be gone
        assert any(read) and s.stats().corrupt == 0
        assert all(torch.equal(out[i], pool[i]) for i, r in enumerate(read) if r)
        assert all(not out[i].any() for i, r in enumerate(read) if not r)
    finally:
        s.close(wait=True)  # while the master is up: a close racing its stop takes seconds longer
