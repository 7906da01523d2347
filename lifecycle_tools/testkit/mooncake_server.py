"""A real Mooncake master (and standalone segment holders) for tests and benchmarks.

Both binaries ship in the ``mooncake-transfer-engine(-non-cuda)`` wheel (the ``mooncake`` extra):
``mooncake_master`` (metadata: which object lives where; no object bytes) and ``mooncake_client``
(a process contributing a memory segment, so objects outlive the process that wrote them). Each
is started directly (its PID is the server's), bound to 127.0.0.1 on free ports, and stopped by
PID. Without the wheel (or ``libibverbs1``) tests skip with the reason, except under ``CI=true``
where they fail.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from lifecycle_tools.testkit.missing import skip_or_fail
from lifecycle_tools.testkit.process import popen_kwargs
from lifecycle_tools.testkit.redis_server import free_port, stop_process

HINT = ("Mooncake is not installed: pip install -e '.[mooncake]' "
        "(mooncake-transfer-engine-non-cuda) and apt-get install libibverbs1")


def mooncake_dir() -> Path | None:
    """The installed ``mooncake`` package directory, or None."""
    spec = importlib.util.find_spec("mooncake")
    return None if spec is None or spec.origin is None else Path(spec.origin).parent


def missing_reason() -> str | None:
    """Why the Mooncake client or binaries cannot be used here, or None."""
    root = mooncake_dir()
    if root is None or not (root / "mooncake_master").exists():
        return HINT
    try:
        import mooncake.store  # noqa: F401 - loads the C++ client and its shared libraries
    except ImportError as err:
        return f"{HINT}: {err}"
    return None


def require_mooncake() -> Path:
    """The package directory; skip the test when Mooncake is missing (fail under ``CI=true``)."""
    reason = missing_reason()
    if reason is not None:
        skip_or_fail(reason)
    return mooncake_dir()


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _env() -> dict:
    return {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR"}


class _Process:
    """A child process stopped by PID (SIGTERM, then SIGKILL)."""

    proc: subprocess.Popen | None = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash), and reap it."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; reaped."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process(proc, timeout)

    def _wait_port(self, port: int, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not _listening(port):
            if self.proc is None or self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(f"{what} exited at start on port {port}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{what} did not listen on port {port} within {timeout}s")
            time.sleep(0.02)


class MooncakeMaster(_Process):
    """One ``mooncake_master`` on 127.0.0.1 (ports kept across ``restart``; state is not).

    Args:
        client_ttl_s: seconds without a heartbeat before the master drops a client's segment.
    """

    def __init__(self, root: Path, client_ttl_s: int = 10) -> None:
        self.binary = root / "mooncake_master"
        self.port, self.metrics_port = free_port(), free_port()
        self.client_ttl_s = client_ttl_s

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def spec(self, **options) -> str:
        """``mooncake://127.0.0.1:PORT?...`` (small segment by default)."""
        options.setdefault("global_segment_size", "64MiB")
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"mooncake://{self.address}" + (f"?{query}" if query else "")

    def start(self, timeout: float = 10.0) -> "MooncakeMaster":
        if self.alive():
            return self
        cmd = [str(self.binary), f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
               "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}", "--rpc_thread_num=2",
               f"--client_ttl={self.client_ttl_s}"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(),
                                     **popen_kwargs())
        self._wait_port(self.port, "mooncake_master", timeout)
        return self

    def restart(self) -> "MooncakeMaster":
        self.stop()
        return self.start()


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets process ``pid`` holds open (Linux /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (Linux /proc)."""
    inodes = socket_inodes(pid)
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in (line.split() for line in f.readlines()[1:]):
                if row[3] == "0A" and row[9] in inodes:  # LISTEN
                    ports.add(int(row[1].rsplit(":", 1)[1], 16))
    return ports


class SegmentHolder(_Process):
    """A standalone ``mooncake_client`` contributing ``segment`` bytes to a master's store (bytes:
    the binary reads "64MiB" as 0)."""

    def __init__(self, root: Path, master: MooncakeMaster, segment: int = 64 << 20) -> None:
        self.binary, self.master, self.segment = root / "mooncake_client", master, segment
        self.port = free_port()

    def start(self, timeout: float = 15.0) -> "SegmentHolder":
        cmd = [str(self.binary), "--host=127.0.0.1", f"--port={self.port}",
               f"--master_server_address={self.master.address}", "--metadata_server=P2PHANDSHAKE",
               f"--global_segment_size={self.segment}", "--protocol=tcp", "--local_buffer_size=0"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(),
                                     **popen_kwargs())
        self._wait_port(self.port, "mooncake_client", timeout)
        return self

    def holds(self, endpoint: str) -> bool:
        """Whether ``endpoint`` (a replica's ``transport_endpoint``, ``127.0.0.1:PORT``) is this
        holder's segment (one of the ports it listens on)."""
        host, _, port = endpoint.rpartition(":")
        return self.alive() and host == "127.0.0.1" and int(port) in listening_ports(self.proc.pid)


def start_master(root: Path, attempts: int = 3, **kwargs) -> MooncakeMaster:
    """A started master on free ports (retries when a port was taken in between)."""
    err: Exception | None = None
    for _ in range(attempts):
        try:
            return MooncakeMaster(root, **kwargs).start()
        except RuntimeError as e:
            err = e
    raise RuntimeError(f"could not start mooncake_master: {err}")


# --- fixtures (import them into a test module) ---------------------------------------------------

@pytest.fixture(scope="session")
def mooncake_session_master():
    """One master for the whole session (None when Mooncake is missing; tests then skip/fail)."""
    if missing_reason() is not None:
        yield None
        return
    master = start_master(mooncake_dir())
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture
def mooncake_master(mooncake_session_master):
    """The session master (restarted if a test stopped it). Tests use fresh random keys."""
    require_mooncake()
    if not mooncake_session_master.alive():
        mooncake_session_master.start()
    return mooncake_session_master


@pytest.fixture
def make_mooncake():
    """Factories of dedicated masters and segment holders (for tests that kill them); all stopped after."""
    root = require_mooncake()
    procs: list[_Process] = []

    def master(**kwargs) -> MooncakeMaster:
        m = start_master(root, **kwargs)
        procs.append(m)
        return m

    def holder(of: MooncakeMaster, segment: int = 64 << 20) -> SegmentHolder:
        h = SegmentHolder(root, of, segment).start()
        procs.append(h)
        return h

    master.holder = holder
    yield master
    for p in reversed(procs):
        p.stop(timeout=1.0)  # a client whose master is gone spends ~20 s unmounting at exit
