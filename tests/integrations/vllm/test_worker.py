"""A worker's executor of the scheduler's jobs (``lifecycle.integrations.vllm.worker.StoreWorker``)
over vLLM-shaped KV tensors and a real storage tier (no vLLM needed): copies into the host pages
the scheduler chose, stores under the given names, delayed requests reported once their copies
ended, the preemption fence, a refused copy reported failed."""

from __future__ import annotations

import threading
import time

import torch

from lifecycle.integrations.vllm.jobs import Free, StepJobs, Store, Write
from lifecycle.integrations.vllm.layout import VllmKVLayout
from lifecycle.integrations.vllm.worker import LayoutCpuCopyEngine, PlacedHostPool, StoreWorker
from lifecycle_tools.testkit.vllm_kv import make_kv_caches, write_kv
from transfer.storage.memory import MemoryStorage

PS = 4


def _worker(engine=None, **kw):
    caches = make_kv_caches("rows", 2, 8, 2, PS, 8, torch.bfloat16)
    write_kv(caches, "rows", torch.randn(2, 2, 8 * PS, 2, 8).to(torch.bfloat16))
    layout = VllmKVLayout.from_kv_caches(caches, PS)
    host = PlacedHostPool.for_layout(layout, 6, pin=False)
    store = MemoryStorage(page_nbytes=host.page_nbytes)
    return StoreWorker(layout, host, store, copy_engine=engine, **kw), layout, store


def _until(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.001)


class _Gate(LayoutCpuCopyEngine):
    """Copies wait for ``open`` (a threading.Event) on the copy thread."""

    def __init__(self):
        super().__init__(1)
        self.open = threading.Event()

    def submit(self, tag, fn):
        super().submit(tag, lambda: (self.open.wait(30), fn())[1])


def test_jobs_run_in_order_and_the_pages_stored_are_the_blocks_bytes():
    w, layout, store = _worker()
    w.run(StepJobs([Write(1, "r", [5, 2], [3, 0])]))
    _until(lambda: (w.poll(), not w._inflight)[1])
    w.run(StepJobs([Store(1, [3, 0], ["a" * 64, "b" * 64], list(range(2 * PS)), None)]))
    _until(lambda: (w.poll(), not w._ops)[1])
    report = w.report()
    assert report.ended == {1: 1} and report.stored == {1: 1} and not report.failed
    pages = layout.page_bytes_of([5, 2])
    buf = torch.empty(layout.page_nbytes, dtype=torch.uint8)
    for name, page in zip(("a" * 64, "b" * 64), pages):
        assert store.batch_get([name], [buf]) == [True]
        assert torch.equal(buf, page.reshape(-1).view(torch.uint8))
    w.run(StepJobs([Free([3, 0])]))
    assert w.host.available_size() == 6 * PS
    w.close()


def test_a_delayed_request_is_reported_once_when_its_copies_ended():
    gate = _Gate()
    w, _, _ = _worker(gate)
    w.run(StepJobs([Write(1, "r", [1], [0])], delayed={"r": [1], "gone": [99]}))
    assert w.finished_sending() == {"gone"}                # no copy of it left here: at once
    assert w.finished_sending() == set()                   # "r": its copy still reads
    gate.open.set()
    _until(lambda: w.finished_sending() == {"r"})
    assert w.finished_sending() == set()
    w.close()


def test_the_preemption_fence_waits_for_the_copies_then_discards_past_its_bound():
    gate = _Gate()
    w, _, store = _worker(gate, fence_timeout_s=60.0)
    w.run(StepJobs([Write(1, "p", [1], [0])]))
    threading.Timer(0.05, gate.open.set).start()
    w.fence({"p": [1]})                                    # returns once the copy ended
    assert not w._inflight and w.fences == 1 and w.fence_discarded == 0
    gate2 = _Gate()
    w2, _, _ = _worker(gate2, fence_timeout_s=0.05)
    w2.run(StepJobs([Write(7, "q", [2], [1])]))
    w2.fence({"q": [7]})                                   # bound passed: discarded, never stored
    assert w2.fence_discarded == 1
    assert w2.report().expired == {7: 1}
    gate2.open.set()
    _until(lambda: (w2.poll(), not w2._inflight)[1])
    w.close(), w2.close()


def test_a_copy_the_offloader_refuses_is_reported_failed_and_its_pages_stay_held_for_the_free():
    w, _, _ = _worker()
    w.run(StepJobs([Write(1, "r", [1], [0])]))
    w.run(StepJobs([Write(2, "r", [2], [0])]))             # host page 0 is held: refused
    _until(lambda: (w.poll(), not w._inflight)[1])
    report = w.report()
    assert report.failed == {2: 1} and report.ended == {1: 1, 2: 1}
    w.run(StepJobs([Free([0])]))                           # the scheduler frees what it allocated
    w.close()
