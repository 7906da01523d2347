"""What every ``kv-lifecycle`` command shares: the program name, the one-line error (exit 2) and
the output-path check. Its own module so the command modules (``cli``, ``simulate_cmd``) import it
and not each other."""

from __future__ import annotations

import os
import sys

PROG = "kv-lifecycle"


def fail(message: str) -> int:
    """Write the one-line error and return exit code 2."""
    sys.stderr.write(f"{PROG}: error: {message}\n")
    return 2


def out_path_problem(path: str, flag: str) -> str | None:
    """Why ``path`` cannot be written as an output file (None: it can)."""
    if os.path.isdir(path):
        return f"{flag} {path!r} is a directory"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        return f"{flag} {path!r}: directory {parent!r} is missing or not writable"
    return None
