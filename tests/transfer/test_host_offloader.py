import errno
import threading

import numpy as np
import pytest
import torch

import hashing
from transfer import BadIndices, Closed, CpuCopyEngine, DoubleFree, HostOffloader, HostPagesBusy, HostPool, KVPool, MemoryStorage, NotAllocated, Offloader, TransferError, UnknownId
from lifecycle_tools.testkit.kv_pattern import synthetic_kv
from tests.support.transfer_helpers import drain, polls

PS = 4


def make(host_tokens=32, engine=None, **offloader_kwargs):
    """An offloader over a small KV pool, host pool and memory tier (``offloader_kwargs``: e.g.
    ``write_timeout_s``, ``clock``); returns ``(offloader, kv, host, store)``."""
    kv = KVPool(2, 2, 8, torch.bfloat16, 64)
    host = HostPool(2, 2, 8, torch.bfloat16, PS, host_tokens)
    store = MemoryStorage("_m_0_1", host.page_nbytes)
    return HostOffloader(kv, host, store, copy_engine=engine, **offloader_kwargs), kv, host, store


def test_is_an_offloader():
    off, *_ = make()
    assert isinstance(off, Offloader)
    off.close()


def test_write_store_free_cycle():
    off, kv, host, store = make()
    slots = torch.arange(8, 16)
    kv.write(slots, synthetic_kv(kv, 1, torch.arange(8)))
    h = off.write(slots, ack_id=11)
    assert h.numel() == 8
    assert drain(polls(off).ended, 1) == [11]
    tokens = list(range(8))
    hashes = hashing.page_hashes(tokens, PS)
    op = off.write_storage(h, tokens, hashes)
    assert drain(off.finished_storage, 1) == [op]
    assert off.failed_storage() == []
    assert store.batch_exists(hashes) == 2
    off.free_host(h)
    with pytest.raises(DoubleFree):
        off.free_host(h)
    st = off.stats()
    assert (st.writes, st.writes_landed, st.storage_ok, st.pages_stored, st.host_free_pages) == (1, 1, 1, 2, 8)
    assert off.idle()
    off.close()


def test_host_short_returns_none_and_enqueues_nothing():
    off, kv, host, _ = make(host_tokens=4)
    assert off.write(torch.arange(8, 16), 1) is None
    assert off.stats().writes_rejected == 1 and host.available_size() == 4 and off.idle()
    off.close()


def test_bad_input_rejected_and_nothing_changes():
    off, kv, host, _ = make()
    with pytest.raises(BadIndices):
        off.write(torch.arange(9, 13), 1)  # not page aligned
    with pytest.raises(BadIndices):
        off.write(torch.arange(0, 3), 1)
    with pytest.raises(BadIndices):
        off.write(torch.arange(64, 68), 1)  # outside the pool
    h = off.write(torch.arange(8, 12), 1)
    with pytest.raises(UnknownId):
        off.write(torch.arange(12, 16), 1)
    drain(polls(off).ended, 1)
    with pytest.raises(BadIndices):
        off.write_storage(h, [1, 2, 3], ["x"])
    with pytest.raises(NotAllocated):
        off.write_storage(torch.arange(28, 32), [1, 2, 3, 4], ["x"])
    assert host.available_size() == 28 and off.idle()
    off.close()


def test_out_of_order_acks_and_busy_pages():
    eng = CpuCopyEngine(threads=2)
    off, kv, host, _ = make(engine=eng)
    gate = threading.Event()
    # hold the first worker thread so ack 2 lands before ack 1
    real = eng.to_host

    def gated(tag, *a):
        if tag == 1:
            from transfer.gather import ChunkCopy
            plan = ChunkCopy(*a)
            eng.submit(tag, lambda: (gate.wait(10), plan.to_host()))
        else:
            real(tag, *a)

    eng.to_host = gated
    h1 = off.write(torch.arange(8, 12), 1)
    off.write(torch.arange(12, 16), 2)
    assert drain(polls(off).ended, 1) == [2]
    with pytest.raises(HostPagesBusy):
        off.free_host(h1)  # its copy has not landed
    with pytest.raises(TransferError):
        off.write_storage(h1, [0] * PS, ["a"])
    gate.set()
    assert drain(polls(off).ended, 1) == [1]
    off.close()


def test_storage_failure_counted_reported_and_host_pages_freeable(monkeypatch):
    off, kv, host, store = make()

    def enospc(name, page, *seal):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "_write", enospc)
    h = off.write(torch.arange(8, 16), 5)
    drain(polls(off).ended, 1)
    tokens = list(range(8))
    op = off.write_storage(h, tokens, hashing.page_hashes(tokens, PS))
    assert drain(off.finished_storage, 1) == [op]
    assert off.failed_storage() == [op]
    assert off.stats().storage_failed == 1 and store.stats().errors == 2   # both pages failed
    off.free_host(h)
    assert host.available_size() == 32
    host.check_integrity()
    off.close()


def test_storage_exception_is_a_failed_op_not_a_crash(monkeypatch):
    off, kv, host, store = make()
    monkeypatch.setattr(store, "batch_set", lambda k, p: 1 / 0)
    h = off.write(torch.arange(8, 12), 1)
    drain(polls(off).ended, 1)
    op = off.write_storage(h, [1, 2, 3, 4], ["k"])
    assert drain(off.finished_storage, 1) == [op] and off.stats().storage_failed == 1
    off.free_host(h)
    off.close()


def test_failed_copy_poisons_pages():
    eng = CpuCopyEngine(threads=1)
    off, kv, host, store = make(engine=eng)
    eng.to_host = lambda tag, *a: eng.submit(tag, lambda: 1 / 0)
    h = off.write(torch.arange(8, 12), 1)
    assert drain(polls(off).ended, 1) == [1] and off.stats().copy_failures == 1
    op = off.write_storage(h, [1, 2, 3, 4], ["0" * 64])
    assert drain(off.finished_storage, 1) == [op] and off.failed_storage() == [op]
    assert store.batch_exists(["0" * 64]) == 0
    off.free_host(h)
    off.close()


def test_close_drains_and_refuses_new_work():
    off, kv, host, _ = make()
    h = off.write(torch.arange(8, 12), 1)
    off.close()
    assert drain(polls(off).ended, 1) == [1]
    with pytest.raises(Closed):
        off.write(torch.arange(12, 16), 2)
    off.free_host(h)
    off.close()


def test_backpressure_is_counted_always_and_warned_at_most_once_per_interval():
    from structlog.testing import capture_logs

    class Clock:
        t = 100.0

        def __call__(self):
            return self.t

    clock = Clock()
    kv = KVPool(2, 2, 8, torch.bfloat16, 64)
    host = HostPool(2, 2, 8, torch.bfloat16, PS, 8)  # room for one 2-page chunk
    off = HostOffloader(kv, host, MemoryStorage("_m_0_1", host.page_nbytes), clock=clock,
                        backpressure_log_interval_s=5.0)
    with capture_logs() as logs:
        for i in range(50):  # stretches of rejections broken by accepted writes, within one interval
            h = off.write(torch.arange(8, 16), 2 * i)
            assert off.write(torch.arange(16, 24), 2 * i + 1) is None
            assert drain(polls(off).ended, 1) == [2 * i]
            off.free_host(h)
        clock.t += 5.0
        assert off.write(torch.arange(16, 24), 1000) is not None
        assert off.write(torch.arange(16, 24), 1001) is None  # a new interval: one more warning
    warned = [e for e in logs if e["event"] == "offloader.host_exhausted"]
    assert [e["log_level"] for e in warned] == ["warning", "warning"]
    assert [e["rejected"] for e in warned] == [1, 50]  # the second carries everything since the first
    assert warned[1]["rejected_total"] == 51 == off.stats().writes_rejected
    drain(polls(off).ended, 1)
    off.close()


def test_backpressure_interval_must_not_be_negative():
    kv = KVPool(2, 2, 8, torch.bfloat16, 64)
    host = HostPool(2, 2, 8, torch.bfloat16, PS, 8)
    with pytest.raises(ValueError):
        HostOffloader(kv, host, MemoryStorage("_m_0_1", host.page_nbytes), backpressure_log_interval_s=-1)


@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_the_copy_reads_the_slots_given_at_write_time_not_a_reused_index_buffer(kind):
    """The plan is built on the copy worker, later: a caller reusing its index tensor (or NumPy
    array, as the manager hands a host row's ids over) after ``write`` returned must not redirect
    the copy (regression: int64 CPU indices were aliased)."""
    gate = threading.Event()

    class Late(CpuCopyEngine):  # plans and runs the copy on the worker once the gate opens
        def to_host(self, tag, kv, host, slots, host_pages):
            from transfer.gather import ChunkCopy

            def job():
                gate.wait(10)
                ChunkCopy(kv, host, slots, host_pages).to_host()

            self.submit(tag, job)

    eng = Late(threads=1)
    off, kv, host, _ = make(engine=eng)
    kv.write(torch.arange(64), synthetic_kv(kv, 3, torch.arange(64)))
    idx = torch.arange(8, 16) if kind == "tensor" else np.arange(8, 16)
    h = off.write(idx, 1)
    idx[:] = torch.arange(40, 48) if kind == "tensor" else np.arange(40, 48)  # the caller reuses its buffer
    gate.set()
    assert drain(polls(off).ended, 1) == [1]
    want = kv.read(torch.arange(8, 16))  # [kinds, layers, 8, heads, dim]
    for i, p in enumerate(host.page_ids(h).tolist()):
        page = want[:, :, i * PS:(i + 1) * PS].permute(0, 2, 1, 3, 4).contiguous()
        assert torch.equal(host.page_view(p).view(torch.uint8), page.view(torch.uint8))
    off.free_host(h)
    off.close()


def test_expire_reports_the_copies_once_and_poisons_their_pages():
    """``expire``: the caller stops waiting for these copies now (their slots are being freed by
    someone else); reported expired once by ``finished_writes``, then failed, never stored."""
    off, kv, host, store = make()
    h = off.write(torch.arange(8, 12), 1)
    assert off.expire([1, 1, 99]) == [1]          # ids not in flight, and repeats, are skipped
    assert off.expire([1]) == []
    assert polls(off).expired() == [1] and polls(off).expired() == []
    assert drain(polls(off).ended, 1) == [1] and polls(off).failed() == [1]
    op = off.write_storage(h, [1, 2, 3, 4], ["0" * 64])
    assert drain(off.finished_storage, 1) == [op] and off.failed_storage() == [op]
    assert store.batch_exists(["0" * 64]) == 0 and off.stats().copies_discarded == 1
    off.free_host(h)
    off.close()


# -- contract details: error messages, log events, hooks, counters ----------------------------
from structlog.testing import capture_logs  # noqa: E402

from lifecycle_tools.testkit.sync_trap import as_device_resident  # noqa: E402
from transfer.errors import StorageError as StorageErrorT  # noqa: E402
from transfer.gather import ChunkCopy  # noqa: E402
from transfer.kv_events.announcer import HostAnnouncer, TierAnnouncer  # noqa: E402


class FakeClock:
    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t


class Gated(CpuCopyEngine):
    """A real CPU engine whose copies for tags in ``hold`` wait on ``gate`` and for tags in
    ``fail`` raise (after the gate)."""

    def __init__(self, threads=1):
        super().__init__(threads)
        self.gate, self.hold, self.fail, self.started = threading.Event(), set(), set(), set()

    def to_host(self, tag, kv, host, slots, host_pages):
        plan, hold, fail = ChunkCopy(kv, host, slots, host_pages), tag in self.hold, tag in self.fail

        def job():
            self.started.add(tag)
            if hold and not self.gate.wait(10):
                raise TimeoutError("test gate never opened")
            if fail:
                raise RuntimeError(f"injected copy failure {tag}")
            return plan.to_host()

        self.submit(tag, job)


class Publisher:
    """Records the KV events the announcers publish."""

    def __init__(self):
        self.events = []

    def stored(self, medium, hashes, tokens, block_size, parent):
        self.events.append(("stored", medium, list(hashes), list(tokens), block_size, parent))

    def removed(self, medium, hashes):
        self.events.append(("removed", medium, list(hashes)))


class Observer:
    def __init__(self):
        self.copies, self.storage = [], []

    def copy_seconds(self, s):
        self.copies.append(s)

    def storage_seconds(self, op, s):
        self.storage.append((op, s))


def landed(off, ack, n_slots=8, first=8):
    h = off.write(torch.arange(first, first + n_slots), ack)
    assert drain(polls(off).ended, 1) == [ack]
    return h


def events(logs, name):
    return [e for e in logs if e["event"] == name]


def test_argument_errors_name_the_argument_and_the_problem():
    kv = KVPool(2, 2, 8, torch.bfloat16, 64)
    host = HostPool(2, 2, 8, torch.bfloat16, PS, 32)
    with pytest.raises(ValueError, match=r"write_timeout_s must be > 0 or None, got 0"):
        HostOffloader(kv, host, MemoryStorage("_m_0_1", host.page_nbytes), write_timeout_s=0)
    off, kv, host, _ = make()
    with pytest.raises(BadIndices, match=r"^a write needs at least one page$"):
        off.write(torch.arange(0), 1)
    with pytest.raises(BadIndices, match=r"^device indices: 3 slots is not a whole number of pages of 4$"):
        off.write(torch.arange(3), 1)
    with pytest.raises(BadIndices, match=r"^device indices must have an integer dtype"):
        off.write(torch.arange(4.0), 1)
    with pytest.raises(BadIndices, match=r"^device indices: 6 slots is not a whole number of pages of 4$"):
        off.write(as_device_resident(torch.arange(6)), 1)   # slot ids on a device: shape checked here
    h = off.write(torch.arange(8, 12), 1)
    with pytest.raises(UnknownId, match=r"ack id 1 is already pending"):
        off.write(torch.arange(12, 16), 1)
    with pytest.raises(TransferError, match=r"^write_storage of host pages whose copy has not landed$"):
        off.write_storage(h, [1, 2, 3, 4], ["k"])
    with pytest.raises(HostPagesBusy, match=r"^host pages are still used by an in-flight copy or storage op$"):
        off.free_host(h)
    with pytest.raises(UnknownId, match=r"ack id 7 is not a copy in flight"):
        off.discard_write(7)
    drain(polls(off).ended, 1)
    with pytest.raises(BadIndices, match=r"^1 host pages, 2 hashes, 3 tokens \(page size 4\)$"):
        off.write_storage(h, [1, 2, 3], ["a", "b"])
    for bad in ([""], [123]):
        with pytest.raises(BadIndices, match=r"^page hashes must be non-empty strings$"):
            off.write_storage(h, [1, 2, 3, 4], bad)
    with pytest.raises(NotAllocated, match=r"^host pages passed to write_storage are not allocated$"):
        off.write_storage(torch.arange(28, 32), [1, 2, 3, 4], ["x"])
    assert off.stats().storage_ops == 0 and host.available_size() == 28
    off.free_host(h)
    off.close()


def test_after_close_the_offloader_itself_refuses_new_work():
    off, kv, host, _ = make()
    h = landed(off, 1, 4)
    off.close()
    with pytest.raises(Closed, match=r"^offloader is closed$"):
        off.write(torch.arange(12, 16), 2)
    with pytest.raises(Closed, match=r"^offloader is closed$"):
        off.write_storage(h, [1, 2, 3, 4], ["k"])
    assert host.available_size() == 28 and off.stats().writes == 1
    off.free_host(h)


def test_zero_backpressure_interval_warns_on_every_rejection_and_recovery_is_logged_once():
    kv = KVPool(2, 2, 8, torch.bfloat16, 64)
    host = HostPool(2, 2, 8, torch.bfloat16, PS, 8)
    off = HostOffloader(kv, host, MemoryStorage("_m_0_1", host.page_nbytes), backpressure_log_interval_s=0)
    with capture_logs() as logs:
        h = off.write(torch.arange(8, 12), 1)            # 1 page: 1 page left
        assert off.write(torch.arange(16, 24), 2) is None
        assert off.write(torch.arange(16, 24), 3) is None
        h2 = off.write(torch.arange(24, 28), 4)          # recovered: logged once
        drain(polls(off).ended, 2)
        off.free_host(h2)
        h2 = off.write(torch.arange(24, 28), 5)          # no rejection since: nothing logged
        drain(polls(off).ended, 1)
    warned = events(logs, "offloader.host_exhausted")
    assert [{k: e[k] for k in ("ack_id", "pages", "rejected", "rejected_total", "host_free_pages",
                               "next_warning_after_s")} for e in warned] == [
        dict(ack_id=2, pages=2, rejected=1, rejected_total=1, host_free_pages=1, next_warning_after_s=0),
        dict(ack_id=3, pages=2, rejected=1, rejected_total=2, host_free_pages=1, next_warning_after_s=0),
    ]
    assert all(type(e["host_free_pages"]) is int for e in warned)
    assert [(e["log_level"], e["rejected"]) for e in events(logs, "offloader.host_recovered")] == [("info", 2)]
    st = off.stats()
    assert st.host_free_pages == 0 and type(off.stats().host_free_pages) is int
    off.free_host(h)
    off.free_host(h2)
    assert off.stats().host_free_pages == 2
    off.close()


def test_idle_is_false_while_a_copy_is_unreported():
    off, *_ = make()
    h = off.write(torch.arange(8, 12), 1)
    assert not off.idle()
    drain(polls(off).ended, 1)
    assert off.idle()
    off.free_host(h)
    off.close()


def test_observer_times_each_copy_from_write_to_its_report():
    import time

    off, *_ = make(engine=CpuCopyEngine(threads=1))
    h1 = off.write(torch.arange(8, 12), 1)          # written before the observer was attached
    obs = off.observer = Observer()
    t0 = time.perf_counter()
    h2 = off.write(torch.arange(12, 16), 2)
    off.close()                                     # both copies have run: one poll reports both
    assert sorted(polls(off).ended()) == [1, 2]
    elapsed = time.perf_counter() - t0
    assert len(obs.copies) == 1                     # ack 1 was not timed
    assert isinstance(obs.copies[0], float) and 0 <= obs.copies[0] <= elapsed
    off.free_host(h1)
    off.free_host(h2)


def test_discarded_copy_does_not_taint_other_copies_and_counts_once():
    off, kv, host, store = make()
    with capture_logs() as logs:
        h1 = off.write(torch.arange(8, 16), 1)
        h2 = off.write(torch.arange(16, 20), 2)
        h3 = off.write(torch.arange(20, 24), 3)
        off.discard_write(1)
        off.discard_write(1)                        # a second call changes nothing
        off.discard_write(3)
        assert sorted(drain(polls(off).ended, 3)) == [1, 2, 3]
    assert sorted(polls(off).failed()) == [1, 3]
    assert off.stats().copies_discarded == 2 and off.stats().copy_expired == 0
    assert [{k: e[k] for k in ("log_level", "ack_id", "pages")} for e in events(logs, "offloader.copy_discarded")] \
        == [dict(log_level="warning", ack_id=1, pages=2), dict(log_level="warning", ack_id=3, pages=1)]
    assert sorted(polls(off).expired()) == [1, 3]   # each once: a poll checks expiry before endings
    # the ack ids can be used again: the new copies are good ones
    for ack, first in ((1, 24), (3, 28)):
        h = off.write(torch.arange(first, first + 4), ack)
        assert drain(polls(off).ended, 1) == [ack]
        assert polls(off).failed() == []
        off.free_host(h)
    for h in (h1, h2, h3):
        off.free_host(h)
    off.close()


def test_expired_copies_are_counted_logged_and_their_ack_ids_reusable():
    clock = FakeClock()
    eng = Gated(threads=1)
    off, kv, host, _ = make(engine=eng, write_timeout_s=5.0, clock=clock)
    eng.hold |= {1, 2}
    eng.fail.add(2)
    with capture_logs() as logs:
        h1 = off.write(torch.arange(8, 16), 1)
        h2 = off.write(torch.arange(16, 20), 2)
        clock.t += 2.0
        h3 = off.write(torch.arange(20, 24), 3)     # deadline later than the others
        clock.t += 3.0
        assert polls(off).expired() == [1, 2]
        eng.gate.set()
        assert sorted(drain(polls(off).ended, 3)) == [1, 2, 3]
    assert polls(off).failed() == [1, 2]
    assert off.stats().copy_expired == 2 and off.stats().copy_failures == 1
    exp = events(logs, "offloader.copy_expired")
    assert [(e["log_level"], e["ack_id"], e["timeout_s"], e["pages"]) for e in exp] == [("error", 1, 5.0, 2)]
    (failed,) = events(logs, "offloader.copy_failed")
    assert failed["ack_id"] == 2 and failed["expired"] is True and "injected copy failure 2" in failed["error"]
    # the expired ack ids are free again: a new copy under the same id is a good one
    h = off.write(torch.arange(24, 28), 1)
    assert drain(polls(off).ended, 1) == [1] and polls(off).failed() == []
    assert off.expire([1]) == []          # already reported: not in flight
    for x in (h, h1, h2, h3):
        off.free_host(x)
    off.close()


def test_copy_failures_are_counted_and_logged_as_not_expired():
    eng = Gated(threads=1)
    eng.fail |= {1, 2}
    off, *_ = make(engine=eng)
    with capture_logs() as logs:
        h1 = off.write(torch.arange(8, 12), 1)
        h2 = off.write(torch.arange(12, 16), 2)
        assert sorted(drain(polls(off).ended, 2)) == [1, 2]
    assert off.stats().copy_failures == 2
    (first,) = events(logs, "offloader.copy_failed")          # the second is rate limited
    assert first["expired"] is False and first["log_level"] == "error"
    off.free_host(h1)
    off.free_host(h2)
    off.close()


class GatedStorage(MemoryStorage):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate = threading.Event()

    def batch_set(self, keys, pages):
        if not self.gate.wait(10):
            raise TimeoutError("test gate never opened")
        return super().batch_set(keys, pages)


def test_a_page_stays_busy_until_every_storage_op_reading_it_is_reported():
    kv = KVPool(2, 2, 8, torch.bfloat16, 64)
    host = HostPool(2, 2, 8, torch.bfloat16, PS, 32)
    store = GatedStorage("_m_0_1", host.page_nbytes)
    off = HostOffloader(kv, host, store, storage_threads=1)
    h = landed(off, 1, 4)
    tokens = [1, 2, 3, 4]
    ops = [off.write_storage(h, tokens, hashing.page_hashes(tokens, PS)) for _ in range(3)]
    assert off.stats().storage_ops == 3 and off.stats().in_flight_storage == 3
    store.gate.set()
    got = []
    while len(got) < 3:
        got += drain(off.finished_storage, 1)
        if len(got) < 3:
            with pytest.raises(HostPagesBusy):
                off.free_host(h)
    assert sorted(got) == ops and off.stats().storage_ok == 3
    off.free_host(h)
    off.close()


def test_storage_failures_are_counted_logged_and_summarised_when_storage_recovers(monkeypatch):
    off, kv, host, store = make()
    h = landed(off, 1, 4)
    tokens = [1, 2, 3, 4]
    keys = hashing.page_hashes(tokens, PS)
    real = store.batch_set
    outcome = ["false"]

    def flaky(k, p):
        if outcome[0] == "false":
            return [False] * len(k)
        if outcome[0] == "raise":
            raise OSError(errno.EIO, "injected EIO")
        return real(k, p)

    monkeypatch.setattr(store, "batch_set", flaky)
    with capture_logs() as logs:
        op1 = off.write_storage(h, tokens, keys)
        assert drain(off.finished_storage, 1) == [op1]
        outcome[0] = "raise"
        op2 = off.write_storage(h, tokens, keys)
        assert drain(off.finished_storage, 1) == [op2]
        n_before = len(events(logs, "offloader.storage_failed"))
        outcome[0] = "ok"
        op3 = off.write_storage(h, tokens, keys)
        assert drain(off.finished_storage, 1) == [op3]
    assert off.failed_storage() == [op1, op2]
    st = off.stats()
    assert (st.storage_failed, st.storage_ok, st.pages_stored) == (2, 1, 1)
    lines = events(logs, "offloader.storage_failed")
    assert n_before == 1 and len(lines) == 2
    assert {k: lines[0][k] for k in ("log_level", "op_id", "error")} == dict(
        log_level="warning", op_id=op1, error="page write failed")
    # the success flushed the summary of the suppressed failure, with its own fields
    assert lines[1]["summary"] is True and lines[1]["suppressed"] == 1 and lines[1]["op_id"] == op2
    assert lines[1]["error"] == repr(OSError(errno.EIO, "injected EIO"))
    off.free_host(h)
    off.close()


def test_a_storage_recovery_summarises_storage_failures_only_and_close_summarises_the_rest(monkeypatch):
    eng = Gated(threads=1)
    off, kv, host, store = make(engine=eng)
    h = landed(off, 1, 4)
    tokens = [1, 2, 3, 4]
    keys = hashing.page_hashes(tokens, PS)
    fail = [True]
    real = store.batch_set
    monkeypatch.setattr(store, "batch_set", lambda k, p: [False] * len(k) if fail[0] else real(k, p))

    def store_once(failing):
        fail[0] = failing
        op = off.write_storage(h, tokens, keys)
        assert drain(off.finished_storage, 1) == [op]

    with capture_logs() as logs:
        store_once(True)
        store_once(False)            # the storage outage is over (nothing was suppressed)
        eng.fail |= {2, 3}
        for ack in (2, 3):           # two failed copies: the second is suppressed
            x = off.write(torch.arange(12, 16), ack)
            assert drain(polls(off).ended, 1) == [ack]
            off.free_host(x)
        store_once(False)            # storage was not failing: its success summarises nothing
        assert [e.get("summary", False) for e in events(logs, "offloader.copy_failed")] == [False]
        off.free_host(h)
        off.close()                  # closing writes the summary of what is left
    copy_lines = events(logs, "offloader.copy_failed")
    assert [(e.get("summary", False), e["ack_id"]) for e in copy_lines] == [(False, 2), (True, 3)]
    assert copy_lines[-1]["suppressed"] == 1
    assert [e.get("summary", False) for e in events(logs, "offloader.storage_failed")] == [False]


def test_refused_store_of_poisoned_pages_is_logged_and_reported():
    eng = Gated(threads=1)
    eng.fail.add(1)
    off, kv, host, store = make(engine=eng)
    h = landed(off, 1, 4)
    with capture_logs() as logs:
        op = off.write_storage(h, [1, 2, 3, 4], ["0" * 64])
        assert drain(off.finished_storage, 1) == [op]
    (refused,) = events(logs, "offloader.store_refused")
    assert refused["op_id"] == op and refused["reason"] == "host pages hold a failed or expired copy"
    (failed,) = events(logs, "offloader.storage_failed")
    assert failed["op_id"] == op
    assert failed["error"] == repr(StorageErrorT("source host pages hold a failed or expired copy"))
    off.free_host(h)
    off.close()


def test_observer_times_storage_writes_without_a_tier_hook():
    import time

    off, kv, host, store = make()
    h = landed(off, 1, 8)
    obs = off.observer = Observer()
    tokens = list(range(8))
    keys = hashing.page_hashes(tokens, PS)
    t0 = time.perf_counter()
    op = off.write_storage(h, tokens, keys)
    assert drain(off.finished_storage, 1) == [op] and off.failed_storage() == []
    elapsed = time.perf_counter() - t0
    assert store.batch_exists(keys) == 2
    assert len(obs.storage) == 1 and obs.storage[0][0] == "set" and 0 <= obs.storage[0][1] <= elapsed
    off.free_host(h)
    off.close()


@pytest.mark.parametrize("observed", [False, True])
def test_storage_tier_hook_gets_the_tokens_and_parent_of_each_page(observed):
    off, kv, host, store = make()
    kv.write(torch.arange(8, 16), synthetic_kv(kv, 5, torch.arange(8)))
    h = landed(off, 1, 8)
    pub = Publisher()
    store.events = TierAnnouncer(pub, "EXTERNAL", PS)
    if observed:
        off.observer = Observer()
    tokens = list(range(10, 18))
    keys = hashing.page_hashes(tokens, PS)
    op = off.write_storage(h, tokens, keys, parent_hash="p" * 64)
    assert drain(off.finished_storage, 1) == [op] and off.failed_storage() == []
    assert pub.events == [("stored", "EXTERNAL", [keys[0]], tokens[:4], PS, "p" * 64),
                          ("stored", "EXTERNAL", [keys[1]], tokens[4:], PS, keys[0])]
    # the stored bytes are the host pages
    into = [torch.empty(host.page_nbytes, dtype=torch.uint8) for _ in keys]
    assert store.batch_get(keys, into) == [True, True]
    for buf, p in zip(into, host.page_ids(h).tolist()):
        assert torch.equal(buf, host.page_bytes(p))
    if observed:
        assert [op for op, _ in off.observer.storage] == ["set"]
    off.free_host(h)
    off.close()


def test_host_events_announce_pages_handed_to_storage_and_remove_them_when_freed():
    off, kv, host, store = make()
    pub = Publisher()
    off.events = HostAnnouncer(pub, PS)
    h = landed(off, 1, 8)
    other = off.write(torch.arange(16, 20), 2)
    drain(polls(off).ended, 1)
    tokens = list(range(8))
    keys = hashing.page_hashes(tokens, PS)
    op = off.write_storage(h, tokens, keys, parent_hash="q" * 64)
    assert drain(off.finished_storage, 1) == [op]
    assert pub.events == [("stored", "CPU_PINNED", keys, tokens, PS, "q" * 64)]
    off.free_host(other)                          # never handed to storage: nothing to remove
    assert len(pub.events) == 1
    off.free_host(h)
    assert pub.events[1:] == [("removed", "CPU_PINNED", keys)]
    off.close()


def test_close_without_a_bound_waits_for_everything():
    off, *_ = make()
    h = off.write(torch.arange(8, 12), 1)
    report = off.close(timeout=None)
    assert report.clean and report.timeout is None
    assert drain(polls(off).ended, 1) == [1]
    off.free_host(h)


def test_close_with_a_stuck_copy_returns_at_its_timeout_and_logs_what_it_left():
    import time

    eng = Gated(threads=1)
    eng.hold.add(1)
    off, kv, host, store = make(engine=eng)
    h = off.write(torch.arange(8, 16), 1)
    drain(lambda: [1] if 1 in eng.started else [], 1)
    with capture_logs() as logs:
        t0 = time.monotonic()
        report = off.close(timeout=0)
        took = time.monotonic() - t0
    assert took < 0.9          # a zero timeout does not wait (a 1 s floor would)
    assert not report.clean and report.abandoned_writes == [1]
    (ev,) = events(logs, "offloader.close_timed_out")
    want = dict(timeout=0, in_flight_writes=1, in_flight_storage=0, abandoned_writes=[1],
                host_pages=report.host_pages, device_slots=8, reason=report.reason)
    assert {k: ev[k] for k in want} == want and len(report.host_pages) == 2
    eng.gate.set()
    assert drain(polls(off).ended, 1) == [1]
    off.free_host(h)


# -- a discarded copy stores and announces nothing (issue 35, held-out gap) ---------------------
@pytest.mark.parametrize("how,polled", [("discard_write", True), ("discard_write", False), ("expire", True),
                                        ("expire", False), ("write_timeout_s", True)])
@pytest.mark.parametrize("when", ["while running", "ended, not yet reported"])
def test_a_discarded_copy_that_lands_stores_and_announces_nothing(how, polled, when):
    """docs (``discard_write`` / ``finished_writes``): a copy the caller gave up on — discarded
    because its device slots are being freed under it (its request released), or expired and
    quarantined — lands as failed and its host pages are never stored. Handed to ``write_storage``
    anyway, the op fails: no page reaches the tier, and no KV event announces one (neither the host
    pool's ``CPU_PINNED`` nor the tier's), while a good copy beside it is stored and announced."""
    clock = FakeClock()
    eng = Gated(threads=1)
    eng.hold.add(1)
    off, kv, host, store = make(engine=eng, write_timeout_s=5.0, clock=clock)
    kv.write(torch.arange(8, 24), synthetic_kv(kv, 3, torch.arange(16)))
    pub = Publisher()
    off.events, store.events = HostAnnouncer(pub, PS), TierAnnouncer(pub, "EXTERNAL", PS)
    bad = off.write(torch.arange(8, 16), 1)
    drain(lambda: [1] if 1 in eng.started else [], 1)
    if when == "ended, not yet reported":
        eng.gate.set()
        drain(lambda: [1] if not eng.unfinished() else [], 1)     # ended; finished_writes not called
    with capture_logs():
        if how == "discard_write":
            off.discard_write(1)
        elif how == "expire":
            assert off.expire([1]) == [1]
        else:
            clock.t += 5.0
        if polled:      # else the poll that reports it ended reports it expired first
            assert polls(off).expired() == [1]
        eng.gate.set()
        assert drain(polls(off).ended, 1) == [1] and polls(off).failed() == [1]
        assert polls(off).expired() == ([] if polled else [1])  # once in all, never after its end
        good = landed(off, 2, 8, first=16)
        tokens = list(range(100, 116))
        keys = hashing.page_hashes(tokens, PS)
        op_bad = off.write_storage(bad, tokens[:8], keys[:2])
        op_good = off.write_storage(good, tokens[8:], keys[2:], parent_hash=keys[1])
        assert sorted(drain(off.finished_storage, 2)) == sorted([op_bad, op_good])
    assert off.failed_storage() == [op_bad]
    assert store.batch_exists(keys[:1]) == 0 and store.batch_exists(keys[1:2]) == 0       # nothing stored
    assert store.stats().stored == 2 and store.stats().pages == 2                 # the good copy's two
    announced = {h for e in pub.events if e[0] == "stored" for h in e[2]}
    assert announced == set(keys[2:]), pub.events                # only the good copy's pages
    assert off.stats().pages_stored == 2
    off.free_host(bad)
    off.free_host(good)
    assert all(keys[0] not in e[2] and keys[1] not in e[2] for e in pub.events)  # nor removed
    off.close()


def test_one_poll_reports_landed_failed_and_expired_in_a_typed_report():
    """transfer/offloader.py: ``finished_writes`` returns one ``WriteReport``: each ack landed or
    failed exactly once, expired at most once and never after the report of its end; a poll with
    nothing to report returns the shared ``EMPTY_REPORT`` (nothing allocated)."""
    from transfer import EMPTY_REPORT, WriteReport

    clock = FakeClock()
    eng = Gated(threads=1)
    off, kv, host, _ = make(engine=eng, write_timeout_s=5.0, clock=clock)
    assert off.finished_writes() is EMPTY_REPORT
    eng.hold |= {1, 2}
    eng.fail.add(2)
    hosts = [off.write(torch.arange(8, 16), 1), off.write(torch.arange(16, 20), 2)]
    clock.t += 2.0
    hosts.append(off.write(torch.arange(20, 24), 3))   # deadline later than the others
    clock.t += 3.0
    reports = [off.finished_writes()]
    assert isinstance(reports[0], WriteReport) and sorted(reports[0].expired) == [1, 2]
    eng.gate.set()
    drain(lambda: (reports.append(r := off.finished_writes()), r.landed + r.failed)[1],
          3 - len(reports[0].landed + reports[0].failed))
    landed = [a for r in reports for a in r.landed]
    failed = [a for r in reports for a in r.failed]
    expired = [a for r in reports for a in r.expired]
    assert sorted(landed) == [3] and sorted(failed) == [1, 2] and sorted(expired) == [1, 2]
    ended_at = {a: i for i, r in enumerate(reports) for a in r.landed + r.failed}
    assert all(i <= ended_at[a] for i, r in enumerate(reports) for a in r.expired)
    assert off.finished_writes() is EMPTY_REPORT
    for h in hosts:
        off.free_host(h)
    off.close()


# -- host indices ``write`` returned: their pages are remembered, not re-derived from the values --
def _landed_chunk(off, kv, ack, first_slot=8, kind="tensor"):
    """A copy of the two device pages from ``first_slot`` on (slot ids as a tensor or as NumPy),
    landed; returns its host indices."""
    slots = torch.arange(first_slot, first_slot + 8)
    kv.write(slots, synthetic_kv(kv, ack, torch.arange(8)))
    h = off.write(slots if kind == "tensor" else slots.numpy(), ack_id=ack)
    assert drain(polls(off).ended, 1) == [ack]
    return h


@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_host_indices_changed_in_place_after_write_are_checked_by_their_values(kind):
    """An in-place change of the host indices ``write`` returned is seen (a tensor's version moved;
    a NumPy array's caller turned it writeable again to change it): the values are checked as for
    any tensor, and a changed one refused with nothing changed."""
    off, kv, host, store = make()
    h = _landed_chunk(off, kv, 1, kind=kind)
    tokens, hashes = list(range(8)), hashing.page_hashes(list(range(8)), PS)
    if kind == "numpy":
        h.flags.writeable = True
    h += 1  # in place: no longer whole pages
    free_before = host.available_size()
    with pytest.raises(BadIndices):
        off.write_storage(h, tokens, hashes)
    with pytest.raises(BadIndices):
        off.free_host(h)
    assert host.available_size() == free_before and off.stats().storage_ops == 0
    h -= 1  # the same values again: still checked by value (version moved, or writeable), and valid
    op = off.write_storage(h, tokens, hashes)
    assert drain(off.finished_storage, 1) == [op]
    off.free_host(h)
    assert host.available_size() == free_before + 8
    off.close()


def test_host_pages_freed_through_another_tensor_are_no_longer_known_by_the_first():
    """Pages ``write`` handed out, freed through another tensor naming them (as the manager frees
    several ops' pages in one call): the first tensor is then refused like any unheld pages."""
    off, kv, host, store = make()
    h = _landed_chunk(off, kv, 1)
    off.free_host(h.clone())
    with pytest.raises(NotAllocated):
        off.write_storage(h, list(range(8)), hashing.page_hashes(list(range(8)), PS))
    with pytest.raises(DoubleFree):
        off.free_host(h)
    assert off.stats().storage_ops == 0 and host.available_size() == 32
    off.close()


def test_host_pages_handed_out_again_are_freed_by_value_through_an_older_tensor():
    """As before the pages were remembered: a tensor names pages by its values, so an older tensor
    of pages handed out again frees them; the newer one then holds nothing."""
    off, kv, host, store = make(host_tokens=8)  # two pages: the second write reuses them
    h1 = _landed_chunk(off, kv, 1)
    off.free_host(h1)
    h2 = _landed_chunk(off, kv, 2)
    assert h2.tolist() == h1.tolist()
    off.free_host(h1)
    with pytest.raises(NotAllocated):
        off.write_storage(h2, list(range(8)), hashing.page_hashes(list(range(8)), PS))
    with pytest.raises(DoubleFree):
        off.free_host(h2)
    assert host.available_size() == 8
    off.close()


def test_a_write_under_inference_mode_returns_host_indices_checked_by_value_after():
    """vLLM's worker runs under ``torch.inference_mode()``: the host indices ``write`` makes there
    are inference tensors, which keep no version; they are checked by value, as any tensor."""
    off, kv, host, store = make()
    with torch.inference_mode():
        h = _landed_chunk(off, kv, 1)
        assert h.is_inference()
        tokens, hashes = list(range(8)), hashing.page_hashes(list(range(8)), PS)
        op = off.write_storage(h, tokens, hashes)
        assert drain(off.finished_storage, 1) == [op]
        off.free_host(h)
        with pytest.raises(DoubleFree):
            off.free_host(h)
    assert host.available_size() == 32 and store.batch_exists(hashes) == 2 and off.idle()
    off.close()


def test_host_indices_follow_the_order_a_placing_pool_hands_its_pages_out_in():
    """A host pool that places pages where it is told (vLLM's scheduler chooses them) may hand out
    a consecutive set out of order: the chunk's i-th page lands in the i-th page given, and the host
    indices ``write`` returns say so, page by page in that order (not the set sorted)."""
    off, kv, host, store = make()
    alloc = host._pages.alloc
    placed = []

    def place(n):  # the pool's own accounting takes the pages; they are handed out in another order
        got = alloc(n)
        placed[:] = [got[0], got[2], got[1], got[3]]
        return got[[0, 2, 1, 3]]

    host._pages.alloc = place
    slots = torch.arange(16, 32)
    kv.write(slots, synthetic_kv(kv, 1, torch.arange(16)))
    h = off.write(slots, ack_id=1)
    assert h.tolist() == [int(p) * PS + k for p in placed for k in range(PS)]
    assert drain(polls(off).ended, 1) == [1]
    want = kv.read(slots)  # [kinds, layers, 16, heads, dim]
    for i, p in enumerate(host.page_ids(h).tolist()):  # chunk page i is in the host page h names i-th
        page = want[:, :, i * PS:(i + 1) * PS].permute(0, 2, 1, 3, 4).contiguous()
        assert torch.equal(host.page_view(p).view(torch.uint8), page.view(torch.uint8))
    off.free_host(h)
    off.close()


def test_a_list_of_host_indices_frees_every_tensors_pages_in_one_call():
    """Several ops' host indices in one ``free_host`` call (what the manager does for the storage
    ops a progress check saw finish): each tensor's pages go back, as if freed one by one."""
    off, kv, host, store = make()
    h1, h2, h3 = (_landed_chunk(off, kv, ack, first) for ack, first in ((1, 0), (2, 8), (3, 16)))
    free_before = host.available_size()
    off.free_host([h1, h2.clone()])  # one tensor ``write`` returned, one by value
    assert host.available_size() == free_before + 16
    for h in (h1, h2):
        with pytest.raises(DoubleFree):
            off.free_host([h])
    off.free_host([])  # nothing to free
    off.free_host([h3])
    assert host.available_size() == 32 and off.idle()
    host.check_integrity()
    off.close()


@pytest.mark.parametrize("bad", ["not_whole_pages", "freed_before", "storage_reads_it"])
def test_a_list_with_one_tensor_that_cannot_be_freed_frees_nothing(bad):
    """All or none: one tensor of the list refused (not whole pages, pages already free, pages a
    storage op still reads) and no page of any tensor in it goes back."""
    off, kv, host, store = make()
    h1, h2 = _landed_chunk(off, kv, 1, 0), _landed_chunk(off, kv, 2, 8)
    if bad == "not_whole_pages":
        other, error = h2[1:], BadIndices
    elif bad == "freed_before":
        off.free_host(h2)
        other, error = h2, DoubleFree
    else:
        gate = threading.Event()
        real = store.batch_set
        store.batch_set = lambda *a, **k: (gate.wait(5), real(*a, **k))[1]
        tokens = list(range(8))
        off.write_storage(h2, tokens, hashing.page_hashes(tokens, PS))
        other, error = h2, HostPagesBusy
    free_before = host.available_size()
    with pytest.raises(error):
        off.free_host([h1, other])
    assert host.available_size() == free_before
    off.free_host(h1)  # h1's pages were never freed: they still can be
    assert host.available_size() == free_before + 8
    if bad == "storage_reads_it":
        gate.set()
        drain(off.finished_storage, 1)
    if bad != "freed_before":
        off.free_host(h2)
    assert host.available_size() == 32
    off.close()


# -- a host row's ids as NumPy (what the manager hands over): NumPy host indices back, read-only ---
def test_numpy_slot_ids_give_read_only_numpy_host_indices_read_from_what_was_remembered():
    """NumPy in, NumPy out: the host indices are a read-only int64 array, page by page as for a
    tensor; ``write_storage`` and ``free_host`` read their pages from what ``write`` remembered."""
    off, kv, host, store = make()
    slots = np.arange(8, 16)
    kv.write(torch.from_numpy(slots), synthetic_kv(kv, 1, torch.arange(8)))
    h = off.write(slots, ack_id=1)
    assert type(h) is np.ndarray and h.dtype == np.int64 and not h.flags.writeable
    assert h.tolist() == list(range(0, 8))
    with pytest.raises(ValueError):
        h[0] = 5  # read-only: the caller cannot change what the offloader remembered
    assert drain(polls(off).ended, 1) == [1]
    tokens, hashes = list(range(8)), hashing.page_hashes(list(range(8)), PS)
    op = off.write_storage(h, tokens, hashes)
    assert drain(off.finished_storage, 1) == [op] and store.batch_exists(hashes) == 2
    off.free_host([h])
    with pytest.raises(DoubleFree):
        off.free_host(h)
    assert host.available_size() == 32 and off.idle()
    off.close()


@pytest.mark.parametrize("bad,match", [
    (np.arange(8, 16, dtype=np.float64), "integer dtype"),
    (np.arange(8, 16).reshape(2, 4), "1-D"),
    (np.arange(9, 13), "page"),
    (np.arange(64, 68), "0..63"),
])
def test_numpy_slot_ids_are_checked_as_tensors_are_and_a_bad_one_changes_nothing(bad, match):
    off, kv, host, _ = make()
    with pytest.raises(BadIndices, match=match):
        off.write(bad, 1)
    assert host.available_size() == 32 and off.idle() and off.stats().writes == 0
    h = off.write(np.arange(8, 12, dtype=np.int32), 1)  # another integer dtype: converted
    assert h.tolist() == [0, 1, 2, 3]
    drain(polls(off).ended, 1)
    off.free_host(h)
    off.close()
