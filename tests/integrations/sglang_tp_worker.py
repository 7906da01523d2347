"""One TP rank for tests/integrations/test_sglang_tp.py (a spawned process, gloo on 127.0.0.1).

Each rank constructs the integration as SGLang's scheduler does, with the TP CPU group, over its
own SGLang-shaped pools, and runs the same replicated decode loop: the same requests, the same
steps, one ``check_offload_progress`` per step, a retraction of the same request at the same step
(through the ``release_kv_cache`` hook), then a collective drain. Rank 1's copies are reported
late (its engine's poll answers every third call only), so the ranks see copies land at different
times. Both ranks write into one store directory, MHA then MLA; the parent checks the outcome.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from lifecycle.integrations.sglang import DecodeKVCacheOffloadManager, use_runtime
from lifecycle.integrations.sglang.install import _release_hook
from lifecycle_tools.testkit.sglang_doubles import release_kv_cache, runtime_context
from tests.integrations.sglang_kit import Node, doubles_kit, sglang_kit

MODEL = "org/M"


def _slow_poll(engine):
    poll, calls = engine.poll, [0]

    def slow():
        calls[0] += 1
        return poll() if calls[0] % 3 == 0 else []

    engine.poll = slow


def _drain(mgr) -> None:
    """Progress checks until every rank is idle: the same number of checks on every rank."""
    while True:
        mgr.check_offload_progress()
        busy = torch.tensor([0 if mgr.idle() else 1])
        dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        if not int(busy):
            return
        time.sleep(0.001)


def _kit():
    """SGLang's own pools and allocator where sglang imports (``.ci/sglang-env``), else the doubles."""
    try:
        return sglang_kit()
    except ImportError:
        return doubles_kit()


def run(rank: int, group, mla: bool, kit) -> dict:
    node = Node(kit, mla=mla)
    full_pages, full_rows = node.alloc.available_size(), node.pool.available_size()
    with use_runtime(runtime_context(page_size=node.ps, model=MODEL)):
        mgr = DecodeKVCacheOffloadManager(req_to_token_pool=node.pool, token_to_kv_pool_allocator=node.alloc,
                                          tp_group=group, tree_cache=node.tree)
    if rank == 1:
        _slow_poll(mgr.offloader.engine)
    hook = _release_hook(release_kv_cache)
    reqs = [node.admit("a", list(range(10, 23)), 14, 0), node.admit("b", list(range(50, 57)), 11, 0)]
    running, step = list(reqs), 0
    while running:
        running = node.decode_step(mgr, running)
        step += 1
        if step == 6:  # retract "b" while its copy is in flight (on rank 1 at least)
            b = reqs[1]
            hook(b, node.tree, is_insert=False)
            b.reset_for_retract()
            node.pool.alloc([b])
            node._grow(b, len(b.origin_input_ids) + len(b.output_ids) - 1)
    _drain(mgr)
    mgr.check_integrity()
    stats = mgr.stats()
    result = {
        "tp": [mgr.tp_rank, mgr.tp_world_size], "released": stats.released, "leaked": stats.leaked,
        "tracked": stats.tracked, "pages": stats.pages_enqueued,
        "pages_back": node.alloc.available_size() == full_pages, "rows_back": node.pool.available_size() == full_rows,
        "skipped": mgr.storage.stats().skipped, "kit": node.kit.name,
    }
    mgr.release_host_resources()
    return result


def main(rank: int, port: int, store: str, out: str) -> None:
    kit = _kit()  # imported before the process group exists: sglang's import takes a while
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    try:
        group = dist.new_group([0, 1], timeout=timedelta(seconds=30))
        results = {}
        for mla in (False, True):
            os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = os.path.join(store, "mla" if mla else "mha")
            results["mla" if mla else "mha"] = run(rank, group, mla, kit)
            dist.barrier()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
