"""``transfer/storage/writers.py``: the file store's writer threads and the page writes in flight
(the pieces that let ``FileStorage.close(timeout)`` abandon a hung write instead of waiting)."""

from __future__ import annotations

import threading

import pytest

from transfer.errors import Closed
from transfer.storage.writers import InFlight, WriterThreads


def test_map_runs_every_item_in_order_and_reraises_after_all_ended():
    w = WriterThreads(2, "t")
    assert w.map(lambda x: x * 2, [1, 2, 3]) == [2, 4, 6]
    seen = []

    def job(x):
        seen.append(x)
        if x == 2:
            raise OSError("boom")
        return x

    with pytest.raises(OSError, match="boom"):
        w.map(job, [1, 2, 3])
    assert sorted(seen) == [1, 2, 3]
    assert w.close(timeout=5) is True and w.close(timeout=0) is True
    with pytest.raises(Closed):
        w.map(lambda x: x, [1])
    with pytest.raises(ValueError):
        WriterThreads(0, "t")


def test_close_abandons_a_stuck_thread_within_its_timeout():
    w = WriterThreads(1, "t")
    gate, started = threading.Event(), threading.Event()

    def stuck(_):
        started.set()
        gate.wait()

    caller = threading.Thread(target=lambda: w.map(stuck, [0]), daemon=True)
    caller.start()
    assert started.wait(10)
    assert w.close(timeout=0.05) is False  # the thread is left behind, the close returns
    gate.set()
    caller.join(10)
    assert not caller.is_alive()


def test_in_flight_names_and_a_bounded_wait():
    f = InFlight()
    assert f.names() == [] and f.wait(0) == []
    with f.running("a"), f.running("a"), f.running("b"):
        assert f.names() == ["a", "b"] and f.wait(0.01) == ["a", "b"]
    assert f.names() == [] and f.wait(None) == []
    done, inside = threading.Event(), threading.Event()

    def later():
        with f.running("c"):
            inside.set()
            done.wait()

    t = threading.Thread(target=later, daemon=True)
    t.start()
    assert inside.wait(10) and f.names() == ["c"]
    threading.Timer(0.01, done.set).start()
    assert f.wait(10) == []  # woken when the last write ends
    t.join(10)


def test_threads_are_named_daemons_and_errors_name_the_problem():
    w = WriterThreads(2, "kv-w")
    who = w.map(lambda _: (threading.current_thread().name, threading.current_thread().daemon), range(6))
    assert {name for name, _ in who} <= {"kv-w-0", "kv-w-1"} and all(daemon for _, daemon in who)
    assert w.close(timeout=None) is True
    with pytest.raises(Closed, match=r"\bwriter threads are closed\b"):
        w.map(lambda x: x, [1])
    with pytest.raises(ValueError, match=r"\bthreads must be >= 1, got 0\b"):
        WriterThreads(0, "t")


def test_close_without_a_bound_stops_every_thread_cleanly(monkeypatch):
    crashed = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashed.append(args.exc_value))
    assert WriterThreads(2, "t").close(timeout=None) is True  # never started: nothing to stop
    w = WriterThreads(3, "t")
    assert w.map(lambda x: x + 1, [1, 2, 3]) == [2, 3, 4]
    assert w.close(timeout=None) is True
    assert crashed == []  # each thread ended on its stop signal, none died of an exception


def test_close_never_waits_on_a_thread_longer_than_what_is_left_of_its_timeout(monkeypatch):
    import types

    from transfer.storage import writers

    waits = []

    class Thread(threading.Thread):
        def join(self, timeout=None):
            waits.append(timeout)
            super().join(timeout)

    monkeypatch.setattr(writers, "threading", types.SimpleNamespace(**{**vars(threading), "Thread": Thread}))
    w = WriterThreads(2, "t")
    gate, started = threading.Event(), threading.Semaphore(0)

    def stuck(_):
        started.release()
        gate.wait()

    caller = threading.Thread(target=lambda: w.map(stuck, [0, 1]), daemon=True)
    caller.start()
    started.acquire()
    started.acquire()
    assert w.close(timeout=0) is False  # both threads stuck: left behind at once
    assert waits == [0.0, 0.0]
    gate.set()
    caller.join(10)
    assert not caller.is_alive()


def test_a_name_written_twice_at_once_stays_in_flight_until_both_writes_end():
    f = InFlight()
    with f.running("a"):
        with f.running("a"):
            assert f.names() == ["a"]
        assert f.names() == ["a"] and f.wait(0) == ["a"]  # one of the two writes is still running
    assert f.names() == [] and f.wait(0) == []
