"""FileStorage specifics: SGLang naming, atomic writes, index rebuild, real I/O faults."""

import errno
import os
import threading
import time

import pytest
import torch

import hashing
from transfer import FileStorage, StorageUnavailable

NB = 32
SUFFIX = hashing.storage_suffix("org/model", 1, 2)


def page(i):
    return torch.full((NB,), i, dtype=torch.uint8)


A, B, C, D, E, Z = (f"{i:x}" * 64 for i in (10, 11, 12, 13, 14, 15))  # page hashes "aaaa...", "bbbb..."


def test_files_named_like_hicachefile_with_raw_bytes(tmp_path):
    s = FileStorage(tmp_path, SUFFIX, NB)
    h = hashing.page_hashes(list(range(4)), 4)[0]
    s.batch_set([h], [page(7)])
    path = tmp_path / f"{h}_org-model_1_2.bin"
    assert sorted(os.listdir(tmp_path)) == [path.name]
    assert path.read_bytes() == bytes([7]) * NB  # raw page bytes; the crc32 is an xattr


def test_no_torn_file_visible_during_write(tmp_path, monkeypatch):
    s = FileStorage(tmp_path, SUFFIX, NB)
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append((sorted(os.listdir(tmp_path)), os.path.getsize(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    s.batch_set([A], [page(1)])
    (names, size), = seen
    assert names == [n for n in names if n.startswith(".") and n.endswith(".tmp")]  # final absent
    assert size == NB
    assert os.listdir(tmp_path) == [f"{A}{SUFFIX}.bin"]


def test_failed_replace_leaves_no_file(tmp_path, monkeypatch):
    s = FileStorage(tmp_path, SUFFIX, NB)

    def enospc(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", enospc)
    assert s.batch_set([A], [page(1)]) == [False]
    assert os.listdir(tmp_path) == [] and s.stats().errors == 1


def test_index_rebuilt_at_restart_and_stale_temps_removed(tmp_path):
    s = FileStorage(tmp_path, SUFFIX, NB)
    s.batch_set([A, B], [page(1), page(2)])
    old = time.time() - 3600
    os.utime(tmp_path / f"{A}{SUFFIX}.bin", (old, old))  # a is least recently used
    stale = tmp_path / f".{C}{SUFFIX}.bin.{'de' * 16}.tmp"
    stale.write_bytes(b"torn")
    os.utime(stale, (old, old))
    fresh = tmp_path / f".{D}{SUFFIX}.bin.{'ca' * 16}.tmp"
    fresh.write_bytes(b"in progress")
    other = tmp_path / "x_other-model_0_1.bin"
    other.write_bytes(b"not ours")
    (tmp_path / f"{E}{SUFFIX}.bin").write_bytes(b"wrong size")

    s2 = FileStorage(tmp_path, SUFFIX, NB, capacity_pages=2)
    assert not stale.exists() and fresh.exists() and other.exists()
    assert s2.batch_exists([A, B]) == 2 and s2.stats().pages == 2
    s2.batch_set([E], [page(5)])  # evicts a, the oldest
    assert not (tmp_path / f"{A}{SUFFIX}.bin").exists()
    out = torch.empty(NB, dtype=torch.uint8)
    assert s2.batch_get([B], [out]) == [True] and torch.equal(out, page(2))


def test_capacity_applied_at_restart(tmp_path):
    s = FileStorage(tmp_path, SUFFIX, NB)
    s.batch_set([A, B, C], [page(1), page(2), page(3)])
    s2 = FileStorage(tmp_path, SUFFIX, NB, capacity_pages=1)
    assert s2.stats().pages == 1 and len(os.listdir(tmp_path)) == 1


def test_page_written_by_another_node_is_found(tmp_path):
    s = FileStorage(tmp_path, SUFFIX, NB)
    (tmp_path / f"{Z}{SUFFIX}.bin").write_bytes(bytes(NB))
    assert s.batch_exists([Z]) == 1


def test_file_deleted_behind_our_back_is_a_miss(tmp_path):
    s = FileStorage(tmp_path, SUFFIX, NB)
    s.batch_set([A], [page(1)])
    os.unlink(tmp_path / f"{A}{SUFFIX}.bin")
    assert s.batch_get([A], [torch.empty(NB, dtype=torch.uint8)]) == [False]
    assert s.batch_exists([A]) == 0


def test_unwritable_directory_raises_at_construction(tmp_path):
    # A real fault that holds even for root: the directory's parent is a regular file.
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(StorageUnavailable):
        FileStorage(blocker / "store", SUFFIX, NB)


def test_directory_removed_after_start_fails_writes(tmp_path):
    d = tmp_path / "store"
    s = FileStorage(d, SUFFIX, NB)
    os.rmdir(d)
    d.write_bytes(b"")  # now a regular file: every open() under it fails with ENOTDIR
    assert s.batch_set([A], [page(1)]) == [False]
    assert s.stats().errors == 1


# --- exact ownership: another deployment's files are never touched ------------------------------

def test_foreign_suffix_pages_of_the_right_size_are_never_adopted_or_evicted(tmp_path):
    ours = "_Llama-3-8B_0_1"
    theirs = [f"{A}_team-ft_Llama-3-8B_0_1.bin",  # ends with our suffix: not ours
              f"{B}_x_model_0_1.bin", f"x{A}{ours}.bin", f"{A[:-1]}{ours}.bin", f"{A}{ours}.bin.bak",
              f"{A.upper()}{ours}.bin", f"{A}.kv{ours}.bin"]
    for name in theirs:
        (tmp_path / name).write_bytes(bytes(NB))  # the right size
    temps = [f".{A}_team-ft_Llama-3-8B_0_1.bin.{'ab' * 16}.tmp", f".{A}{ours}.bin.short.tmp"]
    old = time.time() - 3600
    for name in temps:
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (old, old))
    s = FileStorage(tmp_path, ours, NB, capacity_pages=1, stale_temp_s=0)  # restart, tight bound
    assert s.stats().pages == 0  # none of them adopted
    s.batch_set([C, D], [page(1), page(2)])  # evicts within our own pages only
    assert s.stats().evictions == 1
    for name in theirs + temps:
        assert (tmp_path / name).exists(), name
    assert s.batch_exists([A]) == 0 and s.batch_exists([B]) == 0
    assert not s.delete(A) and (tmp_path / theirs[0]).exists()


def test_same_name_pages_another_deployment_sealed_are_never_replaced_indexed_evicted_or_deleted(tmp_path):
    """Our exact file names, sealed by a deployment of another format (another host layout):
    not indexed at start (so a tight bound never evicts them), not replaced by a write of ours —
    also for a key we had indexed whose file was replaced since — and not deleted; each write or
    delete that leaves one is counted ``foreign_kept`` and reports the page stored / not deleted.
    A store that writes no seals (``checksum=False``) leaves them too."""
    from transfer.storage.integrity import PageFormat
    first = PageFormat.of("page_first", torch.uint8, (2, NB // 2))
    head = PageFormat.of("page_head", torch.uint8, (2, NB // 2))
    theirs = FileStorage(tmp_path, SUFFIX, NB, page_format=head)
    assert theirs.batch_set([A, B], [page(1), page(2)]) == [True, True]
    ours = FileStorage(tmp_path, SUFFIX, NB, capacity_pages=1, page_format=first)  # a restart, tight bound
    assert ours.stats().pages == 0 and ours.stats().evictions == 0
    assert ours.batch_set([A, C], [page(7), page(3)]) == [True, True]
    assert (ours.stats().stored, ours.stats().foreign_kept) == (1, 1)
    os.unlink(tmp_path / f"{C}{SUFFIX}.bin")  # our indexed C vanishes, and theirs writes C
    assert theirs.batch_set([C], [page(4)]) == [True]
    assert ours.batch_set([C], [page(3)]) == [True] and ours.stats().foreign_kept == 2
    assert ours.batch_set([D], [page(5)]) == [True] and ours.delete(B) is False
    assert ours.stats().foreign_kept == 3
    plain = FileStorage(tmp_path, SUFFIX, NB, checksum=False, page_format=first)
    assert plain.batch_set([A], [page(9)]) == [True] and plain.delete(C) is False
    assert plain.stats().foreign_kept == 2
    out = torch.empty(NB, dtype=torch.uint8)
    for key, i in ((A, 1), (B, 2), (C, 4)):
        assert theirs.batch_get([key], [out]) == [True] and torch.equal(out, page(i)), key
    assert ours.batch_get([A], [out]) == [False] and ours.stats().foreign == 1
    assert ours.delete(D) is True  # its own page


def test_default_model_name_does_not_claim_other_models(tmp_path):
    other = tmp_path / f"{A}_org-model_0_1.bin"  # '*_model_0_1' but model 'org/model'
    other.write_bytes(bytes(NB))
    s = FileStorage(tmp_path, hashing.storage_suffix("model"), NB, capacity_pages=1)
    s.batch_set([B, C], [page(1), page(2)])
    assert other.exists() and s.stats().pages == 1


# --- batch_set / batch_exists tell the truth about the disk -------------------------------------

def test_indexed_page_deleted_behind_the_store_is_rewritten_by_set(tmp_path):
    s = FileStorage(tmp_path, SUFFIX, NB)
    s.batch_set([A], [page(1)])
    os.unlink(tmp_path / f"{A}{SUFFIX}.bin")  # another process sharing the directory evicted it
    assert s.batch_set([A], [page(1)]) == [True]
    assert (tmp_path / f"{A}{SUFFIX}.bin").exists() and s.stats().stored == 2 and s.stats().skipped == 0
    out = torch.empty(NB, dtype=torch.uint8)
    assert s.batch_get([A], [out]) == [True] and torch.equal(out, page(1))


def test_batch_exists_stats_not_reads(tmp_path, monkeypatch):
    s = FileStorage(tmp_path, SUFFIX, NB)
    s.batch_set([A, B], [page(1), page(2)])
    import builtins
    monkeypatch.setattr(builtins, "open", lambda *a, **k: (_ for _ in ()).throw(AssertionError("read")))
    assert s.batch_exists([A, B]) == 2
    os.unlink(tmp_path / f"{B}{SUFFIX}.bin")
    assert s.batch_exists([A, B]) == 1


# --- unverified pages are never silent ----------------------------------------------------------

def test_unverified_pages_counted_warned_once_and_refused_in_strict_mode(tmp_path):
    from structlog.testing import capture_logs
    for key in (A, B):  # as SGLang (or cp -r without xattrs) leaves them: raw bytes, no seal
        (tmp_path / f"{key}{SUFFIX}.bin").write_bytes(bytes(page(3).numpy()))
    lax = FileStorage(tmp_path, SUFFIX, NB)
    out = torch.empty(NB, dtype=torch.uint8)
    with capture_logs() as logs:
        assert lax.batch_get([A, B], [out, out.clone()]) == [True, True]
    assert lax.stats().unverified == 2 and torch.equal(out, page(3))
    assert [e["event"] for e in logs].count("storage.unverified_page") == 1  # once per store
    strict = FileStorage(tmp_path, SUFFIX, NB, require_checksum=True)
    assert strict.batch_exists([A]) == 0
    assert strict.batch_get([A], [out]) == [False] and strict.stats().unverified == 1
    assert (tmp_path / f"{A}{SUFFIX}.bin").exists()  # refused, not deleted: it is SGLang's page


def test_close_is_bounded_through_a_write_hung_in_the_filesystem_and_names_it(tmp_path, monkeypatch):
    """reliability.md: close bounds the whole shutdown wait. A page write blocked in the kernel (a
    FIFO opened for writing with no reader: an NFS-like hang) is abandoned and named, not waited on."""
    from structlog.testing import capture_logs

    from tests.support.hung_fs import HungWrite
    from tests.transfer.test_shutdown import bounded

    s = FileStorage(tmp_path / "store", SUFFIX, NB, write_threads=2)
    keys = [f"{i:064x}" for i in (1, 2)]
    hung = HungWrite(s, keys[1] + SUFFIX, monkeypatch)
    results: list = []
    writer = threading.Thread(target=lambda: results.append(s.batch_set(keys, [page(1), page(2)])), daemon=True)
    writer.start()
    hung.wait_stuck()
    with capture_logs() as logs:
        abandoned = bounded(lambda: s.close(timeout=0.05))
    assert abandoned == [keys[1] + SUFFIX]
    (ev,) = [e for e in logs if e["event"] == "file_storage.close_abandoned"]
    assert ev["log_level"] == "error" and ev["pages"] == abandoned
    # the line says which store, under which bound, and why the write could not just be stopped
    assert ev["directory"] == str(tmp_path / "store") and ev["timeout"] == 0.05
    assert "still running" in ev["detail"] and "hung filesystem call cannot be cancelled" in ev["detail"]
    hung.release()
    writer.join(10)
    assert results == [[True, False]]  # the hung page failed when it came back; its temp file is gone
    assert s.writes_in_flight() == [] and s.close(timeout=0) == []
    assert sorted(os.listdir(tmp_path / "store")) == [keys[0] + SUFFIX + ".bin"]


def test_close_without_writes_in_flight_returns_nothing_and_checks_its_timeout(tmp_path):
    s = FileStorage(tmp_path / "store", SUFFIX, NB)
    assert s.batch_set([f"{i:064x}" for i in (1, 2)], [page(1), page(2)]) == [True, True]
    for bad in (-1, float("nan"), "1", True):
        with pytest.raises(ValueError):
            s.close(timeout=bad)
    assert s.close() == [] and s.close(timeout=None) == []
    assert s.batch_set([f"{3:064x}", f"{4:064x}"], [page(3), page(4)]) == [True, True]  # new writers after close
    assert s.close(timeout=1) == []


def test_a_page_replaced_behind_the_index_is_dropped_and_logged_with_its_name_and_size(tmp_path):
    from structlog.testing import capture_logs
    s = FileStorage(tmp_path, SUFFIX, NB)
    s.batch_set([A], [page(1)])
    (tmp_path / f"{A}{SUFFIX}.bin").write_bytes(bytes(NB + 3))  # another process wrote another size
    with capture_logs() as logs:
        assert s.batch_exists([A]) == 0
    (ev,) = [e for e in logs if e["event"] == "file_storage.page_vanished"]
    assert ev["log_level"] == "warning" and ev["name"] == A + SUFFIX and ev["size"] == NB + 3
    assert s.stats().stale_indexed == 1 and s.stats().pages == 0


def test_a_batch_is_written_by_the_stores_named_daemon_writer_threads(tmp_path, monkeypatch):
    s = FileStorage(tmp_path, SUFFIX, NB, write_threads=2)
    seen = []
    real = s._write_file

    def spy(*args):
        seen.append((threading.current_thread().name, threading.current_thread().daemon))
        return real(*args)

    monkeypatch.setattr(s, "_write_file", spy)
    assert s.batch_set([A, B, C], [page(1), page(2), page(3)]) == [True] * 3
    assert len(seen) == 3 and {n for n, _ in seen} <= {"kv-file-write-0", "kv-file-write-1"}
    assert all(daemon for _, daemon in seen)
    s.close()


def test_a_write_that_makes_no_progress_is_a_no_space_error():
    from transfer.storage.file import _write_all

    class Full:
        def write(self, view):
            return 0

    with pytest.raises(OSError) as err:
        _write_all(Full(), memoryview(b"page"))
    assert err.value.errno == errno.ENOSPC and err.value.strerror == "short write"  # what storage.write_failed logs


def test_without_a_suffix_a_page_file_is_its_hash(tmp_path):
    s = FileStorage(tmp_path, page_nbytes=NB)
    assert s.batch_set([A], [page(1)]) == [True]
    assert os.listdir(tmp_path) == [f"{A}.bin"]


# --- reads that fail: counted, logged with the page, bytes never served --------------------------

def test_an_indexed_page_that_vanished_is_a_counted_miss_logged_with_its_name(tmp_path):
    from structlog.testing import capture_logs
    s = FileStorage(tmp_path, SUFFIX, NB)
    s.batch_set([A], [page(1)])
    os.unlink(tmp_path / f"{A}{SUFFIX}.bin")
    with capture_logs() as logs:
        assert s.batch_get([A], [torch.empty(NB, dtype=torch.uint8)]) == [False]
    (ev,) = [e for e in logs if e["event"] == "file_storage.page_vanished"]
    assert ev["log_level"] == "warning" and ev["name"] == A + SUFFIX
    st = s.stats()
    assert st.stale_indexed == 1 and st.misses == 1 and st.pages == 0


@pytest.mark.parametrize("size", [NB - 5, NB + 3])
def test_an_indexed_page_of_another_size_is_a_wrong_size_miss_logged_and_zeroed(tmp_path, size):
    from structlog.testing import capture_logs
    s = FileStorage(tmp_path, SUFFIX, NB)
    s.batch_set([A], [page(1)])
    # another process rewrote the file in place (its seal xattr stays): longer or shorter
    (tmp_path / f"{A}{SUFFIX}.bin").write_bytes((bytes(page(1).numpy()) * 2)[:size])
    out = torch.full((NB,), 9, dtype=torch.uint8)
    with capture_logs() as logs:
        assert s.batch_get([A], [out]) == [False]
    assert torch.equal(out, torch.zeros(NB, dtype=torch.uint8))  # nothing of the file left in the buffer
    st = s.stats()
    assert st.wrong_size == 1 and st.corrupt == 0 and st.unverified == 0 and st.errors == 0
    assert st.misses == 1 and st.hits == 0
    (ev,) = [e for e in logs if e["event"] == "file_storage.wrong_size"]
    assert ev["log_level"] == "error" and ev["name"] == A + SUFFIX
    assert ev["expected"] == NB and ev["size"] == size


def test_writing_and_reading_a_page_raise_no_warning(tmp_path):
    import warnings
    s = FileStorage(tmp_path, SUFFIX, NB)
    out = torch.empty(NB, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. a binary file opened line-buffered warns
        assert s.batch_set([A], [page(4)]) == [True]
        assert s.batch_get([A], [out]) == [True]
    assert torch.equal(out, page(4))


def _xattr_eio(monkeypatch, calls):
    import transfer.storage.file as file_mod

    def getxattr(*a, **kw):
        calls.append(a)
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(file_mod.os, "getxattr", getxattr)


def test_without_checksums_a_read_never_asks_for_the_seal(tmp_path, monkeypatch):
    s = FileStorage(tmp_path, SUFFIX, NB, checksum=False)
    s.batch_set([A], [page(5)])
    calls = []
    _xattr_eio(monkeypatch, calls)  # a filesystem whose xattr calls fail: irrelevant without checksums
    out = torch.empty(NB, dtype=torch.uint8)
    assert s.batch_get([A], [out]) == [True] and torch.equal(out, page(5))
    assert calls == [] and s.stats().errors == 0 and s.stats().unverified == 1


def test_a_page_of_the_wrong_size_is_refused_before_its_seal_is_read(tmp_path, monkeypatch):
    s = FileStorage(tmp_path, SUFFIX, NB)
    s.batch_set([A], [page(5)])
    (tmp_path / f"{A}{SUFFIX}.bin").write_bytes(bytes(NB + 1))
    calls = []
    _xattr_eio(monkeypatch, calls)
    assert s.batch_get([A], [torch.empty(NB, dtype=torch.uint8)]) == [False]
    assert calls == [] and s.stats().wrong_size == 1 and s.stats().errors == 0


# --- seals written by older versions, and seals that are not seals ------------------------------

def _raw_page_with_xattr(tmp_path, key, value):
    path = tmp_path / f"{key}{SUFFIX}.bin"
    path.write_bytes(bytes(page(6).numpy()))
    os.setxattr(path, "user.kv_lifecycle.checksum", value)
    return path


def test_an_older_versions_checksum_reads_as_unverified_and_strict_mode_refuses_it(tmp_path):
    _raw_page_with_xattr(tmp_path, A, b"wsum64 0123456789abcdef")
    lax = FileStorage(tmp_path, SUFFIX, NB)
    out = torch.empty(NB, dtype=torch.uint8)
    assert lax.batch_get([A], [out]) == [True] and torch.equal(out, page(6))
    st = lax.stats()
    assert st.unverified == 1 and st.corrupt == 0 and st.foreign == 0
    strict = FileStorage(tmp_path, SUFFIX, NB, require_checksum=True)
    assert strict.batch_get([A], [out]) == [False] and strict.stats().unverified == 1
    assert strict.stats().corrupt == 0 and (tmp_path / f"{A}{SUFFIX}.bin").exists()


def test_an_unindexed_page_with_an_older_versions_checksum_is_adopted_unless_strict(tmp_path):
    lax = FileStorage(tmp_path, SUFFIX, NB)
    strict = FileStorage(tmp_path, SUFFIX, NB, require_checksum=True)
    _raw_page_with_xattr(tmp_path, A, b"wsum64 0123456789abcdef")  # after the index scans
    assert lax.batch_exists([A]) == 1 and lax.stats().pages == 1
    assert strict.batch_exists([A]) == 0 and strict.stats().pages == 0


def test_an_unindexed_page_whose_seal_does_not_decode_is_not_adopted(tmp_path):
    s = FileStorage(tmp_path, SUFFIX, NB)  # no page_format: the format would come from the seal
    _raw_page_with_xattr(tmp_path, A, b"not a seal")
    assert s.batch_exists([A]) == 0 and s.stats().pages == 0


def test_without_a_page_size_a_page_stored_by_another_store_is_adopted(tmp_path):
    s = FileStorage(tmp_path, SUFFIX)  # an empty directory: nothing indexed
    FileStorage(tmp_path, SUFFIX).batch_set([A, B], [page(1), page(2)])
    assert s.batch_exists([A, B]) == 2 and s.stats().pages == 2


def test_without_checksums_an_indexed_page_of_another_size_is_no_longer_present(tmp_path):
    s = FileStorage(tmp_path, SUFFIX, NB, checksum=False)
    s.batch_set([A], [page(1)])
    (tmp_path / f"{A}{SUFFIX}.bin").write_bytes(bytes(NB + 3))
    assert s.batch_exists([A]) == 0 and s.stats().stale_indexed == 1
    assert s.batch_set([A], [page(1)]) == [True] and s.stats().stored == 2  # rewritten, not skipped
    assert (tmp_path / f"{A}{SUFFIX}.bin").read_bytes() == bytes(page(1).numpy())


def test_close_waits_for_a_write_that_ends_before_its_deadline(tmp_path, monkeypatch):
    """close(timeout) waits *up to* timeout for the writes in flight: a write that ends within the
    bound (here one page written by the caller's own thread, released a moment after close begins)
    is waited for, not abandoned."""
    from tests.support.hung_fs import HungWrite
    from tests.transfer.test_shutdown import bounded

    s = FileStorage(tmp_path / "store", SUFFIX, NB)
    hung = HungWrite(s, A + SUFFIX, monkeypatch)
    results: list = []
    writer = threading.Thread(target=lambda: results.append(s.batch_set([A], [page(1)])), daemon=True)
    writer.start()
    hung.wait_stuck()
    releaser = threading.Timer(0.2, hung.release)  # the filesystem comes back while close waits
    releaser.start()
    assert bounded(lambda: s.close(timeout=10)) == []  # nothing abandoned: the write ended in time
    releaser.join(10)
    writer.join(10)
    assert results == [[False]] and s.writes_in_flight() == []  # it failed on the pipe, and ended


# --- durability, defaults and concurrency of writes ----------------------------------------------

def test_fsync_is_off_by_default_and_syncs_each_whole_page_before_its_rename(tmp_path, monkeypatch):
    """storage.md: ``fsync=True`` adds an fsync before the rename (off by default). What is synced
    is the whole page, already handed to the file, and not yet renamed into place."""
    default, durable = tmp_path / "default", tmp_path / "durable"
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append((os.fstat(fd).st_size, sorted(os.listdir(durable))))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    durable.mkdir()
    assert FileStorage(default, SUFFIX, NB).batch_set([A], [page(1)]) == [True]
    assert synced == []  # the page cache is enough for a cache that can be recomputed
    assert FileStorage(durable, SUFFIX, NB, fsync=True).batch_set([A], [page(1)]) == [True]
    (size, names), = synced
    assert size == NB  # the page's bytes were in the file when it was synced
    assert len(names) == 1 and names[0].startswith(f".{A}{SUFFIX}.bin.") and names[0].endswith(".tmp")
    assert os.listdir(durable) == [f"{A}{SUFFIX}.bin"]


def test_by_default_a_batch_is_written_by_two_writer_threads(tmp_path):
    """storage.md: the file store writes a batch's pages with ``write_threads`` (default 2) threads."""
    before = set(threading.enumerate())
    s = FileStorage(tmp_path, SUFFIX, NB)
    assert s.batch_set([A, B, C, D], [page(1), page(2), page(3), page(4)]) == [True] * 4
    started = [t for t in threading.enumerate() if t not in before and t.name.startswith("kv-file-write")]
    assert sorted(t.name for t in started) == ["kv-file-write-0", "kv-file-write-1"]
    s.close()


def test_the_two_pages_of_a_batch_are_written_at_once(tmp_path, monkeypatch):
    """Pages of a batch are written concurrently: each write of a two-page batch waits, before its
    rename, for the other write to get there too, which only happens if both run at the same time."""
    s = FileStorage(tmp_path, SUFFIX, NB, write_threads=2)
    both_in_flight = threading.Barrier(2, timeout=10)
    real_replace = os.replace

    def replace(src, dst):
        both_in_flight.wait()
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    assert s.batch_set([A, B], [page(1), page(2)]) == [True, True]
    s.close()
    out = torch.empty(NB, dtype=torch.uint8)
    assert s.batch_get([B], [out]) == [True] and torch.equal(out, page(2))


def test_with_one_write_thread_the_caller_writes_the_batch_and_no_thread_is_started(tmp_path, monkeypatch):
    before = set(threading.enumerate())
    s = FileStorage(tmp_path, SUFFIX, NB, write_threads=1)
    writers = []
    real_replace = os.replace

    def replace(src, dst):
        writers.append(threading.current_thread())
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    assert s.batch_set([A, B, C], [page(1), page(2), page(3)]) == [True] * 3
    assert writers == [threading.current_thread()] * 3  # one page after another, on the caller's thread
    assert set(threading.enumerate()) <= before


# --- what the directory scan at start removes, ignores and says -----------------------------------

def test_by_default_a_temp_file_a_minute_old_is_stale_and_a_younger_one_is_left(tmp_path):
    """storage.md: temp files older than ``stale_temp_s`` (60 s) are a crashed writer's leftovers and
    are deleted at start (logged with their path); younger ones may belong to a live writer."""
    from structlog.testing import capture_logs
    now = time.time()
    old = tmp_path / f".{A}{SUFFIX}.bin.{'ab' * 16}.tmp"
    young = tmp_path / f".{B}{SUFFIX}.bin.{'cd' * 16}.tmp"
    for path, age in ((old, 60.5), (young, 30)):
        path.write_bytes(b"torn")
        os.utime(path, (now - age, now - age))
    with capture_logs() as logs:
        FileStorage(tmp_path, SUFFIX, NB)
    assert not old.exists() and young.exists()
    (ev,) = [e for e in logs if e["event"] == "file_storage.removed_stale_temp"]
    assert ev["log_level"] == "info" and ev["path"] == str(old)


def test_with_stale_temp_s_zero_every_temp_file_is_removed_even_one_of_this_instant(tmp_path, monkeypatch):
    """reliability.md: a start with ``stale_temp_s=0`` removes the temp files — all of them, even
    one whose modification time is the very clock reading of the start."""
    now_s = int(time.time())
    temp = tmp_path / f".{A}{SUFFIX}.bin.{'ab' * 16}.tmp"
    temp.write_bytes(b"torn")
    os.utime(temp, ns=(now_s * 10**9, now_s * 10**9))
    with monkeypatch.context() as clock:
        clock.setattr(time, "time", lambda: float(now_s))  # the start happens at that same instant
        FileStorage(tmp_path, SUFFIX, NB, stale_temp_s=0)
    assert not temp.exists()


def test_a_page_file_of_the_wrong_size_is_ignored_at_start_with_its_path_and_size(tmp_path):
    from structlog.testing import capture_logs
    wrong = tmp_path / f"{A}{SUFFIX}.bin"
    wrong.write_bytes(bytes(NB + 3))
    with capture_logs() as logs:
        s = FileStorage(tmp_path, SUFFIX, NB)
    assert s.stats().pages == 0 and wrong.exists()  # not indexed, not deleted
    (ev,) = [e for e in logs if e["event"] == "file_storage.ignored_wrong_size"]
    assert ev["log_level"] == "warning" and ev["path"] == str(wrong) and ev["size"] == NB + 3


def test_a_symlink_named_like_a_page_is_not_indexed_at_start_nor_evicted(tmp_path):
    """Only this store's own regular files are indexed at start: a link named like a page (to a file
    elsewhere) is not one of them, so it is never counted nor evicted, even without a page size."""
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(bytes(page(1).numpy()))
    d = tmp_path / "store"
    d.mkdir()
    link = d / f"{A}{SUFFIX}.bin"
    os.symlink(elsewhere, link)
    s = FileStorage(d, SUFFIX, capacity_pages=1)
    assert s.stats().pages == 0
    assert s.batch_set([B], [page(2)]) == [True] and s.stats().evictions == 0
    assert link.is_symlink() and elsewhere.exists()



def test_a_symlink_named_like_a_page_that_appears_later_is_never_adopted_read_nor_evicted(tmp_path):
    """The same rule after start: a link that another process puts under a page's name — here to a
    real, sealed page of that name in another store's directory — is not this store's file. It is
    not counted by ``batch_exists``, not served, and eviction never removes it."""
    other = FileStorage(tmp_path / "other", SUFFIX, NB)
    assert other.batch_set([A], [page(1)]) == [True]
    d = tmp_path / "store"
    s = FileStorage(d, SUFFIX, NB, capacity_pages=1)
    link = d / f"{A}{SUFFIX}.bin"
    os.symlink(tmp_path / "other" / f"{A}{SUFFIX}.bin", link)
    assert s.batch_exists([A]) == 0 and s.stats().pages == 0
    out = torch.zeros(NB, dtype=torch.uint8)
    assert s.batch_get([A], [out]) == [False] and not out.any()
    assert s.batch_set([B], [page(2)]) == [True] and s.stats().evictions == 0
    assert link.is_symlink() and other.batch_exists([A]) == 1
    # a page of this store replaced by such a link (B's file, now a link to A's): not followed
    assert other.batch_set([B], [page(2)]) == [True]
    mine = d / f"{B}{SUFFIX}.bin"
    mine.unlink()
    os.symlink(tmp_path / "other" / f"{B}{SUFFIX}.bin", mine)
    assert s.batch_get([B], [out]) == [False] and not out.any()
    assert mine.is_symlink() and other.batch_get([B], [out]) == [True]
    # deleting either name removes no link (a delete of a name that holds no page of ours: False)
    assert s.delete(A) is False and s.delete(B) is False
    assert link.is_symlink() and mine.is_symlink() and other.batch_exists([A, B]) == 2


def test_an_indexed_page_replaced_by_a_link_is_not_evicted_through_the_link(tmp_path):
    """Eviction is a delete too: a page this store indexed, whose file another process then
    replaced by a link, is dropped from the index when its turn comes, and the link stays."""
    other = FileStorage(tmp_path / "other", SUFFIX, NB)
    assert other.batch_set([A], [page(1)]) == [True]
    d = tmp_path / "store"
    s = FileStorage(d, SUFFIX, NB, capacity_pages=1)
    assert s.batch_set([A], [page(1)]) == [True]
    mine = d / f"{A}{SUFFIX}.bin"
    mine.unlink()
    os.symlink(tmp_path / "other" / f"{A}{SUFFIX}.bin", mine)
    assert s.batch_set([B], [page(2)]) == [True]     # A's turn to be evicted
    assert mine.is_symlink() and other.batch_exists([A]) == 1
    assert s.batch_exists([B]) == 1 and s.stats().pages == 1

# --- construction refuses what it cannot use, and says so -----------------------------------------

def test_a_directory_that_exists_but_takes_no_file_is_refused_at_construction_by_name():
    """The directory must be writable, not merely exist: procfs exists and refuses new files even to
    root. The error names the directory."""
    with pytest.raises(StorageUnavailable, match="'/proc'"):
        FileStorage("/proc", SUFFIX, NB)


def test_on_a_filesystem_without_user_xattrs_pages_are_stored_unverified_and_each_store_warns_once(
        tmp_path, monkeypatch):
    """docs: on a filesystem without user xattrs the store logs ``file_storage.checksum_unsupported``
    once (naming its directory and the error) and stores pages unverified."""
    from structlog.testing import capture_logs

    def unsupported(*a):
        raise OSError(errno.ENOTSUP, "Operation not supported")

    monkeypatch.setattr(os, "setxattr", unsupported)
    first, second = FileStorage(tmp_path / "one", SUFFIX, NB), FileStorage(tmp_path / "two", SUFFIX, NB)
    with capture_logs() as logs:
        assert first.batch_set([A], [page(1)]) == [True] and first.batch_set([B], [page(2)]) == [True]
        assert second.batch_set([A], [page(1)]) == [True]
    warned = [e for e in logs if e["event"] == "file_storage.checksum_unsupported"]
    assert [(e["log_level"], e["directory"]) for e in warned] == [
        ("warning", str(tmp_path / "one")), ("warning", str(tmp_path / "two"))]
    assert all("Operation not supported" in e["error"] for e in warned)
    out = torch.empty(NB, dtype=torch.uint8)
    assert first.batch_get([B], [out]) == [True] and torch.equal(out, page(2))
    assert first.stats().unverified == 1
