"""``lifecycle_tools/testkit/process.py``: a test kit server dies with the process that started it,
even when that process is killed before any teardown runs (SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lifecycle_tools.testkit.redis_server import require_server

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

SLEEPER = """
import subprocess, sys, time
from lifecycle_tools.testkit.process import popen_kwargs
proc = subprocess.Popen(["sleep", "120"], **popen_kwargs())
print(proc.pid, flush=True)
time.sleep(120)
"""

REDIS = """
import sys, time
from lifecycle_tools.testkit.redis_server import RedisServer
server = RedisServer(sys.argv[1]).start()
print(server.proc.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def started_then_killed(script: str, *args: str) -> int:
    """Run ``script`` in a child interpreter, read the pid of the server it started, SIGKILL the
    child (no teardown, no atexit) and return that pid."""
    child = subprocess.Popen([sys.executable, "-c", script, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(child.stdout.readline())
        assert alive(pid)
    finally:
        child.kill()
        child.wait(10)
    return pid


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    try:  # do not leave it behind for the next test
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return False


def test_a_process_started_with_popen_kwargs_dies_when_its_starter_is_killed():
    assert gone_within(started_then_killed(SLEEPER), 5.0)


def test_a_redis_server_of_the_kit_dies_when_the_test_process_that_started_it_is_killed():
    assert gone_within(started_then_killed(REDIS, require_server()), 5.0)
