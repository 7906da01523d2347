"""Construction and per-chunk reading edges (each case a mutant that survived the suite before it).

``from_stack`` passes every option through; the per-chunk path honours
``effective_kv_committed_len()`` like the first sight does; a request may allocate its whole row.
"""

from __future__ import annotations

import pytest
import torch

from lifecycle import DecodeOffloadManager, InvalidRequest, State
from lifecycle.release import AllocatorReleaseSink
from lifecycle_tools.testkit.doubles import EffectiveReq
from tests.support.ranks import world  # noqa: F401 (fixture)
from tests.support.real_rig import Rig
from transfer import build_stack

PS = 4


def test_from_stack_passes_every_option_through(world):
    stack = build_stack(1, 1, 2, torch.float16, PS, 64, 64, 4, 32)
    sink = AllocatorReleaseSink(stack.req_to_token_pool, stack.allocator)
    seed = "ef" * 32
    try:
        mgr = DecodeOffloadManager.from_stack(stack, offload_stride=8, namespace_seed=seed,
                                              tp_group=world, release_sink=sink)
        assert (mgr.offload_stride, mgr.namespace_seed, mgr.release_sink, mgr.page_size) == (8, seed, sink, PS)
        assert mgr.offloader is stack.offloader and mgr.tp_group is world
        mgr.shutdown()
    finally:
        stack.close()


def test_the_per_chunk_path_honours_the_effective_committed_length():
    rig = Rig(PS)
    row = rig.pool.alloc()
    rig.pool.req_to_token[row, :32] = rig.alloc.alloc(32).to(torch.int32)
    req = EffectiveReq("e", [1000 + i for i in range(8)], row=row, effective=8)
    assert rig.mgr.offload_kv_cache(req) is False         # tracked
    for t in range(5):                                    # kv says 13 committed, effective 9
        req.decode(7000 + t)
    req.effective = 9
    with pytest.raises(InvalidRequest, match=r"chunk \[8, 12\) has tokens whose KV is not committed \(committed 9\)"):
        rig.mgr.offload_kv_cache(req)
    req.effective = 12
    assert rig.mgr.offload_kv_cache(req) is True


def test_a_request_may_allocate_its_whole_row():
    rig = Rig(PS, width=16)
    req, _ = rig.admit("w", 8, 16)
    rig.decode(req, 4)
    req.kv.kv_allocated_len = 16                          # the row's full width
    rig.decode(req, 1, first=7100)
    req.finish()
    rig.mgr.finalize_release_on_finish(req)
    rig.off.land()
    rig.progress()
    assert rig.mgr.state_of(req) is State.RELEASED
