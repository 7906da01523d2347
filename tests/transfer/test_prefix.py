import torch

import hashing
from transfer import build_stack, synthetic_kv
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
    assert done.pages == 2 and done.error
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
