"""Server processes that die with whoever started them.

A test kit server (``redis-server``, ``mooncake_master``, ``mooncake_client``) is stopped by its
fixture's teardown. A test process killed before its teardown runs (a mutation campaign's child
past its time bound, a CI job cancelled, ``kill -9``) used to leave its servers running, adopted
by init: the mutation campaign on ``e9c13f6`` found 536 orphaned cluster nodes and 135 Mooncake
processes gossiping and polling on 2 cores (load average 20), which slowed every later test run
past its bound. On Linux each server now asks the kernel for ``SIGKILL`` when its parent dies
(``PR_SET_PDEATHSIG``). Elsewhere nothing changes.

The signal is tied to the *thread* that started the server: start servers from a thread that
outlives them (fixtures run on pytest's main thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - no C library to ask
        return None


_LIBC = _libc() if sys.platform.startswith("linux") else None


def die_with_parent(parent: int) -> None:
    """``preexec_fn`` for ``subprocess.Popen``: the child gets SIGKILL when its parent dies.

    Args:
        parent: the parent's pid as seen before the fork; when the parent is already gone by the
            time the request is made (``os.getppid()`` differs), the child exits at once.
    """
    if _LIBC is None:
        return
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def popen_kwargs() -> dict:
    """Keyword arguments that make a server started with ``subprocess.Popen`` die with this process
    (its own session too: a Ctrl-C to the test run's terminal is not sent to it)."""
    me = os.getpid()
    return {"start_new_session": True, "preexec_fn": lambda: die_with_parent(me)}
