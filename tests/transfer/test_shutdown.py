"""Bounded shutdown (issue 12): ``close(timeout=...)`` never waits forever on a stuck copy.

A copy that never returns is simulated by a real ``CpuCopyEngine`` (real worker threads, real
gather) whose job for chosen tags blocks on an event the test holds closed. Bounds are checked by
running ``close`` on a helper thread and joining it with a generous limit (a hang fails the test;
no timing is asserted). Every gate is opened at the end so no thread outlives its test.
"""

from __future__ import annotations

import inspect
import threading

import pytest
import torch
from structlog.testing import capture_logs

import hashing
from transfer import CpuCopyEngine, HostOffloader, HostPool, KVPool, MemoryStorage, build_stack
from transfer.gather import ChunkCopy
from transfer.shutdown import DEFAULT_CLOSE_TIMEOUT_S, CloseReport
from transfer.stack import TransferStack
from transfer.worker import BackgroundWorker
from tests.support.transfer_helpers import drain, polls

PS = 4


class StuckEngine(CpuCopyEngine):
    """Copies for tags in ``stuck`` block until ``release`` is set (a copy that never returns)."""

    def __init__(self, threads: int = 1) -> None:
        super().__init__(threads)
        self.release = threading.Event()
        self.stuck: set[int] = set()
        self.started: set[int] = set()

    def to_host(self, tag, kv, host, slots, host_pages):
        plan, hold = ChunkCopy(kv, host, slots, host_pages), tag in self.stuck

        def job():
            self.started.add(tag)
            if hold:
                self.release.wait()  # unbounded on purpose: only close's timeout may end the wait
            return plan.to_host()

        self.submit(tag, job)


class StuckStorage(MemoryStorage):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.release = threading.Event()

    def batch_set(self, keys, pages):
        self.release.wait()
        return super().batch_set(keys, pages)


def make(engine=None, storage=None):
    kv = KVPool(2, 2, 8, torch.bfloat16, 64)
    host = HostPool(2, 2, 8, torch.bfloat16, PS, 32)
    store = storage if storage is not None else MemoryStorage("_m_0_1", host.page_nbytes)
    return HostOffloader(kv, host, store, copy_engine=engine), host


def bounded(fn, limit=20.0):
    """Run ``fn`` on a thread; fail (instead of hanging) if it has not returned within ``limit``."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), "close did not return: it waited on the stuck copy"
    return out[0]


def test_the_default_timeout_is_documented_and_bounded():
    for close in (HostOffloader.close, TransferStack.close):
        default = inspect.signature(close).parameters["timeout"].default
        assert default == DEFAULT_CLOSE_TIMEOUT_S and default is not None
        assert "DEFAULT_CLOSE_TIMEOUT_S" in close.__doc__


def test_stuck_copy_is_abandoned_and_reported_with_its_quarantined_slots_and_pages():
    eng = StuckEngine(threads=1)
    off, host = make(engine=eng)
    eng.stuck.add(1)
    h1 = off.write(torch.arange(8, 16), 1)  # stuck
    h2 = off.write(torch.arange(16, 20), 2)  # queued behind it on the one thread
    drain(lambda: [1] if 1 in eng.started else [], 1)
    with capture_logs() as logs:
        report = bounded(lambda: off.close(timeout=0.05))
    assert isinstance(report, CloseReport) and not report.clean and report.timeout == 0.05
    assert report.abandoned_writes == [1, 2]
    assert report.device_slots == list(range(8, 20))
    assert report.host_pages == sorted(host.page_ids(h1).tolist() + host.page_ids(h2).tolist())
    assert report.abandoned_storage == [] and "quarantined" in report.reason
    (ev,) = [e for e in logs if e["event"] == "offloader.close_timed_out"]
    assert ev["log_level"] == "error" and ev["abandoned_writes"] == [1, 2] and ev["in_flight_writes"] == 2
    assert host.available_size() == 32 - 12  # abandoned pages are never handed back
    eng.release.set()  # the copy finally ends: still reported once, pages then freeable
    assert sorted(drain(polls(off).ended, 2)) == [1, 2]
    off.free_host(h1)
    off.free_host(h2)
    host.check_integrity()


def test_stuck_storage_op_is_abandoned_and_its_pages_stay_busy():
    store = StuckStorage("_m_0_1")
    off, host = make(storage=store)
    h = off.write(torch.arange(8, 12), 1)
    assert drain(polls(off).ended, 1) == [1]
    tokens = [1, 2, 3, 4]
    op = off.write_storage(h, tokens, hashing.page_hashes(tokens, PS))
    report = bounded(lambda: off.close(timeout=0.05))
    assert not report.clean and report.abandoned_storage == [op] and report.abandoned_writes == []
    store.release.set()
    assert drain(off.finished_storage, 1) == [op]
    off.free_host(h)


def test_close_without_stuck_work_is_clean_and_idempotent():
    off, host = make()
    h = off.write(torch.arange(8, 12), 1)
    report = off.close()
    assert report == CloseReport(clean=True, timeout=DEFAULT_CLOSE_TIMEOUT_S)
    assert off.close(timeout=0).clean
    assert drain(polls(off).ended, 1) == [1]
    off.free_host(h)


@pytest.mark.parametrize("bad", [-1, float("nan"), "1", True])
def test_bad_timeout_is_a_value_error_before_anything_closes(bad):
    off, _ = make()
    with pytest.raises(ValueError):
        off.close(timeout=bad)
    assert off.write(torch.arange(8, 12), 1) is not None  # still open
    off.close()


def test_worker_close_bounds_the_total_wait_not_each_thread():
    w = BackgroundWorker("t", threads=3)
    gate = threading.Event()
    for i in range(3):
        w.submit(i, gate.wait)
    drain(lambda: [1] if len(w.unfinished()) == 3 else [], 1)
    assert bounded(lambda: w.close(timeout=0.05)) is False and w.alive()
    assert sorted(w.unfinished()) == [0, 1, 2]
    gate.set()
    assert sorted(d.tag for d in drain(w.poll, 3)) == [0, 1, 2]
    assert w.close(timeout=5) is True and w.unfinished() == []


def stack_with_a_stuck_copy():
    """A stack whose copy engine holds ack 7 (8 slots) until released: (stack, engine, the slots)."""
    stack = build_stack(2, 2, 8, torch.bfloat16, PS, 32, 32, 2, 32)
    eng = StuckEngine(threads=1)
    stack.offloader.engine.close()
    stack.offloader.engine = eng
    eng.stuck.add(7)
    slots = stack.allocator.alloc(8)
    stack.offloader.write(slots, 7)
    drain(lambda: [1] if 7 in eng.started else [], 1)
    return stack, eng, slots


def test_stack_close_takes_a_timeout_and_reports_a_stuck_copy():
    stack, eng, slots = stack_with_a_stuck_copy()
    report = bounded(lambda: stack.close(timeout=0.05))
    assert not report.clean and report.abandoned_writes == [7] and report.device_slots == slots.tolist()
    eng.release.set()
    assert drain(polls(stack.offloader).ended, 1) == [7]
    with pytest.raises(ValueError):
        stack.close(timeout=-1)


def storage_op_with_a_hung_page_write(off, store, monkeypatch):
    """Copy ack 1 (two pages) lands, then its storage op starts on the file tier ``store`` with the
    second page's write blocked in the kernel (``hung_fs.HungWrite``, a FIFO with no reader).
    Returns ``(host indices, page names, op id, the HungWrite)``."""
    from tests.support.hung_fs import HungWrite

    tokens = list(range(1, 2 * PS + 1))
    keys = hashing.page_hashes(tokens, PS)
    hung = HungWrite(store, keys[1] + store.suffix, monkeypatch)
    h = off.write(torch.arange(8, 8 + 2 * PS), 1)
    assert drain(polls(off).ended, 1) == [1]
    op = off.write_storage(h, tokens, keys)  # two pages: written by the store's writer threads
    hung.wait_stuck()
    return h, keys, op, hung


def test_stack_close_is_bounded_through_a_file_write_hung_in_the_filesystem(tmp_path, monkeypatch):
    """reliability.md: ``TransferStack.close(timeout)`` bounds the whole shutdown wait. A file-store
    write blocked in the kernel (a FIFO with no reader) is abandoned and named in the report."""
    stack = build_stack(2, 2, 8, torch.bfloat16, PS, device_tokens=64, host_tokens=32, rows=4, max_len=64,
                        storage=f"file:{tmp_path / 'store'}")
    off, store = stack.offloader, stack.storage
    h, keys, op, hung = storage_op_with_a_hung_page_write(off, store, monkeypatch)
    report = bounded(lambda: stack.close(timeout=0.2))
    assert not report.clean and report.abandoned_storage == [op]
    assert report.abandoned_pages == [keys[1] + store.suffix] and "storage page writes" in report.reason
    hung.release()
    assert drain(off.finished_storage, 1) == [op] and off.failed_storage() == [op]
    off.free_host(h)
    stack.host_pool.check_integrity()


# -- close_storage: a tier's close with or without a timeout, whatever it returns -------------
from transfer.shutdown import close_storage  # noqa: E402


def test_close_storage_passes_the_timeout_only_to_a_close_that_takes_one():
    calls = []

    class Old:                                   # an older custom tier: close() takes nothing
        def close(self):
            calls.append("old")

    class New:
        def close(self, timeout=None):
            calls.append(("new", timeout))
            return {"b", "a"}

    class NoSignature:                           # a close whose signature cannot be read
        __signature__ = 5

        def __call__(self):
            calls.append("opaque")
            return None

    opaque = Old()
    opaque.close = NoSignature()
    assert close_storage(Old(), 1.5) == []
    assert close_storage(New(), 1.5) == ["a", "b"]
    assert close_storage(opaque, 1.5) == []
    assert calls == ["old", ("new", 1.5), "opaque"]


class StuckDeviceEngine(StuckEngine):
    """``StuckEngine`` for slot ids on the device (``HostOffloader.write`` passes ``check_end``)."""

    def to_host(self, tag, kv, host, slots, host_pages, check_end=None):
        super().to_host(tag, kv, host, slots, host_pages)


def test_close_never_reads_slot_ids_on_the_device_it_counts_them():
    """Issue 34, point 5: the report of a close that abandoned copies reads no device memory (such
    a read waits for the device, which may be what is stuck, and can raise): slot ids on the device
    are counted in ``device_slots_unread``, not listed. The stand-in device fails the test on a read."""
    from lifecycle_tools.testkit.sync_trap import as_device_resident, no_host_sync

    eng = StuckDeviceEngine(threads=1)
    off, _ = make(engine=eng)
    eng.stuck.add(3)
    off.write(as_device_resident(torch.arange(8, 16)), 3)
    off.write(torch.arange(16, 20), 4)  # a host row's ids: read and listed as before
    eng.stuck.add(4)
    drain(lambda: [1] if 3 in eng.started else [], 1)
    with no_host_sync():
        report = off.close(timeout=0.05)
    assert not report.clean and report.abandoned_writes == [3, 4]
    assert report.device_slots == [16, 17, 18, 19] and report.device_slots_unread == 8
    assert "8 slot ids on the device, not read" in report.reason
    eng.release.set()
    assert sorted(drain(polls(off).ended, 2)) == [3, 4]


def test_stack_close_that_abandons_a_copy_keeps_the_host_pool_pinned():
    """The host pool is not closed (unpinned) under a copy still in flight: kept until exit."""
    stack, eng, _ = stack_with_a_stuck_copy()
    assert not bounded(lambda: stack.close(timeout=0.05)).clean
    assert stack.host_pool.kept
    eng.release.set()
    assert drain(polls(stack.offloader).ended, 1) == [7]


# -- one bound for everything stuck at once (issue 35) ----------------------------------------
BOUND_S = 4.0   # each stuck part waited out on its own would take >= 2 x BOUND_S


def timed(fn, limit=60.0):
    import time

    t0 = time.monotonic()
    out = bounded(fn, limit)
    return out, time.monotonic() - t0


def test_offloader_close_with_a_stuck_copy_and_a_stuck_storage_write_returns_within_its_timeout():
    """docs (``HostOffloader.close``): at most ``timeout`` seconds in all. A copy that never returns
    and a storage write that never returns at once: the copies' wait and the storage worker's wait
    share the one deadline (a generous margin over it, well under twice it); both are abandoned and
    named."""
    eng, store = StuckEngine(threads=1), StuckStorage("_m_0_1")
    off, host = make(engine=eng, storage=store)
    h = off.write(torch.arange(8, 12), 1)
    assert drain(polls(off).ended, 1) == [1]
    tokens = [1, 2, 3, 4]
    op = off.write_storage(h, tokens, hashing.page_hashes(tokens, PS))    # blocks in batch_set
    eng.stuck.add(2)
    off.write(torch.arange(16, 20), 2)                                    # blocks in the copy
    drain(lambda: [1] if 2 in eng.started else [], 1)
    report, took = timed(lambda: off.close(timeout=BOUND_S))
    assert took < BOUND_S + 2.5, f"close(timeout={BOUND_S}) took {took:.2f} s"
    assert not report.clean and report.abandoned_writes == [2] and report.abandoned_storage == [op]
    eng.release.set()
    store.release.set()
    assert drain(polls(off).ended, 1) == [2] and drain(off.finished_storage, 1) == [op]


def test_stack_close_with_a_stuck_copy_and_a_file_write_hung_in_the_filesystem_returns_within_its_timeout(
        tmp_path, monkeypatch):
    """docs (``TransferStack.close``): at most ``timeout`` seconds in all. A copy that never returns
    and a real file-tier page write blocked in the kernel (a FIFO with no reader, ``hung_fs``) at
    once: the offloader's close, the prefix loader's and the tier's share the one deadline; the
    copy, the storage op and the page write are named in the report."""
    stack = build_stack(2, 2, 8, torch.bfloat16, PS, device_tokens=64, host_tokens=32, rows=4, max_len=64,
                        storage=f"file:{tmp_path / 'store'}")
    eng = StuckEngine(threads=1)
    stack.offloader.engine.close()
    stack.offloader.engine = eng
    off, store = stack.offloader, stack.storage
    _, keys, op, hung = storage_op_with_a_hung_page_write(off, store, monkeypatch)
    eng.stuck.add(2)
    off.write(torch.arange(24, 28), 2)
    drain(lambda: [1] if 2 in eng.started else [], 1)
    report, took = timed(lambda: stack.close(timeout=BOUND_S))
    assert took < BOUND_S + 2.5, f"stack.close(timeout={BOUND_S}) took {took:.2f} s"
    assert not report.clean and report.abandoned_writes == [2] and report.abandoned_storage == [op]
    assert report.abandoned_pages == [keys[1] + store.suffix]
    assert stack.host_pool.kept                       # a copy may still write into it
    eng.release.set()
    hung.release()
    assert drain(polls(off).ended, 1) == [2]
    assert drain(off.finished_storage, 1) == [op] and off.failed_storage() == [op]


def test_file_tier_close_with_a_hung_page_write_returns_within_its_timeout(tmp_path, monkeypatch):
    """docs (``FileStorage.close``): at most ``timeout`` seconds in all: the writer threads' join and
    the wait for the writes in flight share one deadline. A real page write blocked in the kernel
    (``hung_fs``), on a writer thread."""
    import threading

    from tests.support.hung_fs import HungWrite
    from transfer.storage.file import FileStorage

    store = FileStorage(tmp_path / "store", "_f", 64)
    keys = hashing.page_hashes(list(range(1, 2 * PS + 1)), PS)
    hung = HungWrite(store, keys[1] + store.suffix, monkeypatch)
    pages = [torch.full((64,), i, dtype=torch.uint8) for i in range(2)]
    writer = threading.Thread(target=lambda: store.batch_set(keys, pages), daemon=True)
    writer.start()
    hung.wait_stuck()
    abandoned, took = timed(lambda: store.close(timeout=BOUND_S))
    assert took < BOUND_S + 2.5, f"close(timeout={BOUND_S}) took {took:.2f} s"
    assert abandoned == [keys[1] + store.suffix]
    hung.release()
    writer.join(30)
    assert not writer.is_alive()
