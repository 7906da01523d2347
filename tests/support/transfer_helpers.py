"""Shared helpers for the transfer tests: bounded polling, never sleep-based timing assertions."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable


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
