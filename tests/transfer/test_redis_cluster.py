"""The Redis tier on a real 3-master Redis Cluster (started by the test kit): pages spread over
every primary by hash slot, the same sealed values and semantics as one server, a whole stack
reusing a prefix bit-exact, a node killed (typed, bounded) and the URL checks."""

from __future__ import annotations

import hashlib
import itertools
import time

import pytest
import redis
import torch
from redis.cluster import RedisCluster as ClusterClient

from lifecycle_tools.testkit.redis_cluster import redis_cluster  # noqa: F401 (fixture)
from tests.support.decode_driver import DIM, HEADS, LAYERS, MAX_LEN, PS, ROWS, Scheduler
from tests.support.transfer_helpers import drain, never_accepting_port
from transfer import build_stack, open_storage
from transfer.errors import StorageConfigError, StorageUnavailable
from transfer.storage.integrity import SEAL_NBYTES, PageFormat
from transfer.storage.redis.cluster import RedisClusterStorage, node_url, split_commands

NB = 256
FMT = PageFormat.of("raw", torch.uint8, (NB,))
_n = itertools.count()


def hashes(n: int) -> list[str]:
    return [hashlib.sha256(f"cluster-{time.time_ns()}-{next(_n)}".encode()).hexdigest() for _ in range(n)]


def page(i: int) -> torch.Tensor:
    return torch.full((NB,), i % 256, dtype=torch.uint8)


def raw_client(cluster) -> ClusterClient:
    return ClusterClient.from_url(node_url(cluster.url))


def test_pages_spread_over_all_primaries_and_read_back(redis_cluster):
    s = open_storage(redis_cluster.url, "_m_0_1", NB, page_format=FMT)
    try:
        assert isinstance(s, RedisClusterStorage)
        keys = hashes(48)
        assert s.batch_set(keys, [page(i) for i in range(48)]) == [True] * 48
        c = raw_client(redis_cluster)
        per_node = [c.get_redis_connection(n).dbsize() for n in c.get_primaries()]
        assert len(per_node) == 3 and all(k > 0 for k in per_node)  # every primary holds some pages
        value = c.get(keys[5] + "_m_0_1")
        assert len(value) == SEAL_NBYTES + NB and value[SEAL_NBYTES:] == bytes([5]) * NB
        out = [torch.empty(NB, dtype=torch.uint8) for _ in keys]
        assert s.batch_get(keys, out) == [True] * 48 and all(torch.equal(o, page(i)) for i, o in enumerate(out))
        assert s.batch_exists(keys + hashes(1)) == 48
        assert s.batch_set(keys[:3], [page(9)] * 3) == [True] * 3 and s.stats().skipped == 3  # first write wins
        # a corrupt value on one node is a miss and is deleted there
        c.setrange(keys[7] + "_m_0_1", SEAL_NBYTES + 1, b"\xff")
        assert s.batch_get(keys[7:8], out[:1]) == [False] and s.stats().corrupt == 1
        assert c.exists(keys[7] + "_m_0_1") == 0
        assert s.delete(keys[8]) is True and s.delete(keys[8]) is False
        c.close()
    finally:
        s.close()


def test_an_existence_check_counts_only_our_pages_even_when_a_key_holds_another_type(redis_cluster):
    s = open_storage(redis_cluster.url, "_m_0_1", NB, page_format=FMT)
    c = raw_client(redis_cluster)
    ours, listed = hashes(2)
    assert s.batch_set([ours], [page(1)]) == [True]
    c.rpush(listed + "_m_0_1", b"not a page")  # its check answers WRONGTYPE: not ours, not a failure
    try:
        assert s.batch_exists([ours, listed]) == 1 and s.stats().unavailable == 0
    finally:
        c.delete(listed + "_m_0_1")
        c.close()
        s.close()


def test_split_commands_finds_every_key():
    payload = b"".join(redis.connection.PythonRespSerializer(
        buffer_cutoff=1 << 30, encode=lambda x: x if isinstance(x, bytes) else str(x).encode()).pack(
        "SET", f"key{i}".encode(), b"v" * (i * 37), "NX")[0] for i in range(5))
    cmds = split_commands(memoryview(payload), 5)
    assert [k for _, _, k in cmds] == [f"key{i}".encode() for i in range(5)]
    assert cmds[-1][1] == len(payload) and all(a[1] == b[0] for a, b in zip(cmds, cmds[1:]))


def test_a_stack_reuses_a_prefix_through_the_cluster(redis_cluster):
    a = build_stack(LAYERS, HEADS, DIM, torch.bfloat16, PS, 256, 128, ROWS, MAX_LEN,
                    storage=redis_cluster.url, model_name="org/tiny")
    sch = Scheduler(a)
    try:
        req = sch.admit(31, list(range(900, 910)), 3)
        sch.backup_prompt(req)
        for t in range(13):
            sch.step(40 + t)
        sch.finish(req)
        sch.settle()
        tokens = req.origin_input_ids + req.output_ids
        assert a.offloader.stats().storage_failed == 0
    finally:
        sch.mgr.shutdown(force=True)
        a.close()
    b = build_stack(LAYERS, HEADS, DIM, torch.bfloat16, PS, 256, 128, ROWS, MAX_LEN,
                    storage=redis_cluster.url, model_name="org/tiny")
    try:
        n_pages = (len(tokens) - 1) // PS
        assert len(b.prefix_loader.lookup(tokens + [1, 2])) == n_pages >= 3
        assert b.prefix_loader.start(1, tokens + [1, 2]) == n_pages
        (done,) = drain(b.prefix_loader.finished, 1)
        assert done.pages == n_pages and done.error is None
        from lifecycle_tools.testkit.kv_pattern import synthetic_kv
        want = synthetic_kv(b.kv_pool, 31, torch.arange(n_pages * PS))
        assert torch.equal(b.kv_pool.read(done.device_indices).view(torch.uint8), want.view(torch.uint8))
        b.allocator.free(done.device_indices)
    finally:
        b.close()


def test_urls_and_an_unreachable_cluster():
    assert node_url("redis+cluster://127.0.0.1:7000") == "redis://127.0.0.1:7000"
    assert node_url("valkeys+cluster://h:7000/0") == "rediss://h:7000/0"
    for bad in ("redis+cluster://h:7000/3", "redis+cluster://h:port", "redis://h:1"):
        with pytest.raises(StorageConfigError):
            node_url(bad)
    from lifecycle_tools.testkit.redis_server import free_port

    t = time.monotonic()
    with pytest.raises(StorageUnavailable, match="unreachable"):
        open_storage(f"redis+cluster://127.0.0.1:{free_port()}", "_m_0_1", NB)
    assert time.monotonic() - t < 3.0


def test_cluster_url_errors_say_what_is_wrong_and_the_unreachable_error_says_why():
    assert node_url("redis+cluster://127.0.0.1:7000/") == "redis://127.0.0.1:7000/"  # database 0 too
    with pytest.raises(StorageConfigError, match=r"^a Redis Cluster has only database 0: 'redis\+cluster://h:7000/3'$"):
        node_url("redis+cluster://h:7000/3")
    with pytest.raises(StorageConfigError, match=r"^expected redis\+cluster://HOST:PORT, got 'redis://h:1'$"):
        node_url("redis://h:1")
    from lifecycle_tools.testkit.redis_server import free_port

    port = free_port()
    with pytest.raises(StorageUnavailable, match=rf"^redis cluster at redis\+cluster://127\.0\.0\.1:{port} is unreachable: "
                                                 rf".*connecting to 127\.0\.0\.1:{port}\. Connection refused"):
        open_storage(f"redis+cluster://127.0.0.1:{port}", "_m_0_1", NB)


def test_a_node_that_never_accepts_is_a_connect_timeout_not_a_wait_for_the_kernel():
    """As for one server: ``connect_timeout_s`` alone bounds reaching the cluster's first node (a
    listener with a full accept queue never answers the attempt), whatever ``socket_timeout_s``."""
    with never_accepting_port() as port, \
            pytest.raises(StorageUnavailable, match=r"is unreachable: .*Timeout connecting to server$"):
        RedisClusterStorage(f"redis+cluster://127.0.0.1:{port}", "_m_0_1", NB, connect_timeout_s=0.2,
                            socket_timeout_s=600)


def test_a_cluster_store_without_a_suffix_keeps_pages_under_their_hash(redis_cluster):
    s = RedisClusterStorage(redis_cluster.url, page_nbytes=NB, page_format=FMT)
    (k,) = hashes(1)
    assert s.batch_set([k], [page(5)]) == [True]
    admin = ClusterClient.from_url(node_url(redis_cluster.url))
    assert admin.exists(k) == 1  # the name is the page hash alone
    admin.close()
    s.close()


def test_another_deployments_pages_are_never_replaced_evicted_or_deleted_on_any_primary(redis_cluster):
    """The ownership rule over the cluster: pages of another format under our names (another dtype
    here; another host layout alike), spread over every primary, are already there for a write
    (True, ``foreign_kept``), never replaced; evictions and deletes (a compare-and-delete routed
    to the key's primary) leave them; our own pages are evicted and deleted as before."""
    fp16 = PageFormat.of("raw", torch.float16, (NB // 2,))
    theirs = open_storage(redis_cluster.url, "_m_0_1", NB, page_format=fp16)
    ours = open_storage(redis_cluster.url, "_m_0_1", NB, page_format=FMT, capacity_bytes=2 * NB)
    c = raw_client(redis_cluster)
    try:
        keys = hashes(12)
        assert theirs.batch_set(keys[:6], [page(100 + i) for i in range(6)]) == [True] * 6
        assert ours.batch_set(keys[:8], [page(i) for i in range(8)]) == [True] * 8
        assert ours.stats().foreign_kept == 6 and ours.stats().stored == 2
        out = [torch.empty(NB, dtype=torch.uint8) for _ in range(6)]
        assert theirs.batch_get(keys[:6], out) == [True] * 6
        assert all(torch.equal(o, page(100 + i)) for i, o in enumerate(out))
        # ours held keys[6:8]; keys[6] vanishes and theirs writes it; our next writes evict it
        assert c.delete(keys[6] + "_m_0_1") == 1
        assert theirs.batch_set([keys[6]], [page(106)]) == [True]
        assert ours.batch_set(keys[8:10], [page(8), page(9)]) == [True, True]
        assert ours.stats().evictions == 2 and c.exists(keys[7] + "_m_0_1") == 0  # ours: evicted
        assert ours.delete(keys[0]) is False and ours.delete(keys[8]) is True
        assert ours.stats().foreign_kept == 8
        assert theirs.batch_get([keys[0], keys[6]], out[:2]) == [True, True] and torch.equal(out[1], page(106))
    finally:
        c.close()
        theirs.close()
        ours.close()


def test_a_dead_primary_is_a_typed_bounded_error(redis_cluster):
    """Last in the module: it kills a node of the shared cluster."""
    s = open_storage(redis_cluster.url, "_m_0_1", NB, page_format=FMT)
    try:
        keys = hashes(24)
        assert s.batch_set(keys, [page(i) for i in range(24)]) == [True] * 24
        redis_cluster.nodes[1].stop()
        t = time.monotonic()
        with pytest.raises(StorageUnavailable):
            s.batch_set(hashes(24), [page(i) for i in range(24)])
        with pytest.raises(StorageUnavailable):  # the breaker is open now: refused at once
            s.batch_get(keys, [torch.empty(NB, dtype=torch.uint8) for _ in keys])
        with pytest.raises(StorageUnavailable, match=r"\(delete\): circuit open"):  # the refused call named
            s.delete(keys[0])
        assert time.monotonic() - t < 8.0 and s.stats().unavailable >= 2
    finally:
        s.close()
