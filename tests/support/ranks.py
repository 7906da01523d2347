"""TP ranks for tests: one child interpreter per rank (``run_ranks``), or a one-rank gloo group in
process (the ``world`` fixture)."""

from __future__ import annotations

import socket
import subprocess

import pytest
import torch.distributed as dist


@pytest.fixture
def world():
    """A one-rank gloo process group on a free loopback port (an in-process TP manager's group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


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
