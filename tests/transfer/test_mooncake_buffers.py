"""``transfer/storage/mooncake/buffers.py`` against a real ``mooncake_master``: what stays registered
with the Mooncake client is bounded (issue 22, point 5: fresh >= 1 MiB page tensors per call were
all kept registered, and referenced, until ``close``), while the host pool stays registered."""

from __future__ import annotations

import hashlib
import itertools
import time

import pytest
import torch

from lifecycle_tools.testkit.mooncake_server import mooncake_master, mooncake_session_master  # noqa: F401
from transfer import open_storage
from transfer.storage.identity import DeploymentIdentity
from transfer.storage.mooncake.buffers import DEFAULT_MAX_KEPT, BufferRegistry

NB = 1 << 20  # a page of exactly the size the registry keeps
_n = itertools.count()


def fresh(n: int) -> list[str]:
    return [hashlib.sha256(f"buffers-{time.time_ns()}-{next(_n)}".encode()).hexdigest() for _ in range(n)]


class FakeClient:
    """Counts registrations; refuses a registration of ``refuse`` bytes (Mooncake's error code)."""

    def __init__(self, refuse: int = -1) -> None:
        self.live: dict[int, int] = {}
        self.refuse = refuse

    def register_buffer(self, ptr, nbytes):
        if nbytes == self.refuse:
            return -1
        self.live[ptr] = nbytes
        return 0

    def unregister_buffer(self, ptr):
        del self.live[ptr]
        return 0


def test_fresh_big_tensors_per_call_stay_bounded_and_the_pool_stays_registered(mooncake_master):
    s = open_storage(mooncake_master.spec(global_segment_size="128MiB"), page_nbytes=NB,
                     identity=DeploymentIdentity(model_name="m"))
    try:
        pool = torch.zeros(4, NB, dtype=torch.uint8)  # a host pool: every call uses it
        buffers = s._buffers
        for r in range(37):
            page = torch.full((NB,), r % 251, dtype=torch.uint8)  # a fresh storage every call
            keys = fresh(2)
            pool[r % 4].fill_(r % 7)
            assert s.batch_set(keys, [pool[r % 4], page]) == [True, True]
            out = torch.empty(NB, dtype=torch.uint8)  # another fresh storage
            assert s.batch_get(keys[1:], [out]) == [True] and torch.equal(out, page)
            assert len(buffers._pools) <= DEFAULT_MAX_KEPT
        assert pool.untyped_storage().data_ptr() in buffers._pools  # the pool was never dropped
        assert buffers.kept_bytes <= DEFAULT_MAX_KEPT * pool.untyped_storage().nbytes()
        assert buffers.registrations - buffers.unregistrations == buffers.kept
    finally:
        s.close()


def test_lru_drops_only_idle_storages_and_a_refused_registration_keeps_nothing():
    client = FakeClient(refuse=3 << 20)
    reg = BufferRegistry(client, pool_min_bytes=1 << 20, max_kept=2)
    a, b, c = (torch.zeros(1 << 20, dtype=torch.uint8) for _ in range(3))
    with reg.registered([a, b, c]):  # three in use at once: all stay registered during the call
        assert len(client.live) == 3 and reg.kept == 3
    assert reg.kept == 2 and a.data_ptr() not in client.live  # a, least recently used, dropped
    with reg.registered([b[10:20]]):  # a view inside a kept storage: no new registration
        assert reg.registrations == 3
    small = torch.zeros(16, dtype=torch.uint8)
    with reg.registered([small]):
        assert small.data_ptr() in client.live and reg.kept == 2
    assert small.data_ptr() not in client.live
    with pytest.raises(Exception, match="could not register"):
        with reg.registered([torch.zeros(3 << 20, dtype=torch.uint8)]):
            pass
    assert reg.kept == 2 and len(client.live) == 2
    reg.close()
    assert client.live == {} and reg.kept == 0
    with pytest.raises(ValueError):
        BufferRegistry(client, max_kept=0)
    unbounded = BufferRegistry(FakeClient(), max_kept=None)
    tensors = [torch.zeros(1 << 20, dtype=torch.uint8) for _ in range(5)]
    for t in tensors:
        with unbounded.registered([t]):
            pass
    assert unbounded.kept == 5
