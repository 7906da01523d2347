"""Reliability, transfer half: real components with injected faults.

Every fault: the operation fails cleanly, is counted, is logged as a structured event naming what
failed, and host pages come back. Nothing here sleeps to assert timing: copies block on events the
test controls, deadlines run on an injected clock, and completions are drained with bounded polls.
See docs/reliability-transfer.md.
"""

from __future__ import annotations

import errno
import os
import subprocess
import threading

import pytest
import torch
from structlog.testing import capture_logs

import hashing
from transfer import CpuCopyEngine, FileStorage, HostOffloader, HostPagesBusy, HostPool, KVPool, MemoryStorage, StorageUnavailable, TransferError
from lifecycle_tools.testkit.kv_pattern import synthetic_kv
from transfer.gather import ChunkCopy
from transfer.storage.file import XATTR
from tests.support.transfer_helpers import drain, polls

PS = 4
SUFFIX = hashing.storage_suffix("org/model", 0, 1)


# -- fault-injecting parts ----------------------------------------------------------------------
class GatedCopyEngine(CpuCopyEngine):
    """A real ``CpuCopyEngine`` (real worker threads, real gather copy) whose copy for a tag in
    ``hold`` first blocks on ``gate`` (a copy stuck on the device, as far as the caller can tell),
    and whose copy for a tag in ``fail`` raises after the gate."""

    def __init__(self, threads: int = 2) -> None:
        super().__init__(threads)
        self.gate = threading.Event()
        self.hold: set[int] = set()
        self.fail: set[int] = set()
        self.started: set[int] = set()

    def to_host(self, tag, kv, host, slots, host_pages):
        plan = ChunkCopy(kv, host, slots, host_pages)
        hold, fail = tag in self.hold, tag in self.fail

        def job():
            self.started.add(tag)
            if hold and not self.gate.wait(10):  # bounded: a broken test fails, never hangs
                raise TimeoutError("test gate never opened")
            if fail:
                raise RuntimeError(f"injected copy failure (ack {tag})")
            return plan.to_host()

        self.submit(tag, job)


class Clock:
    """Injected monotonic clock: deadlines pass when the test says so."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class GatedStorage(MemoryStorage):
    """A real ``MemoryStorage`` whose page writes wait for ``gate`` (slow/stalled storage)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self.gate.set()

    def _write(self, name, page, seal_bytes):
        if not self.gate.wait(10):
            raise OSError(errno.EIO, "test gate never opened")
        super()._write(name, page, seal_bytes)


def make(host_tokens=32, engine=None, storage=None, **kw):
    kv = KVPool(2, 2, 8, torch.bfloat16, 64)
    kv.write(torch.arange(64), synthetic_kv(kv, 1, torch.arange(64)))
    host = HostPool(2, 2, 8, torch.bfloat16, PS, host_tokens)
    store = storage if storage is not None else MemoryStorage("_m_0_1", host.page_nbytes)
    off = HostOffloader(kv, host, store, copy_engine=engine, **kw)
    return off, kv, host, store


def events(logs, name):
    return [e for e in logs if e["event"] == name]


def store_chunk(off, host_idx, first_token):
    tokens = list(range(first_token, first_token + host_idx.numel()))
    return off.write_storage(host_idx, tokens, hashing.page_hashes(tokens, PS))


# -- 1. stuck / failed device -> host copies ----------------------------------------------------
def test_stuck_copy_expires_once_keeps_slots_until_it_ends_and_is_never_stored():
    eng, clock = GatedCopyEngine(threads=2), Clock()
    off, kv, host, store = make(engine=eng, write_timeout_s=0.5, clock=clock)
    eng.hold.add(1)
    with capture_logs() as logs:
        h1 = off.write(torch.arange(0, 8), 1)
        h2 = off.write(torch.arange(8, 16), 2)  # the other worker thread is free
        assert drain(polls(off).ended, 1) == [2]
        assert polls(off).expired() == []
        clock.t += 0.49
        assert polls(off).expired() == []  # not yet
        clock.t += 0.01
        assert polls(off).expired() == [1]
        assert polls(off).expired() == []  # each ack at most once
        clock.t += 100
        assert polls(off).expired() == []
    (ev,) = events(logs, "offloader.copy_expired")
    assert ev["ack_id"] == 1 and ev["timeout_s"] == 0.5 and ev["log_level"] == "error"
    assert off.stats().copy_expired == 1 and off.stats().in_flight_writes == 1
    # the copy may still read the device slots: its host pages can be neither freed nor stored
    with pytest.raises(HostPagesBusy):
        off.free_host(h1)
    with pytest.raises(TransferError):
        store_chunk(off, h1, 0)
    assert polls(off).ended() == [] and polls(off).failed() == []
    # the good chunk is unaffected
    op2 = store_chunk(off, h2, 8)
    assert drain(off.finished_storage, 1) == [op2] and off.failed_storage() == []
    off.free_host(h2)
    # the copy finally ends: now reported landed, and listed failed (never to be stored)
    with capture_logs() as logs:
        eng.gate.set()
        assert drain(polls(off).ended, 1) == [1]
        assert polls(off).failed() == [1] and polls(off).failed() == []
        op1 = store_chunk(off, h1, 0)  # stored anyway: the op fails, nothing written
        assert drain(off.finished_storage, 1) == [op1] and off.failed_storage() == [op1]
    assert events(logs, "offloader.expired_copy_ended")[0]["ack_id"] == 1
    assert events(logs, "offloader.store_refused")[0]["op_id"] == op1
    assert store.batch_exists(hashing.page_hashes(list(range(8)), PS)) == 0
    off.free_host(h1)
    st = off.stats()
    assert (st.writes, st.writes_landed, st.copy_expired, st.copy_failures) == (2, 2, 1, 0)
    assert (st.storage_ok, st.storage_failed, st.pages_stored) == (1, 1, 2)
    assert host.available_size() == 32 and off.idle()
    host.check_integrity()
    off.close()


def test_copy_finished_before_its_deadline_never_expires():
    clock = Clock()
    off, kv, host, _ = make(write_timeout_s=0.5, clock=clock)
    h = off.write(torch.arange(0, 8), 7)
    assert drain(polls(off).ended, 1) == [7]
    clock.t += 10
    assert polls(off).expired() == [] and polls(off).failed() == []
    off.free_host(h)
    off.close()


def test_no_timeout_means_never_expired():
    eng, clock = GatedCopyEngine(threads=1), Clock()
    off, *_ = make(engine=eng, clock=clock)
    eng.hold.add(1)
    h = off.write(torch.arange(0, 8), 1)
    clock.t += 1e6
    assert polls(off).expired() == []
    eng.gate.set()
    assert drain(polls(off).ended, 1) == [1] and polls(off).failed() == []
    off.free_host(h)
    off.close()


def test_failed_copy_is_reported_listed_failed_logged_and_pages_returned():
    eng = GatedCopyEngine(threads=1)
    off, kv, host, store = make(engine=eng)
    eng.fail.add(3)
    with capture_logs() as logs:
        h3 = off.write(torch.arange(0, 8), 3)
        h4 = off.write(torch.arange(8, 16), 4)
        assert sorted(drain(polls(off).ended, 2)) == [3, 4]
        assert polls(off).failed() == [3]
    (ev,) = events(logs, "offloader.copy_failed")
    assert ev["ack_id"] == 3 and "injected copy failure" in ev["error"]
    assert off.stats().copy_failures == 1
    op = store_chunk(off, h4, 8)
    assert drain(off.finished_storage, 1) == [op] and off.failed_storage() == []
    for h in (h3, h4):  # the caller skips storing ack 3 and frees its pages
        off.free_host(h)
    assert host.available_size() == 32
    host.check_integrity()
    off.close()


def test_stuck_copy_that_then_fails_is_listed_failed_once():
    eng, clock = GatedCopyEngine(threads=1), Clock()
    off, *_ = make(engine=eng, write_timeout_s=1.0, clock=clock)
    eng.hold.add(1)
    eng.fail.add(1)
    h = off.write(torch.arange(0, 8), 1)
    clock.t += 1.0
    assert polls(off).expired() == [1]
    eng.gate.set()
    assert drain(polls(off).ended, 1) == [1]
    assert polls(off).failed() == [1] and polls(off).failed() == []
    st = off.stats()
    assert (st.copy_expired, st.copy_failures) == (1, 1)
    off.free_host(h)
    off.close()


def test_engine_refusing_a_copy_returns_the_host_pages():
    eng = CpuCopyEngine(threads=1)
    off, kv, host, _ = make(engine=eng)

    def refuse(*a):
        raise RuntimeError("launch failed")

    eng.to_host = refuse
    with pytest.raises(RuntimeError):
        off.write(torch.arange(0, 8), 1)
    assert host.available_size() == 32 and off.idle()
    host.check_integrity()
    off.close()


def test_close_with_a_stuck_copy_is_bounded_and_logged():
    eng = GatedCopyEngine(threads=1)
    off, *_ = make(engine=eng)
    eng.hold.add(1)
    off.write(torch.arange(0, 8), 1)
    drain(lambda: [1] if 1 in eng.started else [], 1)  # the copy is running (and stuck)
    with capture_logs() as logs:
        off.close(timeout=0.05)
    assert events(logs, "offloader.close_timed_out")[0]["in_flight_writes"] == 1
    eng.gate.set()
    assert drain(polls(off).ended, 1) == [1]


def test_write_timeout_must_be_positive():
    with pytest.raises(ValueError):
        make(write_timeout_s=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_reports_a_failed_launch_through_poll():
    from transfer import CudaCopyEngine

    eng = CudaCopyEngine("cuda")
    eng.submit(1, lambda: 1 / 0)
    done = drain(eng.poll, 1)
    assert done[0].tag == 1 and isinstance(done[0].error, ZeroDivisionError)
    eng.close()


# -- 4. host pool exhausted for a long stretch --------------------------------------------------
def test_host_pool_exhausted_for_many_polls_then_recovers_nothing_leaked():
    store = GatedStorage("_m_0_1")
    off, kv, host, _ = make(host_tokens=8, storage=store)  # room for one 2-page chunk
    store.gate.clear()  # storage stalls: the chunk's host pages stay busy
    ha = off.write(torch.arange(0, 8), 1)
    assert drain(polls(off).ended, 1) == [1]
    op = store_chunk(off, ha, 0)
    with capture_logs() as logs:
        for i in range(200):  # 200 scheduler polls with no host memory
            assert off.write(torch.arange(8, 16), 100 + i) is None
            assert off.finished_storage() == [] and polls(off).ended() == []
            with pytest.raises(HostPagesBusy):
                off.free_host(ha)
    (ev,) = events(logs, "offloader.host_exhausted")  # logged once per stretch, not per poll
    assert ev["pages"] == 2 and ev["host_free_pages"] == 0
    st = off.stats()
    assert st.writes_rejected == 200 and st.writes == 1 and st.host_free_pages == 0
    store.gate.set()  # storage catches up
    assert drain(off.finished_storage, 1) == [op] and off.failed_storage() == []
    off.free_host(ha)
    with capture_logs() as logs:
        hb = off.write(torch.arange(8, 16), 999)
    assert hb is not None and events(logs, "offloader.host_recovered")[0]["rejected"] == 200
    assert drain(polls(off).ended, 1) == [999]
    opb = store_chunk(off, hb, 8)
    assert drain(off.finished_storage, 1) == [opb]
    off.free_host(hb)
    st = off.stats()
    assert (st.writes, st.writes_rejected, st.writes_landed, st.storage_ok, st.pages_stored) == (2, 200, 2, 2, 4)
    assert st.host_free_pages == 2 and host.available_size() == 8 and off.idle()
    host.check_integrity()
    off.close()


# -- 2. file store faults -----------------------------------------------------------------------
NB = 8192


def pg(i: int, nb: int = NB) -> torch.Tensor:
    return torch.arange(nb, dtype=torch.int64).add(31 * i).remainder(251).to(torch.uint8)


def keys(n: int, start: int = 0) -> list[str]:
    return [f"{i:064x}" for i in range(start, start + n)]


def _mount(args: list[str]) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 64 KiB tmpfs (root only): real ENOSPC and, remounted read-only, real EROFS."""
    d = tmp_path / "tmpfs"
    d.mkdir()
    if os.geteuid() != 0 or not _mount(["-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(d)]):
        pytest.skip("cannot mount a tmpfs here (needs root); the patched-fault tests cover it")
    yield d
    _mount(["-o", "remount,rw", str(d)])
    subprocess.run(["umount", "-l", str(d)], capture_output=True)


def stray_temps(d) -> list[str]:
    return [n for n in os.listdir(d) if n.endswith(".tmp")]


def test_real_enospc_on_a_full_tmpfs_fails_cleanly_and_recovers(small_tmpfs):
    s = FileStorage(small_tmpfs, SUFFIX, NB)
    ks = keys(12)
    with capture_logs() as logs:
        res = s.batch_set(ks, [pg(i) for i in range(12)])
        s.close()   # writes the summary of the failures not logged one by one
    assert False in res and True in res, res  # pages are written concurrently: each result is its own
    n, failed = res.index(False), res.count(False)
    evs = events(logs, "storage.write_failed")
    assert all(ev["errno"] == errno.ENOSPC for ev in evs)
    # one line for the first failed page, then (failed > 1) one summary counting the rest
    assert len(evs) == (1 if failed == 1 else 2) and evs[-1].get("suppressed", 0) == failed - 1
    assert s.stats().errors == failed and s.stats().stored == 12 - failed
    assert stray_temps(small_tmpfs) == []  # no torn temp file left to fill the disk
    out = torch.empty(NB, dtype=torch.uint8)
    for i, k in enumerate(ks):
        assert s.batch_get([k], [out]) == [res[i]]
        if res[i]:
            assert torch.equal(out, pg(i))
    assert s.batch_exists(ks) == n and s.stats().corrupt == s.stats().wrong_size == 0
    stored = [k for k, ok in zip(ks, res) if ok]
    assert len(stored) >= 2, res
    assert s.delete(stored[0]) and s.delete(stored[1])  # capacity returns
    assert s.batch_set(ks[n:n + 1], [pg(n)]) == [True]
    assert s.batch_get(ks[n:n + 1], [out]) == [True] and torch.equal(out, pg(n))
    s.close()


def test_real_read_only_filesystem(small_tmpfs):
    s = FileStorage(small_tmpfs, SUFFIX, NB)
    assert s.batch_set(keys(1), [pg(0)]) == [True]
    assert _mount(["-o", "remount,ro", str(small_tmpfs)])
    with capture_logs() as logs:
        assert s.batch_set(keys(2), [pg(0), pg(1)]) == [True, False]  # first exists (skipped)
    assert events(logs, "storage.write_failed")[0]["errno"] == errno.EROFS
    out = torch.empty(NB, dtype=torch.uint8)
    assert s.batch_get(keys(1), [out]) == [True] and torch.equal(out, pg(0))  # reads still work
    with pytest.raises(StorageUnavailable):
        FileStorage(small_tmpfs, SUFFIX, NB)
    assert _mount(["-o", "remount,rw", str(small_tmpfs)])
    assert s.batch_set(keys(2), [pg(0), pg(1)]) == [True, True]
    s.close()


@pytest.mark.parametrize("call", ["replace", "setxattr"])
def test_patched_enospc_leaves_no_file(tmp_path, monkeypatch, call):
    """The same fault without mount privileges: the rename, or setting the checksum xattr (ext4
    can run out of xattr space), fails with ENOSPC; no file may stay behind."""
    s = FileStorage(tmp_path, SUFFIX, NB)

    def enospc(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, call, enospc)
    with capture_logs() as logs:
        assert s.batch_set(keys(2), [pg(0), pg(1)]) == [False, False]
    assert events(logs, "storage.write_failed")[0]["errno"] == errno.ENOSPC
    assert os.listdir(tmp_path) == [] and s.stats().errors == 2


def test_filesystem_without_user_xattrs_stores_unverified_pages(tmp_path, monkeypatch):
    s = FileStorage(tmp_path, SUFFIX, NB)

    def unsupported(*a):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "setxattr", unsupported)
    with capture_logs() as logs:
        assert s.batch_set(keys(2), [pg(0), pg(1)]) == [True, True]
    assert len(events(logs, "file_storage.checksum_unsupported")) == 1  # once, not per page
    out = torch.empty(NB, dtype=torch.uint8)
    assert s.batch_get(keys(1), [out]) == [True] and torch.equal(out, pg(0))
    assert s.stats().unverified == 1


def test_deleted_page_is_a_miss_and_the_index_is_corrected(tmp_path):
    s = FileStorage(tmp_path, SUFFIX, NB)
    ks = keys(3)
    s.batch_set(ks, [pg(i) for i in range(3)])
    os.unlink(tmp_path / f"{ks[1]}{SUFFIX}.bin")
    with capture_logs() as logs:
        assert s.batch_exists(ks) == 1
    assert events(logs, "file_storage.page_vanished")
    assert s.stats().pages == 2 and s.stats().stale_indexed == 1
    out = [torch.empty(NB, dtype=torch.uint8) for _ in range(3)]
    assert s.batch_get(ks, out) == [True, False, True]
    assert s.batch_set(ks[1:2], [pg(1)]) == [True]  # rewritten, not skipped
    assert s.batch_exists(ks) == 3


def test_deleted_page_found_by_batch_get_first(tmp_path):
    s = FileStorage(tmp_path, SUFFIX, NB)
    s.batch_set(keys(1), [pg(0)])
    os.unlink(tmp_path / f"{keys(1)[0]}{SUFFIX}.bin")
    assert s.batch_get(keys(1), [torch.empty(NB, dtype=torch.uint8)]) == [False]
    st = s.stats()
    assert (st.pages, st.misses, st.stale_indexed) == (0, 1, 1)


@pytest.mark.parametrize("how", ["truncate", "extend"])
def test_wrong_size_page_is_a_counted_miss_never_returned(tmp_path, how):
    s = FileStorage(tmp_path, SUFFIX, NB)
    k = keys(1)
    s.batch_set(k, [pg(5)])
    path = tmp_path / f"{k[0]}{SUFFIX}.bin"
    if how == "truncate":
        os.truncate(path, NB // 2)
    else:
        with open(path, "ab") as f:
            f.write(b"x")
    out = torch.full((NB,), 0xAA, dtype=torch.uint8)
    with capture_logs() as logs:
        assert s.batch_get(k, [out]) == [False]
    assert events(logs, "file_storage.wrong_size")[0]["expected"] == NB
    assert not bool((out == pg(5)).all()) and not bool(out.any())  # cleared, not the page's bytes
    st = s.stats()
    assert (st.wrong_size, st.misses, st.hits, st.pages) == (1, 1, 0, 0)
    assert s.batch_exists(k) == 0  # not re-adopted: wrong size


@pytest.mark.parametrize("where", ["data", "checksum"])
def test_bit_flip_is_detected_by_checksum_and_removed(tmp_path, where):
    s = FileStorage(tmp_path, SUFFIX, NB)
    k = keys(2)
    s.batch_set(k, [pg(1), pg(2)])
    path = tmp_path / f"{k[0]}{SUFFIX}.bin"
    if where == "data":
        raw = bytearray(path.read_bytes())
        raw[NB // 3] ^= 0x10  # one bit, same size
        path.write_bytes(bytes(raw))
    else:
        os.setxattr(path, XATTR, b"garbage")
    out = [torch.empty(NB, dtype=torch.uint8) for _ in range(2)]
    with capture_logs() as logs:
        assert s.batch_get(k, out) == [False, True]
    (ev,) = events(logs, "storage.page_refused")
    assert ev["log_level"] == "error" and ev["verdict"] == "corrupt"
    assert not out[0].any() and torch.equal(out[1], pg(2))
    st = s.stats()
    assert (st.corrupt, st.misses, st.hits) == (1, 1, 1)
    assert not path.exists()
    assert s.batch_exists(k) == 0
    assert s.batch_set(k[:1], [pg(1)]) == [True]  # repaired
    assert s.batch_get(k[:1], out[:1]) == [True] and torch.equal(out[0], pg(1))


def test_page_without_checksum_accepted_unverified_or_refused(tmp_path):
    k = keys(1)[0]
    (tmp_path / f"{k}{SUFFIX}.bin").write_bytes(bytes(pg(3).numpy()))  # as SGLang's HiCacheFile writes
    out = torch.empty(NB, dtype=torch.uint8)
    lax = FileStorage(tmp_path, SUFFIX, NB)
    assert lax.batch_get([k], [out]) == [True] and torch.equal(out, pg(3))
    assert lax.stats().unverified == 1
    strict = FileStorage(tmp_path, SUFFIX, NB, require_checksum=True)
    with capture_logs() as logs:
        assert strict.batch_get([k], [out]) == [False]
    (ev,) = events(logs, "storage.unverified_page")
    assert ev["served"] is False and strict.stats().unverified == 1
    assert (tmp_path / f"{k}{SUFFIX}.bin").exists()  # not ours to delete
    off = FileStorage(tmp_path, SUFFIX, NB, checksum=False)  # verification off: still counted
    assert off.batch_get([k], [out]) == [True] and off.stats().unverified == 1


class Crash(BaseException):
    """Stands for the process dying at this point: no cleanup handler runs."""


@pytest.mark.parametrize("crash_in", ["setxattr", "replace"])
def test_crash_mid_write_never_leaves_a_page_that_verifies_wrongly(tmp_path, monkeypatch, crash_in):
    """Deterministic companion of the SIGKILL test: die after the page bytes were written but
    before its checksum was set, or just before the rename; a new store on the directory never
    returns a wrong page, and a later start removes the dead writer's temp file."""
    s = FileStorage(tmp_path, SUFFIX, NB)
    s.batch_set(keys(1), [pg(0)])

    def die(*a):
        raise Crash

    monkeypatch.setattr(os, crash_in, die)
    with pytest.raises(Crash):
        s.batch_set(keys(1, 1), [pg(1)])
    monkeypatch.undo()
    assert len(stray_temps(tmp_path)) == 1  # the dead writer's temp file is there
    s2 = FileStorage(tmp_path, SUFFIX, NB)  # young temps: ignored, left for their (dead) writer
    out = torch.empty(NB, dtype=torch.uint8)
    assert s2.batch_get(keys(1), [out]) == [True] and torch.equal(out, pg(0))
    assert s2.batch_get(keys(1, 1), [out]) == [False]  # absent: the rename never happened
    assert s2.stats().pages == 1
    s3 = FileStorage(tmp_path, SUFFIX, NB, stale_temp_s=0)  # a later start cleans it
    assert stray_temps(tmp_path) == []
    assert s3.batch_set(keys(1, 1), [pg(1)]) == [True]
    assert s3.batch_get(keys(1, 1), [out]) == [True] and torch.equal(out, pg(1))
    assert s3.stats().unverified == s3.stats().corrupt == 0


def test_short_write_is_completed_not_truncated(tmp_path, monkeypatch):
    """An unbuffered write may write less than asked (a filling disk does this); the page is
    completed by further writes instead of renamed short."""
    import transfer.storage.file as fs

    real = fs._write_all

    def chunked(f, view):
        class Short:
            def write(self, v):
                return f.write(v[:1000])
        real(Short(), view)

    monkeypatch.setattr(fs, "_write_all", chunked)
    s = FileStorage(tmp_path, SUFFIX, NB)
    assert s.batch_set(keys(1), [pg(4)]) == [True]
    monkeypatch.undo()
    out = torch.empty(NB, dtype=torch.uint8)
    assert s.batch_get(keys(1), [out]) == [True] and torch.equal(out, pg(4))
    assert s.stats().corrupt == 0


def test_large_pages_written_concurrently_verify(tmp_path):
    big = 1 << 20
    s = FileStorage(tmp_path, SUFFIX, big)
    assert s.batch_set(keys(2), [pg(0, big), pg(1, big)]) == [True, True]
    out = torch.empty(big, dtype=torch.uint8)
    assert s.batch_get(keys(1, 1), [out]) == [True] and torch.equal(out, pg(1, big))
    s.close()
    s.close()


def test_file_store_fault_under_host_offloader_returns_host_pages(small_tmpfs):
    """End to end: a real full disk under a HostOffloader: ops fail, are reported, pages return."""
    kv = KVPool(2, 2, 8, torch.bfloat16, 128)
    host = HostPool(2, 2, 8, torch.bfloat16, PS, 128)
    store = FileStorage(small_tmpfs, SUFFIX, host.page_nbytes)
    off = HostOffloader(kv, host, store)
    ops, hs = [], []
    for c in range(4):
        slots = torch.arange(32 * c, 32 * c + 32)
        kv.write(slots, synthetic_kv(kv, 1, slots))
        hs.append(off.write(slots, c))
    drain(polls(off).ended, 4)
    for c, h in enumerate(hs):
        ops.append(store_chunk(off, h, 1000 * c))
    assert sorted(drain(off.finished_storage, 4)) == sorted(ops)
    assert off.failed_storage()  # 64 KiB cannot hold 32 pages at a 4 KiB block each
    for h in hs:
        off.free_host(h)
    assert host.available_size() == 128 and off.idle() and stray_temps(small_tmpfs) == []
    host.check_integrity()
    off.close()
    store.close()

