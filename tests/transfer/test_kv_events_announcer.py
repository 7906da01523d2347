"""Storage tiers and the host offloader announce their pages: a real stack, a real ZMQ subscriber,
the file tier's directory as the truth."""

from __future__ import annotations

import os
import time

import torch

import hashing
from tests.support.decode_driver import PS, Scheduler
from tests.support.kv_subscriber import Subscriber, events, int64_id, pages_held
from transfer import build_stack
from transfer.kv_events import CPU_PINNED, DISK, EXTERNAL, KVEventPublisher, medium_of
from transfer.kv_events.announcer import TierAnnouncer
from transfer.storage import FileStorage, MemoryStorage


class Recorder:
    """Collects what an announcer publishes, in order (the publisher's producer interface)."""

    def __init__(self):
        self.log = []

    def stored(self, medium, hashes, tokens, block_size, parent=None):
        self.log.append(("stored", medium, list(hashes), list(tokens), block_size, parent))

    def removed(self, medium, hashes):
        self.log.append(("removed", medium, list(hashes)))


def _pages_on_disk(directory) -> set[str]:
    return {n[:64] for n in os.listdir(directory) if n.endswith(".bin") and not n.startswith(".")}


def _page(i: int) -> torch.Tensor:
    return torch.full((64,), i, dtype=torch.uint8)


def test_a_tier_announces_writes_with_tokens_and_parent_and_every_eviction_in_order(tmp_path):
    store = FileStorage(str(tmp_path), page_nbytes=64, capacity_pages=3)
    rec = Recorder()
    store.events = TierAnnouncer(rec, medium_of(store), page_size=2)
    tokens = list(range(12))
    keys = hashing.page_hashes(tokens, 2)
    with store.events.writing(keys[:4], tokens[:8], None):
        assert all(store.batch_set(keys[:4], [_page(i) for i in range(4)]))
    with store.events.writing(keys[4:], tokens[8:], keys[3]):
        assert all(store.batch_set(keys[4:], [_page(i) for i in range(4, 6)]))
    assert store.batch_set(keys[5:], [_page(5)]) == [True]     # already there: not announced again
    assert store.delete(keys[5])
    stored = [e for e in rec.log if e[0] == "stored"]
    assert [e[2] for e in stored] == [[k] for k in keys]
    assert [e[5] for e in stored] == [None] + keys[:5]          # each page's parent is the one before
    assert [e[3] for e in stored] == [tokens[2 * i:2 * i + 2] for i in range(6)]
    assert all(e[1] == DISK and e[4] == 2 for e in stored)
    held = set()
    for e in rec.log:
        (held.update if e[0] == "stored" else held.difference_update)(e[2])
    assert held == _pages_on_disk(tmp_path) and len(held) == 2


def test_a_page_written_without_a_declaration_is_announced_without_tokens():
    store = MemoryStorage()
    rec = Recorder()
    store.events = TierAnnouncer(rec, medium_of(store), page_size=4)
    key = hashing.page_hashes([1, 2, 3, 4], 4)[0]
    store.batch_set([key], [_page(1)])
    assert rec.log == [("stored", EXTERNAL, [key], [], 4, None)]


def test_a_decode_run_is_announced_host_then_tier_and_the_subscriber_ends_with_the_directory(tmp_path):
    publisher = KVEventPublisher("tcp://127.0.0.1:0", flush_interval_s=0.01)
    sub = Subscriber(publisher.endpoint)
    stack = build_stack(2, 2, 8, torch.float32, PS, 256, 64, 8, 64, storage=f"file:{tmp_path}",
                        storage_capacity_bytes=None, kv_events=publisher)
    try:
        while not sub.sub.poll(20):          # until the subscription is live
            publisher.cleared()
        sub.pump()
        sched = Scheduler(stack)
        reqs = [sched.admit(r, list(range(100 * r, 100 * r + 6)), 7) for r in range(3)]
        for req in reqs:
            sched.backup_prompt(req)         # not declared: announced without tokens
        for t in range(9):
            sched.step(1000 + t)
            sub.pump()
        for req in list(sched.running):
            sched.finish(req)
        sched.settle()
        sched.mgr.shutdown()
        stack.close()
        publisher.close()
        sub.receive_until_end()
        disk = {int64_id(h) for h in _pages_on_disk(tmp_path)}
        assert disk and pages_held(sub.batches, DISK) == disk
        assert pages_held(sub.batches, CPU_PINNED) == set()   # every host page was freed again
        host = [e for e in events(sub.batches) if e[0] == "BlockStored" and e[6] == CPU_PINNED]
        decode_pages = {h for req in reqs for h, _ in sched.kv_pages(req)}
        assert {i for e in host for i in e[1]} == {int64_id(h) for h in decode_pages}
        # the first decode chunk of request 0 links to its prompt's last page, with its tokens
        req = reqs[0]
        seq = req.origin_input_ids + req.output_ids[:-1]
        chain = hashing.page_hashes(seq[: len(seq) // PS * PS], PS)
        first = next(e for e in host if e[1] == [int64_id(chain[1])])
        assert first[2] == int64_id(chain[0]) and first[3] == seq[PS:2 * PS] and first[4] == PS
    finally:
        publisher.close()
        sub.close()


def test_a_redis_tier_announces_writes_evictions_and_deletes_under_its_key_prefix(redis_url):
    import redis

    from transfer.storage.redis import RedisStorage

    store = RedisStorage(redis_url, "_m_0_1", 64, capacity_pages=2, key_prefix="team:")
    rec = Recorder()
    store.events = TierAnnouncer(rec, medium_of(store), page_size=2)
    keys = hashing.page_hashes(list(range(8)), 2)
    try:
        assert all(store.batch_set(keys, [_page(i) for i in range(4)]))
        assert store.batch_set(keys[3:], [_page(3)]) == [True]       # already there: not announced
        assert store.delete(keys[3])
        k0, k1, k2, k3 = keys
        assert [(e[0], e[2]) for e in rec.log] == [
            ("stored", [k0]), ("stored", [k1]), ("stored", [k2]), ("removed", [k0]),   # LRU bound 2
            ("stored", [k3]), ("removed", [k1]), ("removed", [k3])]                    # ... then delete
        assert all(e[1] == EXTERNAL for e in rec.log)
        held = set()
        for e in rec.log:
            (held.update if e[0] == "stored" else held.difference_update)(e[2])
        client = redis.Redis.from_url(redis_url)
        on_server = {k.decode()[len("team:"):len("team:") + 64] for k in client.keys("team:*_m_0_1")}
        client.close()
        assert held == on_server == {keys[2]}
        assert [e[2] for e in rec.log if e[0] == "stored"] == [[k] for k in keys]
    finally:
        client = redis.Redis.from_url(redis_url)
        for k in client.keys("team:*"):
            client.delete(k)
        client.close()
        store.close()


def test_a_chunk_links_to_the_page_before_it_and_a_namespace_seed_is_no_parent():
    from lifecycle import DecodeOffloadManager
    from lifecycle_tools.testkit.doubles import Req
    from transfer.kv_events.announcer import HostAnnouncer

    seed = hashing.namespace_seed("adapter-x")
    stack = build_stack(1, 1, 8, torch.float32, PS, 256, 64, 4, 64, storage="memory")
    rec = Recorder()
    stack.offloader.events = HostAnnouncer(rec, PS)
    mgr = DecodeOffloadManager.from_stack(stack, namespace_seed=seed)
    try:
        row = stack.req_to_token_pool.alloc()
        req = Req("r", [1, 2], row, outputs=tuple(range(10, 20)))   # prompt shorter than a page
        slots = stack.allocator.alloc(12)
        stack.req_to_token_pool.req_to_token[row, :12] = slots.to(torch.int32)
        req.kv.kv_allocated_len = 12
        req.finish()
        if not mgr.offload_kv_cache(req):
            mgr.finalize_release_on_finish(req)
        deadline = time.monotonic() + 10
        while not mgr.idle() and time.monotonic() < deadline:
            mgr.check_offload_progress()
            time.sleep(0.001)
        stored = [e for e in rec.log if e[0] == "stored"]
        chain = hashing.page_hashes([1, 2, *range(10, 16)], PS, seed)
        assert [e[2] for e in stored] == [chain]                     # one chunk of two pages
        assert stored[0][5] is None and stored[0][3] == [1, 2, *range(10, 16)]
    finally:
        mgr.shutdown()
        stack.close()


def test_a_store_of_an_unknown_kind_is_announced_as_external():
    class SomeOtherTier:
        pass

    assert medium_of(SomeOtherTier()) == EXTERNAL
