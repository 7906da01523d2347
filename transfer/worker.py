"""Background worker threads: run submitted jobs off the caller's thread, report completions by poll.

At interpreter exit, a job still running on a worker thread (a copy that ``close(timeout)`` left
behind), and a thread of a closed worker still ending, get up to ``EXIT_GRACE_S`` seconds in all to
return: Python stops its daemon threads when they next take the GIL, and one stopped inside a torch
op (a C++ frame), or still tearing down torch's thread state while the interpreter's statics are
destroyed, aborts the whole process ("terminate called without an active exception", SIGABRT) —
seen when a node shut down with a CPU copy still running, and after ``close(0)``. A job stuck past
the grace is still abandoned (the process then ends as before).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from transfer.errors import Closed


class Done(msgspec.Struct, frozen=True):
    """One finished job: its tag, the job's return value, and the exception it raised (or None)."""

    tag: Any
    value: Any = None
    error: BaseException | None = None


_STOP = object()
EXIT_GRACE_S = 2.0
_WORKERS: weakref.WeakSet = weakref.WeakSet()


def _let_running_jobs_return() -> None:
    """atexit: join the worker threads still running a job or still ending after ``close``,
    ``EXIT_GRACE_S`` in all (an idle thread of an open worker waits for jobs forever: not joined)."""
    deadline = time.monotonic() + EXIT_GRACE_S
    for worker in list(_WORKERS):
        if worker._closed or worker._unfinished:
            for t in worker._threads:
                t.join(max(0.0, deadline - time.monotonic()))


atexit.register(_let_running_jobs_return)


class BackgroundWorker:
    """``threads`` daemon threads consuming a FIFO of jobs; completions may finish out of order.

    Args:
        name: thread name prefix.
        threads: worker threads, >= 1.
    """

    def __init__(self, name: str, threads: int = 1) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: deque[Done] = deque()
        self._unfinished: set = set()  # tags submitted whose job has not returned yet
        self._pending = 0
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()
        _WORKERS.add(self)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            tag, fn = job
            try:
                done = Done(tag, fn())
            except BaseException as err:  # reported to the poller, never raised on this thread
                done = Done(tag, error=err)
            self._unfinished.discard(tag)
            self._done.append(done)

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet returned by ``poll``."""
        return self._pending

    def submit(self, tag: Any, fn: Callable[[], Any]) -> None:
        """Queue ``fn`` to run on a worker thread; ``poll`` reports ``tag`` when it has run.

        Raises:
            Closed: after ``close``.
        """
        if self._closed:
            raise Closed("worker is closed")
        self._pending += 1
        self._unfinished.add(tag)
        self._jobs.put((tag, fn))

    def poll(self) -> list[Done]:
        """Jobs finished since the last call. Never blocks."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        self._pending -= len(out)
        return out

    def unfinished(self) -> list:
        """Tags whose job is queued or running (not yet returned). Never blocks."""
        return list(self._unfinished)

    def alive(self) -> bool:
        """Whether a worker thread is still running (e.g. after ``close`` timed out on a stuck job)."""
        return any(t.is_alive() for t in self._threads)

    def close(self, timeout: float | None = None) -> bool:
        """Stop accepting work, let queued jobs finish, and join the threads, waiting at most
        ``timeout`` seconds in all (None: until they end). A job cannot be cancelled: a thread
        stuck in one is left behind (a daemon thread) and its job is still reported by ``poll``
        if it ever returns. Idempotent.

        Returns:
            True when every thread has ended.
        Raises:
            ValueError: ``timeout`` negative.
        """
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._jobs.put(_STOP)
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self.alive()
