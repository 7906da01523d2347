"""The Redis/Valkey backend against a real ``redis-server``: integrity checks, typed unavailability,
and a decode run through the whole stack and manager that survives the server going away."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis
import structlog
import torch

import hashing
from lifecycle import State
from tests.support.decode_driver import DIM, HEADS, LAYERS, MAX_LEN, PS, ROWS, Scheduler
from tests.support.transfer_helpers import never_accepting_port
from lifecycle_tools.testkit.redis_server import free_port
from transfer import StorageUnavailable, build_stack, open_storage
from transfer.errors import StorageConfigError
from transfer.storage.breaker import CircuitBreaker
from transfer.storage.integrity import PageFormat, raw_format, seal
from transfer.storage.redis.store import HEADER_NBYTES, RedisStorage

NB = 64


def page(i: int) -> torch.Tensor:
    return torch.full((NB,), i, dtype=torch.uint8)


def key(i: int) -> str:
    return f"{i:064x}"


A, B, K1, K2, K3 = key(0xa), key(0xb), key(1), key(2), key(3)


def raw_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5)


# --- the backend alone -------------------------------------------------------------------------

def test_unreachable_server_is_a_typed_one_line_error_and_fast():
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    t = time.monotonic()
    with pytest.raises(StorageUnavailable) as err:
        open_storage(url, "_m_0_1", NB)
    assert time.monotonic() - t < 3.0
    msg = str(err.value)
    assert "\n" not in msg and url in msg and "unreachable" in msg
    assert "Connection refused" in msg  # the reason, on one line
    with pytest.raises(StorageUnavailable):
        build_stack(1, 1, 4, torch.float16, 4, 16, 16, 1, 16, storage=url)


def test_a_server_that_never_accepts_is_a_connect_timeout_not_a_wait_for_the_kernel():
    """``connect_timeout_s`` bounds connecting on its own (reads have their own, long, timeout):
    a listener whose accept queue is full drops the connection attempt, and the store gives up
    after ``connect_timeout_s``, saying so, instead of waiting for the kernel's retries to end."""
    with never_accepting_port() as port, \
            pytest.raises(StorageUnavailable, match=r"is unreachable: Timeout connecting to server$"):
        RedisStorage(f"redis://127.0.0.1:{port}/0", "_m_0_1", NB, connect_timeout_s=0.2, socket_timeout_s=600)


def test_open_storage_specs(tmp_path, redis_url):
    assert type(open_storage("memory", "_s", NB)).__name__ == "MemoryStorage"
    assert type(open_storage(f"file:{tmp_path}", "_s", NB)).__name__ == "FileStorage"
    s = open_storage(redis_url, "_s", NB)
    assert isinstance(s, RedisStorage) and s.suffix == "_s"
    s.close()
    with pytest.raises(ValueError):
        open_storage("redis", "_s", NB)


def test_keys_follow_the_file_store_naming(redis_url):
    s = RedisStorage(redis_url, hashing.storage_suffix("org/tiny", 1, 2), NB)
    h = hashing.page_hashes(list(range(4)), 4)[0]
    s.batch_set([h], [page(7)])
    c = raw_client(redis_url)
    value = c.get(f"{h}_org-tiny_1_2")
    assert value is not None and len(value) == HEADER_NBYTES + NB and value[HEADER_NBYTES:] == bytes([7]) * NB
    c.close()
    s.close()


def test_a_stacks_redis_keys_are_its_identitys(redis_url):
    """Built from the stack's deployment identity: the backend tag first, then hash and file suffix."""
    stack = build_stack(LAYERS, HEADS, DIM, torch.float32, PS, 16, 16, 1, 16, storage=redis_url, model_name="org/m",
                        tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, backend_tag="tenant")
    try:
        h = hashing.page_hashes(list(range(PS)), PS)[0]
        assert stack.storage.batch_set([h], [stack.host_pool.page_bytes(0)]) == [True]
        c = raw_client(redis_url)
        assert stack.identity.redis_key(h) == f"tenant_{h}_org-m_1_2_2_1"
        assert c.exists(f"tenant_{h}_org-m_1_2_2_1") == 1 and c.exists(f"{h}_org-m_1_2_2_1") == 0
        c.close()
    finally:
        stack.close()


def test_other_clients_see_pages_without_local_state(redis_url):
    a = RedisStorage(redis_url, "_m_0_1", NB)
    b = RedisStorage(redis_url, "_m_0_1", NB)
    other_rank = RedisStorage(redis_url, "_m_1_2", NB)
    a.batch_set([K1, K2], [page(1), page(2)])
    assert b.batch_exists([K1, K2, K3]) == 2 and other_rank.batch_exists([K1]) == 0
    out = [torch.empty(NB, dtype=torch.uint8) for _ in range(2)]
    assert b.batch_get([K2, K1], out) == [True, True]
    assert torch.equal(out[0], page(2)) and torch.equal(out[1], page(1))
    assert b.batch_set([K1], [page(9)]) == [True] and b.stats().skipped == 1  # first write wins
    for s in (a, b, other_rank):
        s.close()


def test_corrupt_page_is_a_counted_miss_and_is_removed(redis_url):
    s = RedisStorage(redis_url, "_m_0_1", NB)
    s.batch_set([A, B], [page(1), page(2)])
    c = raw_client(redis_url)
    c.setrange(A + "_m_0_1", HEADER_NBYTES + 5, b"\xff")  # flip a body byte: same size, bad checksum
    c.set(B + "_m_0_1", b"not a page")  # foreign value
    out = [torch.zeros(NB, dtype=torch.uint8) for _ in range(2)]
    assert s.batch_get([A, B], out) == [False, False]
    assert torch.equal(out[0], torch.zeros(NB, dtype=torch.uint8))  # nothing copied out
    st = s.stats()
    assert st.corrupt == 2 and st.misses == 2 and st.hits == 0
    assert c.exists(A + "_m_0_1", B + "_m_0_1") == 0  # so a later write can repair them
    assert s.batch_set([A], [page(1)]) == [True] and s.batch_get([A], out[:1]) == [True]
    assert torch.equal(out[0], page(1))
    c.close()
    s.close()


def test_refused_values_are_logged_with_name_verdict_and_size_and_only_corrupt_ones_removed(redis_url):
    """What ``batch_get`` refuses is logged (name, verdict, the value's size). A value that is not a
    seal is corrupt (and removed) whatever its bytes happen to say; a real seal of a page of
    another size (here zero bytes: the value is the seal alone) is a wrong-size miss, kept."""
    from structlog.testing import capture_logs
    c = raw_client(redis_url)
    not_a_seal = bytearray(HEADER_NBYTES + 1)
    not_a_seal[8:16] = (1).to_bytes(8, "little")  # where a seal keeps its body size: "1", no magic
    c.set(A + "_m_0_1", bytes(not_a_seal))
    c.set(B + "_m_0_1", seal(B + "_m_0_1", raw_format(page(2)), b""))  # a seal over zero page bytes
    for k, verdict, size in ((A, "corrupt", HEADER_NBYTES + 1), (B, "wrong_size", HEADER_NBYTES)):
        s = RedisStorage(redis_url, "_m_0_1", NB)  # a store of its own: its log is rate-limited per event
        with capture_logs() as logs:
            assert s.batch_get([k], [torch.zeros(NB, dtype=torch.uint8)]) == [False]
        (e,) = [e for e in logs if e["event"] == "redis_storage.page_refused"]
        assert (e["log_level"], e["name"], e["verdict"], e["size"]) == ("error", k + "_m_0_1", verdict, size)
        st = s.stats()
        assert st.misses == 1 and (st.corrupt, st.wrong_size) == ((1, 0) if verdict == "corrupt" else (0, 1))
        s.close()
    assert c.exists(A + "_m_0_1") == 0 and c.exists(B + "_m_0_1") == 1  # only the corrupt one removed
    c.close()


def test_truncated_page_is_not_found(redis_url):
    s = RedisStorage(redis_url, "_m_0_1", NB)
    s.batch_set([A, B], [page(1), page(2)])
    c = raw_client(redis_url)
    c.set(B + "_m_0_1", c.get(B + "_m_0_1")[:-1])
    assert s.batch_exists([A, B]) == 1
    assert s.batch_get([B], [torch.empty(NB, dtype=torch.uint8)]) == [False] and s.stats().corrupt == 1
    c.close()
    s.close()


def test_dtype_or_shape_mismatch_is_a_miss(redis_url):
    w = RedisStorage(redis_url, "_m_0_1", NB, page_format=PageFormat.of("page_first", torch.bfloat16, (2, 16)))
    r = RedisStorage(redis_url, "_m_0_1", NB, page_format=PageFormat.of("page_first", torch.float16, (2, 16)))
    w.batch_set([A], [page(3)])
    buf = torch.empty(NB, dtype=torch.uint8)
    assert r.batch_get([A], [buf]) == [False] and r.stats().foreign == 1
    assert w.batch_get([A], [buf]) == [True] and torch.equal(buf, page(3))
    w.close()
    r.close()


def test_ttl_is_set_and_refreshed_on_read(redis_url):
    s = RedisStorage(redis_url, "_m_0_1", NB, ttl_s=30)
    s.batch_set([A], [page(1)])
    c = raw_client(redis_url)
    assert 0 < c.pttl(A + "_m_0_1") <= 30_000
    c.pexpire(A + "_m_0_1", 10_000)
    assert s.batch_get([A], [torch.empty(NB, dtype=torch.uint8)]) == [True]
    assert c.pttl(A + "_m_0_1") > 10_000
    c.close()
    s.close()


def test_large_batches_split_across_round_trips(redis_url):
    s = RedisStorage(redis_url, "_m_0_1", NB, pipeline_bytes=3 * NB)
    keys = [key(100 + i) for i in range(10)]
    assert s.batch_set(keys, [page(i) for i in range(10)]) == [True] * 10
    out = [torch.empty(NB, dtype=torch.uint8) for _ in keys]
    assert s.batch_get(keys, out) == [True] * 10
    assert all(torch.equal(o, page(i)) for i, o in enumerate(out)) and s.batch_exists(keys) == 10
    s.close()


def test_server_refusing_writes_under_maxmemory(make_redis_server):
    server = make_redis_server()
    c = raw_client(server.url)
    s = RedisStorage(server.url, "_m_0_1", NB)
    c.config_set("maxmemory-policy", "noeviction")
    c.config_set("maxmemory", 1)
    assert s.batch_set([A, B], [page(1), page(2)]) == [False, False]
    assert s.stats().errors == 1 and s.stats().stored == 0
    c.config_set("maxmemory", 0)
    assert s.batch_set([A, B], [page(1), page(2)]) == [True, True]
    c.close()
    s.close()


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_server_down_raises_typed_errors_breaker_fails_fast_then_recovers(make_redis_server):
    server = make_redis_server()
    clock = Clock()
    s = RedisStorage(server.url, "_m_0_1", NB, socket_timeout_s=1.0,
                     breaker=CircuitBreaker("test", base_backoff_s=1.0, clock=clock))
    assert s.batch_set([A], [page(1)]) == [True]
    server.stop()
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(StorageUnavailable, match="unreachable"):
            s.batch_set([B], [page(2)])  # the first call finds the server gone: the breaker opens
        for op in (lambda: s.batch_set([B], [page(2)]),
                   lambda: s.batch_get([A], [torch.empty(NB, dtype=torch.uint8)]),
                   lambda: s.batch_exists([A]), lambda: s.delete(A)):
            t = time.monotonic()
            with pytest.raises(StorageUnavailable, match="circuit open"):
                op()  # reads and writes alike: refused at once, the network is not touched
            assert time.monotonic() - t < 0.05
        clock.t += 1.0  # the backoff elapsed: the next call probes (the server is still down)
        with pytest.raises(StorageUnavailable, match="unreachable"):
            s.batch_exists([A])
        assert s.breaker.retry_in() == pytest.approx(2.0)  # doubled
        server.start()  # same port, empty (no persistence)
        with pytest.raises(StorageUnavailable, match="circuit open"):
            s.batch_exists([A])
        clock.t += 2.0
        assert s.batch_set([B], [page(2)]) == [True] and s.batch_exists([B]) == 1
    st = s.stats()
    assert st.errors == 2 and st.unavailable == 2 + 5
    events = [e["event"] for e in logs]
    assert events.count("storage.tier_down") == 1 and events.count("storage.tier_recovered") == 1
    s.close()


def test_sigstopped_server_times_out_then_fails_fast(make_redis_server):
    server = make_redis_server()
    s = RedisStorage(server.url, "_m_0_1", NB, socket_timeout_s=0.3)
    assert s.batch_set([A], [page(1)]) == [True]
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        t = time.monotonic()
        with pytest.raises(StorageUnavailable, match="unreachable"):
            s.batch_exists([A])  # waits out one socket timeout
        with pytest.raises(StorageUnavailable, match="circuit open"):
            s.batch_get([A], [torch.empty(NB, dtype=torch.uint8)])  # then never again while open
        assert time.monotonic() - t < 2.0
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    s.close()


def test_bad_urls_are_config_errors_at_open():
    for url in ("redis://127.0.0.1:6379/abc", "redis://127.0.0.1:6379/0?db=x", "redis://127.0.0.1:notaport/0",
                "redis://127.0.0.1:70000/0", "redis:///0", "http://127.0.0.1:6379/0"):
        with pytest.raises(StorageConfigError):
            RedisStorage(url, "_m_0_1", NB, check=False)
    with pytest.raises(StorageConfigError):
        open_storage("redis://127.0.0.1:6379/abc", "_m_0_1", NB)


def test_delete_reports_what_the_server_did(make_redis_server):
    primary, replica = make_redis_server(), make_redis_server()
    p = RedisStorage(primary.url, "_m_0_1", NB)
    p.batch_set([A], [page(1)])
    c = raw_client(replica.url)
    c.replicaof("127.0.0.1", primary.port)
    deadline = time.monotonic() + 10
    while c.get(A + "_m_0_1") is None and time.monotonic() < deadline:
        time.sleep(0.02)
    r = RedisStorage(replica.url, "_m_0_1", NB)
    assert r.batch_exists([A]) == 1
    with structlog.testing.capture_logs() as logs:
        assert r.delete(A) is False and r.stats().errors == 1  # READONLY: refused, reported
    (e,) = [e for e in logs if e["event"] == "redis_storage.delete_failed"]
    assert e["log_level"] == "error" and e["name"] == A + "_m_0_1" and e["error"].startswith("You can't write")
    assert r.batch_exists([A]) == 1
    assert p.delete(A) is True and p.delete(A) is False
    c.replicaof("NO", "ONE")
    c.close()
    for s in (p, r):
        s.close()


def test_a_delete_is_counted_and_announced_by_page_hash_and_an_unreachable_one_names_the_delete(make_redis_server):
    from tests.transfer.test_storage import Events
    server = make_redis_server()
    s = RedisStorage(server.url, "_m_0_1", NB, socket_timeout_s=1.0)
    s.events = ev = Events()
    assert s.batch_set([A, B], [page(1), page(2)]) == [True, True]
    assert s.delete(A) is True and s.delete(B) is True
    assert s.delete(A) is False  # already gone: nothing removed, nothing to announce
    assert s.stats().deletes == 2
    assert [told for told in ev.told if told[0] == "removed"] == [("removed", [A]), ("removed", [B])]
    server.stop()
    with pytest.raises(StorageUnavailable, match=r"is unreachable \(delete\): "):
        s.delete(B)
    with pytest.raises(StorageUnavailable, match=r"is unavailable \(get\): circuit open"):  # a read now
        s.batch_get([B], [torch.empty(NB, dtype=torch.uint8)])
    s.close()


def test_pages_found_by_reading_count_toward_this_clients_capacity(redis_url):
    """``capacity_pages`` bounds the pages *this client* wrote or found: pages another client
    wrote, once read here, are indexed, and the least recently used beyond the bound evicted."""
    from tests.transfer.test_storage import Events
    w = RedisStorage(redis_url, "_m_0_1", NB)
    assert w.batch_set([A, B, K1], [page(1), page(2), page(3)]) == [True] * 3
    r = RedisStorage(redis_url, "_m_0_1", NB, capacity_pages=1)
    r.events = ev = Events()
    out = [torch.empty(NB, dtype=torch.uint8) for _ in range(3)]
    assert r.batch_get([A, B, K1], out) == [True] * 3  # one batch: A, then B, then K1 found
    st = r.stats()
    assert st.pages == 1 and st.evictions == 2
    assert ev.told == [("removed", [A, B])]
    c = raw_client(redis_url)
    assert [c.exists(x + "_m_0_1") for x in (A, B, K1)] == [0, 0, 1]  # evicted from the server
    c.close()
    w.close()
    r.close()


def test_a_value_the_server_refuses_to_read_is_a_miss_counted_and_logged_with_its_error(redis_url):
    s = RedisStorage(redis_url, "_m_0_1", NB)
    c = raw_client(redis_url)
    c.rpush(A + "_m_0_1", b"not a string")  # GET answers WRONGTYPE
    with structlog.testing.capture_logs() as logs:
        assert s.batch_get([A], [torch.empty(NB, dtype=torch.uint8)]) == [False]
    (e,) = [e for e in logs if e["event"] == "redis_storage.read_failed"]
    assert e["log_level"] == "error" and e["name"] == A + "_m_0_1" and e["error"].startswith("WRONGTYPE")
    assert s.stats().errors == 1 and s.stats().misses == 1
    c.delete(A + "_m_0_1")
    c.close()
    s.close()


def test_exists_counts_only_our_pages_and_set_repairs_what_is_not_a_page_but_keeps_another_deployments(redis_url):
    """A value that is not a page is repaired; a page another deployment sealed (another dtype,
    same name and length) is already there: reported stored, counted ``foreign_kept``, never
    overwritten (its writer still reads it), and a miss for us."""
    fmt = PageFormat.of("page_first", torch.bfloat16, (2, 16))
    other = RedisStorage(redis_url, "_m_0_1", NB, page_format=PageFormat.of("page_first", torch.float16, (2, 16)))
    s = RedisStorage(redis_url, "_m_0_1", NB, page_format=fmt)
    other.batch_set([A], [page(4)])  # same length, another dtype
    c = raw_client(redis_url)
    c.set(B + "_m_0_1", b"x" * (HEADER_NBYTES + NB))  # same length, not a page at all
    assert s.batch_exists([A]) == 0 and s.batch_exists([B]) == 0
    assert s.batch_set([A, B], [page(1), page(2)]) == [True, True]  # A: already there (theirs); B: ours now
    st = s.stats()
    assert (st.repaired, st.foreign_kept, st.stored) == (1, 1, 1) and s.batch_exists([B]) == 1
    assert s.batch_exists([A]) == 0
    out = torch.empty(NB, dtype=torch.uint8)
    assert s.batch_get([B], [out]) == [True] and torch.equal(out, page(2))
    assert s.batch_get([A], [out]) == [False] and s.stats().foreign == 1
    assert other.batch_get([A], [out]) == [True] and torch.equal(out, page(4))  # theirs, untouched
    assert s.batch_set([B], [page(9)]) == [True] and s.stats().skipped == 1  # ours: skipped
    c.close()
    for x in (s, other):
        x.close()


# --- the whole stack, with the server going away mid-run -----------------------------------------

def test_decode_survives_server_outage_and_recovers(make_redis_server):
    server = make_redis_server()
    clock = Clock()  # the circuit breaker's backoff runs on the test's clock
    store = RedisStorage(server.url, hashing.storage_suffix("org/tiny"), socket_timeout_s=1.0,
                         breaker=CircuitBreaker("test", clock=clock))
    stack = build_stack(LAYERS, HEADS, DIM, torch.bfloat16, PS, 256, 128, ROWS, MAX_LEN, storage=store)
    alloc0, host0, rows0 = (stack.allocator.available_size(), stack.host_pool.available_size(),
                            stack.req_to_token_pool.available_size())
    sch = Scheduler(stack)
    off = stack.offloader
    try:
        # phase 1: the server is up
        a = sch.admit(1, list(range(100, 110)), 7)
        b = sch.admit(2, list(range(200, 213)), 7)
        for t in range(6):
            sch.step(50 + t)
        assert off.stats().writes >= 2  # copies (and maybe storage ops) are in flight or done

        # phase 2: the server goes away mid-run (copies and storage ops may be in flight)
        with structlog.testing.capture_logs() as logs:
            server.stop()
            c = sch.admit(3, list(range(300, 305)), 7)
            for t in range(9):
                sch.step(60 + t)
                if t == 3:
                    sch.finish(a)
            sch.finish(b)
            sch.finish(c)
            sch.settle()
        st = off.stats()
        assert st.storage_failed >= 3 and st.storage_ok + st.storage_failed == st.storage_ops
        failures = [e for e in logs if e["event"] == "offloader.storage_failed"]
        assert len(failures) == 1 and "suppressed" not in failures[0]   # one line, not one per op
        assert "StorageUnavailable" in failures[0]["error"]
        assert any(e["event"] == "redis_storage.unavailable" for e in logs)
        assert [e["event"] for e in logs].count("storage.tier_down") == 1  # once per outage
        # nothing leaked, nothing held: GPU slots, host pages, rows all back; every request released
        assert stack.allocator.available_size() == alloc0
        assert stack.host_pool.available_size() == host0
        assert stack.req_to_token_pool.available_size() == rows0
        assert all(sch.mgr.state_of(r) is State.RELEASED for r in (a, b, c))
        mst = sch.mgr.stats()
        assert mst.leaked == 0 and mst.released == 3 and mst.tracked == 0
        assert mst.storage_finished == st.storage_ops
        sch.mgr.check_integrity()
        stack.allocator.check_integrity()
        stack.host_pool.check_integrity()

        # phase 3: the server is back on the same port (empty: no persistence); writes work again
        server.start()
        clock.t += 3600  # the breaker's backoff elapsed: the next write probes and closes it
        failed_before, ok_before = st.storage_failed, st.storage_ok
        with structlog.testing.capture_logs() as logs:
            d = sch.admit(4, list(range(400, 406)), 7)
            for t in range(10):
                sch.step(80 + t)
            sch.finish(d)
            sch.settle()
        st = off.stats()
        # the first success after the outage writes its summary: the failures not logged, counted
        (summary,) = [e for e in logs if e["event"] == "offloader.storage_failed"]
        assert summary["summary"] is True and summary["suppressed"] == failed_before - 1
        assert st.storage_failed == failed_before and st.storage_ok > ok_before
        expected = sch.kv_pages(d)
        assert len(expected) >= 3
        hashes = [h for h, _ in expected]
        assert stack.storage.batch_exists(hashes) == len(hashes)
        bufs = [torch.empty(stack.host_pool.page_nbytes, dtype=torch.uint8) for _ in hashes]
        assert stack.storage.batch_get(hashes, bufs) == [True] * len(hashes)
        for buf, (_, want) in zip(bufs, expected):
            assert torch.equal(buf, want)
        assert stack.allocator.available_size() == alloc0 and stack.host_pool.available_size() == host0
        assert sch.mgr.stats().leaked == 0 and sch.mgr.state_of(d) is State.RELEASED
    finally:
        sch.mgr.shutdown(force=True)
        stack.close()


# --- a skipped SET whose value is not our page is repaired ---------------------------------------

class RefusingFrom(CircuitBreaker):
    """A breaker that lets calls through until its ``refuse_from``-th ``allow`` (counted from a reset)."""

    def __init__(self):
        super().__init__("test")
        self.calls, self.refuse_from = 0, None

    def allow(self):
        self.calls += 1
        return (self.refuse_from is None or self.calls < self.refuse_from) and super().allow()


@pytest.mark.parametrize("step, what", [(2, "check existing"), (3, "repair")])
def test_a_repair_round_trip_refused_is_named_in_the_error(redis_url, step, what):
    b = RefusingFrom()
    s = RedisStorage(redis_url, "_m_0_1", NB, breaker=b)
    c = raw_client(redis_url)
    c.set(A + "_m_0_1", b"not a page")  # SET NX keeps it: checked, then overwritten
    b.calls, b.refuse_from = 0, step  # 1: the SETs, 2: the check of the skipped ones, 3: the repair
    with pytest.raises(StorageUnavailable, match=rf"\({what}\): circuit open"):
        s.batch_set([A], [page(1)])
    c.close()
    s.close()


class WritesRefusedFrom(CircuitBreaker):
    """A breaker that, at its ``from_call``-th ``allow``, has the server refuse every write from
    then on (``min-replicas-to-write`` with no replica: each write answers ``NOREPLICAS``)."""

    def __init__(self, server_url: str, from_call: int):
        super().__init__("test")
        self.server_url, self.from_call, self.calls = server_url, from_call, 0

    def allow(self):
        self.calls += 1
        if self.calls == self.from_call:
            c = raw_client(self.server_url)
            c.config_set("min-replicas-to-write", 1)
            c.close()
        return super().allow()


def test_a_repair_the_server_refuses_is_a_failed_write_not_a_repaired_page(make_redis_server):
    server = make_redis_server()
    s = RedisStorage(server.url, "_m_0_1", NB, breaker=WritesRefusedFrom(server.url, 3))  # 3: the repair
    c = raw_client(server.url)
    c.set(A + "_m_0_1", b"not a page")  # SET NX keeps it: checked, then the overwrite is refused
    with structlog.testing.capture_logs() as logs:
        assert s.batch_set([A], [page(1)]) == [False]
    assert s.stats().repaired == 0 and not [e for e in logs if e["event"] == "redis_storage.repaired"]
    assert c.get(A + "_m_0_1") == b"not a page"
    c.close()
    s.close()


def test_a_repair_overwrites_only_the_foreign_values_keeps_the_ttl_and_logs_each(redis_url):
    s = RedisStorage(redis_url, "_m_0_1", NB, ttl_s=600)
    assert s.batch_set([A], [page(1)]) == [True]  # ours: a later SET of it is skipped, not repaired
    c = raw_client(redis_url)
    c.set(B + "_m_0_1", b"x" * 10)  # another length, not a page
    with structlog.testing.capture_logs() as logs:
        assert s.batch_set([A, B], [page(1), page(2)]) == [True, True]
    st = s.stats()
    assert (st.skipped, st.repaired) == (1, 1)
    assert [e["name"] for e in logs if e["event"] == "redis_storage.repaired"] == [B + "_m_0_1"]
    assert 0 < c.pttl(B + "_m_0_1") <= 600_000  # the repaired page expires like any other
    out = torch.empty(NB, dtype=torch.uint8)
    assert s.batch_get([B], [out]) == [True] and torch.equal(out, page(2))
    c.close()
    s.close()


def test_a_stored_page_of_another_size_is_repaired_not_kept(redis_url):
    fmt = PageFormat.of("page_first", torch.uint8, (2, 16))
    s = RedisStorage(redis_url, "_m_0_1", page_format=fmt)  # any page size
    assert s.batch_set([A], [torch.full((2 * NB,), 7, dtype=torch.uint8)]) == [True]
    assert s.batch_set([A], [page(3)]) == [True] and s.stats().repaired == 1
    out = torch.empty(NB, dtype=torch.uint8)
    assert s.batch_get([A], [out]) == [True] and torch.equal(out, page(3))
    s.close()
