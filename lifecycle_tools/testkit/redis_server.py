"""A real ``redis-server`` for tests and benchmarks: own port, own dir, no persistence, a subprocess.

Nothing here talks to a system Redis service: each server gets a free loopback port, its own
working directory and its whole configuration on the command line (``--daemonize no``, no RDB, no
AOF). Start-up and shutdown are bounded. When the binary is missing, tests skip with a reason,
except under ``CI=true`` where a missing server fails the test.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

from lifecycle_tools.testkit.missing import skip_or_fail
from lifecycle_tools.testkit.process import popen_kwargs

BINARY_ENV = "REDIS_SERVER"  # optional path to the server binary (e.g. valkey-server)


def server_binary() -> str | None:
    """Path of the server binary, or None."""
    return os.environ.get(BINARY_ENV) or shutil.which("redis-server") or shutil.which("valkey-server")


def require_server() -> str:
    """The binary's path; skip the test when missing (fail under ``CI=true``)."""
    path = server_binary()
    if path is None:
        msg = ("redis-server not found on PATH (apt-get install redis-server, or set "
               f"{BINARY_ENV}=/path/to/redis-server or valkey-server)")
        skip_or_fail(msg)
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.settimeout(0.2)
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM a running child, SIGKILL it after ``timeout``, and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1.

    Args:
        binary: the server binary. port: None picks a free port (kept across ``restart``).
        workdir: its ``--dir`` (None: a fresh temporary directory, removed by ``stop``).
    """

    extra_args: tuple[str, ...] = ()  # more server options (a subclass: cluster mode)

    def __init__(self, binary: str, port: int | None = None, workdir: str | None = None) -> None:
        self.binary = binary
        self.port = port or free_port()
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="kvl-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        """Start the process and wait (bounded) until it answers PING."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        cmd = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--daemonize", "no",
            "--save", "", "--appendonly", "no", "--dir", self.workdir, "--protected-mode", "yes",
            "--loglevel", "warning", "--logfile", "", "--databases", "4", *self.extra_args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     cwd=self.workdir, **popen_kwargs())
        deadline = time.monotonic() + timeout
        while not _answers_ping(self.port):
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode(errors="replace") if self.proc.stdout else ""
                self.proc = None
                raise RuntimeError(f"redis-server exited at start on port {self.port}: {out[-500:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING on port {self.port} within {timeout}s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate (then kill) the process and wait for it; keeps the port for ``restart``."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        stop_process(proc, timeout)
        if proc.stdout is not None:
            proc.stdout.close()

    def restart(self, timeout: float = 10.0) -> "RedisServer":
        self.stop()
        return self.start(timeout)

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def start_server(binary: str, attempts: int = 3) -> RedisServer:
    """A started server on a free port (retries when the port was taken in between)."""
    err: Exception | None = None
    for _ in range(attempts):
        server = RedisServer(binary)
        try:
            return server.start()
        except RuntimeError as e:
            server.close()
            err = e
    raise RuntimeError(f"could not start redis-server: {err}")


# --- fixtures (imported by tests/conftest.py) -------------------------------------------------

@pytest.fixture(scope="session")
def redis_session_server():
    """One server for the whole session (cheap tests share it; ``redis_url`` flushes it)."""
    path = server_binary()
    if path is None:
        yield None
        return
    server = start_server(path)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_url(redis_session_server):
    """URL of an empty database on the session server (restarted if a test stopped it)."""
    require_server()
    server = redis_session_server
    if server.proc is None or server.proc.poll() is not None:
        server.start()
    import redis

    client = redis.Redis.from_url(server.url, socket_timeout=5)
    client.flushall()
    client.close()
    return server.url


@pytest.fixture
def make_redis_server():
    """Factory of dedicated servers (for tests that stop and restart one); all stopped after."""
    path = require_server()
    servers: list[RedisServer] = []

    def make() -> RedisServer:
        server = start_server(path)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()
