"""Redis Cluster page storage: ``RedisStorage``'s pages, seals and semantics over a sharded cluster.

``redis+cluster://HOST:PORT`` (or ``rediss+cluster://``, ``valkey+cluster://``) names any node;
redis-py's ``RedisCluster`` client discovers the others and the slot map (hiredis parses replies).
Everything about a page — key, value (seal + bytes), ``SET NX``, verification, TTL, repair — is
``RedisStorage``'s; only how commands reach the servers differs:

* a batch's packed ``SET`` commands (one buffer, see ``wire``) are split by the key's hash
  slot into one pipeline per primary owning those slots, each sent with one write and read back
  in order; a ``MOVED`` reply (the slot moved for good) points the slot map's entry for that slot
  at the node the reply names and resends those commands once; an ``ASK`` reply (the slot is migrating) resends that command behind ``ASKING`` to the
  node named, without touching the slot map (``ask``, per the Redis Cluster spec);
* a batch's ``GET`` commands are split the same way, one pipeline per primary, each read straight
  into the page tensors (``reader``); ``MOVED`` and ``ASK`` are handled as for writes;
* other batches (existence checks, deletes) go through redis-py's cluster pipeline, which groups
  commands by node the same way and follows ``MOVED``/``ASK`` itself; multi-key ``DELETE`` is sent
  key by key (keys of a batch live in different slots).

A node that cannot be reached makes the whole call ``StorageUnavailable`` and counts against the
one circuit breaker of the store (the cluster is one tier). Keys are spread by their hash slot:
``{hash}{suffix}`` has no ``{...}`` hash tag, so a deployment's pages spread over all primaries.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from urllib.parse import urlsplit

from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import AskError, ClusterError, MovedError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

from transfer.errors import StorageConfigError, StorageUnavailable
from transfer.storage.redis.store import RedisStorage, check_url, redact
from transfer.storage.redis.ask import ask_node, deliver, get_asking, send_asking
from transfer.storage.redis.wire import send_and_read

CLUSTER_SCHEMES = {"redis+cluster://": "redis://", "rediss+cluster://": "rediss://",
                   "valkey+cluster://": "redis://", "valkeys+cluster://": "rediss://"}


def is_cluster_spec(spec: object) -> bool:
    """Whether ``spec`` names a Redis (Valkey) Cluster."""
    return isinstance(spec, str) and spec.startswith(tuple(CLUSTER_SCHEMES))


def node_url(spec: str) -> str:
    """``redis+cluster://h:p`` -> ``redis://h:p`` (checked; a cluster has only database 0).

    Raises:
        StorageConfigError: not a cluster URL, a bad port, or a database other than 0.
    """
    for scheme, plain in CLUSTER_SCHEMES.items():
        if spec.startswith(scheme):
            url = plain + spec[len(scheme):]
            check_url(url)
            if urlsplit(url).path not in ("", "/", "/0"):
                raise StorageConfigError(f"a Redis Cluster has only database 0: {redact(spec)!r}")
            return url
    raise StorageConfigError(f"expected redis+cluster://HOST:PORT, got {redact(str(spec))!r}")


def split_commands(payload: memoryview, n: int) -> list[tuple[int, int, bytes]]:
    """``(start, end, key)`` of each of the ``n`` RESP commands packed in ``payload``."""
    out, pos = [], 0
    for _ in range(n):
        start = pos
        end_line = bytes(payload[pos:pos + 24]).index(b"\r\n")
        argc = int(bytes(payload[pos + 1:pos + end_line]))
        pos += end_line + 2
        key = b""
        for arg in range(argc):
            end_line = bytes(payload[pos:pos + 24]).index(b"\r\n")
            size = int(bytes(payload[pos + 1:pos + end_line]))
            pos += end_line + 2
            if arg == 1:
                key = bytes(payload[pos:pos + size])
            pos += size + 2
        out.append((start, pos, key))
    return out


class _PerKeyDeletes:
    """A cluster pipeline whose ``delete(*names)`` is one command per key (keys span slots)."""

    def __init__(self, pipe) -> None:
        self._pipe = pipe

    def delete(self, *names):
        for name in names:
            self._pipe.delete(name)

    def __getattr__(self, name):
        return getattr(self._pipe, name)


class RedisClusterStorage(RedisStorage):
    """Pages in a Redis (or Valkey) Cluster. Arguments as ``RedisStorage`` (``url`` is a
    ``redis+cluster://`` URL of any node; ``client`` is built here).

    Raises:
        StorageConfigError: a bad URL. StorageUnavailable: no node answers (one line, bounded by
        ``connect_timeout_s``).
    """

    def __init__(self, url: str, suffix: str = "", page_nbytes: int | None = None, ttl_s: float | None = None,
                 *, connect_timeout_s: float = 0.5, socket_timeout_s: float = 5.0, **kwargs) -> None:
        plain = node_url(url)
        try:
            client = RedisCluster.from_url(
                plain, socket_connect_timeout=connect_timeout_s, socket_timeout=socket_timeout_s,
                retry=Retry(NoBackoff(), 1), require_full_coverage=False)
        except (RedisClusterException, RedisError, OSError) as err:
            raise StorageUnavailable(f"redis cluster at {redact(url)} is unreachable: "
                                     f"{' '.join(str(err).split()) or type(err).__name__}") from err
        super().__init__(url, suffix, page_nbytes, ttl_s, connect_timeout_s=connect_timeout_s,
                         socket_timeout_s=socket_timeout_s, client=client, **kwargs)

    def _run(self, build, what: str) -> list:
        return super()._run(lambda pipe: build(_PerKeyDeletes(pipe)), what)

    def _execute(self, pipe) -> list:
        try:
            return pipe.execute(raise_on_error=False)
        except (ClusterError, RedisClusterException) as err:  # cluster down / slot not served
            raise RedisConnectionError(str(err)) from err

    def _by_node(self, names: Sequence[bytes], pending: list[int]) -> dict:
        """``pending`` indices grouped by the primary the slot map names for ``names[i]``."""
        by_node = defaultdict(list)
        try:
            for i in pending:
                by_node[self._client.get_node_from_key(names[i])].append(i)
        except (ClusterError, RedisClusterException) as err:
            raise RedisConnectionError(str(err)) from err
        return by_node

    def _write_wire(self, payload: memoryview, n: int) -> list:
        """The packed ``SET`` commands, one pipeline per primary owning their slots. ``ASK``: the
        command again behind ``ASKING`` to the node named, slot map unchanged (``ask``);
        ``MOVED``: the slot's entry pointed at the node named (``_follow_moved``) and the command
        resent once."""
        commands = split_commands(payload, n)
        keys = [key for _, _, key in commands]
        replies: list = [None] * n
        pending = list(range(n))
        for attempt in range(2):
            moved, asked = [], defaultdict(list)
            for node, idxs in self._by_node(keys, pending).items():
                part = b"".join(payload[commands[i][0]:commands[i][1]] for i in idxs)
                for i, reply in zip(idxs, send_and_read(self._client.get_redis_connection(node), memoryview(part),
                                                        len(idxs))):
                    replies[i] = reply
                    _sort(reply, i, moved, asked)
            for idxs in asked.values():
                target = ask_node(self._client, replies[idxs[0]])
                resent = send_asking(self._client.get_redis_connection(target),
                                     [payload[commands[i][0]:commands[i][1]] for i in idxs])
                for i, reply in zip(idxs, resent):
                    replies[i] = reply
                    if isinstance(reply, MovedError):  # the migration ended meanwhile
                        moved.append(i)
            if not moved or attempt:
                break
            _follow_moved(self._client, [replies[i] for i in moved])
            pending = moved
        return replies

    def _read_wire(self, names: list[bytes], dests: list, on_reply) -> list:
        """The ``GET`` commands, one pipeline per primary owning their slots, read into ``dests``.
        ``ASK``: asked again behind ``ASKING`` at the node named, slot map unchanged
        (``ask``); ``MOVED``: the slot's entry pointed at the node named (``_follow_moved``)
        and asked again once."""
        replies: list = [None] * len(names)
        pending = list(range(len(names)))
        for attempt in range(2):
            moved, asked = [], defaultdict(list)

            def forward(k, reply, head, idxs=None):
                i = idxs[k]
                replies[i] = reply
                if isinstance(reply, MovedError) and not attempt:
                    moved.append(i)  # asked again below, not reported
                elif isinstance(reply, AskError) and not isinstance(reply, MovedError):
                    asked[reply.node_addr].append(i)  # asked at the named node below
                else:
                    on_reply(i, reply, head)

            for node, idxs in self._by_node(names, pending).items():
                self._reader.get_into(self._client.get_redis_connection(node), [names[i] for i in idxs],
                                      self.ttl_ms, [dests[i] for i in idxs],
                                      lambda k, r, h, idxs=idxs: forward(k, r, h, idxs))
            for idxs in asked.values():
                target = ask_node(self._client, replies[idxs[0]])
                values = get_asking(self._client.get_redis_connection(target), [names[i] for i in idxs], self.ttl_ms)
                for i, value in zip(idxs, values):
                    if isinstance(value, MovedError) and not attempt:
                        replies[i] = value
                        moved.append(i)
                    else:
                        replies[i] = deliver(i, value, dests[i], self._reader.head_nbytes, on_reply)
            if not moved:
                break
            _follow_moved(self._client, [replies[i] for i in moved])
            pending = moved
        return replies


def _follow_moved(client, replies: Sequence[MovedError]) -> None:
    """Point each ``MOVED`` reply's slot at the node it names (redis-py's ``move_slot``, which adds
    a node the client has not seen). Not a whole-map refresh: that asks one node for its
    ``CLUSTER SLOTS``, and a node not yet told that a migration ended still names the source, so
    the resent command met ``MOVED`` again and, resent only once, missed. The node answering
    ``MOVED`` is the one that knows where the slot went."""
    for reply in replies:
        client.nodes_manager.move_slot(reply)


def _sort(reply, i: int, moved: list[int], asked: dict) -> None:
    """File command ``i`` under ``moved`` (a ``MOVED`` reply) or ``asked`` by node (``ASK``)."""
    if isinstance(reply, MovedError):
        moved.append(i)
    elif isinstance(reply, AskError):
        asked[reply.node_addr].append(i)
