"""``offload_kv_cache`` at its edges (each case a mutant that survived the suite before it).

No row (None or -1) or no output yet: False and untracked; a first sight that enqueues a
one-token chunk (page 1) says True; a tracked request with its outputs gone says False; the first
bad token is named even after the largest valid one; a release sink without the protocol is a
configuration error; a row moved without ``readmit`` is refused by name.
"""

from __future__ import annotations

import pytest
import torch

from lifecycle import ConfigError, DecodeOffloadManager, InvalidRequest
from lifecycle.errors import InvalidToken
from lifecycle_tools.testkit.doubles import Req
from lifecycle_tools.testkit.sync_trap import as_device_resident, no_host_sync
from tests.support.real_rig import Rig
from transfer import PagedTokenAllocator, ReqToTokenPool
from lifecycle_tools.testkit.memory import InMemoryOffloader

PS = 4


@pytest.mark.parametrize("row", [None, -1])
def test_a_request_without_a_row_is_not_tracked(row):
    rig = Rig(PS)
    req = Req("n", range(8), row=0, outputs=(5, 6, 7, 8, 9))
    req.kv.req_pool_idx = row
    assert rig.mgr.offload_kv_cache(req) is False
    assert rig.mgr.state_of(req) is None


def test_a_first_sight_that_enqueues_one_token_says_true():
    rig = Rig(1)
    req, _ = rig.admit("one", 3, 8, outputs=(5, 6))          # KV for 4 tokens, P = 3: one new
    assert rig.mgr.offload_kv_cache(req) is True
    assert rig.mgr.progress_of(req).inc_len == 1


def test_a_tracked_request_whose_outputs_are_gone_says_false():
    rig = Rig(PS)
    req, _ = rig.admit("g", 8, 16)
    rig.decode(req, 2)
    req.output_ids = []
    assert rig.mgr.offload_kv_cache(req) is False
    assert rig.mgr.stats().chunks_enqueued == 0


def test_the_first_bad_prompt_token_is_named_after_the_largest_valid_one():
    rig = Rig(PS)
    req, _ = rig.admit("t", 8, 12)
    req.origin_input_ids[1] = 2**32 - 1
    req.origin_input_ids[5] = -1
    with pytest.raises(InvalidToken, match=r"token id -1 at position 5 "):
        rig.mgr.offload_kv_cache(req)


def test_the_first_bad_output_token_is_named_after_the_largest_valid_one():
    rig = Rig(PS)
    req, _ = rig.admit("u", 8, 16)
    rig.decode(req, 2)
    req.output_ids[0] = 2**32 - 1                             # position 8
    req.output_ids[2] = 2**32                                 # position 10
    with pytest.raises(InvalidToken, match=r"token id 4294967296 at position 10 "):
        rig.decode(req, 2)


class HalfSink:
    def check(self, plan):
        pass


@pytest.mark.parametrize("sink,missing", [(object(), "check, free"), (HalfSink(), "free")])
def test_a_release_sink_without_the_protocol_is_a_config_error(sink, missing):
    alloc, pool = PagedTokenAllocator(64, PS), ReqToTokenPool(2, 32)
    with pytest.raises(ConfigError, match=f"release_sink lacks {missing}$"):
        DecodeOffloadManager(pool, alloc, page_size=PS, offloader=InMemoryOffloader(page_size=PS),
                             release_sink=sink)


def test_a_row_moved_without_readmit_is_refused_by_name():
    rig = Rig(PS)
    req, _ = rig.admit("m", 8, 16)
    rig.decode(req, 1)
    req.kv.req_pool_idx = rig.pool.alloc()
    with pytest.raises(InvalidRequest, match=r"request 'm': row changed from 0 to 1 without readmit"):
        rig.mgr.offload_kv_cache(req)


class IndexKeeper(InMemoryOffloader):
    """Keeps the slot tensor each copy was handed."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.handed = []

    def write(self, device_indices, ack_id):
        self.handed.append(device_indices)
        return super().write(device_indices, ack_id)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_device_rows_chunk_slots_are_a_fresh_int64_copy(dtype):
    """A device row is never read on the host; the copy gets the chunk's ids as int64, copied out
    of the row (a row rewritten while the copy is in flight does not change what it reads)."""
    off = IndexKeeper(page_size=4, host_pages=64, auto_land=False)
    pool = ReqToTokenPool(4, 64)
    pool.req_to_token = pool.req_to_token.to(dtype)
    rig = Rig(4, pool=pool, offloader=off)
    req, slots = rig.admit("d", 8, 16)
    rig.pool.req_to_token = as_device_resident(rig.pool.req_to_token)
    rig.mgr.req_to_token_pool = rig.pool
    row = req.kv.req_pool_idx
    for t in range(7001, 7005):
        req.decode(t)
        with no_host_sync():
            rig.mgr.offload_kv_cache(req)
    (handed,) = off.handed
    want = [int(s) for s in slots[8:12]]
    assert handed.dtype == torch.int64 and handed.tolist() == want
    rig.pool.req_to_token[row, 8:12] = -1
    assert handed.tolist() == want
