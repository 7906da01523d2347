"""A real 3-master Redis Cluster on loopback for tests and benchmarks.

Three ``redis-server --cluster-enabled yes`` processes (``RedisServer`` of this kit: own free port,
own directory, no persistence), joined as ``redis-cli --cluster create ... --cluster-replicas 0``
does (an even slot range and a distinct config epoch per node, then ``CLUSTER MEET``) but without
its fixed one-second waits, waited for until every node knows every node and sees all 16384
slots served, stopped by PID.
Missing binaries skip the test (fail under ``CI=true``), as for the single server.
"""

from __future__ import annotations

import shutil
import time

import pytest
import redis

from lifecycle_tools.testkit.missing import skip_or_fail
from lifecycle_tools.testkit.redis_server import RedisServer, free_port, require_server, server_binary

CLUSTER_ARGS = ("--cluster-enabled", "yes", "--cluster-node-timeout", "2000", "--cluster-config-file",
                "nodes.conf", "--cluster-require-full-coverage", "no")
SLOTS = 16384


def cli_binary() -> str | None:
    return shutil.which("redis-cli") or shutil.which("valkey-cli")


class ClusterNode(RedisServer):
    """One cluster-enabled server (its ``nodes.conf`` lives in its own directory; its cluster bus
    on a second free port, not the default port + 10000)."""

    def __init__(self, binary: str) -> None:
        super().__init__(binary)
        self.bus_port = free_port()
        self.extra_args = CLUSTER_ARGS + ("--cluster-port", str(self.bus_port))

    def command(self, *args):
        """One command to this node (a short-lived connection)."""
        with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5) as client:
            return client.execute_command(*args)


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
        try:
            n = len(self.nodes)
            for i, node in enumerate(self.nodes):
                node.command("CLUSTER", "ADDSLOTSRANGE", i * SLOTS // n, (i + 1) * SLOTS // n - 1)
                node.command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            for node in self.nodes[1:]:
                self.nodes[0].command("CLUSTER", "MEET", "127.0.0.1", node.port, node.bus_port)
        except redis.RedisError as err:
            self.close()
            raise RuntimeError(f"could not join a cluster of {addrs}: {err}") from None
        deadline = time.monotonic() + timeout
        while not all(self._ok(node) for node in self.nodes):
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"cluster on {addrs} not ok within {timeout}s")
            time.sleep(0.02)
        return self

    def _ok(self, node: ClusterNode) -> bool:
        info = node.command("CLUSTER", "INFO")
        info = info.decode() if isinstance(info, bytes) else str(info)
        fields = dict(line.split(":", 1) for line in info.split() if ":" in line)
        return (fields.get("cluster_state") == "ok" and fields.get("cluster_slots_ok") == str(SLOTS)
                and fields.get("cluster_known_nodes") == str(len(self.nodes)))

    def close(self) -> None:
        for node in self.nodes:
            node.close()


def require_cluster() -> tuple[str, str]:
    """``(redis-server, redis-cli)``; skip when missing (fail under ``CI=true``)."""
    binary = require_server()
    cli = cli_binary()
    if cli is None:
        msg = "redis-cli not found on PATH (apt-get install redis-tools / redis-server)"
        skip_or_fail(msg)
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
