"""One suite, every backend."""

import errno

import pytest
import torch

from transfer import FileStorage, MemoryStorage, PageSizeMismatch, StorageStats

NB = 64


@pytest.fixture(params=["memory", "file", "redis"])
def make(request, tmp_path):
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    built = []

    def build(**kw):
        if request.param == "memory":
            s = MemoryStorage("_m_0_1", NB, **kw)
        elif request.param == "file":
            s = FileStorage(tmp_path / "store", "_m_0_1", NB, **kw)
        else:
            from transfer.storage.redis import RedisStorage
            s = RedisStorage(url, "_m_0_1", NB, **kw)
        built.append(s)
        return s

    build.backend = request.param
    yield build
    for s in built:
        s.close()


def fail_writes(s, monkeypatch, calls):
    """Make the backend's next write attempt fail once per attempt, recording attempts in ``calls``."""
    if isinstance(s, (MemoryStorage, FileStorage)):
        def boom(name, pg, **kw):
            calls.append(name)
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(s, "_write", boom)
        return
    import redis  # the redis backend: the server refuses the pipelined batch (as under maxmemory)

    def refuse(pipe):
        calls.append(pipe)
        return [redis.exceptions.ResponseError("OOM command not allowed when used memory > 'maxmemory'")
                for _ in pipe.command_stack]
    monkeypatch.setattr(s, "_execute", refuse)


def page(i):
    return torch.full((NB,), i, dtype=torch.uint8)


def test_set_get_exists(make):
    s = make()
    assert s.batch_set(["a", "b", "c"], [page(1), page(2), page(3)]) == [True] * 3
    assert s.batch_exists(["a", "b", "x", "c"]) == 2
    assert s.batch_exists(["x", "a"]) == 0
    out = [torch.empty(NB, dtype=torch.uint8) for _ in range(3)]
    assert s.batch_get(["c", "x", "a"], out) == [True, False, True]
    assert torch.equal(out[0], page(3)) and torch.equal(out[2], page(1))
    st = s.stats()
    assert isinstance(st, StorageStats)
    assert (st.pages, st.bytes, st.stored, st.hits, st.misses) == (3, 3 * NB, 3, 2, 1)


def test_existing_key_skipped(make):
    s = make()
    s.batch_set(["a"], [page(1)])
    assert s.batch_set(["a", "b"], [page(9), page(2)]) == [True, True]
    out = torch.empty(NB, dtype=torch.uint8)
    s.batch_get(["a"], [out])
    assert torch.equal(out, page(1))  # first write wins
    assert s.stats().skipped == 1 and s.stats().stored == 2


def test_bad_input_changes_nothing(make):
    s = make()
    with pytest.raises(PageSizeMismatch):
        s.batch_set(["a", "b"], [page(1), torch.zeros(NB + 1, dtype=torch.uint8)])
    with pytest.raises(ValueError):
        s.batch_set(["a"], [page(1), page(2)])
    with pytest.raises(ValueError):
        s.batch_set([""], [page(1)])
    assert s.batch_exists(["a"]) == 0 and s.stats().pages == 0


def test_lru_eviction_by_pages(make):
    s = make(capacity_pages=2)
    s.batch_set(["a", "b"], [page(1), page(2)])
    s.batch_get(["a"], [torch.empty(NB, dtype=torch.uint8)])  # a is now most recent
    s.batch_set(["c"], [page(3)])
    assert s.batch_exists(["a"]) == 1 and s.batch_exists(["b"]) == 0 and s.batch_exists(["c"]) == 1
    assert s.stats().evictions == 1 and s.stats().pages == 2


def test_lru_eviction_by_bytes(make):
    s = make(capacity_bytes=3 * NB)
    s.batch_set([f"k{i}" for i in range(5)], [page(i) for i in range(5)])
    assert s.batch_exists(["k2", "k3", "k4"]) == 3 and s.batch_exists(["k1"]) == 0
    assert s.stats().bytes == 3 * NB


def test_delete(make):
    s = make()
    s.batch_set(["a"], [page(1)])
    assert s.delete("a") and not s.delete("a")
    assert s.batch_exists(["a"]) == 0


def test_write_failure_counted(make, monkeypatch):
    s = make()
    calls = []
    fail_writes(s, monkeypatch, calls)
    assert s.batch_set(["a", "b"], [page(1), page(2)]) == [False, False]
    assert calls and s.stats().errors >= 1 and s.stats().pages == 0
