"""Redis Cluster ``ASK`` redirections, as the Redis Cluster specification defines them.

While a hash slot migrates, its source node (``MIGRATING``) answers a command for a key it no
longer holds — or, for a write, a key it does not have — with ``-ASK slot host:port``: *this one
command* must be sent to the named node (``IMPORTING``), preceded by ``ASKING`` on the same
connection, and the slot map must **not** be changed (the slot still belongs to the source until
the migration ends; later commands for the slot go to the source first). A ``MOVED`` reply, by
contrast, means the slot has moved for good: the map is refreshed (``cluster``).

``ASK`` is rare (a resharding window), so the resent commands take the plain path: the packed
``SET`` commands as they are, each behind ``ASKING`` in one write; ``GET``/``GETEX`` through a
pipeline of the node's client, the values then handed to the caller's ``on_reply`` exactly as the
zero-copy reader (``reader``) hands them.
"""

from __future__ import annotations

from collections.abc import Sequence

from redis.exceptions import AskError
from redis.exceptions import ConnectionError as RedisConnectionError

from transfer.storage.redis.wire import send_and_read

ASKING = b"*1\r\n$6\r\nASKING\r\n"


def ask_node(client, err: AskError):
    """The node an ``ASK`` reply names (``client`` a redis-py ``RedisCluster``); the slot map is
    refreshed only to learn a node the client has never seen.

    Raises:
        redis ConnectionError: the named node is not part of the cluster as the client knows it.
    """
    node = client.get_node(host=err.host, port=err.port)
    if node is None:
        client.nodes_manager.initialize()
        node = client.get_node(host=err.host, port=err.port)
    if node is None:
        raise RedisConnectionError(f"ASK names {err.host}:{err.port}, not a node of the cluster")
    return node


def send_asking(node_client, commands: Sequence[memoryview | bytes]) -> list:
    """Send each packed command behind ``ASKING`` on one connection of ``node_client``.

    Returns:
        Per command its reply (or the server's error; an ``ASKING`` refused is that error).
    Raises:
        redis ConnectionError / TimeoutError, OSError: the connection failed.
    """
    payload = b"".join(ASKING + bytes(c) for c in commands)
    replies = send_and_read(node_client, memoryview(payload), 2 * len(commands))
    return [asked if isinstance(asked, Exception) else reply for asked, reply in zip(replies[::2], replies[1::2])]


def get_asking(node_client, names: Sequence[bytes], ttl_ms: int | None) -> list:
    """``GET`` (``GETEX ... PX ttl_ms`` when set) each name behind ``ASKING``, pipelined on one
    connection of ``node_client``.

    Returns:
        Per name: the value (bytes), None (no such key) or the server's error.
    Raises:
        redis ConnectionError / TimeoutError, OSError: the connection failed.
    """
    pipe = node_client.pipeline(transaction=False)
    try:
        for name in names:
            pipe.execute_command("ASKING")
            if ttl_ms is None:
                pipe.execute_command("GET", name)
            else:
                pipe.execute_command("GETEX", name, "PX", ttl_ms)
        out = pipe.execute(raise_on_error=False)
    finally:
        pipe.reset()
    return [asked if isinstance(asked, Exception) else value for asked, value in zip(out[::2], out[1::2])]


def deliver(j: int, value, dest: memoryview, head_nbytes: int, on_reply) -> object:
    """Hand ``value`` (a ``get_asking`` result) to ``on_reply`` as ``reader`` does: the
    value's length and its first ``head_nbytes`` bytes, the rest copied into ``dest`` only when
    it fits exactly. Returns what ``reader`` returns for it (length, None or the error)."""
    if value is None or isinstance(value, Exception):
        on_reply(j, value, memoryview(b""))
        return value
    view = memoryview(value)
    length = view.nbytes
    if length == head_nbytes + dest.nbytes:
        dest[:] = view[head_nbytes:]
    on_reply(j, length, view[:min(length, head_nbytes)])
    return length
