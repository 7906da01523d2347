"""The tools behind the ``kv-lifecycle`` command: the reference scheduler (``simulate``), audit
replay, the timeline picture and diagram generation, plus the test kit (``lifecycle_tools.testkit``).

Kept apart from the library: ``lifecycle``, ``transfer`` and ``hashing`` never import this package.

When this process *is* the command (the ``kv-lifecycle`` console script, or ``python -m
lifecycle_tools``), a Ctrl-C from the first line of this package on is recorded, not raised: the
command's own handler (``lifecycle_tools.interrupt``) takes it over in ``cli.main`` and exits 130
(no traceback). Imported by anything else (tests, a notebook), SIGINT is left alone.
"""

import signal as _signal
import sys as _sys


def _is_the_command() -> bool:
    argv0 = _sys.argv[0] if _sys.argv else ""
    if argv0.replace("\\", "/").rsplit("/", 1)[-1] in ("kv-lifecycle", "kv-lifecycle.exe"):
        return True
    orig = list(getattr(_sys, "orig_argv", ()))
    return "-m" in orig[:-1] and orig[orig.index("-m") + 1] == "lifecycle_tools"


EARLY_SIGINT: list = []
"""SIGINTs received before ``cli.main`` installed the command's handler (this process is the command)."""

if _is_the_command():
    try:
        _signal.signal(_signal.SIGINT, lambda signum, frame: EARLY_SIGINT.append(signum))
    except ValueError:  # not the main thread: nothing to take over
        pass
