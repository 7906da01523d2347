"""A real 3-master Redis Cluster on loopback for tests and benchmarks.

Three ``redis-server --cluster-enabled yes`` processes (``RedisServer`` of this kit: own free port,
own directory, no persistence), joined by ``redis-cli --cluster create ... --cluster-replicas 0
--cluster-yes``, waited for until every node reports ``cluster_state:ok``, stopped by PID.
Missing binaries skip the test (fail under ``CI=true``), as for the single server.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from lifecycle_tools.testkit.redis_server import RedisServer, free_port, require_server, server_binary

CLUSTER_ARGS = ("--cluster-enabled", "yes", "--cluster-node-timeout", "2000", "--cluster-config-file",
                "nodes.conf", "--cluster-require-full-coverage", "no")


def cli_binary() -> str | None:
    return shutil.which("redis-cli") or shutil.which("valkey-cli")


class ClusterNode(RedisServer):
    """One cluster-enabled server (its ``nodes.conf`` lives in its own directory; its cluster bus
    on a second free port, not the default port + 10000)."""

    def __init__(self, binary: str) -> None:
        super().__init__(binary)
        self.extra_args = CLUSTER_ARGS + ("--cluster-port", str(free_port()))


class RedisCluster:
    """``masters`` cluster-enabled servers on 127.0.0.1, slots spread evenly, no replicas."""

    def __init__(self, binary: str, cli: str, masters: int = 3) -> None:
        self.cli = cli
        self.nodes = [ClusterNode(binary) for _ in range(masters)]

    @property
    def url(self) -> str:
        """``redis+cluster://`` URL of the first node (the client discovers the others)."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout: float = 20.0) -> "RedisCluster":
        for node in self.nodes:
            node.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        out = subprocess.run([self.cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                             capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            self.close()
            raise RuntimeError(f"redis-cli --cluster create failed: {(out.stdout + out.stderr)[-500:]}")
        deadline = time.monotonic() + timeout
        while not all(self._ok(n.port) for n in self.nodes):
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"cluster on {addrs} not ok within {timeout}s")
            time.sleep(0.05)
        return self

    def _ok(self, port: int) -> bool:
        out = subprocess.run([self.cli, "-p", str(port), "cluster", "info"], capture_output=True, text=True,
                             timeout=5)
        return "cluster_state:ok" in out.stdout

    def close(self) -> None:
        for node in self.nodes:
            node.close()


def require_cluster() -> tuple[str, str]:
    """``(redis-server, redis-cli)``; skip when missing (fail under ``CI=true``)."""
    binary = require_server()
    cli = cli_binary()
    if cli is None:
        msg = "redis-cli not found on PATH (apt-get install redis-tools / redis-server)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {msg}", pytrace=False)
        pytest.skip(msg)
    return binary, cli


@pytest.fixture(scope="module")
def redis_cluster():
    """A started 3-master cluster shared by a test module (tests use distinct keys)."""
    if server_binary() is None or cli_binary() is None:
        require_cluster()
    cluster = RedisCluster(*require_cluster()).start()
    try:
        yield cluster
    finally:
        cluster.close()
