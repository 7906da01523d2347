"""The bad-input catalogue (docs/reliability.md): every public entry point given wrong input gets a
typed error naming the problem and leaves every table and counter unchanged."""

import types

import pytest
import torch

from hashing import TokenRangeError
from lifecycle import (
    ConfigError,
    DecodeOffloadManager,
    InvalidRequest,
    InvalidTransition,
    ManagerClosed,
    UnknownCompletion,
)
from tests.conftest import Node
from lifecycle_tools.testkit.doubles import Req
from transfer import BadIndices, DoubleFree, NotAllocated, PagedTokenAllocator


def frozen(node):
    m = node.mgr
    records = sorted((k, r.state.name, r.row, r.inflight, r.offload.inc_len, r.offload.last_hash)
                     for k, r in m._ledger.records.items())
    counters = (dict(m._ledger.by_state), m._ledger.released, m._ledger.leaked, m._ledger.host_short, m._ledger.chunks, m._ledger.chunks_landed,
                m._ledger.copies_expired, m._ledger.copy_failures)
    return (records, counters, sorted(m._ledger.ongoing), sorted(m._ledger.storage_ops), list(node.alloc.freed_pages),
            list(node.pool.freed_rows), node.off.host_free_pages(), sorted(node.off.pending_writes))


def running(node, rid="r", row=0, steps=2):
    """A decoding request with no full chunk pending; two more decodes fill one."""
    req = Req(rid, range(4), row=row)
    for t in range(steps):
        req.decode(t)
        node.mgr.offload_kv_cache(req)
    return req


def case_committed_over_allocated(node):
    req = running(node)
    req.decode(5)
    req.decode(6)
    req.kv.kv_allocated_len = req.kv.kv_committed_len - 1
    return lambda: node.mgr.offload_kv_cache(req), InvalidRequest, r"committed 8 > allocated 7"


def case_allocated_beyond_row(node):
    req = running(node)
    req.decode(5)
    req.decode(6)
    req.kv.kv_allocated_len = 10_000
    return lambda: node.mgr.offload_kv_cache(req), InvalidRequest, "exceeds the row width 256"


def case_negative_committed(node):
    req = running(node)
    req.decode(5)
    req.decode(6)
    req.kv.kv_committed_len = -3
    return lambda: node.mgr.offload_kv_cache(req), InvalidRequest, "kv committed length -3 is not a non-negative int"


def case_release_inconsistent_lengths(node):
    req = Req("r", range(8), row=0, finished=True)
    req.kv.kv_allocated_len = 4
    return lambda: node.mgr._release_finished_req(req), InvalidRequest, "committed 8 > allocated 4"


def case_finalize_no_row(node):
    req = Req("r", range(8), row=None)
    return lambda: node.mgr.finalize_release_on_finish(req), InvalidRequest, "no req_to_token row"


def case_finalize_row_out_of_range(node):
    req = Req("r", range(8), row=99)
    return lambda: node.mgr.finalize_release_on_finish(req), InvalidRequest, "row 99 is outside"


def case_row_vanished_mid_decode(node):
    req = running(node)
    req.decode(5)
    req.decode(6)
    req.kv.req_pool_idx = None
    return lambda: node.mgr.offload_kv_cache(req), InvalidRequest, "row changed from 0 to None"


def case_token_out_of_range(node):
    req = running(node, steps=1)
    req.decode(-1)
    req.decode(5)
    req.decode(6)
    return lambda: node.mgr.offload_kv_cache(req), TokenRangeError, "token id -1 at position 6"


def case_token_not_int(node):
    req = running(node, steps=1)
    req.decode("x")
    req.decode(5)
    req.decode(6)
    return lambda: node.mgr.offload_kv_cache(req), TokenRangeError, "token id 'x'"


def case_not_a_request(node):
    junk = types.SimpleNamespace(rid="j", output_ids=[1])
    return lambda: node.mgr.offload_kv_cache(junk), InvalidRequest, "lacks origin_input_ids, kv, finished"


def case_release_not_a_request(node):
    junk = types.SimpleNamespace(rid="j", kv=types.SimpleNamespace(req_pool_idx=0))
    return lambda: node.mgr._release_finished_req(junk), InvalidRequest, "lacks origin_input_ids"


def case_unknown_ack(node):
    req = running(node, steps=3)
    node.off._landed.append(12345)
    return (lambda: (req, node.mgr.check_offload_progress())), UnknownCompletion, "12345"


def case_request_of_another_manager(node):
    other = Node(page_size=4)
    req = running(other)
    return (lambda: (other, node.mgr.finalize_release_on_finish(req))), InvalidRequest, "belongs to another manager"


def case_release_twice(node):
    req = Req("r", range(4), row=0, finished=True)
    node.mgr.finalize_release_on_finish(req)
    return lambda: node.mgr._release_finished_req(req), InvalidTransition, "already released"


def case_readmit_live(node):
    req = running(node)
    return lambda: node.mgr.readmit(req), InvalidTransition, "only a RELEASED request"


def case_after_shutdown(node):
    req = running(node, steps=1)
    node.mgr.shutdown()
    return lambda: node.mgr.offload_kv_cache(req), ManagerClosed, "shut down"


CASES = [v for k, v in sorted(globals().items()) if k.startswith("case_")]


@pytest.mark.parametrize("case", CASES, ids=lambda f: f.__name__[5:])
def test_bad_input_is_a_typed_error_that_changes_nothing(case):
    node = Node(page_size=4)
    call, error, message = case(node)
    before = frozen(node)
    with pytest.raises(error, match=message):
        call()
    assert frozen(node) == before


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(page_size=0), ConfigError, "page_size must be a positive int"),
        (dict(page_size=-16), ConfigError, "page_size must be a positive int"),
        (dict(page_size="16"), ConfigError, "page_size must be a positive int"),
        (dict(page_size=4, offload_stride=6), ConfigError, "not a multiple of page_size"),
        (dict(page_size=4, offload_stride=0), ConfigError, "offload_stride must be a positive int"),
        (dict(page_size=4, namespace_seed="nope"), ConfigError, "namespace_seed"),
        (dict(page_size=4, offloader=None), ConfigError, "no offloader"),
    ],
)
def test_bad_configuration(kwargs, error, message):
    node = Node()
    kwargs.setdefault("offloader", node.off)
    with pytest.raises(error, match=message):
        DecodeOffloadManager(node.pool, node.alloc, **kwargs)


def test_bad_pools():
    node = Node()
    flat = types.SimpleNamespace(req_to_token=torch.zeros(8, dtype=torch.int32), free=lambda r: None)
    with pytest.raises(ConfigError, match="2-D tensor"):
        DecodeOffloadManager(flat, node.alloc, page_size=4, offloader=node.off)
    with pytest.raises(ConfigError, match="no free"):
        DecodeOffloadManager(node.pool, object(), page_size=4, offloader=node.off)


@pytest.mark.parametrize(
    "indices,error",
    [
        (torch.tensor([16.0]), BadIndices),                 # wrong dtype
        (torch.tensor([[16, 17]]), BadIndices),             # wrong shape
        (torch.tensor([10_000_000]), BadIndices),           # outside the pool
        (torch.tensor([64]), NotAllocated),                 # never allocated
    ],
)
def test_allocator_rejects_bad_indices_and_changes_nothing(indices, error):
    alloc = PagedTokenAllocator(256, 16)
    got = alloc.alloc(32)
    free_before = alloc.available_size()
    with pytest.raises(error):
        alloc.free(indices)
    assert alloc.available_size() == free_before
    alloc.free(got)
    with pytest.raises(DoubleFree):
        alloc.free(got)
    alloc.check_integrity()


def _row_pool(**kw):
    return types.SimpleNamespace(**{"req_to_token": torch.zeros(2, 8, dtype=torch.int32), "free": lambda r: None, **kw})


def _allocator(**kw):
    return types.SimpleNamespace(**{"free": lambda s: None, **kw})


@pytest.mark.parametrize("pool, alloc, message", [
    (types.SimpleNamespace(free=lambda r: None), _allocator(), "req_to_token_pool.req_to_token must be a 2-D tensor"),
    (_row_pool(req_to_token=torch.zeros(2, 8, dtype=torch.bool)), _allocator(),
     "req_to_token_pool.req_to_token must hold integer slots, not torch.bool"),
    (types.SimpleNamespace(req_to_token=torch.zeros(2, 8, dtype=torch.int32)), _allocator(),
     "req_to_token_pool has no free(req)"),
    (_row_pool(), object(), "token_to_kv_pool_allocator has no free(indices)"),
    (_row_pool(), _allocator(page_size=-4), "token_to_kv_pool_allocator.page_size must be a positive int, got -4"),
    (_row_pool(), _allocator(page_size="4"), "token_to_kv_pool_allocator.page_size must be a positive int, got '4'"),
    (_row_pool(), _allocator(page_size=True), "token_to_kv_pool_allocator.page_size must be a positive int, got True"),
    (_row_pool(), _allocator(page_size=8), "the allocator's page (8 slots) does not divide the manager's page_size (4): "
     "a stuck copy's quarantined slots would share allocator pages with slots freed at release"),
], ids=["no-table", "bool-table", "no-row-free", "no-slot-free", "negative-page", "str-page", "bool-page", "page-8"])
def test_bad_pools_are_refused_with_what_is_wrong(pool, alloc, message):
    with pytest.raises(ConfigError) as err:
        DecodeOffloadManager(pool, alloc, page_size=4, offloader=Node().off)
    assert str(err.value) == message


def test_an_allocator_without_a_page_size_pages_by_single_slots():
    mgr = DecodeOffloadManager(_row_pool(), _allocator(), page_size=3, offloader=Node(page_size=3).off)
    assert mgr._pools.alloc_page == 1


def test_a_missing_offloader_and_missing_offloader_methods_are_named():
    with pytest.raises(ConfigError) as err:
        DecodeOffloadManager(_row_pool(), _allocator(), page_size=4, offloader=None)
    assert str(err.value) == "no offloader: pass offloader=, or use DecodeOffloadManager.from_stack(build_stack(...))"
    with pytest.raises(ConfigError) as err:
        DecodeOffloadManager(_row_pool(), _allocator(), page_size=4, offloader=object())
    assert str(err.value) == "offloader lacks write, finished_writes, write_storage, finished_storage, free_host, close"


def test_an_offloader_without_close_is_refused_at_construction_and_nothing_is_claimed():
    """transfer/offloader.py: ``close(timeout)`` is part of the protocol, checked once at
    construction (no probing at shutdown): an offloader lacking only it is a ConfigError naming
    it, and the offloader is left free for a manager built over a complete one."""
    from lifecycle_tools.testkit.memory import InMemoryOffloader

    class NoClose:
        def __init__(self):
            self.inner = InMemoryOffloader(page_size=4)
            for m in ("write", "finished_writes", "write_storage", "finished_storage", "free_host"):
                setattr(self, m, getattr(self.inner, m))

    off = NoClose()
    with pytest.raises(ConfigError) as err:
        DecodeOffloadManager(_row_pool(), _allocator(), page_size=4, offloader=off)
    assert str(err.value) == "offloader lacks close"
    off.close = off.inner.close
    DecodeOffloadManager(_row_pool(), _allocator(), page_size=4, offloader=off)
