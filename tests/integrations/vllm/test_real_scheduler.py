"""The connector inside vLLM 0.32.0's real ``Scheduler`` / ``KVCacheManager`` / ``BlockPool``,
loaded by ``kv_connector_module_path``, the worker side in-process over KV tensors from vLLM's own
``allocate_kv_cache`` (``lifecycle_tools.testkit.vllm_engine.VllmRig``).

Promises checked: every block goes back to vLLM's pool exactly once (ref counts never below zero,
every block free at the end, no request left); no forward writes a block a copy still reads, and
vLLM never frees a finished request's block while a copy reads it (``request_finished`` delays the
free, the id comes back in the workers' ``finished_sending``); preempted requests' copies are
fenced before the next forward; every stored page holds exactly the KV the forward wrote, under the
chain name of its tokens; finished requests have every page their forwards wrote stored (the
last ones at finish, on a block boundary too); with TP=2 each rank stores its own heads and a
request is freed once both ranks' copies ended (vLLM's ``KVOutputAggregator``).
"""

from __future__ import annotations

import pytest

from tests.integrations.vllm.vllm_kit import require_vllm

pytestmark = pytest.mark.usefixtures("vllm_required")

BS = 16


@pytest.fixture
def vllm_required():
    require_vllm()


def _rig(tmp_path, **kw):
    from lifecycle_tools.testkit.vllm_engine import VllmRig

    kw.setdefault("extra", {"storage": "memory"})
    return VllmRig(tmp_path, block_size=kw.pop("block_size", BS), **kw)


def _check_stored(rig, rank: int = 0) -> int:
    """Every stored page is a page of some request's tokens and holds the KV written there."""
    names = {}
    for rid in rig.requests:
        for i, name in enumerate(rig.page_names(rid)):
            names.setdefault(name, (rid, i))
    stored = rig.stored_names(rank)
    unknown = stored - names.keys()
    assert not unknown, f"pages stored under names of no request's tokens: {sorted(unknown)[:3]}"
    for name in stored:
        rid, page = names[name]
        assert rig.stored(name, rank) == rig.expected_page(rid, page, rank), (rid, page)
    return len(stored)


def _check_complete(rig, rid: str, rank: int = 0) -> None:
    """A request that finished has every decode page its forwards wrote stored."""
    req, bs = rig.requests[rid], rig.block_size
    written = req.num_tokens - 1
    first = len(req.prompt_token_ids) // bs
    names = rig.page_names(rid)
    missing = [i for i in range(first, written // bs) if rig.stored(names[i], rank) is None]
    assert not missing, f"{rid}: pages {missing} not stored"


def test_a_decode_loop_stores_every_written_page_and_frees_every_block_once(tmp_path):
    rig = _rig(tmp_path, num_blocks=64)
    try:
        specs = {"a": (40, 30), "b": (16, 17), "c": (33, 31), "d": (5, 60)}
        for rid, (n, out) in specs.items():
            rig.add(rid, [7 + (i * 11 + ord(rid)) % 500 for i in range(n)], out)
        rig.run()
        rig.drain_storage()
        rig.check_pool_clean()
        for rid in specs:
            _check_complete(rig, rid)
        assert _check_stored(rig) == rig.connector.store.stats().pages_enqueued > 0
        stats = rig.connector.store.stats()
        assert (stats.released, stats.leaked, stats.tracked) == (4, 0, 0)
    finally:
        rig.close()


def test_finish_on_a_block_boundary_stores_the_last_page_at_finish_and_delays_the_free(tmp_path):
    """prompt 16 + 17 outputs: 33 tokens, 32 with KV: the page [16, 32) is whole only at finish."""
    from lifecycle_tools.testkit.vllm_engine import GatedEngine

    steps = {"n": 0}
    rig = _rig(tmp_path, num_blocks=32, engine=GatedEngine(lambda: steps["n"], hold_steps=2))
    try:
        rig.add("edge", list(range(100, 116)), 17)
        delayed = []
        finished = rig.connector.request_finished

        def spy(request, block_ids):
            out = finished(request, block_ids)
            delayed.append(out[0])
            return out
        rig.connector.request_finished = spy
        rig.run(on_step=lambda r: steps.update(n=r.steps))
        rig.drain_storage()
        rig.check_pool_clean()
        assert delayed == [True]                 # a copy was still reading: vLLM kept the blocks
        names = rig.page_names("edge")
        assert len(names) == 2 and rig.stored(names[1]) == rig.expected_page("edge", 1)
        assert rig.stored(names[0]) is None      # the prompt's page: the prefill side's
        _check_stored(rig)
    finally:
        rig.close()


@pytest.mark.parametrize("layout,kernel", [("LBHNC", None), ("LBNHC", None), ("LBHNC", 16), ("LBNHC", 16)],
                         ids=["cpu-rows", "fa-channels", "cpu-kernel-blocks", "fa-kernel-blocks"])
def test_many_requests_with_aborts_and_preemptions_mid_copy(tmp_path, layout, kernel):
    """A pool too small for the batch (vLLM preempts), copies held on the copy thread for six steps
    (still reading when requests finish or are preempted), aborts mid-decode and while waiting.

    Whether a preempted request still has a copy in flight depends on when the copy threads end
    their copies (delayed frees change which requests vLLM preempts), so a round that happened to
    preempt none mid-copy is followed by another with other output lengths (at most five), until
    one did: every round is checked in full; the fence must have been met in one of them."""
    for attempt in range(5):
        if _preemption_round(tmp_path / f"round{attempt}", layout, kernel, attempt) > 0:
            return
    pytest.fail("no preemption found a copy in flight to fence, in five rounds")


def _preemption_round(tmp_path, layout, kernel, attempt: int) -> int:
    """One round of the scenario above, every invariant asserted; returns the fences rank 0 made."""
    from lifecycle_tools.testkit.vllm_engine import GatedEngine

    tmp_path.mkdir()
    steps = {"n": 0}
    block = 32 if kernel else BS
    rig = _rig(tmp_path, block_size=block, kernel_block=kernel, num_blocks=28 if not kernel else 10,
               layout=layout, max_num_seqs=8, engine=GatedEngine(lambda: steps["n"], hold_steps=6))
    bs = block
    try:
        specs = {f"r{i}": ((i * 7) % 37 + 3 + (bs if i % 3 == 0 else 0), 20 + (i * 13 + 11 * attempt) % 45)
                 for i in range(14)}
        specs["boundary"] = (bs, bs + 1)      # 2*bs tokens with KV at finish: ends on a block boundary
        for rid, (n, out) in specs.items():
            rig.add(rid, [5 + (j * 17 + sum(map(ord, rid))) % 700 for j in range(n)], out)
        aborted = set()

        def on_step(r):
            steps["n"] = r.steps
            if r.steps == 12:
                aborted.update({"r3", "r8"})
                r.abort(["r3", "r8"])          # mid-decode, or still waiting
            if r.steps == 25:
                aborted.add("r11")
                r.abort(["r11"])
        rig.run(on_step=on_step)
        rig.drain_storage()
        rig.check_pool_clean()
        preempted = [rid for rid, r in rig.requests.items() if r.num_preemptions]
        assert preempted, "the pool was meant to force preemptions"
        for rid in specs:
            if rid not in aborted:
                _check_complete(rig, rid)
        assert _check_stored(rig) > 0
        stats = rig.connector.store.stats()
        assert stats.leaked == 0 and stats.tracked == 0 and stats.host_short == 0
        assert rig.connector.store.refused == 0
        return rig.workers[0].worker.fences
    finally:
        rig.close()


def test_tp2_each_rank_stores_its_heads_and_a_request_is_freed_when_both_ranks_copies_ended(tmp_path):
    from lifecycle_tools.testkit.vllm_engine import GatedEngine

    steps = {"n": 0}
    rig = _rig(tmp_path, tp=2, num_blocks=40, engine=GatedEngine(lambda: steps["n"], hold_steps=1))
    try:
        for i in range(5):
            rig.add(f"t{i}", [9 + (j * 5 + i) % 300 for j in range(10 + 9 * i)], 25 + 6 * i)
        rig.run(on_step=lambda r: steps.update(n=r.steps))
        rig.drain_storage()
        rig.check_pool_clean()
        n0, n1 = _check_stored(rig, 0), _check_stored(rig, 1)
        assert n0 == n1 == rig.connector.store.stats().pages_enqueued > 0
        assert rig.stored_names(0) == rig.stored_names(1)
        # rank 0 and rank 1 hold different heads of the same page
        name = sorted(rig.stored_names(0))[0]
        assert rig.stored(name, 0) != rig.stored(name, 1)
        suffixes = {w.worker.storage.suffix for w in rig.workers}
        assert len(suffixes) == 2              # per-rank names, as SGLang's HiCacheFile
    finally:
        rig.close()


def test_a_request_aborted_while_waiting_is_never_delayed_nor_reported(tmp_path):
    rig = _rig(tmp_path, num_blocks=16, max_num_seqs=1)
    try:
        rig.add("runs", list(range(20)), 10)
        rig.add("waits", list(range(30, 50)), 10)
        rig.step()
        rig.abort(["waits"])
        rig.run()
        rig.drain_storage()
        rig.check_pool_clean()
        assert rig.connector.store.stats().leaked == 0
    finally:
        rig.close()


def test_kv_events_name_the_stored_pages(tmp_path):
    """vLLM's scheduler takes the connector's events every step (``update_from_output``)."""
    rig = _rig(tmp_path, num_blocks=32)
    try:
        taken = []
        take = rig.connector.take_events

        def spy():
            out = list(take())
            taken.extend(out)
            return out
        rig.connector.take_events = spy
        rig.add("e", list(range(200, 220)), 30)
        rig.run()
        rig.drain_storage()
        events = taken
        from vllm.distributed.kv_events import BlockStored

        stored = [e for e in events if isinstance(e, BlockStored)]
        names = rig.page_names("e")
        got = [h for e in stored for h in e.block_hashes]
        assert got == [bytes.fromhex(n) for n in names[1:3]]
        assert stored[0].parent_block_hash == bytes.fromhex(names[0])
        assert stored[0].token_ids == list(rig.requests["e"].all_token_ids)[BS:2 * BS]
        assert stored[0].block_size == BS and stored[0].medium == "CPU"
        assert rig.connector.take_events() == []
    finally:
        rig.close()


class _Faulty:
    """Copy engines whose copies of the first chunk hang until ``release`` (or raise): the rig's
    workers get it as ``engine``."""

    def __init__(self, mode: str) -> None:
        import threading

        self.mode, self.release, self.first = mode, threading.Event(), None

    def __call__(self, store_worker):
        from lifecycle.integrations.vllm.worker import LayoutCpuCopyEngine

        fault = self

        class Engine(LayoutCpuCopyEngine):
            def submit(self, tag, fn):
                if fault.first is None:
                    fault.first = tag
                if tag != fault.first:
                    return super().submit(tag, fn)

                def bad():
                    if fault.mode == "raise":
                        raise RuntimeError("copy failed")
                    fault.release.wait(60)
                    return fn()
                return super().submit(tag, bad)

        return Engine(2)


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_a_failed_or_stuck_copy_is_a_miss_never_the_engine(tmp_path, mode):
    """The first copy raises, or hangs past ``write_timeout_s``: its page is never stored, every
    later page is, the request finishes and vLLM gets every block back (a hung copy's blocks after
    ``write_timeout_s``: the one free under a copy the promise allows, its pages discarded)."""
    fault = _Faulty(mode)
    # write_timeout_s 1 s: long beside a one-page CPU copy even on a loaded 2-core machine (a copy that
    # expired by chance would be a second miss), short enough to keep the hung case quick
    rig = _rig(tmp_path, num_blocks=32, engine=fault, extra={"storage": "memory", "write_timeout_s": 1.0})
    try:
        rig.add("f", list(range(300, 320)), 60)
        rig.run(until=lambda r: not r.scheduler.requests)   # every request gone (a stuck copy may remain)
        names = rig.page_names("f")
        assert not rig.scheduler.requests                         # the request ended, its blocks freed
        if mode == "hang":
            assert rig.violations and all("freed under a copy" in v for v in rig.violations)
            rig.violations.clear()
            fault.release.set()                                    # the copy ends at last: discarded
            rig.drain_storage()
            assert rig.stored(names[1]) is None
            assert rig.connector.store.stats().copies_expired == 1
        rig.drain_storage()
        rig.check_pool_clean()
        assert rig.stored(names[1]) is None                       # the first decode page: a miss
        assert all(rig.stored(n) == rig.expected_page("f", i) for i, n in enumerate(names[2:-1], 2))
        stats = rig.connector.store.stats()
        assert stats.leaked == 0 and stats.tracked == 0
    finally:
        fault.release.set()
        rig.close()


def test_metrics_per_rank_on_the_default_registry(tmp_path):
    """``metrics: true``: the scheduler's lifecycle numbers (``role="scheduler"``) and each rank's
    stored pages (``role="worker"``, ``tp_rank``) on prometheus_client's default registry."""
    prometheus_client = pytest.importorskip("prometheus_client")
    rig = _rig(tmp_path, tp=2, num_blocks=32, extra={"storage": "memory", "metrics": True})
    reg = prometheus_client.REGISTRY

    def value(name, **labels):
        return reg.get_sample_value(name, labels) or 0.0
    before = {r: value("kv_lifecycle_storage_pages_total", role="worker", tp_rank=r, tier="memory", result="new")
              for r in ("0", "1")}
    before_off = value("kv_lifecycle_pages_offloaded_total", role="scheduler", tp_rank="-")
    try:
        rig.add("m", list(range(400, 420)), 50)
        rig.run()
        rig.drain_storage()
    finally:
        rig.close()                                       # publishes the last numbers
    pages = rig.connector.store.stats().pages_enqueued
    assert pages > 0
    assert value("kv_lifecycle_pages_offloaded_total", role="scheduler", tp_rank="-") - before_off == pages
    for r in ("0", "1"):
        got = value("kv_lifecycle_storage_pages_total", role="worker", tp_rank=r, tier="memory", result="new")
        assert got - before[r] == pages


def test_a_cache_salt_seeds_the_chain_as_sglang_0_5_23_does(tmp_path):
    import hashing

    rig = _rig(tmp_path, num_blocks=32)
    try:
        rig.add("salted", list(range(600, 620)), 30, cache_salt="tenant-a")
        rig.add("plain", list(range(600, 620)), 30)
        rig.run()
        rig.drain_storage()
        salted, plain = (list(rig.requests[r].all_token_ids) for r in ("salted", "plain"))
        seed = hashing.namespace_seed(None, "tenant-a")
        want = hashing.page_hashes(salted[:48], BS, seed)[1:3]
        assert all(rig.stored(n) is not None for n in want)
        assert set(want).isdisjoint(hashing.page_hashes(plain[:48], BS))   # the same tokens, other names
    finally:
        rig.close()


def test_pages_the_tier_evicts_are_announced_removed(tmp_path):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    page = 2 * BS * 2 * 2 * 32 * 4                          # the rig's page: [2, bs, 2 layers, 2 heads, 32] fp32
    rig = _rig(tmp_path, num_blocks=32, extra={"storage": f"memory?capacity_bytes={2 * page}"})
    taken = []
    take = rig.connector.take_events
    rig.connector.take_events = lambda: (out := list(take()), taken.extend(out))[0]
    try:
        rig.add("ev", list(range(700, 720)), 80)
        rig.run()
        rig.drain_storage()
        stored = [h for e in taken if isinstance(e, BlockStored) for h in e.block_hashes]
        removed = [h for e in taken if isinstance(e, BlockRemoved) for h in e.block_hashes]
        names = [bytes.fromhex(n) for n in rig.page_names("ev")]
        assert stored == names[1:6]                          # five decode pages written
        assert len(removed) == 3 and set(removed) <= set(stored)   # the tier keeps two: three evicted
        assert {e.medium for e in taken if isinstance(e, BlockRemoved)} == {"CPU"}
        assert len(rig.stored_names()) == 2
    finally:
        rig.close()
