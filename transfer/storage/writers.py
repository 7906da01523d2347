"""Page writes in flight, and the daemon threads that run a batch's writes concurrently, with a
bounded close.

A page write is a filesystem call that cannot be cancelled: on NFS, a FUSE mount or a stalled
device it can block forever. ``close(timeout)`` therefore waits at most ``timeout`` for the writes
in flight and then *abandons* them, naming each; the threads are daemon threads, so a write that
never returns neither blocks the close nor keeps the process from exiting.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from transfer.errors import Closed

_STOP = object()


class InFlight:
    """The names of the page writes running now, on any thread (thread-safe)."""

    def __init__(self) -> None:
        self._names: Counter[str] = Counter()
        self._idle = threading.Condition()

    def running(self, name: str):
        """Context manager: ``name`` is in flight within the block."""
        return _Running(self, name)

    def names(self) -> list[str]:
        """The names in flight now, sorted (a name written twice at once is listed once)."""
        with self._idle:
            return sorted(self._names)

    def wait(self, timeout: float | None) -> list[str]:
        """Wait until no write is in flight, at most ``timeout`` seconds (None: without bound).

        Returns:
            The names still in flight at the end (empty when every write ended).
        """
        with self._idle:
            self._idle.wait_for(lambda: not self._names, timeout)
            return sorted(self._names)

    def _enter(self, name: str) -> None:
        with self._idle:
            self._names[name] += 1

    def _exit(self, name: str) -> None:
        with self._idle:
            self._names[name] -= 1
            if self._names[name] <= 0:
                del self._names[name]
            if not self._names:
                self._idle.notify_all()


class _Running:
    def __init__(self, owner: InFlight, name: str) -> None:
        self._owner, self._name = owner, name

    def __enter__(self) -> None:
        self._owner._enter(self._name)

    def __exit__(self, *exc) -> None:
        self._owner._exit(self._name)


class WriterThreads:
    """``threads`` daemon threads running the items of one ``map`` call concurrently.

    Args:
        threads: worker threads (>= 1), started on first use.
        name: thread name prefix.
    """

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._count, self._name = threads, name
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def _start(self) -> None:
        with self._lock:
            if self._closed:
                raise Closed("writer threads are closed")
            if not self._threads:
                self._threads = [threading.Thread(target=self._run, name=f"{self._name}-{i}", daemon=True)
                                 for i in range(self._count)]
                for t in self._threads:
                    t.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            fn, item, out, i, done = job
            try:
                out[i] = fn(item)
            except BaseException as err:  # noqa: BLE001 - handed back to the caller of map
                out[i] = _Raised(err)
            done.release()

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """``[fn(x) for x in items]``, run on the threads; waits for every item (like
        ``Executor.map``): the caller's own wait is bounded by its callers (a storage worker the
        offloader abandons at its close deadline).

        Raises:
            Closed: after ``close``. Whatever ``fn`` raised (the first, after all have ended).
        """
        self._start()
        out: list[Any] = [None] * len(items)
        done = threading.Semaphore(0)
        for i, item in enumerate(items):
            self._jobs.put((fn, item, out, i, done))
        for _ in items:
            done.acquire()
        for r in out:
            if isinstance(r, _Raised):
                raise r.err
        return out

    def close(self, timeout: float | None) -> bool:
        """Stop the threads, waiting at most ``timeout`` seconds in all (None: until they end); a
        thread stuck in a write is left behind (daemon). Idempotent.

        Returns:
            True when every thread has ended.
        """
        with self._lock:
            first, self._closed = not self._closed, True
            threads = list(self._threads)
        if first:
            for _ in threads:
                self._jobs.put(_STOP)
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)


class _Raised:
    __slots__ = ("err",)

    def __init__(self, err: BaseException) -> None:
        self.err = err
