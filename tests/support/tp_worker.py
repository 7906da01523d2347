"""One tensor-parallel rank for tests/lifecycle/test_tp.py (run in a spawned process).

Every rank runs the same replicated scheduler (same requests, same decode steps, same calls), with
its own manager and in-memory offloader; only *when* (and in which order) its copies land and its
storage ops finish differs per rank. After every ``check_offload_progress`` it records what it has
seen land and what the manager has acted on; the parent test compares the ranks.
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist

from lifecycle import DecodeOffloadManager
from lifecycle_tools.testkit.doubles import PagedAllocator, ReqToTokenPool, Req
from lifecycle_tools.testkit.memory import InMemoryOffloader

PS = 4


class RecordingOffloader:
    """An ``InMemoryOffloader`` (auto_land off) that records which acks the manager acts on.

    The manager acts on a landed chunk by calling ``write_storage`` with the chunk's host pages;
    the host pages name the ack.
    """

    def __init__(self) -> None:
        self.inner = InMemoryOffloader(page_size=PS, auto_land=False)
        self.by_host: dict[int, int] = {}
        self.seen_landed: list[int] = []
        self.seen_stored: list[int] = []
        self.acted: list[int] = []

    def write(self, device_indices, ack_id):
        host = self.inner.write(device_indices, ack_id)
        if host is not None:
            self.by_host[int(host[0])] = ack_id
        return host

    def finished_writes(self):
        out = self.inner.finished_writes()
        self.seen_landed += out.landed + out.failed
        return out

    def write_storage(self, host_indices, tokens, page_hashes, parent_hash=None):
        self.acted.append(self.by_host[int(host_indices[0])])
        return self.inner.write_storage(host_indices, tokens, page_hashes, parent_hash)

    def finished_storage(self):
        out = self.inner.finished_storage()
        self.seen_stored += out
        return out

    def free_host(self, host_indices):
        self.inner.free_host(host_indices)

    def close(self, timeout):
        return self.inner.close(timeout)

    def pending_acks(self) -> list[int]:
        return list(self.inner.pending_writes)  # issue (ack id) order


def land_plan(scenario: str, rank: int, step: int, pending: list[int]) -> list[int]:
    """Which pending acks land on this rank at this step, in which order."""
    if scenario == "lag":  # in issue order; rank 1 lags, landing only every third step
        return pending if rank == 0 or step % 3 == 2 else []
    if scenario == "reorder":  # rank 0 lands the oldest pending ack, rank 1 the newest
        if not pending:
            return []
        return pending[:1] if rank == 0 else pending[-1:]
    raise ValueError(scenario)


def run_scenario(scenario: str, rank: int, group) -> dict:
    pool, alloc = ReqToTokenPool(rows=8, width=256), PagedAllocator(page_size=PS)
    off = RecordingOffloader()
    mgr = DecodeOffloadManager(pool, alloc, page_size=PS, offloader=off, tp_group=group)
    reqs = [Req(i, list(range(100 * i, 100 * i + 5 + 2 * i)), i) for i in range(1, 4)]
    running = list(reqs)
    finish_at = {1: 9, 2: 14, 3: 17}
    steps = []

    def observe(step: int) -> None:
        st = mgr.stats()
        steps.append({
            "step": step,
            "landed": list(off.seen_landed),
            "stored": len(off.seen_stored),
            "acted": list(off.acted),
            "chunks_landed": st.chunks_landed,
            "storage_finished": st.storage_finished,
            "released": st.released,
            "states": {str(r.rid): mgr.state_of(r).name for r in reqs},
        })

    for step in range(20):
        for req in running:
            req.decode(5000 + step)
        for req in list(running):
            if finish_at[req.rid] == step:
                req.finish()
                running.remove(req)
                if not mgr.offload_kv_cache(req):
                    mgr.finalize_release_on_finish(req)
            else:
                mgr.offload_kv_cache(req)
        off.inner.land(land_plan(scenario, rank, step, off.pending_acks()))
        if rank == 0 or step % 2:  # storage ops finish on different schedules too
            off.inner.complete_storage()
        mgr.check_offload_progress()
        observe(step)
    for step in range(20, 26):  # drain: the same number of progress checks on every rank
        off.inner.land(off.pending_acks() if scenario == "lag" else off.pending_acks()[:1])
        off.inner.complete_storage()
        mgr.check_offload_progress()
        observe(step)
    return {
        "steps": steps,
        "freed_pages": sorted(alloc.freed_pages),
        "freed_rows": sorted(pool.freed_rows),
        "leaked": mgr.stats().leaked,
        "idle": mgr.idle(),
    }


def main(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    try:
        group = dist.new_group([0, 1], timeout=timedelta(seconds=20))
        result = {name: run_scenario(name, rank, group) for name in ("lag", "reorder")}
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    torch.set_num_threads(1)
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
