import os

import pytest
import torch

from transfer import FileStorage, MemoryStorage, Offloader, StorageUnavailable, build_stack


def test_memory_stack_shapes():
    s = build_stack(4, 2, 16, torch.bfloat16, 8, 64, 32, 3, 128)
    assert s.kv_pool.buffer.shape == (2, 4, 72, 2, 16)  # +1 padding page
    assert s.allocator.available_size() == 64 and s.host_pool.available_size() == 32
    assert s.req_to_token_pool.req_to_token.shape == (3, 128)
    assert isinstance(s.storage, MemoryStorage) and s.storage.suffix == "_model_0_1"
    assert isinstance(s.offloader, Offloader)
    s.close()


def test_file_stack_mla_suffix(tmp_path):
    s = build_stack(2, 1, 32, torch.float16, 4, 16, 16, 1, 16, storage=f"file:{tmp_path}",
                    mla=True, model_name="deepseek-ai/DeepSeek-V3", tp_rank=1, tp_size=2)
    assert isinstance(s.storage, FileStorage) and s.storage.suffix == "_deepseek-ai-DeepSeek-V3"
    assert s.kv_pool.kinds == 1 and s.host_pool.page_nbytes == 4 * 2 * 32 * 2
    s.close()


def test_bad_storage_spec(tmp_path):
    with pytest.raises(ValueError):
        build_stack(1, 1, 4, torch.float16, 4, 16, 16, 1, 16, storage="redis")
    f = tmp_path / "f"
    f.write_bytes(b"")
    with pytest.raises(StorageUnavailable):
        build_stack(1, 1, 4, torch.float16, 4, 16, 16, 1, 16, storage=f"file:{f}/x")


def test_stack_seals_pages_with_the_page_first_host_layout(tmp_path):
    from transfer.storage.file import XATTR
    from transfer.storage.integrity import decode_seal

    s = build_stack(2, 2, 8, torch.bfloat16, 4, 16, 16, 1, 16, storage=f"file:{tmp_path}",
                    model_name="org/m", tp_rank=1, tp_size=2, attn_cp_rank=1, attn_cp_size=2)
    assert s.storage.suffix == "_org-m_1_2_cp1_2"
    fmt = s.storage.page_format
    assert (fmt.layout, fmt.dtype, fmt.shape) == ("page_first", "bfloat16", (2, 4, 2, 2, 8))
    key = "ab" * 32
    assert s.storage.batch_set([key], [s.host_pool.page_bytes(0)]) == [True]
    sealed = decode_seal(os.getxattr(tmp_path / f"{key}{s.storage.suffix}.bin", XATTR))
    assert sealed.format == fmt
    s.close()
    mla = build_stack(2, 1, 32, torch.float16, 4, 16, 16, 1, 16, mla=True)
    assert mla.storage.page_format.shape == (4, 2, 1, 32)  # SGLang's MLA page_first page
    mla.close()


# -- build_stack passes every option on; close bounds the whole wait --------------------------
import threading  # noqa: E402
import time  # noqa: E402

import hashing  # noqa: E402

from transfer import CpuCopyEngine, PageSizeMismatch  # noqa: E402
from transfer.gather import ChunkCopy  # noqa: E402
from transfer.storage.identity import DeploymentIdentity  # noqa: E402
from tests.support.transfer_helpers import drain, polls  # noqa: E402


def test_the_deployment_identity_carries_every_option():
    s = build_stack(2, 2, 8, torch.bfloat16, 4, 16, 16, 1, 16, model_name="org/m", tp_rank=1, tp_size=2,
                    pp_rank=1, pp_size=3, attn_cp_rank=1, attn_cp_size=2, backend_tag="tenant",
                    host_layout="page_head")
    assert s.identity == DeploymentIdentity(model_name="org/m", backend_tag="tenant", tp_rank=1, tp_size=2,
                                            pp_rank=1, pp_size=3, attn_cp_rank=1, attn_cp_size=2, mla=False,
                                            layout="page_head")
    s.close()


def test_a_ready_storage_is_used_as_it_is_and_found_by_the_prefix_loader():
    store = MemoryStorage("_m_0_1")
    s = build_stack(2, 2, 8, torch.bfloat16, 4, 16, 16, 1, 16, storage=store, lookup_timeout_s=0.2)
    assert s.storage is store and s.offloader.storage is store and s.prefix_loader.storage is store
    assert s.prefix_loader.lookup_timeout_s == 0.2
    tokens = list(range(1, 9))
    keys = hashing.page_hashes(tokens, 4)
    assert store.batch_set(keys, [s.host_pool.page_bytes(0), s.host_pool.page_bytes(1)]) == [True, True]
    assert s.prefix_loader.lookup(tokens) == keys
    s.close()


def test_default_lookup_deadline_is_50_ms():
    s = build_stack(2, 2, 8, torch.bfloat16, 4, 16, 16, 1, 16)
    assert s.prefix_loader.lookup_timeout_s == 0.05
    s.close()
    s = build_stack(2, 2, 8, torch.bfloat16, 4, 16, 16, 1, 16, lookup_timeout_s=None)
    assert s.prefix_loader.lookup_timeout_s is None
    s.close()


def test_a_built_tier_gets_the_page_size_capacity_and_expiry():
    s = build_stack(2, 2, 8, torch.bfloat16, 4, 16, 16, 1, 16)
    with pytest.raises(PageSizeMismatch):   # the tier knows the page size
        s.storage.batch_set(["ab" * 32], [torch.zeros(8, dtype=torch.uint8)])
    s.close()
    nb = s.host_pool.page_nbytes
    s = build_stack(2, 2, 8, torch.bfloat16, 4, 16, 16, 1, 16, storage_capacity_bytes=2 * nb)
    keys = hashing.page_hashes(list(range(12)), 4)
    assert s.storage.batch_set(keys, [s.host_pool.page_bytes(i) for i in range(3)]) == [True] * 3
    assert s.storage.batch_exists(keys[1:]) == 2 and s.storage.batch_exists(keys[:1]) == 0  # LRU bound
    s.close()
    with pytest.raises(ValueError):   # a bad expiry is refused even by a tier that does not use it
        build_stack(2, 2, 8, torch.bfloat16, 4, 16, 16, 1, 16, storage_ttl_s=-1)


@pytest.mark.parametrize("strict", [None, False, True])
def test_strict_mode_is_off_by_default_and_passed_to_the_tier(tmp_path, strict):
    opts = {} if strict is None else {"storage_require_checksum": strict}
    s = build_stack(2, 2, 8, torch.bfloat16, 4, 16, 16, 1, 16, storage=f"file:{tmp_path}", **opts)
    key = "cd" * 32
    page = s.host_pool.page_bytes(0)
    path = tmp_path / f"{key}{s.storage.suffix}.bin"
    path.write_bytes(bytes(page.numpy()))            # a page without a seal (as HiCacheFile writes)
    out = torch.empty(s.host_pool.page_nbytes, dtype=torch.uint8)
    assert s.storage.batch_get([key], [out]) == [not strict]
    s.close()


def test_kv_events_announce_host_and_tier_pages():
    class Pub:
        def __init__(self):
            self.seen = []

        def stored(self, medium, hashes, tokens, block_size, parent):
            self.seen.append((medium, list(hashes), list(tokens), parent))

        def removed(self, medium, hashes):
            self.seen.append((medium, "removed", list(hashes)))

    pub = Pub()
    s = build_stack(2, 2, 8, torch.bfloat16, 4, 16, 16, 1, 16, kv_events=pub)
    off = s.offloader
    slots = s.allocator.alloc(4)
    h = off.write(slots, 1)
    assert drain(polls(off).ended, 1) == [1]
    tokens = [5, 6, 7, 8]
    keys = hashing.page_hashes(tokens, 4)
    op = off.write_storage(h, tokens, keys)
    assert drain(off.finished_storage, 1) == [op]
    off.free_host(h)
    assert pub.seen == [("CPU_PINNED", keys, tokens, None), ("EXTERNAL", keys, tokens, None),
                        ("CPU_PINNED", "removed", keys)]
    s.close()


class Tier(MemoryStorage):
    """A memory tier whose reads can be held (a stuck prefix load) and whose ``close`` reports
    ``abandon`` as page writes still running, recording the timeout it was given."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate, self.hold_reads, self.abandon, self.close_timeouts = threading.Event(), False, [], []

    def batch_get(self, keys, into):
        if self.hold_reads and not self.gate.wait(10):
            raise TimeoutError("test gate never opened")
        return super().batch_get(keys, into)

    def close(self, timeout=None):
        self.close_timeouts.append(timeout)
        super().close(timeout)
        return list(self.abandon)


class Stuck(CpuCopyEngine):
    def __init__(self):
        super().__init__(1)
        self.gate, self.started = threading.Event(), set()

    def to_host(self, tag, kv, host, slots, host_pages):
        plan = ChunkCopy(kv, host, slots, host_pages)

        def job():
            self.started.add(tag)
            self.gate.wait(10)
            return plan.to_host()

        self.submit(tag, job)


def stack_on(tier):
    return build_stack(2, 2, 8, torch.bfloat16, 4, 32, 32, 1, 32, storage=tier)


def test_close_without_a_bound_waits_for_everything_and_is_clean():
    tier = Tier("_m_0_1")
    s = stack_on(tier)
    report = s.close(timeout=None)
    assert report.clean and report.timeout is None and report.reason == "" and report.abandoned_pages == []
    assert tier.close_timeouts == [None]
    with pytest.raises(ValueError):
        stack_on(Tier("_m_0_1")).close(timeout="1")


def test_the_tier_gets_what_is_left_of_the_timeout_and_its_abandoned_pages_are_reported():
    tier = Tier("_m_0_1")
    tier.abandon = ["pg_b", "pg_a"]
    s = stack_on(tier)
    t0 = time.monotonic()
    report = s.close(timeout=5.0)
    took = time.monotonic() - t0
    (left,) = tier.close_timeouts
    assert 5.0 - took <= left <= 5.0
    assert report.clean is False and report.abandoned_pages == ["pg_a", "pg_b"]
    assert report.reason == ("2 storage page writes still running after 5.0s (a hung storage call "
                             "cannot be cancelled; those pages may still appear)")


def test_close_with_stuck_copy_load_and_tier_returns_at_its_timeout_naming_all_three():
    tier = Tier("_m_0_1")
    tier.abandon = ["pg"]
    s = stack_on(tier)
    eng = Stuck()
    s.offloader.engine.close()
    s.offloader.engine = eng
    # a stored prefix whose load is held in the tier's read
    tokens = list(range(1, 5))
    keys = hashing.page_hashes(tokens, 4)
    assert tier.batch_set(keys, [s.host_pool.page_bytes(0)]) == [True]
    tier.hold_reads = True
    assert s.prefix_loader.start(9, tokens) == 1
    slots = s.allocator.alloc(4)
    s.offloader.write(slots, 7)
    drain(lambda: [1] if 7 in eng.started else [], 1)
    done = []
    t = threading.Thread(target=lambda: done.append(s.close(timeout=0.05)), daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(5)
    took = time.monotonic() - t0
    tier.gate.set()
    eng.gate.set()
    assert done, "close did not return"
    report = done[0]
    assert took < 0.9                       # 0.05 s in all, not a floor per stage
    assert tier.close_timeouts[0] <= 0.05
    assert report.clean is False and report.abandoned_writes == [7] and report.abandoned_pages == ["pg"]
    prefix = "prefix loads still running after 0.05s (their device slots and host pages stay held)"
    tier_pages = ("1 storage page writes still running after 0.05s (a hung storage call cannot be "
                  "cancelled; those pages may still appear)")
    assert report.reason.startswith("close timed out after 0.05s: 1 device->host copies")
    assert report.reason.endswith(f"returned to the pool; {prefix}; {tier_pages}")
    assert drain(polls(s.offloader).ended, 1) == [7]


def test_the_device_pools_are_built_on_the_requested_device():
    from transfer import DeviceMismatch

    # a device no copy engine serves: the pool really is there, so the offloader refuses it
    with pytest.raises(DeviceMismatch, match="meta"):
        build_stack(2, 2, 8, torch.bfloat16, 4, 16, 16, 1, 16, device="meta")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stack_puts_the_kv_and_req_to_token_pools_on_the_gpu():
    s = build_stack(2, 2, 8, torch.bfloat16, 4, 16, 16, 1, 16, device="cuda")
    assert s.kv_pool.buffer.is_cuda and s.req_to_token_pool.req_to_token.is_cuda
    assert not s.host_pool.buffer.is_cuda
    s.close()


def test_a_stuck_prefix_load_alone_makes_the_close_unclean():
    tier = Tier("_m_0_1")
    s = stack_on(tier)
    tokens = list(range(1, 5))
    keys = hashing.page_hashes(tokens, 4)
    assert tier.batch_set(keys, [s.host_pool.page_bytes(0)]) == [True]
    tier.hold_reads = True
    assert s.prefix_loader.start(9, tokens) == 1
    try:
        report = s.close(timeout=0.05)
    finally:
        tier.gate.set()
    assert report.clean is False and report.abandoned_writes == [] and report.abandoned_pages == []
    assert report.reason == "prefix loads still running after 0.05s (their device slots and host pages stay held)"
