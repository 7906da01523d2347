"""Ctrl-C for the ``kv-lifecycle`` commands: exit 130 with one line, within a second, never swallowed.

Python delivers SIGINT as a ``KeyboardInterrupt`` raised wherever the main thread happens to be,
which may be inside a weakref callback or a ``__del__`` (the manager keys its records weakly): there
Python prints "Exception ignored" and the run goes on. So the commands replace the default handler.

Three phases, when the process is the command (``cli.main()`` with no ``argv``):

- **Start-up** (imports, flag parsing, checks: nothing to flush or shut down): a Ctrl-C ends the
  process at once, exit 130, one line on stderr. ``lifecycle_tools``' first line applies the same
  policy before ``cli.main`` runs.
- **Work** (``begin_work()``: ``simulate`` once it builds the stack and opens its log): the handler
  only records the request; the work loops call ``check()`` at safe points and raise
  ``KeyboardInterrupt`` there, on the main path, so the run is abandoned in bounded time. A watchdog
  started by the first Ctrl-C ends the process with exit 130 after ``grace_s`` seconds whatever the
  main thread is doing (blocked in I/O, waiting on a worker); a second Ctrl-C ends it at once.
- **The end** (``finish(rc)``): the command's result is written; the process ends with
  ``os._exit`` after the ``atexit`` hooks, so a Ctrl-C can still land on this handler (exit 130)
  instead of on the interpreter's finalization, which restores SIGINT's default action (killed by
  the signal, no line) while it tears torch down.

A Ctrl-C during the interpreter's own start-up, before ``lifecycle_tools``' first line runs, is the
interpreter's (docs/reliability.md).

Called in-process (``cli.main(argv)``, tests), the start-up phase is the work phase and ``main``
returns: nothing ends the caller's process but the watchdog.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

EXIT_INTERRUPTED = 130
MESSAGE = "kv-lifecycle: interrupted\n"


class Interrupts:
    """The SIGINT policy of one process.

    Args:
        grace_s: seconds between the first Ctrl-C of the work phase and the forced exit.
        message: written to stderr when the process is ended by a Ctrl-C without the main path.
    """

    def __init__(self, grace_s: float = 0.5, message: str = MESSAGE) -> None:
        self.grace_s = grace_s
        self.message = message
        self._event = threading.Event()
        self._previous = None
        self._installed = False
        self._at_once = False
        self._before_exit: list[Callable[[], None]] = []

    def install(self, at_once: bool = False) -> bool:
        """Take over SIGINT (main thread only). Returns whether it did.

        Args:
            at_once: the start-up phase: until ``begin_work``, a Ctrl-C ends the process at once
                (exit 130, the message). Only for a process that is the command.
        """
        if threading.current_thread() is not threading.main_thread():
            return False
        self._event.clear()
        self._at_once = at_once
        self._previous = signal.signal(signal.SIGINT, self._handler)
        self._installed = True
        return True

    def uninstall(self) -> None:
        """Give SIGINT back to the handler that was there before ``install``."""
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False
        self._at_once = False
        self._before_exit.clear()

    def begin_work(self) -> None:
        """End the start-up phase: from now on a Ctrl-C is recorded for ``check()`` (and the watchdog)."""
        self._at_once = False

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
        if self._at_once or self._event.is_set():
            self._exit_now()
        self._event.set()
        timer = threading.Timer(self.grace_s, self._exit_now)
        timer.daemon = True
        timer.start()

    def exit_now(self, quiet: bool = False) -> NoReturn:
        """End the process with exit 130 at once (after the ``before_exit`` hooks and flushing the
        standard streams), without the interpreter's finalization: a Ctrl-C that arrives while
        Python tears down would otherwise kill it by the signal's default action."""
        self._at_once = True     # a Ctrl-C while the hooks run: straight here again
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

    def finish(self, rc: int, run_atexit: bool = True) -> NoReturn:
        """End the command's process with ``rc`` (130 if Ctrl-C was pressed) once its result is
        written: the ``atexit`` hooks (unless ``run_atexit`` is false), the standard streams flushed,
        then ``os._exit``. The handler stays in place throughout and a Ctrl-C exits 130 at once.
        Errors in the hooks are written as Python writes them and do not change ``rc``."""
        if not self._installed:
            self.install()
        self._at_once = True
        if self._event.is_set():
            self._exit_now()
        if run_atexit:
            atexit._run_exitfuncs()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


INTERRUPTS = Interrupts()


def check() -> None:
    """``INTERRUPTS.check()``: a no-op unless a command installed the handler and Ctrl-C came."""
    INTERRUPTS.check()
