"""``lifecycle_tools/simulate/runner.py``: the end of a pass."""

from __future__ import annotations

import threading
import time
import types

import torch

from lifecycle_tools.simulate.runner import shut_down
from tests.support.real_rig import Rig
from tests.transfer.test_shutdown import StuckEngine
from transfer import HostOffloader, HostPool, KVPool, MemoryStorage

CLOSE_S = 3.0   # the old code gave the manager's shutdown and the stack's close this bound each: >= 6 s


def test_shut_down_is_one_bound_for_the_managers_shutdown_and_the_stacks_close():
    """docs (runner.shut_down): the manager's shutdown and the stack's close share ``close_s``. A
    real ``HostOffloader`` whose copy never returns (a real copy engine whose job waits on an
    event): the forced shutdown waits the bound out; the close after it gets what is left, not the
    bound again (the close is the offloader's own, as ``TransferStack.close`` calls it)."""
    eng = StuckEngine(threads=1)
    kv = KVPool(1, 1, 2, torch.float16, 4 * 64 + 4)
    host = HostPool(1, 1, 2, torch.float16, 4, 64)
    off = HostOffloader(kv, host, MemoryStorage("_m_0_1", host.page_nbytes), copy_engine=eng)
    rig = Rig(4, offloader=off)
    eng.stuck.add(1)
    req, _ = rig.admit("q", 8, 16)
    rig.decode(req, 4)                                # ack 1, stuck
    deadline = time.monotonic() + 30
    while 1 not in eng.started:
        assert time.monotonic() < deadline, "the copy never started"
        time.sleep(0.01)
        rig.progress()
    try:
        out, done = [], threading.Event()
        t0 = time.monotonic()
        threading.Thread(target=lambda: (out.append(shut_down(rig.mgr, types.SimpleNamespace(close=off.close),
                                                              drain_s=0.0, close_s=CLOSE_S)), done.set()),
                         daemon=True).start()
        assert done.wait(60), "shut_down never returned"
        took = time.monotonic() - t0
        assert took < CLOSE_S + 2.0, f"shut_down(close_s={CLOSE_S}) took {took:.2f} s"
        assert "1 copies" in out[0] and rig.mgr.closed
    finally:
        eng.release.set()
