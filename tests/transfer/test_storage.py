"""One suite, every backend (memory, file, a real redis-server): batch semantics, key validation
at the boundary, and the page seal refusing structured corruptions, renamed and foreign pages."""

import errno
import os
import random

import pytest
import torch

from transfer import FileStorage, MemoryStorage, PageSizeMismatch, StorageStats, TransferError
from transfer.errors import InvalidKey
from transfer.storage.integrity import PageFormat

NB = 64
SUFFIX = "_m_0_1"
FMT = PageFormat.of("page_first", torch.bfloat16, (2, 4, 1, 1, 4))  # 64 bytes


def k(name) -> str:
    """A page hash standing for ``name`` (tests use short names for readability)."""
    return f"{abs(hash(name)) % 2**200:064x}"[-64:] if not isinstance(name, int) else f"{name:064x}"


A, B, C, X = k(1), k(2), k(3), k(99)


@pytest.fixture(params=["memory", "file", "redis"])
def make(request, tmp_path):
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    built = []

    def build(**kw):
        if request.param == "memory":
            s = MemoryStorage(SUFFIX, NB, **kw)
        elif request.param == "file":
            s = FileStorage(tmp_path / "store", SUFFIX, NB, **kw)
        else:
            from transfer.storage.redis.store import RedisStorage
            s = RedisStorage(url, SUFFIX, NB, **kw)
        built.append(s)
        return s

    build.backend = request.param
    build.dir = tmp_path / "store"
    build.url = url
    yield build
    for s in built:
        s.close()


def fail_writes(s, monkeypatch, calls):
    """Make the backend's next write attempt fail once per attempt, recording attempts in ``calls``."""
    if isinstance(s, (MemoryStorage, FileStorage)):
        def boom(name, pg, *a, **kw):
            calls.append(name)
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(s, "_write", boom)
        return
    import redis  # the redis backend: the server refuses the pipelined batch (as under maxmemory)

    def refuse(payload, n):
        calls.append(payload)
        return [redis.exceptions.ResponseError("OOM command not allowed when used memory > 'maxmemory'")
                for _ in range(n)]
    monkeypatch.setattr(s, "_write_wire", refuse)


def page(i):
    return torch.full((NB,), i, dtype=torch.uint8)


def test_set_get_exists(make):
    s = make()
    assert s.batch_set([A, B, C], [page(1), page(2), page(3)]) == [True] * 3
    assert s.batch_exists([A, B, X, C]) == 2
    assert s.batch_exists([X, A]) == 0
    out = [torch.empty(NB, dtype=torch.uint8) for _ in range(3)]
    assert s.batch_get([C, X, A], out) == [True, False, True]
    assert torch.equal(out[0], page(3)) and torch.equal(out[2], page(1))
    st = s.stats()
    assert isinstance(st, StorageStats)
    assert (st.pages, st.bytes, st.stored, st.hits, st.misses) == (3, 3 * NB, 3, 2, 1)


def test_existing_key_skipped(make):
    s = make()
    s.batch_set([A], [page(1)])
    assert s.batch_set([A, B], [page(9), page(2)]) == [True, True]
    out = torch.empty(NB, dtype=torch.uint8)
    s.batch_get([A], [out])
    assert torch.equal(out, page(1))  # first write wins
    assert s.stats().skipped == 1 and s.stats().stored == 2


def test_bad_input_changes_nothing(make):
    s = make()
    with pytest.raises(PageSizeMismatch):
        s.batch_set([A, B], [page(1), torch.zeros(NB + 1, dtype=torch.uint8)])
    with pytest.raises(ValueError):
        s.batch_set([A], [page(1), page(2)])
    with pytest.raises(ValueError):
        s.batch_set([""], [page(1)])
    assert s.batch_exists([A]) == 0 and s.stats().pages == 0


@pytest.mark.parametrize("bad", ["", "a", "../victim/x", "AB" * 32, A[:-1] + "\0", A + "/..", None, 7])
def test_bad_key_anywhere_in_a_batch_touches_nothing(make, bad):
    s = make()
    s.batch_set([C], [page(3)])
    before = sorted(os.listdir(make.dir)) if make.backend == "file" else None
    out = [page(7), page(7)]
    for call in (lambda: s.batch_set([A, bad], [page(1), page(2)]),
                 lambda: s.batch_get([C, bad], out),
                 lambda: s.batch_exists([C, bad]),
                 lambda: s.delete(bad)):
        with pytest.raises(InvalidKey) as err:
            call()
        assert isinstance(err.value, TransferError)
    assert torch.equal(out[0], page(7))  # C was not read into the buffer
    assert s.batch_exists([A]) == 0 and s.batch_exists([C]) == 1 and s.stats().pages == 1
    if before is not None:
        assert sorted(os.listdir(make.dir)) == before


def test_lru_eviction_by_pages(make):
    s = make(capacity_pages=2)
    s.batch_set([A, B], [page(1), page(2)])
    s.batch_get([A], [torch.empty(NB, dtype=torch.uint8)])  # A is now most recent
    s.batch_set([C], [page(3)])
    assert s.batch_exists([A]) == 1 and s.batch_exists([B]) == 0 and s.batch_exists([C]) == 1
    assert s.stats().evictions == 1 and s.stats().pages == 2


def test_lru_eviction_by_bytes(make):
    s = make(capacity_bytes=3 * NB)
    ks = [k(10 + i) for i in range(5)]
    s.batch_set(ks, [page(i) for i in range(5)])
    assert s.batch_exists(ks[2:]) == 3 and s.batch_exists(ks[1:2]) == 0
    assert s.stats().bytes == 3 * NB


def test_delete(make):
    s = make()
    s.batch_set([A], [page(1)])
    assert s.delete(A) and not s.delete(A)
    assert s.batch_exists([A]) == 0


def test_write_failure_counted(make, monkeypatch):
    s = make()
    calls = []
    fail_writes(s, monkeypatch, calls)
    assert s.batch_set([A, B], [page(1), page(2)]) == [False, False]
    assert calls and s.stats().errors >= 1 and s.stats().pages == 0


# --- integrity, every tier ---------------------------------------------------------------------

def _tamper(make, s, key: str, fn) -> None:
    """Apply ``fn(bytes) -> bytes`` to the stored page bytes of ``key`` in place (seal unchanged)."""
    name = key + SUFFIX
    if make.backend == "memory":
        data, sealed = s._data[name]
        s._data[name] = (torch.frombuffer(bytearray(fn(bytes(data.numpy()))), dtype=torch.uint8), sealed)
    elif make.backend == "file":
        path = make.dir / f"{name}.bin"
        with open(path, "r+b") as f:  # rewrite in place: the xattr (seal) stays
            body = fn(f.read())
            f.seek(0)
            f.write(body)
    else:
        import redis
        from transfer.storage.redis.store import HEADER_NBYTES
        c = redis.Redis.from_url(make.url)
        value = c.get(name)
        c.set(name, value[:HEADER_NBYTES] + fn(value[HEADER_NBYTES:]))
        c.close()


def _rename(make, s, src: str, dst: str) -> None:
    a, b = src + SUFFIX, dst + SUFFIX
    if make.backend == "memory":
        s._data[b] = s._data.pop(a)
        s._index.add(b, NB)
    elif make.backend == "file":
        os.rename(make.dir / f"{a}.bin", make.dir / f"{b}.bin")
    else:
        import redis
        c = redis.Redis.from_url(make.url)
        c.rename(a, b)
        c.close()


def corruptions(rng: random.Random, body: bytes):
    """Structured corruptions of a 64-byte page (8 little-endian words)."""
    n = len(body)
    words = [int.from_bytes(body[i:i + 8], "little") for i in range(0, n, 8)]

    def pack(ws):
        return b"".join((w % 2**64).to_bytes(8, "little") for w in ws)

    def flips(k):
        b = bytearray(body)
        for bit in rng.sample(range(n * 8), k):
            b[bit // 8] ^= 1 << (bit % 8)
        return bytes(b)
    i, j = rng.sample(range(len(words)), 2)
    d = rng.randrange(1, 2**40)
    comp = list(words)
    comp[i] += d
    comp[j] -= d
    swap = list(words)
    swap[i], swap[j] = words[j], words[i]
    signs = bytearray(body)
    signs[i * 8 + 7] ^= 0x80
    signs[j * 8 + 7] ^= 0x80
    zero = bytearray(body)
    start = rng.randrange(0, n - 16)
    zero[start:start + 16] = bytes(16)
    return {"flips2": flips(2), "flips5": flips(5), "two_sign_bits": bytes(signs), "compensating": pack(comp),
            "swapped": pack(swap), "zeroed": bytes(zero)}


def test_structured_corruptions_are_misses_in_every_tier(make):
    s = make(page_format=FMT)
    rng = random.Random(make.backend)
    for trial in range(6):
        g = torch.Generator().manual_seed(trial)
        pg = torch.randint(0, 256, (NB,), dtype=torch.uint8, generator=g)
        body = bytes(pg.numpy())
        for what, bad in corruptions(rng, body).items():
            if bad == body:
                continue
            key = k(1000 + trial * 10 + len(what))
            assert s.batch_set([key], [pg]) == [True]
            _tamper(make, s, key, lambda _b, bad=bad: bad)
            out = page(7)
            assert s.batch_get([key], [out]) == [False], (make.backend, trial, what)
            assert bytes(out.numpy()) != bad and not torch.equal(out, pg)  # nothing of it served
            assert s.batch_exists([key]) == 0 or make.backend == "redis"  # file/memory: deleted
    assert s.stats().corrupt >= 30 and s.stats().hits == 0


def test_renamed_page_is_a_miss_in_every_tier(make):
    s = make(page_format=FMT)
    s.batch_set([A], [page(1)])
    _rename(make, s, A, B)
    out = page(7)
    assert s.batch_get([B], [out]) == [False] and s.stats().foreign == 1
    assert not torch.equal(out, page(1))


def test_same_size_page_of_another_format_is_a_miss_in_every_tier(make, tmp_path):
    fp16 = PageFormat.of("page_first", torch.float16, FMT.shape)
    layer_first = PageFormat.of("layer_first", torch.bfloat16, FMT.shape)
    for i, other in enumerate((fp16, layer_first)):
        writer = make(page_format=other)
        reader = make(page_format=FMT)
        key = k(200 + i)
        assert writer.batch_set([key], [page(5)]) == [True]
        if make.backend == "memory":  # private dicts: hand the writer's sealed page to the reader
            reader._data.update(writer._data)
            reader._index.add(key + SUFFIX, NB)
        assert reader.batch_get([key], [page(0)]) == [False] and reader.stats().foreign == 1
        if make.backend != "memory":  # memory stores are private; the others share the pages
            assert reader.batch_exists([key]) == 0  # the seal is checked without reading the page
        out = page(0)
        assert writer.batch_get([key], [out]) == [True] and torch.equal(out, page(5))


# --- the shared behaviour's reports: events, counters and log lines ----------------------------

class Events:
    """A KV-event hook (``Storage.events``) that records what it is told, in order."""

    def __init__(self):
        self.told = []

    def stored(self, keys):
        self.told.append(("stored", list(keys)))

    def removed(self, keys):
        self.told.append(("removed", list(keys)))


def test_delete_announces_the_removed_page_by_its_hash():
    s = MemoryStorage(SUFFIX, NB)
    s.events = ev = Events()
    assert s.batch_set([A], [page(1)]) == [True]
    assert s.delete(A) and not s.delete(A)
    assert ev.told == [("stored", [A]), ("removed", [A])]  # by page hash, once


def test_a_delete_that_fails_is_false_counted_and_logged_with_the_error(tmp_path):
    from structlog.testing import capture_logs
    s = FileStorage(tmp_path, SUFFIX, NB)
    os.mkdir(tmp_path / f"{A}{SUFFIX}.bin")  # unlink of a directory fails (EISDIR), even for root
    with capture_logs() as logs:
        assert s.delete(A) is False
    assert s.stats().errors == 1 and s.stats().deletes == 0
    (ev,) = [e for e in logs if e["event"] == "storage.delete_failed"]
    assert ev["log_level"] == "error" and ev["name"] == A + SUFFIX and ev["errno"] == errno.EISDIR
    assert "directory" in ev["error"].lower()


@pytest.mark.parametrize("strict", [False, True])
def test_the_first_unverified_page_is_warned_with_the_store_the_page_and_the_remedy(strict):
    from structlog.testing import capture_logs
    s = MemoryStorage(SUFFIX, NB, checksum=False, require_checksum=strict)  # pages stored without a seal
    assert s.batch_set([A, B], [page(1), page(2)]) == [True, True]
    with capture_logs() as logs:
        assert s.batch_get([A, B], [page(0), page(0)]) == [not strict] * 2
    (ev,) = [e for e in logs if e["event"] == "storage.unverified_page"]  # the first one only
    assert ev["log_level"] == "warning" and ev["store"] == "MemoryStorage" and ev["name"] == A + SUFFIX
    assert ev["served"] is (not strict)
    hint = ev["hint"]
    assert hint.startswith("pages without a checksum seal") and "SGLang" in hint and "checksum=False" in hint
    assert hint.endswith("require_checksum=True refuses them")


# --- refusals and read failures are counted, logged with the page, and announced ----------------

def test_a_corrupt_page_is_logged_with_its_verdict_deleted_and_announced_by_its_hash(tmp_path):
    from structlog.testing import capture_logs
    s = FileStorage(tmp_path, SUFFIX, NB)
    s.events = ev = Events()
    assert s.batch_set([A], [page(1)]) == [True]
    path = tmp_path / f"{A}{SUFFIX}.bin"
    path.write_bytes(bytes(page(2).numpy()))  # same size, same inode (the seal stays): other bytes
    with capture_logs() as logs:
        assert s.batch_get([A], [page(0)]) == [False]
    (e,) = [e for e in logs if e["event"] == "storage.page_refused"]
    assert e["log_level"] == "error" and e["name"] == A + SUFFIX and e["verdict"] == "corrupt"
    assert s.stats().corrupt == 1 and not path.exists()
    assert ev.told == [("stored", [A]), ("removed", [A])]  # by page hash, without the suffix


def test_a_foreign_page_is_logged_with_its_verdict(tmp_path):
    from structlog.testing import capture_logs
    s = FileStorage(tmp_path, SUFFIX, NB)
    assert s.batch_set([B], [page(1)]) == [True]
    os.replace(tmp_path / f"{B}{SUFFIX}.bin", tmp_path / f"{A}{SUFFIX}.bin")  # B's page under A's name
    with capture_logs() as logs:
        assert s.batch_get([A], [page(0)]) == [False]
    (e,) = [e for e in logs if e["event"] == "storage.page_refused"]
    assert e["name"] == A + SUFFIX and e["verdict"] == "foreign" and s.stats().foreign == 1


def test_a_read_that_fails_is_a_miss_counted_and_logged_with_the_error(tmp_path):
    from structlog.testing import capture_logs
    s = FileStorage(tmp_path, SUFFIX, NB)
    assert s.batch_set([A], [page(1)]) == [True]
    path = tmp_path / f"{A}{SUFFIX}.bin"
    os.unlink(path)
    os.mkdir(path)  # opening a directory for reading fails (EISDIR), even for root
    out = page(7)
    with capture_logs() as logs:
        assert s.batch_get([A], [out]) == [False]
    assert torch.equal(out, page(0))
    st = s.stats()
    assert st.errors == 1 and st.misses == 1 and st.hits == 0
    (e,) = [e for e in logs if e["event"] == "storage.read_failed"]
    assert e["log_level"] == "error" and e["name"] == A + SUFFIX and e["errno"] == errno.EISDIR
    assert "directory" in e["error"].lower()


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_misses_and_exists_count_every_key(backend, tmp_path):
    s = MemoryStorage(SUFFIX, NB) if backend == "memory" else FileStorage(tmp_path, SUFFIX, NB)
    assert s.batch_exists([X]) == 0
    assert s.batch_get([A, B, C], [page(0), page(0), page(0)]) == [False] * 3
    assert s.stats().misses == 3 and s.stats().hits == 0
    assert s.batch_set([A, B], [page(1), page(2)]) == [True, True]
    assert s.batch_exists([A, B, C]) == 2 and s.batch_exists([C, A]) == 0
    assert s.stats().pages == 2


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_without_a_page_size_an_absent_key_does_not_exist(backend, tmp_path):
    s = MemoryStorage(SUFFIX) if backend == "memory" else FileStorage(tmp_path, SUFFIX)
    assert s.batch_exists([X]) == 0 and s.stats().pages == 0
    assert s.batch_set([A], [page(1)]) == [True]
    assert s.batch_exists([A, X, B]) == 1 and s.stats().pages == 1


def test_a_backend_probe_lets_batch_exists_adopt_a_page_stored_elsewhere():
    class Shared(MemoryStorage):  # a backend whose pages other processes can store (the _probe hook)
        def __init__(self, shared, **kw):
            super().__init__(SUFFIX, NB, **kw)
            self._data = shared

        def _probe(self, name):
            got = self._data.get(name)
            return None if got is None else got[0].numel()

    shared = {}
    writer, reader = Shared(shared), Shared(shared)
    assert writer.batch_set([A, B], [page(1), page(2)]) == [True, True]
    assert reader.batch_exists([A, B, C]) == 2 and reader.stats().pages == 2
    out = page(0)
    assert reader.batch_get([B], [out]) == [True] and torch.equal(out, page(2))


def test_memory_storage_defaults_no_suffix_and_serves_unsealed_pages():
    s = MemoryStorage(checksum=False)  # defaults: no suffix, any page size, lax about seals
    assert s.suffix == "" and s.page_nbytes is None and s.require_checksum is False
    assert s.batch_set([A], [page(3)]) == [True]
    out = page(0)
    assert s.batch_get([A], [out]) == [True] and torch.equal(out, page(3))
    assert s.stats().unverified == 1


def test_memory_storage_a_page_read_into_a_buffer_of_another_size_is_a_wrong_size_miss():
    s = MemoryStorage(SUFFIX)  # no page size: pages of any size are stored
    assert s.batch_set([A], [page(1)]) == [True]
    out = torch.full((NB // 2,), 9, dtype=torch.uint8)
    assert s.batch_get([A], [out]) == [False]
    assert torch.equal(out, torch.zeros(NB // 2, dtype=torch.uint8))
    st = s.stats()
    assert st.wrong_size == 1 and st.misses == 1 and st.hits == 0 and st.corrupt == 0


def test_a_page_the_probe_reports_but_gone_by_the_read_is_a_miss():
    class Stale(MemoryStorage):  # another process stored the page, then deleted it before our read
        def _probe(self, name):
            return NB

    s = Stale(SUFFIX, NB)
    out = page(5)
    assert s.batch_get([A], [out]) == [False] and torch.equal(out, page(0))
    assert s.stats().misses == 1 and s.stats().hits == 0 and s.stats().unverified == 0


# --- eviction, write failures and close: what the shared behaviour reports ----------------------

def test_an_evicted_page_is_announced_removed_by_its_hash():
    s = MemoryStorage(SUFFIX, NB, capacity_pages=1)
    s.events = ev = Events()
    assert s.batch_set([A], [page(1)]) == [True]
    assert s.batch_set([B], [page(2)]) == [True]  # room for one page: A, the least recent, goes
    assert ev.told == [("stored", [A]), ("stored", [B]), ("removed", [A])]  # by hash, no suffix
    assert s.batch_exists([A]) == 0 and s.stats().evictions == 1


def test_a_write_that_evicts_several_pages_counts_each_eviction():
    s = MemoryStorage(SUFFIX, capacity_bytes=2 * NB)  # no page size: a page may be as big as two
    assert s.batch_set([A, B], [page(1), page(2)]) == [True, True]
    assert s.batch_set([C], [torch.full((2 * NB,), 3, dtype=torch.uint8)]) == [True]
    st = s.stats()
    assert (st.evictions, st.pages, st.bytes) == (2, 1, 2 * NB)
    assert s.batch_exists([A]) == 0 and s.batch_exists([B]) == 0 and s.batch_exists([C]) == 1


def test_capacity_counts_the_bytes_of_pages_of_a_wider_dtype():
    s = MemoryStorage(SUFFIX, NB, capacity_bytes=2 * NB, page_format=FMT)  # bfloat16 pages of NB bytes
    pages = [torch.full(FMT.shape, float(i), dtype=torch.bfloat16) for i in range(3)]
    assert s.batch_set([A, B, C], pages) == [True] * 3
    st = s.stats()
    assert (st.pages, st.bytes, st.evictions) == (2, 2 * NB, 1)  # 2 x 64 bytes, not 2 x 32 elements
    assert s.batch_exists([A]) == 0 and s.batch_exists([B, C]) == 2


def test_an_eviction_that_fails_is_logged_with_the_page_and_the_error_and_not_announced(tmp_path):
    from structlog.testing import capture_logs
    s = FileStorage(tmp_path, SUFFIX, NB, capacity_pages=1)
    s.events = ev = Events()
    assert s.batch_set([A], [page(1)]) == [True]
    path = tmp_path / f"{A}{SUFFIX}.bin"
    os.unlink(path)
    os.mkdir(path)  # unlinking a directory fails (EISDIR), even for root
    with capture_logs() as logs:
        assert s.batch_set([B], [page(2)]) == [True]  # B is stored; evicting A fails
    (e,) = [e for e in logs if e["event"] == "storage.evict_failed"]
    assert e["log_level"] == "warning" and e["name"] == A + SUFFIX and "directory" in e["error"].lower()
    assert ev.told == [("stored", [A]), ("stored", [B])]  # A was not removed: nothing announced
    assert s.stats().evictions == 1 and s.stats().pages == 1


def test_a_failed_page_write_is_logged_with_its_error_and_does_not_stop_the_others(tmp_path):
    from structlog.testing import capture_logs
    s = FileStorage(tmp_path, SUFFIX, NB)
    os.mkdir(tmp_path / f"{A}{SUFFIX}.bin")  # A's page cannot replace a directory (EISDIR)
    with capture_logs() as logs:
        assert s.batch_set([A, B, C], [page(1), page(2), page(3)]) == [False, True, True]
    (e,) = [e for e in logs if e["event"] == "storage.write_failed"]
    assert e["log_level"] == "error" and e["name"] == A + SUFFIX and e["errno"] == errno.EISDIR
    assert "directory" in e["error"].lower()
    st = s.stats()
    assert (st.errors, st.stored, st.pages) == (1, 2, 2)
    out = page(0)
    assert s.batch_get([C], [out]) == [True] and torch.equal(out, page(3))


def test_close_writes_the_summary_of_the_rate_limited_failure_lines(tmp_path):
    from structlog.testing import capture_logs
    s = FileStorage(tmp_path, SUFFIX, NB)
    for key in (A, B, C):
        os.mkdir(tmp_path / f"{key}{SUFFIX}.bin")  # every page of the batch fails
    with capture_logs() as logs:
        assert s.batch_set([A, B, C], [page(1), page(2), page(3)]) == [False] * 3
        assert len([e for e in logs if e["event"] == "storage.write_failed"]) == 1  # the first only
        assert s.close() == []
    lines = [e for e in logs if e["event"] == "storage.write_failed"]
    assert len(lines) == 2 and lines[1]["summary"] is True and lines[1]["suppressed"] == 2
    assert s.stats().errors == 3  # the counter keeps every occurrence


def test_a_backend_implementing_only_the_abstract_methods_closes_with_nothing_abandoned():
    from transfer.storage import Storage

    class Dict(Storage):  # the storage contract over a dict: no index, no log, nothing in flight
        suffix, page_nbytes = SUFFIX, NB

        def __init__(self):
            self.pages = {}

        def batch_set(self, keys, pages):
            for key, pg in zip(keys, pages):
                self.pages.setdefault(key, pg.clone())
            return [True] * len(keys)

        def batch_get(self, keys, into):
            for key, buf in zip(keys, into):
                if key in self.pages:
                    buf.copy_(self.pages[key])
            return [key in self.pages for key in keys]

        def batch_exists(self, keys):
            return next((i for i, key in enumerate(keys) if key not in self.pages), len(keys))

        def delete(self, key):
            return self.pages.pop(key, None) is not None

        def stats(self):
            return StorageStats(pages=len(self.pages))

    s = Dict()
    assert s.batch_set([A], [page(1)]) == [True] and s.batch_exists([A, B]) == 1
    assert s.close() == [] and s.close(timeout=0.5) == []  # the default close: nothing to wait for


def test_an_indexed_backend_built_with_the_defaults_seals_pages_and_serves_them_by_bare_hash():
    from transfer.storage import IndexedStorage

    class Dict(IndexedStorage):  # the three primitives over a dict; IndexedStorage's defaults
        def __init__(self):
            super().__init__()
            self.pages = {}

        def _write(self, name, pg, seal_bytes):
            self.pages[name] = (pg.reshape(-1).view(torch.uint8).clone(), seal_bytes)

        def _read(self, name, into):
            data, seal_bytes = self.pages.get(name, (None, None))
            if data is None or data.numel() != into.numel():
                return False, None
            into.reshape(-1).view(torch.uint8).copy_(data)
            return True, seal_bytes

        def _remove(self, name):
            return self.pages.pop(name, None) is not None

        def _probe(self, name):  # pages stored by someone else count too
            return self.pages[name][0].numel() if name in self.pages else None

    s = Dict()
    assert (s.suffix, s.page_nbytes, s.checksum, s.require_checksum) == ("", None, True, False)
    assert s.batch_set([A], [page(1)]) == [True]
    assert list(s.pages) == [A] and s.pages[A][1] is not None  # stored under the bare hash, sealed
    out = page(0)
    assert s.batch_get([A], [out]) == [True] and torch.equal(out, page(1))
    assert s.stats().unverified == 0  # verified against its seal
    s.pages[B] = (page(2).clone(), None)  # a page without a seal (as SGLang writes them): lax by default
    assert s.batch_get([B], [out]) == [True] and torch.equal(out, page(2))
    assert s.stats().unverified == 1
