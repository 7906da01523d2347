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


EXIT_SCRIPT = """
import sys, threading, time, torch
from transfer.worker import BackgroundWorker
w = BackgroundWorker("probe", 1)
a = torch.randn(256, 256)
started = threading.Event()
def busy():                      # a copy still running torch ops when the process ends
    started.set()
    t = time.monotonic()
    while time.monotonic() - t < 0.6:
        torch.mm(a, a)
def stuck():                     # a copy that never returns
    started.set()
    threading.Event().wait()
w.submit(1, busy if sys.argv[1] == "busy" else stuck)
started.wait(30)
w.close(0)                       # abandoned, as a bounded shutdown leaves it
print("end of run", flush=True)
"""


@pytest.mark.parametrize("job", ["busy", "stuck"])
def test_the_process_ends_cleanly_with_a_job_left_running_at_exit(job):
    """docs (transfer/worker.py): a job ``close(timeout)`` left running gets ``EXIT_GRACE_S`` at
    interpreter exit. Stopped inside a torch op instead, the process aborted ("terminate called
    without an active exception", SIGABRT: every run before the grace); a job stuck past the grace
    is abandoned and the process still ends, exit 0."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, job], capture_output=True, text=True, timeout=120,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.splitlines() == ["end of run"] and "terminate called" not in out.stderr
