"""Storage tiers and the host offloader announce their pages: a real stack, a real ZMQ subscriber,
the file tier's directory as the truth; every page's ``BlockStored`` after its parent's (a child
announced while its parent is declared waits for it), in a unit, in a simulate run whose first
prefill backup is held until a decode chunk continuing it was announced, and in a whole
``kv-lifecycle simulate --kv-events`` run read by SGLang 0.5.19's own subscriber."""

from __future__ import annotations

from tests.support.transfer_helpers import polls
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import hashing
from tests.support.decode_driver import PS, Scheduler
from tests.support.kv_subscriber import Subscriber, events, int64_id, pages_held
from transfer import build_stack
from tests.data.sglang_0_5_19_kv_events import BlockStored, KVEventsSubscriber
from tests.data.sglang_0_5_19_kv_events import logger as sglang_logger
from transfer.kv_events import CPU_PINNED, DISK, EXTERNAL, ChainOrder, KVEventPublisher, medium_of
from transfer.kv_events.announcer import HostAnnouncer, TierAnnouncer
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
        sub.receive_until(publisher.stats().batches)
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

    from transfer.storage.redis.store import RedisStorage

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



# -- chain order: a page's BlockStored after its parent's (issue 35.6) -------------------------------
def late_children(batches) -> list:
    """The ``BlockStored`` events (arrays) whose parent was not announced stored before them."""
    seen, late = set(), []
    for ev in events(batches):
        if ev[0] == "BlockStored":
            if ev[2] is not None and ev[2] not in seen:
                late.append(ev)
            seen.update(ev[1])
    return late


def _chain(n: int, ps: int = 2):
    tokens = list(range(n * ps))
    return tokens, hashing.page_hashes(tokens, ps)


def test_a_child_announced_while_its_parent_is_declared_waits_for_the_parent(tmp_path):
    """A prefill backup queued (declared) before a decode chunk continuing it is announced: the
    chunk's host pages, and their removal, are published after the backup's pages, in order."""
    rec = Recorder()
    store = FileStorage(str(tmp_path), page_nbytes=64)
    store.events = TierAnnouncer(rec, DISK, page_size=2)
    host = HostAnnouncer(rec, 2)
    tokens, keys = _chain(4)
    backup = store.events.writing(keys[:2], tokens[:4], None)     # queued: declared now
    host.stored(keys[2:], tokens[4:], keys[1])                    # the decode chunk after it
    host.removed(keys[2:])                                        # its host pages freed
    assert rec.log == [] and ChainOrder.of(rec).held == 2
    with backup:                                                   # the backup runs
        assert all(store.batch_set(keys[:2], [_page(0), _page(1)]))
    assert [(e[0], e[1], e[2]) for e in rec.log] == [
        ("stored", DISK, [keys[0]]), ("stored", DISK, [keys[1]]),
        ("stored", CPU_PINNED, keys[2:]), ("removed", CPU_PINNED, keys[2:])]
    assert rec.log[2][3] == tokens[4:] and rec.log[2][5] == keys[1]
    assert ChainOrder.of(rec).held == 0


def test_grandchildren_wait_too_and_an_undeclared_parent_holds_nothing(tmp_path):
    rec = Recorder()
    store = FileStorage(str(tmp_path), page_nbytes=64)
    store.events = TierAnnouncer(rec, DISK, page_size=2)
    host = HostAnnouncer(rec, 2)
    tokens, keys = _chain(6)
    host.stored(keys[1:2], tokens[2:4], keys[0])                  # parent never declared: at once
    backup = store.events.writing(keys[2:4], tokens[4:8], keys[1])
    host.stored(keys[4:5], tokens[8:10], keys[3])                 # waits for keys[3]
    host.stored(keys[5:6], tokens[10:12], keys[4])                # waits for its parent, which waits
    assert [e[2] for e in rec.log] == [keys[1:2]]
    with backup:
        store.batch_set(keys[2:4], [_page(2), _page(3)])
    assert [e[2] for e in rec.log] == [keys[1:2], keys[2:3], keys[3:4], keys[4:5], keys[5:6]]


def test_a_declaration_that_ends_without_writing_releases_what_waits():
    """The backup found its pages already there (or failed): the child goes when the declaration
    ends, not later."""
    rec = Recorder()
    tier = TierAnnouncer(rec, EXTERNAL, page_size=2)
    host = HostAnnouncer(rec, 2)
    tokens, keys = _chain(3)
    backup = tier.writing(keys[:2], tokens[:4], None)
    host.stored(keys[2:], tokens[4:], keys[1])
    assert rec.log == []
    backup.end()
    backup.end()                                                   # idempotent
    assert [(e[1], e[2]) for e in rec.log] == [(CPU_PINNED, keys[2:])]


def test_two_declarations_of_a_page_hold_its_children_until_the_page_is_announced_once():
    rec = Recorder()
    tier = TierAnnouncer(rec, EXTERNAL, page_size=2)
    host = HostAnnouncer(rec, 2)
    tokens, keys = _chain(2)
    first, second = tier.writing(keys[:1], tokens[:2], None), tier.writing(keys[:1], tokens[:2], None)
    host.stored(keys[1:], tokens[2:], keys[0])
    first.end()                                                    # the other one still writes it
    assert rec.log == []
    tier.stored(keys[:1])                                          # written (inside ``second``)
    second.end()
    assert [(e[1], e[2], e[3], e[5]) for e in rec.log] == [(EXTERNAL, keys[:1], tokens[:2], None),
                                                           (CPU_PINNED, keys[1:], tokens[2:], keys[0])]


def test_what_is_held_when_the_publisher_closes_is_sent_first_and_counted(tmp_path):
    """A declaration that never ends (a backup stuck in a hung tier) cannot keep events from the
    subscriber: ``close`` publishes what is held, in arrival order, in its last batch."""
    publisher = KVEventPublisher("tcp://127.0.0.1:0", flush_interval_s=0.01)
    sub = Subscriber(publisher.endpoint)
    try:
        while not sub.sub.poll(20):
            publisher.cleared()
        sub.pump()
        tier = TierAnnouncer(publisher, DISK, page_size=2)
        host = HostAnnouncer(publisher, 2)
        tokens, keys = _chain(3)
        tier.writing(keys[:2], tokens[:4], None)                   # never ends
        host.stored(keys[2:], tokens[4:], keys[1])
        host.removed(keys[2:])
        gate = ChainOrder.of(publisher)
        assert gate.held == 2 and publisher.stats().stored == 0
        publisher.close()
        assert (gate.held, gate.unordered) == (0, 2)
        s = publisher.stats()
        assert (s.stored, s.removed, s.queued, s.dropped) == (1, 1, 0, 0)
        sub.receive_until(s.batches)
        got = [e for e in events(sub.batches) if e[0] != "AllBlocksCleared"]
        assert [(e[0], e[1]) for e in got] == [("BlockStored", [int64_id(keys[2])]),
                                              ("BlockRemoved", [int64_id(keys[2])])]
        host.stored(keys[2:], tokens[4:], keys[1])                 # after close: dropped, counted
        assert publisher.stats().dropped == 1
    finally:
        publisher.close()
        sub.close()


def test_an_announcer_refuses_a_medium_sglang_does_not_have():
    with pytest.raises(ValueError, match="medium 'SSD' is not one of"):
        TierAnnouncer(Recorder(), "SSD", 4)


SIM = dict(requests=8, turns=2, prompt_len="8-40", output_len="24-40", layers=1, heads=1, head_dim=8, page_size=4,
           stride=8, device_tokens=2048, host_tokens=1024, rows=6, retract_frac=0.0, abort_frac=0.0, seed=5,
           verify="all")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_decode_chunk_announced_before_its_prefill_backup_ran_is_published_after_it(tmp_path):
    """simulate's prefill backup is declared when it is queued: its first backup is held until a
    decode chunk continuing that prompt was announced on the host, and the subscriber still sees
    the prompt's pages before the chunk (every BlockStored after its parent)."""
    from lifecycle_tools.simulate import SimConfig, build, prepare, run
    from lifecycle_tools.simulate.telemetry import Telemetry

    from transfer.copy_engine import CpuCopyEngine

    ev, replay = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    cfg = SimConfig(**SIM, storage=f"file:{tmp_path / 'store'}", kv_events=ev, kv_events_replay=replay)
    stack, mgr = build(cfg, prepare(cfg))
    # one copy thread: copies land in issue order (with two, a chunk can land a progress call before
    # the chunk it continues, which docs/metrics.md names as not ordered)
    stack.offloader.engine.close(5.0)
    stack.offloader.engine = CpuCopyEngine(1)
    sub = Subscriber(ev, replay)
    telemetry = Telemetry.start(cfg, stack, mgr)
    while not sub.sub.poll(20):                                # until the subscription is live
        telemetry.publisher.cleared()
    sub.pump()
    parents, first_backup, child_first = set(), [], threading.Event()
    host_stored, batch_set = stack.offloader.events.stored, stack.storage.batch_set

    def spy_host_stored(keys, tokens, parent):                # the scheduler thread: a chunk handed to storage
        parents.add(parent)
        if first_backup and parent in first_backup[0]:
            child_first.set()
        return host_stored(keys, tokens, parent)

    def held_backup(keys, pages):
        if threading.current_thread().name.startswith("prefill-backup") and not first_backup:
            first_backup.append(set(keys))
            if parents & first_backup[0]:
                child_first.set()
            child_first.wait(60)                               # until a chunk continuing it was announced
        return batch_set(keys, pages)

    stack.offloader.events.stored = spy_host_stored
    stack.storage.batch_set = held_backup
    try:
        report = run(cfg, stack, mgr, progress=lambda p: sub.pump(), telemetry=telemetry)
    finally:
        telemetry.close()
    try:
        assert report.ok, report.problems
        assert child_first.is_set()                            # the race happened: child announced first
        sub.receive_until(telemetry.events_stats()["batches"])
        assert late_children(sub.batches) == []
        assert pages_held(sub.batches, DISK) == {int64_id(h) for h in _pages_on_disk(tmp_path / "store")}
        assert pages_held(sub.batches, CPU_PINNED) == set()
    finally:
        sub.close()


ROOT = Path(__file__).resolve().parents[2]


def test_sglangs_subscriber_reads_a_whole_simulate_run_without_an_error_and_parents_come_first(tmp_path, caplog):
    """The done-when of issue 35 for SGLang: ``kv-lifecycle simulate --kv-events`` (the CLI, a whole
    run with prefill backups, evictions and a warm second pass) read by SGLang 0.5.19's own
    ``KVEventsSubscriber`` logs nothing at warning or above; our subscriber (replay filling any gap)
    finds every BlockStored after its parent's and the file tier's pages exactly."""
    caplog.set_level(logging.INFO, logger=sglang_logger.name)
    store, out = tmp_path / "store", tmp_path / "r.json"
    ev, replay = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    theirs = KVEventsSubscriber(ev.replace("127.0.0.1", "localhost"), poll_timeout_ms=20)
    ours = Subscriber(ev, replay)
    theirs.start()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lifecycle_tools", "simulate", "--requests", "48", "--layers", "1", "--heads", "1",
             "--head-dim", "8", "--page-size", "4", "--stride", "8", "--system-prompt", "16", "--prompt-len", "8-64",
             "--output-len", "16-64", "--device-tokens", "8192", "--host-tokens", "2048", "--rows", "12",
             "--capacity-bytes", "40000", "--warm", "--seed", "2", "--retract-frac", "0", "--abort-frac", "0",
             "--verify", "all", "--no-progress",
             "--store", str(store), "--json", str(out), "--kv-events", ev, "--kv-events-replay", replay],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ours.pump_while(lambda: proc.poll() is None)
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
        report = json.loads(out.read_text())
        sent = report["kv_events"]
        ours.receive_until(sent["batches"])
        assert (sent["queued"], sent["dropped"], sent["unsent"]) == (0, 0, 0)
        _wait_for(lambda: sum(len(e.block_hashes) for e, _, _ in theirs.received if isinstance(e, BlockStored))
                  >= sum(len(e[1]) for e in events(ours.batches) if e[0] == "BlockStored" and e is not None)
                  or not theirs._thread.is_alive(), 5)
    finally:
        theirs.stop()
        ours.close()
    assert [r.getMessage() for r in caplog.records if r.name == sglang_logger.name and r.levelno >= logging.WARNING] == []
    assert any(isinstance(e, BlockStored) for e, _, _ in theirs.received)
    # every BlockStored after its parent's; the one exception docs/metrics.md names (the CPU copy
    # engine's two threads can land a chunk a progress call before the chunk it continues: a host
    # chunk before its parent's host chunk) is reported, not failed
    first = {}
    for ev in events(ours.batches):
        if ev[0] == "BlockStored":
            for h in ev[1]:
                first.setdefault(h, ev[6])
    late = late_children(ours.batches)
    assert [e for e in late if not (e[6] == CPU_PINNED and first.get(e[2]) == CPU_PINNED)] == []
    removed = sum(len(e[1]) for e in events(ours.batches) if e[0] == "BlockRemoved" and e[2] == DISK)
    assert removed > 0                                         # the LRU bound evicted: removals came too
    assert pages_held(ours.batches, DISK) == {int64_id(h) for h in _pages_on_disk(store)}
    assert pages_held(ours.batches, CPU_PINNED) == set()


def _wait_for(cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_chunks_that_land_together_are_announced_in_chain_order():
    """A finished request's chunks are enqueued at once and land before the manager polls: they are
    handed to storage, so announced, in the order they were issued (ack ids 63, 64, 65: a set of
    them iterates 64, 65, 63)."""
    import itertools

    from lifecycle import DecodeOffloadManager
    from lifecycle_tools.testkit.doubles import Req

    stack = build_stack(1, 1, 8, torch.float32, PS, 256, 64, 4, 64, storage="memory")
    rec = Recorder()
    stack.offloader.events = HostAnnouncer(rec, PS)
    mgr = DecodeOffloadManager.from_stack(stack, offload_stride=PS)
    mgr._ledger._ack_ids = itertools.count(63)
    try:
        row = stack.req_to_token_pool.alloc()
        req = Req("r", list(range(4)), row, outputs=tuple(range(10, 15)))   # a prompt page, a decode page
        slots = stack.allocator.alloc(16)
        stack.req_to_token_pool.req_to_token[row, :16] = slots.to(torch.int32)
        assert mgr.offload_kv_cache(req)                            # one chunk a decode page
        for step in range(2):
            for t in range(4):
                req.decode(15 + 4 * step + t)
            assert mgr.offload_kv_cache(req)
        assert len(mgr._ledger.ongoing) == 3
        deadline = time.monotonic() + 30
        while not stack.offloader.stats().in_flight_writes == 0 or len(mgr._ledger.landed) < 3:
            mgr._ledger.landed.update(polls(stack.offloader).ended())   # collected, not settled
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert list(mgr._ledger.landed) != sorted(mgr._ledger.landed)            # the old order: the set's
        req.finish()
        mgr.check_offload_progress()                                # settles the three together
        while not mgr.idle() and time.monotonic() < deadline:
            mgr.check_offload_progress()
            time.sleep(0.001)
        chain = hashing.page_hashes([*range(4), *range(10, 22)], PS)
        stored = [e for e in rec.log if e[0] == "stored"]
        assert [(e[2], e[5]) for e in stored] == [([chain[i]], chain[i - 1]) for i in (1, 2, 3)]
    finally:
        mgr.shutdown(force=True)
        stack.close()
