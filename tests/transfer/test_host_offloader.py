import errno
import threading

import pytest
import torch

import hashing
from transfer import (
    BadIndices, Closed, CpuCopyEngine, DoubleFree, HostOffloader, HostPagesBusy, HostPool, KVPool,
    MemoryStorage, NotAllocated, Offloader, TransferError, UnknownId, synthetic_kv,
)
from tests.support.transfer_helpers import drain

PS = 4


def make(host_tokens=32, engine=None):
    kv = KVPool(2, 2, 8, torch.bfloat16, 64)
    host = HostPool(2, 2, 8, torch.bfloat16, PS, host_tokens)
    store = MemoryStorage("_m_0_1", host.page_nbytes)
    return HostOffloader(kv, host, store, copy_engine=engine), kv, host, store


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
    assert drain(off.finished_writes, 1) == [11]
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
    drain(off.finished_writes, 1)
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
    assert drain(off.finished_writes, 1) == [2]
    with pytest.raises(HostPagesBusy):
        off.free_host(h1)  # its copy has not landed
    with pytest.raises(TransferError):
        off.write_storage(h1, [0] * PS, ["a"])
    gate.set()
    assert drain(off.finished_writes, 1) == [1]
    off.close()


def test_storage_failure_counted_reported_and_host_pages_freeable(monkeypatch):
    off, kv, host, store = make()

    def enospc(name, page, *seal):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "_write", enospc)
    h = off.write(torch.arange(8, 16), 5)
    drain(off.finished_writes, 1)
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
    drain(off.finished_writes, 1)
    op = off.write_storage(h, [1, 2, 3, 4], ["k"])
    assert drain(off.finished_storage, 1) == [op] and off.stats().storage_failed == 1
    off.free_host(h)
    off.close()


def test_failed_copy_poisons_pages():
    eng = CpuCopyEngine(threads=1)
    off, kv, host, store = make(engine=eng)
    eng.to_host = lambda tag, *a: eng.submit(tag, lambda: 1 / 0)
    h = off.write(torch.arange(8, 12), 1)
    assert drain(off.finished_writes, 1) == [1] and off.stats().copy_failures == 1
    op = off.write_storage(h, [1, 2, 3, 4], ["0" * 64])
    assert drain(off.finished_storage, 1) == [op] and off.failed_storage() == [op]
    assert store.batch_exists(["0" * 64]) == 0
    off.free_host(h)
    off.close()


def test_close_drains_and_refuses_new_work():
    off, kv, host, _ = make()
    h = off.write(torch.arange(8, 12), 1)
    off.close()
    assert drain(off.finished_writes, 1) == [1]
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
            assert drain(off.finished_writes, 1) == [2 * i]
            off.free_host(h)
        clock.t += 5.0
        assert off.write(torch.arange(16, 24), 1000) is not None
        assert off.write(torch.arange(16, 24), 1001) is None  # a new interval: one more warning
    warned = [e for e in logs if e["event"] == "offloader.host_exhausted"]
    assert [e["log_level"] for e in warned] == ["warning", "warning"]
    assert [e["rejected"] for e in warned] == [1, 50]  # the second carries everything since the first
    assert warned[1]["rejected_total"] == 51 == off.stats().writes_rejected
    drain(off.finished_writes, 1)
    off.close()


def test_backpressure_interval_must_not_be_negative():
    kv = KVPool(2, 2, 8, torch.bfloat16, 64)
    host = HostPool(2, 2, 8, torch.bfloat16, PS, 8)
    with pytest.raises(ValueError):
        HostOffloader(kv, host, MemoryStorage("_m_0_1", host.page_nbytes), backpressure_log_interval_s=-1)


def test_the_copy_reads_the_slots_given_at_write_time_not_a_reused_index_buffer():
    """The plan is built on the copy worker, later: a caller reusing its index tensor after
    ``write`` returned must not redirect the copy (regression: int64 CPU indices were aliased)."""
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
    idx = torch.arange(8, 16)
    h = off.write(idx, 1)
    idx.copy_(torch.arange(40, 48))  # the caller reuses its buffer for something else
    gate.set()
    assert drain(off.finished_writes, 1) == [1]
    want = kv.read(torch.arange(8, 16))  # [kinds, layers, 8, heads, dim]
    for i, p in enumerate(host.page_ids(h).tolist()):
        page = want[:, :, i * PS:(i + 1) * PS].permute(0, 2, 1, 3, 4).contiguous()
        assert torch.equal(host.page_view(p).view(torch.uint8), page.view(torch.uint8))
    off.free_host(h)
    off.close()


def test_expire_reports_the_copies_once_and_poisons_their_pages():
    """``expire``: the caller stops waiting for these copies now (their slots are being freed by
    someone else); reported once by ``expired_writes``, landed as failed, never stored."""
    off, kv, host, store = make()
    h = off.write(torch.arange(8, 12), 1)
    assert off.expire([1, 1, 99]) == [1]          # ids not in flight, and repeats, are skipped
    assert off.expire([1]) == []
    assert off.expired_writes() == [1] and off.expired_writes() == []
    assert drain(off.finished_writes, 1) == [1] and off.failed_writes() == [1]
    op = off.write_storage(h, [1, 2, 3, 4], ["0" * 64])
    assert drain(off.finished_storage, 1) == [op] and off.failed_storage() == [op]
    assert store.batch_exists(["0" * 64]) == 0 and off.stats().copies_discarded == 1
    off.free_host(h)
    off.close()
