"""Run one child interpreter per TP rank and wait for all of them (tests only)."""

from __future__ import annotations

import subprocess

import pytest


def run_ranks(commands: list[list[str]], *, cwd, env, timeout_s: float, hint: str = "") -> list[str]:
    """Start every command at once, wait for each within ``timeout_s``, kill stragglers.

    Returns:
        Each rank's combined stdout/stderr.
    Raises:
        pytest fails when a rank times out or exits non-zero (with the tail of its log).
    """
    procs = [subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for cmd in commands]
    logs = []
    try:
        for p in procs:
            try:
                logs.append(p.communicate(timeout=timeout_s)[0].decode(errors="replace"))
            except subprocess.TimeoutExpired:
                pytest.fail(f"a TP rank did not finish within {timeout_s}s{hint}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-3000:]}"
    return logs
