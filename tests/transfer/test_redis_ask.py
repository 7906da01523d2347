"""``transfer/storage/redis/ask.py``: Redis Cluster ``ASK`` redirections on a real 3-master cluster
(started by the test kit) with hash slots really migrating (``CLUSTER SETSLOT ... MIGRATING`` /
``IMPORTING``, ``MIGRATE``) while pages are written and read.

Written from docs/storage.md ("a ``MOVED``/``ASK`` reply ... resends those commands") and the Redis
Cluster specification: ``ASK`` means this one command goes, behind ``ASKING``, to the node named,
and the slot map is left as it is; ``MOVED`` (the migration finished) refreshes the map.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time

import torch
from redis.crc import key_slot

from lifecycle_tools.testkit.redis_cluster import redis_cluster  # noqa: F401 (fixture)
from transfer import open_storage
from transfer.storage.integrity import PageFormat

NB = 256
FMT = PageFormat.of("raw", torch.uint8, (NB,))
SUFFIX = "_m_0_1"
_n = itertools.count()


def page(i: int) -> torch.Tensor:
    return torch.full((NB,), i % 251, dtype=torch.uint8)


def served_slots(node) -> set[int]:
    """The slots ``node`` serves now, as it says itself (``CLUSTER NODES``, its ``myself`` line):
    the tests of this module share one cluster, and each ends by moving slots to another node."""
    me = next(line.split() for line in node.command("CLUSTER", "NODES").decode().splitlines()
              if "myself" in line.split()[2])
    ranges = [part.split("-") for part in me[8:] if not part.startswith("[")]  # "[slot->-id]": migrating
    return {slot for r in ranges for slot in range(int(r[0]), int(r[-1]) + 1)}


def keys_of_node(node, n: int) -> list[str]:
    """``n`` fresh page hashes whose names fall in slots ``node`` serves now."""
    slots = served_slots(node)
    out = []
    while len(out) < n:
        h = hashlib.sha256(f"ask-{time.time_ns()}-{next(_n)}".encode()).hexdigest()
        if key_slot((h + SUFFIX).encode()) in slots:
            out.append(h)
    return out


def slot_of(h: str) -> int:
    return key_slot((h + SUFFIX).encode())


class Migration:
    """Slots moving from ``src`` to ``dst`` as ``redis-cli --cluster reshard`` moves them."""

    def __init__(self, cluster, src, dst, slots: set[int]) -> None:
        self.cluster, self.src, self.dst, self.slots = cluster, src, dst, sorted(slots)
        self.src_id = src.command("CLUSTER", "MYID").decode()
        self.dst_id = dst.command("CLUSTER", "MYID").decode()

    def begin(self) -> None:
        for slot in self.slots:
            self.dst.command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.src_id)
            self.src.command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.dst_id)

    def move(self, names: list[str]) -> None:
        """``MIGRATE`` these keys to the destination (one not on the source answers NOKEY)."""
        for name in names:
            self.src.command("MIGRATE", "127.0.0.1", self.dst.port, "", 0, 5000, "KEYS", name)

    def move_all(self) -> None:
        for slot in self.slots:
            while True:
                names = self.src.command("CLUSTER", "GETKEYSINSLOT", slot, 100)
                if not names:
                    break
                self.src.command("MIGRATE", "127.0.0.1", self.dst.port, "", 0, 5000, "KEYS", *names)

    def end(self) -> None:
        """The slots now belong to the destination, told to every node (destination first)."""
        nodes = [self.dst, self.src] + [n for n in self.cluster.nodes if n not in (self.src, self.dst)]
        for slot in self.slots:
            for node in nodes:
                node.command("CLUSTER", "SETSLOT", slot, "NODE", self.dst_id)


def test_pages_are_written_and_read_through_ask_while_slots_migrate(redis_cluster):
    src, dst = redis_cluster.nodes[0], redis_cluster.nodes[1]
    keys = keys_of_node(src, 12)
    old, new = keys[:6], keys[6:]
    s = open_storage(redis_cluster.url, SUFFIX, NB, page_format=FMT)
    migration = Migration(redis_cluster, src, dst, {slot_of(h) for h in old + new})
    try:
        assert s.batch_set(old, [page(i) for i in range(6)]) == [True] * 6  # all on the source
        migration.begin()
        migration.move([h + SUFFIX for h in old[:3]])  # half of them now live on the destination
        out = [torch.zeros(NB, dtype=torch.uint8) for _ in range(6)]
        assert s.batch_get(old, out) == [True] * 6  # moved ones answered through ASK
        assert all(torch.equal(o, page(i)) for i, o in enumerate(out))
        assert s.batch_exists(old) == 6
        # new pages in a migrating slot: the source does not have them -> ASK -> the destination
        assert s.batch_set(new, [page(10 + i) for i in range(6)]) == [True] * 6
        assert sum(dst.command("CLUSTER", "COUNTKEYSINSLOT", slot) for slot in migration.slots) == 9
        assert s.batch_get(new, out) == [True] * 6
        assert all(torch.equal(o, page(10 + i)) for i, o in enumerate(out))
        assert s.batch_set(old + new, [page(99)] * 12) == [True] * 12 and s.stats().skipped == 12  # first writer wins
        # ASK changed no slot map: the client still names the source for every migrating slot
        assert {s._client.get_node_from_key((h + SUFFIX).encode()).port for h in old + new} == {src.port}
        assert s.stats().errors == 0 and s.stats().corrupt == 0
    finally:
        migration.move_all()
        migration.end()
    out = [torch.zeros(NB, dtype=torch.uint8) for _ in range(12)]
    assert s.batch_get(old + new, out) == [True] * 12  # MOVED: the map refreshed, every page found
    assert all(torch.equal(o, page(i if i < 6 else 4 + i)) for i, o in enumerate(out))
    assert {s._client.get_node_from_key((h + SUFFIX).encode()).port for h in old + new} == {dst.port}
    s.close()


def test_writers_and_readers_never_miss_while_keys_migrate_one_by_one(redis_cluster):
    """Writes and reads run on a thread while the main thread migrates the slots' keys one by one
    and then ends the migration: every write is stored and every page written is read back."""
    src, dst = redis_cluster.nodes[2], redis_cluster.nodes[0]
    keys = keys_of_node(src, 24)
    first, later = keys[:8], keys[8:]
    s = open_storage(redis_cluster.url, SUFFIX, NB, page_format=FMT)
    migration = Migration(redis_cluster, src, dst, {slot_of(h) for h in keys})
    failures: list = []
    stop = threading.Event()
    assert s.batch_set(first, [page(i) for i in range(8)]) == [True] * 8

    def run() -> None:
        written = list(first)
        todo = list(later)
        while not stop.is_set() or todo:
            if todo:
                batch, todo = todo[:2], todo[2:]
                got = s.batch_set(batch, [page(keys.index(h)) for h in batch])
                if got != [True] * len(batch):
                    failures.append(("set", batch, got))
                written += batch
            out = [torch.zeros(NB, dtype=torch.uint8) for _ in written]
            got = s.batch_get(written, out)
            bad = [h for h, ok, o in zip(written, got, out) if not ok or not torch.equal(o, page(keys.index(h)))]
            if bad:
                failures.append(("get", bad))
            if s.batch_exists(written) != len(written):
                failures.append(("exists", len(written)))

    worker = threading.Thread(target=run, daemon=True)
    try:
        migration.begin()
        worker.start()
        for h in first:
            migration.move([h + SUFFIX])
        migration.move_all()
        migration.end()
    finally:
        stop.set()
        worker.join(60)
    assert not worker.is_alive()
    assert failures == []
    assert s.stats().errors == 0
    s.close()


def test_reads_through_ask_refresh_the_ttl_miss_absent_keys_and_leave_the_slot_map_alone(redis_cluster):
    src, dst = redis_cluster.nodes[0], redis_cluster.nodes[1]
    keys = keys_of_node(src, 4)
    s = open_storage(redis_cluster.url + "?ttl_s=600", SUFFIX, NB, page_format=FMT)
    migration = Migration(redis_cluster, src, dst, {slot_of(h) for h in keys})
    refreshes = []
    real_initialize = s._client.nodes_manager.initialize
    try:
        assert s.batch_set(keys[:3], [page(i) for i in range(3)]) == [True] * 3
        for h in keys[:3]:
            src.command("PEXPIRE", h + SUFFIX, 5000)  # MIGRATE keeps it
        migration.begin()
        migration.move([h + SUFFIX for h in keys[:3]])  # on the destination: reads are ASKed there
        s._client.nodes_manager.initialize = lambda *a, **kw: (refreshes.append(1), real_initialize(*a, **kw))[1]
        out = [torch.zeros(NB, dtype=torch.uint8) for _ in range(4)]
        assert s.batch_get(keys, out) == [True] * 3 + [False]  # keys[3]: on neither node (nil via ASK)
        assert all(torch.equal(out[i], page(i)) for i in range(3)) and not out[3].any()
        assert refreshes == []  # ASK names a known node: no slot map refresh
        assert s.stats().errors == 0 and s.stats().corrupt == 0
    finally:
        s._client.nodes_manager.initialize = real_initialize
        migration.move_all()
        migration.end()
    assert all(dst.command("PTTL", h + SUFFIX) > 50_000 for h in keys[:3])  # GETEX ... PX through ASK
    s.close()


def test_moved_is_followed_to_the_node_it_names_even_when_a_map_refresh_would_be_stale(redis_cluster):
    """The end of a migration seen from a client whose slot map still names the source, and whose
    map refresh would ask a node not yet told (simulated: the refresh changes nothing, as a
    ``CLUSTER SLOTS`` from such a node does). The source answers ``MOVED dst``; the command must go
    to ``dst`` — resent once — and find every page, store every new one."""
    src, dst = redis_cluster.nodes[1], redis_cluster.nodes[2]
    keys = keys_of_node(src, 8)
    old, new = keys[:4], keys[4:]
    s = open_storage(redis_cluster.url, SUFFIX, NB, page_format=FMT)
    migration = Migration(redis_cluster, src, dst, {slot_of(h) for h in keys})
    stale_refreshes = []
    real_initialize = s._client.nodes_manager.initialize
    try:
        assert s.batch_set(old, [page(i) for i in range(4)]) == [True] * 4
        migration.begin()
        migration.move_all()
        migration.end()
        assert {s._client.get_node_from_key((h + SUFFIX).encode()).port for h in keys} == {src.port}
        s._client.nodes_manager.initialize = lambda *a, **kw: stale_refreshes.append(1)
        out = [torch.zeros(NB, dtype=torch.uint8) for _ in range(4)]
        assert s.batch_get(old, out) == [True] * 4
        assert all(torch.equal(o, page(i)) for i, o in enumerate(out))
        assert {s._client.get_node_from_key((h + SUFFIX).encode()).port for h in old} == {dst.port}
        assert s.batch_set(new, [page(4 + i) for i in range(4)]) == [True] * 4  # MOVED on the write path
        assert sum(dst.command("CLUSTER", "COUNTKEYSINSLOT", slot) for slot in migration.slots) == 8
        assert s.batch_get(keys, [torch.zeros(NB, dtype=torch.uint8) for _ in keys]) == [True] * 8
        assert s.stats().errors == 0 and s.stats().corrupt == 0
    finally:
        s._client.nodes_manager.initialize = real_initialize
    s.close()


# --- the pieces the resent commands go through ---------------------------------------------------

def test_an_asking_refused_is_the_error_of_the_command_behind_it(redis_url):
    """``send_asking``: a node that refuses ``ASKING`` (here a server without cluster support) has
    not taken the command as an ``ASK`` resend, so that command's result is the refusal."""
    import redis
    from transfer.storage.redis.ask import send_asking
    client = redis.Redis.from_url(redis_url)
    name = f"ask-refused-{next(_n)}".encode()
    packed = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$1\r\nv\r\n" % (len(name), name)
    (reply,) = send_asking(client, [packed])
    assert isinstance(reply, redis.ResponseError) and "cluster support disabled" in str(reply)
    client.close()


def test_values_read_through_ask_are_handed_over_as_the_wire_reader_hands_them():
    """``deliver``: nil and errors with an empty head; a value as its length and its head, the
    rest copied into the page only when it fits exactly (as ``redis_reader`` does)."""
    from redis import ResponseError
    from transfer.storage.redis.ask import deliver
    seen = []
    on_reply = lambda j, reply, head: seen.append((j, reply, bytes(head)))  # noqa: E731
    dest = memoryview(bytearray(b"...."))
    err = ResponseError("WRONGTYPE not a string")
    assert deliver(3, None, dest, 4, on_reply) is None
    assert deliver(4, err, dest, 4, on_reply) is err
    assert deliver(5, b"HEADlonger", dest, 4, on_reply) == 10 and bytes(dest) == b"...."  # does not fit
    assert deliver(6, b"HEADbody", dest, 4, on_reply) == 8 and bytes(dest) == b"body"
    assert seen == [(3, None, b""), (4, err, b""), (5, 10, b"HEAD"), (6, 8, b"HEAD")]


def test_an_ask_naming_a_node_outside_the_cluster_is_a_connection_error(redis_cluster):
    import pytest
    from redis.cluster import RedisCluster as ClusterClient
    from redis.exceptions import AskError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from transfer.storage.redis.ask import ask_node
    from transfer.storage.redis.cluster import node_url
    client = ClusterClient.from_url(node_url(redis_cluster.url))
    with pytest.raises(RedisConnectionError, match=r"^ASK names 127\.0\.0\.1:1, not a node of the cluster$"):
        ask_node(client, AskError("3999 127.0.0.1:1"))
    client.close()
