"""Loading stored prefixes into vLLM blocks: the scheduler side (``lookup.LoadPlanner``) and the
worker side (``load.LoadWorker``), without vLLM (its real ``Scheduler`` drives them in
``test_load_scheduler.py``).

Promises (docs/integration.md, "Loading prefixes"): a lookup never blocks the scheduler thread
(``None`` while pending, then the answer; a hung, failing or overloaded tier is a miss); the answer
is whole pages beyond vLLM's local hit, never the last token, named by our chain (an SGLang node's
names); asking again plans nothing; ``after_alloc`` plans the load into the blocks vLLM allocated
after the local hit; the worker writes the pages bit-exact into vLLM's per-layer views; every page it
cannot serve (missing, corrupt, tier down, timed out) is a block in ``load_error_block_ids`` and the
request is still reported in ``finished_recving``; a read that returns after its job timed out never
writes.
"""

from __future__ import annotations

import pickle
import threading
from types import SimpleNamespace

import msgspec
import pytest
import torch

import hashing
from lifecycle.errors import ConfigError, InvalidRequest
from lifecycle.integrations.vllm.layout import VllmKVLayout
from lifecycle.integrations.vllm.load import LoadJob, LoadWorker
from lifecycle.integrations.vllm.lookup import LoadPlanner, request_namespace
from lifecycle_tools.testkit.vllm_kv import make_kv_caches, read_kv, write_kv
from transfer.errors import StorageUnavailable
from transfer.stack import page_format
from transfer.storage.file import FileStorage
from transfer.storage.memory import MemoryStorage
from transfer.storage.spec import open_storage

BS, LAYERS, HEADS, DIM = 4, 3, 2, 8
SUFFIX = "_org-M_0_1"
DEADLINE_S = 60.0  # generous: only ever reached when something is broken


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def vllm_request(req_id, tokens, **fields):
    """The fields of vLLM's ``Request`` the planner reads (the real one: test_load_scheduler.py)."""
    return SimpleNamespace(request_id=req_id, all_token_ids=list(tokens), num_tokens=len(tokens),
                           cache_salt=fields.get("cache_salt"), lora_request=fields.get("lora_request"),
                           mm_features=fields.get("mm_features", []))


def blocks_of(ids):
    """vLLM's ``KVCacheBlocks`` as the planner reads it (one group)."""
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def caches(split="rows", blocks=16, dtype=torch.bfloat16):
    return make_kv_caches(split, LAYERS, blocks, HEADS, BS, DIM, dtype)


def random_kv(blocks, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((2, LAYERS, blocks * BS, HEADS, DIM), generator=gen).to(dtype)


def slots(block_ids):
    return (torch.tensor(block_ids).view(-1, 1) * BS + torch.arange(BS)).reshape(-1)


def stored_prefix(store, layout, tokens, kv_blocks, seed=None):
    """Store the pages of ``tokens`` (KV taken from ``kv_blocks`` of ``layout``) under our chain."""
    names = hashing.page_hashes(tokens, BS, seed)
    pages = layout.page_bytes_of(kv_blocks[:len(names)])
    assert all(store.batch_set(names, [p.reshape(-1).view(torch.uint8) for p in pages]))
    return names


def answer(planner, req, computed=0):
    """Ask until answered (the lookup runs on a helper thread), with a long deadline."""
    done = threading.Event()
    for _ in range(int(DEADLINE_S / 0.01)):
        got = planner.matched_tokens(req, computed)
        if got[0] is not None:
            return got
        done.wait(0.01)
    raise AssertionError("the lookup never answered")


class Gate:
    """A tier whose calls block until opened (a hung tier), then go to ``inner``."""

    def __init__(self, inner, *, exists=True, get=True) -> None:
        self.inner, self.suffix, self.page_nbytes = inner, inner.suffix, inner.page_nbytes
        self.page_format = inner.page_format
        self.opened, self.entered = threading.Event(), threading.Event()
        self._exists, self._get = exists, get

    def batch_exists(self, keys):
        if self._exists:
            self.entered.set()
            assert self.opened.wait(DEADLINE_S)
        return self.inner.batch_exists(keys)

    def batch_get(self, keys, into):
        if self._get:
            self.entered.set()
            assert self.opened.wait(DEADLINE_S)
        return self.inner.batch_get(keys, into)


class Down:
    """A tier that is down: every call raises as ``RedisStorage`` does when it cannot connect."""

    suffix, page_format = SUFFIX, None

    def __init__(self, page_nbytes) -> None:
        self.page_nbytes, self.calls = page_nbytes, 0

    def batch_exists(self, keys):
        self.calls += 1
        raise StorageUnavailable("connection refused")

    def batch_get(self, keys, into):
        self.calls += 1
        raise StorageUnavailable("connection refused")


@pytest.fixture
def src():
    """vLLM blocks holding known KV (the node that computed the prefix)."""
    kv = random_kv(16, seed=1)
    c = caches()
    write_kv(c, "rows", kv)
    return SimpleNamespace(kv=kv, layout=VllmKVLayout.from_kv_caches(c, BS))


@pytest.fixture
def store(tmp_path, src):
    host = src.layout.host_pool(BS, pin=False)
    s = FileStorage(tmp_path / "store", SUFFIX, src.layout.page_nbytes, page_format=page_format(host))
    yield s
    s.close()


# -- the scheduler side ----------------------------------------------------------------------------

def test_lookup_is_pending_then_answers_whole_pages_beyond_the_local_hit_never_the_last_token(store, src):
    tokens = list(range(1, 27))                       # 6 whole pages and 2 tokens
    stored_prefix(store, src.layout, tokens, list(range(16)))
    planner = LoadPlanner(Gate(store), BS)
    try:
        req = vllm_request("a", tokens)
        assert planner.matched_tokens(req, 0) == (None, False)    # pending: vLLM asks again later
        planner.storage.opened.set()
        assert answer(planner, req) == (24, True)                 # 6 pages, all loadable
        assert planner.matched_tokens(req, 8) == (16, True)       # beyond a local hit of 2 pages
        assert planner.take_load_jobs() == []                     # asking planned nothing
        # exactly a whole number of pages: the last page holds the last token, never loaded
        exact = vllm_request("b", tokens[:24])
        assert answer(planner, exact) == (20, True)
        assert planner.matched_tokens(vllm_request("c", tokens[:4]), 0) == (0, False)   # nothing to load
        assert planner.matched_tokens(req, 6) == (0, False)       # a local hit not on a page boundary
        assert planner.matched_tokens(req, 24) == (0, False)      # the local hit covers every stored page
    finally:
        planner.close()


def test_the_lookup_names_pages_as_an_sglang_node_does_namespace_included(store, src):
    tokens = list(range(50, 63))
    salt = "tenant-7"
    seed = hashing.namespace_seed(None, salt)                    # SGLang's storage_namespace_seed(None, salt)
    stored_prefix(store, src.layout, tokens, list(range(16)), seed=seed)
    planner = LoadPlanner(store, BS)
    try:
        assert answer(planner, vllm_request("plain", tokens)) == (0, False)          # another namespace
        assert answer(planner, vllm_request("salted", tokens, cache_salt=salt)) == (12, True)
        planner.after_alloc(vllm_request("salted", tokens, cache_salt=salt), blocks_of([9, 3, 5, 7]), 12)
        (job,) = planner.take_load_jobs()
        assert job.page_hashes == hashing.page_hashes(tokens, BS, seed)
        # LoRA and multimodal requests are not named: a miss, never an error into vLLM
        assert planner.matched_tokens(vllm_request("lora", tokens, lora_request=object()), 0) == (0, False)
        assert planner.matched_tokens(vllm_request("mm", tokens, mm_features=[object()]), 0) == (0, False)
    finally:
        planner.close()
    with pytest.raises(InvalidRequest, match="LoRA"):
        request_namespace(vllm_request("lora", tokens, lora_request=object()))
    with pytest.raises(InvalidRequest, match="another namespace"):
        request_namespace(vllm_request("x", tokens, cache_salt="other"), seed)


def test_after_alloc_plans_the_pages_into_the_blocks_vllm_allocated_after_the_local_hit(store, src):
    tokens = list(range(1, 27))
    names = stored_prefix(store, src.layout, tokens, list(range(16)))
    planner = LoadPlanner(store, BS)
    try:
        req = vllm_request("a", tokens)
        answer(planner, req, 8)
        assert planner.matched_tokens(req, 8) == (16, True)
        planner.after_alloc(req, blocks_of([11, 12, 2, 9, 4, 6, 8]), 16)   # 2 local + 4 loaded + 1 new
        (job,) = planner.take_load_jobs()
        assert job == LoadJob("a", names[2:6], [2, 9, 4, 6])
        assert pickle.loads(pickle.dumps(job)) == job and msgspec.msgpack.decode(
            msgspec.msgpack.encode(job), type=LoadJob) == job
        assert planner.loading("a") and planner.request_finished("a")   # blocks held while it loads
        planner.on_finished_recving({"a"})
        assert not planner.loading("a") and not planner.request_finished("a")
        # decided on num_external_tokens, not on blocks: 0 plans nothing whatever the blocks
        other = vllm_request("b", tokens)
        answer(planner, other)
        planner.after_alloc(other, blocks_of([1, 2, 3]), 0)
        assert planner.take_load_jobs() == [] and not planner.loading("b")
        # a count this planner never answered is refused and changes nothing
        third = vllm_request("c", tokens)
        answer(planner, third)
        with pytest.raises(InvalidRequest, match="never answered"):
            planner.after_alloc(third, blocks_of(range(7)), 28)
        assert planner.take_load_jobs() == []
        planner.after_alloc(third, blocks_of(range(7)), 24)
        assert len(planner.take_load_jobs()) == 1
    finally:
        planner.close()


def test_synchronous_loads_are_answered_as_such_and_never_wait_for_finished_recving(store, src):
    tokens = list(range(1, 27))
    names = stored_prefix(store, src.layout, tokens, list(range(16)))
    planner = LoadPlanner(store, BS, load_async=False)
    try:
        req = vllm_request("s", tokens)
        assert answer(planner, req) == (24, False)           # vLLM loads it before this step's forward
        planner.after_alloc(req, blocks_of(range(10, 17)), 24)
        assert planner.take_load_jobs() == [LoadJob("s", names[:6], list(range(10, 16)), sync=True)]
        assert not planner.loading("s") and not planner.request_finished("s")
    finally:
        planner.close()


def test_a_hung_tier_never_blocks_the_scheduler_and_a_late_lookup_is_a_miss(store, src):
    tokens = list(range(1, 27))
    stored_prefix(store, src.layout, tokens, list(range(16)))
    gate, clock = Gate(store), Clock()
    planner = LoadPlanner(gate, BS, lookup_timeout_s=5.0, clock=clock)
    try:
        req = vllm_request("a", tokens)
        for _ in range(3):                              # the tier is hung: every ask returns at once
            assert planner.matched_tokens(req, 0) == (None, False)
        assert gate.entered.wait(DEADLINE_S)            # the lookup is inside the tier, on its own thread
        clock.now = 5.0
        assert planner.matched_tokens(req, 0) == (0, False)   # past its deadline: a miss
        assert planner.stats().timed_out == 1
        gate.opened.set()
    finally:
        planner.close()


def test_a_tier_that_is_down_is_a_miss_and_the_breaker_stops_asking(src):
    down = Down(src.layout.page_nbytes)
    planner = LoadPlanner(down, BS)
    try:
        assert answer(planner, vllm_request("a", range(1, 27))) == (0, False)
        assert planner.stats().failed == 1 and planner.breaker.state.value == "open"
        calls = down.calls
        assert planner.matched_tokens(vllm_request("b", range(1, 27)), 0) == (0, False)   # not asked
        assert down.calls == calls and planner.stats().skipped == 1
    finally:
        planner.close()


def test_lookups_are_bounded_an_ask_beyond_the_bound_is_a_miss(store, src):
    gate = Gate(store)
    planner = LoadPlanner(gate, BS, threads=1, max_pending=2)
    try:
        assert planner.matched_tokens(vllm_request("a", range(1, 27)), 0) == (None, False)
        assert planner.matched_tokens(vllm_request("b", range(2, 28)), 0) == (None, False)
        assert planner.pending() == 2
        assert planner.matched_tokens(vllm_request("c", range(3, 29)), 0) == (0, False)   # full: a miss
        gate.opened.set()
        assert answer(planner, vllm_request("a", range(1, 27))) == (0, False)
    finally:
        planner.close()


def test_bad_planner_settings_are_refused_in_one_typed_line(store):
    for kwargs in ({"block_size": 0}, {"threads": 0}, {"max_pending": True}, {"lookup_timeout_s": 0},
                   {"namespace_seed": "xyz"}):
        args = {"block_size": BS, **kwargs}
        with pytest.raises(ConfigError) as err:
            LoadPlanner(store, args.pop("block_size"), **args)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="batch_exists"):
        LoadPlanner(object(), BS)


# -- the worker side -------------------------------------------------------------------------------

@pytest.mark.parametrize("split,tier", [("rows", "file"), ("channels", "file"), ("rows", "redis")])
def test_the_worker_loads_stored_pages_bit_exact_into_the_blocks(tmp_path, request, split, tier):
    kv = random_kv(16, seed=2)
    src = caches(split)
    write_kv(src, split, kv)
    layout = VllmKVLayout.from_kv_caches(src, BS)
    host = layout.host_pool(BS, pin=False)
    spec = f"file:{tmp_path / 's'}" if tier == "file" else request.getfixturevalue("redis_url")
    store = open_storage(spec, SUFFIX, layout.page_nbytes, page_format=page_format(host))
    tokens = list(range(7, 7 + 10 * BS))
    names = stored_prefix(store, layout, tokens, [3, 1, 4, 15, 9, 2, 6, 5, 8, 7])
    dst = caches(split)
    worker = LoadWorker(VllmKVLayout.from_kv_caches(dst, BS), store, threads=2, chunk_pages=3)
    planner = LoadPlanner(store, BS)
    try:
        assert answer(planner, vllm_request("q", tokens + [1])) == (10 * BS, True)   # the lookup on this tier
        worker.start([LoadJob("a", names[:6], [10, 11, 0, 12, 13, 14]), LoadJob("b", names[6:], [1, 2, 3, 4])])
        done = set()
        for _ in range(int(DEADLINE_S / 0.01)):
            done |= worker.finished_recving()
            if done == {"a", "b"}:
                break
            threading.Event().wait(0.01)
        assert done == {"a", "b"} and worker.load_error_block_ids() == set()
        got = read_kv(dst, split, DIM)
        want = kv[:, :, slots([3, 1, 4, 15, 9, 2, 6, 5, 8, 7])]
        assert torch.equal(got[:, :, slots([10, 11, 0, 12, 13, 14, 1, 2, 3, 4])].view(torch.int16),
                           want.view(torch.int16))
        assert not got[:, :, slots([5, 6, 7, 8, 9, 15])].view(torch.int16).any()   # nothing else written
        assert worker.stats().pages_loaded == 10 and worker.idle()
    finally:
        planner.close()
        assert worker.close(DEADLINE_S)
        store.close()


def _drain(worker, want):
    done, errors = set(), set()
    for _ in range(int(DEADLINE_S / 0.01)):
        done |= worker.finished_recving()
        errors |= worker.load_error_block_ids()
        if want <= done:
            return done, errors
        threading.Event().wait(0.01)
    raise AssertionError(f"jobs never ended: {want - done}")


def test_pages_that_cannot_be_served_are_load_errors_and_the_request_still_finishes(tmp_path, store, src):
    tokens = list(range(1, 1 + 8 * BS))
    names = stored_prefix(store, src.layout, tokens, list(range(8)))
    store.delete(names[5])                                           # evicted since the lookup
    path = next((tmp_path / "store").glob(f"{names[2]}*.bin"))       # a bit flipped on disk
    data = bytearray(path.read_bytes())
    data[7] ^= 0x10
    path.write_bytes(bytes(data))
    dst = caches()
    worker = LoadWorker(VllmKVLayout.from_kv_caches(dst, BS), store, chunk_pages=2)
    try:
        worker.start([LoadJob("missing", names[4:8], [10, 11, 12, 13]),
                      LoadJob("corrupt", names[0:4], [1, 2, 3, 4])])
        done, errors = _drain(worker, {"missing", "corrupt"})
        # from the first page it could not serve on: vLLM recomputes those blocks
        assert errors == {11, 12, 13} | {3, 4}
        got = read_kv(dst, "rows", DIM)
        assert torch.equal(got[:, :, slots([10, 1, 2])].view(torch.int16), src.kv[:, :, slots([4, 0, 1])].view(torch.int16))
        assert not got[:, :, slots([3, 11])].view(torch.int16).any()   # a refused page never lands
        assert worker.stats().jobs_short == 2
    finally:
        assert worker.close(DEADLINE_S)


def test_a_tier_that_is_down_fails_the_whole_load_never_the_caller(src):
    dst = caches()
    worker = LoadWorker(VllmKVLayout.from_kv_caches(dst, BS), Down(src.layout.page_nbytes))
    names = hashing.page_hashes(range(1, 13), BS)
    try:
        worker.start([LoadJob("a", names, [5, 6, 7])])
        done, errors = _drain(worker, {"a"})
        assert errors == {5, 6, 7} and worker.stats().tier_errors == 1
    finally:
        assert worker.close(DEADLINE_S)


def test_a_load_past_its_deadline_fails_and_its_late_read_never_writes_the_blocks(store, src):
    tokens = list(range(1, 1 + 3 * BS))
    names = stored_prefix(store, src.layout, tokens, [0, 1, 2])
    gate, clock = Gate(store, exists=False), Clock()
    dst = caches()
    worker = LoadWorker(VllmKVLayout.from_kv_caches(dst, BS), gate, load_timeout_s=10.0, clock=clock)
    try:
        worker.start([LoadJob("a", names, [4, 5, 6])])
        assert gate.entered.wait(DEADLINE_S)
        assert worker.finished_recving() == set()                     # still within its deadline
        clock.now = 10.0
        assert worker.finished_recving() == {"a"}                     # reported once, failed
        assert worker.load_error_block_ids() == {4, 5, 6}
        gate.opened.set()                                             # the hung read returns late
        assert worker.close(DEADLINE_S)                               # ... and its thread ends
        assert worker.finished_recving() == set() and worker.load_error_block_ids() == set()
        assert not read_kv(dst, "rows", DIM).view(torch.int16).any()  # vLLM recomputes them: untouched
        assert worker.stats().timed_out == 1
    finally:
        gate.opened.set()
        worker.close(DEADLINE_S)


def test_a_synchronous_load_is_waited_for_before_the_forward_and_never_in_finished_recving(store, src):
    tokens = list(range(1, 1 + 2 * BS))
    names = stored_prefix(store, src.layout, tokens, [0, 1])
    gate = Gate(store, exists=False)
    dst = caches()
    worker = LoadWorker(VllmKVLayout.from_kv_caches(dst, BS), gate)
    try:
        worker.start([LoadJob("s", names, [8, 9], sync=True)])
        waited = threading.Thread(target=worker.wait, args=("model.layers.0.self_attn.attn",))
        waited.start()
        assert gate.entered.wait(DEADLINE_S)
        assert waited.is_alive()                                      # the forward waits for the load
        gate.opened.set()
        waited.join(DEADLINE_S)
        assert not waited.is_alive()
        assert torch.equal(read_kv(dst, "rows", DIM)[:, :, slots([8, 9])].view(torch.int16),
                           src.kv[:, :, slots([0, 1])].view(torch.int16))
        worker.wait("model.layers.1.self_attn.attn")                  # later layers: already loaded
        assert worker.finished_recving() == set() and worker.load_error_block_ids() == set()
    finally:
        gate.opened.set()
        assert worker.close(DEADLINE_S)


def test_a_malformed_job_is_a_load_error_not_an_exception(store, src):
    worker = LoadWorker(VllmKVLayout.from_kv_caches(caches(), BS), store)
    names = hashing.page_hashes(range(1, 9), BS)
    try:
        worker.start([LoadJob("a", names, [1]), LoadJob("b", names, [2, 99])])
        assert worker.finished_recving() == {"a", "b"}
        assert worker.load_error_block_ids() == {1, 2}                # 99 is no block of this cache
    finally:
        assert worker.close(DEADLINE_S)


def test_bad_worker_settings_are_refused_in_one_typed_line(store, src):
    layout = VllmKVLayout.from_kv_caches(caches(), BS)
    for kwargs in ({"threads": 0}, {"chunk_pages": 1.5}, {"load_timeout_s": -1}):
        with pytest.raises(ConfigError) as err:
            LoadWorker(layout, store, **kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="bytes"):
        LoadWorker(layout, MemoryStorage(SUFFIX, layout.page_nbytes * 2))
