import time

import pytest
import torch

import hashing
from transfer import StorageUnavailable, build_stack, synthetic_kv
from transfer.errors import Closed, UnknownId
from tests.support.transfer_helpers import drain

PS = 4


def store_request(stack, req, tokens, seed=None):
    """Put a request's KV on device and offload its full pages to storage."""
    n = len(tokens) // PS * PS
    slots = stack.allocator.alloc(n)
    stack.kv_pool.write(slots, synthetic_kv(stack.kv_pool, req, torch.arange(n)))
    off = stack.offloader
    h = off.write(slots, req)
    drain(off.finished_writes, 1)
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


def test_page_lost_between_lookup_and_read_shortens_the_load():
    s = build_stack(1, 1, 4, torch.float16, PS, 64, 32, 2, 32)
    tokens = list(range(12))
    store_request(s, 1, tokens)
    free_before = s.allocator.available_size()
    real_get = s.storage.batch_get

    def lose_last(keys, into):
        s.storage.delete(keys[-1])
        return real_get(keys, into)

    s.storage.batch_get = lose_last
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
    real_get = s.storage.batch_get

    def lose_last(keys, into):
        s.storage.delete(keys[-1])
        return real_get(keys, into)

    s.storage.batch_get = lose_last
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
