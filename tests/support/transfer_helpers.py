"""Shared helpers for the transfer tests: bounded polling, never sleep-based timing assertions."""

from __future__ import annotations

import socket
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager


def drain(poll: Callable[[], Iterable], want: int, timeout: float = 10.0) -> list:
    """Call ``poll`` until it has returned ``want`` items in total; fail after ``timeout`` s."""
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < want:
        got.extend(poll())
        if len(got) < want:
            if time.monotonic() > deadline:
                raise AssertionError(f"only {len(got)} of {want} completions after {timeout}s: {got}")
            time.sleep(0.001)
    return got


class Polls:
    """One offloader's ``finished_writes`` reports (``transfer.WriteReport``) seen one kind at a
    time: each call takes one report and keeps the other kinds for their own calls, so a test can
    drain the copies that ended (landed or failed), then ask which of them failed, or which
    expired, as it would read one report."""

    def __init__(self, off) -> None:
        self.off = off
        self._ended: list[int] = []
        self._failed: list[int] = []
        self._expired: list[int] = []

    def _take(self, kind: str) -> list[int]:
        r = self.off.finished_writes()
        self._ended += r.landed + r.failed
        self._failed += r.failed
        self._expired += r.expired
        out = getattr(self, kind)
        setattr(self, kind, [])
        return out

    def ended(self) -> list[int]:
        """Acks whose copy ended (landed or failed) since the last ``ended``."""
        return self._take("_ended")

    def failed(self) -> list[int]:
        """Acks reported failed since the last ``failed``."""
        return self._take("_failed")

    def expired(self) -> list[int]:
        """Acks reported expired since the last ``expired``."""
        return self._take("_expired")


_POLLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def polls(off) -> Polls:
    """The one ``Polls`` of ``off`` (kept while ``off`` lives)."""
    p = _POLLS.get(off)
    if p is None:
        p = _POLLS[off] = Polls(off)
    return p


@contextmanager
def never_accepting_port() -> Iterator[int]:
    """A loopback port whose listener never answers a new connection: its accept queue is filled
    (backlog 0), so the next attempt waits for the kernel's retries. Closed on exit."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    queued = []
    try:
        port = listener.getsockname()[1]
        while True:  # fill the accept queue: the next connection attempt goes unanswered
            sock = socket.socket()
            sock.settimeout(0.3)
            try:
                sock.connect(("127.0.0.1", port))
            except TimeoutError:
                sock.close()
                break
            queued.append(sock)
        yield port
    finally:
        for sock in queued:
            sock.close()
        listener.close()
