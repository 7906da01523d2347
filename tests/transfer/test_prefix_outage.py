"""Prefix lookups on the scheduler thread against a real redis-server that is killed, stopped
(SIGSTOP: it accepts nothing and answers nothing) and restarted: every lookup returns quickly, a
dead or hung tier is a counted miss behind the circuit breaker, logged once per outage, and the
lookups find pages again once the tier is back."""

from __future__ import annotations

import os
import signal
import time

import torch
from structlog.testing import capture_logs

from tests.transfer.test_prefix import PS, store_request
from transfer import StorageUnavailable, build_stack
from transfer.storage.breaker import CircuitBreaker
from transfer.storage.redis.store import RedisStorage


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def stack_on(server, clock, socket_timeout_s=5.0):
    breaker = CircuitBreaker("test-redis", base_backoff_s=1.0, clock=clock)
    store = RedisStorage(server.url, "_m_0_1", breaker=breaker, socket_timeout_s=socket_timeout_s)
    return build_stack(1, 1, 4, torch.float16, PS, 64, 32, 2, 32, storage=store, lookup_timeout_s=0.05)


def timed(fn):
    t = time.monotonic()
    out = fn()
    return out, time.monotonic() - t


def test_killed_server_is_a_fast_counted_miss_then_found_again(make_redis_server):
    server, clock = make_redis_server(), Clock()
    s = stack_on(server, clock)
    tokens = list(range(12))
    store_request(s, 1, tokens)
    loader = s.prefix_loader
    assert len(loader.lookup(tokens)) == 3
    server.stop()
    with capture_logs() as logs:
        for _ in range(50):  # the scheduler keeps admitting requests while the tier is down
            got, took = timed(lambda: loader.lookup(tokens))
            assert got == [] and took < 1.0
            assert loader.start(7, tokens) == 0  # nothing queued, nothing allocated, no raise
        server.start()  # back, same port, empty (no persistence)
        assert loader.lookup(tokens) == []  # still backing off: not asked
        clock.t += 1.0
        assert loader.lookup(tokens) == []  # probed: answered (the pages are gone), breaker closed
    st = loader.stats()
    assert st.failed == 1 and st.skipped == 100 and st.lookups == 103
    events = [e["event"] for e in logs]
    assert events.count("storage.tier_down") == 1 and events.count("storage.tier_recovered") == 1
    store_request(s, 2, tokens)  # writes work again
    assert len(loader.lookup(tokens)) == 3
    s.close()


def test_sigstopped_server_costs_one_deadline_then_nothing(make_redis_server):
    server, clock = make_redis_server(), Clock()
    s = stack_on(server, clock, socket_timeout_s=2.0)
    tokens = list(range(12))
    store_request(s, 1, tokens)
    loader = s.prefix_loader
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        got, took = timed(lambda: loader.lookup(tokens))
        assert got == [] and took < 0.5  # the lookup deadline (0.05 s), not the 2 s socket timeout
        for _ in range(20):
            got, took = timed(lambda: loader.lookup(tokens))
            assert got == [] and took < 0.01  # breaker open: the hung tier is not asked
        st = loader.stats()
        assert (st.timed_out, st.skipped) == (1, 20)
        # writes share the breaker: they fail at once instead of waiting on the hung server
        _, took = timed(lambda: _expect_unavailable(s.storage))
        assert took < 0.05
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    clock.t += 1.0
    deadline = time.monotonic() + 10
    while len(loader.lookup(tokens)) != 3:  # the server answers again
        assert time.monotonic() < deadline, loader.stats()
        clock.t += 60
        time.sleep(0.01)
    s.close()


def _expect_unavailable(store):
    try:
        store.batch_set(["ab" * 32], [torch.zeros(store.page_nbytes or 64, dtype=torch.uint8)])
    except StorageUnavailable:
        return
    raise AssertionError("batch_set did not fail fast while the breaker was open")


def test_lookup_deadline_and_breaker_for_a_tier_without_its_own(tmp_path, monkeypatch):
    """A file store on a hung filesystem (its stat blocks): the loader's own breaker."""
    import threading

    s = build_stack(1, 1, 4, torch.float16, PS, 64, 32, 2, 32, storage=f"file:{tmp_path}",
                    lookup_timeout_s=0.05)
    tokens = list(range(8))
    store_request(s, 1, tokens)
    gate = threading.Event()
    real = s.storage.batch_exists
    monkeypatch.setattr(s.storage, "batch_exists", lambda keys: (gate.wait(5), real(keys))[1])
    loader = s.prefix_loader
    assert loader.breaker is not getattr(s.storage, "breaker", None)
    with capture_logs() as logs:
        got, took = timed(lambda: loader.lookup(tokens))
    assert got == [] and took < 1.0 and loader.stats().timed_out == 1
    (down,) = [e for e in logs if e["event"] == "storage.tier_down"]
    assert down["tier"] == "FileStorage" and down["error"] == "lookup took longer than 0.05s"
    assert loader.lookup(tokens) == [] and loader.stats().skipped == 1
    gate.set()
    s.close()


def test_one_lookup_thread_a_hung_lookup_is_not_joined_by_another_nor_waited_for_at_close(tmp_path, monkeypatch):
    import threading

    from tests.transfer.test_shutdown import bounded

    s = build_stack(1, 1, 4, torch.float16, PS, 64, 32, 2, 32, storage=f"file:{tmp_path}", lookup_timeout_s=0.05)
    tokens = list(range(8))
    store_request(s, 1, tokens)
    gate, calls = threading.Event(), []
    real = s.storage.batch_exists

    def first_hangs(keys):
        calls.append(1)
        if len(calls) == 1:
            gate.wait(10)
        return real(keys)

    monkeypatch.setattr(s.storage, "batch_exists", first_hangs)
    loader = s.prefix_loader
    assert loader.lookup(tokens) == [] and loader.stats().timed_out == 1
    time.sleep(loader.breaker.retry_in())  # after its backoff: the next lookup asks the tier again
    assert loader.lookup(tokens) == []  # queued behind the hung one on the one lookup thread
    assert loader.stats().timed_out == 2 and calls == [1]
    assert bounded(lambda: loader.close(timeout=2), limit=5.0) is True  # the hung lookup is abandoned
    gate.set()
    s.close()
