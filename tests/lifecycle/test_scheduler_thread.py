"""The per-chunk path on the scheduler thread lets no worker in (docs/architecture.md, "The GIL on
the scheduler thread"): over a real host stack (``HostOffloader``, its copy and storage workers, the
paged allocator, the row pool), a chunk's enqueue, its landing and storage, several storage ops'
host pages freed in one call, and a release call no torch op that lets the GIL go. The torch calls
this thread makes are recorded with a ``TorchFunctionMode`` (this thread's only: the workers' own
copies are not in it)."""

from __future__ import annotations

import time

import numpy as np

import torch
from torch.overrides import TorchFunctionMode

from lifecycle import DecodeOffloadManager
from lifecycle_tools.testkit.doubles import Req
from transfer import build_stack

PS = 4
# what the scheduler thread may call on a tensor: reads of its values into NumPy / Python and of
# its attributes (``__get__``: dtype, shape, is_cpu, _version ...; ``is_inference``); none of them
# releases the GIL
KEEPS_THE_GIL = {"numpy", "tolist", "__get__", "dim", "numel", "__len__", "is_inference"}


class TorchCalls(TorchFunctionMode):
    """The names of the torch functions and tensor methods called while active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def _admit(stack, rid, prompt_len, room):
    row = stack.req_to_token_pool.alloc()
    slots = stack.allocator.alloc(room)
    stack.req_to_token_pool.req_to_token[row, : slots.numel()] = slots.to(torch.int32)
    return Req(rid, [1000 + i for i in range(prompt_len)], row=row, outputs=(7000,))


def _until(cond, what, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_a_chunks_whole_life_and_a_release_call_no_torch_op_that_lets_the_gil_go():
    stack = build_stack(2, 2, 8, torch.float16, PS, 256, 256, 4, 64)
    mgr = DecodeOffloadManager.from_stack(stack)
    try:
        reqs = [_admit(stack, f"r{i}", 2 * PS + 1, 40) for i in range(2)]
        for req in reqs:
            assert mgr.offload_kv_cache(req) is False  # first sight: tracked, nothing due yet
        calls = TorchCalls()
        with calls:
            for req in reqs:  # one page of decode KV each: a chunk due for both
                for t in range(PS):
                    req.decode(7001 + t)
                assert mgr.offload_kv_cache(req) is True
        _until(lambda: _landed(stack), "the copies")
        with calls:
            mgr.check_offload_progress()  # both landed: their storage writes submitted
        assert mgr.stats().inflight_writes == 0
        # both storage ops reported done (collected, not settled): one progress check frees their pages together
        _until(lambda: mgr.pending().unsettled == 2, "both storage ops reported")
        assert stack.storage.batch_exists(_names(mgr, reqs)) == 2
        with calls:
            mgr.check_offload_progress()
            for req in reqs:
                req.finish()
                assert mgr.offload_kv_cache(req) is False
                mgr.finalize_release_on_finish(req)
        assert mgr.idle() and all(mgr.state_of(r).name == "RELEASED" for r in reqs)
        assert set(calls.names) <= KEEPS_THE_GIL, sorted(set(calls.names) - KEEPS_THE_GIL)
        mgr.shutdown()
    finally:
        stack.close()


def _landed(stack) -> bool:
    """Both copies reported by the copy engine (not yet settled by the manager)."""
    return not stack.offloader.engine.unfinished() and stack.offloader.engine.pending == 2


def _names(mgr, reqs) -> list[str]:
    return [mgr.progress_of(r).last_hash for r in reqs]


def test_a_host_rows_chunk_makes_no_torch_call_on_this_thread_from_enqueue_to_stored():
    """A row in host memory: the manager hands ``write`` the chunk's slot ids as NumPy, gets its host
    indices back as a read-only NumPy array, and hands those to ``write_storage`` and ``free_host``:
    from the enqueue to the host pages freed after storage, this thread makes no torch call (a tensor
    made or read costs 10-25 µs on cold caches; docs/architecture.md, "The GIL on the scheduler
    thread"). Two rounds of two chunks; the second is recorded (the first made the row table's
    NumPy view, once per table)."""
    stack = build_stack(2, 2, 8, torch.float16, PS, 256, 256, 4, 64)
    mgr = DecodeOffloadManager.from_stack(stack)
    try:
        reqs = [_admit(stack, f"r{i}", 2 * PS + 1, 40) for i in range(2)]
        for req in reqs:
            assert mgr.offload_kv_cache(req) is False
        for round_ in range(2):
            calls = TorchCalls()
            with calls:
                for req in reqs:
                    for t in range(PS):
                        req.decode(7001 + t)
                    assert mgr.offload_kv_cache(req) is True
            chunks = list(mgr._ledger.ongoing.values())
            assert [type(c.indices) for c in chunks] == [np.ndarray] * 2
            assert all(type(c.host) is np.ndarray and not c.host.flags.writeable for c in chunks)
            _until(lambda: _landed(stack), "the copies")
            with calls:
                mgr.check_offload_progress()
            _until(lambda: mgr.pending().unsettled == 2, "both storage ops reported")
            free_before = stack.host_pool.available_size()
            with calls:
                mgr.check_offload_progress()  # both ops' host pages freed in one call
            assert stack.host_pool.available_size() == free_before + 2 * PS
            assert stack.storage.batch_exists(_names(mgr, reqs)) == 2
        assert calls.names == []
        for req in reqs:
            req.finish()
            mgr.finalize_release_on_finish(req)
        assert mgr.idle() and all(mgr.state_of(r).name == "RELEASED" for r in reqs)
        mgr.shutdown()
    finally:
        stack.close()
