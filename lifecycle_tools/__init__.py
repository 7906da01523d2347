"""The tools behind the ``kv-lifecycle`` command: the reference scheduler (``simulate``), audit
replay, the timeline picture and diagram generation, plus the test kit (``lifecycle_tools.testkit``).

Kept apart from the library: ``lifecycle``, ``transfer`` and ``hashing`` never import this package.

When this process *is* the command (the ``kv-lifecycle`` console script, or ``python -m
lifecycle_tools``), a Ctrl-C from the first line of this package on ends it at once with exit 130 and
one line on stderr (no traceback): nothing has started that needs stopping. ``cli.main`` takes SIGINT
over with the same policy until the command begins its work (``lifecycle_tools.interrupt``). Imported
by anything else (tests, a notebook), SIGINT is left alone.
"""

import signal as _signal
import sys as _sys


def _is_the_command() -> bool:
    argv0 = _sys.argv[0] if _sys.argv else ""
    if argv0.replace("\\", "/").rsplit("/", 1)[-1] in ("kv-lifecycle", "kv-lifecycle.exe"):
        return True
    orig = list(getattr(_sys, "orig_argv", ()))
    return "-m" in orig[:-1] and orig[orig.index("-m") + 1] == "lifecycle_tools"


def _interrupted_while_starting(signum, frame):  # noqa: ARG001 - signal handler signature
    import os

    try:
        _sys.stderr.write("kv-lifecycle: interrupted\n")
        _sys.stderr.flush()
    finally:
        os._exit(130)


if _is_the_command():
    try:
        _signal.signal(_signal.SIGINT, _interrupted_while_starting)
    except ValueError:  # not the main thread: nothing to take over
        pass
