"""``transfer/storage/mooncake/session.py`` without a master: a lazy store connects in the background,
retrying after 0.5 s, 1 s, 2 s ... capped at 30 s (docs/storage.md, *No master at open*), logging
each failed attempt, until it connects or is closed.

``mooncake_conn.connect`` is replaced by a fake that fails a given number of times, and the
session's stop event by one whose ``wait`` returns at once and records how long it was asked to
wait: the retry schedule is observed without sleeping. Against a real master:
``test_mooncake_faults.py::test_master_absent_at_setup_lazy_connects_later``.
"""

from __future__ import annotations

import threading
import time
import types

import pytest
from structlog.testing import capture_logs

from transfer.errors import StorageUnavailable
from transfer.storage.mooncake import conn
from transfer.storage.mooncake import session as mooncake_session
from transfer.storage.mooncake.session import ClientSession


class FakeClient:
    """A set-up Mooncake client, as far as the session uses one."""

    def __init__(self) -> None:
        self.closed = False

    def get_hostname(self) -> str:
        return "127.0.0.1:17001"

    def close(self) -> int:
        self.closed = True
        return 0


class FakeReplicateConfig:
    replica_num = 1
    preferred_segments: list = []


class InstantEvent(threading.Event):
    """A stop event whose ``wait`` does not sleep: it records the timeout and returns at once."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list = []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return self.is_set()


@pytest.fixture
def fake_mooncake(monkeypatch):
    """``conn.connect`` fails ``state.failures`` times (a distinct error each), then returns a client."""
    state = types.SimpleNamespace(failures=0, attempts=0, client=FakeClient(), errors=[])

    def connect(settings):
        state.attempts += 1
        if state.attempts <= state.failures:
            err = StorageUnavailable(f"mooncake master at {settings.master} is unreachable: attempt {state.attempts}")
            state.errors.append(str(err))
            raise err
        return state.client

    monkeypatch.setattr(conn, "import_store", lambda: (None, FakeReplicateConfig))
    monkeypatch.setattr(conn, "connect", connect)
    monkeypatch.setattr(conn, "probe", lambda host, port, timeout_s: None)  # the master answers at close
    monkeypatch.setattr(mooncake_session, "threading", types.SimpleNamespace(
        Lock=threading.Lock, Condition=threading.Condition, Thread=threading.Thread, Event=InstantEvent))
    return state


def _until(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return cond()


def wait_connected(session: ClientSession, timeout: float = 5.0) -> bool:
    return _until(lambda: session.connected, timeout)


def test_a_lazy_session_retries_with_a_doubling_backoff_capped_at_30_s(fake_mooncake):
    fake_mooncake.failures = 9
    s = ClientSession(conn.MooncakeSettings(master="127.0.0.1:1", lazy=True))
    try:
        assert wait_connected(s)
        assert fake_mooncake.attempts == 10
        assert s._closed.waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    finally:
        s.close(wait=True)
    assert fake_mooncake.client.closed


def test_each_failed_attempt_is_logged_with_its_error_and_the_wait_before_the_next(fake_mooncake):
    fake_mooncake.failures = 3
    with capture_logs() as logs:
        s = ClientSession(conn.MooncakeSettings(master="127.0.0.1:1", lazy=True))
        try:
            assert wait_connected(s)
        finally:
            s.close(wait=True)
    retries = [{k: e.get(k) for k in ("event", "log_level", "error", "retry_in_s")}
               for e in logs if e.get("event") == "mooncake.connect_retry"]
    assert retries == [{"event": "mooncake.connect_retry", "log_level": "debug", "error": err, "retry_in_s": wait}
                       for err, wait in zip(fake_mooncake.errors, [0.5, 1.0, 2.0])]
    assert "attempt 1" in fake_mooncake.errors[0]


def test_a_lazy_session_closed_while_retrying_stops_connecting(fake_mooncake):
    fake_mooncake.failures = 10 ** 9
    s = ClientSession(conn.MooncakeSettings(master="127.0.0.1:1", lazy=True))
    deadline = time.monotonic() + 5.0
    while fake_mooncake.attempts < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    s.close(wait=True)
    time.sleep(0.05)
    attempts = fake_mooncake.attempts
    time.sleep(0.1)
    assert fake_mooncake.attempts == attempts and not s.connected


def test_a_session_closed_while_its_master_is_gone_parks_the_client_for_good(fake_mooncake, monkeypatch):
    """With the master not answering at close, the client is neither closed nor ever destroyed
    (Mooncake's close would hold the GIL for ~17 s): one warning says so."""
    import gc
    import weakref

    monkeypatch.setattr(conn, "probe", lambda host, port, timeout_s: "Connection refused")
    s = ClientSession(conn.MooncakeSettings(master="127.0.0.1:1", lazy=True))
    assert wait_connected(s)
    client = weakref.ref(fake_mooncake.client)
    with capture_logs() as logs:
        s.close(wait=True)
    parked = [{k: e.get(k) for k in ("event", "log_level", "master", "detail")}
              for e in logs if e.get("event") == "mooncake.client_parked"]
    assert parked == [{"event": "mooncake.client_parked", "log_level": "warning", "master": "127.0.0.1:1",
                       "detail": "master unreachable at close; the client is left open until the process exits"}]
    assert not fake_mooncake.client.closed
    del s, fake_mooncake.client
    gc.collect()
    assert client() is not None  # still referenced: never destroyed


def _held_connect(monkeypatch, client, gate: threading.Event, seen: list) -> None:
    """``conn.connect`` records the thread it runs on and returns ``client`` once ``gate`` is set."""
    def connect(settings):
        t = threading.current_thread()
        seen.append((t.name, t.daemon))
        gate.wait(10)
        return client
    monkeypatch.setattr(conn, "connect", connect)


def test_a_lazy_session_connects_on_a_daemon_thread_named_kv_mooncake_connect(fake_mooncake, monkeypatch):
    gate, seen = threading.Event(), []
    _held_connect(monkeypatch, fake_mooncake.client, gate, seen)
    s = ClientSession(conn.MooncakeSettings(master="127.0.0.1:1", lazy=True))
    try:
        assert _until(lambda: seen)
        assert seen == [("kv-mooncake-connect", True)] and not s.connected   # never holds up the exit
    finally:
        s.close(wait=True)
        gate.set()


@pytest.mark.parametrize("segment, at_open", [("10.0.0.5:17001", ["10.0.0.5:17001"]), ("", []), ("local", [])])
def test_a_named_preferred_segment_is_set_at_open_and_local_waits_for_the_connection(
        fake_mooncake, monkeypatch, segment, at_open):
    gate = threading.Event()
    _held_connect(monkeypatch, fake_mooncake.client, gate, [])
    s = ClientSession(conn.MooncakeSettings(master="127.0.0.1:1", lazy=True, preferred_segment=segment))
    try:
        assert list(s._put_config.preferred_segments) == at_open   # not connected yet
    finally:
        s.close(wait=True)
        gate.set()


@pytest.mark.parametrize("segment, size, placed", [("local", 1, ["127.0.0.1:17001"]), ("local", 0, []),
                                                   ("", 1 << 20, [])])
def test_local_places_objects_on_this_clients_segment_only_when_it_contributes_one(
        fake_mooncake, segment, size, placed):
    s = ClientSession(conn.MooncakeSettings(master="127.0.0.1:1", preferred_segment=segment,
                                            global_segment_size=size))   # not lazy: connected now
    try:
        assert s.connected and list(s._put_config.preferred_segments) == placed
    finally:
        s.close(wait=True)


def test_connecting_is_logged_once_with_the_master_and_this_clients_segment(fake_mooncake):
    with capture_logs() as logs:
        s = ClientSession(conn.MooncakeSettings(master="127.0.0.1:1"))
    s.close(wait=True)
    got = [{k: e.get(k) for k in ("event", "log_level", "master", "hostname")}
           for e in logs if e.get("master") is not None or e.get("hostname") is not None]
    assert got == [{"event": "mooncake.connected", "log_level": "info", "master": "127.0.0.1:1",
                    "hostname": "127.0.0.1:17001"}]


def test_a_connection_made_after_close_is_closed_at_once_and_never_used(fake_mooncake, monkeypatch):
    gate, seen = threading.Event(), []
    _held_connect(monkeypatch, fake_mooncake.client, gate, seen)
    s = ClientSession(conn.MooncakeSettings(master="127.0.0.1:1", lazy=True))
    assert _until(lambda: seen)
    s.close(wait=True)          # while the connection is being made
    gate.set()                  # it completes now
    assert _until(lambda: fake_mooncake.client.closed)
    assert not s.connected


def test_close_flushes_the_rate_limited_log_summary_once(fake_mooncake):
    s = ClientSession(conn.MooncakeSettings(master="127.0.0.1:1"))
    flushed = []
    s._oplog = types.SimpleNamespace(flush=lambda: flushed.append(1))   # what MooncakeStorage sets
    s.close(wait=True)
    s.close(wait=True)
    assert flushed == [1]


def test_existence_checks_run_one_at_a_time_and_close_waits_for_the_running_one_on_a_non_daemon_thread(
        fake_mooncake, monkeypatch):
    probes = []
    monkeypatch.setattr(conn, "probe", lambda host, port, timeout_s: probes.append((host, port, timeout_s)))
    s = ClientSession(conn.MooncakeSettings(master="127.0.0.1:1", connect_timeout_s=0.25))
    gate, started, ran = threading.Event(), threading.Event(), []

    def stuck_check():
        ran.append(threading.current_thread().name)
        started.set()
        gate.wait(30)

    try:
        s._exists_pool.submit(stuck_check)
        queued = s._exists_pool.submit(ran.append, "queued")
        assert started.wait(5)
        time.sleep(0.1)
        assert len(ran) == 1 and ran[0].startswith("kv-mooncake-exists")   # one worker: the next waits
        before = set(threading.enumerate())
        closer = threading.Thread(target=s.close, daemon=True)    # close() called from a daemon thread
        closer.start()
        closer.join(5)
        assert not closer.is_alive()                              # returns at once ...
        finishing = [t for t in threading.enumerate() if t not in before and t.name == "kv-mooncake-close"]
        assert [t.daemon for t in finishing] == [False]           # ... the close runs on a non-daemon thread
        time.sleep(0.2)
        assert not fake_mooncake.client.closed                    # not while a check still uses the client
    finally:
        gate.set()
    finishing[0].join(10)
    assert fake_mooncake.client.closed and queued.cancelled() and ran == ran[:1]   # the queued check dropped
    assert probes == [("127.0.0.1", 1, 0.25)]                     # the master probed with its own bound


def test_close_waits_a_bounded_60_s_for_calls_in_flight_then_closes_anyway(fake_mooncake, monkeypatch):
    waits = []

    class NoWaitCondition(threading.Condition):
        def wait_for(self, predicate, timeout=None):
            waits.append(timeout)          # the bound asked for; the test does not sit through it
            return super().wait_for(predicate, timeout=0)

    monkeypatch.setattr(mooncake_session.threading, "Condition", NoWaitCondition)
    s = ClientSession(conn.MooncakeSettings(master="127.0.0.1:1"))
    s._inflight = 1                        # a read that never returns
    s.close(wait=True)
    assert waits == [60] and fake_mooncake.client.closed
