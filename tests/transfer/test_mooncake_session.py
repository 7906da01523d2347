"""``transfer/storage/mooncake_session.py`` without a master: a lazy store connects in the background,
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
from transfer.storage import mooncake_conn as conn
from transfer.storage import mooncake_session
from transfer.storage.mooncake_session import ClientSession


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


def wait_connected(session: ClientSession, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not session.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    return session.connected


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
