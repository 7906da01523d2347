import time

import pytest
import torch

import hashing
from transfer import StorageUnavailable, build_stack
from lifecycle_tools.testkit.kv_pattern import synthetic_kv
from transfer.errors import Closed, UnknownId
from tests.support.transfer_helpers import drain, polls

PS = 4


def store_request(stack, req, tokens, seed=None):
    """Put a request's KV on device and offload its full pages to storage."""
    n = len(tokens) // PS * PS
    slots = stack.allocator.alloc(n)
    stack.kv_pool.write(slots, synthetic_kv(stack.kv_pool, req, torch.arange(n)))
    off = stack.offloader
    h = off.write(slots, req)
    drain(polls(off).ended, 1)
    off.write_storage(h, tokens[:n], hashing.page_hashes(tokens[:n], PS, seed))
    drain(off.finished_storage, 1)
    off.free_host(h)
    return slots


def test_prefix_loaded_bit_exact_into_new_slots(tmp_path):
    s = build_stack(2, 2, 8, torch.bfloat16, PS, 128, 64, 4, 64, storage=f"file:{tmp_path}")
    first = list(range(100, 114))  # 3 full pages + 2 tokens
    src = store_request(s, 1, first)
    second = first[:10] + [7, 7, 7, 7, 7]  # shares 2 full pages
    assert len(s.prefix_loader.lookup(second)) == 2
    assert s.prefix_loader.start(9, second) == 2
    (done,) = drain(s.prefix_loader.finished, 1)
    assert done.load_id == 9 and done.pages == 2 and done.error is None
    assert done.page_hashes == hashing.page_hashes(second, PS)[:2]
    assert torch.equal(s.kv_pool.read(done.device_indices).view(torch.uint8),
                       s.kv_pool.read(src[:8]).view(torch.uint8))
    assert s.host_pool.available_size() == 64
    s.allocator.free(done.device_indices)
    s.allocator.free(src)
    assert s.allocator.available_size() == 128
    s.close()


def test_namespace_seed_separates_chains():
    s = build_stack(1, 1, 4, torch.float16, PS, 64, 32, 2, 32)
    tokens = list(range(8))
    seed = hashing.namespace_seed("lora-a")
    store_request(s, 1, tokens, seed)
    assert s.prefix_loader.start(1, tokens) == 0
    assert s.prefix_loader.start(2, tokens, seed) == 2
    drain(s.prefix_loader.finished, 1)
    s.close()


def test_a_lookup_finds_only_pages_stored_under_its_own_namespace():
    """The same tokens stored under four namespaces (plain, a LoRA adapter, a salt, both): a
    lookup and a load from each namespace's seed find that namespace's pages, never another's."""
    s = build_stack(1, 1, 4, torch.float16, PS, 256, 64, 2, 32)
    tokens = list(range(12))
    spaces = [(None, None), ("lora-1", None), (None, "tenant"), ("lora-1", "tenant")]
    seeds = [hashing.namespace_seed(k, c) for k, c in spaces]
    src = {}                                       # namespace seed -> the device slots its KV came from
    for i, seed in enumerate(seeds[1:]):           # every namespace but the plain one holds pages
        src[seed] = store_request(s, i + 1, tokens, seed)
    assert s.prefix_loader.lookup(tokens) == []    # the plain namespace holds none
    for seed in seeds[1:]:
        assert s.prefix_loader.lookup(tokens, seed) == hashing.page_hashes(tokens, PS, seed)
    src[None] = store_request(s, 9, tokens)
    assert s.prefix_loader.lookup(tokens) == hashing.page_hashes(tokens, PS)
    for i, seed in enumerate(seeds):
        assert s.prefix_loader.start(10 + i, tokens, seed) == 3
        (done,) = drain(s.prefix_loader.finished, 1)
        assert done.page_hashes == hashing.page_hashes(tokens, PS, seed) and done.error is None
        assert torch.equal(s.kv_pool.read(done.device_indices).view(torch.uint8),    # its own KV
                           s.kv_pool.read(src[seed]).view(torch.uint8))
        s.allocator.free(done.device_indices)
    s.close()


def lose_last_page_on_read(s):
    """Make every storage read first delete the batch's last page (lost between lookup and read);
    return the real ``batch_get``."""
    real_get = s.storage.batch_get

    def lose_last(keys, into):
        s.storage.delete(keys[-1])
        return real_get(keys, into)

    s.storage.batch_get = lose_last
    return real_get


def test_page_lost_between_lookup_and_read_shortens_the_load():
    s = build_stack(1, 1, 4, torch.float16, PS, 64, 32, 2, 32)
    tokens = list(range(12))
    store_request(s, 1, tokens)
    free_before = s.allocator.available_size()
    lose_last_page_on_read(s)
    assert s.prefix_loader.start(3, tokens) == 3
    (done,) = drain(s.prefix_loader.finished, 1)
    assert done.pages == 2 and done.error.startswith("1 page") and "could not be read" in done.error
    assert s.allocator.available_size() == free_before - 2 * PS
    s.close()


def test_short_of_memory_allocates_nothing():
    s = build_stack(1, 1, 4, torch.float16, PS, 64, 8, 2, 32)
    tokens = list(range(8))
    store_request(s, 1, tokens)
    s.host_pool.alloc(4)
    before = s.allocator.available_size()
    assert s.prefix_loader.start(1, tokens) is None
    assert s.allocator.available_size() == before
    s.close()


def small_stack():
    return build_stack(1, 1, 4, torch.float16, PS, 64, 32, 2, 32)


def test_a_pending_id_and_a_closed_loader_are_refused_by_name():
    s = small_stack()
    tokens = list(range(8))
    store_request(s, 1, tokens)
    assert s.prefix_loader.start(5, tokens) == 2
    with pytest.raises(UnknownId, match=r"\bload id 5 is already pending\b"):
        s.prefix_loader.start(5, tokens)
    drain(s.prefix_loader.finished, 1)
    s.prefix_loader.close()
    with pytest.raises(Closed, match=r"\bprefix loader is closed\b"):
        s.prefix_loader.start(6, tokens)
    s.close()


def test_a_one_page_prefix_is_loaded_bit_exact():
    s = small_stack()
    tokens = list(range(6))  # one full page
    src = store_request(s, 1, tokens)
    assert s.prefix_loader.start(2, tokens) == 1
    (done,) = drain(s.prefix_loader.finished, 1)
    assert done.pages == 1 and done.error is None and done.device_indices.numel() == PS
    assert torch.equal(s.kv_pool.read(done.device_indices).view(torch.uint8),
                       s.kv_pool.read(src[:PS]).view(torch.uint8))
    s.close()


class Seconds:
    """A metrics observer: ``storage_seconds(op, s)`` calls, in order."""

    def __init__(self):
        self.calls = []

    def storage_seconds(self, op, seconds):
        self.calls.append((op, seconds))


def test_the_read_of_a_load_is_reported_to_the_observer_with_its_duration():
    s = small_stack()
    tokens = list(range(8))
    store_request(s, 1, tokens)
    s.prefix_loader.observer = obs = Seconds()
    before = time.perf_counter()
    assert s.prefix_loader.start(3, tokens) == 2
    drain(s.prefix_loader.finished, 1)
    took = time.perf_counter() - before
    assert [op for op, _ in obs.calls] == ["exists", "get"]
    assert all(0 <= sec <= took for _, sec in obs.calls)  # a duration within the call, not a timestamp
    s.close()


def test_a_load_with_nothing_read_or_a_failed_read_reports_zero_pages_and_frees_every_slot():
    s = small_stack()
    tokens = list(range(8))
    store_request(s, 1, tokens)
    free_before, host_before = s.allocator.available_size(), s.host_pool.available_size()
    real_get = s.storage.batch_get

    def lose_all(keys, into):
        for key in keys:
            s.storage.delete(key)
        return real_get(keys, into)

    s.storage.batch_get = lose_all
    assert s.prefix_loader.start(4, tokens) == 2
    (done,) = drain(s.prefix_loader.finished, 1)
    assert done.pages == 0 and done.device_indices.numel() == 0 and done.page_hashes == []
    assert done.error.startswith("2 pages could not be read")
    store_request(s, 2, tokens)

    def down(keys, into):
        raise StorageUnavailable("tier down for the test")

    s.storage.batch_get = down
    assert s.prefix_loader.start(5, tokens) == 2
    (done,) = drain(s.prefix_loader.finished, 1)
    assert done.pages == 0 and done.device_indices.numel() == 0
    assert "StorageUnavailable" in done.error and "tier down for the test" in done.error
    assert s.allocator.available_size() == free_before - 2 * PS  # only the second request's own slots
    assert s.host_pool.available_size() == host_before
    assert (s.prefix_loader.stats().loads, s.prefix_loader.stats().loads_short) == (2, 2)
    s.close()


def test_loads_pages_and_short_loads_are_counted():
    s = small_stack()
    tokens = list(range(12))
    store_request(s, 1, tokens)
    real_get = lose_last_page_on_read(s)
    assert s.prefix_loader.start(1, tokens) == 3
    (short,) = drain(s.prefix_loader.finished, 1)
    s.storage.batch_get = real_get
    store_request(s, 2, tokens)
    assert s.prefix_loader.start(2, tokens) == 3
    (full,) = drain(s.prefix_loader.finished, 1)
    assert (short.pages, full.pages) == (2, 3)
    st = s.prefix_loader.stats()
    assert (st.loads, st.pages_loaded, st.loads_short) == (2, 5, 1)
    s.close()


def test_lookups_and_the_pages_they_find_are_counted():
    s = small_stack()
    tokens = list(range(12))  # 3 pages stored
    store_request(s, 1, tokens)
    s.prefix_loader.observer = obs = Seconds()
    loader = s.prefix_loader
    assert len(loader.lookup(tokens)) == 3
    assert len(loader.lookup(tokens[:4] + [7] * 8)) == 1  # only the first page is shared
    assert loader.lookup(list(range(500, 508))) == []  # 2 pages, none stored
    assert loader.lookup([1, 2, 3]) == []  # not a full page: the tier is not asked
    assert [op for op, _ in obs.calls] == ["exists"] * 3
    st = loader.stats()
    assert (st.lookups, st.pages_looked_up, st.hits, st.pages_found) == (4, 8, 2, 4)
    s.close()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_a_lookup_deadline_must_be_positive_or_none(bad):
    with pytest.raises(ValueError, match=r"\blookup_timeout_s must be > 0 or None\b"):
        build_stack(1, 1, 4, torch.float16, PS, 64, 32, 2, 32, lookup_timeout_s=bad)
    build_stack(1, 1, 4, torch.float16, PS, 64, 32, 2, 32, lookup_timeout_s=None).close()


def test_a_failing_lookup_opens_the_loaders_breaker_named_after_the_store_with_the_error():
    from structlog.testing import capture_logs
    s = small_stack()
    tokens = list(range(8))
    store_request(s, 1, tokens)

    def down(keys):
        raise StorageUnavailable("disk  gone\n(for the test)")

    s.storage.batch_exists = down
    with capture_logs() as logs:
        assert s.prefix_loader.lookup(tokens) == []
    (ev,) = [e for e in logs if e["event"] == "storage.tier_down"]
    assert ev["tier"] == "MemoryStorage" and ev["error"] == "disk gone (for the test)"
    assert s.prefix_loader.stats().failed == 1 and s.prefix_loader.breaker.name == "MemoryStorage"
    s.close()


def test_lookups_run_on_the_callers_thread_or_the_one_named_lookup_thread_loads_on_the_loader_thread(tmp_path):
    import threading
    where = []
    for timeout, storage in ((0.05, "memory"), (None, f"file:{tmp_path}/a"), (5.0, f"file:{tmp_path}/b")):
        s = build_stack(1, 1, 4, torch.float16, PS, 64, 32, 2, 32, storage=storage, lookup_timeout_s=timeout)
        tokens = list(range(8))
        store_request(s, 1, tokens)
        real_exists, real_get = s.storage.batch_exists, s.storage.batch_get
        s.storage.batch_exists = lambda keys: (where.append(threading.current_thread().name), real_exists(keys))[1]
        s.storage.batch_get = lambda k, i: (where.append(threading.current_thread().name), real_get(k, i))[1]
        assert s.prefix_loader.start(1, tokens) == 2
        drain(s.prefix_loader.finished, 1)
        s.close()
    me = threading.current_thread().name
    # memory, and no deadline: asked directly; a deadline: on the loader's one lookup thread
    assert where == [me, "kv-prefix-load-0", me, "kv-prefix-load-0", "kv-prefix-lookup_0", "kv-prefix-load-0"]


def test_close_reports_whether_every_load_ended_within_its_timeout():
    import threading

    from tests.transfer.test_shutdown import bounded

    s = small_stack()
    tokens = list(range(8))
    store_request(s, 1, tokens)
    gate, inside = threading.Event(), threading.Event()
    real_get = s.storage.batch_get

    def stuck(keys, into):
        inside.set()
        gate.wait(10)
        return real_get(keys, into)

    s.storage.batch_get = stuck
    assert s.prefix_loader.start(1, tokens) == 2
    assert inside.wait(10)
    assert bounded(lambda: s.prefix_loader.close(timeout=0.01)) is False  # the load is left running
    gate.set()
    (done,) = drain(s.prefix_loader.finished, 1)  # still reported once it ends
    assert done.pages == 2 and s.prefix_loader.close(timeout=None) is True
    s.close()


def test_a_loader_with_two_threads_runs_two_loads_at_once():
    import threading

    from transfer.prefix import PrefixLoader

    s = small_stack()
    first, second = list(range(8)), list(range(100, 108))
    store_request(s, 1, first)
    store_request(s, 2, second)
    loader = PrefixLoader(s.kv_pool, s.allocator, s.host_pool, s.storage, threads=2)
    entered = [threading.Event(), threading.Event()]
    real_get = s.storage.batch_get

    def meet(keys, into):  # each load waits until the other one has started: both in flight at once
        mine = 0 if keys[0] == hashing.page_hashes(first, PS)[0] else 1
        entered[mine].set()
        if not entered[1 - mine].wait(5):
            raise AssertionError("the other load did not start while this one ran")
        return real_get(keys, into)

    s.storage.batch_get = meet
    assert loader.start(1, first) == 2 and loader.start(2, second) == 2
    done = drain(loader.finished, 2)
    assert sorted((d.load_id, d.pages, d.error) for d in done) == [(1, 2, None), (2, 2, None)]
    loader.close()
    s.close()
