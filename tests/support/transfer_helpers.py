"""Shared helpers for the transfer tests: bounded polling, never sleep-based timing assertions."""

from __future__ import annotations

import socket
import time
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
