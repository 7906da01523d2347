"""``kv-lifecycle simulate`` freezes the heap after warm-up, and only for the run."""

import gc

from lifecycle_tools import simulate


def test_the_run_freezes_the_heap_after_building_and_unfreezes_at_the_end():
    cfg = simulate.SimConfig(
        layers=1, heads=1, head_dim=16, dtype="fp16", page_size=4, device_tokens=4096, host_tokens=1024,
        rows=16, requests=12, turns=1, system_prompt=0, prompt_len="4-12", output_len="4-12",
        arrival_rate=0.0, think_steps=0, seed=3, storage="memory", reuse=False, verify="8",
    )
    stack, mgr = simulate.build(cfg, simulate.prepare(cfg))
    frozen_during = []
    progress = mgr.check_offload_progress

    def check_offload_progress():
        frozen_during.append(gc.get_freeze_count())
        return progress()

    mgr.check_offload_progress = check_offload_progress
    before = gc.get_freeze_count()
    report = simulate.run(cfg, stack, mgr, freeze_gc=True)
    assert report.ok, report
    assert frozen_during and min(frozen_during) > before  # the stack, manager, torch: all frozen
    assert gc.get_freeze_count() == before  # the embedding process's heap is its own again


def test_without_freeze_gc_the_heap_is_left_alone():
    cfg = simulate.SimConfig(
        layers=1, heads=1, head_dim=16, dtype="fp16", page_size=4, device_tokens=4096, host_tokens=1024,
        rows=16, requests=6, turns=1, system_prompt=0, prompt_len="4-12", output_len="4-12",
        arrival_rate=0.0, think_steps=0, seed=4, storage="memory", reuse=False, verify="8",
    )
    stack, mgr = simulate.build(cfg, simulate.prepare(cfg))
    before = gc.get_freeze_count()
    seen = []
    progress = mgr.check_offload_progress
    mgr.check_offload_progress = lambda: (seen.append(gc.get_freeze_count()), progress())[1]
    assert simulate.run(cfg, stack, mgr).ok
    assert seen and set(seen) == {before}
