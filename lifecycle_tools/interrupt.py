"""Ctrl-C for the ``kv-lifecycle`` commands: stop within a second with exit 130, never swallowed.

Python delivers SIGINT as a ``KeyboardInterrupt`` raised wherever the main thread happens to be,
which may be inside a weakref callback or a ``__del__`` (the manager keys its records weakly): there
Python prints "Exception ignored" and the run goes on. So the commands replace the default handler
with one that only records the request; the work loops call ``check()`` at safe points and raise
``KeyboardInterrupt`` there, on the main path. A watchdog started by the first Ctrl-C ends the
process with exit 130 after ``grace_s`` seconds whatever the main thread is doing (blocked in I/O,
waiting on a worker); a second Ctrl-C ends it at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

EXIT_INTERRUPTED = 130


class Interrupts:
    """The SIGINT policy of one process.

    Args:
        grace_s: seconds between the first Ctrl-C and the forced exit.
        message: written to stderr when the watchdog or a second Ctrl-C ends the process.
    """

    def __init__(self, grace_s: float = 0.8, message: str = "kv-lifecycle: interrupted\n") -> None:
        self.grace_s = grace_s
        self.message = message
        self._event = threading.Event()
        self._previous = None
        self._installed = False
        self._before_exit: list[Callable[[], None]] = []

    def install(self) -> bool:
        """Take over SIGINT (main thread only). Returns whether it did."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._event.clear()
        self._previous = signal.signal(signal.SIGINT, self._handler)
        self._installed = True
        return True

    def uninstall(self) -> None:
        """Give SIGINT back to the handler that was there before ``install``."""
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False
        self._before_exit.clear()

    def before_exit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (e.g. flush a log file) before a forced exit; errors in it are ignored."""
        self._before_exit.append(fn)

    def requested(self) -> bool:
        """Whether Ctrl-C was pressed since ``install``."""
        return self._event.is_set()

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` if Ctrl-C was pressed (call at a safe point of a loop)."""
        if self._event.is_set():
            raise KeyboardInterrupt

    def pressed(self) -> None:
        """Act as if Ctrl-C was pressed now (one that came before ``install``, recorded elsewhere)."""
        self._handler(signal.SIGINT, None)

    def _handler(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        if self._event.is_set():
            self._exit_now()
        self._event.set()
        timer = threading.Timer(self.grace_s, self._exit_now)
        timer.daemon = True
        timer.start()

    def exit_now(self, quiet: bool = False) -> None:
        """End the process with exit 130 at once (after the ``before_exit`` hooks and flushing the
        standard streams), without the interpreter's finalization: a Ctrl-C that arrives while
        Python tears down would otherwise kill it by the signal's default action."""
        for fn in list(self._before_exit):
            try:
                fn()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        try:
            if not quiet:
                sys.stderr.write(self.message)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(EXIT_INTERRUPTED)

    _exit_now = exit_now


INTERRUPTS = Interrupts()


def check() -> None:
    """``INTERRUPTS.check()``: a no-op unless a command installed the handler and Ctrl-C came."""
    INTERRUPTS.check()
