"""FileStorage specifics: SGLang naming, atomic writes, index rebuild, real I/O faults."""

import errno
import os
import time

import pytest
import torch

import hashing
from transfer import FileStorage, StorageUnavailable

NB = 32
SUFFIX = hashing.storage_suffix("org/model", 1, 2)


def page(i):
    return torch.full((NB,), i, dtype=torch.uint8)


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
    s.batch_set(["a"], [page(1)])
    (names, size), = seen
    assert names == [n for n in names if n.startswith(".") and n.endswith(".tmp")]  # final absent
    assert size == NB
    assert os.listdir(tmp_path) == [f"a{SUFFIX}.bin"]


def test_failed_replace_leaves_no_file(tmp_path, monkeypatch):
    s = FileStorage(tmp_path, SUFFIX, NB)

    def enospc(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", enospc)
    assert s.batch_set(["a"], [page(1)]) == [False]
    assert os.listdir(tmp_path) == [] and s.stats().errors == 1


def test_index_rebuilt_at_restart_and_stale_temps_removed(tmp_path):
    s = FileStorage(tmp_path, SUFFIX, NB)
    s.batch_set(["a", "b"], [page(1), page(2)])
    old = time.time() - 3600
    os.utime(tmp_path / f"a{SUFFIX}.bin", (old, old))  # a is least recently used
    stale = tmp_path / f".c{SUFFIX}.bin.deadbeef.tmp"
    stale.write_bytes(b"torn")
    os.utime(stale, (old, old))
    fresh = tmp_path / f".d{SUFFIX}.bin.cafe.tmp"
    fresh.write_bytes(b"in progress")
    other = tmp_path / "x_other-model_0_1.bin"
    other.write_bytes(b"not ours")
    (tmp_path / f"short{SUFFIX}.bin").write_bytes(b"wrong size")

    s2 = FileStorage(tmp_path, SUFFIX, NB, capacity_pages=2)
    assert not stale.exists() and fresh.exists() and other.exists()
    assert s2.batch_exists(["a", "b"]) == 2 and s2.stats().pages == 2
    s2.batch_set(["e"], [page(5)])  # evicts a, the oldest
    assert not (tmp_path / f"a{SUFFIX}.bin").exists()
    out = torch.empty(NB, dtype=torch.uint8)
    assert s2.batch_get(["b"], [out]) == [True] and torch.equal(out, page(2))


def test_capacity_applied_at_restart(tmp_path):
    s = FileStorage(tmp_path, SUFFIX, NB)
    s.batch_set(["a", "b", "c"], [page(1), page(2), page(3)])
    s2 = FileStorage(tmp_path, SUFFIX, NB, capacity_pages=1)
    assert s2.stats().pages == 1 and len(os.listdir(tmp_path)) == 1


def test_page_written_by_another_node_is_found(tmp_path):
    s = FileStorage(tmp_path, SUFFIX, NB)
    (tmp_path / f"z{SUFFIX}.bin").write_bytes(bytes(NB))
    assert s.batch_exists(["z"]) == 1


def test_file_deleted_behind_our_back_is_a_miss(tmp_path):
    s = FileStorage(tmp_path, SUFFIX, NB)
    s.batch_set(["a"], [page(1)])
    os.unlink(tmp_path / f"a{SUFFIX}.bin")
    assert s.batch_get(["a"], [torch.empty(NB, dtype=torch.uint8)]) == [False]
    assert s.batch_exists(["a"]) == 0


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
    assert s.batch_set(["a"], [page(1)]) == [False]
    assert s.stats().errors == 1
