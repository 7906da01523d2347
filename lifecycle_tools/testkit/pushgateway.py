"""A real Prometheus Pushgateway for tests: own loopback port, no persistence, a subprocess.

Debian's ``prometheus-pushgateway`` package (``.ci/run`` installs it) ships the binary as
``prometheus-pushgateway``; upstream's is ``pushgateway``. When neither is found, tests skip with a
reason, except under ``CI=true`` where a missing binary fails the test (as for ``redis-server``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request

from lifecycle_tools.testkit.missing import skip_or_fail
from lifecycle_tools.testkit.process import popen_kwargs
from lifecycle_tools.testkit.redis_server import free_port, stop_process

BINARY_ENV = "PUSHGATEWAY"  # optional path to the binary


def require_binary() -> str:
    """The binary's path; skip the test when missing (fail under ``CI=true``)."""
    path = os.environ.get(BINARY_ENV) or shutil.which("prometheus-pushgateway") or shutil.which("pushgateway")
    if path is None:
        msg = ("prometheus-pushgateway not found on PATH (apt-get install prometheus-pushgateway, or set "
               f"{BINARY_ENV}=/path/to/pushgateway)")
        skip_or_fail(msg)
    return path


class Pushgateway:
    """One Pushgateway process on 127.0.0.1 (``url``: its address, ``metrics_text()``: what it serves)."""

    def __init__(self, binary: str) -> None:
        self.binary, self.port = binary, free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "Pushgateway":
        """Start it and wait (bounded) until ``/-/ready`` answers 200."""
        cmd = [self.binary, f"--web.listen-address=127.0.0.1:{self.port}", "--persistence.file=",
               "--log.level=warn"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen_kwargs())
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode(errors="replace") if self.proc.stdout else ""
                raise RuntimeError(f"pushgateway exited at start on port {self.port}: {out[-500:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pushgateway not ready on port {self.port} within {timeout}s")
            time.sleep(0.05)

    def metrics_text(self) -> str:
        """The exposition text it serves on ``/metrics`` (every pushed group, and its own metrics)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self, timeout: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process(proc, timeout)
            if proc.stdout is not None:
                proc.stdout.close()
