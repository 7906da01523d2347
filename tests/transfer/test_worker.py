"""``BackgroundWorker``: daemon threads named after the worker, a FIFO of jobs, completions by poll."""

from __future__ import annotations

import threading

import pytest

from transfer.errors import Closed
from transfer.worker import BackgroundWorker
from tests.support.transfer_helpers import drain


def test_threads_must_be_at_least_one():
    with pytest.raises(ValueError, match=r"^threads must be >= 1, got 0$"):
        BackgroundWorker("w", 0)


def test_threads_are_daemons_named_after_the_worker():
    before = set(threading.enumerate())
    w = BackgroundWorker("kv-test-named", 2)
    new = [t for t in threading.enumerate() if t not in before]
    assert sorted(t.name for t in new) == ["kv-test-named-0", "kv-test-named-1"]
    assert all(t.daemon for t in new)
    assert w.close(timeout=5)


def test_pending_counts_jobs_not_yet_polled():
    w = BackgroundWorker("w", 1)
    gate = threading.Event()
    w.submit("a", lambda: 1)
    w.submit("b", lambda: gate.wait(10))
    w.submit("c", lambda: 3)
    assert w.pending == 3
    (done,) = drain(w.poll, 1)
    assert done.tag == "a" and done.value == 1 and w.pending == 2
    gate.set()
    assert [d.tag for d in drain(w.poll, 2)] == ["b", "c"] and w.pending == 0
    assert w.close(timeout=5)


def test_after_close_submit_is_refused_and_threads_end_cleanly(monkeypatch):
    crashed = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashed.append(args.exc_value))
    w = BackgroundWorker("w", 2)
    w.submit(1, lambda: "x")
    assert w.close(timeout=5) is True and not w.alive()
    assert [(d.tag, d.value) for d in w.poll()] == [(1, "x")]
    with pytest.raises(Closed, match=r"^worker is closed$"):
        w.submit(2, lambda: "y")
    assert w.pending == 0 and w.unfinished() == []
    assert crashed == []                       # stopped by the stop marker, not by an error
